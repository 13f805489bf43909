"""gemm: the simulator's dynamic matmul (docs/ane-reference.md §3.4) next to numpy.matmul on the same
shapes in the same run.

The kernel's input [1, IC, 1, SEQ+OC] holds the activation and the IC×OC weight; its output
[1, OC, 1, SEQ] = Wᵀ·x. Times are per eval, the median of --reps after one warm-up, and include the
simulator's fp16 conversions in fp16 mode: simulator figures, not ANE figures.
"""

import statistics

import numpy as np

from ..host import blas
from ..device import open_device
from ..model.kernels import dynamic_matmul_kernel
from .table import Column, table
from .timing import timed

SHAPE = dict(ic=768, seq=256, oc=2048)
COLUMNS = [Column("", 22, "s", lambda r: r[0], "<"),
           Column("ms", 9, ".2f", lambda r: r[1]["ms_median"]),
           Column("GFLOP/s", 10, ".1f", lambda r: r[1]["gflops"]),
           Column("vs numpy", 10, "s", lambda r: f"{r[1]['vs_numpy']:.2f}x"),
           Column("max rel err", 13, ".2e", lambda r: r[1]["max_rel_err"])]


def gemm_bytes(ic, seq, oc):
    """At least what the benchmark holds: the fp32 input [1, IC, 1, SEQ+OC] and the float64 reference [OC, SEQ]."""
    return 4 * ic * (seq + oc) + 8 * oc * seq


def simulator_eval(precision, x, ic, oc, seq):
    """(a call that evaluates the kernel on `x`, the output surface)"""
    dev = open_device("sim", precision=precision)
    kernel = dev.compile(dynamic_matmul_kernel(ic, oc, seq).text())
    xs, ys = dev.surface([1, ic, 1, seq + oc]), dev.surface([1, oc, 1, seq])
    xs.write(x)
    req = dev.request(kernel, {"x": xs}, {"mm_y": ys})
    return (lambda: dev.eval(req)), ys


def run(args):
    """(the benchmark's figures: ms, GFLOP/s, time relative to numpy and error of each way to multiply;
    the summary's)"""
    ic, seq, oc = args.ic, args.seq, args.oc
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, ic, 1, seq + oc)).astype(np.float32) * 0.1
    act, w = x[0, :, 0, :seq], x[0, :, 0, seq:]
    ref = w.astype(np.float64).T @ act.astype(np.float64)
    flops = 2 * ic * seq * oc
    median_ms = lambda fn: statistics.median(timed(fn, args.reps, 1))    # warm-up: first touch, thread pools
    a32, w32 = np.ascontiguousarray(act), np.ascontiguousarray(w)
    # numpy first: its BLAS threads are still cold, so any cost of two thread pools falls on us
    rows = {"numpy.matmul fp32": (median_ms(lambda: np.matmul(w32.T, a32)), 0.0)}
    for precision in ("fp32", "fp16"):
        evaluate, ys = simulator_eval(precision, x, ic, oc, seq)
        ms = median_ms(evaluate)
        rows[f"simulator {precision}"] = ms, float(np.abs(ys.read()[0, :, 0, :] - ref).max() / np.abs(ref).max())
    base = rows["numpy.matmul fp32"][0]
    return (dict(shape=dict(ic=ic, seq=seq, oc=oc), flops=flops, reps=args.reps,
                 runs={name: dict(ms_median=ms, gflops=flops / ms / 1e6, vs_numpy=ms / base, max_rel_err=err)
                       for name, (ms, err) in rows.items()}),
            dict(simulator_vs_numpy={p: rows[f"simulator {p}"][0] / base for p in ("fp32", "fp16")}))


def text(args, figures):
    return (f"dynamic matmul [{args.ic}x{args.seq}] x [{args.ic}x{args.oc}] -> [{args.oc}x{args.seq}], "
            f"{figures['flops'] / 1e9:.3f} GFLOP, BLAS {blas.corename()} ({blas.get_num_threads()} threads), "
            f"median of {args.reps}\n" + table(COLUMNS, figures["runs"].items()))
