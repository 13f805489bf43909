"""MIL generators for the dynamic-weight kernels (docs/ane-reference.md §3.4, §4.2).

Weights travel as input data, packed in the spatial dimension of a kernel's own inputs, so each
kernel compiles once per run and new weights only need new input data. Activations and gradients
come from other kernels' surfaces, bound as further inputs and read in place (see
model/transformer.py's CHAINED); `dynamic_matmul` is the reference's single-input form.
"""

import numpy as np

from ..mil import Builder


def dynamic_matmul(b, x, ic, oc, seq, act_at, w_at, prefix):
    """y[1,oc,1,seq] = Wᵀ·act, where x holds act in spatial [act_at, act_at+seq) and the ic×oc
    matrix W in spatial [w_at, w_at+oc): channel i of x carries row i of W (§3.4)."""
    act = b.slice_by_size(x=x, begin=[0, 0, 0, act_at], size=[1, ic, 1, seq], name=f"{prefix}_act")
    return packed_matmul(b, act, x, ic, oc, seq, w_at, prefix)


def packed_matmul(b, act, x, ic, oc, seq, w_at, prefix):
    """y[1,oc,1,seq] = Wᵀ·act for act [1,ic,1,seq] and the ic×oc matrix W in spatial [w_at, w_at+oc) of x."""
    w = b.slice_by_size(x=x, begin=[0, 0, 0, w_at], size=[1, ic, 1, oc], name=f"{prefix}_w")
    act_rows = b.transpose(x=b.reshape(x=act, shape=[1, 1, ic, seq], name=f"{prefix}_a2"),
                           perm=[0, 1, 3, 2], name=f"{prefix}_at")                 # [1,1,seq,ic]
    w_mat = b.reshape(x=w, shape=[1, 1, ic, oc], name=f"{prefix}_wm")
    y = b.matmul(x=act_rows, y=w_mat, transpose_x=False, transpose_y=False, name=f"{prefix}_yh")
    y = b.transpose(x=y, perm=[0, 1, 3, 2], name=f"{prefix}_yt")                    # [1,1,oc,seq]
    return b.reshape(x=y, shape=[1, oc, 1, seq], name=f"{prefix}_y")


def dynamic_matmul_kernel(ic, oc, seq, dialect="ios18", dtype="fp16"):
    """A one-op kernel: input x [1, ic, 1, seq+oc] (activation, then weight), output y [1, oc, 1, seq]."""
    b = Builder(dialect, dtype)
    x = b.input("x", [1, ic, 1, seq + oc])
    b.output(dynamic_matmul(b, x, ic, oc, seq, 0, seq, "mm"))
    return b


# ---------------------------------------------------------------- packing layouts

class Kernel:
    """A compiled-once kernel: its MIL, its BLOBFILE constants and where each tensor sits.

    `inputs` maps each input to (axis, {segment: (start, size)}). The kernel's own inputs (`own`: x,
    or x1 and x3) hold its weights packed along the spatial axis (3); its other inputs are surfaces
    that other kernels wrote, read in place: a kernel's output (channel segments, axis 1) or packed
    input (axis 3). Outputs are channel segments.
    """

    def __init__(self, name, builder, inputs, outputs, own=("x",)):
        self.name, self.own = name, tuple(n for n in own if n in inputs)
        self.text, self.weights = builder.text(), builder.weights()
        self.inputs, self.outputs = inputs, outputs          # outputs: name -> (start, size)
        fn = builder.fn
        self.in_shapes = {v.name: v.type.shape for v in fn.inputs}
        self.out_shape = fn.outputs[0].type.shape

    def input_of(self, segment):
        """The name of the input that holds a segment."""
        holders = [name for name, (_, layout) in self.inputs.items() if segment in layout]
        if len(holders) != 1:
            raise KeyError(f"kernel {self.name} has {'no' if not holders else 'more than one'} input segment '{segment}'")
        return holders[0]

    def index(self, segment):
        """Where a segment sits in its input: a [C, size] (spatial packing) or [size, S] (channels)
        block, for `Surface.write(value, index)` or `array[index]`."""
        axis, layout = self.inputs[self.input_of(segment)]
        start, size = layout[segment]
        part = slice(start, start + size)
        return (0, slice(None), 0, part) if axis == 3 else (0, part, 0, slice(None))

    def out_index(self, name):
        """Where an output segment sits in the output: a [size, S] block."""
        start, size = self.outputs[name]
        return 0, slice(start, start + size), 0, slice(None)

    def output(self, surface, name):
        return surface[self.out_index(name)]


def segments(**sizes):
    out, at = {}, 0
    for name, size in sizes.items():
        out[name] = (at, size)
        at += size
    return out, at


def packed_input(b, channels, name="x", **sizes):
    """Input `name` [1, channels, 1, sum(sizes)] and the spatial layout of its segments."""
    layout, width = segments(**sizes)
    return b.input(name, [1, channels, 1, width]), layout


def input_segments(b, name, axis, extent, sizes, *wanted):
    """Input `name`: another surface, read in place instead of copied, holding the segments `sizes`
    (in order) along `axis`: 1 for a kernel's output [1, Σ, 1, extent], 3 for a kernel's packed
    input [1, extent, 1, Σ]. Returns the wanted segments as slices, and the inputs entry."""
    layout, total = segments(**sizes)
    shape = [1, total, 1, extent] if axis == 1 else [1, extent, 1, total]
    x = b.input(name, shape)

    def part(seg):
        begin, size = [0, 0, 0, 0], list(shape)
        begin[axis], size[axis] = layout[seg]
        return b.slice_by_size(x=x, begin=begin, size=size, name=f"{name}_{seg}")
    return [part(seg) for seg in wanted], {name: (axis, layout)}


def channel_output(b, **tensors):
    """Concatenate [1,c,1,S] results along channels: the kernel's single output surface."""
    layout, _ = segments(**{n: t.type.shape[1] for n, t in tensors.items()})
    out = tensors[next(iter(tensors))] if len(tensors) == 1 else \
        b.concat(values=tuple(tensors.values()), axis=1, interleave=False, name="out")
    b.output(out)
    return layout


# ---------------------------------------------------------------- attention helpers

def to_heads(b, t, heads, hd, seq, name):
    """[1, heads·hd, 1, seq] -> [1, heads, seq, hd]."""
    return b.transpose(x=b.reshape(x=t, shape=[1, heads, hd, seq], name=f"{name}_4"),
                       perm=[0, 1, 3, 2], name=name)


def from_heads(b, t, heads, hd, seq, name):
    """[1, heads, seq, hd] -> [1, heads·hd, 1, seq]."""
    return b.reshape(x=b.transpose(x=t, perm=[0, 1, 3, 2], name=f"{name}_t"),
                     shape=[1, heads * hd, 1, seq], name=name)


def repeat_kv(b, t, cfg, name):
    """[1, kv_heads, S, hd] -> [1, heads, S, hd]; query head h reads kv head h // gqa_ratio.

    The one GQA mapping of the whole pipeline: forward and backward kernels both use this.
    """
    r = cfg.gqa_ratio
    if r == 1:
        return t
    flat = b.reshape(x=t, shape=[1, cfg.kv_heads, 1, cfg.seq * cfg.head_dim], name=f"{name}_f")
    tiled = b.concat(values=(flat,) * r, axis=2, interleave=False, name=f"{name}_c")    # [1,KV,r,S·hd]
    return b.reshape(x=tiled, shape=[1, cfg.heads, cfg.seq, cfg.head_dim], name=name)


def reduce_kv(b, t, cfg, name):
    """The adjoint of repeat_kv: sum the gradients of each kv head's group of query heads."""
    r = cfg.gqa_ratio
    if r == 1:
        return t
    grouped = b.reshape(x=t, shape=[1, cfg.kv_heads, r, cfg.seq * cfg.head_dim], name=f"{name}_g")
    summed = b.reduce_sum(x=grouped, axes=[2], keep_dims=True, name=f"{name}_s")
    return b.reshape(x=summed, shape=[1, cfg.kv_heads, cfg.seq, cfg.head_dim], name=name)


def rope_tables(cfg):
    """cos/sin [hd/2, S] of the angle of pair j (channels 2j, 2j+1 of a head) at position s."""
    j = np.arange(cfg.head_dim // 2)
    angle = cfg.rope_theta ** (-2.0 * j / cfg.head_dim)[:, None] * np.arange(cfg.seq)[None, :]
    return np.cos(angle), np.sin(angle)


def rope_consts(b, cfg, sign=1):
    """The cos and sign·sin tables [1, 1, hd/2, S] as BLOBFILE constants (sign -1: the inverse
    rotation, which is also RoPE's backward)."""
    cos, sin = rope_tables(cfg)
    return (b.weight(cos.reshape(1, 1, *cos.shape), "rope_cos.bin", name="rope_cos"),
            b.weight(sign * sin.reshape(1, 1, *sin.shape), "rope_sin.bin", name="rope_sin"))


def rope(b, t, heads, cfg, cos, sin, name):
    """RoPE of channel-first t [1, heads·hd, 1, S]: each pair (a, b) of channels (2j, 2j+1) becomes
    (a·cos − b·sin, b·cos + a·sin) (§3.4). A head's pairs are rows of [1, heads, hd/2, 2S] (a in the
    first S columns, b in the last), so every operand is a view and cos/sin [1,1,hd/2,S] broadcast."""
    half, s = cfg.head_dim // 2, cfg.seq
    pairs = b.reshape(x=t, shape=[1, heads, half, 2 * s], name=f"{name}_p")
    a = b.slice_by_size(x=pairs, begin=[0, 0, 0, 0], size=[1, heads, half, s], name=f"{name}_a")
    c = b.slice_by_size(x=pairs, begin=[0, 0, 0, s], size=[1, heads, half, s], name=f"{name}_b")
    ra = b.sub(x=b.mul(x=a, y=cos, name=f"{name}_ac"), y=b.mul(x=c, y=sin, name=f"{name}_bs"), name=f"{name}_ra")
    rb = b.add(x=b.mul(x=c, y=cos, name=f"{name}_bc"), y=b.mul(x=a, y=sin, name=f"{name}_as"), name=f"{name}_rb")
    rotated = b.concat(values=(ra, rb), axis=3, interleave=False, name=f"{name}_r")
    return b.reshape(x=rotated, shape=[1, heads * cfg.head_dim, 1, s], name=name)


def scaled_heads(b, t, heads, cfg, name):
    """t/√hd as heads: [1, heads·hd, 1, S] -> [1, heads, S, hd]. Scaling q (or k) rather than the
    scores costs S×hd instead of S×S multiplies, on contiguous data (exact in fp16 for power-of-two
    scales such as hd = 64's 1/8)."""
    scaled = b.mul(x=t, y=1.0 / np.sqrt(cfg.head_dim), name=f"{name}_s")
    return to_heads(b, scaled, heads, cfg.head_dim, cfg.seq, name)


def causal_probs(b, q_scaled, k, mask, name):
    """softmax((q/√hd)·kᵀ + mask) over keys: explicit matmul + additive mask, since SDPA ignores masks."""
    scores = b.matmul(x=q_scaled, y=k, transpose_x=False, transpose_y=True, name=f"{name}_qk")
    return b.softmax(x=b.add(x=scores, y=mask, name=f"{name}_m"), axis=-1, name=name)


def rmsnorm(b, x, w, eps, name):
    """RMSNorm over the channels of x [1,C,1,S], as the reference's static pipeline runs it on the
    ANE (§3.4): x², sum over channels, ×1/C, +eps, pow −0.5 (the compiler rejects rsqrt), x·inv, ×w
    [1,C,1,1]. Returns the result and inv [1,1,1,S], which the backward needs."""
    ss = b.reduce_sum(x=b.mul(x=x, y=x, name=f"{name}_sq"), axes=[1], keep_dims=True, name=f"{name}_ss")
    mean = b.add(x=b.mul(x=ss, y=1.0 / x.type.shape[1], name=f"{name}_ms"), y=eps, name=f"{name}_eps")
    inv = b.pow(x=mean, y=-0.5, name=f"{name}_inv")
    return b.mul(x=b.mul(x=x, y=inv, name=f"{name}_xhat"), y=w, name=name), inv


def rmsnorm_backward(b, x, inv, w, dy, name):
    """The backward of y = x·inv·w over the channels of [1,C,1,S] tensors: dx = inv·(w·dy −
    x̂·Σ_c(w·dy·x̂)/C) with x̂ = x·inv; also dy ⊙ x̂, whose sum over positions is w's gradient."""
    xhat = b.mul(x=x, y=inv, name=f"{name}_xhat")
    wdy = b.mul(x=dy, y=w, name=f"{name}_wdy")
    dot = b.reduce_sum(x=b.mul(x=wdy, y=xhat, name=f"{name}_p"), axes=[1], keep_dims=True, name=f"{name}_ps")
    proj = b.mul(x=xhat, y=b.mul(x=dot, y=1.0 / x.type.shape[1], name=f"{name}_pm"), name=f"{name}_proj")
    dx = b.mul(x=b.sub(x=wdy, y=proj, name=f"{name}_c"), y=inv, name=name)
    return dx, b.mul(x=dy, y=xhat, name=f"{name}_g")


def packed_column(b, x, lay, name):
    """The one-column segment `name` of packed x, [1,C,1,1] (an RMSNorm weight)."""
    return b.slice_by_size(x=x, begin=[0, 0, 0, lay[name][0]], size=[1, x.type.shape[1], 1, 1], name=name)


def attention_consts(b, cfg):
    mask = np.where(np.tril(np.ones((cfg.seq, cfg.seq), bool)), 0.0, -65504.0).reshape(1, 1, cfg.seq, cfg.seq)
    return b.weight(mask, "mask.bin", name="mask")


# ---------------------------------------------------------------- the ten kernels (§4.2)

def sdpa_fwd_inputs(cfg):
    """sdpaFwd's packed input: rms_att, Wqᵀ, Wkᵀ, Wvᵀ (qBwd reads rms_att)."""
    return dict(rms=1, wq=cfg.q_dim, wk=cfg.kv_dim, wv=cfg.kv_dim)


def sdpa_fwd_outputs(cfg):
    """sdpaFwd's output segments in order, {name: channels}: other kernels read them in place."""
    return dict(attn=cfg.q_dim, q=cfg.q_dim, k=cfg.kv_dim, v=cfg.kv_dim, probs=cfg.heads * cfg.seq, xn=cfg.dim, xn_inv=1)


def sdpa_fwd(cfg, dialect="ios18", dtype="fp16"):
    """RMSNorm of the layer input, then Wqᵀ/Wkᵀ/Wvᵀ -> attention output; also RoPE'd Q and K, V, the
    probabilities [H·S, S] saved for the backward (which then needs no second Q·Kᵀ and softmax),
    xnorm and its 1/rms. The layer input is read in place from input "prev": the layer below's
    ffnFused output (for the first layer, a surface of that layout holding the embedding)."""
    b = Builder(dialect, dtype)
    s, d = cfg.seq, cfg.dim
    x, lay = packed_input(b, d, **sdpa_fwd_inputs(cfg))
    (act,), prev_in = input_segments(b, "prev", 1, s, ffn_fused_outputs(cfg), "x_next")
    xn, inv = rmsnorm(b, act, packed_column(b, x, lay, "rms"), cfg.norm_eps, "xn")
    proj = {n: packed_matmul(b, xn, x, d, lay[n][1], s, lay[n][0], n) for n in ("wq", "wk", "wv")}
    cos, sin = rope_consts(b, cfg)
    q_rope = rope(b, proj["wq"], cfg.heads, cfg, cos, sin, "q_rope")
    k_rope = rope(b, proj["wk"], cfg.kv_heads, cfg, cos, sin, "k_rope")
    k = to_heads(b, k_rope, cfg.kv_heads, cfg.head_dim, s, "k")
    v = to_heads(b, proj["wv"], cfg.kv_heads, cfg.head_dim, s, "v")
    probs = causal_probs(b, scaled_heads(b, q_rope, cfg.heads, cfg, "q"), repeat_kv(b, k, cfg, "k_rep"),
                         attention_consts(b, cfg), "probs")
    attn = b.matmul(x=probs, y=repeat_kv(b, v, cfg, "v_rep"), transpose_x=False, transpose_y=False, name="pv")
    out = channel_output(b, attn=from_heads(b, attn, cfg.heads, cfg.head_dim, s, "attn"),
                         q=q_rope, k=k_rope, v=proj["wv"],
                         probs=b.reshape(x=probs, shape=[1, cfg.heads * s, 1, s], name="probs_out"),
                         xn=xn, xn_inv=inv)
    assert out == segments(**sdpa_fwd_outputs(cfg))[0]
    return Kernel("sdpaFwd", b, {"x": (3, lay), **prev_in}, out)


def wo_fwd(cfg, dialect="ios18", dtype="fp16"):
    """The attention's residual x2 = x + α·Wo·attn: x holds only Woᵀ [q_dim, dim]; attn is read in
    place from input "fwd" (the layer's sdpaFwd output), the layer input x from "prev" (as sdpaFwd's)."""
    b = Builder(dialect, dtype)
    s = cfg.seq
    x, lay = packed_input(b, cfg.q_dim, w=cfg.dim)
    (attn,), fwd_in = input_segments(b, "fwd", 1, s, sdpa_fwd_outputs(cfg), "attn")
    (act,), prev_in = input_segments(b, "prev", 1, s, ffn_fused_outputs(cfg), "x_next")
    o = packed_matmul(b, attn, x, cfg.q_dim, cfg.dim, s, lay["w"][0], "o")
    x2 = b.add(x=act, y=b.mul(x=o, y=cfg.alpha, name="o_a"), name="x2")
    return Kernel("woFwd", b, {"x": (3, lay), **fwd_in, **prev_in}, channel_output(b, x2=x2))


def ffn_fused_outputs(cfg):
    """ffnFused's output segments in order, {name: channels}: ffnBwdW13t reads h1 and h3 in place."""
    return dict(x_next=cfg.dim, h1=cfg.hidden, h3=cfg.hidden, gate=cfg.hidden, x2=cfg.dim, x2n=cfg.dim, x2n_inv=1)


def ffn_fused(cfg, dialect="ios18", dtype="fp16"):
    """x2norm = RMSNorm(x2), x_next = x2 + α·W2·(silu(W1·x2norm) ⊙ W3·x2norm); also returns h1, h3,
    the gate, x2, x2norm and its 1/rms. x2 is read in place from input "wo", woFwd's output."""
    b = Builder(dialect, dtype)
    s, d, h = cfg.seq, cfg.dim, cfg.hidden
    x, lay = packed_input(b, d, rms=1, w1=h, w3=h, w2=h)
    (x2,), wo_in = input_segments(b, "wo", 1, s, {"x2": d}, "x2")
    x2n, inv = rmsnorm(b, x2, packed_column(b, x, lay, "rms"), cfg.norm_eps, "x2n")
    h1 = packed_matmul(b, x2n, x, d, h, s, lay["w1"][0], "h1")
    h3 = packed_matmul(b, x2n, x, d, h, s, lay["w3"][0], "h3")
    gate = b.mul(x=b.mul(x=h1, y=b.sigmoid(x=h1, name="sig"), name="silu"), y=h3, name="gate")
    w2 = b.reshape(x=b.slice_by_size(x=x, begin=[0, 0, 0, lay["w2"][0]], size=[1, d, 1, h], name="w2"),
                   shape=[1, 1, d, h], name="w2m")                   # raw W2 [dim, hidden]
    ffn = b.matmul(x=w2, y=b.reshape(x=gate, shape=[1, 1, h, s], name="gm"), transpose_x=False,
                   transpose_y=False, name="ffn")                    # [1,1,dim,S]
    x_next = b.add(x=x2, y=b.mul(x=b.reshape(x=ffn, shape=[1, d, 1, s], name="ffn4"), y=cfg.alpha, name="ffn_a"),
                   name="x_next")
    out = channel_output(b, x_next=x_next, h1=h1, h3=h3, gate=gate, x2=x2, x2n=x2n, x2n_inv=inv)
    assert out == segments(**ffn_fused_outputs(cfg))[0]
    return Kernel("ffnFused", b, {"x": (3, lay), **wo_in}, out)


def q_bwd_outputs(cfg):
    return dict(dy=cfg.dim, g=cfg.dim)


def ffn_bwd_w2t(cfg, dialect="ios18", dtype="fp16"):
    """dgate = W2ᵀ·(α·dy), with raw W2 [dim, hidden] in x. dy, the gradient of the layer's output,
    is read in place from input "dy": the layer above's qBwd output (for the top layer, a surface of
    that layout where the CPU writes the loss's gradient)."""
    b = Builder(dialect, dtype)
    x, lay = packed_input(b, cfg.dim, w=cfg.hidden)
    (dy,), dy_in = input_segments(b, "dy", 1, cfg.seq, q_bwd_outputs(cfg), "dy")
    dffn = b.mul(x=dy, y=cfg.alpha, name="dffn")
    dgate = packed_matmul(b, dffn, x, cfg.dim, cfg.hidden, cfg.seq, lay["w"][0], "dgate")
    return Kernel("ffnBwdW2t", b, {"x": (3, lay), **dy_in}, channel_output(b, dgate=dgate))


def ffn_bwd_w13t_outputs(cfg):
    return dict(dx=cfg.dim, dh1=cfg.hidden, dh3=cfg.hidden)


def ffn_bwd_w13t(cfg, dialect="ios18", dtype="fp16"):
    """The SiLU-gate backward, dh1 = dgate·h3·σ(h1)·(1 + h1·(1 − σ(h1))) and dh3 = dgate·h1·σ(h1), then
    dx = W1ᵀ·dh1 + W3ᵀ·dh3; outputs dx, dh1 and dh3 (for dW1, dW3). Raw W1 and W3 [hidden, dim] are
    in two inputs, x1 and x3, so that no input is much larger than the activation surfaces it is
    read with (they all take the largest one's allocation size); "dgate" is ffnBwdW2t's output
    surface and "ffn" the layer's ffnFused output (h1, h3), both read in place."""
    b = Builder(dialect, dtype)
    s, d, h = cfg.seq, cfg.dim, cfg.hidden
    x1, lay1 = packed_input(b, h, "x1", w1=d)
    x3, lay3 = packed_input(b, h, "x3", w3=d)
    (dgate,), dgate_in = input_segments(b, "dgate", 1, s, {"dgate": h}, "dgate")
    (h1, h3), ffn_in = input_segments(b, "ffn", 1, s, ffn_fused_outputs(cfg), "h1", "h3")
    sig = b.sigmoid(x=h1, name="sig")
    g_sig = b.mul(x=dgate, y=sig, name="g_sig")
    dh3 = b.mul(x=g_sig, y=h1, name="dh3")
    slope = b.add(x=b.mul(x=h1, y=b.sub(x=1.0, y=sig, name="one_m_sig"), name="h1_oms"), y=1.0, name="slope")
    dh1 = b.mul(x=b.mul(x=g_sig, y=h3, name="g_sig_h3"), y=slope, name="dh1")
    dx = b.add(x=packed_matmul(b, dh1, x1, h, d, s, 0, "t1"), y=packed_matmul(b, dh3, x3, h, d, s, 0, "t3"), name="dx")
    out = channel_output(b, dx=dx, dh1=dh1, dh3=dh3)
    assert out == segments(**ffn_bwd_w13t_outputs(cfg))[0]
    return Kernel("ffnBwdW13t", b, {"x1": (3, lay1), "x3": (3, lay3), **dgate_in, **ffn_in}, out, own=("x1", "x3"))


def wot_bwd_outputs(cfg):
    return dict(da=cfg.q_dim, dx2=cfg.dim, g=cfg.dim)


def wot_bwd(cfg, dialect="ios18", dtype="fp16"):
    """The backward of the FFN's RMSNorm and of the residual, dx2 = RMSNorm'(x2)·dx_ffn + dy, then
    da = Woᵀ·(α·dx2); outputs da, dx2 and dx_ffn ⊙ x̂2 (rms_ffn's gradient, summed over positions).
    x holds rms_ffn and raw Wo [dim, q_dim]; dy (input "dy", as ffnBwdW2t's), x2 and its 1/rms
    (ffnFused's output) and dx_ffn (ffnBwdW13t's) are read in place."""
    b = Builder(dialect, dtype)
    s, d = cfg.seq, cfg.dim
    x, lay = packed_input(b, d, rms=1, w=cfg.q_dim)
    (dy,), dy_in = input_segments(b, "dy", 1, s, q_bwd_outputs(cfg), "dy")
    (x2, inv), ffn_in = input_segments(b, "ffn", 1, s, ffn_fused_outputs(cfg), "x2", "x2n_inv")
    (dx_ffn,), w13_in = input_segments(b, "w13", 1, s, ffn_bwd_w13t_outputs(cfg), "dx")
    dx2n, g = rmsnorm_backward(b, x2, inv, packed_column(b, x, lay, "rms"), dx_ffn, "dx2n")
    dx2 = b.add(x=dx2n, y=dy, name="dx2")
    da = packed_matmul(b, b.mul(x=dx2, y=cfg.alpha, name="dx2a"), x, d, cfg.q_dim, s, lay["w"][0], "da")
    out = channel_output(b, da=da, dx2=dx2, g=g)
    assert out == segments(**wot_bwd_outputs(cfg))[0]
    return Kernel("wotBwd", b, {"x": (3, lay), **dy_in, **ffn_in, **w13_in}, out)


def q_bwd(cfg, dialect="ios18", dtype="fp16"):
    """The attention's input gradient dx_attn = Wqᵀ·dq + dx_kv, then the backward of its RMSNorm and
    of the residual: dy = RMSNorm'(x)·dx_attn + dx2, the gradient of the layer's input; also
    dx_attn ⊙ x̂ (rms_att's gradient, summed over positions). x holds raw Wq [q_dim, dim]; dq
    (sdpaBwd2's output), dx_kv (kvBwd's), the layer input and rms_att (sdpaFwd's input), its 1/rms
    (sdpaFwd's output) and dx2 (wotBwd's) are read in place."""
    b = Builder(dialect, dtype)
    s, d = cfg.seq, cfg.dim
    x, lay = packed_input(b, cfg.q_dim, w=d)
    (dq,), bwd2_in = input_segments(b, "bwd2", 1, s, sdpa_bwd2_outputs(cfg), "dq")
    (dx_kv,), kv_in = input_segments(b, "kv", 1, s, {"dx": d}, "dx")
    (w_rms,), att_in = input_segments(b, "att", 3, d, sdpa_fwd_inputs(cfg), "rms")
    (act,), prev_in = input_segments(b, "prev", 1, s, ffn_fused_outputs(cfg), "x_next")
    (inv,), fwd_in = input_segments(b, "fwd", 1, s, sdpa_fwd_outputs(cfg), "xn_inv")
    (dx2,), wot_in = input_segments(b, "wot", 1, s, wot_bwd_outputs(cfg), "dx2")
    dx_attn = b.add(x=packed_matmul(b, dq, x, cfg.q_dim, d, s, lay["w"][0], "dxq"), y=dx_kv, name="dx_attn")
    dxn, g = rmsnorm_backward(b, act, inv, w_rms, dx_attn, "dxn")
    out = channel_output(b, dy=b.add(x=dxn, y=dx2, name="dy"), g=g)
    assert out == segments(**q_bwd_outputs(cfg))[0]
    return Kernel("qBwd", b, {"x": (3, lay), **bwd2_in, **kv_in, **att_in, **prev_in, **fwd_in, **wot_in}, out)


def kv_bwd(cfg, dialect="ios18", dtype="fp16"):
    """dx = Wkᵀ·dk + Wvᵀ·dv, with raw Wk, Wv [kv_dim, dim] in x; dk (sdpaBwd2's output) and dv
    (sdpaBwd1's) are read in place."""
    b = Builder(dialect, dtype)
    s, d = cfg.seq, cfg.dim
    x, lay = packed_input(b, cfg.kv_dim, wk=d, wv=d)
    (dk,), bwd2_in = input_segments(b, "bwd2", 1, s, sdpa_bwd2_outputs(cfg), "dk")
    (dv,), bwd1_in = input_segments(b, "bwd1", 1, s, sdpa_bwd1_outputs(cfg), "dv")
    dx = b.add(x=packed_matmul(b, dk, x, cfg.kv_dim, d, s, lay["wk"][0], "tk"),
               y=packed_matmul(b, dv, x, cfg.kv_dim, d, s, lay["wv"][0], "tv"), name="dx")
    return Kernel("kvBwd", b, {"x": (3, lay), **bwd2_in, **bwd1_in}, channel_output(b, dx=dx))


def sdpa_bwd1_outputs(cfg):
    return dict(dv=cfg.kv_dim, dp=cfg.heads * cfg.seq)


def sdpa_bwd1(cfg, dialect="ios18", dtype="fp16"):
    """With the forward's probs: dV = probsᵀ·da (summed per kv head) and dp = da·Vᵀ. Inputs are whole
    output surfaces, read in place: "fwd" is sdpaFwd's (probs, V), "da" wotBwd's."""
    b = Builder(dialect, dtype)
    s, hd, hs = cfg.seq, cfg.head_dim, cfg.heads * cfg.seq
    (da,), da_in = input_segments(b, "da", 1, s, wot_bwd_outputs(cfg), "da")
    (v, probs), fwd_in = input_segments(b, "fwd", 1, s, sdpa_fwd_outputs(cfg), "v", "probs")
    probs = b.reshape(x=probs, shape=[1, cfg.heads, s, s], name="probs")
    da = to_heads(b, da, cfg.heads, hd, s, "da_h")
    v = repeat_kv(b, to_heads(b, v, cfg.kv_heads, hd, s, "v_h"), cfg, "v_rep")
    dv = reduce_kv(b, b.matmul(x=probs, y=da, transpose_x=True, transpose_y=False, name="dv_full"), cfg, "dv")
    dp = b.matmul(x=da, y=v, transpose_x=False, transpose_y=True, name="dp")        # [1,H,S,S]
    out = channel_output(b, dv=from_heads(b, dv, cfg.kv_heads, hd, s, "dv_out"),
                         dp=b.reshape(x=dp, shape=[1, hs, 1, s], name="dp_out"))
    assert out == segments(**sdpa_bwd1_outputs(cfg))[0]
    return Kernel("sdpaBwd1", b, {**da_in, **fwd_in}, out)


def sdpa_bwd2_outputs(cfg):
    return dict(dq=cfg.q_dim, dk=cfg.kv_dim)


def sdpa_bwd2(cfg, dialect="ios18", dtype="fp16"):
    """ds = probs ⊙ (dp − rowsum(probs ⊙ dp)); dQ = ds·K/√hd, dK = dsᵀ·Q/√hd (summed per kv head),
    the scale on the S×hd operands rather than the S×S ds; then RoPE's backward (the inverse
    rotation), so dQ and dK are the gradients of the projections Wq·x and Wk·x. The row sums come
    from S×hd values, not S×S: Σ_j probs_ij·dp_ij = da_i·attn_i, since dp = da·Vᵀ and attn =
    probs·V. Inputs are whole output surfaces, read in place: "fwd" is sdpaFwd's (probs, Q, K, the
    attention output), "bwd1" sdpaBwd1's (dp), "da" wotBwd's (the attention output's gradient)."""
    b = Builder(dialect, dtype)
    s, hd = cfg.seq, cfg.head_dim
    (dp,), bwd1_in = input_segments(b, "bwd1", 1, s, sdpa_bwd1_outputs(cfg), "dp")
    (q, k, probs, attn), fwd_in = input_segments(b, "fwd", 1, s, sdpa_fwd_outputs(cfg), "q", "k", "probs", "attn")
    (da,), da_in = input_segments(b, "da", 1, s, wot_bwd_outputs(cfg), "da")
    probs = b.reshape(x=probs, shape=[1, cfg.heads, s, s], name="probs")
    dp = b.reshape(x=dp, shape=[1, cfg.heads, s, s], name="dp")
    q = scaled_heads(b, q, cfg.heads, cfg, "q_h")
    k = repeat_kv(b, scaled_heads(b, k, cfg.kv_heads, cfg, "k_h"), cfg, "k_rep")
    dot = b.reshape(x=b.mul(x=da, y=attn, name="da_attn"), shape=[1, cfg.heads, hd, s], name="da_attn_h")
    rowsum = b.transpose(x=b.reduce_sum(x=dot, axes=[2], keep_dims=True, name="rowsum_t"), perm=[0, 1, 3, 2],
                         name="rowsum")                                              # [1,H,S,1]
    centered = b.sub(x=dp, y=rowsum, name="centered")
    ds = b.mul(x=probs, y=centered, name="ds")
    dq = b.matmul(x=ds, y=k, transpose_x=False, transpose_y=False, name="dq_h")
    dk = reduce_kv(b, b.matmul(x=ds, y=q, transpose_x=True, transpose_y=False, name="dk_full"), cfg, "dk")
    cos, sin = rope_consts(b, cfg, sign=-1)
    dq = rope(b, from_heads(b, dq, cfg.heads, hd, s, "dq_r"), cfg.heads, cfg, cos, sin, "dq")
    dk = rope(b, from_heads(b, dk, cfg.kv_heads, hd, s, "dk_r"), cfg.kv_heads, cfg, cos, sin, "dk_out")
    out = channel_output(b, dq=dq, dk=dk)
    assert out == segments(**sdpa_bwd2_outputs(cfg))[0]
    return Kernel("sdpaBwd2", b, {**bwd1_in, **fwd_in, **da_in}, out)


KERNELS = dict(sdpaFwd=sdpa_fwd, woFwd=wo_fwd, ffnFused=ffn_fused, ffnBwdW2t=ffn_bwd_w2t, ffnBwdW13t=ffn_bwd_w13t,
               wotBwd=wot_bwd, sdpaBwd1=sdpa_bwd1, sdpaBwd2=sdpa_bwd2, qBwd=q_bwd, kvBwd=kv_bwd)
