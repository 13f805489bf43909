"""The KV-cache decoder against the training forward: Transformer.logits on the simulator in fp32 gives
the logits at every position of a full window; the decoder must give the same ones, whether the
window comes as one prompt (prefill) or as a one-token prompt and then a token at a time (decode)."""

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.model.config import ModelConfig, init_params
from anectypes.model.decoder import Decoder
from anectypes.model.transformer import Transformer

CONFIGS = {
    "mha": ModelConfig(dim=48, hidden=96, heads=4, kv_heads=4, head_dim=12, layers=2, seq=16, vocab=64),
    # GQA (3 query heads per kv head), head_dim != dim / heads
    "gqa": ModelConfig(dim=40, hidden=72, heads=6, kv_heads=2, head_dim=8, layers=3, seq=16, vocab=64),
}


def spread(params, rng):
    """Norm weights away from 1 and larger weights, so that every part of the math shows in the logits."""
    for name, p in params.items():
        p *= np.float32(3.0) if p.ndim == 2 else 1
        if p.ndim == 1:
            p[...] = rng.uniform(0.5, 1.5, p.shape)
    return params


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def model(request):
    cfg = CONFIGS[request.param]
    rng = np.random.default_rng(1)
    params = spread(init_params(cfg, rng), rng)
    active = np.sort(rng.choice(cfg.vocab, 48, replace=False))     # a compact vocabulary, as a run has
    tokens = active[rng.integers(0, len(active), cfg.seq)]
    with Transformer(cfg, open_device("sim", precision="fp32"), {k: v.copy() for k, v in params.items()}, active) as t:
        expected = t.logits(tokens).T                                 # [S, active]
    return cfg, params, active, tokens, expected


def close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_prompt_of_seq_tokens(model):
    cfg, params, active, tokens, expected = model
    dec = Decoder(cfg, params, vocab_ids=active)
    close(dec.forward(tokens, all_logits=True), expected)
    assert dec.pos == cfg.seq


@pytest.mark.parametrize("prompt", [1, 5])
def test_prompt_then_one_token_at_a_time(model, prompt):
    cfg, params, active, tokens, expected = model
    dec = Decoder(cfg, params, vocab_ids=active)
    for _ in range(2):                                     # a second session over the first one's cache
        dec.reset()
        got = [dec.forward(tokens[:prompt], all_logits=True)]
        got += [dec.forward(tokens[p:p + 1]).copy()[None] for p in range(prompt, cfg.seq)]
        close(np.concatenate(got), expected)


def test_the_last_logits_are_those_of_all_logits(model):
    cfg, params, active, tokens, expected = model
    dec = Decoder(cfg, params, vocab_ids=active)
    close(dec.forward(tokens[:7]), expected[6])


def test_beyond_seq_is_refused(model):
    cfg, params, *_ = model
    dec = Decoder(cfg, params)
    dec.forward(np.zeros(cfg.seq - 1, np.int64))
    with pytest.raises(ValueError, match="do not fit"):
        dec.forward(np.zeros(2, np.int64))


def test_the_decode_matrices_are_stored_in_out_row_major(model):
    """Each product's matrix is a C-contiguous [in, out] array (transposing a parameter makes a
    column-major view, and numpy keeps that order through arithmetic; sgemv then read the other
    layout, measured 1.6x slower over the 6 layers of stories15M)."""
    cfg, params, *_ = model
    dec = Decoder(cfg, params)
    for layer in dec.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            assert layer[name].flags.c_contiguous, name
    assert dec.layers[0]["wqkv"].shape == (cfg.dim, cfg.q_dim + 2 * cfg.kv_dim)
    assert dec.cls_t.flags.c_contiguous
