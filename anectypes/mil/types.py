"""MIL tensor types, literal values and the two text dialects (docs/ane-reference.md §3.1, §3.5)."""

import math
from dataclasses import dataclass

import numpy as np

from ..errors import MILError

# MIL dtype name -> numpy storage dtype
NUMPY = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "int8": np.int8, "uint8": np.uint8,
         "int16": np.int16, "uint16": np.uint16, "uint32": np.uint32, "bool": np.bool_, "uint64": np.uint64,
         "string": np.str_}
FLOAT = ("fp16", "fp32")
NUMERIC = ("fp16", "fp32", "int32", "int8", "uint8")
QUOTE_LIMIT = 80          # characters of a name, token or value that an error message quotes


def shorten(text):
    """`text` as an error message quotes it: whole, or its first QUOTE_LIMIT characters and its length."""
    text = str(text)
    return text if len(text) <= QUOTE_LIMIT else f"{text[:QUOTE_LIMIT]}... ({len(text)} characters)"


@dataclass(frozen=True)
class TensorType:
    """A MIL type: dtype plus static shape. A scalar is a rank-0 tensor (`fp16` == `tensor<fp16, []>`)."""
    dtype: str
    shape: tuple = ()

    @property
    def rank(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def nbytes(self):
        return self.size * np.dtype(NUMPY[self.dtype]).itemsize

    def text(self, verbose_scalars=False):
        if not self.shape and not verbose_scalars:
            return self.dtype
        return f"tensor<{self.dtype}, [{', '.join(map(str, self.shape))}]>"

    __str__ = text


@dataclass(frozen=True)
class Dialect:
    """How MIL text is spelled for one family of chips."""
    name: str            # the opset in `func main<...>`
    program: str         # the version in `program(...)`
    build_info: str      # the attribute line after `program(...)`
    verbose_scalars: bool
    chips: str           # the chips that compile it


_INFO_18 = ('[buildInfo = dict<string, string>({{"coremlc-component-MIL", "3510.2.1"}, '
            '{"coremlc-version", "3505.4.1"}, {"coremltools-component-milinternal", ""}, '
            '{"coremltools-version", "9.0"}})]')
_INFO_16 = '[buildInfo = dict<tensor<string, []>, tensor<string, []>>({{"coremlc-version", "3505.4.1"}})]'

# Apple's opsets in order (coremltools' ops/defs/iOS15..iOS18, §3.8): an op exists from its `since` on
OPSETS = ("ios15", "ios16", "ios17", "ios18")

# M1/M2 need program(1.0)/ios16 and verbose scalars (§3.5); which ops each opset has: ops.Op.since
DIALECTS = {
    "ios18": Dialect("ios18", "1.3", _INFO_18, verbose_scalars=False, chips="M3/M4/M5"),
    "ios16": Dialect("ios16", "1.0", _INFO_16, verbose_scalars=True, chips="M1/M2"),
}


def dialect(name):
    if name not in DIALECTS:
        raise MILError(f"unknown MIL dialect {name!r}; choose one of {', '.join(DIALECTS)}")
    return DIALECTS[name]


def as_value(ttype, raw):
    """Turn a parsed or user-given literal into the stored value for `ttype`: a scalar, a list (nested or
    not) or a numpy array, such as the int64 or float64 array of a list the parser read at once.

    Scalars become Python scalars (str for strings); tensors become numpy arrays of the dtype.
    """
    if ttype.dtype == "string":
        if ttype.shape or not isinstance(raw, str):
            raise MILError(f"expected a string literal for {ttype}")
        return raw
    if isinstance(raw, str):
        raise MILError(f"expected a {ttype.dtype} value for {ttype}, got string {shorten(raw)!r}")
    flat = (raw if isinstance(raw, np.ndarray) else np.array(raw, dtype=object)).reshape(-1)
    kinds = {kind(v) for v in flat} if flat.dtype == object else {kind(flat.dtype.type(0))}
    if ttype.dtype in FLOAT and kinds - {"int", "float"}:
        raise MILError(f"expected numbers for {ttype}" + (", got true/false" if "bool" in kinds else ""))
    if flat.size != ttype.size:
        raise MILError(f"literal has {flat.size} values but {ttype} needs {ttype.size}")
    if ttype.dtype == "bool":
        if kinds - {"bool"}:
            raise MILError(f"expected true/false values for {ttype}")
    elif ttype.dtype not in FLOAT:
        if kinds - {"int"}:
            raise MILError(f"expected integer values for {ttype}")
        info = np.iinfo(NUMPY[ttype.dtype])
        if flat.size and (flat.min() < info.min or flat.max() > info.max):
            raise MILError(f"value out of range for {ttype.dtype}")
    with np.errstate(over="ignore"):
        arr = (flat.astype(np.float64) if ttype.dtype in FLOAT else flat).astype(NUMPY[ttype.dtype])
    return arr.item() if not ttype.shape else arr.reshape(ttype.shape)


def kind(value):
    """bool, int, float or other: what a literal value is (Python or numpy)."""
    for name, types in (("bool", (bool, np.bool_)), ("int", (int, np.integer)), ("float", (float, np.floating))):
        if isinstance(value, types):
            return name
    return "other"


def format_value(ttype, value):
    """The literal text of a value: `1`, `true`, `"x"`, `0.125`, or `[1, 2]` for tensors."""
    if ttype.dtype == "string":
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    arr = np.asarray(value, dtype=NUMPY[ttype.dtype]).reshape(-1)
    if ttype.dtype == "bool":
        items = ["true" if v else "false" for v in arr]
    elif ttype.dtype in FLOAT:
        items = [hex_float(v) for v in arr]
    else:
        items = [str(int(v)) for v in arr]
    return items[0] if not ttype.shape else "[" + ", ".join(items) + "]"


def hex_float(value):
    """A float as coremlc prints it (C's %a, §3.9): `0x1p-17`, `-0x1.8p+0`, `-0x0p+0`; `inf`, `-inf`, `nan`."""
    text = float(value).hex()                        # '0x1.8000000000000p+0', or 'inf', '-inf', 'nan'
    mantissa, p, exponent = text.partition("p")
    return mantissa.rstrip("0").rstrip(".") + p + exponent if p else text
