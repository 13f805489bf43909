"""fp16 mode: without loss scaling, backward activations underflow and weight gradients vanish."""

import numpy as np

from anectypes.device import open_device
from anectypes.model.config import ModelConfig, init_params
from anectypes.model.transformer import Transformer

CFG = ModelConfig(dim=64, hidden=128, heads=4, kv_heads=4, head_dim=16, layers=8, seq=128, vocab=512)


def zero_fraction(loss_scale):
    rng = np.random.default_rng(0)
    params = init_params(CFG, rng)
    model = Transformer(CFG, open_device("sim", precision="fp16"), params, np.arange(CFG.vocab))
    tokens = rng.integers(0, CFG.vocab, CFG.seq + 1)
    model.forward_backward(tokens[:-1], tokens[1:], loss_scale=loss_scale)
    model.wait()
    g = model.grads["layers.0.wq"]
    return np.mean(g == 0)


def test_gradients_flush_to_zero_without_loss_scaling_and_survive_with_it():
    unscaled, scaled = zero_fraction(1.0), zero_fraction(256.0)
    assert unscaled > 0.25, unscaled      # a measurable fraction of Wq's gradient is exactly zero
    assert scaled < 0.01, scaled          # the reference's default scale (256) keeps it alive
