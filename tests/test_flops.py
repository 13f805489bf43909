"""step_flops against GEMMs counted while a real micro-step runs on the simulator.

Every GEMM of a step goes through anectypes.host.blas: the CPU half calls `blas.sgemm` (classifier, the
dW worker), and the simulator runs every MIL `matmul` (and `conv`, `scaled_dot_product_attention`)
with `blas.matmul`. Wrapping those two functions therefore sees every matrix product; each call is
charged 2·M·N·K per batch element, from the operands' shapes alone.
"""

import threading

import numpy as np
import pytest

from anectypes.host import blas
from anectypes.device import open_device
from anectypes.model.config import PRESETS, ModelConfig, init_params
from anectypes.model.flops import step_flops
from anectypes.model.transformer import Transformer

CONFIGS = {
    "tiny": PRESETS["tiny"],
    "gqa": ModelConfig(dim=48, hidden=80, heads=6, kv_heads=2, head_dim=8, layers=3, seq=24, vocab=96),
}


def gemm_flops(a, b, trans_a=False, trans_b=False):
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    k2, n = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
    assert k == k2
    batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), dtype=np.int64))
    return 2 * m * n * k * batch


@pytest.fixture
def counted(monkeypatch):
    """Record (caller, flops) of every blas.sgemm / blas.matmul call; the caller is "dW" for the
    weight-gradient GEMMs issued through Transformer.accumulate (inline or on its worker)."""
    calls, in_dw = [], threading.local()
    for name in ("sgemm", "matmul"):
        real = getattr(blas, name)

        def wrapper(a, b, out=None, *, real=real, **kw):
            calls.append(("dW" if getattr(in_dw, "on", False) else "",
                          gemm_flops(a, b, kw.get("trans_a", False), kw.get("trans_b", False))))
            return real(a, b, out, **kw)
        monkeypatch.setattr(blas, name, wrapper)
    real_accumulate = Transformer.accumulate

    def accumulate(self, grad, a, b=None, **kw):
        in_dw.on = True
        try:
            sgemm = blas.sgemm
            wrapped = lambda *args, **kw: (setattr(in_dw, "on", True), sgemm(*args, **kw))[1]
            monkeypatch.setattr(blas, "sgemm", wrapped)
            return real_accumulate(self, grad, a, b, **kw)
        finally:
            monkeypatch.setattr(blas, "sgemm", sgemm)
            in_dw.on = False
    monkeypatch.setattr(Transformer, "accumulate", accumulate)
    return calls


def one_step(cfg, precision, calls):
    rng = np.random.default_rng(0)
    active = np.sort(rng.choice(cfg.vocab, cfg.vocab * 3 // 4, replace=False))   # a strict subset
    model = Transformer(cfg, open_device("sim", precision=precision), init_params(cfg, rng), active)
    tokens, targets = rng.choice(active, cfg.seq), rng.choice(active, cfg.seq)
    if model.guarded:
        model.calibrate(tokens)            # fp16's first forward chooses its scales from a float32 one first
    calls.clear()                                          # construction runs no GEMM, but be sure
    model.forward_backward(tokens, targets)
    model.wait()
    return len(active)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_step_flops_equals_counted_gemms(cfg, precision, counted):
    n_active = one_step(cfg, precision, counted)
    want = step_flops(cfg, n_active)
    assert sum(f for _, f in counted) == want["total"]
    # accumulate() runs exactly the weight gradients and the classifier's dE (one third of it)
    dw = sum(f for t, f in counted if t == "dW")
    assert dw == want["bwd_dw"] + want["classifier"] // 3


def test_parts_sum_to_total():
    for cfg in CONFIGS.values():
        parts = step_flops(cfg, 100)
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
        assert all(isinstance(v, int) and v > 0 for v in parts.values())
        # the three projection passes (forward, dx, dW) are the same GEMM shapes
        assert parts["fwd_proj"] == parts["bwd_dx"] == parts["bwd_dw"]


def test_hand_count_stories15m():
    """A by-hand figure for stories15m (dim 288, hidden 768, 6 heads of 48, 6 layers, S 256)."""
    s, d, h, L = 256, 288, 768, 6
    proj = 2 * s * (4 * d * d + 3 * d * h)                 # q, k, v, o and w1, w3, w2
    attn = 2 * s * s * d                                    # one attention-shaped GEMM, all heads
    want = L * (3 * proj + 6 * attn) + 3 * 2 * 32000 * d * s
    assert step_flops(PRESETS["stories15m"], 32000)["total"] == want


@pytest.mark.parametrize("targets", [("wq", "wv", "w2"), ("wq", "wk", "wv", "wo", "w1", "w3", "w2")])
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_step_flops_of_lora_equals_counted_gemms(cfg, targets, counted):
    """With LoRA: the adapters' products in the kernels, their gradients on the CPU, no weight gradient and no dE."""
    from anectypes.model.lora import Lora, init_adapters
    lora = Lora(4, 8.0, targets)
    rng = np.random.default_rng(0)
    active = np.sort(rng.choice(cfg.vocab, cfg.vocab * 3 // 4, replace=False))
    params = {**init_params(cfg, rng), **init_adapters(cfg, lora, rng)}
    model = Transformer(cfg, open_device("sim", precision="fp32"), params, active, lora=lora)
    counted.clear()
    model.forward_backward(rng.choice(active, cfg.seq), rng.choice(active, cfg.seq))
    model.wait()
    assert sum(f for _, f in counted) == step_flops(cfg, len(active), lora)["total"] < step_flops(cfg, len(active))["total"]
