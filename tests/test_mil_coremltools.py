"""Cross-check against Apple's own tool, coremltools (the `test` extra; it runs on Linux), as the
independent reference for docs/ane-reference.md §2.5 and §3.8:

* blobs: each side's writer, the other side's reader, for every dtype both store; the files are
  byte-identical;
* op definitions: for each op of the registry, random argument sets, valid and invalid, go to
  coremltools' type inference (its MIL builder, at the dialect's opset) and to ours (`Builder.op`). Both
  must accept with the same output dtype and shape, or both refuse; where Apple accepts and we
  refuse, our message must say "not supported by anectypes", and only there.
"""

import numpy as np
import pytest

import coremltools as ct
from coremltools.converters.mil.mil import Builder as mb
from coremltools.converters.mil.mil import Function, types
from coremltools.libmilstoragepython import _BlobStorageReader, _BlobStorageWriter

from anectypes.errors import MILError
from anectypes.mil import Builder
from anectypes.mil.blob import CODES, read_chunk, write_blob
from anectypes.mil.ops import OPS
from anectypes.mil.types import NUMPY, OPSETS

TARGETS = {"ios16": ct.target.iOS16, "ios18": ct.target.iOS18}
CT_TYPES = {name: getattr(types, name) for name in ("fp16", "fp32", "int32", "int8", "uint8", "int16", "uint16",
                                                     "bool")}
CT_METHOD = {"fp16": "fp16", "fp32": "float", "uint8": "uint8", "int8": "int8", "int16": "int16",
             "uint16": "uint16", "int32": "int32", "uint32": "uint32"}


# ---------------------------------------------------------------- blobs

def sample(dtype, n, seed):
    rng = np.random.default_rng(seed)
    if dtype in ("fp16", "fp32"):
        return rng.standard_normal(n).astype(NUMPY[dtype])
    info = np.iinfo(NUMPY[dtype])
    return rng.integers(info.min, info.max, n, endpoint=True).astype(NUMPY[dtype])


def test_blobs_both_ways_for_every_dtype(tmp_path):
    arrays = [sample(d, 5 + 7 * i, i) for i, d in enumerate(CODES)]     # odd sizes: padding between chunks
    theirs = tmp_path / "theirs.bin"
    writer = _BlobStorageWriter(str(theirs))
    offsets = [getattr(writer, f"write_{CT_METHOD[d]}_data")(a.view(np.uint16) if d == "fp16" else a)
               for d, a in zip(CODES, arrays)]
    del writer                                          # flushes the file
    ours, our_offsets = write_blob(*arrays)
    assert our_offsets == offsets
    assert ours == theirs.read_bytes()
    (tmp_path / "ours.bin").write_bytes(ours)
    reader = _BlobStorageReader(str(tmp_path / "ours.bin"))
    for d, a, off in zip(CODES, arrays, offsets):
        got = np.asarray(getattr(reader, f"read_{CT_METHOD[d]}_data")(off))
        np.testing.assert_array_equal(got.view(np.float16) if d == "fp16" else got, a)
        np.testing.assert_array_equal(read_chunk(theirs.read_bytes(), off, d, a.shape), a)


def test_both_readers_refuse_a_dtype_that_does_not_match(tmp_path):
    blob, (off,) = write_blob(sample("fp32", 6, 0))
    (tmp_path / "w.bin").write_bytes(blob)
    with pytest.raises(Exception, match="Metadata data type does not match requested type"):
        _BlobStorageReader(str(tmp_path / "w.bin")).read_fp16_data(off)
    with pytest.raises(Exception, match="holds fp32"):
        read_chunk(blob, off, "fp16", (12,))


# ---------------------------------------------------------------- op definitions
# An argument is ("in", dtype, shape): a function input; ("const", dtype, value); or a list of inputs.

def inp(dtype, shape):
    return ("in", dtype, tuple(int(d) for d in shape))


def const(dtype, value):
    return ("const", dtype, value)


def coreml(op, dialect, args):
    """coremltools' verdict: ("ok", dtype, shape) or ("refused", message)."""
    specs = {}

    def value(a):
        if isinstance(a, list):
            return tuple(value(x) for x in a)
        kind, dtype, v = a
        if kind == "in":
            name = f"i{len(specs)}"
            specs[name] = (v, dtype)
            return name
        return v if dtype == "string" else np.array(v, NUMPY[dtype])[()]
    values = {k: value(a) for k, a in args.items()}
    try:
        with Function({n: mb.placeholder(shape=s, dtype=CT_TYPES[d]) for n, (s, d) in specs.items()},
                      opset_version=TARGETS[dialect]) as f:
            def resolve(v):
                return tuple(map(resolve, v)) if isinstance(v, tuple) else f.inputs[v] if isinstance(v, str) \
                    and v in specs else v
            out = getattr(mb, op)(**{k: resolve(v) for k, v in values.items()})
    except Exception as e:                      # noqa: BLE001: any refusal of coremltools' is a refusal
        return ("refused", f"{type(e).__name__}: {e}")
    return ("ok", types.builtin_to_string(out.dtype), tuple(int(d) for d in out.shape))


def anectypes(op, dialect, args):
    b = Builder(dialect)

    def var(name, a):
        if isinstance(a, list):
            return [var(f"{name}{i}", x) for i, x in enumerate(a)]
        kind, dtype, v = a
        return b.input(name, v, dtype) if kind == "in" else b.const(v, dtype, name=name)
    try:
        out = b.op(op, **{k: var(k, a) for k, a in args.items()})
    except MILError as e:
        return ("refused", e.reason)
    return ("ok", out.type.dtype, out.type.shape)


def dims(rng, rank):
    return [int(d) for d in rng.choice([1, 2, 3, 4], rank)]


def float_dtype(rng, more=()):
    return str(rng.choice(["fp16", "fp32", *more]))


def binary(rng):
    dt = float_dtype(rng, ["int32"])
    x = dims(rng, rng.integers(1, 5))
    y = x[rng.integers(0, len(x)):] if rng.random() < 0.6 else dims(rng, rng.integers(1, 5))
    y = [1 if rng.random() < 0.2 else d for d in y]
    other = const(dt, 0.5 if dt != "int32" else 2) if rng.random() < 0.3 else inp(
        dt if rng.random() < 0.8 else float_dtype(rng, ["int32"]), y)
    return dict(x=inp(dt, x), y=other)


def unary(rng):
    return dict(x=inp(float_dtype(rng, ["int32"]), dims(rng, rng.integers(1, 5))))


def softmax(rng):
    r = int(rng.integers(1, 5))
    return dict(x=inp(float_dtype(rng, ["int32"]), dims(rng, r)), axis=const("int32", int(rng.integers(-r - 1, r + 1))))


def reduce_sum(rng):
    r = int(rng.integers(1, 5))
    axes = [int(a) for a in rng.integers(-r, r, rng.integers(1, r + 1))]
    if rng.random() < 0.15:
        axes[0] = r                                 # out of range
    return dict(x=inp(float_dtype(rng, ["int32"]), dims(rng, r)), axes=const("int32", axes),
                keep_dims=const("bool", bool(rng.random() < 0.5)))


def moved_dtype(rng):
    return str(rng.choice(["fp16", "fp32", "int32", "bool", "int8", "uint8"]))


def slice_by_size(rng):
    shape = dims(rng, rng.integers(1, 5))
    begin = [int(rng.integers(0, d)) for d in shape]
    size = [int(rng.integers(1, d - b + 1)) if rng.random() < 0.8 else -1 for d, b in zip(shape, begin)]
    if rng.random() < 0.15:
        begin[0] = -1                               # Apple accepts; not supported by anectypes
    if rng.random() < 0.15:
        size[-1] = int(rng.choice([0, shape[-1] + 1]))   # empty, or outside x: Apple's type inference takes both
    if rng.random() < 0.15:
        size = size + [1]                           # wrong length: both refuse
    return dict(x=inp(moved_dtype(rng), shape), begin=const("int32", begin), size=const("int32", size))


def reshape(rng):
    shape = dims(rng, rng.integers(1, 5))
    n = int(np.prod(shape))
    new = [n] if rng.random() < 0.3 else [d for d in dims(rng, rng.integers(1, 4))]
    choice = rng.random()
    if choice < 0.3:
        new = list(np.random.default_rng(int(rng.integers(1 << 30))).permutation(shape))
    if choice > 0.8:
        new[int(rng.integers(0, len(new)))] = -1
    elif choice > 0.7:
        new[int(rng.integers(0, len(new)))] = 0     # Apple accepts; not supported by anectypes
    return dict(x=inp(moved_dtype(rng), shape), shape=const("int32", [int(v) for v in new]))


def transpose(rng):
    r = int(rng.integers(1, 5))
    perm = [int(p) for p in rng.permutation(r)]
    if rng.random() < 0.2:
        perm[0] = perm[-1]                          # not a permutation (when r > 1)
    return dict(x=inp(moved_dtype(rng), dims(rng, r)), perm=const("int32", perm))


def concat(rng):
    r, dt = int(rng.integers(1, 5)), moved_dtype(rng)
    base, axis = dims(rng, r), int(rng.integers(-r, r))
    values = []
    for _ in range(int(rng.integers(1, 4))):
        s = list(base)
        s[axis] = int(rng.integers(1, 4))
        if rng.random() < 0.1:
            s = dims(rng, r)
        values.append(inp(dt if rng.random() < 0.9 else moved_dtype(rng), s))
    return dict(values=values, axis=const("int32", axis), interleave=const("bool", bool(rng.random() < 0.2)))


def matmul(rng):
    dt = float_dtype(rng)
    m, k, n = (int(v) for v in rng.integers(1, 5, 3))
    batch = dims(rng, rng.integers(0, 3))
    tx, ty = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
    x = batch + ([k, m] if tx else [m, k])
    y = batch[int(rng.integers(0, len(batch) + 1)):] + ([n, k] if ty else [k, n])
    if rng.random() < 0.2:
        y[-1 if ty else -2] += 1                    # inner dimensions differ
    return dict(x=inp(dt, x), y=inp(dt if rng.random() < 0.9 else float_dtype(rng, ["int32"]), y),
                transpose_x=const("bool", tx), transpose_y=const("bool", ty))


def conv(rng):
    dt, g = float_dtype(rng), int(rng.choice([1, 1, 2]))
    c, oc, k = 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3)), int(rng.integers(1, 4))
    x = [1, c, int(rng.integers(k, 7)), int(rng.integers(k, 7))]
    w_shape = [oc, c // g, k, k]
    weight = inp(dt, w_shape) if rng.random() < 0.5 else const(dt, np.ones(w_shape).tolist())
    pad_type = str(rng.choice(["valid", "same", "same_lower", "custom"]))
    args = dict(x=inp(dt, x), weight=weight, groups=const("int32", g), pad_type=const("string", pad_type),
                strides=const("int32", [int(s) for s in rng.integers(1, 3, 2)]),
                dilations=const("int32", [int(d) for d in rng.choice([1, 1, 2], 2)]),
                pad=const("int32", [int(p) for p in rng.integers(0, 2, 4)]))
    if rng.random() < 0.3:
        args["bias"] = const(dt, [0.5] * oc) if rng.random() < 0.5 else inp(dt, [oc])
    return args


def sdpa(rng):
    dt = float_dtype(rng)
    batch = dims(rng, rng.integers(1, 3))
    L, S, E, EV = (int(v) for v in rng.integers(1, 6, 4))
    kb = batch if rng.random() < 0.8 else dims(rng, len(batch))
    args = dict(query=inp(dt, batch + [L, E]), key=inp(dt, kb + [S, E]), value=inp(dt, kb + [S, EV]))
    if rng.random() < 0.5:
        mask = [L, S] if rng.random() < 0.6 else [L, S + 1] if rng.random() < 0.5 else [L + 1, S]
        args["attn_mask"] = inp(str(rng.choice(["fp16", "fp32", "bool"])), mask)
    return args


def cast(rng):
    src = str(rng.choice(["fp16", "fp32", "int32", "bool", "int8"]))
    return dict(x=inp(src, dims(rng, rng.integers(1, 4))),
                dtype=const("string", str(rng.choice(["fp16", "fp32", "int32", "bool", "int8", "uint8"]))))


def quant_args(rng, shape):
    """scale, zero point and axis: scalars or vectors, with or without an axis, right or wrong."""
    axis = int(rng.integers(-len(shape), len(shape)))
    vector = rng.random() < 0.5
    n = shape[axis] + (1 if rng.random() < 0.1 else 0)
    args = {}
    if vector or rng.random() < 0.2:
        args["axis"] = const("int32", axis)
    return args, vector, n


def quantize(rng):
    dt, out = float_dtype(rng), str(rng.choice(["int8", "uint8"]))
    shape = dims(rng, rng.integers(1, 4))
    args, vector, n = quant_args(rng, shape)
    scale = [0.5] * n if vector else (0.0 if rng.random() < 0.2 else 0.25)
    args.update(input=inp(dt, shape), output_dtype=const("string", out),
                scale=const(dt if rng.random() < 0.85 else float_dtype(rng), scale))
    if rng.random() < 0.5:
        args["zero_point"] = const(out if rng.random() < 0.9 else "int8", [1] * n if vector else 1)
    return args


def dequantize(rng):
    dt = str(rng.choice(["int8", "uint8"]))
    shape = dims(rng, rng.integers(1, 4))
    args, vector, n = quant_args(rng, shape)
    args.update(input=inp(dt, shape), scale=const(float_dtype(rng), [0.5] * n if vector else 0.25))
    if rng.random() < 0.5:
        args["zero_point"] = const(dt if rng.random() < 0.8 else str(rng.choice(["int8", "uint8"])),
                                   [1] * n if vector else 1)
    return args


def constexpr_affine_dequantize(rng):
    dt = str(rng.choice(["int8", "uint8"]))
    shape = dims(rng, rng.integers(1, 4))
    axis = int(rng.integers(-len(shape) - 1, len(shape)))
    n = shape[axis % len(shape)] + (1 if rng.random() < 0.1 else 0)
    return dict(quantized_data=const(dt, np.ones(shape, int).tolist()), axis=const("int32", axis),
                scale=const(float_dtype(rng), [0.5] * n if rng.random() < 0.5 else 0.25),
                zero_point=const(dt if rng.random() < 0.8 else str(rng.choice(["int8", "uint8"])),
                                 [1] * n if rng.random() < 0.5 else 1))


GENERATORS = {"add": binary, "sub": binary, "mul": binary, "pow": binary, "sigmoid": unary, "softmax": softmax,
              "reduce_sum": reduce_sum, "slice_by_size": slice_by_size, "reshape": reshape, "transpose": transpose,
              "concat": concat, "matmul": matmul, "conv": conv, "scaled_dot_product_attention": sdpa, "cast": cast,
              "quantize": quantize, "dequantize": dequantize,
              "constexpr_affine_dequantize": constexpr_affine_dequantize}
CASES = 40


def test_every_op_of_the_registry_is_cross_checked():
    assert set(GENERATORS) == set(OPS)


@pytest.mark.parametrize("dialect", TARGETS)
@pytest.mark.parametrize("op", sorted(GENERATORS))
def test_type_inference_agrees_with_coremltools(op, dialect):
    rng = np.random.default_rng([ord(c) for c in op + dialect])
    disagreements, verdicts = [], set()
    for _ in range(CASES):
        args = GENERATORS[op](rng)
        theirs, ours = coreml(op, dialect, args), anectypes(op, dialect, args)
        verdicts.add((theirs[0], ours[0]))
        if theirs[0] == ours[0] == "ok":
            agree = theirs[1:] == ours[1:]
        elif ours[0] == "refused":     # "not supported by anectypes" claims that Apple accepts it
            agree = (theirs[0] == "refused") != ("not supported by anectypes" in ours[1])
        else:
            agree = False
        if not agree:
            disagreements.append(f"{args}\n    coremltools: {theirs}\n    anectypes:   {ours}")
    assert not disagreements, f"{len(disagreements)} of {CASES} disagree:\n" + "\n".join(disagreements[:5])
    if OPSETS.index(OPS[op].since) <= OPSETS.index(dialect):   # the random sets must exercise both verdicts
        assert ("ok", "ok") in verdicts, verdicts


@pytest.mark.parametrize("source", ["input", "dequantized"])
def test_dilated_conv_weight_computed_from_constants(source):
    """Apple refuses dilations with a dynamic weight, but a weight computed from constants only (here by
    constexpr_affine_dequantize) is not dynamic: both sides agree on both."""
    with Function({"x": mb.placeholder(shape=(1, 2, 6, 6), dtype=types.fp16),
                   "w": mb.placeholder(shape=(3, 2, 2, 2), dtype=types.fp16)}, opset_version=ct.target.iOS18) as f:
        w = f.inputs["w"] if source == "input" else mb.constexpr_affine_dequantize(
            quantized_data=np.ones((3, 2, 2, 2), np.int8), zero_point=np.int8(0), scale=np.float16(0.5), axis=0)
        try:
            mb.conv(x=f.inputs["x"], weight=w, dilations=[2, 2])
            theirs = "ok"
        except ValueError:
            theirs = "refused"
    b = Builder("ios18")
    w = b.input("w", [3, 2, 2, 2]) if source == "input" else b.constexpr_affine_dequantize(
        quantized_data=np.ones((3, 2, 2, 2), np.int8), zero_point=np.int8(0), scale=np.float16(0.5), axis=0)
    try:
        b.conv(x=b.input("x", [1, 2, 6, 6]), weight=w, dilations=[2, 2])
        ours = "ok"
    except MILError:
        ours = "refused"
    assert theirs == ours == ("refused" if source == "input" else "ok")


@pytest.mark.parametrize("op,name", [("reshape", "shape"), ("slice_by_size", "begin"), ("slice_by_size", "size")])
def test_computed_shape_and_slice_arguments(op, name):
    """Apple takes a reshape shape or a slice begin/size computed at run time (its output shape is then
    symbolic); anectypes needs them inline and says so."""
    fixed = {"reshape": {"shape": [3, 2]}, "slice_by_size": {"begin": [0, 0], "size": [1, 2]}}[op]
    with Function({"x": mb.placeholder(shape=(2, 3), dtype=types.fp16),
                   "v": mb.placeholder(shape=(len(fixed[name]),), dtype=types.int32)},
                  opset_version=ct.target.iOS18) as f:
        args = {k: np.array(v, np.int32) for k, v in fixed.items()} | {name: f.inputs["v"]}
        getattr(mb, op)(x=f.inputs["x"], **args)          # accepted
    b = Builder("ios18")
    args = dict(fixed) | {name: b.input("v", [len(fixed[name])], "int32")}
    with pytest.raises(MILError, match=f"argument '{name}' must be an inline const, but v is computed: that is "
                                       r"not supported by anectypes \(Apple's ios18 definition"):
        b.op(op, x=b.input("x", [2, 3]), **args)
    b.op(op, x=b.input("x2", [2, 3]), **fixed)            # the inline twin
