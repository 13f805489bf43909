"""Devices run MIL kernels. Every device offers the same small protocol:

    dev = open_device("sim", precision="fp16")
    kernel = dev.compile(mil_text, weights)          # weights: "@model_path/weights/X.bin" -> blob bytes
    xs, ys = dev.surface(kernel.inputs["x"].shape), dev.surface(kernel.outputs["y"].shape)
    xs.array[...] = data                              # a zero-copy numpy view, [1,C,1,S] channel-first
    req = dev.request(kernel, inputs={"x": xs}, outputs={"y": ys})   # many requests per kernel are fine
    dev.eval(req)                                     # ys.array now holds the result
    kernel.free(); xs.free(); ys.free()

`dev.compiles` counts compiles; once `dev.compile_budget` is spent, compile() raises
CompileBudgetExceeded (the real ANE compiler leaks and fails after about 119 compiles, §1.11).
"""

from ..errors import CompileBudgetExceeded, DeviceError

DEFAULT_COMPILE_BUDGET = 119
BACKENDS = ("sim",)


def open_device(backend="sim", **options):
    """Open a device by backend name; options go to its constructor."""
    if backend == "sim":
        from .sim import SimDevice
        return SimDevice(**options)
    raise DeviceError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")


__all__ = ["open_device", "CompileBudgetExceeded", "DeviceError", "DEFAULT_COMPILE_BUDGET", "BACKENDS"]
