"""Apple's op definitions (coremltools `converters/mil/mil/ops/defs/iOS15..iOS18`, docs/ane-reference.md §3.8):
for every rule, a program that must be refused, with the op, the line and the rule in the message, and its
nearest valid twin, which must pass. Programs are built with the Builder (the twin), printed, and broken by
one edit of the text, so the parser's located errors are what is checked.

What Apple accepts and anectypes does not implement is refused with "not supported by anectypes"; what
anectypes now implements of it (bool concat, same_lower padding) is run against a numpy reference.
tests/test_mil_coremltools.py asks coremltools itself.
"""

import re
from inspect import getsource

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.errors import MILError
from anectypes.mil import Builder, Plan, parse
from anectypes.mil.__main__ import op_doc
from anectypes.mil.ops import OPS, REQUIRED
from anectypes.mil.types import NUMPY, format_value, TensorType

UNSUPPORTED = "is not supported by anectypes (Apple's ios18 definition of the op accepts it)"


def program(build, dialect="ios18"):
    """The text of the program `build(b)` makes: the valid twin."""
    b = Builder(dialect)
    b.output(build(b))
    text = b.text()
    parse(text)
    return text


def refused(text, old, new, reason, op):
    """`text` with `old` replaced by `new` (once) must be refused at the op's statement, naming op and rule."""
    assert text.count(old) == 1, (old, text)
    bad = text.replace(old, new)
    with pytest.raises(MILError) as info:
        parse(bad)
    e = info.value
    line = next(i for i, s in enumerate(bad.splitlines(), 1) if f" = {op}(" in s)
    assert reason in e.reason and e.op == op and e.line == line, (str(e), line)
    assert str(e).startswith(f"line {line}, col ")
    return e


def sdpa(q, k, v, mask=None):
    def build(b):
        extra = {"attn_mask": b.input("m", mask)} if mask else {}
        return b.scaled_dot_product_attention(query=b.input("q", q), key=b.input("k", k), value=b.input("v", v),
                                              **extra)
    return build


# ---------------------------------------------------------------- opsets: the first opset of each op

@pytest.mark.parametrize("op,since", [("scaled_dot_product_attention", "ios18"), ("quantize", "ios17"),
                                      ("dequantize", "ios17")])
def test_op_not_in_the_ios16_opset(op, since):
    args = {"scaled_dot_product_attention": lambda b: dict(query=b.input("q", [1, 4, 8]), key=b.input("k", [1, 6, 8]),
                                                           value=b.input("v", [1, 6, 8])),
            "quantize": lambda b: dict(input=b.input("x", [4]), scale=0.5, output_dtype="int8"),
            "dequantize": lambda b: dict(input=b.input("x", [4], "int8"), scale=0.5)}[op]
    b = Builder("ios16")
    with pytest.raises(MILError, match=f"{op} is not in Apple's ios16 opset .*: it exists from {since} on"):
        b.op(op, **args(b))
    b = Builder("ios18")
    b.output(b.op(op, **args(b)))                     # the twin: the same op in ios18
    parse(b.text())


# ---------------------------------------------------------------- scaled_dot_product_attention

def test_sdpa_batch_dimensions_must_be_equal():
    text = program(sdpa([2, 4, 8], [2, 6, 8], [2, 6, 8]))
    refused(text, "tensor<fp16, [2, 6, 8]> k", "tensor<fp16, [1, 6, 8]> k",
            "must have the same batch dimensions", "scaled_dot_product_attention")


def test_sdpa_mask_must_end_in_the_key_length():
    text = program(sdpa([1, 4, 8], [1, 6, 8], [1, 6, 8], mask=[4, 6]))
    refused(text, "tensor<fp16, [4, 6]> m", "tensor<fp16, [4, 7]> m", "attn_mask [4, 7] must end in the key length 6",
            "scaled_dot_product_attention")


def test_sdpa_mask_must_broadcast_against_the_queries():
    text = program(sdpa([1, 4, 8], [1, 6, 8], [1, 6, 8], mask=[1, 4, 6]))
    refused(text, "tensor<fp16, [1, 4, 6]> m", "tensor<fp16, [1, 3, 6]> m", "[1, 4] and [1, 3] do not broadcast",
            "scaled_dot_product_attention")


# ---------------------------------------------------------------- quantize and dequantize

def quantize(scale=0.5, dtype="fp16"):
    def build(b):
        b.const(1, "int32", name="ax")                # unused by the twin, given as the axis by the edit
        return b.quantize(input=b.input("x", [2, 3], dtype), scale=b.const(scale, dtype, name="s"),
                          output_dtype="int8")
    return build


def dequantize(b):
    b.const(1, "int32", name="ax")
    return b.dequantize(input=b.input("x", [2, 3], "int8"), scale=b.const(0.5, "fp16", name="s"))


@pytest.mark.parametrize("build,op", [(quantize(), "quantize"), (dequantize, "dequantize")])
def test_axis_with_a_scalar_scale(build, op):
    refused(program(build), "scale = s", "scale = s, axis = ax", "axis is given but scale is a scalar", op)


def test_quantize_scale_of_zero():
    text = program(quantize(0.5))
    refused(text, "fp16(0x1p-1)", "fp16(0x0p+0)", "scale is 0", "quantize")


def test_quantize_scale_dtype_must_match_the_input():
    text = program(quantize(dtype="fp32"))
    bad = text.replace("fp32 s = const()[name = string(\"s\"), val = fp32(0x1p-1)]",
                       "fp16 s = const()[name = string(\"s\"), val = fp16(0x1p-1)]")
    refused(bad, "= quantize(", "= quantize(", "scale must be fp32 like the input, got fp16", "quantize")


# ---------------------------------------------------------------- conv

def conv(weight_input=False, dilations=(1, 1), bias=None, dialect="ios18"):
    def build(b):
        x = b.input("x", [1, 2, 6, 6])
        w = b.input("w", [3, 2, 2, 2]) if weight_input else b.const(np.ones((3, 2, 2, 2)), "fp16", name="w")
        extra = {"bias": b.input("bias", [3]) if bias == "input" else b.const(np.ones(3), "fp16", name="bias")} \
            if bias else {}
        return b.conv(x=x, weight=w, dilations=list(dilations), **extra)
    return build


def test_conv_computed_weight_with_dilations():
    text = program(conv(weight_input=True))
    refused(text, "conv_dilations\"), val = tensor<int32, [2]>([1, 1])", "conv_dilations\"), val = "
            "tensor<int32, [2]>([2, 2])", "a computed (non-const) weight does not support dilations [2, 2]", "conv")
    parse(program(conv(dilations=(2, 2))))        # a const weight may be dilated, and one computed from consts

    def dequantized(b):
        w = b.constexpr_affine_dequantize(quantized_data=np.ones((3, 2, 2, 2), np.int8), zero_point=np.int8(0),
                                          scale=np.float16(0.5), axis=0)
        return b.conv(x=b.input("x", [1, 2, 6, 6]), weight=w, dilations=[2, 2])
    parse(program(dequantized))


def test_conv_bias_must_be_const_in_ios16():
    text = program(conv(bias="const"), "ios16")
    bad = text.replace("tensor<fp16, [1, 2, 6, 6]> x)", "tensor<fp16, [1, 2, 6, 6]> x, tensor<fp16, [3]> b2)")
    refused(bad, "bias = bias", "bias = b2", "bias must be a const in ios16", "conv")
    parse(program(conv(bias="input")))            # iOS17 conv takes a computed bias


def test_conv_same_lower_pads_before():
    """same_lower puts the odd padding pixel first (same: last); the output size is the same."""
    x = np.arange(25, dtype=np.float16).reshape(1, 1, 5, 5)
    for pad_type, lo in (("same", 0), ("same_lower", 1)):
        b = Builder("ios18")
        b.output(b.conv(x=b.input("x", [1, 1, 5, 5]), weight=b.const(np.ones((1, 1, 2, 2)), "fp16", name="w"),
                        pad_type=pad_type))
        got = Plan(parse(b.text()), {}, "fp32").run({"x": x})["conv"][0, 0]
        padded = np.pad(x[0, 0].astype(np.float64), ((lo, 1 - lo), (lo, 1 - lo)))
        want = padded[:-1, :-1] + padded[1:, :-1] + padded[:-1, 1:] + padded[1:, 1:]
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- what Apple accepts and anectypes does not

def test_concat_of_bools_runs():
    b = Builder("ios18")
    b.output(b.concat(values=[b.input("x", [2, 3], "bool"), b.input("y", [2, 1], "bool")], axis=1))
    x, y = np.array([[1, 0, 1], [0, 1, 1]], bool), np.array([[0], [1]], bool)
    np.testing.assert_array_equal(Plan(parse(b.text()), {}, "fp16").run({"x": x, "y": y})["concat"],
                                  np.concatenate([x, y], 1))


UNSUPPORTED_CASES = [
    # (twin builder, old, new, op, what the message names)
    pytest.param(lambda b: b.pow(x=b.input("x", [4]), y=b.input("y", [4])), "fp16", "int32", "pow",
                 "dtype int32", id="int32 pow"),
    pytest.param(lambda b: b.matmul(x=b.input("x", [2, 4]), y=b.input("y", [4, 3])), "fp16", "int32", "matmul",
                 "dtype int32", id="int32 matmul"),
    pytest.param(lambda b: b.matmul(x=b.input("x", [1, 4]), y=b.input("y", [4, 3])), "fp16, [1, 4]> x",
                 "fp16, [4]> x", "matmul", "a rank-1 operand", id="rank-1 matmul"),
    pytest.param(lambda b: b.cast(x=b.input("x", [4]), dtype="int32"), '"int32"', '"int8"', "cast",
                 "cast to int8", id="cast to int8"),
    pytest.param(lambda b: b.reshape(x=b.input("x", [2, 3]), shape=[3, 2]), "([3, 2])", "([0, 3])", "reshape",
                 "0 in a reshape shape", id="0 in reshape"),
    pytest.param(lambda b: b.slice_by_size(x=b.input("x", [4]), begin=[1], size=[2]), "([1])", "([-3])",
                 "slice_by_size", "a negative slice begin", id="negative slice begin"),
    pytest.param(lambda b: b.reduce_sum(x=b.input("x", [2, 3, 4]), axes=[0, 1]), "([0, 1])", "([1, 1])",
                 "reduce_sum", "repeated axes", id="repeated reduce_sum axes"),
    pytest.param(lambda b: b.reduce_sum(x=b.input("x", [2, 3, 4]), axes=[0, 1]), "([0, 1])", "([-2, 1])",
                 "reduce_sum", "repeated axes", id="repeated reduce_sum axes, negative"),
]


@pytest.mark.parametrize("build,old,new,op,what", UNSUPPORTED_CASES)
def test_what_apple_accepts_and_anectypes_refuses_says_so(build, old, new, op, what):
    text = program(build)
    e = refused(text, old, new, what, op) if text.count(old) == 1 else \
        refused(text.replace(old, new, text.count(old) - 1), old, new, what, op)
    assert "not supported by anectypes" in e.reason and "invalid" not in e.reason


@pytest.mark.parametrize("rank", [3, 5])
def test_1d_and_3d_conv_say_not_supported(rank):
    b = Builder("ios18")
    x, w = b.input("x", [1, 2] + [4] * (rank - 2)), b.input("w", [3, 2] + [1] * (rank - 2))
    with pytest.raises(MILError, match=f"{rank - 2}-D conv .* " + UNSUPPORTED.replace("(", r"\(").replace(")", r"\)")):
        b.conv(x=x, weight=w, strides=[1] * (rank - 2), pad=[0] * 2 * (rank - 2), dilations=[1] * (rank - 2))
    b.conv(x=b.input("x4", [1, 2, 4, 4]), weight=b.input("w4", [3, 2, 1, 1]))       # the 2-D twin


# ---------------------------------------------------------------- blobs and constants

def test_blob_dtype_code_is_checked_when_the_device_compiles():
    """An fp32 chunk declared as tensor<fp16, [12]>: refused at compile (so by `check`), naming the const,
    the file, the offset and both types; the twin declares fp32."""
    b = Builder("ios18", float_dtype="fp32")
    x = b.input("x", [6])
    b.output(b.add(x=x, y=b.weight(np.arange(6, dtype=np.float32), "w.bin", name="w")))
    text, weights = b.text(), b.weights()
    dev = open_device("sim")
    dev.compile(text, weights)
    bad = text.replace("tensor<fp32, [6]> w = const()[name = string(\"w\"), val = tensor<fp32, [6]>",
                       "tensor<fp16, [12]> w = const()[name = string(\"w\"), val = tensor<fp16, [12]>")
    bad = bad.replace("tensor<fp32, [6]> x", "tensor<fp16, [12]> x").replace("tensor<fp32, [6]> add",
                                                                             "tensor<fp16, [12]> add")
    with pytest.raises(Exception) as info:
        dev.compile(bad, weights)
    for fragment in ("const 'w'", "@model_path/weights/w.bin", "chunk at 64", "holds fp32",
                     "declares tensor<fp16, [12]>"):
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("value,text", [(1.0, "0x1p+0"), (-0.0, "-0x0p+0"), (1.3125 * 2 ** -17, "0x1.5p-17"),
                                        (1.5 * 2 ** -23, "0x1.8p-23"), (65504.0, "0x1.ffcp+15"),
                                        (np.inf, "inf"), (-np.inf, "-inf"), (np.nan, "nan")])
def test_float_constants_print_as_coremlc_does_and_read_back(value, text):
    """C's %a, as coremlc dumps constants (docs/ane-reference.md §3.9): and non-finite values read back."""
    assert format_value(TensorType("fp16"), value) == text
    b = Builder("ios18")
    b.output(b.add(x=b.input("x", [2]), y=b.const(value, "fp16", name="c")))
    program_text = b.text()
    assert f"val = fp16({text})" in program_text
    back = next(o.out.value for o in parse(program_text).main.ops if o.name == "c")
    assert back == value or np.isnan(back) and np.isnan(value)
    assert np.signbit(back) == np.signbit(value)
    assert parse(program_text).text() == program_text


def test_a_variable_named_inf_is_still_a_variable():
    b = Builder("ios18")
    b.output(b.add(x=b.input("inf", [2]), y=b.input("nan", [2])))
    assert [v.name for v in parse(b.text()).main.inputs] == ["inf", "nan"]


def test_a_blobfile_where_an_inline_const_is_needed_says_not_supported():
    """Apple reads any const from a weights file; anectypes needs shapes and flags inline."""
    b = Builder("ios18")
    x = b.input("x", [2, 3])
    with pytest.raises(MILError, match=r"'perm' must be an inline const, but p is a BLOBFILE: that is not supported by "
                                       "anectypes"):
        b.transpose(x=x, perm=b.weight(np.array([1, 0], np.int32), "p.bin", dtype="int32", name="p"))
    b.transpose(x=x, perm=[1, 0])                     # the inline twin


def dtypes(text):
    """The MIL dtypes a docstring's text names, quoted values ("fp16") left out."""
    return set(re.findall(r"\b(" + "|".join(NUMPY) + r")\b", re.sub(r'"[^"]*"', "", text)))


@pytest.mark.parametrize("name", list(OPS))
def test_each_op_is_documented_where_it_is_defined(name):
    """Each op's docstring (ops.py; docs/mil.md's table is made of them) names its arguments in order, each
    const, tuple, optional and BLOBFILE one as such, exactly the dtypes its Params take or Apple's
    definition adds, the op's first opset, and has a section of what anectypes refuses where it does."""
    op = OPS[name]
    doc = op_doc(op)
    assert list(doc["Inputs"]) == list(op.params)
    for pname, p in op.params.items():
        text = doc["Inputs"][pname]
        assert text.startswith("const ") == (p.kind == "const"), (pname, text)
        assert text.startswith("a tuple ") == p.many, (pname, text)
        assert ("optional" in text or "default" in text) == (p.default is not REQUIRED), (pname, text)
        assert ("BLOBFILE" in text) == p.blob_ok, (pname, text)
        named = dtypes(text) | (dtypes(doc["T"]) if re.search(r"\bT\b", text) else set())
        assert named == set(p.dtypes), (pname, text)
    texts = [*doc["Inputs"].values(), *(text for text in doc.values() if isinstance(text, str))]
    assert set().union(*map(dtypes, texts)) == {d for p in op.params.values() for d in p.dtypes + p.apple}
    assert doc["Opsets"].startswith(f"iOS{op.since[3:]} on")
    if any(d in p.dtypes for p in op.params.values() for d in p.newer):
        assert "from iOS17" in doc["Opsets"]
    if any(p.apple or p.computed_ok for p in op.params.values()) or "unsupported(" in getsource(type(op)):
        assert "Not supported by anectypes" in doc
