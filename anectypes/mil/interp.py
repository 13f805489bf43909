"""Run a parsed MIL program with numpy: an execution plan built once, evaluated many times.

Precision modes (ane-reference.md §3.7):
- "fp16" behaves like the hardware: every fp16 tensor is stored as fp16 between ops (overflow gives
  ±inf, subnormal results are flushed to zero unless ftz=False); matmul, conv and reductions
  accumulate in fp32 and round their result to fp16.
- "fp32" stores every float tensor as fp32: fast and exact, for training speed and gradient checks.

Planning resolves constants and BLOBFILE weights, preallocates each op's output buffer, turns slice,
reshape and transpose into numpy views, and folds `matmul -> transpose(last two axes)` into one GEMM
with swapped operands, so the reference's dynamic matmul (slice, reshape, transpose, matmul,
transpose, reshape) costs exactly one GEMM and no copies beyond fp16 conversion.
"""

from types import SimpleNamespace

import numpy as np

from ..errors import BlobError, MILError
from . import blob
from .ops import REQUIRED
from .program import Operation, Var
from .types import FLOAT, NUMPY

PRECISIONS = ("fp16", "fp32")


def round_to_fp16(src, dst, ftz=True):
    """dst (fp16) = src rounded to nearest even, overflow to ±inf, subnormals flushed if ftz."""
    with np.errstate(over="ignore"):
        np.copyto(dst, src, casting="same_kind")
    if ftz:
        bits = dst.view(np.uint16)
        bits &= np.where(bits & 0x7C00, np.uint16(0xFFFF), np.uint16(0x8000))  # exponent 0 -> ±0


class Plan:
    """An executable form of a program's `main` function for one precision mode."""

    def __init__(self, program, weights=None, precision="fp16", ftz=True):
        if precision not in PRECISIONS:
            raise MILError(f"precision must be fp16 or fp32, got {precision!r}")
        self.precision, self.ftz = precision, ftz
        self.weights = weights or {}
        fn = program.main
        self.inputs = {v.name: v.type for v in fn.inputs}
        self.outputs = {v.name: v.type for v in fn.outputs}
        self.slots = {}           # Var -> index into the environment list
        self.env = []
        self.steps = []
        for v in fn.inputs:
            self.slot(v)
        ops = self.fold_transposed_matmuls(fn)
        for o in ops:
            self.plan_op(o)
        self.in_slots = [(v.name, self.slots[v], self.storage(v.type.dtype)) for v in fn.inputs]
        self.out_slots = [(v.name, self.slots[v]) for v in fn.outputs]

    def storage(self, dtype):
        """numpy dtype that holds a MIL dtype between ops in this precision mode."""
        return np.dtype(np.float32 if dtype == "fp16" and self.precision == "fp32" else NUMPY[dtype])

    def slot(self, var, value=None):
        self.slots[var] = len(self.env)
        self.env.append(value)
        return self.slots[var]

    def fold_transposed_matmuls(self, fn):
        """Rewrite matmul(x, y) -> transpose(last two) as matmul(y, x) with flipped transposes."""
        users = {}
        for o in fn.ops:
            for v in o.args.values():
                for x in v if isinstance(v, tuple) else (v,):
                    users.setdefault(x, []).append(o)
        outputs, ops, folded = set(fn.outputs), [], {}
        for o in fn.ops:
            if o in folded:
                ops.append(folded.pop(o))
                continue
            u = users.get(o.out, [])
            if (o.type == "matmul" and o.out not in outputs and len(u) == 1 and u[0].type == "transpose"
                    and swaps_last_two(u[0].args["perm"].value, o.out.type.rank)):
                a = o.args
                tx = bool(a["transpose_x"].value) if "transpose_x" in a else False
                ty = bool(a["transpose_y"].value) if "transpose_y" in a else False
                flags = {k: Var(k, None, not f) for k, f in (("transpose_x", ty), ("transpose_y", tx))}
                folded[u[0]] = Operation(o.op, u[0].out, dict(x=a["y"], y=a["x"], **flags), o.name, o.line, o.col)
                continue
            ops.append(o)
        return ops

    def const_value(self, var):
        """The stored value of a const variable (reading its BLOBFILE chunk if it has one)."""
        if var.blob is None:
            return var.value
        b = var.blob
        if b.path not in self.weights:
            have = ", ".join(sorted(self.weights)) or "none"
            raise BlobError(f"BLOBFILE {b.path} is not in the weights mapping (have: {have})")
        try:
            return blob.read_chunk(self.weights[b.path], b.offset, var.type.dtype, var.type.shape)
        except BlobError as e:  # say which const and file: a program may read many chunks
            what = f"const '{var.name}' " if var.name else ""
            raise BlobError(f"{what}BLOBFILE {b.path}: {e}") from None

    def plan_op(self, o):
        if o.op is None:                                   # const: stored once, in storage precision
            value = self.const_value(o.out)
            stored = value if o.out.type.dtype == "string" else np.asarray(value, self.storage(o.out.type.dtype))
            self.slot(o.out, stored)
            return
        op, out_type = o.op, o.out.type
        const_args, tensor_args = {}, {}
        for pname, p in op.params.items():
            v = o.args.get(pname)
            if v is None:
                const_args[pname] = None if p.default is REQUIRED else p.default
            elif p.kind == "const":
                const_args[pname] = self.const_value(v) if v.blob else v.value
            else:
                tensor_args[pname] = tuple(self.slots[x] for x in v) if isinstance(v, tuple) else self.slots[v]
        env = self.env

        def gather():
            a = dict(const_args)
            for k, s in tensor_args.items():
                a[k] = [env[i] for i in s] if isinstance(s, tuple) else env[s]
            return SimpleNamespace(**a)

        store_dtype = self.storage(out_type.dtype)
        if op.in_attributes:                               # constexpr: folded now, like the compiler does
            buf = np.empty(out_type.shape, np.float32 if out_type.dtype in FLOAT else store_dtype)
            op.run(gather(), buf)
            stored = buf if buf.dtype == store_dtype else np.empty(out_type.shape, store_dtype)
            self.slot(o.out, self.store(buf, stored))     # rounds only into fp16 storage, like compute ops
            return
        index = self.slot(o.out)
        if op.kind == "view":
            def step():
                env[index] = op.run(gather())
        elif op.kind == "exact":
            out = np.empty(out_type.shape, store_dtype)

            def step():
                op.run(gather(), out)
                env[index] = out
        else:
            compute = np.empty(out_type.shape, np.float32 if out_type.dtype in FLOAT else store_dtype)
            stored = compute if compute.dtype == store_dtype else np.empty(out_type.shape, store_dtype)

            def step():
                op.run(gather(), compute)
                env[index] = self.store(compute, stored)
        step.op = o
        self.steps.append(step)

    def store(self, compute, stored):
        if stored is not compute:
            round_to_fp16(compute, stored, self.ftz)
        return stored

    def run(self, inputs, outputs=None):
        """Evaluate with `inputs` (name -> array of the declared shape).

        Results go into `outputs` (name -> array) when given, else into new arrays that are returned.
        """
        env = self.env
        for name, index, dtype in self.in_slots:
            if name not in inputs:
                raise MILError(f"missing input '{name}' (the program takes {', '.join(self.inputs)})")
            x = inputs[name]
            if tuple(np.shape(x)) != self.inputs[name].shape:
                raise MILError(f"input '{name}' has shape {list(np.shape(x))}, "
                               f"the program declares {list(self.inputs[name].shape)}")
            env[index] = x if isinstance(x, np.ndarray) and x.dtype == dtype else np.asarray(x, dtype)
        for step in self.steps:
            try:
                step()
            except (MILError, BlobError):
                raise
            except Exception as e:  # a bug or an unforeseen input: name the op that failed
                o = step.op
                raise MILError(f"evaluation failed: {type(e).__name__}: {e}", o.line, o.col, o.type) from e
        if outputs is None:
            return {name: np.array(env[index]) for name, index in self.out_slots}
        for name, index in self.out_slots:
            np.copyto(outputs[name], env[index], casting="same_kind")
        return outputs


def swaps_last_two(perm, rank):
    return rank >= 2 and list(perm) == list(range(rank - 2)) + [rank - 1, rank - 2]


def run(program, inputs, weights=None, precision="fp16", ftz=True):
    """One-shot convenience: plan and evaluate; returns name -> array."""
    return Plan(program, weights, precision, ftz).run(inputs)

