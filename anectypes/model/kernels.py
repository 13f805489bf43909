"""MIL generators for the dynamic-weight kernels (docs/ane-reference.md §3.4, §4.2).

Weights travel as input data, packed in the spatial dimension of a kernel's own inputs, so each
kernel compiles once per run and new weights only need new input data. Activations and gradients
come from other kernels' surfaces, bound as further inputs and read in place. Each kernel's own
inputs, the sources of the others and its output's layout are declared once, in `wiring`: the
generators build from it, the transformer binds by it. `dynamic_matmul` is the reference's
single-input form. The ten kernels stay in one module (past 450 lines) because they share that wiring and
their helpers, and read best side by side: one kernel's outputs are the next one's inputs.
"""

from typing import NamedTuple

import numpy as np

from ..mil import Builder
from .config import rope_tables


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


def raw_matmul(b, x, at, rows, cols, act, prefix):
    """y[1,rows,1,seq] = M·act for act [1,cols,1,seq] and the rows×cols matrix M in the first `rows` channels
    of x's spatial [at, at+cols) (channel i carries row i of M, untransposed)."""
    seq = act.type.shape[3]
    m = b.reshape(x=b.slice_by_size(x=x, begin=[0, 0, 0, at], size=[1, rows, 1, cols], name=f"{prefix}_w"),
                  shape=[1, 1, rows, cols], name=f"{prefix}_wm")
    y = b.matmul(x=m, y=b.reshape(x=act, shape=[1, 1, cols, seq], name=f"{prefix}_act"), transpose_x=False,
                 transpose_y=False, name=f"{prefix}_mm")
    return b.reshape(x=y, shape=[1, rows, 1, seq], name=prefix)


def dynamic_matmul_kernel(ic, oc, seq, dialect="ios18", dtype="fp16"):
    """A one-op kernel: input x [1, ic, 1, seq+oc] (activation, then weight), output y [1, oc, 1, seq]."""
    b = Builder(dialect, dtype)
    x = b.input("x", [1, ic, 1, seq + oc])
    b.output(dynamic_matmul(b, x, ic, oc, seq, 0, seq, "mm"))
    return b


# ---------------------------------------------------------------- wiring: layouts and sources

class Wiring(NamedTuple):
    """How one kernel is wired (declared in `wiring`, the one place).

    `own`: the inputs that hold its weights packed along the spatial axis (3), {input: (channels,
    {segment: width})}. `reads`: the inputs bound to another kernel's surface and read in place (no
    copies), {input: (kernel, which)}, where `which` is "out" (that kernel's output surface for the
    same layer), "below" (its output for the layer below; for the first layer `bottom`, where the
    CPU writes the embedding), "above" (its output for the layer above; for the top layer `top`,
    where the CPU writes the loss's gradient) or one of its own inputs (that surface, same layer).
    `out`: its output's segments along the channels (axis 1), in order, {segment: channels}.
    """
    own: dict
    reads: dict
    out: dict


class Kernel:
    """A compiled-once kernel: its MIL, its BLOBFILE constants and where each tensor sits.

    `inputs` maps each input to (axis, {segment: (start, size)}): its own inputs (`own`) are packed
    along the spatial axis (3); the inputs it reads in place (`reads`, {input: (kernel, which)}) are
    another kernel's output (channel segments, axis 1) or packed input (axis 3). `outputs` are the
    output's channel segments, {name: (start, size)}.
    """

    def __init__(self, name, builder, inputs, outputs, wired):
        self.name, self.own, self.reads = name, tuple(wired.own), wired.reads
        self.text, self.weights = builder.text(), builder.weights()
        self.inputs, self.outputs = inputs, outputs
        fn = builder.fn
        self.in_shapes = {v.name: v.type.shape for v in fn.inputs}
        self.out_shape = fn.outputs[0].type.shape

    def own_segments(self):
        """The segments of its own inputs (packed along the spatial axis)."""
        return [seg for name in self.own for seg in self.inputs[name][1]]

    def input_of(self, segment):
        """The name of the input that holds a segment."""
        holders = [name for name, (_, layout) in self.inputs.items() if segment in layout]
        if len(holders) != 1:
            raise KeyError(f"kernel {self.name} has {'no' if not holders else 'more than one'} input segment '{segment}'")
        return holders[0]

    def index(self, segment):
        """Where a segment sits in its input: a [C, size] (spatial packing) or [size, S] (channels)
        block, for `Surface.write(value, index)`, or `a[index]` inside `Surface.writing()`."""
        axis, layout = self.inputs[self.input_of(segment)]
        start, size = layout[segment]
        part = slice(start, start + size)
        return (0, slice(None), 0, part) if axis == 3 else (0, part, 0, slice(None))

    def chunks(self, segment, rows):
        """Where each chunk of an adapter's matrix [rows, rank] held in `segment` sits (see row_chunks):
        (first row, rows, index of its [rows, rank] block)."""
        holder = self.input_of(segment)
        start, width = self.inputs[holder][1][segment]
        parts = row_chunks(rows, self.in_shapes[holder][1])
        rank = width // len(parts)
        return [(lo, n, (0, slice(0, n), 0, slice(start + k * rank, start + (k + 1) * rank)))
                for k, (lo, n) in enumerate(parts)]

    def out_index(self, name):
        """Where an output segment sits in the output: a [size, S] block."""
        start, size = self.outputs[name]
        return 0, slice(start, start + size), 0, slice(None)

    def output(self, surface, name):
        return surface[self.out_index(name)]


def row_chunks(rows, channels):
    """A matrix of `rows` rows in an input of `channels` channels, as chunks of at most `channels` rows placed side
    by side along the spatial axis: (first row, rows) of each."""
    return [(lo, min(channels, rows - lo)) for lo in range(0, rows, channels)]


def segments(**sizes):
    out, at = {}, 0
    for name, size in sizes.items():
        out[name] = (at, size)
        at += size
    return out, at


SLOT = 32      # fp16 elements: every maderix input width is a multiple of it, where packed and padded rows agree (§1.6)


def packed_layout(channels, widths):
    """A packed input's layout {segment: (start, width)} and its shape [1, channels, 1, total]: each segment in a
    slot of its width rounded up to SLOT (a norm weight's one column in a 32-wide one), so that every start and
    the total are multiples of SLOT; the slots' padding is never read."""
    layout, total = segments(**{name: -(-w // SLOT) * SLOT for name, w in widths.items()})
    return {name: (start, widths[name]) for name, (start, _) in layout.items()}, [1, channels, 1, total]


class KernelBuilder:
    """The MIL builder of one kernel, wired as `wiring(cfg)` declares it: it makes the declared
    inputs, slices what the kernel reads out of the declared layouts of the surfaces it reads, and
    checks the output against the declared one. An inconsistency raises ValueError."""

    def __init__(self, name, cfg, dialect, dtype, lora=None):
        self.name, self.seq, self.b, self.lora = name, cfg.seq, Builder(dialect, dtype), lora
        self.wirings = wiring(cfg, lora)
        self.wired, self.inputs = self.wirings[name], {}

    def fail(self, why):
        raise ValueError(f"kernel {self.name}: {why}")

    def packed(self, name):
        """Own input `name` [1, channels, 1, Σ widths] and its layout {segment: (start, width)}."""
        if name not in self.wired.own:
            self.fail(f"no own input '{name}' declared")
        layout, shape = packed_layout(*self.wired.own[name])
        self.inputs[name] = (3, layout)
        return self.b.input(name, shape), layout

    def read(self, name, *wanted):
        """The wanted segments of input `name`: the surface its declared source holds, laid out as
        that source declares it, read in place."""
        x, axis, layout = self.bind(name)
        if missing := [seg for seg in wanted if seg not in layout]:
            kernel, which = self.wired.reads[name]
            self.fail(f"input '{name}' ({kernel}, {which}) has no segment {', '.join(missing)}")
        shape = x.type.shape

        def part(seg):
            begin, size = [0, 0, 0, 0], list(shape)
            begin[axis], size[axis] = layout[seg]
            return self.b.slice_by_size(x=x, begin=begin, size=size, name=f"{name}_{seg}")
        return [part(seg) for seg in wanted]

    def weights(self, name):
        """Input `name`, another kernel's packed input read in place whole (the weights a forward kernel holds,
        which a backward kernel multiplies by the other side), and its layout {segment: (start, width)}."""
        x, axis, layout = self.bind(name)
        if axis != 3:
            self.fail(f"input '{name}' reads an output, not a packed input")
        return x, layout

    def bind(self, name):
        """Input `name`, bound to its declared source: (the input, the axis its segments lie along, their layout)."""
        if name not in self.wired.reads:
            self.fail(f"no input '{name}' declared to read")
        kernel, which = self.wired.reads[name]
        source = self.wirings.get(kernel)
        if source is None or which not in ("out", "below", "above", *source.own):
            self.fail(f"input '{name}' reads ({kernel}, {which}), which no kernel declares")
        if which in source.own:
            axis, (layout, shape) = 3, packed_layout(*source.own[which])
        else:
            axis, (layout, total) = 1, segments(**source.out)
            shape = [1, total, 1, self.seq]
        self.inputs[name] = (axis, layout)
        return self.b.input(name, shape), axis, layout

    def projection(self, act, x, lay, seg, n_in, n_out, prefix, transposed=True, backward=False):
        """A weight W [n_out, n_in] held in segment `seg` of packed x (as Wᵀ [n_in, n_out] when `transposed`, the
        forward kernels' layout, §4.2; else as W, ffnFused's W2) times act: W·act [1,n_out,1,S], or with `backward`
        Wᵀ·act [1,n_in,1,S] (the input's gradient: a backward kernel reads the weights a forward kernel holds).
        Where x holds W's LoRA adapter, Aᵀ [n_in, rank] in segment seg_1 and B [n_out, rank] in seg_2 (each in
        chunks, see low_rank), its scale·B·(A·act), or scale·Aᵀ·(Bᵀ·act), is added."""
        rows, cols = (n_in, n_out) if transposed else (n_out, n_in)
        if transposed == backward:                               # the matrix as it lies: M·act
            y = raw_matmul(self.b, x, lay[seg][0], rows, cols, act, prefix)
        else:                                                    # Mᵀ·act
            y = packed_matmul(self.b, act, x, rows, cols, self.seq, lay[seg][0], prefix)
        if f"{seg}_1" not in lay:
            return y
        first, second = ((f"{seg}_2", n_out), (f"{seg}_1", n_in)) if backward else ((f"{seg}_1", n_in), (f"{seg}_2", n_out))
        low = self.low_rank(x, lay, *second, self.low_rank_t(x, lay, *first, act, f"{prefix}_l1"), f"{prefix}_l2")
        return self.b.add(x=y, y=self.b.mul(x=low, y=self.lora.scale, name=f"{prefix}_ls"), name=f"{prefix}_l")

    def low_rank(self, x, lay, seg, rows, act, prefix):
        """M·act [1,rows,1,S] for an adapter's M [rows, rank] in segment `seg` of packed x: its chunks of as many rows
        as x has channels side by side (row_chunks), so that a rank-wide matrix takes rank-wide columns whatever its
        length; their products concatenated along the channels."""
        r, at = self.lora.rank, lay[seg][0]
        parts = tuple(raw_matmul(self.b, x, at + k * r, n, r, act, f"{prefix}_{k}")
                      for k, (_, n) in enumerate(row_chunks(rows, x.type.shape[1])))
        return parts[0] if len(parts) == 1 else self.b.concat(values=parts, axis=1, interleave=False, name=prefix)

    def low_rank_t(self, x, lay, seg, rows, act, prefix):
        """Mᵀ·act [1,rank,1,S] for M [rows, rank] held as low_rank's: each chunk's product with its rows of act
        [1,rows,1,S], summed."""
        r, at, s = self.lora.rank, lay[seg][0], self.seq
        total = None
        for k, (lo, n) in enumerate(row_chunks(rows, x.type.shape[1])):
            part = act if n == rows else self.b.slice_by_size(x=act, begin=[0, lo, 0, 0], size=[1, n, 1, s],
                                                              name=f"{prefix}_{k}a")
            y = packed_matmul(self.b, part, x, n, r, s, at + k * r, f"{prefix}_{k}")
            total = y if total is None else self.b.add(x=total, y=y, name=f"{prefix}_{k}s")
        return total

    def output(self, **tensors):
        """The kernel with [1,c,1,S] results `tensors`, concatenated along the channels into its single
        output in the declared order and sizes."""
        got = {n: list(t.type.shape) for n, t in tensors.items()}
        want = {n: [1, c, 1, self.seq] for n, c in self.wired.out.items()}
        if list(got.items()) != list(want.items()):
            self.fail(f"outputs {got} differ from the declared {want}")
        if unused := set(self.wired.own).union(self.wired.reads).difference(self.inputs):
            self.fail(f"declared input{'s' if len(unused) > 1 else ''} {', '.join(sorted(unused))} not used")
        out = tensors[next(iter(tensors))] if len(tensors) == 1 else \
            self.b.concat(values=tuple(tensors.values()), axis=1, interleave=False, name="out")
        self.b.output(out)
        return Kernel(self.name, self.b, self.inputs, segments(**self.wired.out)[0], self.wired)


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


def norm_inv(b, x, scale, root_eps, name, axis=1):
    """1/rms of x [1,C,1,S] over its channels (axis 2: over each head's hd of [1,heads,hd,S]), from x squared at
    `scale` (a number, or one per position) so that neither a square nor the sum leaves fp16 (docs/model.md, fp16
    ranges): 1/√(mean((x·scale)²) + (scale·root_eps)²) · scale, which is 1/√(mean(x²) + ε) for root_eps = √ε, as
    the reference's static pipeline computes it on the ANE (§3.4): x², sum over channels, ×1/C, +ε, pow −0.5
    (the compiler rejects rsqrt). root_eps [1,1,1,1] is √ε times the scale x is carried at."""
    xs = b.mul(x=x, y=scale, name=f"{name}_xs")
    ss = b.reduce_sum(x=b.mul(x=xs, y=xs, name=f"{name}_sq"), axes=[axis], keep_dims=True, name=f"{name}_ss")
    e = b.mul(x=scale, y=root_eps, name=f"{name}_e")
    mean = b.add(x=b.mul(x=ss, y=1.0 / x.type.shape[axis], name=f"{name}_ms"), y=b.mul(x=e, y=e, name=f"{name}_e2"),
                 name=f"{name}_eps")
    return b.mul(x=b.pow(x=mean, y=-0.5, name=f"{name}_invs"), y=scale, name=f"{name}_inv")


def rmsnorm(b, x, w, first, root_eps, name, axis=1):
    """RMSNorm x·inv·w of x [1,C,1,S] by w [1,C,1,1] (axis 2: over each head's hd of x [1,heads,hd,S] by w
    [1,1,hd,1]), inv = 1/rms found twice (norm_inv): at scale `first` (ranges.py chooses it: a power of two per
    layer, times the last norm's 1/rms per position for the stream), then at that first estimate, so that every
    position is squared near 1 whatever its own range. Returns the result and inv (the backward's), [1,1,1,S]
    (axis 2: [1,heads,1,S])."""
    inv = norm_inv(b, x, norm_inv(b, x, first, root_eps, f"{name}_1", axis), root_eps, name, axis)
    return b.mul(x=b.mul(x=x, y=inv, name=f"{name}_xhat"), y=w, name=name), inv


def rmsnorm_backward(b, x, inv, w, dy, name, axis=1):
    """The backward of y = x·inv·w over the channels of [1,C,1,S] tensors (axis 2: over each head's hd,
    as rmsnorm's): dx = inv·(w·dy − x̂·Σ_c(w·dy·x̂)/C) with x̂ = x·inv; also dy ⊙ x̂, whose sum over
    positions (and heads) is w's gradient."""
    xhat = b.mul(x=x, y=inv, name=f"{name}_xhat")
    wdy = b.mul(x=dy, y=w, name=f"{name}_wdy")
    dot = b.reduce_sum(x=b.mul(x=wdy, y=xhat, name=f"{name}_p"), axes=[axis], keep_dims=True, name=f"{name}_ps")
    proj = b.mul(x=xhat, y=b.mul(x=dot, y=1.0 / x.type.shape[axis], name=f"{name}_pm"), name=f"{name}_proj")
    dx = b.mul(x=b.sub(x=wdy, y=proj, name=f"{name}_c"), y=inv, name=name)
    return dx, b.mul(x=dy, y=xhat, name=f"{name}_g")


def packed_column(b, x, lay, name, column=0, channels=None):
    """Column `column` of segment `name` of packed x, [1,C,1,1] (an RMSNorm weight), or its first `channels`."""
    return b.slice_by_size(x=x, begin=[0, 0, 0, lay[name][0] + column], size=[1, channels or x.type.shape[1], 1, 1],
                           name=f"{name}_{column}" if column or channels else name)


def norm_scales(b, x, lay, name):
    """A norm's power-of-two scale ρ and √ε times the scale its input is carried at, [1,1,1,1] each, from channel 0
    of the two columns of segment `name` of packed x (Transformer.stage_scales writes them)."""
    return tuple(packed_column(b, x, lay, name, column, channels=1) for column in (0, 1))


def stream_norm(b, x, w, prev_inv, scales, name):
    """RMSNorm of the residual stream x [1,C,1,S] (rmsnorm), first squared at ρ times `prev_inv` [1,1,1,S], the
    last norm's 1/rms of the stream at each position (a massive activation's position at its own scale)."""
    rho, root_eps = scales
    return rmsnorm(b, x, w, b.mul(x=prev_inv, y=rho, name=f"{name}_first"), root_eps, name)


def head_weight(b, column, cfg, name):
    """A QK-norm weight [1,1,hd,1] from its packed column [1,dim,1,1] (held in the first hd channels)."""
    w = b.slice_by_size(x=column, begin=[0, 0, 0, 0], size=[1, cfg.head_dim, 1, 1], name=f"{name}_c")
    return b.reshape(x=w, shape=[1, 1, cfg.head_dim, 1], name=name)


def head_norm(b, t, heads, w, scales, cfg, name):
    """QK-norm: RMSNorm of each head of t [1, heads·hd, 1, S] over its hd channels, by w [1,1,hd,1], squared at
    `scales` (norm_scales); returns the result [1, heads·hd, 1, S] and inv [1, heads, 1, S]."""
    s = cfg.seq
    y, inv = rmsnorm(b, b.reshape(x=t, shape=[1, heads, cfg.head_dim, s], name=f"{name}_h"), w, *scales, name, axis=2)
    return (b.reshape(x=y, shape=[1, heads * cfg.head_dim, 1, s], name=f"{name}_y"),
            b.reshape(x=inv, shape=[1, heads, 1, s], name=f"{name}_i"))


def head_norm_backward(b, t, inv, w, dy, heads, cfg, name):
    """The backward of head_norm at its input t with inv (both as the forward gave them): the input's
    gradient and dy ⊙ t̂, each [1, heads·hd, 1, S] (w's gradient: summed over positions and heads)."""
    shape, s = [1, heads, cfg.head_dim, cfg.seq], cfg.seq
    dx, g = rmsnorm_backward(b, b.reshape(x=t, shape=shape, name=f"{name}_x"),
                             b.reshape(x=inv, shape=[1, heads, 1, s], name=f"{name}_inv4"), w,
                             b.reshape(x=dy, shape=shape, name=f"{name}_dy"), name, axis=2)
    flat = [1, heads * cfg.head_dim, 1, s]
    return (b.reshape(x=dx, shape=flat, name=f"{name}_dx"), b.reshape(x=g, shape=flat, name=f"{name}_gw"))


def attention_consts(b, cfg):
    mask = np.where(np.tril(np.ones((cfg.seq, cfg.seq), bool)), 0.0, -65504.0).reshape(1, 1, cfg.seq, cfg.seq)
    return b.weight(mask, "mask.bin", name="mask")


# ---------------------------------------------------------------- the ten kernels (§4.2)

def adapter(lora, weight, seg, channels, n_in, n_out):
    """The segments of `weight`'s LoRA adapter beside its segment `seg` in an input of `channels` channels, if it
    has one: seg_1 holds Aᵀ [n_in, rank], seg_2 B [n_out, rank], each in chunks of `channels` rows (see
    KernelBuilder.low_rank)."""
    if not (lora and weight in lora.targets):
        return {}
    width = lambda rows: lora.rank * len(row_chunks(rows, channels))
    return {f"{seg}_1": width(n_in), f"{seg}_2": width(n_out)}


def wiring(cfg, lora=None):
    """Every kernel's wiring (see Wiring), declared once: the generators build their inputs and check
    their output from it, and the transformer binds each request's surfaces by it. With `lora` (a
    model.lora.Lora), the inputs that hold a targeted weight also hold its adapter. The forward kernels hold the
    weights; the backward kernels read them there (so a model's weights are staged once, in one place each)."""
    d, h, q, kv, hs = cfg.dim, cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.heads * cfg.seq

    def ad(weight, seg, channels, n_in, n_out):
        return adapter(lora, weight, seg, channels, n_in, n_out)
    # QK-norm: its weights as two more columns, the norms' inputs and 1/rms saved for sdpaBwd2
    qk = cfg.qk_norm
    return {
        "sdpaFwd": Wiring(own={"x": (d, dict(rms=1, rms_scale=2, wq=q, wk=kv, wv=kv,
                                             **(dict(qn=1, qn_scale=2, kn=1, kn_scale=2) if qk else {}),
                                             **ad("wq", "wq", d, d, q), **ad("wk", "wk", d, d, kv),
                                             **ad("wv", "wv", d, d, kv)))},       # qBwd, kvBwd read it
                          reads={"prev": ("ffnFused", "below")},
                          out=dict(attn=q, q=q, k=kv, v=kv, probs=hs, xn=d, xn_inv=1,
                                   **(dict(q_pre=q, k_pre=kv, q_inv=cfg.heads, k_inv=cfg.kv_heads) if qk else {}))),
        "woFwd": Wiring(own={"x": (q, dict(w=d, **ad("wo", "w", q, q, d)))},
                        reads={"fwd": ("sdpaFwd", "out"), "prev": ("ffnFused", "below")},
                        out=dict(x2=d)),
        # three inputs of about the size of the activations read with them: one request's inputs take the largest
        # one's allocation size (§1.9), and ffnBwdW2t, ffnBwdW13t and wotBwd read them
        "ffnFused": Wiring(own={"w1": (d, dict(rms=1, rms_scale=2, w1=h, **ad("w1", "w1", d, d, h))),
                                "w3": (d, dict(w3=h, **ad("w3", "w3", d, d, h))),
                                "w2": (d, dict(w2=h, **ad("w2", "w2", d, h, d)))},
                           reads={"wo": ("woFwd", "out"), "fwd": ("sdpaFwd", "out")},
                           out=dict(x_next=d, h1=h, h3=h, gate=h, x2=d, x2n=d, x2n_inv=1)),
        "ffnBwdW2t": Wiring(own={},
                            reads={"dy": ("qBwd", "above"), "w": ("ffnFused", "w2")},
                            out=dict(dgate=h)),
        "ffnBwdW13t": Wiring(own={},
                             reads={"dgate": ("ffnBwdW2t", "out"), "ffn": ("ffnFused", "out"), "w1": ("ffnFused", "w1"),
                                    "w3": ("ffnFused", "w3")},
                             out=dict(dx=d, dh1=h, dh3=h)),
        "wotBwd": Wiring(own={},
                         reads={"dy": ("qBwd", "above"), "ffn": ("ffnFused", "out"), "w13": ("ffnBwdW13t", "out"),
                                "w": ("woFwd", "x"), "norm": ("ffnFused", "w1")},
                         out=dict(da=q, dx2=d, g=d)),
        "sdpaBwd1": Wiring(own={},
                           reads={"da": ("wotBwd", "out"), "fwd": ("sdpaFwd", "out")},
                           out=dict(dv=kv, dp=hs)),
        "sdpaBwd2": Wiring(own={},
                           reads={"bwd1": ("sdpaBwd1", "out"), "fwd": ("sdpaFwd", "out"), "da": ("wotBwd", "out"),
                                  **({"att": ("sdpaFwd", "x")} if qk else {})},
                           out=dict(dq=q, dk=kv, **(dict(gq=q, gk=kv) if qk else {}))),
        "qBwd": Wiring(own={},
                       reads={"bwd2": ("sdpaBwd2", "out"), "kv": ("kvBwd", "out"), "att": ("sdpaFwd", "x"),
                              "prev": ("ffnFused", "below"), "fwd": ("sdpaFwd", "out"), "wot": ("wotBwd", "out")},
                       out=dict(dy=d, g=d)),
        "kvBwd": Wiring(own={},
                        reads={"bwd2": ("sdpaBwd2", "out"), "bwd1": ("sdpaBwd1", "out"), "att": ("sdpaFwd", "x")},
                        out=dict(dx=d)),
    }


def sdpa_fwd(cfg, dialect="ios18", dtype="fp16", lora=None):
    """RMSNorm of the layer input, then Wqᵀ/Wkᵀ/Wvᵀ (with QK-norm, q and k normalized per head before
    RoPE, their inputs and 1/rms saved for the backward) -> attention output; also RoPE'd Q and K, V, the
    probabilities [H·S, S] saved for the backward (which then needs no second Q·Kᵀ and softmax),
    xnorm and its 1/rms. The layer input is read in place from input "prev": the layer below's
    ffnFused output (for the first layer, a surface of that layout holding the embedding)."""
    k = KernelBuilder("sdpaFwd", cfg, dialect, dtype, lora)
    b, s, d = k.b, cfg.seq, cfg.dim
    x, lay = k.packed("x")
    act, prev_inv = k.read("prev", "x_next", "x2n_inv")
    xn, inv = stream_norm(b, act, packed_column(b, x, lay, "rms"), prev_inv, norm_scales(b, x, lay, "rms_scale"), "xn")
    proj = {n: k.projection(xn, x, lay, n, d, lay[n][1], n) for n in ("wq", "wk", "wv")}
    q, k_, saved = proj["wq"], proj["wk"], {}
    if cfg.qk_norm:
        q, q_inv = head_norm(b, q, cfg.heads, head_weight(b, packed_column(b, x, lay, "qn"), cfg, "qn_w"),
                             norm_scales(b, x, lay, "qn_scale"), cfg, "q_norm")
        k_, k_inv = head_norm(b, k_, cfg.kv_heads, head_weight(b, packed_column(b, x, lay, "kn"), cfg, "kn_w"),
                              norm_scales(b, x, lay, "kn_scale"), cfg, "k_norm")
        saved = dict(q_pre=proj["wq"], k_pre=proj["wk"], q_inv=q_inv, k_inv=k_inv)
    cos, sin = rope_consts(b, cfg)
    q_rope = rope(b, q, cfg.heads, cfg, cos, sin, "q_rope")
    k_rope = rope(b, k_, cfg.kv_heads, cfg, cos, sin, "k_rope")
    keys = to_heads(b, k_rope, cfg.kv_heads, cfg.head_dim, s, "k")
    v = to_heads(b, proj["wv"], cfg.kv_heads, cfg.head_dim, s, "v")
    probs = causal_probs(b, scaled_heads(b, q_rope, cfg.heads, cfg, "q"), repeat_kv(b, keys, cfg, "k_rep"),
                         attention_consts(b, cfg), "probs")
    attn = b.matmul(x=probs, y=repeat_kv(b, v, cfg, "v_rep"), transpose_x=False, transpose_y=False, name="pv")
    return k.output(attn=from_heads(b, attn, cfg.heads, cfg.head_dim, s, "attn"), q=q_rope, k=k_rope, v=proj["wv"],
                    probs=b.reshape(x=probs, shape=[1, cfg.heads * s, 1, s], name="probs_out"), xn=xn, xn_inv=inv,
                    **saved)


def wo_fwd(cfg, dialect="ios18", dtype="fp16", lora=None):
    """The attention's residual x2 = x + α·Wo·attn: x holds only Woᵀ [q_dim, dim]; attn is read in
    place from input "fwd" (the layer's sdpaFwd output), the layer input x from "prev" (as sdpaFwd's)."""
    k = KernelBuilder("woFwd", cfg, dialect, dtype, lora)
    b = k.b
    x, lay = k.packed("x")
    (attn,) = k.read("fwd", "attn")
    (act,) = k.read("prev", "x_next")
    o = k.projection(attn, x, lay, "w", cfg.q_dim, cfg.dim, "o")
    return k.output(x2=b.add(x=act, y=b.mul(x=o, y=cfg.alpha, name="o_a"), name="x2"))


def ffn_fused(cfg, dialect="ios18", dtype="fp16", lora=None):
    """x2norm = RMSNorm(x2), x_next = x2 + α·W2·(silu(W1·x2norm) ⊙ W3·x2norm); also returns h1, h3,
    the gate, x2, x2norm and its 1/rms. x2 is read in place from input "wo", woFwd's output. Input w1 holds
    rms_ffn and W1ᵀ, w3 W3ᵀ, w2 raw W2 [dim, hidden]."""
    k = KernelBuilder("ffnFused", cfg, dialect, dtype, lora)
    b, d, h = k.b, cfg.dim, cfg.hidden
    (x1, lay1), (x3, lay3), (w2, lay2) = k.packed("w1"), k.packed("w3"), k.packed("w2")
    (x2,) = k.read("wo", "x2")
    (prev_inv,) = k.read("fwd", "xn_inv")
    x2n, inv = stream_norm(b, x2, packed_column(b, x1, lay1, "rms"), prev_inv, norm_scales(b, x1, lay1, "rms_scale"),
                           "x2n")
    h1 = k.projection(x2n, x1, lay1, "w1", d, h, "h1")
    h3 = k.projection(x2n, x3, lay3, "w3", d, h, "h3")
    gate = b.mul(x=b.mul(x=h1, y=b.sigmoid(x=h1, name="sig"), name="silu"), y=h3, name="gate")
    ffn = k.projection(gate, w2, lay2, "w2", h, d, "ffn", transposed=False)
    x_next = b.add(x=x2, y=b.mul(x=ffn, y=cfg.alpha, name="ffn_a"), name="x_next")
    return k.output(x_next=x_next, h1=h1, h3=h3, gate=gate, x2=x2, x2n=x2n, x2n_inv=inv)


def ffn_bwd_w2t(cfg, dialect="ios18", dtype="fp16", lora=None):
    """dgate = W2ᵀ·(α·dy), with raw W2 [dim, hidden] read from ffnFused's input w2. dy, the gradient of the
    layer's output, is read in place from input "dy": the layer above's qBwd output (for the top layer, a
    surface of that layout where the CPU writes the loss's gradient)."""
    k = KernelBuilder("ffnBwdW2t", cfg, dialect, dtype, lora)
    b = k.b
    x, lay = k.weights("w")
    (dy,) = k.read("dy", "dy")
    dffn = b.mul(x=dy, y=cfg.alpha, name="dffn")
    return k.output(dgate=k.projection(dffn, x, lay, "w2", cfg.hidden, cfg.dim, "dgate", transposed=False,
                                       backward=True))


def ffn_bwd_w13t(cfg, dialect="ios18", dtype="fp16", lora=None):
    """The SiLU-gate backward, dh1 = dgate·h3·σ(h1)·(1 + h1·(1 − σ(h1))) and dh3 = dgate·h1·σ(h1), then
    dx = W1ᵀ·dh1 + W3ᵀ·dh3; outputs dx, dh1 and dh3 (for dW1, dW3). W1ᵀ and W3ᵀ are read from ffnFused's
    inputs w1 and w3, "dgate" is ffnBwdW2t's output surface and "ffn" the layer's ffnFused output (h1, h3),
    all in place."""
    k = KernelBuilder("ffnBwdW13t", cfg, dialect, dtype, lora)
    b, d, h = k.b, cfg.dim, cfg.hidden
    x1, lay1 = k.weights("w1")
    x3, lay3 = k.weights("w3")
    (dgate,) = k.read("dgate", "dgate")
    h1, h3 = k.read("ffn", "h1", "h3")
    sig = b.sigmoid(x=h1, name="sig")
    g_sig = b.mul(x=dgate, y=sig, name="g_sig")
    dh3 = b.mul(x=g_sig, y=h1, name="dh3")
    slope = b.add(x=b.mul(x=h1, y=b.sub(x=1.0, y=sig, name="one_m_sig"), name="h1_oms"), y=1.0, name="slope")
    dh1 = b.mul(x=b.mul(x=g_sig, y=h3, name="g_sig_h3"), y=slope, name="dh1")
    dx = b.add(x=k.projection(dh1, x1, lay1, "w1", d, h, "t1", backward=True),
               y=k.projection(dh3, x3, lay3, "w3", d, h, "t3", backward=True), name="dx")
    return k.output(dx=dx, dh1=dh1, dh3=dh3)


def wot_bwd(cfg, dialect="ios18", dtype="fp16", lora=None):
    """The backward of the FFN's RMSNorm and of the residual, dx2 = RMSNorm'(x2)·dx_ffn + dy, then
    da = Woᵀ·(α·dx2); outputs da, dx2 and dx_ffn ⊙ x̂2 (rms_ffn's gradient, summed over positions).
    Woᵀ (woFwd's input), rms_ffn (ffnFused's w1), dy (input "dy", as ffnBwdW2t's), x2 and its 1/rms
    (ffnFused's output) and dx_ffn (ffnBwdW13t's) are read in place."""
    k = KernelBuilder("wotBwd", cfg, dialect, dtype, lora)
    b, d = k.b, cfg.dim
    x, lay = k.weights("w")
    (w_rms,) = k.read("norm", "rms")
    (dy,) = k.read("dy", "dy")
    x2, inv = k.read("ffn", "x2", "x2n_inv")
    (dx_ffn,) = k.read("w13", "dx")
    dx2n, g = rmsnorm_backward(b, x2, inv, w_rms, dx_ffn, "dx2n")
    dx2 = b.add(x=dx2n, y=dy, name="dx2")
    da = k.projection(b.mul(x=dx2, y=cfg.alpha, name="dx2a"), x, lay, "w", cfg.q_dim, d, "da", backward=True)
    return k.output(da=da, dx2=dx2, g=g)


def q_bwd(cfg, dialect="ios18", dtype="fp16", lora=None):
    """The attention's input gradient dx_attn = Wqᵀ·dq + dx_kv, then the backward of its RMSNorm and
    of the residual: dy = RMSNorm'(x)·dx_attn + dx2, the gradient of the layer's input; also
    dx_attn ⊙ x̂ (rms_att's gradient, summed over positions). dq (sdpaBwd2's output), dx_kv (kvBwd's), Wqᵀ
    and rms_att (sdpaFwd's input), the layer input, its 1/rms (sdpaFwd's output) and dx2 (wotBwd's) are read in
    place."""
    k = KernelBuilder("qBwd", cfg, dialect, dtype, lora)
    b, d = k.b, cfg.dim
    x, lay = k.weights("att")
    (dq,) = k.read("bwd2", "dq")
    (dx_kv,) = k.read("kv", "dx")
    w_rms = packed_column(b, x, lay, "rms")
    (act,) = k.read("prev", "x_next")
    (inv,) = k.read("fwd", "xn_inv")
    (dx2,) = k.read("wot", "dx2")
    dx_attn = b.add(x=k.projection(dq, x, lay, "wq", d, cfg.q_dim, "dxq", backward=True), y=dx_kv, name="dx_attn")
    dxn, g = rmsnorm_backward(b, act, inv, w_rms, dx_attn, "dxn")
    return k.output(dy=b.add(x=dxn, y=dx2, name="dy"), g=g)


def kv_bwd(cfg, dialect="ios18", dtype="fp16", lora=None):
    """dx = Wkᵀ·dk + Wvᵀ·dv; Wkᵀ and Wvᵀ (sdpaFwd's input), dk (sdpaBwd2's output) and dv (sdpaBwd1's) are read
    in place."""
    k = KernelBuilder("kvBwd", cfg, dialect, dtype, lora)
    b, d = k.b, cfg.dim
    x, lay = k.weights("att")
    (dk,) = k.read("bwd2", "dk")
    (dv,) = k.read("bwd1", "dv")
    return k.output(dx=b.add(x=k.projection(dk, x, lay, "wk", d, cfg.kv_dim, "tk", backward=True),
                             y=k.projection(dv, x, lay, "wv", d, cfg.kv_dim, "tv", backward=True), name="dx"))


def sdpa_bwd1(cfg, dialect="ios18", dtype="fp16", lora=None):
    """With the forward's probs: dV = probsᵀ·da (summed per kv head) and dp = da·Vᵀ. Inputs are whole
    output surfaces, read in place: "fwd" is sdpaFwd's (probs, V), "da" wotBwd's."""
    k = KernelBuilder("sdpaBwd1", cfg, dialect, dtype, lora)
    b, s, hd, hs = k.b, cfg.seq, cfg.head_dim, cfg.heads * cfg.seq
    (da,) = k.read("da", "da")
    v, probs = k.read("fwd", "v", "probs")
    probs = b.reshape(x=probs, shape=[1, cfg.heads, s, s], name="probs")
    da = to_heads(b, da, cfg.heads, hd, s, "da_h")
    v = repeat_kv(b, to_heads(b, v, cfg.kv_heads, hd, s, "v_h"), cfg, "v_rep")
    dv = reduce_kv(b, b.matmul(x=probs, y=da, transpose_x=True, transpose_y=False, name="dv_full"), cfg, "dv")
    dp = b.matmul(x=da, y=v, transpose_x=False, transpose_y=True, name="dp")        # [1,H,S,S]
    return k.output(dv=from_heads(b, dv, cfg.kv_heads, hd, s, "dv_out"),
                    dp=b.reshape(x=dp, shape=[1, hs, 1, s], name="dp_out"))


def sdpa_bwd2(cfg, dialect="ios18", dtype="fp16", lora=None):
    """ds = probs ⊙ (dp − rowsum(probs ⊙ dp)); dQ = ds·K/√hd, dK = dsᵀ·Q/√hd (summed per kv head),
    the scale on the S×hd operands rather than the S×S ds; then RoPE's backward (the inverse
    rotation), so dQ and dK are the gradients of the projections Wq·x and Wk·x (with QK-norm, through
    its backward, by its inputs and 1/rms that sdpaFwd saved and its weights read from sdpaFwd's
    input; also gq and gk, whose sums over positions and heads are its weights' gradients). The row sums come
    from S×hd values, not S×S: Σ_j probs_ij·dp_ij = da_i·attn_i, since dp = da·Vᵀ and attn =
    probs·V. Inputs are whole output surfaces, read in place: "fwd" is sdpaFwd's (probs, Q, K, the
    attention output), "bwd1" sdpaBwd1's (dp), "da" wotBwd's (the attention output's gradient)."""
    k = KernelBuilder("sdpaBwd2", cfg, dialect, dtype, lora)
    b, s, hd = k.b, cfg.seq, cfg.head_dim
    (dp,) = k.read("bwd1", "dp")
    q, keys, probs, attn, *pre = k.read("fwd", "q", "k", "probs", "attn",
                                        *(("q_pre", "k_pre", "q_inv", "k_inv") if cfg.qk_norm else ()))
    (da,) = k.read("da", "da")
    probs = b.reshape(x=probs, shape=[1, cfg.heads, s, s], name="probs")
    dp = b.reshape(x=dp, shape=[1, cfg.heads, s, s], name="dp")
    q = scaled_heads(b, q, cfg.heads, cfg, "q_h")
    keys = repeat_kv(b, scaled_heads(b, keys, cfg.kv_heads, cfg, "k_h"), cfg, "k_rep")
    dot = b.reshape(x=b.mul(x=da, y=attn, name="da_attn"), shape=[1, cfg.heads, hd, s], name="da_attn_h")
    rowsum = b.transpose(x=b.reduce_sum(x=dot, axes=[2], keep_dims=True, name="rowsum_t"), perm=[0, 1, 3, 2],
                         name="rowsum")                                              # [1,H,S,1]
    centered = b.sub(x=dp, y=rowsum, name="centered")
    ds = b.mul(x=probs, y=centered, name="ds")
    dq = b.matmul(x=ds, y=keys, transpose_x=False, transpose_y=False, name="dq_h")
    dk = reduce_kv(b, b.matmul(x=ds, y=q, transpose_x=True, transpose_y=False, name="dk_full"), cfg, "dk")
    cos, sin = rope_consts(b, cfg, sign=-1)
    dq = rope(b, from_heads(b, dq, cfg.heads, hd, s, "dq_r"), cfg.heads, cfg, cos, sin, "dq")
    dk = rope(b, from_heads(b, dk, cfg.kv_heads, hd, s, "dk_r"), cfg.kv_heads, cfg, cos, sin, "dk_out")
    if not cfg.qk_norm:
        return k.output(dq=dq, dk=dk)
    q_pre, k_pre, q_inv, k_inv = pre
    qn, kn = k.read("att", "qn", "kn")
    dq, gq = head_norm_backward(b, q_pre, q_inv, head_weight(b, qn, cfg, "qn_w"), dq, cfg.heads, cfg, "dqn")
    dk, gk = head_norm_backward(b, k_pre, k_inv, head_weight(b, kn, cfg, "kn_w"), dk, cfg.kv_heads, cfg, "dkn")
    return k.output(dq=dq, dk=dk, gq=gq, gk=gk)


KERNELS = dict(sdpaFwd=sdpa_fwd, woFwd=wo_fwd, ffnFused=ffn_fused, ffnBwdW2t=ffn_bwd_w2t, ffnBwdW13t=ffn_bwd_w13t,
               wotBwd=wot_bwd, sdpaBwd1=sdpa_bwd1, sdpaBwd2=sdpa_bwd2, qBwd=q_bwd, kvBwd=kv_bwd)
