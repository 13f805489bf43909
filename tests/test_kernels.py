"""Each of the ten dynamic-weight kernels, run by the simulator, against the float64 reference model."""

from dataclasses import replace

import numpy as np
import pytest

from support import reference_model as ref
from anectypes.device import open_device
from anectypes.device.protocol import surfaces
from anectypes.mil import parse
from anectypes.mil import limits
from anectypes.model.chips import kernel_findings, summary
from anectypes.model.config import ModelConfig
from anectypes.model.kernels import KERNELS

CONFIGS = {
    "mha": ModelConfig(dim=32, hidden=48, heads=4, kv_heads=4, head_dim=8, layers=2, seq=8, vocab=20),
    "gqa": ModelConfig(dim=32, hidden=40, heads=6, kv_heads=2, head_dim=8, layers=3, seq=12, vocab=20),
}
# Qwen3's QK-norm, with head_dim ≠ dim/heads, and llama3 RoPE (issue 35 §1)
QK = ModelConfig(dim=32, hidden=40, heads=6, kv_heads=2, head_dim=12, layers=3, seq=12, vocab=20, qk_norm=True,
                 rope_type="llama3", rope_original_context=16, rope_theta=1000.0)
rng = np.random.default_rng(3)


def run(name, cfg, precision="fp32", **segments):
    """Build kernel `name` for the precision mode (fp32 mode runs fp32-typed MIL), write the named
    input segments into the inputs that hold them, evaluate on the simulator; returns a getter for
    the output segments."""
    kernel = KERNELS[name](cfg, dtype=precision)
    dev = open_device("sim", precision=precision)
    k = dev.compile(kernel.text, kernel.weights)
    ins, outs = surfaces(dev, k.inputs), surfaces(dev, k.outputs)
    for name in (n for n in kernel.own_segments() if n.endswith("_scale") and n not in segments):
        segments[name] = np.tile([1.0, np.sqrt(cfg.norm_eps)], (kernel.in_shapes[kernel.input_of(name)][1], 1))
    for name in ("x2n_inv", "xn_inv"):      # the last norm's 1/rms, where a norm squares first: unscaled
        if name not in segments and any(name in lay for _, lay in kernel.inputs.values()) and name not in kernel.outputs:
            segments[name] = np.ones((1, cfg.seq))
    for name, value in segments.items():
        ins[kernel.input_of(name)].write(value, kernel.index(name))
    dev.eval(dev.request(k, ins, outs))
    return lambda name: kernel.output(outs[next(iter(outs))].array, name).astype(np.float64)


def rand(*shape, scale=0.5):
    return rng.standard_normal(shape) * scale


def close(got, want, tol=1e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("dialect", ["ios18", "ios16"])
@pytest.mark.parametrize("cfg", [CONFIGS["gqa"], QK], ids=["gqa", "qk_norm"])
def test_kernel_text_parses_and_round_trips(name, dialect, cfg):
    kernel = KERNELS[name](cfg, dialect)
    assert parse(kernel.text).text() == kernel.text


@pytest.mark.parametrize("chip", list(limits.CHIPS))
def test_qk_norm_and_llama3_rope_add_no_finding_of_the_chip_catalogue(chip):
    """`mil check --chip`'s rules over the ten kernels: QK-norm's per-head reductions and its saved
    tensors are refused in no kernel where the same model without them is not, and warned by no rule
    that does not warn that model already (M1's surface order, which most kernels have, now also sdpaBwd2's)."""
    plain = replace(QK, qk_norm=False, rope_type="default")
    found = {cfg: kernel_findings(cfg, chip) for cfg in (QK, plain)}
    assert [summary(f, "error") for f in found.values()] == [summary(found[plain], "error")] * 2
    warned = [summary(f, "warning", kernels=False) for f in found.values()]
    assert warned == [summary(found[plain], "warning", kernels=False)] * 2


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sdpa_fwd_with_qk_norm_and_llama3_rope(precision):
    cfg = QK
    x, w_rms = rand(cfg.dim, cfg.seq), 1 + rand(cfg.dim, scale=0.1)
    wq, wk, wv = rand(cfg.q_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim)
    qn, kn = 1 + rand(cfg.head_dim, scale=0.3), 1 + rand(cfg.head_dim, scale=0.3)
    out = run("sdpaFwd", cfg, precision, x_next=x, rms=w_rms[:, None], wq=wq.T, wk=wk.T, wv=wv.T,
              qn=np.pad(qn, (0, cfg.dim - cfg.head_dim))[:, None], kn=np.pad(kn, (0, cfg.dim - cfg.head_dim))[:, None])
    xn = ref.rmsnorm(x.T, w_rms, cfg.norm_eps)
    q = ref.rope(ref.rmsnorm(ref.to_heads(xn @ wq.T, cfg.heads, cfg.head_dim), qn, cfg.norm_eps), cfg)
    k = ref.rope(ref.rmsnorm(ref.to_heads(xn @ wk.T, cfg.kv_heads, cfg.head_dim), kn, cfg.norm_eps), cfg)
    attn, _ = ref.attention_forward(q, k, ref.to_heads(xn @ wv.T, cfg.kv_heads, cfg.head_dim))
    tol = 1e-5 if precision == "fp32" else 2e-2
    close(out("q"), ref.from_heads(q).T, tol)
    close(out("k"), ref.from_heads(k).T, tol)
    close(out("attn"), ref.from_heads(attn).T, tol)
    close(out("q_pre"), (xn @ wq.T).T, tol)


def norm_ref(x, w, eps):
    """float64 RMSNorm of channel-first x [C, S] over channels, and 1/rms [1, S]."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=0, keepdims=True) + eps)
    return x * inv * w[:, None], inv


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_sdpa_fwd(cfg):
    """RMSNorm of the layer input, then q, k, v, RoPE and causal attention."""
    x, w_rms = rand(cfg.dim, cfg.seq, scale=2.0), 1.0 + rand(cfg.dim, scale=0.3)
    wq, wk, wv = rand(cfg.q_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim)
    out = run("sdpaFwd", cfg, x_next=x, rms=w_rms[:, None], wq=wq.T, wk=wk.T, wv=wv.T)
    xn_cf, inv = norm_ref(x, w_rms, cfg.norm_eps)
    close(out("xn"), xn_cf)
    close(out("xn_inv"), inv)
    xn = ref.rmsnorm(x.T, w_rms, cfg.norm_eps)                    # rows: the reference's own norm
    q = ref.rope(ref.to_heads(xn @ wq.T, cfg.heads, cfg.head_dim), cfg.rope_theta)
    k = ref.rope(ref.to_heads(xn @ wk.T, cfg.kv_heads, cfg.head_dim), cfg.rope_theta)
    attn, probs = ref.attention_forward(q, k, ref.to_heads(xn @ wv.T, cfg.kv_heads, cfg.head_dim))
    close(out("attn"), ref.from_heads(attn).T)
    close(out("probs"), probs.reshape(cfg.heads * cfg.seq, cfg.seq))
    close(out("q"), ref.from_heads(q).T)
    close(out("k"), ref.from_heads(k).T)
    close(out("v"), (xn @ wv.T).T)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_wo_fwd(cfg):
    """x2 = x + α·Wo·attn, attn read from its segment of sdpaFwd's output, x from ffnFused's."""
    attn, x, wo = rand(cfg.q_dim, cfg.seq), rand(cfg.dim, cfg.seq), rand(cfg.dim, cfg.q_dim)
    out = run("woFwd", cfg, attn=attn, x_next=x, w=wo.T)
    close(out("x2"), x + ref.alpha(cfg) * wo @ attn)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_ffn_fused(cfg):
    """RMSNorm of x2, then the SiLU-gated FFN and the second residual."""
    x2, w_rms = rand(cfg.dim, cfg.seq), 1.0 + rand(cfg.dim, scale=0.3)
    w1, w3, w2 = rand(cfg.hidden, cfg.dim), rand(cfg.hidden, cfg.dim), rand(cfg.dim, cfg.hidden)
    out = run("ffnFused", cfg, x2=x2, rms=w_rms[:, None], w1=w1.T, w3=w3.T, w2=w2)
    x2n, inv = norm_ref(x2, w_rms, cfg.norm_eps)
    h1, h3 = w1 @ x2n, w3 @ x2n
    gate = ref.silu_gate(h1, h3)
    close(out("x2"), x2)
    close(out("x2n"), x2n)
    close(out("x2n_inv"), inv)
    close(out("h1"), h1)
    close(out("h3"), h3)
    close(out("gate"), gate)
    close(out("x_next"), x2 + ref.alpha(cfg) * w2 @ gate)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_ffn_bwd_w2t(cfg):
    """dgate = W2ᵀ·(α·dy), dy read from its segment of a qBwd-layout surface."""
    dy, w2 = rand(cfg.dim, cfg.seq), rand(cfg.dim, cfg.hidden)
    out = run("ffnBwdW2t", cfg, dy=dy, w2=w2)
    close(out("dgate"), w2.T @ (ref.alpha(cfg) * dy))


def norm_backward_ref(x, w, dy, eps):
    """float64 (dx, per-position w-gradient terms) of RMSNorm over channels, from the reference's
    row-wise rmsnorm_backward; the terms sum over positions to its dw."""
    dx, dw = ref.rmsnorm_backward(x.T, w, dy.T, eps)
    terms = dy * x / np.sqrt(np.mean(x * x, axis=0, keepdims=True) + eps)
    np.testing.assert_allclose(terms.sum(axis=1), dw)
    return dx.T, terms


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_wot_bwd(cfg):
    """The FFN norm's backward plus the residual, dx2 = RMSNorm'(x2)·dx_ffn + dy, then da = Woᵀ·(α·dx2)."""
    x2, dx_ffn, dy = rand(cfg.dim, cfg.seq, scale=2.0), rand(cfg.dim, cfg.seq), rand(cfg.dim, cfg.seq)
    w_rms, wo = 1.0 + rand(cfg.dim, scale=0.3), rand(cfg.dim, cfg.q_dim)
    _, inv = norm_ref(x2, w_rms, cfg.norm_eps)
    out = run("wotBwd", cfg, rms=w_rms[:, None], w=wo.T, dy=dy, x2=x2, x2n_inv=inv, dx=dx_ffn)
    dx2n, terms = norm_backward_ref(x2, w_rms, dx_ffn, cfg.norm_eps)
    dx2 = dx2n + dy
    close(out("dx2"), dx2)
    close(out("g"), terms)
    close(out("da"), wo.T @ (ref.alpha(cfg) * dx2))


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_kv_bwd(cfg):
    dk, dv = rand(cfg.kv_dim, cfg.seq), rand(cfg.kv_dim, cfg.seq)
    wk, wv = rand(cfg.kv_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim)
    out = run("kvBwd", cfg, wk=wk.T, wv=wv.T, dk=dk, dv=dv)
    close(out("dx"), wk.T @ dk + wv.T @ dv)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_q_bwd(cfg):
    """dx_attn = Wqᵀ·dq + dx_kv, the attention norm's backward and the residual: the layer input's
    gradient dy = RMSNorm'(x)·dx_attn + dx2."""
    x, dq, dx_kv, dx2 = (rand(cfg.dim, cfg.seq, scale=2.0), rand(cfg.q_dim, cfg.seq), rand(cfg.dim, cfg.seq),
                         rand(cfg.dim, cfg.seq))
    w_rms, wq = 1.0 + rand(cfg.dim, scale=0.3), rand(cfg.q_dim, cfg.dim)
    _, inv = norm_ref(x, w_rms, cfg.norm_eps)
    out = run("qBwd", cfg, wq=wq.T, dq=dq, dx=dx_kv, x_next=x, rms=w_rms[:, None], xn_inv=inv, dx2=dx2)
    dxn, terms = norm_backward_ref(x, w_rms, wq.T @ dq + dx_kv, cfg.norm_eps)
    close(out("dy"), dxn + dx2)
    close(out("g"), terms)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_ffn_bwd_w13t(cfg):
    """The SiLU-gate backward from dgate and the forward's h1, h3, then dx through W1ᵀ and W3ᵀ as ffnFused holds them."""
    h1, h3, dgate = rand(cfg.hidden, cfg.seq, scale=2.0), rand(cfg.hidden, cfg.seq), rand(cfg.hidden, cfg.seq)
    w1, w3 = rand(cfg.hidden, cfg.dim), rand(cfg.hidden, cfg.dim)
    out = run("ffnBwdW13t", cfg, dgate=dgate, h1=h1, h3=h3, w1=w1.T, w3=w3.T)
    dh1, dh3 = ref.silu_gate_backward(h1, h3, dgate)
    close(out("dh1"), dh1)
    close(out("dh3"), dh3)
    close(out("dx"), w1.T @ dh1 + w3.T @ dh3)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_sdpa_backward_pair(cfg):
    """sdpaBwd1 then sdpaBwd2 (the forward's probs and dp carried over as the pipeline does) give dV
    and, through RoPE's backward, the gradients of the q and k projections."""
    hd = cfg.head_dim
    q = rand(cfg.heads, cfg.seq, hd)
    k, v = rand(cfg.kv_heads, cfg.seq, hd), rand(cfg.kv_heads, cfg.seq, hd)
    dout = rand(cfg.heads, cfg.seq, hd)
    attn, probs = ref.attention_forward(q, k, v)
    dq, dk, dv = ref.attention_backward(q, k, v, probs, dout)
    cf = lambda t: ref.from_heads(t).T                     # [n, S, hd] -> channel-first [n·hd, S]
    rows = probs.reshape(cfg.heads * cfg.seq, cfg.seq)
    out1 = run("sdpaBwd1", cfg, probs=rows, v=cf(v), da=cf(dout))
    close(out1("dv"), cf(dv))
    out2 = run("sdpaBwd2", cfg, probs=rows, dp=out1("dp"), q=cf(q), k=cf(k), attn=cf(attn), da=cf(dout))
    close(out2("dq"), cf(ref.rope_backward(dq, cfg.rope_theta)))      # through RoPE, to the projections
    close(out2("dk"), cf(ref.rope_backward(dk, cfg.rope_theta)))


def test_fp16_mode_tracks_fp32_mode():
    """The hardware-faithful mode stays within fp16 accuracy of the exact mode on a whole kernel."""
    cfg = CONFIGS["gqa"]
    x = rand(cfg.dim, cfg.seq)
    w = dict(wq=rand(cfg.dim, cfg.q_dim, scale=0.2), wk=rand(cfg.dim, cfg.kv_dim, scale=0.2),
             wv=rand(cfg.dim, cfg.kv_dim, scale=0.2), rms=np.ones((cfg.dim, 1)))
    exact = run("sdpaFwd", cfg, "fp32", x_next=x, **w)("attn")
    half = run("sdpaFwd", cfg, "fp16", x_next=x, **w)("attn")
    assert np.abs(half - exact).max() < 1e-2 * np.abs(exact).max()


@pytest.mark.parametrize("name, change, error", [
    ("woFwd", lambda w, cfg: dict(out=dict(x2=cfg.dim + 1)), "kernel woFwd: outputs .* differ from the declared"),
    ("wotBwd", lambda w, cfg: dict(out=dict(dx2=cfg.dim, da=cfg.q_dim, g=cfg.dim)), "kernel wotBwd: outputs"),
    ("woFwd", lambda w, cfg: dict(reads={"fwd": w.reads["fwd"]}), "kernel woFwd: no input 'prev' declared to read"),
    ("woFwd", lambda w, cfg: dict(reads={**w.reads, "fwd": ("sdpaFwd", "above2")}), r"reads \(sdpaFwd, above2\)"),
    ("woFwd", lambda w, cfg: dict(reads={**w.reads, "fwd": ("wotBwd", "out")}), "has no segment attn"),
    ("woFwd", lambda w, cfg: dict(reads={**w.reads, "kv": ("kvBwd", "out")}), "declared input kv not used"),
    ("ffnFused", lambda w, cfg: dict(own={"w1": w.own["w1"], "w3": w.own["w3"]}), "no own input 'w2' declared"),
    ("kvBwd", lambda w, cfg: dict(reads={**w.reads, "att": ("sdpaFwd", "out")}), "input 'att' reads an output"),
])
def test_a_kernel_unlike_its_wiring_is_refused(monkeypatch, name, change, error):
    """Each input's source and the output's layout are declared once (kernels.wiring); a generator that
    builds something else fails with an error naming the kernel (not an assert, which python -O drops)."""
    from anectypes.model import kernels
    cfg = CONFIGS["gqa"]
    declared = kernels.wiring(cfg)
    changed = {**declared, name: declared[name]._replace(**change(declared[name], cfg))}
    monkeypatch.setattr(kernels, "wiring", lambda c, lora=None: changed)
    with pytest.raises(ValueError, match=error):
        KERNELS[name](cfg)


@pytest.mark.parametrize("preset", ["tiny", "stories15m", "stories42m", "stories110m", "qwen3_06b"])
def test_every_packed_input_and_segment_is_a_multiple_of_32_wide(preset):
    """Every maderix input width is a multiple of 32 fp16 values, where a packed row and an engine-padded one
    agree (issue 44 §1): each kernel's packed inputs, with and without LoRA (rank 16 on every projection) and
    QK-norm, are that wide and each segment starts at such an offset."""
    from anectypes.model.config import PRESETS
    from anectypes.model.lora import Lora
    lora = Lora(16, 8.0, ("wq", "wk", "wv", "wo", "w1", "w3", "w2"))
    for cfg in (PRESETS[preset], replace(PRESETS[preset], qk_norm=not PRESETS[preset].qk_norm)):
        for adapters in (None, lora):
            for name, make in KERNELS.items():
                k = make(cfg, "ios18", "fp16", adapters)
                for x, (axis, layout) in k.inputs.items():
                    if axis == 3:
                        starts = [start for start, _ in layout.values()]
                        assert k.in_shapes[x][3] % 32 == 0 and all(s % 32 == 0 for s in starts), (name, x, layout)
