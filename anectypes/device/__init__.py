"""Devices run MIL kernels: the simulator (sim.py) and the Apple Neural Engine (ane/), each a `Device`:

    dev = open_device("sim", precision="fp16")
    kernel = dev.compile(mil_text, weights)          # weights: "@model_path/weights/X.bin" -> blob bytes
    xs, ys = dev.surface(kernel.inputs["x"].shape), dev.surface(kernel.outputs["y"].shape)
    xs.write(data)                                    # or `with xs.writing() as a:` a zero-copy [1,C,1,S] view
    # one request's inputs must share one allocation size, as must its outputs: surface(shape, alloc=bytes),
    # or surfaces(dev, kernel.inputs, kernel.sizes) makes them all
    req = dev.request(kernel, inputs={"x": xs}, outputs={"y": ys})   # many requests per kernel are fine
    dev.eval(req)                                     # ys.read() (or `with ys.reading() as a:`) has the result
    kernel.free(); xs.free(); ys.free()

`dev.compiles` counts compiles; once `dev.compile_budget` is spent, compile() raises
CompileBudgetExceeded (the real ANE compiler leaks and fails after about 119 compiles, §1.11).
"""

from ..errors import DeviceError
from ..mil.types import DIALECTS
from .protocol import Device

BACKENDS = ("auto", "sim", "ane")


def add_dialect_flag(ap):
    """--dialect, on every command that compiles kernels of its own for a device (train, bench, doctor)."""
    ap.add_argument("--dialect", choices=sorted(DIALECTS),
                    help="the MIL dialect of the kernels: ios16 (program(1.0), which M1 and M2 read) or ios18 "
                         "(program(1.3), M3 and newer) (default: on the ANE the chip's, by the family of its "
                         "aneSubType, unless ANECTYPES_DIALECT names one; on the simulator ios18, or --chip's)")


def open_device(backend="sim", **options) -> Device:
    """Open a device by backend name; options go to its constructor.

    "auto" opens the ANE when its framework and classes are present, else the simulator; the
    returned device then carries a one-line `notice` saying why, for the caller to show.
    """
    if backend == "sim":
        from .sim import SimDevice
        return SimDevice(**options)
    if backend == "ane":
        from .ane import ANEDevice
        return ANEDevice(**options)
    if backend == "auto":
        from .ane import available
        ok, why = available()
        if ok and options.get("precision", "fp16") == "fp16":
            if options.get("chip"):
                raise DeviceError(f"a chip's limits are simulated, but backend auto uses this Mac's ANE ({why}): "
                                  "choose backend sim to simulate a chip")
            return open_device("ane", **options)
        device = open_device("sim", **options)
        device.notice = (f"backend auto: using the simulator ({why})" if not ok else
                         "backend auto: using the simulator (fp32 precision is a simulator mode)")
        return device
    raise DeviceError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")


