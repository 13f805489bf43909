"""The simulator device: runs the same MIL text as the ANE with the numpy interpreter."""

import threading

import numpy as np

from ..errors import AnectypesError, DeviceError, MILError
from ..host.fp16 import Scratch, round_to_fp16
from ..mil import interp, limits, parse
from .protocol import (DEFAULT_COMPILE_BUDGET, Device, Kernel, Request, Surface, allocation, check_compile_budget,
               check_uniform)


class SimKernel(Kernel):
    sizes, layout = {}, None    # the simulator reads and writes the tensors packed, from the surface's start

    def __init__(self, plan, lock):
        self.plan = plan
        self.inputs, self.outputs = plan.inputs, plan.outputs
        self.lock = lock   # the device's: its kernels' buffers share one arena, one evaluation at a time

    def free(self):
        self.plan = None


class SimRequest(Request):
    def __init__(self, kernel, inputs, outputs):
        self.kernel = kernel
        for n, s in inputs.items():      # the interpreter reads fp16 inputs in place: they must hold fp16 values
            if n in kernel.inputs and kernel.plan.is_fp16(kernel.inputs[n]) and s.convert is None:
                raise DeviceError(f"input '{n}' is fp16: bind a surface made with dtype fp16")
        self.inputs = {n: bind(s, kernel.inputs, n, "input") for n, s in inputs.items()}
        self.outputs = {n: bind(s, kernel.outputs, n, "output") for n, s in outputs.items()}
        for names, bound, what in ((kernel.inputs, self.inputs, "input"), (kernel.outputs, self.outputs, "output")):
            missing = sorted(set(names) - set(bound))
            if missing:
                raise DeviceError(f"request does not bind {what} '{missing[0]}' of the kernel")
        check_uniform(inputs, "input")
        check_uniform(outputs, "output")
        self.runner = None                  # the kernel's plan bound to these arrays, at the first eval

    def free(self):
        self.inputs = self.outputs = {}          # host memory: nothing to release but the views
        self.runner = None


def bind(surface, declared, name, what):
    if name not in declared:
        raise DeviceError(f"the kernel has no {what} named '{name}' (it has {', '.join(declared)})")
    try:
        return surface.view(declared[name].shape)
    except DeviceError as e:
        raise DeviceError(f"{what} '{name}': {e}") from None


class SimDevice(Device):
    name, notice = "sim", None
    shares_cpu = True              # kernels compute on the CPU cores

    def __init__(self, precision="fp16", compile_budget=DEFAULT_COMPILE_BUDGET, ftz=True, dialect=None, chip=None):
        """chip: simulate the limits of m1..m5 (mil/limits.py), which also picks the dialect; by default
        the newest chip of the dialect (ios18 unless given)."""
        if precision not in interp.PRECISIONS:
            raise DeviceError(f"precision must be fp16 or fp32, got {precision!r}")
        if chip is not None and chip not in limits.CHIPS:
            raise DeviceError(f"unknown chip {chip!r}; choose one of {', '.join(limits.CHIPS)}")
        self.chip, chip_dialect = limits.CHIPS[chip] if chip else (None, None)   # chip: the aneSubType
        self.catalogue_chip = chip
        if chip_dialect and dialect and dialect != chip_dialect:
            raise DeviceError(f"{chip} reads the {chip_dialect} dialect, not {dialect}")
        self.precision, self.ftz, self.dialect = precision, ftz, dialect or chip_dialect or "ios18"
        self.compile_budget, self.compiles = compile_budget, 0
        self.scratch = threading.local()          # work buffers of surface writes, per thread (staging runs on several)
        self.arena = interp.Arena()               # the kernels' intermediate results: one kernel runs at a time
        self.lock = threading.Lock()

    def compile(self, mil_text, weights=None, name=None):       # name: unused, no simulator compile hangs
        check_compile_budget(self)
        try:
            program = parse(mil_text)
            limits.enforce(program, self.catalogue_chip or limits.NEWEST[program.dialect.name])
            plan = interp.Plan(program, weights or {}, self.precision, self.ftz, self.arena)
        except MILError as e:                  # keep line, col and op for the caller
            raise MILError(f"compile failed: {e.reason}", e.line, e.col, e.op) from None
        except AnectypesError as e:
            raise type(e)(f"compile failed: {e}") from None
        self.compiles += 1                      # only compiles that succeed count on the simulator
        return SimKernel(plan, self.lock)

    def surface(self, shape, dtype="fp16", alloc=0):
        """A surface for a tensor of `shape`, always float32 memory: the interpreter's format, so kernels
        read inputs and write outputs without conversion. In fp16 mode an fp16 surface holds fp16
        values: `Surface.write` rounds what it stores (to nearest even, subnormals kept, like the CPU's
        fp32 -> fp16 conversion), and data written through `writing()` must be fp16 values already.
        `alloc` and the size floor set the allocation size the ANE would give it (only checked here:
        the memory is the tensor's)."""
        holds_fp16 = dtype == "fp16" and self.precision == "fp16"
        return Surface(np.zeros(tuple(shape), np.float32), convert=self.to_fp16 if holds_fp16 else None,
                       alloc=allocation(shape, 2 if dtype == "fp16" else 4, alloc))

    def to_fp16(self, value):
        """A C-contiguous float32 copy of `value` rounded in place to fp16 values (rounding the copy,
        not a strided block of the surface, whose passes would not run on contiguous memory)."""
        value = np.array(value, np.float32, order="C")
        if not hasattr(self.scratch, "buffers"):
            self.scratch.buffers = Scratch()
        round_to_fp16(value, ftz=False, scratch=self.scratch.buffers)
        return value

    def request(self, kernel, inputs, outputs):
        return SimRequest(kernel, inputs, outputs)

    def eval(self, request):
        k = request.kernel
        if k.plan is None:
            raise DeviceError("the kernel was freed")
        with k.lock:
            if request.runner is None:     # bound at its first evaluation: later ones only compute
                request.runner = k.plan.bind(request.inputs, request.outputs, fp16_values=True)
            request.runner()
