"""dispatch: the eval latency of a tiny kernel (one 1×1 conv, 128 channels, spatial 64), median and p99."""

import statistics

import numpy as np

from .peak import chain_input, peak_program, peak_weights
from .timing import measure, timing

DISPATCH_CHANNELS, DISPATCH_SPATIAL = 128, 64                   # the M4 latency figure's kernel (§5.2)


def dispatch_program(rng, dialect="ios18"):
    c, s = DISPATCH_CHANNELS, DISPATCH_SPATIAL
    return peak_program(peak_weights(1, c, rng), s, dialect)


def run_dispatch(dev, reps, warmup, seed=0):
    rng = np.random.default_rng(seed)
    c, s = DISPATCH_CHANNELS, DISPATCH_SPATIAL
    out, times, compile_s = measure(dev, dispatch_program(rng, dev.dialect), chain_input(c, s, rng), reps, warmup)
    return dict(kernel=f"one 1x1 conv, {c} channels, spatial {s}", channels=c, spatial=s, reps=reps,
                compile_s=compile_s, ms_mean=statistics.fmean(times), **timing(times))


def run(dev, args):
    """(the benchmark's figures, the summary's)"""
    r = run_dispatch(dev, args.reps, args.warmup)
    return dict(warmup=args.warmup, **r), dict(dispatch_ms_median=r["ms_median"], dispatch_ms_p99=r["ms_p99"])


def text(args, r):
    return (f"dispatch: eval latency of {r['kernel']}, {args.reps} evals after {args.warmup} warm-up\n"
            f"median {r['ms_median']:.4f} ms, p99 {r['ms_p99']:.4f} ms, min {r['ms_min']:.4f} ms, "
            f"mean {r['ms_mean']:.4f} ms")
