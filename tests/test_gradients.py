"""The whole training pipeline's gradients against the independent float64 reference model."""

import numpy as np
import pytest

import reference_model as ref
from anectypes.device import open_device
from anectypes.model.config import ModelConfig
from anectypes.model.transformer import Transformer

CONFIGS = {
    "mha": ModelConfig(dim=32, hidden=48, heads=4, kv_heads=4, head_dim=8, layers=2, seq=8, vocab=24),
    "gqa": ModelConfig(dim=32, hidden=40, heads=4, kv_heads=2, head_dim=8, layers=2, seq=8, vocab=24),
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
