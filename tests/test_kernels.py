"""Each of the ten dynamic-weight kernels, run by the simulator, against the float64 reference model."""

import numpy as np
import pytest

import reference_model as ref
from anectypes.device import open_device, surfaces
from anectypes.mil import parse
from anectypes.model.config import ModelConfig
from anectypes.model.kernels import KERNELS

CONFIGS = {
    "mha": ModelConfig(dim=32, hidden=48, heads=4, kv_heads=4, head_dim=8, layers=2, seq=8, vocab=20),
    "gqa": ModelConfig(dim=32, hidden=40, heads=6, kv_heads=2, head_dim=8, layers=3, seq=12, vocab=20),
}
rng = np.random.default_rng(3)


def run(name, cfg, precision="fp32", **segments):
    """Build kernel `name` for the precision mode (fp32 mode runs fp32-typed MIL), write the named
    input segments into the inputs that hold them, evaluate on the simulator; returns a getter for
    the output segments."""
    kernel = KERNELS[name](cfg, dtype=precision)
    dev = open_device("sim", precision=precision)
    k = dev.compile(kernel.text, kernel.weights)
    ins, outs = surfaces(dev, k.inputs), surfaces(dev, k.outputs)
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
def test_kernel_text_parses_and_round_trips(name, dialect):
    kernel = KERNELS[name](CONFIGS["gqa"], dialect)
    assert parse(kernel.text).text() == kernel.text


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_sdpa_fwd(cfg):
    x = rand(cfg.seq, cfg.dim)
    wq, wk, wv = rand(cfg.q_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim), rand(cfg.kv_dim, cfg.dim)
    out = run("sdpaFwd", cfg, xnorm=x.T, wq=wq.T, wk=wk.T, wv=wv.T)
    q = ref.rope(ref.to_heads(x @ wq.T, cfg.heads, cfg.head_dim), cfg.rope_theta)
    k = ref.rope(ref.to_heads(x @ wk.T, cfg.kv_heads, cfg.head_dim), cfg.rope_theta)
    attn, probs = ref.attention_forward(q, k, ref.to_heads(x @ wv.T, cfg.kv_heads, cfg.head_dim))
    close(out("attn"), ref.from_heads(attn).T)
    close(out("probs"), probs.reshape(cfg.heads * cfg.seq, cfg.seq))
    close(out("q"), ref.from_heads(q).T)
    close(out("k"), ref.from_heads(k).T)
    close(out("v"), (x @ wv.T).T)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_ffn_fused(cfg):
    xn, x2 = rand(cfg.seq, cfg.dim), rand(cfg.seq, cfg.dim)
    w1, w3, w2 = rand(cfg.hidden, cfg.dim), rand(cfg.hidden, cfg.dim), rand(cfg.dim, cfg.hidden)
    out = run("ffnFused", cfg, x2norm=xn.T, x2=x2.T, w1=w1.T, w3=w3.T, w2=w2)
    h1, h3 = xn @ w1.T, xn @ w3.T
    gate = ref.silu_gate(h1, h3)
    close(out("h1"), h1.T)
    close(out("h3"), h3.T)
    close(out("gate"), gate.T)
    close(out("x_next"), (x2 + ref.alpha(cfg) * gate @ w2.T).T)


@pytest.mark.parametrize("name, ic, oc, terms", [
    ("woFwd", "q_dim", "dim", 1), ("ffnBwdW2t", "dim", "hidden", 1), ("wotBwd", "dim", "q_dim", 1),
    ("qBwd", "q_dim", "dim", 1), ("kvBwd", "kv_dim", "dim", 2)])
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_linear_kernels(cfg, name, ic, oc, terms):
    """y = Σ Wᵀ·act with W [ic, oc] packed: the forward takes Wᵀ of an [oc, ic] layer, backward raw W."""
    ic, oc = getattr(cfg, ic), getattr(cfg, oc)
    acts, ws = [rand(ic, cfg.seq) for _ in range(terms)], [rand(ic, oc) for _ in range(terms)]
    names = ["act", "w"] if terms == 1 else ["act0", "act1", "w0", "w1"]
    out = run(name, cfg, **dict(zip(names, acts + ws)))
    close(out(next(iter(KERNELS[name](cfg).outputs))), sum(w.T @ a for a, w in zip(acts, ws)))


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS)
def test_ffn_bwd_w13t(cfg):
    """The SiLU-gate backward from dgate and the forward's h1, h3, then dx through raw W1 and W3."""
    h1, h3, dgate = rand(cfg.hidden, cfg.seq, scale=2.0), rand(cfg.hidden, cfg.seq), rand(cfg.hidden, cfg.seq)
    w1, w3 = rand(cfg.hidden, cfg.dim), rand(cfg.hidden, cfg.dim)
    out = run("ffnBwdW13t", cfg, dgate=dgate, h1=h1, h3=h3, w1=w1, w3=w3)
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
    _, probs = ref.attention_forward(q, k, v)
    dq, dk, dv = ref.attention_backward(q, k, v, probs, dout)
    cf = lambda t: ref.from_heads(t).T                     # [n, S, hd] -> channel-first [n·hd, S]
    rows = probs.reshape(cfg.heads * cfg.seq, cfg.seq)
    out1 = run("sdpaBwd1", cfg, probs=rows, v=cf(v), da=cf(dout))
    close(out1("dv"), cf(dv))
    out2 = run("sdpaBwd2", cfg, probs=rows, dp=out1("dp"), q=cf(q), k=cf(k))
    close(out2("dq"), cf(ref.rope_backward(dq, cfg.rope_theta)))      # through RoPE, to the projections
    close(out2("dk"), cf(ref.rope_backward(dk, cfg.rope_theta)))


def test_fp16_mode_tracks_fp32_mode():
    """The hardware-faithful mode stays within fp16 accuracy of the exact mode on a whole kernel."""
    cfg = CONFIGS["gqa"]
    x = rand(cfg.seq, cfg.dim)
    w = dict(wq=rand(cfg.dim, cfg.q_dim, scale=0.2), wk=rand(cfg.dim, cfg.kv_dim, scale=0.2),
             wv=rand(cfg.dim, cfg.kv_dim, scale=0.2))
    exact = run("sdpaFwd", cfg, "fp32", xnorm=x.T, **w)("attn")
    half = run("sdpaFwd", cfg, "fp16", xnorm=x.T, **w)("attn")
    assert np.abs(half - exact).max() < 1e-2 * np.abs(exact).max()
