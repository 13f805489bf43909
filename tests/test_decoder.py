"""The KV-cache decoder against the training forward: Transformer.logits on the simulator in fp32 gives
the logits at every position of a full window; the decoder must give the same ones, whether the
window comes as one prompt (prefill) or as a one-token prompt and then a token at a time (decode)."""

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.model.config import ModelConfig, init_params
from anectypes.generate.decoder import Decoder
from anectypes.model.transformer import Transformer

CONFIGS = {
    "mha": ModelConfig(dim=48, hidden=96, heads=4, kv_heads=4, head_dim=12, layers=2, seq=16, vocab=64),
    # GQA (3 query heads per kv head), head_dim != dim / heads
    "gqa": ModelConfig(dim=40, hidden=72, heads=6, kv_heads=2, head_dim=8, layers=3, seq=16, vocab=64),
    # real checkpoints' architecture (issue 35): QK-norm, llama3 RoPE, α = 1, an untied classifier
    "qknorm-llama3-untied": ModelConfig(dim=40, hidden=72, heads=6, kv_heads=2, head_dim=12, layers=2, seq=16,
                                        vocab=64, qk_norm=True, rope_type="llama3", rope_factor=4.0,
                                        rope_original_context=32, rope_theta=1000.0, residual_scaled=False,
                                        tied=False),
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
@pytest.mark.parametrize("lanes", [1, 2, 5])        # 5: some lanes get no rows of the smaller products
def test_prompt_then_one_token_at_a_time(model, prompt, lanes):
    cfg, params, active, tokens, expected = model
    dec = Decoder(cfg, params, vocab_ids=active, lanes=lanes)
    for _ in range(2):                                     # a second session over the first one's cache
        dec.reset()
        got = [dec.forward(tokens[:prompt], all_logits=True)]
        got += [dec.forward(tokens[p:p + 1]).copy()[None] for p in range(prompt, cfg.seq)]
        close(np.concatenate(got), expected)
    dec.close()


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


def test_each_decode_matrix_is_stored_in_the_order_sgemv_streams_faster(model):
    """Each product's matrix [in, out] is a copy in one memory order: row-major [in, out] when the
    output is wider than the input, else row-major [out, in] (transposing a parameter gives a
    column-major view, whose order numpy keeps through arithmetic: the decoder once read stories15M's
    matrices in the slower order, 1.6x slower over its layers)."""
    cfg, params, *_ = model
    dec = Decoder(cfg, params)
    mats = [*(layer[name] for layer in dec.layers for name in ("wqkv", "wo", "w13", "w2")), dec.cls_t]
    for w in mats:
        assert (w.flags.c_contiguous if w.shape[1] > w.shape[0] else w.flags.f_contiguous), w.shape
        assert not any(np.shares_memory(w, p) for p in params.values())
    assert dec.layers[0]["wqkv"].shape == (cfg.dim, cfg.q_dim + 2 * cfg.kv_dim)
    assert {w.flags.c_contiguous for w in mats} == {True, False}      # both orders occur
