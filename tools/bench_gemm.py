"""Simulator GEMM throughput on the reference's dynamic matmul, next to numpy.matmul in the same run.

    python tools/bench_gemm.py [--ic 768 --seq 256 --oc 2048] [--reps 20] [--json]

The kernel is the §3.4 dynamic matmul: input [1, IC, 1, SEQ+OC] holding the activation and the
IC×OC weight, output [1, OC, 1, SEQ] = Wᵀ·x. Times are per eval (median over --reps), including
the simulator's fp16 conversions in fp16 mode. These are simulator figures, not ANE figures.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from anectypes import blas  # noqa: E402
from anectypes.device import open_device  # noqa: E402
from anectypes.model.kernels import dynamic_matmul_kernel  # noqa: E402


def median_ms(fn, reps):
    fn()  # warm-up: first-touch of buffers, thread pools
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def simulator_eval(precision, x, ic, oc, seq):
    dev = open_device("sim", precision=precision)
    kernel = dev.compile(dynamic_matmul_kernel(ic, oc, seq).text())
    xs, ys = dev.surface([1, ic, 1, seq + oc]), dev.surface([1, oc, 1, seq])
    xs.write(x)
    req = dev.request(kernel, {"x": xs}, {"mm_y": ys})
    return (lambda: dev.eval(req)), ys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ic", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--oc", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    ic, seq, oc = args.ic, args.seq, args.oc
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, ic, 1, seq + oc)).astype(np.float32) * 0.1
    act, w = x[0, :, 0, :seq], x[0, :, 0, seq:]
    flops = 2.0 * ic * seq * oc
    a32, w32 = np.ascontiguousarray(act), np.ascontiguousarray(w)
    # numpy first: its BLAS threads are still cold, so any cost of two thread pools falls on us
    rows = [("numpy.matmul fp32", median_ms(lambda: np.matmul(w32.T, a32), args.reps), 0.0)]
    for precision in ("fp32", "fp16"):
        run, ys = simulator_eval(precision, x, ic, oc, seq)
        ms = median_ms(run, args.reps)
        ref = w.astype(np.float64).T @ act.astype(np.float64)
        err = float(np.abs(ys.array[0, :, 0, :] - ref).max() / np.abs(ref).max())
        rows.append((f"simulator {precision}", ms, err))
    result = dict(shape=dict(ic=ic, seq=seq, oc=oc), gflop=flops / 1e9, blas=blas.corename(),
                  blas_threads=blas.get_num_threads(),
                  runs={name: dict(ms=round(ms, 3), gflops=round(flops / ms / 1e6, 1), max_rel_err=err)
                        for name, ms, err in rows})
    if args.json:
        print(json.dumps(result))
        return
    base = rows[0][1]
    print(f"dynamic matmul [{ic}x{seq}] x [{ic}x{oc}] -> [{oc}x{seq}], {flops / 1e9:.3f} GFLOP, "
          f"BLAS {result['blas']} ({result['blas_threads']} threads), median of {args.reps}")
    print(f"{'':22s}{'ms':>9s}{'GFLOP/s':>10s}{'vs numpy':>10s}{'max rel err':>13s}")
    for name, ms, err in rows:
        print(f"{name:22s}{ms:9.2f}{flops / ms / 1e6:10.1f}{ms / base:9.2f}x{err:13.2e}")


if __name__ == "__main__":
    main()
