"""python -m anectypes.doctor — what this machine can do, checked for real.

Reports the OS and chip, the Objective-C runtime, the AppleNeuralEngine framework and its classes,
the MIL dialect chosen; then compiles a small kernel on the ANE, runs it next to the simulator on the
same inputs, prints the largest difference and the eval latency. Without an ANE it says why and
that the simulator will be used. `--json` prints the same as one JSON object (paste it in a report).
"""

import json
import platform
import statistics
import sys
import time

import numpy as np

from . import __version__
from .host import blas, fp16
from .cli import ArgumentParser, at_least, quiet_on_closed_stdout
from .device import ane, open_device
from .device.ane import CLASSES, available, objc
from .errors import AnectypesError
from .model.kernels import dynamic_matmul_kernel

IC, OC, SEQ = 256, 256, 128   # a dynamic matmul with 64 KB+ surfaces, above the ANE's minimum sizes (§3.6)


def check_kernel(backend, x, reps):
    """Compile and evaluate the test kernel; returns (output, median ms, p99 ms)."""
    dev = open_device(backend)
    k = dev.compile(dynamic_matmul_kernel(IC, OC, SEQ, dev.dialect).text())
    xs, ys = dev.surface([1, IC, 1, SEQ + OC]), dev.surface([1, OC, 1, SEQ])
    xs.write(x)
    req = dev.request(k, {"x": xs}, {"mm_y": ys})
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dev.eval(req)
        times.append((time.perf_counter() - t0) * 1e3)
    out = ys.read().astype(np.float64)
    k.free()
    xs.free()
    ys.free()
    return out, statistics.median(times[1:]), float(np.percentile(times[1:], 99))


def host_warnings():
    """What to fix before this Python can use the ANE of a Mac (nothing elsewhere)."""
    if sys.platform == "darwin" and (ane.rosetta() or ane.MACHINE != "arm64"):
        return ["this Python is an x86_64 build (under Rosetta, or an Intel Mac): on Apple Silicon the ANE needs an "
                "arm64 Python 3.10 or newer (see the README's \"On a Mac\")"]
    return []


def diagnose(reps=50):
    r = dict(anectypes=__version__, os=f"{platform.system()} {platform.release()}", machine=platform.machine(),
             python=platform.python_version(), numpy=np.__version__, warnings=host_warnings())
    if sys.platform == "darwin":
        r["macos"] = platform.mac_ver()[0]
        r["rosetta"] = ane.rosetta()
    try:
        r["blas"] = f"{blas.library_path()} ({blas.corename()})"
    except AnectypesError as e:
        r["blas"] = f"unavailable: {e}"
    # how the simulator's fp16 mode flushes subnormals: the SSE unit's modes (x86-64 glibc) or a mask
    r["fp16_rounding"] = "sse-modes" if fp16.FENV else "mask"
    try:
        r["objc_runtime"] = objc.runtime().kind
    except AnectypesError as e:
        r["objc_runtime"] = f"unavailable: {e}"
    ok, info = available()
    r["classes"] = {c: bool(r["objc_runtime"] in ("apple", "gnu") and objc.cls(c)) for c in CLASSES}
    x = np.random.default_rng(0).standard_normal((1, IC, 1, SEQ + OC)).astype(np.float16) * 0.5
    sim_out, sim_ms, sim_p99 = check_kernel("sim", x, reps)
    r["simulator"] = dict(eval_ms_median=round(sim_ms, 4), eval_ms_p99=round(sim_p99, 4))
    if not ok:
        r["ane"] = dict(available=False, reason=info, verdict="the simulator will be used")
        return r
    dev = open_device("ane")
    r["ane"] = dict(available=True, chip=info, dialect=dev.dialect)
    try:
        out, ms, p99 = check_kernel("ane", x, reps)
        r["ane"].update(max_abs_diff_vs_simulator=float(np.abs(out - sim_out).max()),
                        eval_ms_median=round(ms, 4), eval_ms_p99=round(p99, 4))
    except AnectypesError as e:
        r["ane"].update(error=str(e))
    return r


@quiet_on_closed_stdout
def main(argv=None):
    ap = ArgumentParser(prog="python -m anectypes.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ap.add_argument("--reps", type=at_least(1), default=50, help="evaluations timed per backend (default 50)")
    args = ap.parse_args(argv)
    r = diagnose(args.reps)
    if args.json:
        print(json.dumps(r))
        return 0
    for key in ("anectypes", "os", "macos", "machine", "rosetta", "python", "numpy", "blas", "fp16_rounding",
                "objc_runtime"):
        if key in r:
            print(f"{key:14s} {r[key]}")
    for warning in r["warnings"]:
        print(f"warning: {warning}")
    for c, present in r["classes"].items():
        print(f"{'class':14s} {c}: {'present' if present else 'missing'}")
    s = r["simulator"]
    print(f"{'simulator':14s} dynamic matmul {IC}x{SEQ}·{IC}x{OC}: eval {s['eval_ms_median']} ms median, "
          f"{s['eval_ms_p99']} ms p99")
    a = r["ane"]
    if not a["available"]:
        print(f"{'ANE':14s} not available: {a['reason']}\n{'':14s} {a['verdict']}")
    elif "error" in a:
        print(f"{'ANE':14s} chip {a['chip']}, dialect {a['dialect']}: FAILED: {a['error']}")
    else:
        print(f"{'ANE':14s} chip {a['chip']}, dialect {a['dialect']}: max |ANE - simulator| = "
              f"{a['max_abs_diff_vs_simulator']:.3g}; eval {a['eval_ms_median']} ms median, {a['eval_ms_p99']} ms p99")
    return 0


if __name__ == "__main__":
    sys.exit(main())
