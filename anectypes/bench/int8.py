"""int8: the peak chain as W8A8 (ane_int8_bench.m) next to the fp16 chain, and the speed-up."""

import math

import numpy as np

from ..mil import Builder
from .peak import chain_flops, chain_input, peak_program, peak_weights
from .table import Column, table
from .timing import measure, timing

ACT_SCALE = 2.0 ** -5       # int8 activations: a power of two (exact in fp16), range ±4
COLUMNS = [Column("", 6, "s", lambda r: r["kind"], "<"),
           Column("W MB", 8, ".1f", lambda r: r["weight_mb"]),
           Column("compile s", 11, ".2f", lambda r: r["compile_s"]),
           Column("ms", 10, ".3f", lambda r: r["ms_median"]),
           Column("p99 ms", 10, ".3f", lambda r: r["ms_p99"]),
           Column("TOPS", 9, ".4f", lambda r: r["tflops"])]


def int8_weights(depth, channels, rng, zero_point=0):
    """int8 weights and their power-of-two scale, so that (q - zero_point)·scale has variance ≈ 1/C.

    q - zero_point is uniform on [-m, m] with m(m+1)/3·scale² = 1/C and m ≤ 127.
    """
    target = math.sqrt(3.0 / channels)                     # half-width of U(-a, a) with variance 1/C
    scale = 2.0 ** math.ceil(math.log2(target / 127))
    m = max(1, min(127, round(target / scale)))
    lo, hi = max(-128, zero_point - m), min(127, zero_point + m)
    q = rng.integers(lo, hi, (depth, channels, channels), endpoint=True, dtype=np.int8)
    return q, scale


def int8_program(qweights, spatial, w_scale, a_scale=ACT_SCALE, zero_point=0, dialect="ios18"):
    """The W8A8 chain of ane_int8_bench.m: W_i = constexpr_affine_dequantize(int8 chunk i, w_scale,
    zero_point, axis 0) → conv; between convs quantize(·, a_scale) to int8 and dequantize(·, a_scale)
    back to fp16; the last conv's output is the result."""
    depth, channels = qweights.shape[0], qweights.shape[1]
    b = Builder(dialect)
    h = b.input("x", [1, channels, 1, spatial])
    for i in range(depth):
        q = b.weight(qweights[i].reshape(channels, channels, 1, 1), "weights.bin", dtype="int8", emit=False,
                     name=f"Q{i}")
        w = b.constexpr_affine_dequantize(quantized_data=q, scale=float(w_scale), zero_point=np.int8(zero_point),
                                          axis=0, name=f"W{i}")
        h = b.conv(x=h, weight=w, name="y" if i == depth - 1 else f"c{i}")
        if i < depth - 1:
            qa = b.quantize(input=h, scale=float(a_scale), output_dtype="int8", name=f"q{i}")
            h = b.dequantize(input=qa, scale=float(a_scale), name=f"dq{i}")
    b.output(h)
    return b


def run_int8(dev, depth, channels, spatial, reps, warmup, seed=0):
    rng = np.random.default_rng(seed)
    x = chain_input(channels, spatial, rng)
    flops = chain_flops(depth, channels, spatial)
    q, w_scale = int8_weights(depth, channels, rng)
    programs = {"fp16": peak_program(peak_weights(depth, channels, rng), spatial, dev.dialect),
                "int8": int8_program(q, spatial, w_scale, ACT_SCALE, 0, dev.dialect)}
    runs = {}
    for kind, b in programs.items():
        out, times, compile_s = measure(dev, b, x, reps, warmup)
        t = timing(times)
        runs[kind] = dict(weight_mb=(2 if kind == "fp16" else 1) * depth * channels * channels / 2**20,
                          compile_s=compile_s, tflops=flops / t["ms_median"] / 1e9,
                          finite=bool(np.isfinite(out).all()), **t)
    return dict(depth=depth, channels=channels, spatial=spatial, flops=flops,
                scales=dict(weight=w_scale, activation=ACT_SCALE, zero_point=0), fp16=runs["fp16"],
                int8=runs["int8"], speedup=runs["fp16"]["ms_median"] / runs["int8"]["ms_median"])


def run(dev, args):
    """(the benchmark's figures, the summary's)"""
    r = run_int8(dev, args.depth, args.channels, args.spatial, args.reps, args.warmup)
    return (dict(reps=args.reps, warmup=args.warmup, **r),
            dict(fp16_tflops=r["fp16"]["tflops"], int8_tops=r["int8"]["tflops"], int8_speedup=r["speedup"]))


def text(args, r):
    return "\n".join([
        f"int8 W8A8 vs fp16: {r['depth']}x conv {r['channels']}ch, input [1,{r['channels']},1,{r['spatial']}], "
        f"{r['flops'] / 1e9:.3f} GOP; int8 weight scale {r['scales']['weight']:g}, activation scale "
        f"{r['scales']['activation']:g}; median of {args.reps} evals after {args.warmup} warm-up",
        table(COLUMNS, [dict(r[kind], kind=kind) for kind in ("fp16", "int8")]),
        f"int8 speed-up (fp16 ms / int8 ms): {r['speedup']:.2f}x"])
