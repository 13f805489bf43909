"""The programs the doctor compiles, and how one is evaluated and compared with the simulator.

`trivial` is one op; `control` is the reference's own woFwd kernel for Stories110M, verbatim
(`reference_wofwd.mil`, maderix/ANE's `gen_dyn_matmul_mil(768, 768, 256)`), so a failure that the
reference's program shares is the machine's, not our MIL's; `binding` has two inputs declared in the
other order than the alphabetical one the engine binds by (docs/ane-reference.md §1.9), so a wrong
binding shows as a result with its inputs swapped; `odd` has an input 33 values wide, not a multiple of 32, where an
engine that pads rows reads other values than the packed ones written (docs/ane-reference.md §1.6); `kernel NAME` is one of the ten training kernels.
"""

import statistics
import time
from importlib.resources import files
from typing import NamedTuple

import numpy as np

from ..device.protocol import surfaces
from ..mil import DIALECTS, Builder, parse
from ..model.kernels import KERNELS

CONTROL = "reference_wofwd.mil"
TOLERANCE = 0.05          # a result further from the simulator's than 5% of its largest magnitude is wrong


class Program(NamedTuple):
    text: str
    weights: dict          # "@model_path/weights/X.bin" -> blob
    inputs: dict           # input name -> shape, in declared order


def trivial(dialect):
    b = Builder(dialect)
    x = b.input("x", [1, 64, 1, 64])
    b.output(b.add(x=x, y=x, name="y"))
    return b.program()


def control(dialect):
    """The reference's text as it wrote it; for a chip of the other dialect, its ops in that dialect's spelling."""
    program = parse(files(__package__).joinpath(CONTROL).read_text())
    if program.dialect.name != dialect:
        program.dialect, program.version = DIALECTS[dialect], None
    return program


def binding(dialect):
    """y = a − b with b declared first: bound in declared order instead, the result is b − a."""
    b = Builder(dialect)
    second = b.input("b", [1, 64, 1, 64])
    first = b.input("a", [1, 64, 1, 64])
    b.output(b.sub(x=first, y=second, name="y"))
    return b.program()


def odd(dialect):
    """y = x · 2 with x [1, 64, 1, 33]: packed, channel c starts at value 33·c; padded to 64 bytes, at 64·c."""
    b = Builder(dialect)
    b.output(b.mul(x=b.input("x", [1, 64, 1, 33]), y=2.0, name="y"))
    return b.program()


def build(probe, cfg, dialect):
    """The Program a probe compiles ("trivial", "control", "binding", "odd" or "kernel NAME") in `dialect`."""
    if probe.startswith("kernel "):
        k = KERNELS[probe.split()[1]](cfg, dialect)
        return Program(k.text, k.weights, dict(k.in_shapes))
    program = {"trivial": trivial, "control": control, "binding": binding, "odd": odd}[probe](dialect)     # none has weights
    return Program(program.text(), {}, {v.name: v.type.shape for v in program.main.inputs})


def random_inputs(program, seed=0):
    """Random inputs of magnitude 0.25 to ~2 and either sign: none near zero, since the training kernels' norms take
    a first scale from their inputs (kernels.rmsnorm) and one near zero leaves nothing to normalize."""
    rng = np.random.default_rng(seed)
    return {n: (np.sign(rng.standard_normal(shape)) * (0.25 + np.abs(rng.standard_normal(shape)) * 0.5))
            .astype(np.float16) for n, shape in program.inputs.items()}


def evaluate(dev, program, inputs, reps=0):
    """Compile on `dev`, evaluate once more than `reps` times; ({output: fp16 array}, [ms of each timed eval],
    the engine's live I/O lists or None: Kernel.layout)."""
    kernel = dev.compile(program.text, program.weights)
    ins = outs = request = None
    try:
        ins, outs = surfaces(dev, kernel.inputs, kernel.sizes), surfaces(dev, kernel.outputs, kernel.sizes)
        for name, s in ins.items():
            s.write(inputs[name])
        request = dev.request(kernel, ins, outs)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            dev.eval(request)
            times.append((time.perf_counter() - t0) * 1e3)
        return {n: s.read() for n, s in outs.items()}, times[1:], kernel.layout
    finally:
        if request is not None:
            request.free()
        kernel.free()
        for s in [*(ins or {}).values(), *(outs or {}).values()]:
            s.free()


def timing(times):
    return dict(eval_ms_median=round(statistics.median(times), 4),
                eval_ms_p99=round(float(np.percentile(times, 99)), 4)) if times else {}


def difference(got, want):
    """How far the device's outputs are from the simulator's: the largest absolute difference, that as a
    fraction of the simulator's largest magnitude, and whether both are finite in the same places."""
    got = np.concatenate([got[n].astype(np.float64).ravel() for n in sorted(want)])
    want = np.concatenate([want[n].astype(np.float64).ravel() for n in sorted(want)])
    same_finite = bool(np.array_equal(np.isfinite(got), np.isfinite(want)))
    both = np.isfinite(got) & np.isfinite(want)
    max_abs = float(np.abs(got[both] - want[both]).max()) if both.any() else 0.0
    scale = float(np.abs(want[both]).max()) if both.any() else 0.0
    return dict(max_abs=max_abs, relative=max_abs / scale if scale else 0.0, same_finite=same_finite)


def wrong(diff):
    return not diff["same_finite"] or diff["relative"] > TOLERANCE
