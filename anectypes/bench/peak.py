"""peak: the reference's peak program (inmem_peak, docs/ane-reference.md §5.2), N chained 1×1 convs."""

import numpy as np

from ..mil import Builder
from .table import Column, table
from .timing import measure, timing

PEAK_SHAPE = dict(depth=128, channels=512, spatial=64)          # inmem_peak's program (§5.2)
SWEEP = [(128, 512, 64), (64, 512, 64), (32, 512, 64), (128, 256, 64), (128, 384, 64), (128, 768, 64),
         (32, 512, 256)]                                         # (depth, channels, spatial)
COLUMNS = [Column("depth", 6, "d", lambda r: r["depth"]),
           Column("channels", 10, "d", lambda r: r["channels"]),
           Column("spatial", 9, "d", lambda r: r["spatial"]),
           Column("GFLOP", 9, ".3f", lambda r: r["flops"] / 1e9),
           Column("W MB", 8, ".1f", lambda r: r["weight_mb"]),
           Column("compile s", 11, ".2f", lambda r: r["compile_s"]),
           Column("ms", 10, ".3f", lambda r: r["ms_median"]),
           Column("p99 ms", 10, ".3f", lambda r: r["ms_p99"]),
           Column("TFLOPS", 9, ".4f", lambda r: r["tflops"])]


def chain_flops(depth, channels, spatial):
    """FLOPs of N chained 1×1 convs C→C over S positions: 2·N·C²·S."""
    return 2 * depth * channels * channels * spatial


def chain_bytes(depth, channels, spatial, int8=False):
    """At least what a chain benchmark holds: its N fp16 C×C weights (int8: and their int8 copy) and its
    fp16 input and output [1, C, 1, S]."""
    return (3 if int8 else 2) * depth * channels * channels + 2 * 2 * channels * spatial


def chain_input(channels, spatial, rng):
    return rng.standard_normal((1, channels, 1, spatial)).astype(np.float16)


def peak_weights(depth, channels, rng):
    """N fp16 C×C matrices with entries N(0, 1/C): the chain neither grows nor shrinks on average."""
    w = np.empty((depth, channels, channels), np.float16)
    for i in range(depth):
        w[i] = rng.standard_normal((channels, channels), dtype=np.float32) * np.float32(channels ** -0.5)
    return w


def peak_program(weights, spatial, dialect="ios18"):
    """The peak program: input x [1,C,1,S] fp16, y = conv_N(...conv_1(x)); the N weights [C,C,1,1]
    are the N chunks of one BLOBFILE."""
    depth, channels = weights.shape[0], weights.shape[1]
    b = Builder(dialect)
    h = b.input("x", [1, channels, 1, spatial])
    for i in range(depth):
        w = b.weight(weights[i].reshape(channels, channels, 1, 1), "weights.bin", name=f"W{i}")
        h = b.conv(x=h, weight=w, name="y" if i == depth - 1 else f"c{i}")
    b.output(h)
    return b


def run_peak(dev, depth, channels, spatial, reps, warmup, seed=0):
    rng = np.random.default_rng(seed)
    b = peak_program(peak_weights(depth, channels, rng), spatial, dev.dialect)
    out, times, compile_s = measure(dev, b, chain_input(channels, spatial, rng), reps, warmup)
    flops = chain_flops(depth, channels, spatial)
    t = timing(times)
    return dict(depth=depth, channels=channels, spatial=spatial, flops=flops,
                weight_mb=2 * depth * channels * channels / 2**20, compile_s=compile_s,
                tflops=flops / t["ms_median"] / 1e9, finite=bool(np.isfinite(out).all()), **t)


def run(dev, args):
    """(the benchmark's figures, the summary's)"""
    shapes = SWEEP if args.sweep else [(args.depth, args.channels, args.spatial)]
    runs = [run_peak(dev, d, c, s, args.reps, args.warmup) for d, c, s in shapes]
    best = max(runs, key=lambda r: r["tflops"])
    return (dict(reps=args.reps, warmup=args.warmup, runs=runs),
            dict(peak_tflops=best["tflops"], best=dict(depth=best["depth"], channels=best["channels"],
                                                       spatial=best["spatial"])))


def text(args, figures):
    return (f"peak: N chained 1x1 convs, C channels, input [1,C,1,S] fp16; median of {args.reps} evals "
            f"after {args.warmup} warm-up\n" + table(COLUMNS, figures["runs"]))
