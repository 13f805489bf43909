"""The timing harness: wall-clock times of repeated calls, and of a MIL program's evaluations on a device."""

import statistics
import time

import numpy as np

TIMING_BYTES = 64           # what each timed eval keeps: two floats (its time and its ms_all copy) in lists


def timed(fn, reps, warmup):
    """Call fn() warmup + reps times; the times of the last reps calls, in ms."""
    times = []
    for i in range(warmup + reps):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return times


def timing(times):
    return dict(ms_median=statistics.median(times), ms_p99=float(np.percentile(times, 99)), ms_min=min(times),
                ms_all=[round(t, 4) for t in times])


def measure(dev, builder, x, reps, warmup):
    """Compile `builder`'s program, evaluate it warmup + reps times on input `x` (the "x" input) and
    return (output as float64, eval times in ms of the timed reps, compile seconds)."""
    t0 = time.perf_counter()
    kernel = dev.compile(builder.text(), builder.weights())
    compile_s = time.perf_counter() - t0
    (in_name, in_type), = kernel.inputs.items()
    (out_name, out_type), = kernel.outputs.items()
    xs, ys = dev.surface(in_type.shape), dev.surface(out_type.shape)
    req = None
    try:
        xs.write(x)
        req = dev.request(kernel, {in_name: xs}, {out_name: ys})
        times = timed(lambda: dev.eval(req), reps, warmup)
        out = ys.read().astype(np.float64)
    finally:
        if req is not None:
            req.free()
        kernel.free()
        xs.free()
        ys.free()
    return out, times, compile_s
