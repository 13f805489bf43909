"""Simulator training-step throughput: time per forward+backward micro-step, where it goes, GFLOP/s, MFU.

    python tools/bench_train.py --model stories15m [--precision fp16|fp32|both] [--steps 10]
                                [--warmup 2] [--seq N] [--vocab N] [--active N] [--json]

Builds a Transformer with random init on the simulator device and times `--steps` micro-steps (one
sequence each: forward_backward on random tokens, wait(), zero_grads) after `--warmup` untimed ones.
Reported per precision: the median step time, the median of each part of the Transformer's own
breakdown (eval: kernel evaluation, io: surface writes/reads incl. fp16 conversion, cls: classifier
and loss, dw_wait: waiting for the dW sgemm worker, cpu: the rest of the step = total − the others,
i.e. RMSNorm, SiLU and RoPE backward, the embedding scatter and Python overhead),
the achieved GFLOP/s (anectypes.model.flops.step_flops / median time), and the peak RSS. Each
precision runs in a fresh process, so its peak RSS is its own. The machine's sgemm peak (a 2048³
sgemm through anectypes.blas, best of 3) is measured in the same run and MFU = achieved / peak.

These are simulator figures (numpy + the CPU BLAS), not ANE figures.
"""

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from anectypes import blas  # noqa: E402
from anectypes.device import open_device  # noqa: E402
from anectypes.model.config import PRESETS, load_config  # noqa: E402
from anectypes.model.flops import step_flops  # noqa: E402
from anectypes.model.transformer import Transformer, init_params  # noqa: E402

PARTS = ("eval", "io", "cls", "dw_wait")      # measured by the Transformer; "cpu" is the remainder
NOTE = "simulator figures"


def peak_rss_mb():
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def sgemm_peak_gflops(n=2048, reps=3):
    """Best of `reps` n³ float32 GEMMs through anectypes.blas, after one warm-up call."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    out = np.empty((n, n), np.float32)
    blas.sgemm(a, b, out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        blas.sgemm(a, b, out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


def bench_precision(model_name, precision, steps, warmup, seq, vocab, n_active):
    """Time micro-steps of one model in one precision; returns the per-precision result dict."""
    cfg = load_config(model_name, vocab=vocab, seq=seq)
    rng = np.random.default_rng(0)
    active = (np.arange(cfg.vocab) if n_active is None else
              np.sort(rng.choice(cfg.vocab, n_active, replace=False)))
    model = Transformer(cfg, open_device("sim", precision=precision), init_params(cfg, rng), active)
    samples = []
    for i in range(warmup + steps):
        tokens, targets = rng.choice(active, cfg.seq), rng.choice(active, cfg.seq)   # ids the model knows
        model.reset_times()
        t0 = time.perf_counter()
        model.forward_backward(tokens, targets)
        model.wait()            # a no-op after forward_backward, but part of the step if it ever isn't
        step_ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:         # every timed part lies inside [t0, now], so the parts sum to <= step_ms
            samples.append(dict(model.times, total=step_ms))
        model.zero_grads()
    ms = statistics.median(s["total"] for s in samples)
    breakdown = {p: statistics.median(s[p] for s in samples) for p in PARTS}
    breakdown["cpu"] = max(0.0, ms - sum(breakdown.values()))
    flops = step_flops(cfg, len(active))
    return dict(model=model_name, precision=precision, backend="sim", note=NOTE,
                seq=cfg.seq, vocab=cfg.vocab, n_active=len(active), params=cfg.n_params(),
                steps=steps, warmup=warmup, ms_fwdbwd_median=ms,
                ms_fwdbwd_all=[s["total"] for s in samples], breakdown_ms=breakdown,
                flops_total=flops["total"], flops_parts={k: v for k, v in flops.items() if k != "total"},
                gflops=flops["total"] / ms / 1e6, rss_mb=peak_rss_mb())


def _child(args):
    return bench_precision(*args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="stories15m", help=f"a preset ({', '.join(PRESETS)}) or a JSON config")
    ap.add_argument("--precision", choices=("fp16", "fp32", "both"), default="both")
    ap.add_argument("--steps", type=int, default=10, help="timed micro-steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed micro-steps first")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's, 32000 "
                                                             "for the stories models)")
    ap.add_argument("--active", type=int, default=None, help="active (compact) vocabulary size (default: all)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per precision instead of a table")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(args.model, vocab=args.vocab, seq=args.seq)       # fail early on a bad model name
    if args.active is not None and not 1 <= args.active <= cfg.vocab:
        ap.error(f"--active must be in [1, {cfg.vocab}]")
    precisions = ("fp16", "fp32") if args.precision == "both" else (args.precision,)

    # one fresh process per precision: ru_maxrss is a high-water mark, so a shared process would
    # report the larger of the runs for both; spawn (not fork) so the child starts small
    ctx = multiprocessing.get_context("spawn")
    results = []
    for p in precisions:
        with ctx.Pool(1) as pool:
            results.append(pool.apply(_child, ((args.model, p, args.steps, args.warmup, args.seq,
                                                 args.vocab, args.active),)))
    peak = sgemm_peak_gflops()
    for r in results:
        r.update(sgemm_peak_gflops=peak, mfu=r["gflops"] / peak, blas=blas.corename(),
                 blas_threads=blas.get_num_threads())

    if args.json:
        for r in results:
            print(json.dumps(r))
        return
    r0 = results[0]
    print(f"SIMULATOR figures (numpy + CPU BLAS), not ANE figures. {args.model}: {r0['params'] / 1e6:.1f}M params, "
          f"seq {r0['seq']}, vocab {r0['vocab']} ({r0['n_active']} active), "
          f"{r0['flops_total'] / 1e9:.2f} GFLOP per micro-step")
    print(f"median of {args.steps} micro-steps after {args.warmup} warm-up; BLAS {r0['blas']} "
          f"({r0['blas_threads']} threads), sgemm peak {peak:.1f} GFLOP/s (2048³, best of 3)")
    cols = ("total",) + PARTS + ("cpu",)
    print(f"{'precision':10s}" + "".join(f"{c + ' ms':>12s}" for c in cols)
          + f"{'GFLOP/s':>10s}{'MFU':>8s}{'RSS MB':>9s}")
    for r in results:
        vals = [r["ms_fwdbwd_median"]] + [r["breakdown_ms"][c] for c in cols[1:]]
        print(f"{r['precision']:10s}" + "".join(f"{v:12.1f}" for v in vals)
              + f"{r['gflops']:10.1f}{r['mfu']:8.1%}{r['rss_mb']:9.0f}")
    for r in results:
        share = {c: r["breakdown_ms"][c] / r["ms_fwdbwd_median"] for c in cols[1:]}
        print(f"{r['precision']}: " + ", ".join(f"{c} {v:.0%}" for c, v in share.items()))


if __name__ == "__main__":
    main()
