"""The typed MIL graph that the parser produces, the builder assembles and the interpreter runs.

`bind()` is the one place where an op's arguments are checked against its registry entry and its
output type is inferred; `Program.text()` prints the graph in either dialect.
"""

from dataclasses import dataclass, field

import numpy as np

from ..errors import MILError
from .ops import OPS, REQUIRED, Args
from .types import OPSETS, TensorType, as_value, format_value, shorten


@dataclass(frozen=True)
class BlobRef:
    """A BLOBFILE reference: `path` as written in the MIL, `offset` of the chunk header (§2.1)."""
    path: str
    offset: int


@dataclass(eq=False)
class Var:
    name: str
    type: TensorType
    value: object = None          # inline literal of a const (Python scalar, str or numpy array)
    blob: BlobRef = None          # or its BLOBFILE reference
    from_consts: bool = False     # computed from constants only (Apple's is_descendant_of_const)

    @property
    def is_const(self):
        return self.value is not None or self.blob is not None


@dataclass(eq=False)
class Operation:
    op: object                    # an ops.Op, or None for `const`
    out: Var
    args: dict                    # param -> Var | tuple[Var] (absent optional params are left out)
    name: str                     # the [name = string("...")] attribute
    line: int = None
    col: int = None

    @property
    def type(self):
        return "const" if self.op is None else self.op.name


@dataclass(eq=False)
class Function:
    name: str
    inputs: list
    ops: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


@dataclass(eq=False)
class Program:
    dialect: object
    functions: dict
    version: str = None           # as parsed; the dialect's own when built

    @property
    def main(self):
        return self.functions["main"]

    def blob_paths(self):
        return sorted({o.out.blob.path for f in self.functions.values() for o in f.ops
                       if o.out.blob} | {v.blob.path for f in self.functions.values() for o in f.ops
                                         for v in o.args.values() if isinstance(v, Var) and v.blob})

    def text(self):
        d = self.dialect
        lines = [f"program({self.version or d.program})", d.build_info, "{"]
        for f in self.functions.values():
            params = ", ".join(f"{v.type.text(True)} {v.name}" for v in f.inputs)
            lines.append(f"    func {f.name}<{d.name}>({params}) {{")
            lines += ["        " + op_text(o, d) for o in f.ops]
            lines.append(f"    }} -> ({', '.join(v.name for v in f.outputs)});")
        lines.append("}")
        return "\n".join(lines) + "\n"


def literal_text(var, d):
    """`int32(1)`, `tensor<int32, [2]>([1, 1])` or a BLOBFILE reference, spelled for dialect d."""
    t = var.type
    if var.blob is not None:
        b = var.blob
        path = literal_text(Var("", TensorType("string"), b.path), d)
        offset = literal_text(Var("", TensorType("uint64"), b.offset), d)
        return f"{t.text(True)}(BLOBFILE(path = {path}, offset = {offset}))"
    return f"{t.text(d.verbose_scalars)}({format_value(t, var.value)})"


def op_text(o, d):
    name = literal_text(Var("", TensorType("string"), o.name), d)
    head = f"{o.out.type.text(d.verbose_scalars)} {o.out.name} = "
    if o.op is None:
        return head + f"const()[name = {name}, val = {literal_text(o.out, d)}];"
    if o.op.in_attributes:
        attrs = [f"{k} = {literal_text(v, d)}" for k, v in o.args.items()] + [f"name = {name}"]
        return head + f"{o.op.name}()[{', '.join(sorted(attrs))}];"
    args = ", ".join(f"{k} = " + (f"({', '.join(x.name for x in v)})" if isinstance(v, tuple) else v.name)
                     for k, v in o.args.items())
    return head + f"{o.op.name}({args})[name = {name}];"


@dataclass
class Arg:
    type: TensorType = None
    value: object = None
    const: bool = False           # a const
    from_consts: bool = False     # a const, or computed from constants only


# ops the ANE's MIL text is reported not to have, and what to write instead (docs/ane-reference.md §3.6)
MISSING = {"reduce_mean": "write reduce_sum and mul by 1/N (hollance/neural-engine#44)",
           "gelu": "write it with tanh, mul, add and pow (ORION-C #10)",
           "rsqrt": "write pow(x, -0.5) (ORION-P)"}


def bind(opname, args, d):
    """Check `args` (param -> Var or tuple of Vars) against op `opname`; return (op, output type)."""
    op = OPS.get(opname)
    if op is None:
        hint = f" ({MISSING[opname]})" if opname in MISSING else ""
        raise MILError(f"unknown op '{shorten(opname)}'{hint}; supported: const, {', '.join(sorted(OPS))}")
    if OPSETS.index(d.name) < OPSETS.index(op.since):
        raise MILError(f"{opname} is not in Apple's {d.name} opset ({d.chips}): it exists from {op.since} on "
                       "(coremltools ops/defs)", op=opname)
    unknown = sorted(set(args) - set(op.params))
    if unknown:
        raise MILError(f"unknown argument '{shorten(unknown[0])}'; {opname} takes {', '.join(op.params)}", op=opname)
    a, apple_only = {}, None
    newer_ok = OPSETS.index(d.name) >= OPSETS.index("ios17")
    for pname, p in op.params.items():
        v = args.get(pname)
        if v is None:
            if p.default is REQUIRED:
                raise MILError(f"missing required argument '{pname}'", op=opname)
            a[pname] = Arg() if p.default is None else default_arg(p)
            continue
        vs = v if isinstance(v, tuple) else (v,)
        if isinstance(v, tuple) != p.many or not vs:
            raise MILError(f"argument '{pname}' must be " + ("a tuple of variables (a, b, ...)" if p.many
                                                              else "a single variable"), op=opname)
        for x in vs:
            if x.type.dtype in p.apple and (newer_ok or x.type.dtype not in p.newer):
                apple_only = apple_only or (f"argument '{pname}' ({shorten(x.name)}) of dtype {x.type.dtype} is not "
                                            f"supported by anectypes (Apple's {d.name} definition of the op accepts it)")
            elif x.type.dtype not in p.dtypes or x.type.dtype in p.newer and not newer_ok:
                raise MILError(f"argument '{pname}' ({shorten(x.name)}) has dtype {x.type.dtype}; expected "
                               f"{' or '.join(t for t in p.dtypes if newer_ok or t not in p.newer)}", op=opname)
            if p.kind == "const" and (x.value is None if not p.blob_ok else not x.is_const):
                apple_takes = x.blob is not None or p.computed_ok    # Apple reads any const from a file
                raise MILError(f"argument '{pname}' must be an inline const, but {shorten(x.name)} is "
                               + ("a BLOBFILE" if x.blob else "computed") + (
                                   f": that is not supported by anectypes (Apple's {d.name} definition of the op "
                                   "accepts it)" if apple_takes else ""), op=opname)
            if p.kind == "const" and x.type.dtype == "bool" and x.type.shape:  # flags are scalars
                raise MILError(f"argument '{pname}' ({shorten(x.name)}) must be a bool scalar, got {x.type}",
                               op=opname)
        a[pname] = [arg(x) for x in vs] if p.many else arg(v)
    try:
        out = op.infer(Args(**a, opset=d.name))     # Apple's refusals first: then what anectypes lacks
        if apple_only:
            raise MILError(apple_only)
        return op, out
    except MILError as e:
        raise MILError(e.reason, op=opname) from None
    except (TypeError, ValueError, IndexError, KeyError) as e:  # a shape rule that missed a check
        raise MILError(f"invalid arguments ({type(e).__name__}: {e})", op=opname) from None


def arg(v):
    return Arg(v.type, v.value, v.is_const, v.is_const or v.from_consts)


def computed_from_consts(op, args):
    """Whether the op's result is computed from constants only: a constexpr op's, or one whose
    arguments all are (coremltools' `is_descendant_of_const`)."""
    vs = [x for v in args.values() for x in (v if isinstance(v, tuple) else (v,))]
    return op.in_attributes or all(x.is_const or x.from_consts for x in vs)


def default_arg(p):
    shape = np.shape(p.default)
    ttype = TensorType(p.dtypes[0], shape)
    return Arg(ttype, as_value(ttype, p.default), True, True)

