"""The whole training pipeline's gradients against the independent float64 reference model."""

import numpy as np
import pytest

from support import reference_model as ref
from anectypes.device import open_device
from anectypes.model.config import ModelConfig
from anectypes.model.transformer import Transformer
from anectypes.train.optim import AdamW, update_model

CONFIGS = {
    "mha": ModelConfig(dim=32, hidden=48, heads=4, kv_heads=4, head_dim=8, layers=2, seq=8, vocab=24),
    "gqa": ModelConfig(dim=32, hidden=40, heads=4, kv_heads=2, head_dim=8, layers=2, seq=8, vocab=24),
    # real checkpoints' architecture (issue 35 §1): QK-norm with head_dim ≠ dim/heads, llama3 RoPE, α = 1, untied
    "qknorm-llama3-untied": ModelConfig(dim=32, hidden=40, heads=4, kv_heads=2, head_dim=12, layers=2, seq=8,
                                        vocab=24, qk_norm=True, rope_type="llama3", rope_factor=4.0,
                                        rope_original_context=64, rope_theta=1000.0, residual_scaled=False,
                                        tied=False),
}


def setup(cfg, seed=0):
    rng = np.random.default_rng(seed)
    params64 = ref.init_params(cfg, seed=seed, std=0.2)
    tokens = rng.integers(0, cfg.vocab, cfg.seq + 1)
    active = np.unique(np.concatenate([tokens, rng.choice(cfg.vocab, 5)]))   # a strict subset of ids
    return params64, tokens[:-1], tokens[1:], active


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_pipeline_gradients_match_float64_reference(cfg):
    params64, x, y, active = setup(cfg)
    loss64, grads64 = ref.loss_and_grads(params64, cfg, x, y, active)
    model = Transformer(cfg, open_device("sim", precision="fp32"),
                        {k: v.astype(np.float32) for k, v in params64.items()}, active)
    scale = 256.0
    loss = model.forward_backward(x, y, loss_scale=scale)
    model.wait()
    assert abs(loss - loss64) < 1e-5 * abs(loss64)
    for name, want in grads64.items():
        got = model.grads[name] / scale
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, (name, err)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_masked_targets_add_nothing_to_the_loss_or_the_gradients(cfg):
    """A chat row's prompt: targets IGNORE are out of the mean loss and its gradients, against the float64
    reference that leaves those rows out; the gradients differ from the unmasked step's."""
    from anectypes.model.loss import IGNORE
    params64, x, y, active = setup(cfg)
    y = np.where(np.arange(cfg.seq) % 3 == 1, y, IGNORE)        # a third of the positions are targets
    loss64, grads64 = ref.loss_and_grads(params64, cfg, x, y, active)
    model = Transformer(cfg, open_device("sim", precision="fp32"),
                        {k: v.astype(np.float32) for k, v in params64.items()}, active)
    loss = model.forward_backward(x, y, loss_scale=256.0)
    model.wait()
    assert abs(loss - loss64) < 1e-5 * abs(loss64)
    unmasked = ref.loss_and_grads(params64, cfg, x, setup(cfg)[2], active)[1]
    for name, want in grads64.items():
        got = model.grads[name] / 256.0
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-4, name
        assert np.abs(unmasked[name] - want).max() > 1e-3 * np.abs(want).max(), name


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_exact_accumulation_sums_the_micro_steps_in_any_order_to_the_same_bits(precision):
    """--exact-accum: the float64 sum the ranks add up equals the float64 sum of each micro-step's own
    gradients, whatever the order; the update then takes the same step from either order."""
    cfg = CONFIGS["gqa"]
    params64, _, _, active = setup(cfg)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab, cfg.seq + 1) for _ in range(4)]
    seqs = [(np.where(np.isin(s, active), s, active[0])[:-1], np.where(np.isin(s, active), s, active[0])[1:])
            for s in seqs]

    def model(exact):
        return Transformer(cfg, open_device("sim", precision=precision),
                           {k: v.astype(np.float32) for k, v in params64.items()}, active, exact=exact)

    single, each = model(False), []
    for x, y in seqs:
        single.zero_grads()
        single.forward_backward(x, y, loss_scale=256.0)
        single.wait()
        each.append(single.grad_buffer.astype(np.float64))
    want = np.sum(each, axis=0)
    after = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        m = model(True)
        for i in order:
            m.forward_backward(*seqs[i], loss_scale=256.0)
        assert not m.grad_buffer.any()                  # each micro-step's gradients moved into the sum
        np.testing.assert_array_equal(m.summed, want)
        assert update_model(m, AdamW(m.params), 1e-2, 256.0 * 4, 1.0) is not None
        assert not m.summed.any() and not m.grad_buffer.any()
        after.append({k: v.copy() for k, v in m.params.items()})
    assert all(np.array_equal(after[0][k], after[1][k]) for k in after[0])
    assert any(not np.array_equal(after[0][k], params64[k].astype(np.float32)) for k in after[0])


def test_finite_difference_spot_check():
    """A few directional derivatives of the pipeline's own loss agree with its gradients."""
    cfg = CONFIGS["gqa"]
    params64, x, y, active = setup(cfg, seed=1)
    params = {k: v.astype(np.float32) for k, v in params64.items()}
    model = Transformer(cfg, open_device("sim", precision="fp32"), params, active)
    model.forward_backward(x, y)
    model.wait()
    grads = {k: g.copy() for k, g in model.grads.items()}
    rng = np.random.default_rng(2)
    for name in ("layers.0.wq", "layers.1.w2", "layers.0.rms_att", "embed"):
        d = rng.standard_normal(params[name].shape).astype(np.float32)
        d /= np.linalg.norm(d)  # a unit direction keeps the float32 central difference accurate
        h = 1e-2
        base = params[name].copy()
        losses = []
        for sign in (1, -1):
            params[name][...] = base + sign * h * d
            model.stage_weights()
            losses.append(model.forward_backward(x, y))
        params[name][...] = base
        model.stage_weights()
        numeric = (losses[0] - losses[1]) / (2 * h)
        analytic = float(np.sum(grads[name] * d))
        assert abs(numeric - analytic) < 2e-3 * max(1.0, abs(analytic)), (name, numeric, analytic)


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("threads", [False, True])
def test_cross_entropy_blocks_match_float64(shifted, threads):
    """The blocked loss (a last block shorter than CE_ROWS; on threads or not), shifted per block or,
    with |logits| under the bound, not at all, against the reference's float64 loss and gradient."""
    from concurrent.futures import ThreadPoolExecutor
    from anectypes.model.loss import CE_ROWS, SAFE_LOGIT, cross_entropy_
    rng = np.random.default_rng(4)
    classes, n = 2 * CE_ROWS + 123, 7
    got = (rng.uniform(-9, 9, (classes, n)) + (1e4 if shifted else 0.0)).astype(np.float32)  # e^1e4 overflows
    target = rng.integers(0, classes, n)
    want_loss, want = ref.cross_entropy(got.T, target)
    with ThreadPoolExecutor(2) as pool:
        loss, f = cross_entropy_(got, target, bound=np.inf if shifted else SAFE_LOGIT / 6,
                                 map=pool.map if threads else map)
    assert np.isclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got * f, want.T, rtol=1e-4, atol=1e-9)


def test_logit_bound_bounds_every_logit():
    from anectypes.model.loss import logit_bound
    rng = np.random.default_rng(5)
    E, x = rng.standard_normal((50, 8)), rng.standard_normal((8, 6))
    row_norm = np.sqrt((E * E).sum(axis=1).max())
    assert np.abs(E @ x).max() <= logit_bound(row_norm, x)
    x[:, 2] = 3 * E[np.argmax((E * E).sum(axis=1))]                  # a column along the longest row
    assert np.isclose(np.abs(E @ x).max(), logit_bound(row_norm, x))


@pytest.mark.parametrize("vocab", [3, 40, 5000])
def test_scatter_add_sums_repeated_rows_in_order(vocab):
    """The embedding's backward: each row's values summed in float32 in the order they come, then
    added to the table (a plain loop is the reference, bit for bit; float64 bounds the error)."""
    from anectypes.model.loss import scatter_add
    rng = np.random.default_rng(6)
    rows = rng.integers(0, vocab, 256)
    values = rng.standard_normal((256, 9)).astype(np.float32)
    table = rng.standard_normal((vocab, 9)).astype(np.float32)
    want, sums = table.copy(), {}
    for r, v in zip(rows, values):
        sums[r] = sums[r] + v if r in sums else v.copy()
    for r, v in sums.items():
        want[r] += v
    exact = table.astype(np.float64)
    np.add.at(exact, rows, values.astype(np.float64))
    scatter_add(table, rows, values.T.copy().T)                       # values as a transposed view, as dy.T
    assert np.array_equal(table, want)
    np.testing.assert_allclose(table, exact, rtol=1e-5, atol=1e-5)
