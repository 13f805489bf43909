"""The MIL op registry: one class per op holds its arguments, the opsets that have it, its type/shape
rule and its numpy code.

The builder, the parser and the interpreter all read this table (docs/ane-reference.md §3.3), so an op's
argument names, dtypes and shape rule live in exactly one place. Each op's docstring documents it, as
coremltools' op classes do: what it computes, its inputs (types, dtypes, which must be const, defaults),
its output, its first opset, and what anectypes does not support of Apple's definition ("Not supported
by anectypes"), in sections that tests/test_mil_rules.py holds to the Params; `python -m anectypes.mil
ops` makes docs/mil.md's table of them. This file is the whole registry, each op's definition and
documentation beside its code, hence its length past 450 lines.

`infer(a)` gets an Args whose entries have `.type` (TensorType), `.value` (the literal for inline
constants, else None) and `.const` (known at compile time, BLOBFILEs included), plus `a.opset`, and
returns the output TensorType, raising MILError on misuse. The rules are Apple's (coremltools'
`converters/mil/mil/ops/defs/iOS15..iOS18`, docs/ane-reference.md §3.8); what Apple accepts and
anectypes does not implement is refused by `unsupported()`, which says so.
`run(a, out)` gets the values themselves (numpy arrays, float32 for both float types, or Python
scalars for scalar constants) and writes the result into `out`, a preallocated float32 buffer for
float outputs (in fp16 mode the interpreter then rounds it to fp16 values in place) or the output
dtype otherwise. View ops return a view instead.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ..host import blas
from ..errors import MILError
from .types import FLOAT, NUMERIC, OPSETS, TensorType

REQUIRED = object()


@dataclass(frozen=True)
class Param:
    kind: str                 # "tensor": any variable; "const": must be known when the program is compiled
    dtypes: tuple = NUMERIC   # allowed MIL dtypes
    default: object = REQUIRED
    many: bool = False        # a tuple of variables, e.g. concat(values=(a, b))
    blob_ok: bool = False     # a const that may come from a BLOBFILE (its value is known only at compile)
    computed_ok: bool = False # Apple's definition also takes a computed value, which anectypes does not
    apple: tuple = ()         # dtypes Apple's definition also accepts, which anectypes does not implement
    newer: tuple = ()         # dtypes (of `dtypes` or `apple`) that Apple accepts only from iOS17 on


def tensor(*dtypes, default=REQUIRED, many=False, apple=(), newer=()):
    return Param("tensor", dtypes or NUMERIC, default, many, apple=apple, newer=newer)


def const(*dtypes, default=REQUIRED, blob_ok=False, computed_ok=False):
    return Param("const", dtypes, default, blob_ok=blob_ok, computed_ok=computed_ok)


def moved(*extra):
    """The data of a data-movement op: Apple's iOS15 types, and 8-bit integers from iOS17 on."""
    return tensor("fp16", "fp32", "int32", "bool", "int8", "uint8", *extra,
                  newer=("int8", "uint8", "int16", "uint16"), apple=("int16", "uint16"))


class Op:
    name = ""
    params = {}
    kind = "compute"          # "compute" (fresh result), "view" (no copy), "exact" (values unchanged)
    in_attributes = False     # constexpr ops take their arguments in the [...] attribute list
    strided_out = False       # run() may write into a strided view (a part of a concat's result)
    since = "ios15"           # the first of Apple's opsets (types.OPSETS) that has the op

    def infer(self, a):
        raise NotImplementedError

    def run(self, a, out):
        raise NotImplementedError


OPS = {}


def register(cls):
    OPS[cls.name] = cls()
    return cls


def fail(message):
    raise MILError(message)


def need(condition, message):
    if not condition:
        fail(message)


def unsupported(condition, what, a):
    """Refuse what Apple's definition of the op accepts but anectypes does not implement."""
    if condition:
        fail(f"{what} is not supported by anectypes (Apple's {a.opset} definition of the op accepts it)")


def from_ios17(a):
    return OPSETS.index(a.opset) >= OPSETS.index("ios17")


def Args(**kw):
    return SimpleNamespace(**kw)


def f32(x):
    """float32 operand for fp32 arithmetic (a no-op for float tensors, which are stored as float32)."""
    return x if isinstance(x, np.ndarray) and x.dtype == np.float32 else np.array(x, np.float32, order="K")


def norm_axis(axis, rank, what="axis"):
    need(-rank <= axis < rank, f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


def same_dtype(*args):
    dts = {a.type.dtype for a in args}
    need(len(dts) == 1, "operands must have the same dtype, got " + " and ".join(sorted(dts)))
    return dts.pop()


def broadcast(*shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        fail("shapes " + " and ".join(str(list(s)) for s in shapes) + " do not broadcast")


def vector(a, name, length, dtype="int32"):
    """A const int vector argument of a given length, as a tuple."""
    t = a.type
    need(t.dtype == dtype and t.shape == (length,), f"{name} must be tensor<{dtype}, [{length}]>, got {t}")
    return tuple(int(v) for v in a.value)


def sum_last(x, out=None):
    """Sums of float32 x along its last axis, keepdims: einsum's loop, quicker than numpy.sum's on rows
    of a few hundred (docs/train-speed.md)."""
    out = np.empty(x.shape[:-1] + (1,), np.float32) if out is None else out
    np.einsum("...i->...", x, out=out[..., 0])
    return out


def gemm_operand(x):
    """float32 with a BLAS-compatible layout in the last two axes (views of views may need a copy)."""
    x = f32(x)
    s, item = x.strides[-2:], x.itemsize
    if x.ndim >= 2 and (s[1] == item and s[0] >= max(x.shape[1], 1) * item
                        or s[0] == item and s[1] >= max(x.shape[0], 1) * item):
        return x
    return np.ascontiguousarray(x)


# ---------------------------------------------------------------- data movement (views)

@register
class SliceBySize(Op):
    """x[begin[i] : begin[i] + size[i]] on every axis i: a view of x, no copy.

    Inputs:
        x: tensor<T, [d_0, ..., d_n]>.
        begin: const tensor<int32, [rank(x)]>, the first index on each axis (0 <= begin[i] < d_i).
        size: const tensor<int32, [rank(x)]>, the length on each axis, or -1 for the rest of it.
    Output: tensor<T, size>, each -1 replaced by d_i - begin[i]; the slice lies inside x.
    T: fp16, fp32, int32, bool; int8 and uint8 from iOS17.
    Opsets: iOS15 on; the 8-bit T from iOS17 (the ios18 dialect).
    Not supported by anectypes: a computed begin or size; int16 and uint16 data (iOS17); a negative begin;
        a size of 0; a slice that reaches beyond x (Apple's type inference does not check the bounds).
    """
    name, kind = "slice_by_size", "view"
    params = dict(x=moved(), begin=const("int32", computed_ok=True), size=const("int32", computed_ok=True))

    def infer(self, a):
        shape = a.x.type.shape
        begin, size = vector(a.begin, "begin", len(shape)), vector(a.size, "size", len(shape))
        unsupported(min(begin, default=0) < 0, f"a negative slice begin {list(begin)}", a)
        out = []
        for d, (b, s, n) in enumerate(zip(begin, size, shape)):
            s = n - b if s == -1 else s
            unsupported(s == 0, f"an empty slice (size {list(size)})", a)
            need(s > 0, f"slice size {list(size)} is negative on axis {d}")
            unsupported(b + s > n, f"a slice (begin {list(begin)}, size {list(size)}) outside x {list(shape)} on "
                                   f"axis {d}", a)
            out.append(s)
        return TensorType(a.x.type.dtype, tuple(out))

    def run(self, a, out=None):
        return a.x[tuple(slice(b, b + s if s != -1 else None) for b, s in zip(a.begin, a.size))]


@register
class Reshape(Op):
    """x's elements in the same row-major order, with another shape: a view of x where its strides allow.

    Inputs:
        x: tensor<T, any shape>.
        shape: const tensor<int32, [K]>, positive sizes and at most one -1 (the size that keeps the count).
    Output: tensor<T, shape> (its -1 filled in), with as many elements as x.
    T: fp16, fp32, int32, bool; int8 and uint8 from iOS17.
    Opsets: iOS15 on; the 8-bit T from iOS17 (the ios18 dialect).
    Not supported by anectypes: a computed shape; int16 and uint16 data (iOS17); a 0 in shape (Apple copies
        x's dimension there, counted from the left and at equal rank in iOS15, from the right in iOS17).
    """
    name, kind = "reshape", "view"
    params = dict(x=moved(), shape=const("int32", computed_ok=True))

    def infer(self, a):
        t = a.shape.type
        need(t.dtype == "int32" and t.rank == 1, f"shape must be a 1-D int32 const, got {t}")
        given = [int(v) for v in a.shape.value]
        shape = self.zeros_copied(given, a.x.type.shape, from_ios17(a))
        need(shape.count(-1) <= 1 and all(v > 0 or v == -1 for v in shape),
             f"shape {shape} may hold positive sizes and at most one -1")
        n = a.x.type.size
        if -1 in shape:
            rest = int(np.prod([v for v in shape if v != -1]))
            need(n % rest == 0, f"cannot infer -1 in shape {shape} for {n} elements")
            shape[shape.index(-1)] = n // rest
        need(int(np.prod(shape)) == n, f"cannot reshape {list(a.x.type.shape)} ({n} elements) to {shape}")
        unsupported(0 in given, f"0 in a reshape shape {given} (it copies a dimension of x)", a)
        return TensorType(a.x.type.dtype, tuple(shape))

    @staticmethod
    def zeros_copied(shape, x_shape, right_aligned):
        """Apple's reading of a 0 in the shape: x's dimension at that place, counted from the left
        (iOS15, same rank only) or from the right (iOS17; 1 beyond x's rank)."""
        if 0 not in shape:
            return shape
        if not right_aligned:
            need(len(shape) == len(x_shape), f"a 0 in shape {shape} needs the rank of x {list(x_shape)}")
            return [x_shape[i] if v == 0 else v for i, v in enumerate(shape)]
        lead = len(shape) - len(x_shape)
        return [(x_shape[i - lead] if i >= lead else 1) if v == 0 else v for i, v in enumerate(shape)]

    def run(self, a, out=None):
        return a.x.reshape(tuple(int(v) for v in a.shape))  # a view whenever the strides allow


@register
class Transpose(Op):
    """x with its axes permuted: axis i of the result is axis perm[i] of x (a view, no copy).

    Inputs:
        x: tensor<T, [d_0, ..., d_n]>.
        perm: const tensor<int32, [rank(x)]>, each axis once, negative ones counted from the end.
    Output: tensor<T, [d_perm[0], ..., d_perm[n]]>.
    T: fp16, fp32, int32, bool; int8 and uint8 from iOS17.
    Opsets: iOS15 on; the 8-bit T from iOS17 (the ios18 dialect).
    Not supported by anectypes: int16 and uint16 data (iOS17); a perm that repeats an axis (Apple's type
        inference takes it).
    """
    name, kind = "transpose", "view"
    params = dict(x=moved(), perm=const("int32"))

    def infer(self, a):
        shape = a.x.type.shape
        perm = vector(a.perm, "perm", len(shape))
        need(all(-len(shape) <= p < len(shape) for p in perm), f"perm {list(perm)} has axes out of range")
        unsupported(sorted(p % len(shape) for p in perm) != list(range(len(shape))),
                    f"a perm {list(perm)} that is not a permutation of the {len(shape)} axes", a)
        return TensorType(a.x.type.dtype, tuple(shape[p] for p in perm))

    def run(self, a, out=None):
        return a.x.transpose(tuple(int(p) for p in a.perm))


@register
class Concat(Op):
    """The values joined along axis; with interleave, their slices along it alternate: v0[0], v1[0], v0[1], ...

    Inputs:
        values: a tuple (a, b, ...) of tensor<T> of one rank and dtype, equal in size outside axis.
        axis: const int32 scalar in [-rank, rank).
        interleave: const bool, default false; true needs values of one shape.
    Output: tensor<T> shaped like the values, its size along axis the sum of theirs.
    T: fp16, fp32, int32, bool, int8, uint8.
    Opsets: iOS15 on.
    Not supported by anectypes: a concat of scalars.
    """
    name, kind = "concat", "exact"
    params = dict(values=tensor("fp16", "fp32", "int32", "bool", "int8", "uint8", many=True), axis=const("int32"),
                  interleave=const("bool", default=False))

    def infer(self, a):
        need(a.axis.type.shape == (), "axis must be a scalar int32")
        dtype = same_dtype(*a.values)
        shapes = [v.type.shape for v in a.values]
        rank = len(shapes[0])
        need(all(len(s) == rank for s in shapes), "all values must have the same rank")
        unsupported(rank == 0, "concat of scalars", a)
        ax = norm_axis(a.axis.value, rank)
        if a.interleave.value:
            need(all(s == shapes[0] for s in shapes), "interleave needs values of identical shape")
        for s in shapes:
            need(s[:ax] + s[ax + 1:] == shapes[0][:ax] + shapes[0][ax + 1:],
                 f"shapes {[list(s) for s in shapes]} differ outside axis {ax}")
        out = list(shapes[0])
        out[ax] = sum(s[ax] for s in shapes)
        return TensorType(dtype, tuple(out))

    def run(self, a, out):
        ax = a.axis % out.ndim
        if a.interleave:  # x0[0], x1[0], x0[1], x1[1], ... along the axis
            shape = out.shape[:ax] + (a.values[0].shape[ax], len(a.values)) + out.shape[ax + 1:]
            np.stack(a.values, axis=ax + 1, out=out.reshape(shape))
        else:
            np.concatenate(a.values, axis=ax, out=out)


# ---------------------------------------------------------------- arithmetic

class Binary(Op):
    """Elementwise arithmetic on two tensors that broadcast (numpy's rule): add, sub and mul, whose
    docstrings give only what they compute.

    Inputs:
        x: tensor<T>.
        y: tensor<T> that broadcasts against x, such as a scalar.
    Output: tensor<T> of the broadcast shape.
    T: fp16, fp32 or int32, one for both operands.
    Opsets: iOS15 on.
    """
    params = dict(x=tensor("fp16", "fp32", "int32"), y=tensor("fp16", "fp32", "int32"))
    ufunc = None
    strided_out = True        # a ufunc writes any view

    def infer(self, a):
        return TensorType(same_dtype(a.x, a.y), broadcast(a.x.type.shape, a.y.type.shape))

    def run(self, a, out):
        if out.dtype == np.float32:
            self.ufunc(a.x, a.y, out=out, dtype=np.float32)
        else:
            self.ufunc(a.x, a.y, out=out)


@register
class Add(Binary):
    """x + y, elementwise with broadcasting."""
    name, ufunc = "add", np.add


@register
class Sub(Binary):
    """x - y, elementwise with broadcasting."""
    name, ufunc = "sub", np.subtract


@register
class Mul(Binary):
    """x * y, elementwise with broadcasting."""
    name, ufunc = "mul", np.multiply


@register
class Pow(Binary):
    """x ** y, elementwise with broadcasting; pow(x, -0.5) stands in for rsqrt, which the ANE lacks (§3.6).

    Inputs:
        x: tensor<T>.
        y: tensor<T> that broadcasts against x, such as a scalar.
    Output: tensor<T> of the broadcast shape.
    T: fp16 or fp32, one for both operands.
    Opsets: iOS15 on.
    Not supported by anectypes: int32 operands (Apple's pow takes them).
    """
    name, ufunc = "pow", np.power
    params = dict(x=tensor(*FLOAT, apple=("int32",)), y=tensor(*FLOAT, apple=("int32",)))


@register
class Sigmoid(Op):
    """1 / (1 + exp(-x)), elementwise.

    Inputs:
        x: tensor<T>.
    Output: tensor<T> shaped like x.
    T: fp16 or fp32.
    Opsets: iOS15 on.
    """
    name = "sigmoid"
    params = dict(x=tensor(*FLOAT))

    def infer(self, a):
        return a.x.type

    def run(self, a, out):
        np.negative(a.x, out=out, dtype=np.float32)
        np.exp(out, out=out)          # exp overflow gives inf, and 1/(1+inf) = 0 as it should
        out += 1
        np.reciprocal(out, out=out)


@register
class Softmax(Op):
    """exp(x) / sum(exp(x)) along axis (computed as exp(x - max) for range).

    Inputs:
        x: tensor<T>.
        axis: const int32 scalar, default -1.
    Output: tensor<T> shaped like x.
    T: fp16 or fp32.
    Opsets: iOS15 on.
    Not supported by anectypes: an axis outside [-rank, rank) (Apple's type inference takes it).
    """
    name = "softmax"
    params = dict(x=tensor(*FLOAT), axis=const("int32", default=-1))

    def infer(self, a):
        need(a.axis.type.shape == (), "axis must be a scalar int32")
        unsupported(not -a.x.type.rank <= a.axis.value < a.x.type.rank,
                    f"axis {a.axis.value} out of range for rank {a.x.type.rank}", a)
        return a.x.type

    def run(self, a, out):
        np.subtract(a.x, np.max(a.x, axis=a.axis, keepdims=True), out=out, dtype=np.float32)
        np.exp(out, out=out)
        out /= sum_last(out) if a.axis % out.ndim == out.ndim - 1 else np.sum(out, axis=a.axis, keepdims=True)


@register
class ReduceSum(Op):
    """The sum of x over the given axes.

    Inputs:
        x: tensor<T>.
        axes: const tensor<int32, [K]>, optional (default: every axis), each in [-rank, rank).
        keep_dims: const bool, default false: keep each summed axis, as size 1.
    Output: tensor<T> without the summed axes (size 1 with keep_dims); a scalar when none is left.
    T: fp16, fp32 or int32.
    Opsets: iOS15 on.
    Not supported by anectypes: an axis listed twice (Apple's shape rule drops a dimension for each entry).
    """
    name = "reduce_sum"
    params = dict(x=tensor("fp16", "fp32", "int32"), axes=const("int32", default=None),
                  keep_dims=const("bool", default=False))

    def axes_of(self, axes, rank):
        if axes is None:
            return tuple(range(rank))
        axes = tuple(norm_axis(int(v), rank, "axes entry") for v in np.atleast_1d(axes))
        need(len(set(axes)) == len(axes), f"axes {list(axes)} repeat an axis")
        return axes

    def infer(self, a):
        if a.axes.value is not None:
            need(a.axes.type.rank == 1, f"axes must be a 1-D int32 const, got {a.axes.type}")
            axes = [norm_axis(int(v), a.x.type.rank, "axes entry") for v in a.axes.value]
            if len(set(axes)) < len(axes):    # Apple drops each listed axis in turn, from the last
                need(a.keep_dims.value or all(ax < a.x.type.rank - j for j, ax in enumerate(sorted(axes)[::-1])),
                     f"axes {[int(v) for v in a.axes.value]} repeat an axis and drop more axes than x has")
                unsupported(True, f"repeated axes {[int(v) for v in a.axes.value]}", a)
        axes = self.axes_of(a.axes.value, a.x.type.rank)
        keep = a.keep_dims.value
        shape = tuple(1 if d in axes else n for d, n in enumerate(a.x.type.shape) if keep or d not in axes)
        return TensorType(a.x.type.dtype, shape)

    def run(self, a, out):
        axes = self.axes_of(a.axes, a.x.ndim)
        if axes == (a.x.ndim - 1,) and a.x.dtype == out.dtype == np.float32 and out.flags.c_contiguous:
            sum_last(a.x, out.reshape(a.x.shape[:-1] + (1,)))
            return
        np.sum(a.x, axis=axes, keepdims=bool(a.keep_dims), out=out,
               dtype=np.float32 if out.dtype == np.float32 else None)


@register
class MatMul(Op):
    """x @ y on the last two axes, batch axes broadcast (numpy's matmul); a transpose flag swaps the last two
    axes of its operand first.

    Inputs:
        x: tensor<T, [..., M, K]> ([..., K, M] with transpose_x), rank >= 2.
        y: tensor<T, [..., K, N]> ([..., N, K] with transpose_y), rank >= 2.
        transpose_x: const bool, default false.
        transpose_y: const bool, default false.
    Output: tensor<T, [broadcast batch axes of x and y, M, N]>.
    T: fp16 or fp32, one for both operands.
    Opsets: iOS15 on.
    Not supported by anectypes: int32 operands; a rank-1 operand (Apple's treats it as a vector); from
        iOS17, a const operand of another dtype than the other one.
    """
    name = "matmul"
    params = dict(x=tensor(*FLOAT, apple=("int32",)), y=tensor(*FLOAT, apple=("int32",)),
                  transpose_x=const("bool", default=False), transpose_y=const("bool", default=False))

    def infer(self, a):
        unsupported(from_ios17(a) and a.x.type.dtype != a.y.type.dtype and a.x.const != a.y.const,
                    "a const operand of another dtype than the other", a)
        dtype = same_dtype(a.x, a.y)
        xs, ys = a.x.type.shape, a.y.type.shape
        unsupported(min(len(xs), len(ys)) == 1, f"a rank-1 operand ({list(xs)} and {list(ys)})", a)
        need(len(xs) >= 2 and len(ys) >= 2, f"matmul needs tensor operands, got {list(xs)} and {list(ys)}")
        m, k = xs[-2:][::-1] if a.transpose_x.value else xs[-2:]
        k2, n = ys[-2:][::-1] if a.transpose_y.value else ys[-2:]
        need(k == k2, f"inner dimensions differ: x {list(xs)} (transpose_x={a.transpose_x.value}) "
                      f"and y {list(ys)} (transpose_y={a.transpose_y.value})")
        return TensorType(dtype, broadcast(xs[:-2], ys[:-2]) + (m, n))

    def run(self, a, out):
        blas.matmul(gemm_operand(a.x), gemm_operand(a.y), out,
                    trans_a=bool(a.transpose_x), trans_b=bool(a.transpose_y))


@register
class Conv(Op):
    """2-D convolution (cross-correlation, as in PyTorch) over [N, C, H, W], with groups, strides, dilations
    and padding; a 1x1 conv is the ANE's linear layer (§3.4).

    Inputs:
        x: tensor<T, [N, C, H, W]>.
        weight: tensor<T, [OC, C / groups, kH, kW]>; a computed one (not from consts) takes no dilations.
        bias: tensor<T, [OC]>, optional; a const before iOS17.
        strides: const tensor<int32, [2]>, default [1, 1].
        pad_type: const string, default "valid"; "same" (output ceil(H / stride)), "same_lower" (its odd
            padding pixel first) or "custom" (pad).
        pad: const tensor<int32, [4]> (top, bottom, left, right), default [0, 0, 0, 0]; read for "custom".
        dilations: const tensor<int32, [2]>, default [1, 1].
        groups: const int32 scalar, default 1, dividing C and OC.
    Output: tensor<T, [N, OC, OH, OW]>, OH = (H + top + bottom - dilation * (kH - 1) - 1) // stride + 1
        (OW alike), at least 1.
    T: fp16 or fp32.
    Opsets: iOS15 on.
    Not supported by anectypes: 1-D and 3-D conv; from iOS17, a weight (and bias) of another dtype than x.
    """
    name = "conv"
    params = dict(x=tensor(*FLOAT), weight=tensor(*FLOAT), bias=tensor(*FLOAT, default=None),
                  strides=const("int32", default=(1, 1)), pad_type=const("string", default="valid"),
                  pad=const("int32", default=(0, 0, 0, 0)), dilations=const("int32", default=(1, 1)),
                  groups=const("int32", default=1))

    def geometry(self, x_shape, w_shape, strides, pad_type, pad, dilations):
        """Output spatial size and the (top, bottom, left, right) padding actually applied."""
        out, pads = [], []
        for d in range(2):
            n, k, s, dil = x_shape[2 + d], w_shape[2 + d], strides[d], dilations[d]
            span = dil * (k - 1) + 1
            if pad_type in ("same", "same_lower"):       # same_lower: the odd pixel of padding goes first
                o = -(-n // s)
                total = max((o - 1) * s + span - n, 0)
                lo, hi = total // 2, total - total // 2
                lo, hi = (hi, lo) if pad_type == "same_lower" else (lo, hi)
            else:
                lo, hi = (pad[2 * d], pad[2 * d + 1]) if pad_type == "custom" else (0, 0)
                o = (n + lo + hi - span) // s + 1
            need(o > 0, f"conv output would be empty: input {list(x_shape)}, kernel {list(w_shape)}")
            out.append(o)
            pads += [lo, hi]
        return out, pads

    def infer(self, a):
        unsupported(from_ios17(a) and a.x.type.dtype != a.weight.type.dtype, "a weight of another dtype than x", a)
        dtype = same_dtype(a.x, a.weight)
        xs, ws = a.x.type.shape, a.weight.type.shape
        unsupported(len(xs) in (3, 5) and len(ws) == len(xs), f"{len(xs) - 2}-D conv (x {list(xs)})", a)
        need(len(xs) == 4 and len(ws) == 4, f"conv needs x [N,C,H,W] and weight [OC,C/groups,kH,kW], "
                                            f"got {list(xs)} and {list(ws)}")
        need(from_ios17(a) or a.bias.type is None or a.bias.const,
             f"bias must be a const in {a.opset} (Apple's iOS15 conv; a computed bias needs iOS17)")
        need(a.groups.type.shape == (), "groups must be a scalar int32")
        g = a.groups.value
        need(g > 0 and xs[1] % g == 0 and ws[0] % g == 0,
             f"groups={g} must divide input channels {xs[1]} and output channels {ws[0]}")
        need(ws[1] * g == xs[1], f"weight {list(ws)} expects {ws[1] * g} input channels, x has {xs[1]}")
        strides, dilations = vector(a.strides, "strides", 2), vector(a.dilations, "dilations", 2)
        need(min(strides + dilations) > 0, "strides and dilations must be positive")
        need(a.weight.from_consts or max(dilations) == 1,
             f"a computed (non-const) weight does not support dilations {list(dilations)} (Apple's conv)")
        need(a.pad_type.value in ("valid", "same", "same_lower", "custom"),
             f"pad_type must be valid, same, same_lower or custom, got {a.pad_type.value!r}")
        pad = vector(a.pad, "pad", 4)
        need(min(pad) >= 0, "pad must not be negative")
        if a.bias.type is not None:
            need(a.bias.type.shape == (ws[0],) and a.bias.type.dtype == dtype,
                 f"bias must be tensor<{dtype}, [{ws[0]}]>, got {a.bias.type}")
        (oh, ow), _ = self.geometry(xs, ws, strides, a.pad_type.value, pad, dilations)
        return TensorType(dtype, (xs[0], ws[0], oh, ow))

    def run(self, a, out):
        x, w, g = f32(a.x), f32(a.weight), int(a.groups)
        (oh, ow), (t, b, l, r) = self.geometry(x.shape, w.shape, a.strides, a.pad_type, a.pad, a.dilations)
        n, c, oc, (kh, kw) = x.shape[0], x.shape[1] // g, w.shape[0] // g, w.shape[2:]
        (sh, sw), (dh, dw) = a.strides, a.dilations
        if (kh, kw, sh, sw, t, b, l, r) == (1, 1, 1, 1, 0, 0, 0, 0):  # the ANE's linear layer: one GEMM
            cols = x.reshape(n, g, c, oh * ow)
        else:
            xp = np.pad(x, ((0, 0), (0, 0), (t, b), (l, r)))
            win = np.lib.stride_tricks.sliding_window_view(xp, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), (2, 3))
            win = win[:, :, ::sh, ::sw, ::dh, ::dw][:, :, :oh, :ow]            # [N, C, OH, OW, kh, kw]
            cols = np.ascontiguousarray(win.transpose(0, 1, 4, 5, 2, 3)).reshape(n, g, c * kh * kw, oh * ow)
        wm = np.ascontiguousarray(w.reshape(g, oc, c * kh * kw))
        blas.matmul(wm, cols, out.reshape(n, g, oc, oh * ow))
        if a.bias is not None:
            out += f32(a.bias).reshape(1, -1, 1, 1)


@register
class ScaledDotProductAttention(Op):
    """softmax(query @ key^T / sqrt(E)) @ value over the last two axes, batch axes equal (no broadcasting).

    Inputs:
        query: tensor<T, [..., L, E]>, rank >= 3.
        key: tensor<T, [..., S, E]>.
        value: tensor<T, [..., S, EV]>.
        attn_mask: tensor<fp16, fp32 or bool, [..., S]>, optional, broadcasting against query's [..., L].
    Output: tensor<T, [..., L, EV]>.
    T: fp16 or fp32.
    Opsets: iOS18 on (the ios18 dialect).
    Not supported by anectypes: the mask's effect: like the ANE, the simulator ignores attn_mask, and the
        chip catalogue refuses a program that passes one (§3.6, §3.10).
    """
    name, since = "scaled_dot_product_attention", "ios18"
    params = dict(query=tensor(*FLOAT), key=tensor(*FLOAT), value=tensor(*FLOAT),
                  attn_mask=tensor("fp16", "fp32", "bool", default=None))

    def infer(self, a):
        """Apple's rules; the mask is not applied, like on the ANE (the chip catalogue refuses it, §3.6)."""
        dtype = same_dtype(a.query, a.key, a.value)
        q, k, v = a.query.type.shape, a.key.type.shape, a.value.type.shape
        need(len(q) >= 3 and len(k) == len(q) and len(v) == len(q), "query, key and value need one rank >= 3")
        need(q[:-2] == k[:-2] == v[:-2], f"query {list(q)}, key {list(k)} and value {list(v)} must have the same "
                                         "batch dimensions")
        need(q[-1] == k[-1] and k[-2] == v[-2], f"query {list(q)}, key {list(k)} and value {list(v)} "
                                                "do not fit [..., L, E], [..., S, E], [..., S, EV]")
        m = a.attn_mask.type
        if m is not None:
            need(m.rank >= 1 and m.shape[-1] == k[-2], f"attn_mask {list(m.shape)} must end in the key length {k[-2]}")
            broadcast(q[:-1], m.shape[:-1])
        return TensorType(dtype, q[:-1] + (v[-1],))

    def run(self, a, out):
        q, k, v = gemm_operand(a.query), gemm_operand(a.key), gemm_operand(a.value)
        scores = blas.matmul(q, k, np.empty(q.shape[:-1] + (k.shape[-2],), np.float32),
                             trans_b=True, alpha=1 / np.sqrt(q.shape[-1]))
        Softmax().run(Args(x=scores, axis=-1), scores)
        blas.matmul(scores, v, out)


# ---------------------------------------------------------------- dtypes and quantisation

@register
class Cast(Op):
    """x converted to another dtype.

    Inputs:
        x: tensor<T>.
        dtype: const string, "fp16", "fp32", "int32" or "bool".
    Output: tensor<dtype> shaped like x.
    T: fp16, fp32, int32 or bool.
    Opsets: iOS15 on; M1/M2 have no cast, which the chip catalogue refuses there (§3.5).
    Not supported by anectypes: casts from and to int8, uint8, int16 and uint16 (iOS17).
    """
    name = "cast"                     # M1/M2 have no cast: the chip catalogue (limits.py) refuses it there
    params = dict(x=tensor("fp16", "fp32", "int32", "bool", apple=("int8", "uint8", "int16", "uint16"),
                         newer=("int8", "uint8", "int16", "uint16")), dtype=const("string"))

    def infer(self, a):
        unsupported(from_ios17(a) and a.dtype.value in ("int8", "uint8", "int16", "uint16"),
                    f"cast to {a.dtype.value}", a)
        need(a.dtype.value in ("fp16", "fp32", "int32", "bool"),
             f"cast dtype must be fp16, fp32, int32 or bool, got {a.dtype.value!r}")
        return TensorType(a.dtype.value, a.x.type.shape)

    def run(self, a, out):
        np.copyto(out, a.x, casting="unsafe")


def quant_params(a, shape, axis_always):
    """Apple's rules for scale and zero_point: scalars, or vectors as long as the data's `axis`. iOS17's
    quantize/dequantize take an axis with vectors only and a zero_point shaped like the scale;
    constexpr_affine_dequantize (iOS16) always takes an axis and mixes them freely."""
    scale, zp, axis = a.scale.type, a.zero_point.type, a.axis.type
    for name, t in (("scale", scale), ("zero_point", zp)):
        need(t is None or t.rank <= 1, f"{name} must be a scalar or a 1-D vector, got {t}")
    if not axis_always:
        need(axis is None or scale.rank == 1, "axis is given but scale is a scalar: give an axis with vectors only")
        need(axis is not None or scale.rank == 0, "a vector scale needs an axis")
        need(zp is None or zp.rank == scale.rank, f"zero_point {zp} must be a {'vector' if scale.rank else 'scalar'} "
                                                  f"like scale {scale}")
    if axis is not None:
        need(axis.shape == (), f"axis must be a scalar int32, got {axis}")
        ax = norm_axis(a.axis.value, len(shape))
        for name, t in (("scale", scale), ("zero_point", zp)):
            if t is not None and t.rank == 1:
                need(t.shape[0] == shape[ax], f"{name} has {t.shape[0]} entries but axis {ax} has size {shape[ax]}")


def broadcast_along(value, axis, rank):
    v = np.asarray(value, dtype=np.float32)
    if v.ndim == 0:
        return v
    shape = [1] * rank
    shape[axis % rank] = -1
    return v.reshape(shape)


class Dequantizing(Op):
    """(q - zero_point) * scale, with scalar or per-axis parameters; the result has the scale's dtype."""
    mixed_zero_point = False  # Apple's definition takes a zero_point of another dtype than the data
    def infer(self, a):
        data = getattr(a, self.data)
        quant_params(a, data.type.shape, self.in_attributes)
        zp = a.zero_point.type
        if zp is not None and zp.dtype != data.type.dtype:
            what = f"a {zp.dtype} zero_point for {data.type.dtype} data"
            need(self.mixed_zero_point, f"{what}: zero_point must have the data's dtype")
            unsupported(True, what, a)
        return TensorType(a.scale.type.dtype, data.type.shape)

    def run(self, a, out):
        data = getattr(a, self.data)
        ax = 0 if a.axis is None else a.axis
        zp = 0 if a.zero_point is None else broadcast_along(a.zero_point, ax, data.ndim)
        np.multiply(np.subtract(data, zp, dtype=np.float32), broadcast_along(a.scale, ax, data.ndim), out=out)


@register
class ConstexprAffineDequantize(Dequantizing):
    """(quantized_data - zero_point) * scale, known at compile time: int8 weights, usually from a BLOBFILE.
    Its arguments go in the attribute list: constexpr_affine_dequantize()[axis = ..., name = ..., ...].

    Inputs:
        quantized_data: const tensor<int8 or uint8>, inline or a BLOBFILE.
        zero_point: const int8, uint8 or fp32, a scalar or a vector along axis; inline or a BLOBFILE.
        scale: const fp16 or fp32, a scalar or a vector along axis; inline or a BLOBFILE.
        axis: const int32 scalar, always given, in [-rank, rank).
    Output: tensor<scale's dtype, quantized_data's shape>.
    Opsets: iOS16 on.
    Not supported by anectypes: a zero_point of another dtype than quantized_data (fp32, or the other
        8-bit type).
    """
    name, in_attributes, data, since = "constexpr_affine_dequantize", True, "quantized_data", "ios16"
    mixed_zero_point = True
    params = dict(quantized_data=const("int8", "uint8", blob_ok=True),
                  zero_point=const("int8", "uint8", "fp32", blob_ok=True), scale=const(*FLOAT, blob_ok=True),
                  axis=const("int32"))


@register
class Dequantize(Dequantizing):
    """(input - zero_point) * scale: 8-bit data back to floats.

    Inputs:
        input: tensor<int8 or uint8>.
        zero_point: const int8 or uint8 (input's dtype), optional (0); a scalar, or a vector along axis like
            scale; inline or a BLOBFILE.
        scale: const fp16 or fp32, a scalar or a vector along axis; inline or a BLOBFILE.
        axis: const int32 scalar, optional; given with vectors only.
    Output: tensor<scale's dtype, input's shape>.
    Opsets: iOS17 on (the ios18 dialect).
    """
    name, data, since = "dequantize", "input", "ios17"
    params = dict(input=tensor("int8", "uint8"), zero_point=const("int8", "uint8", default=None, blob_ok=True),
                  scale=const(*FLOAT, blob_ok=True), axis=const("int32", default=None))


@register
class Quantize(Op):
    """round(input / scale) + zero_point (halves to even), clipped to output_dtype's range.

    Inputs:
        input: tensor<fp16 or fp32>.
        zero_point: const int8 or uint8 (output_dtype), optional (0); a scalar, or a vector along axis like
            scale; inline or a BLOBFILE.
        scale: const fp16 or fp32 (input's dtype), a scalar or a vector along axis, not all zeros; inline or a
            BLOBFILE.
        axis: const int32 scalar, optional; given with vectors only.
        output_dtype: const string, "int8" or "uint8".
    Output: tensor<output_dtype, input's shape>.
    Opsets: iOS17 on (the ios18 dialect).
    Not supported by anectypes: a scale vector with some zeros in it.
    """
    name, since = "quantize", "ios17"
    params = dict(input=tensor(*FLOAT), zero_point=const("int8", "uint8", default=None, blob_ok=True),
                  scale=const(*FLOAT, blob_ok=True), axis=const("int32", default=None),
                  output_dtype=const("string"))

    def infer(self, a):
        need(a.output_dtype.value in ("int8", "uint8"), f"output_dtype must be int8 or uint8, "
                                                        f"got {a.output_dtype.value!r}")
        need(a.scale.type.dtype == a.input.type.dtype,
             f"scale must be {a.input.type.dtype} like the input, got {a.scale.type}")
        if a.zero_point.type is not None:
            need(a.zero_point.type.dtype == a.output_dtype.value, "zero_point dtype must equal output_dtype")
        if a.scale.value is not None:
            need(np.any(a.scale.value != 0), "scale is 0")
            unsupported(not np.all(a.scale.value != 0), "a scale vector with zeros in it", a)
        quant_params(a, a.input.type.shape, False)
        return TensorType(a.output_dtype.value, a.input.type.shape)

    def run(self, a, out):
        ax, rank = 0 if a.axis is None else a.axis, a.input.ndim
        q = np.rint(np.divide(a.input, broadcast_along(a.scale, ax, rank), dtype=np.float32))  # half to even
        if a.zero_point is not None:
            q += broadcast_along(a.zero_point, ax, rank)
        info = np.iinfo(out.dtype)
        np.copyto(out, np.clip(q, info.min, info.max), casting="unsafe")
