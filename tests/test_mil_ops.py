"""Acceptance test for the MIL toolchain: for every op in the registry,

    Builder -> b.text() -> parse() -> Plan(precision=fp32 | fp16).run()

equals a float64 numpy reference written here from the op's definition (docs/ane-reference.md §3.3; the
coremltools op documentation where the reference is silent). No anectypes code computes a reference.

Checked for every program:
* the printer round trip: parse(text).text() == text;
* fp32 mode: error <= 1e-6 relative to the magnitude of the result (see `assert_fp32`);
* fp16 mode: the reference rounded to fp16 (and flushed to zero, ftz=True) within 1 fp16 ulp of the
  result for single-rounding ops and 2 ulps + fp32 accumulation error for long sums (see `assert_fp16`);
  and the same with ftz=False (no flush).

Numerics of fp16 mode (docs/ane-reference.md §3.7): overflow gives ±inf, subnormal results are flushed to
zero with ftz=True and survive with ftz=False, while fp32 mode keeps them. Also: the reference's dynamic
matmul (§3.4), written with the Builder and by hand in the reference's spelling, computes y = Wᵀx and
runs as one GEMM; BLOBFILE consts load from the weights mapping.
"""

import itertools
import warnings
import zlib

import numpy as np
import pytest

import anectypes.host.blas
from anectypes.errors import BlobError
from anectypes.mil import Builder, Plan, parse
from anectypes.mil.ops import OPS
from anectypes.mil.types import NUMPY, OPSETS

DIALECTS = ("ios18", "ios16")             # the M3/M4/M5 and the M1/M2 dialects
U32 = 2.0 ** -24                          # unit roundoff of fp32
FP16_MIN_NORMAL = 2.0 ** -14
COVERED = set()                           # ops the tests below exercise (see `covers`)


def dialects_with(op):
    """The dialects whose opset has `op` (Apple's: quantize from iOS17, sdpa from iOS18)."""
    return [d for d in DIALECTS if OPSETS.index(d) >= OPSETS.index(OPS[op].since)]


def covers(*ops):
    """Decorator: the test exercises these ops (recorded at import, whatever tests are selected)."""
    def mark(test):
        COVERED.update(ops)
        return test
    return mark


def rng_for(*key):
    """A generator seeded from the test's parameters: every case is deterministic and independent."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def h(rng, shape, scale=1.0):
    """Random fp16 values (the tensors a kernel sees on the ANE)."""
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def f64(*arrays):
    out = tuple(np.asarray(a, dtype=np.float64) for a in arrays)
    return out if len(out) > 1 else out[0]


# ------------------------------------------------------------------ checking machinery

def round_trip(b):
    """The program as the parser reads it back from the builder's text, and its weights."""
    text = b.text()
    program = parse(text)
    assert program.text() == text, "printing the parsed program must reproduce the builder's text"
    return program, b.weights()


def fp16_round(ref, ftz):
    """numpy's float16 rounding (nearest even, overflow to ±inf), then flush-to-zero of subnormals."""
    with np.errstate(over="ignore"):
        r = np.asarray(ref, dtype=np.float64).astype(np.float16)
    if ftz:
        r = np.where(np.abs(r) < FP16_MIN_NORMAL, np.float16(0) * np.sign(r), r).astype(np.float16)
    return r


def assert_exact(got, ref, dtype):
    assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
    assert got.shape == np.shape(ref)
    np.testing.assert_array_equal(got, np.asarray(ref).astype(dtype))


def assert_fp32(got, ref, mag):
    """fp32 mode: |got - ref| <= 1e-6 * mag, elementwise.

    mag is |ref| for single-rounding ops (a plain relative error) and, for ops that sum n terms,
    the same sum of the terms' absolute values (e.g. |x| @ |y|), the quantity every floating-point
    summation error is proportional to; a result that cancels to ~0 cannot be asked for more
    relative accuracy than the terms it was summed from carry.
    """
    assert got.dtype == np.float32, got.dtype
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got.astype(np.float64) - ref)
    bad = ~(err <= 1e-6 * mag)
    assert not bad.any(), (f"fp32 mode: {bad.sum()} of {bad.size} elements exceed 1e-6 relative error; "
                           f"worst err/mag {np.max(err / np.maximum(mag, 1e-300)):.3g}")


# Why these fp16 tolerances (ulp = np.spacing of the fp16-rounded reference, i.e. of the result):
#
# The simulator reads the same fp16 values as the reference, computes in fp32 and rounds once, to fp16,
# at the end of the op. Let r be the exact (float64) result and r32 the simulator's fp32 value.
# * Single-rounding ops (add, sub, mul, pow, sigmoid, cast, dequantize, ...): r32 = r(1 + d) with |d| a
#   few fp32 unit roundoffs (0 for products and most sums of fp16 values, which are exact in fp32;
#   <= ~4 for exp/pow/reciprocal chains). fp16 ulps are 2^13 times coarser, so fp16(r32) and fp16(r)
#   are both one of the two fp16 neighbours of r and can differ only when an fp16 rounding midpoint
#   lies between r and r32: at most 1 ulp. The rare ulp of double rounding (fp64 -> fp32 -> fp16) is
#   the same kind of event. Tolerance: 1 ulp.
# * Accumulations of n terms (matmul, conv, reduce_sum, softmax's denominator, sdpa): whatever order
#   the BLAS or numpy sums in, |r32 - r| <= n * u32 * sum|terms| (Higham, Accuracy and Stability of
#   Numerical Algorithms, §3.1), so |fp16(r32) - fp16(r)| <= 1 ulp + n * u32 * sum|terms|. When the sum
#   does not cancel, sum|terms| ~ |r| and that second term is ~n * 2^-24 |r|, far below one fp16 ulp
#   (2^-10 |r|) for any n used here; it only matters where the result cancels to a small value whose
#   own ulp is finer than fp32's accuracy on the large terms. We allow 2 ulps (the second covers the
#   extra fp32 roundings of bias adds, scaling and exp that the n * u32 model leaves out, and a result
#   that crosses into the next binade) plus n * u32 * sum|terms|.
# * Where the fp32 value is exact (a product of two fp16 values has at most 22 significant bits; so
#   does (q - zero_point) * scale; a cast rounds its input once) r32 = r and the simulator must be
#   bit-identical to the reference: tolerance 0 ulp.
# * Flush to zero is discontinuous: an exact result within that tolerance of the point where fp16
#   rounding reaches the smallest normal (2^-14 - 2^-25) may come out as 0 or as ±2^-14.
# Exact ops (slice, reshape, transpose, concat, quantize, casts to integers) must match bit for bit.
def assert_fp16(got, ref, mag, ulps, rel, ftz):
    assert got.dtype == np.float16, got.dtype
    assert got.shape == ref.shape, (got.shape, ref.shape)
    want = fp16_round(ref, ftz)
    special = ~np.isfinite(want)
    np.testing.assert_array_equal(got[special], want[special])       # overflow to ±inf, NaN
    if ftz:
        g = np.abs(got[np.isfinite(got)])
        assert not np.any((g > 0) & (g < FP16_MIN_NORMAL)), "ftz=True must not produce subnormal results"
    with np.errstate(over="ignore"):
        ulp = np.abs(np.spacing(ref.astype(np.float16))).astype(np.float64)
    tol = ulps * ulp + rel * mag
    err = np.abs(got.astype(np.float64) - want)
    ok = special | (err <= tol)
    if ftz:
        edge = np.abs(np.abs(ref) - (FP16_MIN_NORMAL - 2.0 ** -25)) <= tol
        ok |= edge & np.isin(np.abs(got.astype(np.float64)), (0.0, FP16_MIN_NORMAL))
    assert ok.all(), (f"fp16 mode (ftz={ftz}): {np.sum(~ok)} of {ok.size} elements off by more than "
                      f"{ulps} ulp + {rel:.3g}*mag; worst error in ulps "
                      f"{np.max(np.where(ok, 0, err / np.maximum(ulp, 2.0 ** -24))):.3g}")


def check(b, inputs, ref, mag=None, ulps=1, terms=0, rel=None, exact=None):
    """Round-trip b's program, run it in every precision mode and compare each output with `ref`.

    ref: float64 reference of the single output, or {output name: reference}.
    mag: the magnitude the error is measured against (default |ref|); terms: the length of the
    longest fp32 accumulation (rel = terms * u32 unless given); ulps: see the comment above
    assert_fp16; exact: float outputs of data movement, which must match bit for bit in both modes
    (integer and bool outputs always must).
    """
    program, weights = round_trip(b)
    names = [v.name for v in program.main.outputs]
    refs = ref if isinstance(ref, dict) else {names[0]: ref}
    mags = mag if isinstance(mag, dict) else {n: mag for n in refs}
    rel = terms * U32 if rel is None else rel
    declared = {v.name: v.type.dtype for v in program.main.outputs}
    for precision, ftz in [("fp32", True), ("fp16", True), ("fp16", False)]:
        got = Plan(program, weights=weights, precision=precision, ftz=ftz).run(inputs)
        for name, r in refs.items():
            g = got[name]
            # fp16 tensors are held as fp32 in fp32 mode; every other dtype as itself
            assert g.dtype == (np.float32 if declared[name] == "fp16" and precision == "fp32"
                               else np.dtype(NUMPY[declared[name]])), (name, declared[name], g.dtype)
            if g.dtype.kind not in "f":                               # int8/uint8/int32/bool results
                assert_exact(g, r, g.dtype)
                assert np.array_equal(np.asarray(r, np.float64), np.asarray(r).astype(g.dtype)), \
                    "the reference of an integer result must itself be integral and in range"
                continue
            r = np.asarray(r, dtype=np.float64)
            m = np.abs(r) if mags[name] is None else np.asarray(mags[name], dtype=np.float64)
            if exact:             # data movement: the fp16 values, held exactly in either mode
                assert_exact(g, r, g.dtype)
            elif g.dtype == np.float32:
                assert_fp32(g, r, m)
            else:
                assert_fp16(g, r, m, ulps, rel, ftz)
    return program


# ------------------------------------------------------------------ float64 references

def ref_transpose(x, perm):
    """out[i_0, ..., i_{r-1}] = x[j] with j[perm[d]] = i_d (out.shape[d] = x.shape[perm[d]])."""
    perm = [p % x.ndim for p in perm]
    out = np.empty([x.shape[p] for p in perm], dtype=np.float64)
    for idx in np.ndindex(out.shape):
        src = [0] * x.ndim
        for d, p in enumerate(perm):
            src[p] = idx[d]
        out[idx] = x[tuple(src)]
    return out


def ref_concat(values, axis, interleave):
    """Concatenation along `axis`; interleaved: x0[0], x1[0], ..., x0[1], x1[1], ... along it."""
    axis %= values[0].ndim
    if not interleave:
        parts = [np.moveaxis(v, axis, 0) for v in values]
        return np.moveaxis(np.array([row for p in parts for row in p], dtype=np.float64), 0, axis)
    n = len(values)
    shape = list(values[0].shape)
    shape[axis] *= n
    out = np.empty(shape)
    for idx in np.ndindex(*shape):
        i = idx[axis]
        src = idx[:axis] + (i // n,) + idx[axis + 1:]
        out[idx] = values[i % n][src]
    return out


def ref_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def ref_matmul(x, y, tx=False, ty=False):
    """op(x) @ op(y) over the last two axes; leading (batch) axes broadcast."""
    x = np.swapaxes(x, -1, -2) if tx else x
    y = np.swapaxes(y, -1, -2) if ty else y
    return np.einsum("...mk,...kn->...mn", x, y)


def same_padding(n, k, s, d):
    """pad_type="same": output ceil(n / s); the total padding is split evenly, the odd one at the end."""
    out = -(-n // s)
    total = max((out - 1) * s + d * (k - 1) + 1 - n, 0)
    return total // 2, total - total // 2


def ref_conv(x, w, bias=None, strides=(1, 1), pad_type="valid", pad=(0, 0, 0, 0), dilations=(1, 1), groups=1):
    """Direct definition of MIL conv (cross-correlation, NCHW, weight [OC, C/groups, KH, KW]):

    y[n, o, i, j] = bias[o] + sum_{c, p, q} xpad[n, g(o)*C/groups + c, i*sh + p*dh, j*sw + q*dw] * w[o, c, p, q]
    with g(o) = o // (OC/groups) and xpad zero-padded by (top, bottom, left, right).
    """
    n_, c_all, hh, ww = x.shape
    oc, cg, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    if pad_type == "valid":
        t, b, l, r = 0, 0, 0, 0
    elif pad_type == "custom":
        t, b, l, r = pad
    else:
        (t, b), (l, r) = same_padding(hh, kh, sh, dh), same_padding(ww, kw, sw, dw)
    xp = np.zeros((n_, c_all, hh + t + b, ww + l + r))
    xp[:, :, t:t + hh, l:l + ww] = x
    oh = (hh + t + b - dh * (kh - 1) - 1) // sh + 1
    ow = (ww + l + r - dw * (kw - 1) - 1) // sw + 1
    y = np.zeros((n_, oc, oh, ow))
    per_group = oc // groups
    for o in range(oc):
        g = o // per_group
        for i in range(oh):
            for j in range(ow):
                patch = xp[:, g * cg:(g + 1) * cg, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                           j * sw:j * sw + dw * (kw - 1) + 1:dw]
                y[:, o, i, j] = np.einsum("ncpq,cpq->n", patch, w[o])
    if bias is not None:
        y += np.asarray(bias).reshape(1, -1, 1, 1)
    return y


def ref_sdpa(q, k, v):
    """softmax(q kᵀ / sqrt(E)) v over the last two axes."""
    s = np.einsum("...le,...se->...ls", q, k) / np.sqrt(q.shape[-1])
    return np.einsum("...ls,...sv->...lv", ref_softmax(s, -1), v)


def along(v, axis, rank):
    """A scalar, or a vector laid along `axis` of a rank-`rank` tensor."""
    v = np.asarray(v, dtype=np.float64)
    if v.ndim == 0:
        return v
    shape = [1] * rank
    shape[axis] = -1
    return v.reshape(shape)


def ref_quantize(x, scale, zero_point, axis, dtype):
    """clip(round_half_to_even(x / scale) + zero_point, dtype min, dtype max)."""
    info = np.iinfo(dtype)
    q = np.round(x / along(scale, axis, x.ndim))                     # numpy rounds half to even
    return np.clip(q + along(zero_point, axis, x.ndim), info.min, info.max)


def ref_dequantize(q, scale, zero_point, axis):
    """(q - zero_point) * scale."""
    return (q - along(zero_point, axis, q.ndim)) * along(scale, axis, q.ndim)


# ------------------------------------------------------------------ data movement

SLICES = [([2, 3, 4, 5], [0, 1, 1, 0], [2, 2, 3, 5]),
          ([2, 3, 4, 5], [1, 0, 2, 3], [-1, -1, -1, 2]),     # size -1: to the end of the axis
          ([6, 7], [2, 0], [3, 7])]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("shape,begin,size", SLICES)
@covers("slice_by_size")
def test_slice_by_size(dialect, shape, begin, size):
    rng = rng_for("slice", shape, begin, size)
    b = Builder(dialect)
    x = b.input("x", shape)
    b.output(b.slice_by_size(x=x, begin=begin, size=size))
    xv = h(rng, shape)
    idx = tuple(slice(bg, n if s == -1 else bg + s) for bg, s, n in zip(begin, size, shape))
    check(b, {"x": xv}, f64(xv)[idx], exact=True)


RESHAPES = [([2, 3, 4], [4, 6]), ([2, 3, 4], [1, -1, 2, 1]), ([1, 8, 1, 6], [1, 1, 8, 6]), ([5], [1, 5, 1, 1])]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("shape,new", RESHAPES)
@covers("reshape")
def test_reshape(dialect, shape, new):
    rng = rng_for("reshape", shape, new)
    b = Builder(dialect)
    x = b.input("x", shape)
    b.output(b.reshape(x=x, shape=new))
    xv = h(rng, shape)
    known = int(np.prod([d for d in new if d != -1]))
    full = [xv.size // known if d == -1 else d for d in new]
    # row-major: element k of the flat order keeps its position k
    want = np.array([float(v) for v in xv.flat]).reshape(full)
    check(b, {"x": xv}, want, exact=True)


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("reshape", "transpose")
def test_reshape_of_transposed_view(dialect):
    """reshape after transpose (a non-contiguous view in the simulator) still uses the row-major order."""
    rng = rng_for("reshape-of-view")
    b = Builder(dialect)
    x = b.input("x", [1, 6, 1, 4])
    t = b.transpose(x=b.reshape(x=x, shape=[1, 1, 6, 4]), perm=[0, 1, 3, 2])
    b.output(b.reshape(x=t, shape=[1, 4, 1, 6]))
    xv = h(rng, [1, 6, 1, 4])
    want = ref_transpose(f64(xv).reshape(1, 1, 6, 4), [0, 1, 3, 2])
    check(b, {"x": xv}, np.array(list(want.flat)).reshape(1, 4, 1, 6), exact=True)


TRANSPOSES = [([1, 2, 3, 4], [0, 1, 3, 2]), ([2, 3, 4], [2, 0, 1]), ([2, 3, 4, 5], [3, -2, 0, 1]), ([3, 5], [1, 0])]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("shape,perm", TRANSPOSES)
@covers("transpose")
def test_transpose(dialect, shape, perm):
    rng = rng_for("transpose", shape, perm)
    b = Builder(dialect)
    x = b.input("x", shape)
    b.output(b.transpose(x=x, perm=perm))
    xv = h(rng, shape)
    check(b, {"x": xv}, ref_transpose(f64(xv), perm), exact=True)


CONCATS = [([[1, 2, 1, 3], [1, 5, 1, 3]], 1, None),                 # default interleave (false)
           ([[2, 3, 2], [2, 3, 1], [2, 3, 4]], -1, False),
           ([[1, 4, 1, 3], [1, 4, 1, 3]], 3, True),                 # RoPE-style pair interleave
           ([[2, 3, 2], [2, 3, 2], [2, 3, 2]], 1, True),
           ([[3, 2], [3, 2]], -2, True)]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("shapes,axis,interleave", CONCATS)
@covers("concat")
def test_concat(dialect, shapes, axis, interleave):
    rng = rng_for("concat", shapes, axis, interleave)
    b = Builder(dialect)
    xs = [b.input(f"x{i}", s) for i, s in enumerate(shapes)]
    kw = {} if interleave is None else {"interleave": interleave}
    b.output(b.concat(values=xs, axis=axis, **kw))
    vals = [h(rng, s) for s in shapes]
    check(b, {f"x{i}": v for i, v in enumerate(vals)}, ref_concat([f64(v) for v in vals], axis, bool(interleave)),
          exact=True)


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("concat")
def test_concat_int32(dialect):
    b = Builder(dialect)
    x, y = b.input("x", [2, 2], "int32"), b.input("y", [2, 2], "int32")
    b.output(b.concat(values=(x, y), axis=0, interleave=True))
    xv, yv = np.array([[1, 2], [3, 4]], np.int32), np.array([[5, 6], [7, 8]], np.int32)
    check(b, {"x": xv, "y": yv}, np.array([[1, 2], [5, 6], [3, 4], [7, 8]]))


# ------------------------------------------------------------------ elementwise arithmetic

def binary_definition(op, x, y):
    return {"add": lambda: x + y, "sub": lambda: x - y, "mul": lambda: x * y, "pow": lambda: x ** y}[op]()


BINARY_SHAPES = [([2, 3, 4], [2, 3, 4]), ([2, 3, 1, 5], [1, 3, 4, 1]), ([1, 8, 1, 6], [1, 8, 1, 1]),
                 ([3, 4], None)]                      # None: a scalar const operand, as in x * fp16(0.125)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "pow"])
@pytest.mark.parametrize("xs,ys", BINARY_SHAPES)
@covers("add", "sub", "mul", "pow")
def test_binary(dialect, op, xs, ys):
    rng = rng_for("binary", op, xs, ys)
    b = Builder(dialect)
    x = b.input("x", xs)
    if op == "pow":                                  # positive base, so every real power is defined
        xv = np.abs(h(rng, xs, 1.5)) + np.float16(0.25)
        yv = np.float16(-0.5) if ys is None else h(rng, ys, 0.7)
    else:
        xv = h(rng, xs, 4)
        yv = np.float16(0.125 * rng.integers(-40, 40)) if ys is None else h(rng, ys, 4)
    if ys is None:
        y = float(yv)                                 # the builder emits an fp16 scalar const
        inputs = {"x": xv}
    else:
        y = b.input("y", ys)
        inputs = {"x": xv, "y": yv}
    b.output(b.op(op, x=x, y=y))
    check(b, inputs, binary_definition(op, *f64(xv, yv)), ulps=0 if op == "mul" else 1)   # fp16 products: exact


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@covers("add", "sub", "mul")
def test_binary_int32(dialect, op):
    rng = rng_for("binary-int", op)
    b = Builder(dialect)
    x, y = b.input("x", [3, 4], "int32"), b.input("y", [1, 4], "int32")
    b.output(b.op(op, x=b.op(op, x=x, y=y), y=-7))           # tensor-tensor and tensor-scalar
    xv, yv = (rng.integers(-1000, 1000, s).astype(np.int32) for s in ([3, 4], [1, 4]))
    check(b, {"x": xv, "y": yv}, binary_definition(op, binary_definition(op, *f64(xv, yv)), -7.0))


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("sigmoid")
def test_sigmoid(dialect):
    rng = rng_for("sigmoid")
    b = Builder(dialect)
    x = b.input("x", [2, 3, 4, 5])
    b.output(b.sigmoid(x=x))
    xv = h(rng, [2, 3, 4, 5], 5)
    xv.flat[:6] = [-20, -11, 0, 11, 20, -0.0]        # saturated tails and the midpoint
    check(b, {"x": xv}, 1 / (1 + np.exp(-f64(xv))))


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("axis", [None, -1, 0, 1, 2])
@covers("softmax")
def test_softmax(dialect, axis):
    rng = rng_for("softmax", axis)
    shape = [2, 7, 5, 6]
    b = Builder(dialect)
    x = b.input("x", shape)
    b.output(b.softmax(x=x) if axis is None else b.softmax(x=x, axis=axis))
    xv = h(rng, shape, 3)
    ax = -1 if axis is None else axis
    # every term is positive: no cancellation, mag = |ref|; n terms in the denominator
    check(b, {"x": xv}, ref_softmax(f64(xv), ax), ulps=2, terms=shape[ax] + 4)


REDUCTIONS = [([1], True), ([-1], False), ([0, 2], False), ([2, 0], True), (None, False), (None, True)]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("axes,keep", REDUCTIONS)
@covers("reduce_sum")
def test_reduce_sum(dialect, axes, keep):
    rng = rng_for("reduce", axes, keep)
    shape = [3, 40, 4, 5]
    b = Builder(dialect)
    x = b.input("x", shape)
    kw = {} if axes is None else {"axes": axes}
    if keep:
        kw["keep_dims"] = True
    b.output(b.reduce_sum(x=x, **kw))
    xv = h(rng, shape)
    ax = tuple(range(4)) if axes is None else tuple(a % 4 for a in axes)
    x64 = f64(xv)
    n = int(np.prod([shape[a] for a in ax]))
    check(b, {"x": xv}, x64.sum(axis=ax, keepdims=keep), mag=np.abs(x64).sum(axis=ax, keepdims=keep),
          ulps=2, terms=n)


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("reduce_sum")
def test_reduce_sum_int32(dialect):
    b = Builder(dialect)
    x = b.input("x", [3, 4], "int32")
    b.output(b.reduce_sum(x=x, axes=[0]))
    xv = np.arange(12, dtype=np.int32).reshape(3, 4) * 1000 - 5000
    check(b, {"x": xv}, f64(xv).sum(axis=0))


# ------------------------------------------------------------------ matmul, conv, attention

MATMULS = [([7, 5], [5, 3], False, False),                     # rank 2, non-square
           ([2, 3, 6, 9], [2, 3, 9, 4], False, False),
           ([2, 3, 9, 6], [2, 3, 9, 4], True, False),
           ([2, 3, 6, 9], [2, 3, 4, 9], False, True),
           ([2, 3, 9, 6], [2, 3, 4, 9], True, True),
           ([2, 1, 5, 8], [3, 8, 7], False, False),             # batch dims broadcast: [2, 3, 5, 7]
           ([1, 4, 8, 5], [6, 8], True, True),                  # rank 4 x rank 2
           ([1, 1, 24, 96], [1, 1, 96, 80], False, False)]      # a longer inner dimension


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("xs,ys,tx,ty", MATMULS)
@covers("matmul")
def test_matmul(dialect, xs, ys, tx, ty):
    rng = rng_for("matmul", xs, ys, tx, ty)
    b = Builder(dialect)
    x, y = b.input("x", xs), b.input("y", ys)
    b.output(b.matmul(x=x, y=y, transpose_x=tx, transpose_y=ty))
    xv, yv = h(rng, xs), h(rng, ys)
    k = xs[-2] if tx else xs[-1]
    x64, y64 = f64(xv, yv)
    check(b, {"x": xv, "y": yv}, ref_matmul(x64, y64, tx, ty), mag=ref_matmul(abs(x64), abs(y64), tx, ty),
          ulps=2, terms=k)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("tx,ty", itertools.product([False, True], repeat=2))
@covers("matmul", "transpose")
def test_matmul_then_transpose_is_folded(dialect, tx, ty):
    """matmul -> transpose(last two axes) becomes one matmul with swapped operands and flipped flags."""
    rng = rng_for("fold", tx, ty)
    b = Builder(dialect)
    x = b.input("x", [2, 7, 5] if tx else [2, 5, 7])
    y = b.input("y", [3, 7] if ty else [7, 3])
    m = b.matmul(x=x, y=y, transpose_x=tx, transpose_y=ty)
    b.output(b.transpose(x=m, perm=[0, 2, 1]))
    xv, yv = h(rng, x.type.shape), h(rng, y.type.shape)
    x64, y64 = f64(xv, yv)
    program = check(b, {"x": xv, "y": yv}, np.swapaxes(ref_matmul(x64, y64, tx, ty), -1, -2),
                    mag=np.swapaxes(ref_matmul(abs(x64), abs(y64), tx, ty), -1, -2), ulps=2, terms=7)
    assert [s.op.type for s in Plan(program).steps] == ["matmul"]


CONVS = [
    # x shape, weight shape, conv arguments, weight source, bias
    ([1, 16, 1, 12], [8, 16, 1, 1], {}, "blob", False),                        # the ANE's linear layer
    ([2, 8, 3, 4], [6, 4, 1, 1], {"groups": 2}, "inline", True),               # grouped 1x1
    ([1, 3, 7, 6], [4, 3, 3, 3], {"pad_type": "valid"}, "inline", False),
    ([1, 3, 7, 6], [4, 3, 3, 2], {"pad_type": "same", "strides": [2, 2]}, "blob", True),
    ([2, 4, 6, 7], [6, 2, 3, 3], {"pad_type": "custom", "pad": [1, 0, 2, 1], "strides": [2, 1],
                                  "dilations": [1, 2], "groups": 2}, "blob", True),
    ([1, 4, 8, 8], [4, 1, 3, 2], {"pad_type": "same", "dilations": [2, 2], "groups": 4}, "inline", True),
    ([1, 2, 5, 6], [3, 2, 2, 4], {"pad_type": "same"}, "inline", False),      # odd total padding: (0, 1), (1, 2)
    ([1, 3, 8, 7], [2, 3, 3, 3], {"pad_type": "same", "strides": [2, 3]}, "blob", True),   # (0, 1), (1, 1)
    ([1, 6, 5, 5], [3, 6, 1, 1], {"strides": [2, 2]}, "blob", False),           # 1x1 but strided
    ([1, 2, 5, 9], [3, 2, 2, 4], {"pad_type": "custom", "pad": [0, 0, 0, 0], "strides": [1, 3]}, "inline", False),
]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("xs,ws,kw,source,bias", CONVS)
@covers("conv")
def test_conv(dialect, xs, ws, kw, source, bias):
    rng = rng_for("conv", xs, ws, kw, source, bias)
    b = Builder(dialect)
    x = b.input("x", xs)
    wv = h(rng, ws, 0.5)
    bv = h(rng, [ws[0]]) if bias else None
    w = b.weight(wv, "w.bin") if source == "blob" else b.const(wv, "fp16", name="w")
    args = dict(kw)
    if bias:
        args["bias"] = bv
    b.output(b.conv(x=x, weight=w, **args))
    xv = h(rng, xs)
    x64, w64 = f64(xv, wv)
    geometry = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
    want = ref_conv(x64, w64, None if bv is None else f64(bv), **geometry)
    mag = ref_conv(abs(x64), abs(w64), None if bv is None else abs(f64(bv)), **geometry)
    check(b, {"x": xv}, want, mag=mag, ulps=2, terms=ws[1] * ws[2] * ws[3] + 1)


SDPA = [([1, 2, 5, 8], [1, 2, 7, 8], [1, 2, 7, 6]),
        ([3, 6, 4], [3, 9, 4], [3, 9, 5])]                      # rank 3


def sdpa_tolerance(q, k, v):
    """fp32 error of sdpa relative to p @ |v|: the scores' accumulation error passes through exp
    as a relative error of the probabilities, then the value sum adds its own (S terms)."""
    e, s = q.shape[-1], k.shape[-2]
    score_err = e * U32 * np.max(np.einsum("...le,...se->...ls", abs(q), abs(k))) / np.sqrt(e)
    return 2 * score_err + (2 * s + 6) * U32


@pytest.mark.parametrize("dialect", dialects_with("scaled_dot_product_attention"))
@pytest.mark.parametrize("qs,ks,vs", SDPA)
@covers("scaled_dot_product_attention")
def test_scaled_dot_product_attention(dialect, qs, ks, vs):
    rng = rng_for("sdpa", qs, ks, vs)
    b = Builder(dialect)
    q, k, v = b.input("q", qs), b.input("k", ks), b.input("v", vs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # no mask, no warning
        b.output(b.scaled_dot_product_attention(query=q, key=k, value=v))
    qv, kv, vv = h(rng, qs), h(rng, ks), h(rng, vs)
    q64, k64, v64 = f64(qv, kv, vv)
    p = ref_softmax(np.einsum("...le,...se->...ls", q64, k64) / np.sqrt(qs[-1]), -1)
    check(b, {"q": qv, "k": kv, "v": vv}, ref_sdpa(q64, k64, v64), mag=np.einsum("...ls,...sv->...lv", p, abs(v64)),
          ulps=2, rel=sdpa_tolerance(q64, k64, v64))


@pytest.mark.parametrize("mask_kind", ["const", "input"])
@covers("scaled_dot_product_attention")
def test_sdpa_ignores_attn_mask(mask_kind):
    """The ANE ignores attn_mask (docs/ane-reference.md §3.6) and so does the interpreter; Apple's op
    definition accepts the mask, so only the chip catalogue refuses it (tests/test_mil_limits.py)."""
    rng = rng_for("sdpa-mask", mask_kind)
    b = Builder("ios18")
    q, k, v = b.input("q", [1, 2, 4, 8]), b.input("k", [1, 2, 4, 8]), b.input("v", [1, 2, 4, 8])
    causal = np.triu(np.full((4, 4), -65504.0), 1).astype(np.float16).reshape(1, 1, 4, 4)
    mask = b.const(causal, "fp16", name="mask") if mask_kind == "const" else b.input("mask", [1, 1, 4, 4])
    b.output(b.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask))
    qv, kv, vv = (h(rng, [1, 2, 4, 8]) for _ in range(3))
    inputs = {"q": qv, "k": kv, "v": vv} | ({"mask": causal} if mask_kind == "input" else {})
    q64, k64, v64 = f64(qv, kv, vv)
    p = ref_softmax(np.einsum("...le,...se->...ls", q64, k64) / np.sqrt(8), -1)
    check(b, inputs, ref_sdpa(q64, k64, v64), mag=np.einsum("...ls,...sv->...lv", p, abs(v64)),
          ulps=2, rel=sdpa_tolerance(q64, k64, v64))


# ------------------------------------------------------------------ cast and quantisation

@covers("cast")
def test_cast_fp16_fp32_and_back():
    rng = rng_for("cast")
    b = Builder("ios18")
    x = b.input("x", [2, 3, 4])
    up = b.cast(x=x, dtype="fp32", name="up")
    down = b.cast(x=b.mul(x=up, y=3.0), dtype="fp16", name="down")   # fp32 arithmetic between the casts
    b.output(up, down)
    xv = h(rng, [2, 3, 4], 100)
    # fp16 -> fp32 is exact; x * 3 in fp32 then rounded to fp16 once
    check(b, {"x": xv}, {"up": f64(xv), "down": 3 * f64(xv)}, ulps=0)


@covers("cast")
def test_cast_fp32_input_to_fp16_rounds_only_in_fp16_mode():
    """fp32 I/O with a cast inside (the benches' style, §3.7): fp16 mode rounds to fp16, overflows to inf
    and flushes subnormals; fp32 mode stores fp16 tensors as fp32 and so keeps every value."""
    b = Builder("ios18")
    x = b.input("x", [8], dtype="fp32")
    b.output(b.cast(x=x, dtype="fp16"))
    program, weights = round_trip(b)
    xv = np.array([0.1, 1 / 3, 2049, 2051, 1e5, -1e5, 1e-6, 3e-5], np.float32)   # 2049/2051: ties to even
    x64 = f64(xv)
    got16 = Plan(program, weights, "fp16").run({"x": xv})["cast"]
    assert_exact(got16, fp16_round(x64, ftz=True), np.float16)
    assert list(got16[2:6]) == [2048, 2052, np.inf, -np.inf] and not got16[6] and not got16[7]
    got16_noftz = Plan(program, weights, "fp16", ftz=False).run({"x": xv})["cast"]
    assert_exact(got16_noftz, fp16_round(x64, ftz=False), np.float16)
    assert got16_noftz[6] != 0 and got16_noftz[7] != 0
    got32 = Plan(program, weights, "fp32").run({"x": xv})["cast"]
    assert_exact(got32, xv, np.float32)


CASTS_TO_INT = [("fp16", "int32"), ("fp32", "int32"), ("fp16", "bool"), ("int32", "fp16"), ("int32", "fp32"),
                ("bool", "fp16"), ("bool", "int32"), ("int32", "bool")]


@pytest.mark.parametrize("src,dst", CASTS_TO_INT)
@covers("cast")
def test_cast_integer_and_bool(src, dst):
    """Float -> int32 truncates toward zero (numpy astype, as coremltools' value inference does);
    -> bool is `!= 0`; int32 -> fp16 rounds to nearest even."""
    rng = rng_for("cast-int", src, dst)
    b = Builder("ios18")
    x = b.input("x", [4, 6], src)
    b.output(b.cast(x=x, dtype=dst))
    if src in ("fp16", "fp32"):
        xv = (rng.standard_normal([4, 6]) * 300).astype(np.float16 if src == "fp16" else np.float32)
        xv.flat[:6] = [0.0, -0.0, 2.5, -2.5, 0.75, -0.999]
    elif src == "int32":
        xv = rng.integers(-5000, 5000, [4, 6]).astype(np.int32)
        xv.flat[:4] = [0, 2049, -2051, 4097]
    else:
        xv = rng.integers(0, 2, [4, 6]).astype(bool)
    x64 = f64(xv)
    want = {"int32": np.trunc(x64), "bool": (x64 != 0).astype(np.float64), "fp16": x64, "fp32": x64}[dst]
    check(b, {"x": xv}, want, ulps=0)


QUANTIZE = [
    # output dtype, scale, zero point, axis, input scale
    ("int8", 0.25, None, None, 8),                  # power-of-two scale: x / scale exact, ties included
    ("int8", 0.1, 3, None, 20),                     # clipping at both ends
    ("uint8", 0.5, 128, None, 30),
    ("int8", [0.25, 0.5, 0.125], [0, -4, 7], 1, 12),   # per channel along axis 1
    ("uint8", [0.1, 0.2, 0.05, 0.3], None, -1, 6),     # per channel along the last axis, no zero point
]


@pytest.mark.parametrize("dialect", dialects_with("quantize"))
@pytest.mark.parametrize("dtype,scale,zp,axis,spread", QUANTIZE)
@covers("quantize")
def test_quantize(dialect, dtype, scale, zp, axis, spread):
    rng = rng_for("quantize", dtype, scale, zp, axis)
    shape = [2, 3, 5, 4]
    b = Builder(dialect)
    x = b.input("x", shape)
    sv = np.asarray(scale, np.float16)
    kw = {"scale": sv if sv.ndim else float(sv), "output_dtype": dtype}
    if zp is not None:
        kw["zero_point"] = b.const(np.asarray(zp), dtype, name="zp")
    if axis is not None:
        kw["axis"] = axis
    b.output(b.quantize(input=x, **kw))
    xv = h(rng, shape, spread)
    ties = sv.ndim == 0 and np.log2(float(sv)).is_integer()
    if ties:             # exact halves of a power-of-two scale: round half to even decides them
        xv.flat[:6] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5]) * float(sv)
    zp64 = 0.0 if zp is None else f64(zp)
    ax = 0 if axis is None else axis % len(shape)
    want = ref_quantize(f64(xv), f64(sv), zp64, ax, np.dtype(dtype))
    if ties:
        assert list(want.flat[:6] - zp64) == [0, 2, 2, 0, -2, -2]
    if spread >= 20:     # these cases clip at both ends of the integer range
        assert want.min() == np.iinfo(dtype).min and want.max() == np.iinfo(dtype).max
    check(b, {"x": xv}, want)


DEQUANTIZE = [("int8", 0.05, None, None), ("int8", 0.125, -3, None), ("uint8", 0.5, 128, None),
              ("int8", [0.1, 0.2, 0.3], [1, 0, -2], 1), ("uint8", [0.5, 0.25], None, 0)]


@pytest.mark.parametrize("dialect", dialects_with("dequantize"))
@pytest.mark.parametrize("dtype,scale,zp,axis", DEQUANTIZE)
@covers("dequantize")
def test_dequantize(dialect, dtype, scale, zp, axis):
    rng = rng_for("dequantize", dtype, scale, zp, axis)
    shape = [2, 3, 4]
    info = np.iinfo(dtype)
    b = Builder(dialect)
    q = b.input("q", shape, dtype)
    sv = np.asarray(scale, np.float16)
    kw = {"scale": sv if sv.ndim else float(sv)}
    if zp is not None:
        kw["zero_point"] = b.const(np.asarray(zp), dtype, name="zp")
    if axis is not None:
        kw["axis"] = axis
    b.output(b.dequantize(input=q, **kw))
    qv = rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    ax = 0 if axis is None else axis
    check(b, {"q": qv}, ref_dequantize(f64(qv), f64(sv), 0.0 if zp is None else f64(zp), ax), ulps=0)


@pytest.mark.parametrize("dialect", dialects_with("quantize"))
@covers("quantize", "dequantize")
def test_quantize_dequantize_chain(dialect):
    rng = rng_for("qdq")
    b = Builder(dialect)
    x = b.input("x", [1, 16, 1, 8])
    q = b.quantize(input=x, scale=0.03125, zero_point=b.const(5, "int8", name="zp"), output_dtype="int8")
    b.output(b.dequantize(input=q, scale=0.03125, zero_point=b.const(5, "int8", name="zp")))
    xv = h(rng, [1, 16, 1, 8], 2)
    want = ref_dequantize(ref_quantize(f64(xv), 0.03125, 5.0, 0, np.dtype(np.int8)), 0.03125, 5.0, 0)
    check(b, {"x": xv}, want, ulps=0)


CONSTEXPR = [
    # data dtype, scale (scalar, per-channel vector, or "blob32": an fp32 vector from a BLOBFILE), zero point, axis
    ("int8", 0.02, 0, 0),                            # the int8 bench's form (§3.3)
    ("int8", 0.125, -5, 0),
    ("int8", "vector", "vector", 0),                 # per output channel
    ("int8", "vector", "vector", 1),                 # per input channel
    ("uint8", "blob32", 128, 0),
]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("dtype,scale,zp,axis", CONSTEXPR)
@covers("constexpr_affine_dequantize", "conv")
def test_constexpr_affine_dequantize(dialect, dtype, scale, zp, axis):
    """int8 weights from a BLOBFILE, dequantised at compile time and used as a 1x1 conv weight."""
    rng = rng_for("constexpr", dtype, scale, zp, axis)
    oc, ic = 6, 8
    info = np.iinfo(dtype)
    qv = rng.integers(info.min, info.max, [oc, ic, 1, 1], endpoint=True).astype(dtype)
    n = oc if axis == 0 else ic
    b = Builder(dialect)
    x = b.input("x", [1, ic, 1, 5])
    if scale == "vector":
        sv = (rng.uniform(0.01, 0.05, n)).astype(np.float16)
        s_arg = sv
    elif scale == "blob32":
        sv = rng.uniform(0.001, 0.01, n).astype(np.float32)
        s_arg = b.weight(sv, "scale.bin", dtype="fp32", emit=False)
    else:
        sv = np.float16(scale)
        s_arg = float(sv)
    zv = rng.integers(-10, 10, n).astype(dtype) if zp == "vector" else np.asarray(zp, dtype)
    w = b.constexpr_affine_dequantize(quantized_data=b.weight(qv, "q.bin", dtype=dtype, emit=False),
                                      scale=s_arg, zero_point=zv, axis=axis)    # zv: typed int8/uint8
    y = b.conv(x=x, weight=w) if w.type.dtype == "fp16" else None
    b.output(*([w] if y is None else [w, y]))
    xv = h(rng, [1, ic, 1, 5])
    w64 = ref_dequantize(f64(qv), f64(sv), f64(zv), axis)
    # fp16 mode stores the folded weight as fp16, so the conv's fp16 reference is built on fp16(w);
    # fp32 mode keeps w exact and its conv is checked against w itself below
    w16 = f64(fp16_round(w64, ftz=False))
    assert np.array_equal(fp16_round(w64, ftz=True), w16)      # (none of these weights is subnormal)
    program, weights = round_trip(b)
    for precision, ftz in [("fp32", True), ("fp16", True), ("fp16", False)]:
        got = Plan(program, weights, precision, ftz).run({"x": xv})
        if got[w.name].dtype == np.float32:       # fp32 mode, or an fp32 scale (the result has its dtype)
            assert_fp32(got[w.name], w64, np.abs(w64))
        else:
            assert_fp16(got[w.name], w64, np.abs(w64), 0, 0.0, ftz)
            if y is not None:
                assert_fp16(got[y.name], ref_conv(f64(xv), w16), ref_conv(abs(f64(xv)), abs(w16)), 2,
                            (ic + 1) * U32, ftz)
    if y is not None:     # fp32 mode: the conv against the exact dequantised weight
        got = Plan(program, weights, "fp32").run({"x": xv})[y.name]
        assert_fp32(got, ref_conv(f64(xv), w64), ref_conv(abs(f64(xv)), abs(w64)))


# ------------------------------------------------------------------ const

CONSTS = [("fp16", 1.5), ("fp16", -0.0), ("fp16", 0.1), ("fp16", -65504.0), ("fp32", 1e-8), ("fp32", 3.14159265),
          ("int32", -2147483648), ("int8", -128), ("uint8", 255), ("bool", True), ("bool", False),
          ("fp16", [[0.5, -2.0, 1e-3], [7.0, 0.0, -0.0]]), ("fp32", [1e-30, -1e30, 0.1]),
          ("int32", [[1, -2], [3, 2147483647]]), ("int8", [-128, 0, 127]), ("uint8", [0, 200, 255]),
          ("bool", [True, False, True])]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("dtype,value", CONSTS)
@covers("const")
def test_const_inline(dialect, dtype, value):
    b = Builder(dialect)
    c = b.const(np.asarray(value), dtype, name="c")
    b.output(c)
    program, weights = round_trip(b)
    stored = np.asarray(value).astype({"fp16": np.float16, "fp32": np.float32, "int32": np.int32,
                                       "int8": np.int8, "uint8": np.uint8, "bool": bool}[dtype])
    for precision in ("fp32", "fp16"):
        got = Plan(program, weights, precision).run({})["c"]
        kind = np.float32 if dtype == "fp16" and precision == "fp32" else stored.dtype
        assert got.dtype == kind and got.shape == stored.shape
        assert got.astype(stored.dtype).tobytes() == stored.tobytes()    # bit exact, -0.0 included


@covers("const")
def test_const_string_and_scalar_forms():
    """String consts (as op arguments everywhere) and both scalar spellings survive the round trip."""
    for dialect, spelled in (("ios18", 'string pt = const()[name = string("pt"), val = string("valid")];'),
                             ("ios16", 'tensor<string, []> pt = const()[name = tensor<string, []>("pt"), '
                                       'val = tensor<string, []>("valid")];')):
        b = Builder(dialect)
        b.output(b.const('valid', "string", name="pt"), b.const(7, "int32", name="n"))
        program, _ = round_trip(b)
        assert spelled in b.text()
        got = Plan(program).run({})
        assert got["pt"] == "valid" and got["n"] == 7


BLOB_CONSTS = [("fp16", np.float16), ("fp32", np.float32), ("int8", np.int8), ("uint8", np.uint8)]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("dtype,np_dtype", BLOB_CONSTS)
@covers("const")
def test_const_blobfile(dialect, dtype, np_dtype):
    rng = rng_for("blob-const", dtype)
    if np.dtype(np_dtype).kind == "f":
        a, c = h(rng, [3, 4, 1, 1]).astype(np_dtype), h(rng, [5]).astype(np_dtype)
    else:
        info = np.iinfo(np_dtype)
        a, c = (rng.integers(info.min, info.max, s, endpoint=True).astype(np_dtype) for s in ([3, 4, 1, 1], [5]))
    b = Builder(dialect)
    va = b.weight(a, "w.bin", dtype=dtype, name="a")
    vc = b.weight(c, "w.bin", dtype=dtype, name="c")                     # a second chunk of the same file
    b.output(va, vc)
    assert "offset = uint64(64)" in b.text() or "offset = tensor<uint64, []>(64)" in b.text()
    program, weights = round_trip(b)
    for precision in ("fp32", "fp16"):
        got = Plan(program, weights, precision).run({})
        for name, want in (("a", a), ("c", c)):
            assert got[name].shape == want.shape
            assert np.array_equal(got[name], want.astype(np.float64))
            assert got[name].dtype == (np.float32 if dtype == "fp16" and precision == "fp32" else np_dtype)


@covers("const", "mul")
def test_const_blobfile_loads_from_the_weights_mapping():
    """The values come from the mapping given to Plan, not from anything the builder remembers;
    a missing entry is a BlobError that names the path."""
    rng = rng_for("blob-mapping")
    w1, w2 = h(rng, [1, 4, 1, 3]), h(rng, [1, 4, 1, 3])
    b = Builder()
    x = b.input("x", [1, 4, 1, 3])
    b.output(b.mul(x=x, y=b.weight(w1, "scale.bin")))
    program, weights = round_trip(b)
    assert list(weights) == ["@model_path/weights/scale.bin"] and program.blob_paths() == list(weights)
    xv = h(rng, [1, 4, 1, 3])
    other = Builder()
    other.output(other.weight(w2, "scale.bin"))
    for mapping, w in ((weights, w1), (other.weights(), w2)):
        got = Plan(program, weights=mapping, precision="fp16").run({"x": xv})["mul"]
        assert_fp16(got, f64(xv) * f64(w), np.abs(f64(xv) * f64(w)), 0, 0.0, True)
    for missing in ({}, None, {"@model_path/weights/other.bin": weights["@model_path/weights/scale.bin"]}):
        with pytest.raises(BlobError, match="@model_path/weights/scale.bin"):
            Plan(program, weights=missing)


# ------------------------------------------------------------------ fp16 numerics

def run_both(b, inputs, **kw):
    program, weights = round_trip(b)
    return (Plan(program, weights, "fp16", **kw).run(inputs), Plan(program, weights, "fp32").run(inputs))


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("mul", "add")
def test_fp16_overflow_gives_inf(dialect):
    b = Builder(dialect)
    x, y = b.input("x", [4]), b.input("y", [4])
    b.output(b.mul(x=x, y=y), b.add(x=x, y=y))
    xv = np.array([300, -300, 65504, 255.875], np.float16)
    yv = np.array([300, 300, 65504, 256], np.float16)
    g16, g32 = run_both(b, {"x": xv, "y": yv})
    assert list(g16["mul"]) == [np.inf, -np.inf, np.inf, 65504]      # 255.875 * 256 = 65504 is the largest
    assert list(g16["add"]) == [600, 0, np.inf, 512]                 # 131008 rounds past 65520: inf
    np.testing.assert_array_equal(g32["mul"], f64(xv) * f64(yv))    # fp32 mode: 90000 etc.
    np.testing.assert_array_equal(g32["add"], f64(xv) + f64(yv))
    assert g32["mul"][0] == 90000 and g32["add"][2] == 131008


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("mul", "matmul")
def test_fp16_subnormal_results_flush_to_zero(dialect):
    b = Builder(dialect)
    x, y = b.input("x", [1, 4]), b.input("y", [4, 1])
    b.output(b.mul(x=x, y=b.const(np.float16(1e-3), "fp16", name="k")), b.matmul(x=x, y=y))
    xv = np.array([[1e-3, -2e-3, 1e-4, 3.0]], np.float16)
    yv = np.array([[1e-3], [1e-3], [0.0], [0.0]], np.float16)
    x64, k64 = f64(xv), float(np.float16(1e-3))
    flushed, _ = run_both(b, {"x": xv, "y": yv})
    kept, exact = run_both(b, {"x": xv, "y": yv}, ftz=False)
    products = x64 * k64                                  # 1e-6, -2e-6, 1e-7 are fp16 subnormals
    assert list(flushed["mul"][0, :3]) == [0, 0, 0] and flushed["mul"][0, 3] == np.float16(3 * k64)
    assert np.all(kept["mul"][0, :3] != 0)
    np.testing.assert_array_equal(kept["mul"], fp16_round(products, ftz=False))
    dot = float(x64[0] @ f64(yv)[:, 0])                   # -1e-6: subnormal sum of two products
    assert flushed["matmul"][0, 0] == 0 and kept["matmul"][0, 0] == np.float16(dot)
    # fp32 mode keeps tiny values: 1e-7 and 1e-8 products are not flushed
    assert_fp32(exact["mul"], products, np.abs(products))
    assert exact["matmul"][0, 0] != 0 and abs(exact["matmul"][0, 0] - dot) <= 1e-6 * abs(dot)


@pytest.mark.parametrize("dialect", DIALECTS)
@covers("mul")
def test_fp32_mode_keeps_small_products(dialect):
    b = Builder(dialect)
    x = b.input("x", [3])
    b.output(b.mul(x=x, y=x))
    xv = np.array([1e-4, -1e-4, 2e-4], np.float16)              # normal fp16 values, squares ~1e-8
    g16, g32 = run_both(b, {"x": xv})
    want = f64(xv) ** 2
    assert np.all(g16["mul"] == 0)
    assert np.all(g32["mul"] > 0) and np.all(np.abs(g32["mul"] - want) <= 1e-6 * want)


# ------------------------------------------------------------------ the reference's dynamic matmul

HEADER = ('program(1.3)\n[buildInfo = dict<string, string>({{"coremlc-component-MIL", "3510.2.1"}, '
          '{"coremlc-version", "3505.4.1"}, {"coremltools-component-milinternal", ""}, '
          '{"coremltools-version", "9.0"}})]{\n')


def dyn_matmul_text(ic, oc, seq):
    """gen_dyn_matmul's MIL, spelled the way the reference spells it (shorthand scalars, no spaces)."""
    body = [
        f'    func main<ios18>(tensor<fp16, [1, {ic}, 1, {seq + oc}]> x) {{',
        '        tensor<int32, [4]> ba = const()[name=string("ba"), val=tensor<int32, [4]>([0,0,0,0])];',
        f'        tensor<int32, [4]> sa = const()[name=string("sa"), val=tensor<int32, [4]>([1,{ic},1,{seq}])];',
        f'        tensor<fp16, [1,{ic},1,{seq}]> act = slice_by_size(x=x,begin=ba,size=sa)[name=string("act")];',
        f'        tensor<int32, [4]> bw = const()[name=string("bw"), val=tensor<int32, [4]>([0,0,0,{seq}])];',
        f'        tensor<int32, [4]> sw = const()[name=string("sw"), val=tensor<int32, [4]>([1,{ic},1,{oc}])];',
        f'        tensor<fp16, [1,{ic},1,{oc}]> wt = slice_by_size(x=x,begin=bw,size=sw)[name=string("wt")];',
        f'        tensor<int32, [4]> ra = const()[name=string("ra"), val=tensor<int32, [4]>([1,1,{ic},{seq}])];',
        f'        tensor<fp16, [1,1,{ic},{seq}]> a2 = reshape(shape=ra,x=act)[name=string("a2")];',
        '        tensor<int32, [4]> pm = const()[name=string("pm"), val=tensor<int32, [4]>([0,1,3,2])];',
        f'        tensor<fp16, [1,1,{seq},{ic}]> a3 = transpose(perm=pm,x=a2)[name=string("a3")];',
        f'        tensor<int32, [4]> rw = const()[name=string("rw"), val=tensor<int32, [4]>([1,1,{ic},{oc}])];',
        f'        tensor<fp16, [1,1,{ic},{oc}]> W = reshape(shape=rw,x=wt)[name=string("W")];',
        '        bool bF = const()[name=string("bF"), val=bool(false)];',
        f'        tensor<fp16, [1,1,{seq},{oc}]> yh = matmul(transpose_x=bF,transpose_y=bF,x=a3,y=W)[name=string("yh")];',
        f'        tensor<fp16, [1,1,{oc},{seq}]> yt = transpose(perm=pm,x=yh)[name=string("yt")];',
        f'        tensor<int32, [4]> ro = const()[name=string("ro"), val=tensor<int32, [4]>([1,{oc},1,{seq}])];',
        f'        tensor<fp16, [1,{oc},1,{seq}]> y = reshape(shape=ro,x=yt)[name=string("y")];',
        '    } -> (y);',
        '}',
    ]
    return HEADER + "\n".join(body) + "\n"


def dyn_matmul_builder(ic, oc, seq, dialect):
    b = Builder(dialect)
    x = b.input("x", [1, ic, 1, seq + oc])
    act = b.slice_by_size(x=x, begin=[0, 0, 0, 0], size=[1, ic, 1, seq], name="act")
    wt = b.slice_by_size(x=x, begin=[0, 0, 0, seq], size=[1, ic, 1, oc], name="wt")
    a3 = b.transpose(x=b.reshape(x=act, shape=[1, 1, ic, seq], name="a2"), perm=[0, 1, 3, 2], name="a3")
    w = b.reshape(x=wt, shape=[1, 1, ic, oc], name="W")
    yh = b.matmul(x=a3, y=w, transpose_x=False, transpose_y=False, name="yh")
    yt = b.transpose(x=yh, perm=[0, 1, 3, 2], name="yt")
    b.output(b.reshape(x=yt, shape=[1, oc, 1, seq], name="y"))
    return b


def assert_one_gemm(program, monkeypatch, inputs):
    """One matmul step, no transpose after it, and exactly one BLAS GEMM per evaluation."""
    plan = Plan(program)
    types = [s.op.type for s in plan.steps]
    assert types.count("matmul") == 1 and "transpose" not in types[types.index("matmul"):], types
    calls = []
    real = anectypes.host.blas.matmul
    monkeypatch.setattr(anectypes.host.blas, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan.run(inputs)
    assert len(calls) == 1


@pytest.mark.parametrize("ic,oc,seq", [(48, 80, 24), (96, 32, 40)])
@pytest.mark.parametrize("source", ["builder-ios18", "builder-ios16", "text"])
@covers("slice_by_size", "reshape", "transpose", "matmul")
def test_dynamic_matmul(ic, oc, seq, source, monkeypatch):
    """docs/ane-reference.md §3.4: channel i of the input holds x[i, :SEQ] then row i of the IC x OC matrix W;
    the kernel computes y[o, s] = sum_i W[i, o] x[i, s], i.e. y = Wᵀx, laid out [1, OC, 1, SEQ]."""
    rng = rng_for("dyn", ic, oc, seq)
    xa, wm = h(rng, [ic, seq]), h(rng, [ic, oc], 0.1)
    packed = np.concatenate([xa, wm], axis=1).reshape(1, ic, 1, seq + oc)
    x64, w64 = f64(xa, wm)
    want = np.zeros((oc, seq))
    mag = np.zeros((oc, seq))
    for i in range(ic):                                   # the definition, one input channel at a time
        want += np.outer(w64[i], x64[i])
        mag += np.outer(abs(w64[i]), abs(x64[i]))
    want, mag = want.reshape(1, oc, 1, seq), mag.reshape(1, oc, 1, seq)
    if source == "text":
        text = dyn_matmul_text(ic, oc, seq)
        program = parse(text)
        assert parse(program.text()).text() == program.text()
        for precision, ftz in [("fp32", True), ("fp16", True), ("fp16", False)]:
            got = Plan(program, precision=precision, ftz=ftz).run({"x": packed})["y"]
            if precision == "fp32":
                assert_fp32(got, want, mag)
            else:
                assert_fp16(got, want, mag, 2, ic * U32, ftz)
        built = dyn_matmul_builder(ic, oc, seq, "ios18")
        same = Plan(parse(built.text())).run({"x": packed})["y"]
        assert np.array_equal(Plan(program).run({"x": packed})["y"], same)     # same program, same bits
    else:
        program = check(dyn_matmul_builder(ic, oc, seq, source.split("-")[1]), {"x": packed}, want, mag=mag,
                        ulps=2, terms=ic)
    assert_one_gemm(program, monkeypatch, {"x": packed})


# ------------------------------------------------------------------ coverage

def test_every_registry_op_is_covered():
    """Every op in ops.OPS, plus const, has a test above: a new op must come with one."""
    assert set(OPS) | {"const"} == COVERED, sorted((set(OPS) | {"const"}) ^ COVERED)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bound_runner_reads_its_arrays_at_each_call(precision):
    """Plan.bind resolves views once; a runner called again after its input arrays changed in place
    computes from the new data, also through a reshape that numpy can only copy (of a transpose),
    and writes into the same output arrays."""
    b = Builder()
    x = b.input("x", [1, 2, 3, 4])
    t = b.reshape(x=b.transpose(x=b.sigmoid(x=x, name="s"), perm=[0, 1, 3, 2], name="t"), shape=[1, 2, 1, 12], name="r")
    b.output(b.mul(x=t, y=2.0, name="y"), b.slice_by_size(x=x, begin=[0, 1, 0, 0], size=[1, 1, 3, 4], name="v"))
    plan = Plan(parse(b.text()), precision=precision)
    dtype = np.float16 if precision == "fp16" else np.float32
    xv = np.zeros((1, 2, 3, 4), dtype)
    outs = {"y": np.zeros((1, 2, 1, 12), dtype), "v": np.zeros((1, 1, 3, 4), dtype)}
    runner = plan.bind({"x": xv}, outs)
    rng = np.random.default_rng(7)
    for _ in range(3):
        xv[...] = rng.standard_normal(xv.shape)
        runner()
        x64 = f64(xv)
        s64 = 1 / (1 + np.exp(-x64))
        s64 = s64.astype(np.float16).astype(np.float64) if precision == "fp16" else s64
        np.testing.assert_allclose(outs["y"], 2 * np.swapaxes(s64, 2, 3).reshape(1, 2, 1, 12), rtol=1e-3)
        np.testing.assert_array_equal(outs["v"], xv[:, 1:])
        assert runner.outputs["y"] is outs["y"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_concat_parts_along_a_later_axis(precision):
    """RoPE's concat of two halves along the last axis of [1, H, d, S]: its parts are strided views,
    which an add or sub writes in place in fp32 mode (nothing to round) and which fp16 mode, and an
    op that needs a contiguous result (sigmoid), leave to the concat's copy. Same values either way."""
    b = Builder()
    x, y = b.input("x", [1, 2, 3, 4]), b.input("y", [1, 2, 3, 4])
    parts = (b.sub(x=x, y=y, name="ra"), b.add(x=x, y=y, name="rb"), b.sigmoid(x=x, name="sg"))
    b.output(b.mul(x=b.concat(values=parts, axis=3, interleave=False, name="r"), y=2.0, name="out"))
    plan = Plan(parse(b.text()), precision=precision)
    assert len(plan.placed) == (2 if precision == "fp32" else 0)
    rng = np.random.default_rng(6)
    xv, yv = (rng.standard_normal((1, 2, 3, 4)).astype(np.float16) for _ in range(2))
    x64, y64 = f64(xv, yv)
    rnd = (lambda v: v.astype(np.float16).astype(np.float64)) if precision == "fp16" else (lambda v: v)
    want = 2 * np.concatenate([rnd(x64 - y64), rnd(x64 + y64), rnd(1 / (1 + np.exp(-x64)))], axis=3)
    for _ in range(2):                                          # run after run
        got = plan.run({"x": xv, "y": yv})["out"].astype(np.float64)
        np.testing.assert_allclose(got, rnd(want), rtol=2e-3 if precision == "fp16" else 1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_concat_parts_and_outputs_computed_in_place(precision):
    """The plan lets ops write straight into their part of a channel concat (nested concats, a
    reshape in between, a part used twice or read again later) and into the caller's output arrays;
    the results equal the plain computation, with or without output arrays, run after run."""
    b = Builder()
    x = b.input("x", [1, 3, 1, 4])
    a0 = b.add(x=b.reshape(x=x, shape=[1, 1, 3, 4], name="x4"), y=1.0, name="a0")
    a = b.reshape(x=a0, shape=[1, 3, 1, 4], name="a")
    inner = b.concat(values=(b.mul(x=x, y=2.0, name="twice"), x), axis=1, interleave=False, name="inner")
    outs = (b.concat(values=(a, inner, a), axis=1, interleave=False, name="c"), b.sub(x=a, y=x, name="d"),
            b.concat(values=(a0, a0), axis=3, interleave=False, name="e"))     # e's parts: not contiguous
    b.output(*outs)
    plan = Plan(parse(b.text()), precision=precision)
    names = list(plan.outputs)
    assert len(plan.placed) == 3 and len(plan.direct) == 3   # a0, twice, inner placed; c, d, e direct
    fp16 = precision == "fp16"
    rnd = (lambda v: v.astype(np.float16).astype(np.float64)) if fp16 else (lambda v: v)
    rng = np.random.default_rng(5)
    for given in (False, True, True):
        x64 = rng.standard_normal((1, 3, 1, 4)).astype(np.float16).astype(np.float64)
        a64 = rnd(x64 + 1)
        want = [np.concatenate([a64, rnd(2 * x64), x64, a64], axis=1), rnd(a64 - x64),
                np.concatenate([a64.reshape(1, 1, 3, 4)] * 2, axis=3)]
        dtype = np.float16 if fp16 else np.float32
        arrays = {n: np.full(w.shape, np.nan, dtype) for n, w in zip(names, want)}
        got = plan.run({"x": x64.astype(np.float16)}, arrays if given else None)
        for n, w in zip(names, want):
            assert got[n].dtype == dtype and (got[n] is arrays[n]) == given
            np.testing.assert_array_equal(got[n], w)
