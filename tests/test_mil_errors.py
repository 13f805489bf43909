"""Malformed MIL: every mistake is a MILError (or BlobError for weights) that says what, where and in which op.

Each case starts from a small valid program and breaks one thing. Positions are given with a marker:
`locate(text, "= ‸add(")` is the line and column of the character after ‸ in the (unique) snippet.
"""

import random
import re

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.errors import BlobError, MILError
from anectypes.mil import Plan, parse
from anectypes.mil.blob import write_blob
from anectypes.mil.parser import tokenize

# transpose, scalar const, add: the elementwise base (ios18, the M3/M4/M5 dialect)
BASE = """program(1.3)
{
    func main<ios18>(tensor<fp16, [1, 4, 1, 3]> x) {
        tensor<int32, [4]> perm = const()[name = string("perm"), val = tensor<int32, [4]>([0, 1, 3, 2])];
        tensor<fp16, [1, 4, 3, 1]> t = transpose(x = x, perm = perm)[name = string("t")];
        fp16 one = const()[name = string("one"), val = fp16(1)];
        tensor<fp16, [1, 4, 3, 1]> y = add(x = t, y = one)[name = string("y")];
    } -> (y);
}
"""

# slice, matmul with named bool flags, reshape
MATMUL = """program(1.3)
{
    func main<ios18>(tensor<fp16, [1, 1, 4, 8]> a, tensor<fp16, [1, 1, 8, 2]> b) {
        tensor<int32, [4]> begin = const()[name = string("begin"), val = tensor<int32, [4]>([0, 0, 0, 0])];
        tensor<int32, [4]> size = const()[name = string("size"), val = tensor<int32, [4]>([1, 1, 4, 8])];
        tensor<fp16, [1, 1, 4, 8]> s = slice_by_size(x = a, begin = begin, size = size)[name = string("s")];
        bool f = const()[name = string("f"), val = bool(false)];
        tensor<fp16, [1, 1, 4, 2]> m = matmul(x = s, y = b, transpose_x = f, transpose_y = f)[name = string("m")];
        tensor<int32, [2]> shape = const()[name = string("shape"), val = tensor<int32, [2]>([4, 2])];
        tensor<fp16, [4, 2]> r = reshape(x = m, shape = shape)[name = string("r")];
    } -> (r);
}
"""

# the M1/M2 form (docs/ane-reference.md §3.5): program(1.0), ios16, verbose scalars
IOS16 = """program(1.0)
[buildInfo = dict<tensor<string, []>, tensor<string, []>>({{"coremlc-version", "3505.4.1"}})]
{
    func main<ios16>(tensor<fp16, [1, 4, 1, 3]> x) {
        tensor<int32, [4]> perm = const()[name = tensor<string, []>("perm"), val = tensor<int32, [4]>([0, 1, 3, 2])];
        tensor<fp16, [1, 4, 3, 1]> t = transpose(x = x, perm = perm)[name = tensor<string, []>("t")];
        tensor<fp16, []> half = const()[name = tensor<string, []>("half"), val = tensor<fp16, []>(0.5)];
        tensor<fp16, [1, 4, 3, 1]> y = mul(x = t, y = half)[name = tensor<string, []>("y")];
    } -> (y);
}
"""

CAST = '''        string dt = const()[name = string("dt"), val = string("fp32")];
        tensor<fp32, [1, 4, 3, 1]> c = cast(x = y, dtype = dt)[name = string("c")];
    } -> (c);'''

# a 1x1 conv reading its weight from a BLOBFILE
CONV = """program(1.3)
{
    func main<ios18>(tensor<fp16, [1, IC, 1, 3]> x) {
        tensor<fp16, [4, IC, 1, 1]> w = const()[name = string("w"), val = tensor<fp16, [4, IC, 1, 1]>(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(OFFSET)))];
        tensor<fp16, [1, 4, 1, 3]> y = conv(x = x, weight = w)[name = string("y")];
    } -> (y);
}
"""
WPATH = "@model_path/weights/w.bin"


def conv_program(ic=4, offset=64):
    weight = (np.arange(4 * ic) % 5 - 2).astype(np.float16).reshape(4, ic, 1, 1)
    blob, (off,) = write_blob(weight)
    assert off == 64
    return CONV.replace("IC", str(ic)).replace("OFFSET", str(offset)), {WPATH: blob}


def edit(text, old, new):
    assert text.count(old) == 1, f"{old!r} must occur once in the base program"
    return text.replace(old, new)


def edited(text, *edits):
    """text with each (old, new) of edits applied in turn, each old occurring once."""
    for old, new in edits:
        text = edit(text, old, new)
    return text


def locate(text, marked):
    """(line, col) of the ‸ in `marked`, a snippet that occurs exactly once in text."""
    snippet = marked.replace("‸", "")
    assert text.count(snippet) == 1, f"{snippet!r} must occur once"
    at = text.index(snippet) + marked.index("‸")
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def expect(text, reason, where, op=None):
    """parse(text) must raise MILError whose reason contains every fragment, in `op`, at `where`: the
    marked token (a snippet with ‸) or a (line, col)."""
    with pytest.raises(MILError) as info:
        parse(text)
    e = info.value
    for fragment in [reason] if isinstance(reason, str) else reason:
        assert fragment in e.reason, (fragment, e.reason)
    line, col = where if isinstance(where, tuple) else locate(text, where)
    assert (e.line, e.col) == (line, col), (e.line, e.col, line, col, e.reason)
    assert e.op == op
    # the message a user sees carries all three
    assert str(e).startswith(f"line {line}, col {col}: " + (f"op '{op}': " if op else ""))
    return e


def test_base_programs_are_valid():
    for text in (BASE, MATMUL, IOS16, edit(BASE, "    } -> (y);", CAST), conv_program()[0]):
        parse(text)
    Plan(parse(conv_program()[0]), conv_program()[1])


def case(name, text, reason, where, op=None):
    return pytest.param(text, reason, where, op, id=name)


PERM_FROM_INPUT = ("tensor<fp16, [1, 4, 1, 3]> x)", "tensor<fp16, [1, 4, 1, 3]> x, tensor<int32, [4]> p)")
QUANTIZE = """        tensor<fp16, []> s = const()[name = tensor<string, []>("s"), val = tensor<fp16, []>(0.5)];
        tensor<string, []> o = const()[name = tensor<string, []>("o"), val = tensor<string, []>("int8")];
        tensor<int8, [1, 4, 3, 1]> q = quantize(input = y, scale = s, output_dtype = o)[name = tensor<string, []>("q")];
    } -> (q);"""


def second_function(head):
    """BASE with a second function `head`, e.g. "main<ios18>"."""
    second = f"    func {head}(tensor<fp16, [2]> a) {{\n    }} -> (a);\n"
    return edited(BASE, ("} -> (y);\n}\n", "} -> (y);\n" + second + "}\n"))


BLOB_IN_SCALAR = 'val = fp16(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(64)))'

# Each case breaks one thing in a valid program: (name, text, the reason's fragments, where, op)
CASES = [
    # statements, names, scope
    case("missing name attribute", edited(BASE, ('add(x = t, y = one)[name = string("y")];', "add(x = t, y = one);")),
         'missing the name attribute: every op needs [name = string("...")]', "= ‸add(", "add"),
    case("missing name attribute on const",
         edited(BASE, ('const()[name = string("one"), val = fp16(1)]', "const()[val = fp16(1)]")),
         "missing the name attribute", "one = ‸const()", "const"),
    case("duplicate variable", edited(BASE, ("fp16 one = const()", "fp16 t = const()"), ("y = one)", "y = t)")),
         "variable 't' is defined twice (MIL variables are single-assignment)", "fp16 ‸t = const", "const"),
    case("parameter defined twice",
         edited(BASE, ("tensor<fp16, [1, 4, 1, 3]> x)", "tensor<fp16, [1, 4, 1, 3]> x, tensor<fp16, [2]> x)")),
         "variable 'x' is defined twice", "[2]> ‸x)"),
    case("duplicate op name", edited(BASE, ('name = string("one")', 'name = string("t")')),
         'op name "t" is used twice', "one = ‸const()", "const"),
    case("undefined variable", edited(BASE, ("add(x = t,", "add(x = tt,")),
         "undefined variable 'tt'", "add(x = ‸tt,", "add"),
    case("variable used before its definition",
         edited(BASE, ("transpose(x = x, perm = perm)", "transpose(x = x, perm = later)"),
                ("fp16 one = const()", 'tensor<int32, [4]> later = const()[name = string("later"), val = '
                 "tensor<int32, [4]>([0, 1, 3, 2])];\n        fp16 one = const()")),
         "undefined variable 'later'", "perm = ‸later)", "transpose"),
    case("output names an undefined variable", edited(BASE, ("-> (y);", "-> (y, z);")),
         "output 'z' is not defined in function 'main'", "-> (y, ‸z);"),
    case("function defined twice", second_function("main<ios18>"), "function 'main' is defined twice",
         "    ‸func main<ios18>(tensor<fp16, [2]> a)"),
    case("no main function", edited(BASE, ("func main<", "func other<")), "the program has no 'main' function", (1, 1)),

    # ops, arguments, attributes
    case("unknown op", edited(BASE, ("= add(", "= addd(")),
         ["unknown op 'addd'", "supported: const, add,", "transpose", "matmul", "conv"], "= ‸addd("),
    case("unknown argument", edited(BASE, ("add(x = t, y = one)", "add(x = t, y = one, z = one)")),
         "unknown argument 'z'; add takes x, y", "= ‸add(", "add"),
    case("argument given twice", edited(BASE, ("add(x = t, y = one)", "add(x = t, x = one)")),
         "argument 'x' given twice", "t, ‸x = one)", "add"),
    case("unknown attribute", edited(BASE, ('[name = string("y")]', '[name = string("y"), foo = int32(1)]')),
         "unknown attribute 'foo' (only name is allowed here)", "= ‸add(", "add"),
    case("const without val", edited(BASE, (", val = fp16(1)]", "]")),
         "const needs a val attribute", "one = ‸const()", "const"),
    case("const with arguments", edited(BASE, ('const()[name = string("one")', 'const(x = x)[name = string("one")')),
         "const takes only name and val attributes (unexpected: ['x'])", "one = ‸const(", "const"),
    case("missing required argument", edited(BASE, ("add(x = t, y = one)", "add(x = t)")),
         "missing required argument 'y'", "= ‸add(", "add"),
    case("tuple where a single variable is expected", edited(BASE, ("add(x = t,", "add(x = (t, t),")),
         "argument 'x' must be a single variable", "= ‸add(", "add"),

    # types and shapes
    case("declared shape differs from inferred",
         edited(BASE, ("tensor<fp16, [1, 4, 3, 1]> y =", "tensor<fp16, [1, 4, 1, 3]> y =")),
         "declared type tensor<fp16, [1, 4, 1, 3]> does not match the tensor<fp16, [1, 4, 3, 1]> that add produces",
         "1, 3]> ‸y = add", "add"),
    case("declared dtype differs from inferred",
         edited(BASE, ("tensor<fp16, [1, 4, 3, 1]> t =", "tensor<fp32, [1, 4, 3, 1]> t =")),
         "declared type tensor<fp32, [1, 4, 3, 1]> does not match the tensor<fp16, [1, 4, 3, 1]> that transpose "
         "produces", "3, 1]> ‸t = transpose", "transpose"),
    case("add of fp16 and fp32", edited(BASE, ('fp16 one = const()[name = string("one"), val = fp16(1)]',
                                               'fp32 one = const()[name = string("one"), val = fp32(1)]')),
         "operands must have the same dtype, got fp16 and fp32", "= ‸add(", "add"),
    case("shapes that do not broadcast",
         edited(BASE, ("[1, 4, 1, 3]> x)", "[1, 4, 1, 3]> x, tensor<fp16, [1, 2, 3, 1]> u)"),
                ("add(x = t, y = one)", "add(x = t, y = u)")),
         "shapes [1, 4, 3, 1] and [1, 2, 3, 1] do not broadcast", "= ‸add(", "add"),
    case("matmul inner dimension mismatch", edited(MATMUL, ("[1, 1, 8, 2]> b", "[1, 1, 7, 2]> b")),
         "inner dimensions differ: x [1, 1, 4, 8] (transpose_x=False) and y [1, 1, 7, 2] (transpose_y=False)",
         "= ‸matmul(", "matmul"),
    case("matmul flag must be a bool const", edited(MATMUL, ("transpose_x = f,", "transpose_x = a,")),
         "argument 'transpose_x' (a) has dtype fp16; expected bool", "= ‸matmul(", "matmul"),
    # Apple's type inference does not check it (tests/test_mil_coremltools.py); anectypes says it refuses it
    case("slice out of bounds", edited(MATMUL, ("([0, 0, 0, 0])", "([0, 0, 1, 0])")),
         ["a slice (begin [0, 0, 1, 0], size [1, 1, 4, 8]) outside x [1, 1, 4, 8] on axis 2",
          "is not supported by anectypes"], "= ‸slice_by_size(", "slice_by_size"),
    case("slice vector of wrong length", edited(MATMUL, ("tensor<int32, [4]> size", "tensor<int32, [3]> size"),
                                                ("tensor<int32, [4]>([1, 1, 4, 8])", "tensor<int32, [3]>([1, 4, 8])")),
         "size must be tensor<int32, [4]>, got tensor<int32, [3]>", "= ‸slice_by_size(", "slice_by_size"),
    case("reshape element count mismatch", edited(MATMUL, ("([4, 2])", "([4, 3])")),
         "cannot reshape [1, 1, 4, 2] (8 elements) to [4, 3]", "= ‸reshape(", "reshape"),
    case("reshape with two unknown sizes", edited(MATMUL, ("([4, 2])", "([-1, -1])")),
         "shape [-1, -1] may hold positive sizes and at most one -1", "= ‸reshape(", "reshape"),
    # Apple's type inference takes it (tests/test_mil_coremltools.py): anectypes says it does not
    case("perm that is not a permutation", edited(BASE, ("([0, 1, 3, 2])", "([0, 1, 3, 3])")),
         ["a perm [0, 1, 3, 3] that is not a permutation of the 4 axes", "is not supported by anectypes"],
         "= ‸transpose(", "transpose"),
    case("perm with axes out of range", edited(BASE, ("([0, 1, 3, 2])", "([0, 1, 4, 2])")),
         "perm [0, 1, 4, 2] has axes out of range", "= ‸transpose(", "transpose"),
    case("perm computed by an op is not a const",
         edited(BASE, PERM_FROM_INPUT, ('const()[name = string("perm"), val = tensor<int32, [4]>([0, 1, 3, 2])]',
                                        'add(x = p, y = p)[name = string("perm")]')),
         "argument 'perm' must be an inline const, but perm is computed", "= ‸transpose(", "transpose"),
    case("perm from a function input is not a const", edited(BASE, PERM_FROM_INPUT, ("perm = perm)", "perm = p)")),
         "argument 'perm' must be an inline const, but p is computed", "= ‸transpose(", "transpose"),
    case("flag tensor where a bool scalar is expected",
         edited(MATMUL, ('bool f = const()[name = string("f"), val = bool(false)]',
                         'tensor<bool, [2]> f = const()[name = string("f"), val = tensor<bool, [2]>([false, true])]')),
         "argument 'transpose_x' (f) must be a bool scalar, got tensor<bool, [2]>", "= ‸matmul(", "matmul"),
    case("dimension that is not an integer", edited(BASE, ("[1, 4, 1, 3]> x", "[1, 4.5, 1, 3]> x")),
         "dimension must be a non-negative integer, found 4.5", "[1, ‸4.5, 1"),
    case("dimension too large", edited(BASE, ("[1, 4, 1, 3]> x", "[1, 99999999999999999999, 1, 3]> x")),
         "dimension 99999999999999999999 is too large (at most 2147483647)", "[1, ‸99999"),
    case("unknown dtype", edited(BASE, ("tensor<fp16, [1, 4, 1, 3]> x", "tensor<fp8, [1, 4, 1, 3]> x")),
         "unknown dtype 'fp8'; MIL dtypes are fp16, fp32", "tensor<‸fp8"),

    # literals
    case("literal with wrong element count", edited(BASE, ("([0, 1, 3, 2])", "([0, 1, 3])")),
         "literal has 3 values but tensor<int32, [4]> needs 4", "val = ‸tensor<int32, [4]>([0, 1, 3])", "const"),
    case("literal with non-integer values", edited(BASE, ("([0, 1, 3, 2])", "([0, 1, 3, 2.0])")),
         "expected integer values for tensor<int32, [4]>", "val = ‸tensor<int32, [4]>([", "const"),
    case("literal out of range", edited(BASE, ("([0, 1, 3, 2])", "([0, 1, 3, 4294967296])")),
         "value out of range for int32", "val = ‸tensor<int32, [4]>([", "const"),
    case("float literal given a bool", edited(BASE, ("fp16(1)", "fp16(true)")),
         "expected numbers for fp16, got true/false", "val = ‸fp16(", "const"),
    case("float literal given a string", edited(BASE, ("fp16(1)", 'fp16("1")')),
         "expected a fp16 value for fp16, got string '1'", "val = ‸fp16(", "const"),
    case("value that is not a literal", edited(BASE, ("fp16(1)", "fp16(x)")),
         "expected a value (number, true/false, string or [list]), found 'x'", "fp16(‸x)"),
    case("name attribute that is not a string", edited(BASE, ('name = string("y")', "name = int32(7)")),
         "the name attribute must be a string", "= ‸add(", "add"),

    # the ios16 (M1/M2) dialect and opsets
    case("shorthand scalar in ios16 attribute", edited(IOS16, ('[name = tensor<string, []>("t")]',
                                                               '[name = string("t")]')),
         "the ios16 dialect spells scalars in full: tensor<string, []>, not string", '[name = ‸string("t")]'),
    case("shorthand scalar type in ios16 statement", edited(IOS16, ("tensor<fp16, []> half = const()",
                                                                    "fp16 half = const()")),
         "the ios16 dialect spells scalars in full: tensor<fp16, []>, not fp16", "‸fp16 half"),
    case("op newer than the opset", edited(IOS16, ("    } -> (y);", QUANTIZE)),
         "quantize is not in Apple's ios16 opset (M1/M2): it exists from ios17 on", "= ‸quantize(", "quantize"),
    case("unsupported opset", edited(BASE, ("main<ios18>", "main<ios17>")),
         "unsupported opset 'ios17'; anectypes reads ios18 and ios16", "main<‸ios17>"),
    case("two opsets in one program", second_function("other<ios16>"), "all functions must use one opset",
         "other<‸ios16>"),

    # text that is not MIL
    case("unexpected character", edited(BASE, ("perm = perm)", "perm = perm $)")),
         "unexpected character '$'", "perm ‸$)"),
    case("missing semicolon", edited(BASE, ('string("t")];', 'string("t")]')),
         "expected ';' after the statement, found 'fp16'", "        ‸fp16 one"),
    case("missing outputs arrow", edited(BASE, ("    } -> (y);\n", "    }\n")),
         "expected '->' and the output list after the function body, found '}'", (9, 1)),
    case("unterminated string", edited(BASE, ('string("y")', 'string("y)')),
         "unterminated string: a string literal must end with '\"' on the same line", 'string(‸"y)'),
    case("truncated text", BASE[:BASE.index("= add(") + 2], "expected an op name, found end of text", (7, 40)),
    case("empty text", "", "expected 'program', found end of text", (1, 1)),
    case("text after the program", BASE + "}\n", "expected end of text after the program, found '}'", (10, 1)),

    # BLOBFILE references (their weights are checked when planned or compiled: below)
    case("blobfile in a scalar literal", edited(BASE, ("val = fp16(1)", BLOB_IN_SCALAR)),
         "a BLOBFILE value needs a tensor type with a shape", "fp16(‸BLOBFILE"),
    case("blobfile without offset", edited(conv_program()[0], (", offset = uint64(64)", "")),
         "BLOBFILE needs exactly path and offset, got ['path']", "(‸BLOBFILE("),
    case("blobfile offset must be uint64", edited(conv_program()[0], ("offset = uint64(64)", "offset = int32(64)")),
         "BLOBFILE path must be a string and offset a uint64", "(‸BLOBFILE("),
]


@pytest.mark.parametrize("text, reason, where, op", CASES)
def test_malformed_mil_is_a_mil_error_at_its_place(text, reason, where, op):
    expect(text, reason, where, op)


# --------------------------------------------------------------- the ios16 (M1/M2) dialect: the chips' refusal

def test_cast_in_ios16_is_apples_op_and_the_chips_refusal():
    """Apple's iOS16 opset has cast, so the op definitions accept it; M1/M2, the chips that read ios16, have
    none (PR#6, docs/ane-reference.md §3.5): the chip catalogue refuses it when the device compiles."""
    text = edit(IOS16, "    } -> (y);", CAST.replace('string dt', 'tensor<string, []> dt')
                .replace('string("', 'tensor<string, []>("'))
    parse(text)
    with pytest.raises(MILError) as info:
        open_device("sim", dialect="ios16").compile(text)
    assert "cast" in str(info.value) and "PR#6" in str(info.value) and info.value.line == locate(text, "= ‸cast(")[0]


def test_cast_is_fine_in_ios18():
    program = parse(edit(BASE, "    } -> (y);", CAST))
    assert str(program.main.outputs[0].type) == "tensor<fp32, [1, 4, 3, 1]>"


# --------------------------------------------------------------- text that is not UTF-8

def test_non_utf8_bytes():
    data = edit(BASE, "perm = perm)", "perm = perm\xff)").encode("latin-1")
    line, col = locate(BASE.replace("perm = perm)", "perm = perm\xff)"), "perm = perm‸\xff)")
    e = expect(data, "MIL text is not UTF-8 (byte ", (line, col))
    assert "is 0xff" in e.reason and str(data.index(b"\xff")) in e.reason


def test_non_utf8_position_counts_characters_not_bytes():
    text = "// caf\u00e9 \u2192\n" + edit(BASE, "perm = perm)", "perm = perm\xff)")
    data = text.replace("\xff", "@").encode("utf-8").replace(b"@", b"\xff")
    e = expect(data, "MIL text is not UTF-8", locate(text, "perm = perm‸\xff)"))
    assert e.line == 6


# --------------------------------------------------------------- BLOBFILE weights (checked when planned/compiled)

@pytest.mark.parametrize("ic", [4, 16])   # payload smaller / larger than a chunk header
def test_blobfile_offset_pointing_at_the_payload(ic):
    text, weights = conv_program(ic, offset=128)
    program = parse(text)                  # the text is fine; the offset is wrong for this blob
    for compile_ in (lambda: Plan(program, weights), lambda: open_device("sim").compile(text, weights)):
        with pytest.raises(BlobError) as info:
            compile_()
        msg = str(info.value)
        for fragment in ("const 'w'", WPATH, "offset 128", "chunk header at 64", "looks like a payload offset",
                         "MIL offsets point at the chunk header (e.g. 64), not at the payload (e.g. 128)"):
            assert fragment in msg, (fragment, msg)


def test_blobfile_offset_inside_the_file_header():
    text, weights = conv_program(offset=0)
    with pytest.raises(BlobError, match="offset 0 is inside the 64-byte file header; chunk offsets start at 64"):
        Plan(parse(text), weights)


def test_truncated_blob():
    text, weights = conv_program(ic=4)
    short = {WPATH: weights[WPATH][:-3]}
    with pytest.raises(BlobError) as info:
        open_device("sim").compile(text, short)
    msg = str(info.value)
    assert msg.startswith("compile failed: const 'w' BLOBFILE @model_path/weights/w.bin: ")
    assert "payload truncated: fp16[4, 4, 1, 1] needs 32 bytes from offset 128, only 29 available" in msg
    with pytest.raises(BlobError, match="blob is 40 bytes; a BLOBFILE needs at least its 64-byte file header"):
        Plan(parse(text), {WPATH: weights[WPATH][:40]})


def test_blob_whose_shape_disagrees_with_the_mil_type():
    text, _ = conv_program(ic=4)
    _, weights = conv_program(ic=8)        # 8 input channels in the blob, 4 in the MIL type
    with pytest.raises(BlobError, match=r"size field says 64 bytes but fp16\[4, 4, 1, 1\] needs 32"):
        Plan(parse(text), weights)


def test_blobfile_missing_from_weights():
    text, weights = conv_program()
    with pytest.raises(BlobError, match="BLOBFILE @model_path/weights/w.bin is not in the weights mapping "
                                        r"\(have: @model_path/weights/v.bin\)"):
        Plan(parse(text), {"@model_path/weights/v.bin": weights[WPATH]})
    with pytest.raises(BlobError, match=r"not in the weights mapping \(have: none\)"):
        open_device("sim").compile(text)


def test_weights_given_as_a_path_instead_of_bytes():
    text, _ = conv_program()
    with pytest.raises(BlobError, match="a blob must be bytes-like .* not str: read the file first"):
        Plan(parse(text), {WPATH: "weights/w.bin"})


def test_device_compile_keeps_the_position():
    text = edit(BASE, "add(x = t,", "add(x = tt,")
    with pytest.raises(MILError) as info:
        open_device("sim").compile(text)
    e = info.value
    assert (e.line, e.col, e.op) == (*locate(text, "add(x = ‸tt,"), "add")
    assert e.reason == "compile failed: undefined variable 'tt'"


# --------------------------------------------------------------- nothing else ever escapes

def mutations(text, rng):
    """Every token deleted, doubled, and replaced by a few others; and the text cut every few characters."""
    starts = [0]
    for line in text.split("\n"):
        starts.append(starts[-1] + len(line) + 1)
    tokens = tokenize(text)[:-1]
    vocab = sorted({t.text for t in tokens}) + ["-1", "0", "1e40", "99999", '""', "[]", "()", "tensor<int32, []>"]
    for t in tokens:
        at, end = starts[t.line - 1] + t.col - 1, starts[t.line - 1] + t.col - 1 + len(t.text)
        yield text[:at] + text[end:]
        yield text[:end] + " " + text[at:]
        for _ in range(2):
            yield text[:at] + rng.choice(vocab) + text[end:]
    for cut in range(0, len(text), 11):
        yield text[:cut]


def test_mutated_programs_raise_only_mil_or_blob_errors():
    rng = random.Random(0)
    conv_text, weights = conv_program()
    bases = [BASE, MATMUL, IOS16, edit(BASE, "    } -> (y);", CAST), conv_text]
    count = failures = 0
    for base in bases:
        for text in mutations(base, rng):
            count += 1
            try:
                Plan(parse(text), weights)
            except MILError as e:
                failures += 1
                assert e.line is not None and e.col is not None, e   # parse errors always have a position
            except BlobError:
                failures += 1
    assert count > 1500 and failures > count // 2


def test_a_shape_rule_that_crashes_still_gives_a_mil_error(monkeypatch):
    """Safety net: an op's shape rule that misses a check must not leak IndexError and friends."""
    from anectypes.mil.ops import OPS

    def broken(a):
        return ()[1]
    monkeypatch.setattr(OPS["add"], "infer", broken)
    expect(BASE, "invalid arguments (IndexError: tuple index out of range)", "= ‸add(", "add")


# --------------------------------------------------------------- huge, deep and long inputs

@pytest.mark.parametrize("old, new, bracket, opened", [
    ("fp16(1)", "fp16(" + "[" * 100_000 + "1" + "]" * 100_000 + ")", "[", 4),
    ("fp16 one = const()", "dict<" * 100_000 + "fp16 one = const()", "dict<", 2),
], ids=["list literal", "dict type"])
def test_brackets_nested_100000_deep(old, new, bracket, opened):
    """A clean error, not a RecursionError: at the first bracket past the limit (`opened` are open before)."""
    from anectypes.mil.parser import MAX_NESTING
    text = edit(BASE, old, new)
    run = text.index(bracket * 3)
    col = run - text.rfind("\n", 0, run) + (MAX_NESTING - opened + 1) * len(bracket) - 1
    expect(text, f"brackets nested more than {MAX_NESTING} deep", (text.count("\n", 0, run) + 1, col))


HUGE = 1_000_000                # characters: a token no message may echo whole


@pytest.mark.parametrize("edits", [
    pytest.param([("add(x = t,", "add(x = H,")], id="undefined variable"),
    pytest.param([("= add(", "= H(")], id="unknown op"),
    pytest.param([("fp16(1)", "fp16(H)")], id="found <token>"),
    pytest.param([("fp16(1)", 'fp16("H")')], id="got string"),
    pytest.param([("fp16(1)", 'fp16(1 "H")')], id="expected ')', found <string>"),
    pytest.param([("[1, 4, 1, 3]> x", "[1, 4.N, 1, 3]> x")], id="dimension not an integer"),
    pytest.param([("tensor<fp16, [1, 4, 1, 3]> x", "tensor<H, [1, 4, 1, 3]> x")], id="unknown dtype"),
    pytest.param([("main<ios18>", "main<H>")], id="unsupported opset"),
    pytest.param([("-> (y);", "-> (H);")], id="output not defined"),
    pytest.param([("add(x = t, y = one)", "add(x = t, H = one)")], id="unknown argument"),
    pytest.param([("add(x = t, y = one)", "add(x = t, H = one, H = one)")], id="argument given twice"),
    pytest.param([('string("y")]', 'string("y"), H = int32(1)]')], id="unknown attribute"),
    pytest.param([('string("y")]', 'string("y"), H = int32(1), H = int32(1)]')], id="attribute given twice"),
    pytest.param([("val = fp16(1)]", "val = fp16(1), H = int32(1)]")], id="const's unexpected attributes"),
    pytest.param([('name = string("t")', 'name = string("H")'), ('name = string("one")', 'name = string("H")')],
                 id="op name twice"),
    pytest.param([(" t = transpose", " H = transpose"), ("add(x = t,", "add(x = H,"), ("fp16 one =", "fp16 H =")],
                 id="variable twice"),
    pytest.param([("tensor<fp16, [1, 4, 1, 3]> x)", "tensor<fp16, [1, 4, 1, 3]> x, tensor<int32, [4]> p)"),
                  ('const()[name = string("perm"), val = tensor<int32, [4]>([0, 1, 3, 2])]',
                   'add(x = p, y = p)[name = string("perm")]'),
                  ("> perm = add", "> H = add"), ("perm = perm)", "perm = H)")], id="not an inline const"),
])
def test_errors_quote_at_most_80_characters_of_a_huge_token(edits):
    text = BASE
    for old, new in edits:
        text = edit(text, old, new.replace("H", "h" * HUGE).replace("N", "9" * HUGE))
    with pytest.raises(MILError) as info:
        parse(text)
    message = str(info.value)
    assert len(message) < 600 and re.search(r"\.\.\. \(100000\d characters\)", message), message[:300]


@pytest.mark.parametrize("digits", ["9" * 500, "9" * HUGE], ids=["500 digits", "a million digits"])
def test_a_huge_integer_is_a_clean_error(digits):
    for old, new, reason, marked in [
            ("[1, 4, 1, 3]> x", f"[1, {digits}, 1, 3]> x", "is too large (at most 2147483647)", "[1, ‸9999"),
            ("([0, 1, 3, 2])", f"([0, 1, 3, {digits}])", "value out of range for int32",
             "val = ‸tensor<int32, [4]>([")]:
        e = expect(edit(BASE, old, new), reason, marked, op=None if "x" in old else "const")
        assert len(str(e)) < 600


def test_a_huge_integer_in_a_float_literal_is_infinite():
    for digits in ("9" * 400, "9" * HUGE):
        one, = [o for o in parse(edit(BASE, "fp16(1)", f"fp16({digits})")).main.ops if o.name == "one"]
        assert one.out.value == np.inf


def test_a_tensor_larger_than_memory(monkeypatch):
    text = edit(BASE, "[1, 4, 1, 3]> x)", "[1, 4, 1, 3]> x, tensor<fp16, [1, 1000000000, 1, 1000000]> z)")
    expect(text, "tensor<fp16, [1, 1000000000, 1, 1000000]> needs 1,862,645.1 GiB, more than the ",
           ", ‸tensor<fp16, [1, 1000000000")
    from anectypes.mil import parser                    # the limit is this machine's memory
    monkeypatch.setattr(parser, "physical_memory", lambda: 2**30)
    text = edit(BASE, "[1, 4, 1, 3]> x)", "[1, 4, 1, 3]> x, tensor<fp32, [1, 268435457]> z)")
    expect(text, "tensor<fp32, [1, 268435457]> needs 1.0 GiB, more than the 1.0 GiB of memory this machine has",
           ", ‸tensor<fp32, [1, 268435457]")
    parse(edit(BASE, "[1, 4, 1, 3]> x)", "[1, 4, 1, 3]> x, tensor<fp32, [1, 268435456]> z)"))

def const_value(dtype, items, slow=False):
    """The value of `tensor<dtype, [n]>([items])`; slow=True keeps the parser from reading the list at
    once (a no-break space, which MIL reads as a space, makes it read token by token): the reference."""
    n = len(items.split(","))
    body = items + ("\u00a0" if slow else " ")
    text = edit(BASE, "fp16 one = const()", f'tensor<{dtype}, [{n}]> c = const()[name = string("c"), '
                f'val = tensor<{dtype}, [{n}]>([{body}])];\n        fp16 one = const()')
    c, = [o for o in parse(text).main.ops if o.name == "c"]
    return c.out.value


def test_a_flat_list_of_numbers_is_read_at_once(monkeypatch):
    """Not a token per number (a 50 MB weight literal would take minutes): the parser makes a handful."""
    from anectypes.mil import parser
    made, Token = [], parser.Token
    monkeypatch.setattr(parser, "Token", lambda *a: made.append(a) or Token(*a))
    for dtype in ("fp16", "int32"):
        made.clear()
        np.testing.assert_array_equal(const_value(dtype, ", ".join(["1"] * 10_000)), np.ones(10_000))
        assert len(made) < 1000


NUMBERS = ["0", "7", "-3", "+12", "007", "-0", "255", "256", "-128", "-129", "2147483647", "2147483648",
           "9007199254740993", "18446744073709551615", "18446744073709551616", "123456789012345678901234567890",
           "1.5", "-0.0", ".5", "-.25", "5.", "1e3", "1E-3", "1.e5", "-2.5e+2", "1e400", "-1e400", "1e-400",
           "65504", "65520", "3.4028235e38", "0.1", "1" * 40 + ".5"]
JUNK = ["", " ", "1e", ".", "+", "--1", "1..2", "e5", "1 2", "1e5.5", "+-1", "1,", "- 1"]


@pytest.mark.slow
def test_the_fast_reading_gives_what_token_by_token_gives():
    """Values (bit for bit, signed zeros included), errors and their positions are those of reading the
    same list token by token, for every dtype, on lists of valid and malformed numbers."""
    rng = random.Random(1)
    spaces = ["", " ", "  ", "\n", "\t", " \n    "]
    small = [n for n in NUMBERS if abs(float(n)) < 2**53]      # (larger ones are read token by token)
    for trial in range(300):
        pool = [NUMBERS + JUNK, NUMBERS, small][trial % 3]
        items = [rng.choice(spaces) + rng.choice(pool) + rng.choice(spaces) for _ in range(rng.randint(1, 6))]
        text = ",".join(items)
        for dtype in ("fp16", "fp32", "int32", "int8", "uint8", "uint64", "bool"):
            results = []
            for slow in (False, True):
                try:
                    v = np.asarray(const_value(dtype, text, slow))
                    results.append((v.dtype, v.tobytes()))
                except MILError as e:
                    results.append(str(e))
            assert results[0] == results[1], (dtype, text, results)
