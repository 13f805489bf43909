"""What every device is: the Device, Kernel and Request protocols, the Surface (an fp16 [1,C,1,S] buffer a
kernel reads or writes), their allocation rules and the compile budget (see the package's docstring)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Protocol

import numpy as np

from ..errors import CompileBudgetExceeded, DeviceError
from ..host.fp16 import to_fp16
from ..mil.limits import SURFACE_ALIGN

DEFAULT_COMPILE_BUDGET = 119
MIN_SURFACE_BYTES = 49152       # smaller surfaces fail at eval with 0x1d; the ANE reads a larger
                                # surface from its start (ORION-C #4 and #12, §1.6, §1.9)


class Kernel(Protocol):
    """A compiled MIL program."""
    inputs: dict                # name -> MIL tensor type (.shape, .dtype) of each input
    outputs: dict               # and of each output
    sizes: dict                 # name -> bytes the engine touches of the tensor's surface (its BatchStride), where
                                # the device says; a surface of it is made at least that large
    layout: dict | None         # the engine's live I/O lists as the device read them ({"inputs": [...], "outputs":
                                # [...]}, ane/__init__.py live_io), else None

    def free(self) -> None: ...


class Request(Protocol):
    """A kernel bound to surfaces for its inputs and outputs; evaluate it any number of times."""

    def free(self) -> None: ...


class Device(Protocol):
    """What the model, the trainer and the CLIs use of a device: SimDevice and ANEDevice implement all of it."""
    name: str                   # "sim" or "ane"
    precision: str              # "fp16", or "fp32" (a simulator mode)
    dialect: str                # the MIL dialect its kernels are written in: "ios18", or "ios16" on M1/M2 (§3.5)
    chip: str | None            # the Neural Engine's aneSubType (e.g. "h16"); None on the simulator
    catalogue_chip: str | None  # m1..m5, whose rows of the chip catalogue apply (mil/limits.py); None: the
                                # newest chip that reads the program's dialect
    notice: str | None          # one line for the user on why open_device("auto") chose it, else None
    shares_cpu: bool            # kernels compute on the CPU cores (then the trainer does not overlap dW with them)
    compiles: int               # compiles so far; at compile_budget compile() raises CompileBudgetExceeded
    compile_budget: int

    # name: what the ANE prints before it compiles (a compile that hangs is then attributable)
    def compile(self, mil_text: str | bytes, weights: dict[str, bytes] | None = None, name: str | None = None
                ) -> Kernel: ...

    def surface(self, shape, dtype: str = "fp16", alloc: int = 0) -> Surface: ...

    def request(self, kernel: Kernel, inputs: dict[str, Surface], outputs: dict[str, Surface]) -> Request: ...

    def eval(self, request: Request) -> None: ...


def check_compile_budget(device):
    """Raise once the device's compile budget is spent (the same rule on every device, so the
    trainer's checkpoint-and-restart works whatever the backend)."""
    if device.compiles >= device.compile_budget:
        raise CompileBudgetExceeded(
            f"compile budget of {device.compile_budget} spent (the ANE compiler leaks after ~119 "
            "compiles): checkpoint and restart the process")


class Surface:
    """A tensor's memory as a numpy array: host memory (simulator) or an IOSurface's (ANE).

    The data is touched only through write()/read() or inside `with surface.writing() as a:` /
    `with surface.reading() as a:`, which hold the device's lock (an IOSurface's, §1.15) around
    the zero-copy array `a`: nothing that escapes the block may still point into it.
    `release` frees the underlying memory; `handle` is what the device binds in requests; `lock`
    (write: bool -> a context manager) guards access; `convert` (value -> the values the memory
    holds) is given where plain assignment would not store what the device stores (see SimDevice.surface).
    """

    def __init__(self, array, release=None, handle=None, convert=None, alloc=None, lock=None):
        self.array, self.nbytes, self.handle, self._release = array, array.nbytes, handle, release
        self.convert, self._lock = convert, lock
        self.alloc = alloc or array.nbytes       # bytes of the device allocation (an IOSurface's size)

    @contextmanager
    def _access(self, write):
        if self.array is None:
            raise DeviceError("the surface was freed")
        with self._lock(write) if self._lock else nullcontext():
            yield self.array

    def writing(self):
        """The array, locked for writing for the block."""
        return self._access(write=True)

    def reading(self):
        """The array, locked for reading for the block: copy out what must outlive it."""
        return self._access(write=False)

    def stored(self, value):
        """`value` as writing it stores it (in the memory's dtype): assigning the result is then exact."""
        if self.convert:
            return self.convert(value)
        return to_fp16(value) if self.array.dtype == np.float16 else np.ascontiguousarray(value, self.array.dtype)

    def write(self, value, index=...):
        """array[index] = value, converted the way the CPU converts data for the device: write
        through this, since a simulator surface may hold fp16 values in float32 memory."""
        if self.array is None:
            raise DeviceError("the surface was freed")
        shape = self.array[index].shape
        try:
            fits = np.broadcast_shapes(np.shape(value), shape) == shape
        except ValueError:
            fits = False
        if not fits:
            raise DeviceError(f"cannot write a value of shape {list(np.shape(value))} into "
                              f"{list(shape)} of the surface")
        if self.convert is None and self.array.dtype == np.float16:    # fp16 memory (the ANE's): one conversion
            with self.writing() as a:                                  # straight into the block
                to_fp16(value, a[index])
            return
        value = self.stored(value)
        with self.writing() as a:
            a[index] = value

    def read(self):
        """A copy of the contents in the tensor's format: float16 for fp16 surfaces (the simulator
        holds their fp16 values in float32 memory)."""
        with self.reading() as a:
            return np.array(a, np.float16 if self.convert else a.dtype)

    def view(self, shape):
        """The first prod(shape) elements as `shape`: the ANE reads a surface from its start (§1.6).
        A view for binding (it checks the size); its data is for the device, not the CPU."""
        if self.array is None:
            raise DeviceError("the surface was freed")
        n = int(np.prod(shape))
        if n > self.array.size:
            raise DeviceError(f"surface of {self.array.size} elements is too small for {list(shape)}")
        return self.array.reshape(-1)[:n].reshape(shape)

    def free(self):
        if self.array is not None and self._release:
            self._release()
        self.array = None


def allocation(shape, itemsize, alloc=0):
    """Bytes a device allocates for a tensor: at least `alloc`, the tensor and MIN_SURFACE_BYTES, rounded up
    to a multiple of SURFACE_ALIGN (the M5's, harmless elsewhere: §1.6)."""
    need = max(itemsize * int(np.prod(shape)), MIN_SURFACE_BYTES, int(alloc))
    return -(-need // SURFACE_ALIGN) * SURFACE_ALIGN


def check_uniform(surfaces, what):
    """One request's inputs (and its outputs) must share one allocation size: mixed sizes are
    reported to fail with status 0x1d (§1.9). The same rule on every device, so what runs on the
    simulator runs on the ANE."""
    sizes = {n: s.alloc for n, s in surfaces.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"'{n}' {b} bytes" for n, b in sorted(sizes.items()))
        raise DeviceError(f"the {what}s of one request must have equal allocation sizes (mixed sizes fail "
                          f"with status 0x1d); got {listed}: make the surfaces with surface(shape, alloc=...)")


def surfaces(device, types, sizes=None):
    """Surfaces for one request's inputs (or outputs), {name: MIL tensor type}, sharing one
    allocation size: the largest any of them needs (`sizes`: a kernel's, Kernel.sizes)."""
    size = lambda n, t: allocation(t.shape, 4 if t.dtype == "fp32" else 2, (sizes or {}).get(n, 0))
    alloc = max(size(n, t) for n, t in types.items())
    return {n: device.surface(t.shape, t.dtype, alloc) for n, t in types.items()}
