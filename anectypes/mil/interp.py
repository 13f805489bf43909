"""Run a parsed MIL program with numpy: an execution plan built once, evaluated many times.

Precision modes (docs/ane-reference.md §3.7):
- "fp16" behaves like the hardware: every fp16 tensor holds fp16 values between ops (overflow gives
  ±inf, subnormal results are flushed to zero unless ftz=False); matmul, conv and reductions
  accumulate in fp32 and round their result to fp16.
- "fp32" stores every float tensor as fp32: fast and exact, for training speed and gradient checks.

Both modes store float tensors as float32 arrays, so ops and BLAS read them without conversion and
slices stay views. In fp16 mode an fp16 tensor's array holds exactly fp16-representable values: each
op computes in fp32 and `round_to_fp16` (anectypes/host/fp16.py) rounds its result in place. fp16
data crosses only the program boundary: float16 inputs are converted once per run into buffers and
fp16 outputs are written into float16 arrays. The simulator's surfaces skip even that: they hold fp16
values in float32 memory, read in place and written with a copy.

Planning resolves constants and BLOBFILE weights, preallocates each op's output buffer, turns slice,
reshape and transpose into numpy views, and folds `matmul -> transpose(last two axes)` into one GEMM
with swapped operands, so the reference's dynamic matmul (slice, reshape, transpose, matmul,
transpose, reshape) costs exactly one GEMM and no copies. An op whose result is a program output, or
a part of a concat, writes it straight into its place: the caller's output array, or the concat's
result, so outputs and concats cost no copies either. The graph passes that decide this are pure
functions of the program or of the plan's steps. `Plan.bind` ties a plan to fixed input and
output arrays and takes the views and each op's arguments once; a call then only computes (the
simulator binds each request at its first evaluation).
"""

from types import SimpleNamespace

import numpy as np

from ..errors import BlobError, MILError
from ..host.fp16 import Scratch, fp16_to_fp32, fp32_to_fp16, round_to_fp16
from . import blob
from .ops import REQUIRED
from .program import Operation, Var
from .types import FLOAT, NUMPY

PRECISIONS = ("fp16", "fp32")


class Arena:
    """Memory for the results ops compute inside a program, shared by plans that never run at once
    (one device's kernels): each plan lays its buffers out from its start, a buffer in the place of
    one whose last reader came before (lifetimes), and it is as large as the largest plan
    needs (stories15m's ten kernels: 7 MB instead of 51 MB). Also holds the fp16 helpers' work
    buffers."""

    ALIGN = 64

    def __init__(self):
        self.need, self.memory, self.scratch = 0, np.empty(0, np.uint8), Scratch()

    def layout(self, specs, lifetimes):
        """Byte offsets of buffers {key: (shape, dtype)} alive over steps {key: (first, last)}: a
        buffer takes the place of one of the same size whose last step came before its first;
        reserves their total."""
        offsets, free, at = {}, {}, 0
        ending = sorted((last, key) for key, (_, last) in lifetimes.items())
        for key in sorted(specs, key=lambda k: lifetimes[k][0]):
            first = lifetimes[key][0]
            while ending and ending[0][0] < first:          # places whose buffer is dead by now
                done = ending.pop(0)[1]
                free.setdefault(self.size(specs[done]), []).append(offsets[done])
            size = self.size(specs[key])
            if free.get(size):
                offsets[key] = free[size].pop()
            else:
                offsets[key], at = at, at + size
        self.need = max(self.need, at)
        return offsets

    def size(self, spec):
        shape, dtype = spec
        return -(-int(np.prod(shape)) * dtype.itemsize // self.ALIGN) * self.ALIGN

    def views(self, specs, offsets):
        """The buffers, as views of the memory (new memory if it grew since: views handed out
        before keep the old)."""
        if self.memory.size < self.need:
            self.memory = np.empty(self.need, np.uint8)
        return {key: self.memory[offsets[key]:offsets[key] + int(np.prod(shape)) * dtype.itemsize]
                .view(dtype).reshape(shape) for key, (shape, dtype) in specs.items()}


class Plan:
    """An executable form of a program's `main` function for one precision mode. Its ops' results
    live in `arena` (by default its own)."""

    def __init__(self, program, weights=None, precision="fp16", ftz=True, arena=None):
        if precision not in PRECISIONS:
            raise MILError(f"precision must be fp16 or fp32, got {precision!r}")
        self.precision, self.ftz = precision, ftz
        self.rounds = precision == "fp16"     # fp16 tensors hold fp16 values (in float32 arrays)
        self.arena = arena or Arena()
        self.scratch = self.arena.scratch
        self.weights = weights or {}
        fn = program.main
        self.inputs = {v.name: v.type for v in fn.inputs}
        self.outputs = {v.name: v.type for v in fn.outputs}
        self.slots = {}           # Var -> index into the environment list
        self.env = []
        self.buffers = {}         # env index -> (shape, dtype) of the result buffer of the op computing it
        self.strided = set()      # env indices of results that may live in a strided view
        self.steps = []
        for v in fn.inputs:
            self.slot(v)
        for o in fold_transposed_matmuls(fn):
            self.plan_op(o)
        self.in_slots = [(v.name, self.slots[v], self.storage(v.type.dtype), self.is_fp16(v.type))
                         for v in fn.inputs]
        self.in_bufs = {}        # fp16 inputs given as other data are converted into these, each run
        self.out_slots = [(v.name, self.slots[v], self.is_fp16(v.type)) for v in fn.outputs]
        bases = buffer_bases(self.steps, self.buffers)
        self.direct = direct_outputs(self.out_slots, bases)
        self.steps, self.placed = place_concat_inputs(self.steps, bases, self.buffers, self.strided,
                                                      taken=set(self.direct.values()))
        # the buffers in the arena: not those that are always parts of a concat's result
        in_concat = {src for src, *_ in self.placed}
        self.own = {i: spec for i, spec in self.buffers.items() if i not in in_concat}
        ends = [index for _, index, _ in self.out_slots]
        self.offsets = self.arena.layout(self.own, lifetimes(self.steps, self.placed, self.own, ends))

    @staticmethod
    def storage(dtype):
        """numpy dtype that holds a MIL dtype between ops: float32 for both float types."""
        return np.dtype(np.float32 if dtype in FLOAT else NUMPY[dtype])

    def is_fp16(self, ttype):
        """Whether values of this type are fp16 values (rounded after every op) in this mode."""
        return self.rounds and ttype.dtype == "fp16"

    def slot(self, var, value=None):
        self.slots[var] = len(self.env)
        self.env.append(value)
        return self.slots[var]

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
            value, dtype = self.const_value(o.out), o.out.type.dtype
            if self.is_fp16(o.out.type):
                value = np.asarray(value, np.float16)     # exactly its fp16 value
            self.slot(o.out, value if dtype == "string" else np.asarray(value, self.storage(dtype)))
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
        rounds = self.is_fp16(out_type) and op.kind != "exact"
        if op.in_attributes:                               # constexpr: folded now, like the compiler does
            out = np.empty(out_type.shape, self.storage(out_type.dtype))
            op.run(Step(o, op, const_args, tensor_args, None, False).args(self.env), out)
            if rounds:
                round_to_fp16(out, self.ftz, self.scratch)
            self.slot(o.out, out)
            return
        index = self.slot(o.out)
        if op.kind != "view":   # the result buffer: env[index] unless bind() points it at an output array
            self.buffers[index] = (out_type.shape, self.storage(out_type.dtype))
            if op.strided_out and not rounds:
                self.strided.add(index)
        self.steps.append(Step(o, op, const_args, tensor_args, index, rounds))

    def run(self, inputs, outputs=None, fp16_values=False):
        """Evaluate with `inputs` (name -> array of the declared shape).

        Results go into `outputs` (name -> array) when given, else into new arrays that are returned.
        Other data than float16 for an fp16 input is rounded to fp16 (unflushed), unless
        `fp16_values` says float32 arrays hold fp16 values already (the simulator's surfaces): those
        are read in place.
        """
        runner = self.bind(inputs, outputs, fp16_values)
        runner()
        return runner.outputs

    def bind(self, inputs, outputs=None, fp16_values=False):
        """A runner that evaluates with these input and output arrays, as run() does, each time it
        is called: views and op arguments are resolved once, here, so a call only computes (the
        simulator binds each request once). It reads the arrays' contents at each call; it serves
        one call at a time, and no two runners of a plan run at once (they share its buffers)."""
        env = list(self.env)                         # consts
        for index, buf in self.arena.views(self.own, self.offsets).items():
            env[index] = buf
        fresh, outputs = outputs is None, outputs or {}
        in_place = set()
        for name, index in self.direct.items():       # computed in place when the output array fits
            target, buf = outputs.get(name), env[index]
            if (isinstance(target, np.ndarray) and target.dtype == buf.dtype and target.size == buf.size
                    and target.flags.c_contiguous and target.flags.writeable
                    and not any(np.may_share_memory(target, x) for x in inputs.values())):
                env[index] = target.reshape(buf.shape)
                in_place.add(name)
        for src, index, part, shape in self.placed:
            env[src] = env[index][part].reshape(shape)
        converts = []                                 # (input data, float32 buffer) per call
        for name, index, dtype, fp16 in self.in_slots:
            if name not in inputs:
                raise MILError(f"missing input '{name}' (the program takes {', '.join(self.inputs)})")
            x = inputs[name]
            if tuple(np.shape(x)) != self.inputs[name].shape:
                raise MILError(f"input '{name}' has shape {list(np.shape(x))}, "
                               f"the program declares {list(self.inputs[name].shape)}")
            if fp16 and not (fp16_values and isinstance(x, np.ndarray) and x.dtype == np.float32):
                buf = self.in_bufs.get(name)
                if buf is None:
                    buf = self.in_bufs[name] = np.empty(self.inputs[name].shape, np.float32)
                converts.append((x, buf))
                env[index] = buf
            else:
                env[index] = x if isinstance(x, np.ndarray) and x.dtype == dtype else np.asarray(x, dtype)
        calls = []
        step = None
        try:
            for step in self.steps:
                if not step.is_view:
                    calls.append(step.bind(env))
                    continue
                args = step.args(env)
                value = step.impl.run(args)
                if np.may_share_memory(value, args.x):   # a view of arrays that stay: taken once
                    env[step.index] = value
                else:          # numpy copied (a reshape of a strided view): into a buffer, each call
                    env[step.index] = buf = np.empty_like(value)
                    calls.append((copy_view, (step.impl, args, buf), None, step))
        except (MILError, BlobError):
            raise
        except Exception as e:
            raise failed(step, e) from e
        finals = [(name, env[index], None if fresh else outputs[name], fp16)
                  for name, index, fp16 in self.out_slots if name not in in_place]
        return Runner(self, converts, calls, finals, outputs)


# ---------------------------------------------------------------- graph passes: pure functions

def fold_transposed_matmuls(fn):
    """fn's ops, each matmul(x, y) -> transpose(last two) rewritten as matmul(y, x) with flipped transposes."""
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


def swaps_last_two(perm, rank):
    return rank >= 2 and list(perm) == list(range(rank - 2)) + [rank - 1, rank - 2]


def buffer_bases(steps, buffers):
    """{env index: the result buffer it is, or is a reshape (of a reshape ...) of}, for each that has one:
    the op computing that buffer can write into an output array or a concat's part directly."""
    bases = {i: i for i in buffers}
    for step in steps:                         # in program order: a reshape's x comes before it
        if step.is_view and step.op.type == "reshape" and step.tensor_args["x"] in bases:
            bases[step.index] = bases[step.tensor_args["x"]]
    return bases


def direct_outputs(out_slots, bases):
    """{output name: the buffer computed straight into the caller's array} for each output that is (a
    reshape of) a result buffer that no other output is."""
    sources = [bases.get(index) for _, index, _ in out_slots]
    return {name: index for (name, _, _), index in zip(out_slots, sources)
            if index is not None and sources.count(index) == 1}


def place_concat_inputs(steps, bases, buffers, strided, taken):
    """Let the ops computing a concat's inputs write straight into their part of its result (or of
    the output array the concat writes), so the concat copies nothing. Along an axis with only 1s
    before it each part is one contiguous block, which any op can write; along another axis (RoPE's
    halves) a part is a strided view, which only an op that writes any view and rounds nothing
    afterwards (`strided`) gets. A buffer in `taken` (an output's) stays where it is. Returns the
    steps, each concat's with the copies it still makes, and the placements (input buffer, concat's
    env index, part, buffer shape) in the order bind() applies them."""
    steps, taken, placed = list(steps), set(taken), []
    for n in reversed(range(len(steps))):      # an outer concat first: it places the inner one
        o, index = steps[n].op, steps[n].index
        shape = o.out.type.shape
        if o.type != "concat" or ("interleave" in o.args and o.args["interleave"].value):
            continue
        axis = int(o.args["axis"].value) % len(shape)
        blocks = int(np.prod(shape[:axis])) == 1
        copies, at = [], 0
        for v, i in zip(o.args["values"], steps[n].tensor_args["values"]):
            part = (slice(None),) * axis + (slice(at, at + v.type.shape[axis]),)
            at += v.type.shape[axis]
            src = bases.get(i)
            if (src is None or src in taken or src == index
                    or not blocks and (src not in strided or buffers[src][0] != v.type.shape)):
                copies.append((part, i))
            else:
                taken.add(src)
                placed.append((src, index, part, buffers[src][0]))
        steps[n] = Step(o, None, {}, {}, index, False, copies)
    return steps, placed


def lifetimes(steps, placed, own, ends):
    """{buffer in `own`: (first, last)}: the steps from the first that writes it (itself, or an op
    computing a part of the concat it is) to the last that reads it or a view of it (the end of the
    run for the results in `ends`, the outputs)."""
    home = {src: index for src, index, *_ in placed}      # env index -> whose memory it is
    for step in steps:
        if step.is_view:
            home[step.index] = step.tensor_args["x"]

    def buffer(i):
        while i in home:
            i = home[i]
        return i if i in own else None
    span = {}
    for n, step in enumerate(steps):
        reads = [i for _, i in step.copies] if step.copies is not None else \
            [i for v in step.tensor_args.values() for i in (v if isinstance(v, tuple) else (v,))]
        writes = [] if step.is_view else [step.index]
        for i in map(buffer, reads + writes):
            if i is not None:
                span[i] = (span.get(i, (n, n))[0], n)
    for index in ends:
        i = buffer(index)
        if i is not None:
            span[i] = (span.get(i, (0, 0))[0], len(steps))
    return {i: span.get(i, (0, 0)) for i in own}


class Step:
    """One op of a plan: the program's operation (`op`), the registry's implementation (`impl`), its
    constant and env-index arguments, its result's env index, and whether the result is rounded to
    fp16; a concat whose parts are computed in place has `copies`, the (part, env index) pairs it
    still copies."""

    def __init__(self, op, impl, const_args, tensor_args, index, rounds, copies=None):
        self.op, self.impl, self.const_args, self.tensor_args = op, impl, const_args, tensor_args
        self.index, self.rounds, self.copies = index, rounds, copies
        self.is_view = copies is None and impl.kind == "view"      # its result is a view, taken at bind()

    def args(self, env):
        a = dict(self.const_args)
        for k, s in self.tensor_args.items():
            a[k] = [env[i] for i in s] if isinstance(s, tuple) else env[s]
        return SimpleNamespace(**a)

    def bind(self, env):
        """(function, its arguments, the result to round to fp16 or None, the step), the arguments
        taken from env now."""
        out = env[self.index]
        if self.copies is not None:
            return copy_parts, ([(out, part, env[i]) for part, i in self.copies],), None, self
        return self.impl.run, (self.args(env), out), out if self.rounds else None, self


def failed(step, e):
    """The error for an op that failed: a bug or an unforeseen input, named with the op."""
    o = step.op
    return MILError(f"evaluation failed: {type(e).__name__}: {e}", o.line, o.col, o.type)


def copy_view(op, args, out):
    np.copyto(out, op.run(args))


def copy_parts(copies):
    for out, part, value in copies:
        out[part] = value


class Runner:
    """A plan bound to its input and output arrays (Plan.bind): call it to evaluate."""

    def __init__(self, plan, converts, calls, finals, outputs):
        self.plan, self.converts, self.calls, self.finals = plan, converts, calls, finals
        self.outputs = outputs

    def __call__(self):
        plan = self.plan
        for x, buf in self.converts:
            fp16_to_fp32(x if isinstance(x, np.ndarray) and x.dtype == np.float16 else np.asarray(x, np.float16), buf)
        step = None
        try:
            for fn, args, rounded, step in self.calls:
                fn(*args)
                if rounded is not None:
                    round_to_fp16(rounded, plan.ftz, plan.scratch)
        except (MILError, BlobError):
            raise
        except Exception as e:
            raise failed(step, e) from e
        for name, value, target, fp16 in self.finals:   # target None: no output arrays given, new ones
            if fp16:                                   # fp16 values into float16 memory
                if target is None:
                    target = self.outputs[name] = np.empty(np.shape(value), np.float16)
                fp32_to_fp16(value, target, plan.scratch)
            elif target is None:
                self.outputs[name] = np.array(value)
            else:
                np.copyto(target, value, casting="same_kind")


def run(program, inputs, weights=None, precision="fp16", ftz=True):
    """One-shot convenience: plan and evaluate; returns name -> array."""
    return Plan(program, weights, precision, ftz).run(inputs)

