"""Build MIL programs from Python and print them in the reference's dialect (or the M1/M2 one).

    b = Builder()                                   # Builder("ios16") for M1/M2
    x = b.input("x", [1, 64, 1, 32])
    w = b.weight(np.ones((64, 64, 1, 1)), "w.bin")  # a BLOBFILE const; b.weights() has the blob
    y = b.conv(x=x, weight=w)                       # any registry op; Python literals become consts
    b.output(y)
    text, weights = b.text(), b.weights()
"""

import numpy as np

from ..errors import MILError
from .blob import BlobWriter
from .ops import OPS
from .program import BlobRef, Function, Operation, Program, Var, bind, computed_from_consts
from .types import FLOAT, NUMPY, TensorType, as_value, dialect

MIL_NAMES = {np.dtype(t): name for name, t in NUMPY.items() if name != "string"}  # numpy dtype -> MIL

WEIGHTS_PREFIX = "@model_path/weights/"


class Builder:
    def __init__(self, dialect_name="ios18", float_dtype="fp16"):
        self.dialect = dialect(dialect_name)
        self.float_dtype = float_dtype          # default dtype of inputs and weights
        self.fn = Function("main", [])
        self.names = set()
        self.consts = {}
        self.blobs = {}

    def unique(self, hint):
        name, k = hint, 0
        while name in self.names:
            k += 1
            name = f"{hint}_{k}"
        self.names.add(name)
        return name

    def input(self, name, shape, dtype=None):
        if name in self.names:
            raise MILError(f"variable '{name}' is defined twice")
        self.names.add(name)
        var = Var(name, TensorType(dtype or self.float_dtype, tuple(int(d) for d in shape)))
        self.fn.inputs.append(var)
        return var

    def const(self, value, dtype, name=None, hint=None):
        """A const op holding `value` (identical unnamed constants are emitted once)."""
        arr = np.asarray(value)
        ttype = TensorType(dtype, arr.shape)
        key = (ttype, value if isinstance(value, str) else arr.astype(np.float64).tobytes())
        if name is None and key in self.consts:
            return self.consts[key]
        var = Var(self.unique(name or hint or f"c_{dtype}"), ttype, as_value(ttype, value.tolist() if
                                                                       isinstance(value, np.ndarray) else value))
        self.fn.ops.append(Operation(None, var, {}, var.name))
        self.consts.setdefault(key, var)
        return var

    def weight(self, array, file, dtype=None, name=None, emit=True):
        """A const read from BLOBFILE `@model_path/weights/<file>` (chunks append to the file).

        emit=False gives a bare literal for the attribute list of a constexpr op instead of a const op.
        """
        path, dtype = WEIGHTS_PREFIX + file, dtype or self.float_dtype
        offset = self.blobs.setdefault(path, BlobWriter()).add(np.asarray(array).astype(NUMPY[dtype]))
        var = Var(self.unique(name or file.rsplit(".", 1)[0]), TensorType(dtype, np.shape(array)),
                  blob=BlobRef(path, offset))
        if emit:
            self.fn.ops.append(Operation(None, var, {}, var.name))
        return var

    def op(self, opname, name=None, **args):
        spec = OPS.get(opname)
        if spec is None:
            raise MILError(f"unknown op '{opname}'; supported: const, {', '.join(sorted(OPS))}")
        given = [v for v in args.values() if isinstance(v, Var)]
        ready = {}
        for key, v in args.items():
            if v is None:
                continue
            if isinstance(v, (list, tuple)) and v and all(isinstance(x, Var) for x in v):
                v = tuple(v)
            elif not isinstance(v, Var) and key in spec.params:
                p = spec.params[key]
                dtype = (given[0].type.dtype if p.kind == "tensor" and given else p.dtypes[0])
                if p.kind == "const" and isinstance(v, float) and given and given[0].type.dtype in FLOAT \
                        and given[0].type.dtype in p.dtypes:
                    dtype = given[0].type.dtype      # e.g. a quantize scale in the input's precision
                elif p.kind == "const" and isinstance(v, (np.ndarray, np.generic)) \
                        and MIL_NAMES.get(v.dtype) in p.dtypes:
                    dtype = MIL_NAMES[v.dtype]       # a typed numpy value keeps its dtype, e.g. a uint8 zero_point
                v = (Var("", TensorType(dtype, np.shape(v)), as_value(TensorType(dtype, np.shape(v)), v))
                     if spec.in_attributes else self.const(v, dtype, hint=f"{name or opname}_{key}"))
            ready[key] = v
        op, out_type = bind(opname, ready, self.dialect)
        out = Var(self.unique(name or opname), out_type, from_consts=computed_from_consts(op, ready))
        self.fn.ops.append(Operation(op, out, ready, out.name))
        return out

    def __getattr__(self, opname):
        if opname in OPS:
            return lambda name=None, **args: self.op(opname, name, **args)
        raise AttributeError(opname)

    def output(self, *vars):
        self.fn.outputs = list(vars)

    def program(self):
        if not self.fn.outputs:
            raise MILError("the program has no outputs: call output(...)")
        return Program(self.dialect, {"main": self.fn})

    def text(self):
        return self.program().text()

    def weights(self):
        """The weights mapping the compiler takes: `@model_path/weights/X.bin` -> blob bytes."""
        return {path: w.to_bytes() for path, w in self.blobs.items()}
