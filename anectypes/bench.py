"""python -m anectypes.bench — the reference's benchmarks on this machine, as a table or one JSON object.

    python -m anectypes.bench peak [--depth 128 --channels 512 --spatial 64] [--sweep] [--reps 20]
    python -m anectypes.bench int8 [--depth 128 --channels 512 --spatial 64] [--reps 20]
    python -m anectypes.bench dispatch [--reps 1000]
    python -m anectypes.bench train --model PRESET [--precision fp16|fp32|both] [--steps 10] [--warmup 2]
                                    [--seq N] [--vocab N] [--active N] [--compare torch]
    every subcommand: [--backend auto|sim|ane] [--json]; peak, int8, dispatch: [--precision fp16|fp32]

peak      the reference's peak program (inmem_peak, docs/ane-reference.md §5.2): N chained 1×1 convs of C
          channels on an fp16 input [1, C, 1, S], the N weights as N chunks of one BLOBFILE;
          TFLOPS = 2·N·C²·S / median eval time. --sweep runs a few (depth, channels, spatial) shapes.
int8      the same chain as W8A8 (ane_int8_bench.m): int8 weights through constexpr_affine_dequantize
          and int8 activations through quantize/dequantize between the convs, next to the fp16
          chain; prints both and the speed-up (fp16 time / int8 time).
dispatch  the eval latency of a tiny kernel (one 1×1 conv, 128 channels, spatial 64): median, p99.
train     time per forward+backward micro-step of a model with its breakdown, GFLOP/s (model FLOPs of
          anectypes.model.flops), the optimizer update (one AdamW step + re-staging the weights),
          MFU against the sgemm peak measured in the same run, peak RSS; each precision in a fresh
          process. --compare torch times the same architecture in PyTorch eager on the CPU (fp32).

Flags out of range, and sizes that cannot fit in this machine's memory, are refused before any work.
On the ANE backend the figures are the engine's. On the simulator they are "simulator figures":
numpy and the CPU BLAS executing the same MIL, which says nothing about the ANE's speed; the table
header and the "note" fields say so. `--json` prints one object of schema version 1
(tools/bench_schema.json): {"schema_version": 1, "system": {...}, "benchmarks": {...}, "summary": {...}},
in the spirit of the community benchmark schema (docs/ane-reference.md §6.3).
"""

import argparse
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from . import __version__, blas
from .cli import ArgumentParser
from .device import BACKENDS, open_device
from .errors import AnectypesError, BlasError
from .mil import Builder
from .model.config import PRESETS, load_config
from .model.flops import step_flops
from .system import physical_memory

SCHEMA_VERSION = 1
NOTE_SIM = "simulator figures"
NOTE_ANE = "ANE figures"
SIM_HEADER = "SIMULATOR figures (numpy + CPU BLAS on this machine), not ANE figures"
PEAK_SHAPE = dict(depth=128, channels=512, spatial=64)          # inmem_peak's program (§5.2)
SWEEP = [(128, 512, 64), (64, 512, 64), (32, 512, 64), (128, 256, 64), (128, 384, 64), (128, 768, 64),
         (32, 512, 256)]                                         # (depth, channels, spatial)
DISPATCH_CHANNELS, DISPATCH_SPATIAL = 128, 64                   # the M4 latency figure's kernel (§5.2)
ACT_SCALE = 2.0 ** -5       # int8 activations: a power of two (exact in fp16), range ±4
PARTS = ("eval", "io", "cls", "dw_wait")      # measured by the Transformer; "cpu" is a step's remainder
UPDATE_LR = 1e-4
TIMING_BYTES = 64           # what each timed eval keeps: two floats (its time and its ms_all copy) in lists


# ------------------------------------------------------------------ the system block

def cpu_model():
    """The CPU's marketing name: /proc/cpuinfo on Linux, sysctl on macOS."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("model name", "hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def memory_gb():
    memory = physical_memory()
    return round(memory / 2**30, 1) if memory else None


def blas_info():
    try:
        return dict(core=blas.corename(), threads=blas.get_num_threads())
    except BlasError as e:
        return dict(core=f"unavailable: {e}", threads=None)


def system_info(backend, precision, chip=None):
    """The report's system block; `chip` is the ANE's aneSubType when the ANE ran, else the CPU's name."""
    info = dict(machine=platform.machine(), os=f"{platform.system()} {platform.release()}",
                chip=chip or cpu_model(), memory_gb=memory_gb(), backend=backend, precision=precision,
                anectypes_version=__version__, blas=blas_info(), python=platform.python_version(),
                numpy=np.__version__)
    if sys.platform == "darwin":
        info["macos_version"] = platform.mac_ver()[0]
    return info


def note_for(backend):
    return NOTE_ANE if backend == "ane" else NOTE_SIM


def report(backend, precision, chip, benchmarks, summary):
    return dict(schema_version=SCHEMA_VERSION, system=system_info(backend, precision, chip),
                benchmarks=benchmarks, summary=summary)


def header(backend, chip):
    return SIM_HEADER if backend != "ane" else f"ANE figures (chip {chip or 'unknown'})"


# ------------------------------------------------------------------ the programs

def chain_flops(depth, channels, spatial):
    """FLOPs of N chained 1×1 convs C→C over S positions: 2·N·C²·S."""
    return 2 * depth * channels * channels * spatial


def chain_bytes(depth, channels, spatial, int8=False):
    """At least what a chain benchmark holds: its N fp16 C×C weights (int8: and their int8 copy) and its
    fp16 input and output [1, C, 1, S]."""
    return (3 if int8 else 2) * depth * channels * channels + 2 * 2 * channels * spatial


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


def dispatch_program(rng, dialect="ios18"):
    c, s = DISPATCH_CHANNELS, DISPATCH_SPATIAL
    return peak_program(peak_weights(1, c, rng), s, dialect)


# ------------------------------------------------------------------ running and timing

def open_bench_device(backend, precision):
    dev = open_device(backend, precision=precision)
    if getattr(dev, "notice", None):
        print(dev.notice, file=sys.stderr)
    return dev


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
        times = []
        for i in range(warmup + reps):
            t = time.perf_counter()
            dev.eval(req)
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1e3)
        out = np.array(ys.array, np.float64)
    finally:
        if req is not None:
            req.free()
        kernel.free()
        xs.free()
        ys.free()
    return out, times, compile_s


def timing(times):
    return dict(ms_median=statistics.median(times), ms_p99=float(np.percentile(times, 99)), ms_min=min(times),
                ms_all=[round(t, 4) for t in times])


def chain_input(channels, spatial, rng):
    return rng.standard_normal((1, channels, 1, spatial)).astype(np.float16)


def run_peak(dev, depth, channels, spatial, reps, warmup, seed=0):
    rng = np.random.default_rng(seed)
    b = peak_program(peak_weights(depth, channels, rng), spatial, dev.dialect)
    out, times, compile_s = measure(dev, b, chain_input(channels, spatial, rng), reps, warmup)
    flops = chain_flops(depth, channels, spatial)
    t = timing(times)
    return dict(depth=depth, channels=channels, spatial=spatial, flops=flops,
                weight_mb=2 * depth * channels * channels / 2**20, compile_s=compile_s,
                tflops=flops / t["ms_median"] / 1e9, finite=bool(np.isfinite(out).all()), **t)


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


def run_dispatch(dev, reps, warmup, seed=0):
    rng = np.random.default_rng(seed)
    c, s = DISPATCH_CHANNELS, DISPATCH_SPATIAL
    out, times, compile_s = measure(dev, dispatch_program(rng, dev.dialect), chain_input(c, s, rng), reps, warmup)
    return dict(kernel=f"one 1x1 conv, {c} channels, spatial {s}", channels=c, spatial=s, reps=reps,
                compile_s=compile_s, ms_mean=statistics.fmean(times), **timing(times))


# ------------------------------------------------------------------ peak, int8, dispatch commands

def cmd_peak(args):
    dev = open_bench_device(args.backend, args.precision)
    chip, note = getattr(dev, "chip", None), note_for(dev.name)
    shapes = SWEEP if args.sweep else [(args.depth, args.channels, args.spatial)]
    runs = [run_peak(dev, d, c, s, args.reps, args.warmup) for d, c, s in shapes]
    best = max(runs, key=lambda r: r["tflops"])
    result = report(dev.name, args.precision, chip,
                    dict(peak=dict(note=note, reps=args.reps, warmup=args.warmup, runs=runs)),
                    dict(note=note, peak_tflops=best["tflops"],
                         best=dict(depth=best["depth"], channels=best["channels"], spatial=best["spatial"])))
    if args.json:
        return result
    print(f"{header(dev.name, chip)}; {args.precision}")
    print(f"peak: N chained 1x1 convs, C channels, input [1,C,1,S] fp16; median of {args.reps} evals "
          f"after {args.warmup} warm-up")
    print(f"{'depth':>6s}{'channels':>10s}{'spatial':>9s}{'GFLOP':>9s}{'W MB':>8s}{'compile s':>11s}"
          f"{'ms':>10s}{'p99 ms':>10s}{'TFLOPS':>9s}")
    for r in runs:
        print(f"{r['depth']:6d}{r['channels']:10d}{r['spatial']:9d}{r['flops'] / 1e9:9.3f}{r['weight_mb']:8.1f}"
              f"{r['compile_s']:11.2f}{r['ms_median']:10.3f}{r['ms_p99']:10.3f}{r['tflops']:9.4f}")
    return None


def cmd_int8(args):
    dev = open_bench_device(args.backend, args.precision)
    chip, note = getattr(dev, "chip", None), note_for(dev.name)
    r = run_int8(dev, args.depth, args.channels, args.spatial, args.reps, args.warmup)
    result = report(dev.name, args.precision, chip, dict(int8=dict(note=note, reps=args.reps, warmup=args.warmup,
                                                                    **r)),
                    dict(note=note, fp16_tflops=r["fp16"]["tflops"], int8_tops=r["int8"]["tflops"],
                         int8_speedup=r["speedup"]))
    if args.json:
        return result
    print(f"{header(dev.name, chip)}; {args.precision}")
    print(f"int8 W8A8 vs fp16: {r['depth']}x conv {r['channels']}ch, input [1,{r['channels']},1,{r['spatial']}], "
          f"{r['flops'] / 1e9:.3f} GOP; int8 weight scale {r['scales']['weight']:g}, activation scale "
          f"{r['scales']['activation']:g}; median of {args.reps} evals after {args.warmup} warm-up")
    print(f"{'':6s}{'W MB':>8s}{'compile s':>11s}{'ms':>10s}{'p99 ms':>10s}{'TOPS':>9s}")
    for kind in ("fp16", "int8"):
        x = r[kind]
        print(f"{kind:6s}{x['weight_mb']:8.1f}{x['compile_s']:11.2f}{x['ms_median']:10.3f}{x['ms_p99']:10.3f}"
              f"{x['tflops']:9.4f}")
    print(f"int8 speed-up (fp16 ms / int8 ms): {r['speedup']:.2f}x")
    return None


def cmd_dispatch(args):
    dev = open_bench_device(args.backend, args.precision)
    chip, note = getattr(dev, "chip", None), note_for(dev.name)
    r = run_dispatch(dev, args.reps, args.warmup)
    result = report(dev.name, args.precision, chip, dict(dispatch=dict(note=note, warmup=args.warmup, **r)),
                    dict(note=note, dispatch_ms_median=r["ms_median"], dispatch_ms_p99=r["ms_p99"]))
    if args.json:
        return result
    print(f"{header(dev.name, chip)}; {args.precision}")
    print(f"dispatch: eval latency of {r['kernel']}, {args.reps} evals after {args.warmup} warm-up")
    print(f"median {r['ms_median']:.4f} ms, p99 {r['ms_p99']:.4f} ms, min {r['ms_min']:.4f} ms, "
          f"mean {r['ms_mean']:.4f} ms")
    return None


# ------------------------------------------------------------------ train

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


def train_setup(model_name, seq, vocab, n_active):
    """The config, the rng, the active vocabulary and the parameters both the simulator and the PyTorch
    runs start from: the same seed gives the same model and the same token stream."""
    from .model.config import init_params
    cfg = load_config(model_name, vocab=vocab, seq=seq)
    rng = np.random.default_rng(0)
    active = (np.arange(cfg.vocab) if n_active is None else
              np.sort(rng.choice(cfg.vocab, n_active, replace=False)))
    return cfg, rng, active, init_params(cfg, rng)


def footprint_mb(model, opt):
    """What training must hold: weights, gradients, AdamW moments, the activations the last forward
    saved for the backward beyond the output surfaces (see Transformer.forward) and the surfaces."""
    arrays = [*model.params.values(), *model.grads.values(), *opt.m.values(), *opt.v.values()]
    if not model.full_vocab:
        arrays.append(model.compact_grad)
    # an IOSurface holds its whole allocation (§1.9: surfaces read together are allocated alike);
    # the simulator's surfaces hold only their tensors
    surfaces = sum(s.alloc if s.handle is not None else s.nbytes for s in model.surfaces())
    return (sum(a.nbytes for a in arrays) + model.saved_nbytes + surfaces + model.logits_buf.nbytes) / 2**20


def bench_precision(model_name, precision, steps, warmup, seq, vocab, n_active, backend="sim"):
    """Time micro-steps and optimizer updates of one model in one precision; the per-precision dict."""
    from .model.transformer import Transformer
    from .optim import DEFAULT_LOSS_SCALE, AdamW
    cfg, rng, active, params = train_setup(model_name, seq, vocab, n_active)
    dev = open_device(backend, precision=precision)
    model = Transformer(cfg, dev, params, active)
    opt = AdamW(model.params)
    samples, updates = [], []
    try:
        for i in range(warmup + steps):
            tokens, targets = rng.choice(active, cfg.seq), rng.choice(active, cfg.seq)   # ids the model knows
            model.reset_times()
            t0 = time.perf_counter()
            model.forward_backward(tokens, targets, DEFAULT_LOSS_SCALE)   # gradients as training scales them
            model.wait()        # a no-op after forward_backward, but part of the step if it ever isn't
            step_ms = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            opt.step(model.params, model.grads, UPDATE_LR)      # one AdamW step ...
            model.stage_weights()                               # ... and the weights back into the surfaces
            update_ms = (time.perf_counter() - t1) * 1e3
            if i >= warmup:     # every timed part lies inside [t0, t0 + step], so the parts sum to <= step_ms
                samples.append(dict(model.times, total=step_ms))
                updates.append(update_ms)
            model.zero_grads()
        theory_mb = footprint_mb(model, opt)
    finally:
        model.close()
    flops = step_flops(cfg, len(active))
    r = dict(model=model_name, precision=precision, backend=dev.name, note=note_for(dev.name),
             seq=cfg.seq, vocab=cfg.vocab, n_active=len(active), params=cfg.n_params(),
             steps=steps, warmup=warmup, samples=samples, flops_total=flops["total"],
             flops_parts={k: v for k, v in flops.items() if k != "total"},
             ms_update_all=updates, rss_mb=peak_rss_mb(), memory_theoretical_mb=theory_mb)
    if getattr(dev, "chip", None):
        r["chip"] = dev.chip
    if getattr(dev, "notice", None):
        r["notice"] = dev.notice
    return r


def pooled(rounds):
    """One precision's result from its rounds (fresh processes): the timed steps of all pooled,
    medians over them, the highest peak RSS. "cpu" is the median of each step's remainder (its
    total minus its timed parts): the median step minus the parts' medians would mix steps and
    move by the spread of the large parts."""
    r = {k: v for k, v in rounds[0].items() if k != "samples"}
    samples = [s for x in rounds for s in x["samples"]]
    ms = statistics.median(s["total"] for s in samples)
    breakdown = {p: statistics.median(s[p] for s in samples) for p in PARTS}
    breakdown["cpu"] = statistics.median(max(0.0, s["total"] - sum(s[p] for p in PARTS)) for s in samples)
    updates = [u for x in rounds for u in x["ms_update_all"]]
    r.update(ms_fwdbwd_median=ms, ms_fwdbwd_all=[s["total"] for s in samples], breakdown_ms=breakdown,
             gflops=r["flops_total"] / ms / 1e6, ms_update_median=statistics.median(updates),
             ms_update_all=updates, rss_mb=max(x["rss_mb"] for x in rounds))
    r["rss_over_theoretical"] = r["rss_mb"] / r["memory_theoretical_mb"]
    return r


NO_TORCH = "anectypes does not depend on it: `pip install torch` to compare"


def import_torch():
    """(torch, None) or (None, why): PyTorch is optional, only --compare torch uses it."""
    try:
        import torch
    except ImportError as e:
        return None, f"PyTorch not installed ({e}); {NO_TORCH}"
    return torch, None


def torch_loss(torch, cfg, p, active, tokens, compact_targets, cos, sin, mask):
    """The anectypes model in PyTorch (positions on rows, [S, C]): RMSNorm, interleaved-pair RoPE,
    causal GQA attention with the full S×S scores masked, α-scaled residuals, SiLU-gated FFN, tied
    embedding over the compact vocabulary (the embedding itself, no gathered copy, when every token
    is active, as in the simulator), mean cross-entropy. `p` maps anectypes' parameter names
    to tensors stored [out, in] like the simulator's."""
    F, a, hd = torch.nn.functional, cfg.alpha, cfg.head_dim

    def rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(t, heads):                               # [S, heads·hd] → [heads, S, hd]
        pairs = t.view(cfg.seq, heads, hd // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1)
        return rot.view(cfg.seq, heads, hd).transpose(0, 1)

    x = p["embed"][tokens]
    for i in range(cfg.layers):
        L = f"layers.{i}."
        xn = rms(x, p[L + "rms_att"])
        q = rope(xn @ p[L + "wq"].T, cfg.heads)
        k = rope(xn @ p[L + "wk"].T, cfg.kv_heads).repeat_interleave(cfg.gqa_ratio, 0)
        v = (xn @ p[L + "wv"].T).view(cfg.seq, cfg.kv_heads, hd).transpose(0, 1).repeat_interleave(cfg.gqa_ratio, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) * (hd ** -0.5) + mask, -1)
        attn = (probs @ v).transpose(0, 1).reshape(cfg.seq, cfg.q_dim)
        x2 = x + a * (attn @ p[L + "wo"].T)
        x2n = rms(x2, p[L + "rms_ffn"])
        x = x2 + a * ((F.silu(x2n @ p[L + "w1"].T) * (x2n @ p[L + "w3"].T)) @ p[L + "w2"].T)
    out_w = p["embed"] if len(active) == cfg.vocab else p["embed"][active]
    logits = rms(x, p["rms_final"]) @ out_w.T
    return F.cross_entropy(logits, compact_targets)


def torch_inputs(torch, cfg):
    """cos/sin [S, 1, hd/2] (one value per pair) and the additive causal mask [S, S]."""
    j = np.arange(cfg.head_dim // 2)
    angle = np.arange(cfg.seq)[:, None] * cfg.rope_theta ** (-2.0 * j / cfg.head_dim)[None, :]
    cos, sin = (torch.tensor(f(angle)[:, None, :], dtype=torch.float32) for f in (np.cos, np.sin))
    mask = torch.triu(torch.full((cfg.seq, cfg.seq), float("-inf")), diagonal=1)
    return cos, sin, mask


def torch_missing():
    """Why PyTorch cannot be compared, or None. Checked without importing it: the processes that
    run the benchmarks start as forks of this one, and Linux keeps a process's peak RSS across exec,
    so PyTorch imported here would count in every child's peak."""
    return f"PyTorch not installed; {NO_TORCH}" if importlib.util.find_spec("torch") is None else None


def bench_torch(model_name, steps, warmup, seq, vocab, n_active, threads):
    """Forward + backward of the loss in PyTorch eager, fp32 on the CPU, batch 1, same model and tokens."""
    torch, why = import_torch()
    if torch is None:
        return dict(available=False, reason=why)
    torch.set_num_threads(threads)
    cfg, rng, active, params = train_setup(model_name, seq, vocab, n_active)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    compact_of = np.full(cfg.vocab, -1, np.int64)
    compact_of[active] = np.arange(len(active))
    active_t = torch.tensor(active)
    cos, sin, mask = torch_inputs(torch, cfg)
    times = []
    for i in range(warmup + steps):
        tokens, targets = rng.choice(active, cfg.seq), rng.choice(active, cfg.seq)
        tokens_t, targets_t = torch.tensor(tokens), torch.tensor(compact_of[targets])
        t0 = time.perf_counter()
        torch_loss(torch, cfg, p, active_t, tokens_t, targets_t, cos, sin, mask).backward()
        ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
        for t in p.values():
            t.grad = None
    # a plain str: torch's version object would import torch into the parent when unpickled there
    return dict(available=True, version=str(torch.__version__), dtype="fp32", device="cpu", threads=threads,
                ms_fwdbwd_median=statistics.median(times), ms_fwdbwd_all=times, rss_mb=peak_rss_mb())


def _child(fn, args):
    return fn(*args)


def in_fresh_process(fn, *args):
    """fn(*args) in a new process: ru_maxrss is a high-water mark, so each run must have its own;
    spawn (not fork) so the child starts small."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child, (fn, args))


MODEL_KEYS = ("model", "seq", "vocab", "n_active", "params", "steps", "warmup", "flops_total", "flops_parts")


def train_results(args):
    """(per-precision flat dicts, the torch dict or None, sgemm peak)."""
    precisions = ("fp16", "fp32") if args.precision == "both" else (args.precision,)
    why = torch_missing() if args.compare == "torch" else None
    torch_result = dict(available=False, reason=why) if why else None
    threads = blas.get_num_threads() or os.cpu_count() or 1
    rounds, torch_rounds = {p: [] for p in precisions}, []
    for _ in range(args.rounds):     # in turn, so that a machine whose speed drifts favours no one
        for p in precisions:
            rounds[p].append(in_fresh_process(bench_precision, args.model, p, args.steps, args.warmup, args.seq,
                                              args.vocab, args.active, args.backend))
        if args.compare == "torch" and torch_result is None:
            torch_rounds.append(in_fresh_process(bench_torch, args.model, args.steps, args.warmup, args.seq,
                                                 args.vocab, args.active, threads))
    results = [pooled(rounds[p]) for p in precisions]
    if torch_rounds and not torch_rounds[0]["available"]:       # found, but its import failed
        torch_result = torch_rounds[0]
    elif torch_rounds:
        times = [t for x in torch_rounds for t in x["ms_fwdbwd_all"]]
        torch_result = dict(torch_rounds[0], ms_fwdbwd_median=statistics.median(times), ms_fwdbwd_all=times,
                            rss_mb=max(x["rss_mb"] for x in torch_rounds))
    peak = sgemm_peak_gflops()
    for r in results:
        r.update(sgemm_peak_gflops=peak, mfu=r["gflops"] / peak, blas=blas.corename(),
                 blas_threads=blas.get_num_threads())
        if torch_result and torch_result["available"]:
            r["ratio_vs_torch"] = r["ms_fwdbwd_median"] / torch_result["ms_fwdbwd_median"]
    return results, torch_result, peak


def train_report(args, results, torch_result, peak):
    backends = sorted({r["backend"] for r in results}, key=lambda b: b != "ane")
    chip = next((r["chip"] for r in results if r.get("chip")), None)
    notes = {r["note"] for r in results}
    note = notes.pop() if len(notes) == 1 else " and ".join(f"{r['note']} ({r['precision']})" for r in results)
    train = {k: results[0][k] for k in MODEL_KEYS}
    train.update(note=note, sgemm_peak_gflops=peak, rounds=args.rounds,
                 precisions={r["precision"]: {k: v for k, v in r.items() if k not in MODEL_KEYS
                                              and k not in ("sgemm_peak_gflops", "blas", "blas_threads")}
                             for r in results})
    if torch_result is not None:
        train["compare"] = dict(torch=torch_result)
    per = lambda key: {r["precision"]: r[key] for r in results}
    summary = dict(note=note, model=args.model, ms_fwdbwd_median=per("ms_fwdbwd_median"), gflops=per("gflops"),
                   mfu=per("mfu"), ms_update_median=per("ms_update_median"))
    if torch_result is not None:
        ok = torch_result["available"]
        summary.update(torch_ms_fwdbwd_median=torch_result["ms_fwdbwd_median"] if ok else None,
                       ratio_vs_torch=per("ratio_vs_torch") if ok else None)
    return report("+".join(backends), args.precision, chip, dict(train=train), summary)


def print_train_table(args, results, torch_result, peak):
    r0 = results[0]
    for notice in dict.fromkeys(r["notice"] for r in results if r.get("notice")):
        print(notice)
    heads = {r["precision"]: header(r["backend"], r.get("chip")) for r in results}
    print(heads[r0["precision"]] if len(set(heads.values())) == 1 else
          "; ".join(f"{p}: {h}" for p, h in heads.items()))
    print(f"{args.model}: {r0['params'] / 1e6:.1f}M params, seq {r0['seq']}, vocab {r0['vocab']} "
          f"({r0['n_active']} active), {r0['flops_total'] / 1e9:.2f} GFLOP per micro-step")
    runs = f"{args.rounds} rounds in turn of " if args.rounds > 1 else ""
    print(f"median of {runs}{args.steps} micro-steps after {args.warmup} warm-up; BLAS {r0['blas']} "
          f"({r0['blas_threads']} threads), sgemm peak {peak:.1f} GFLOP/s (2048³, best of 3); "
          f"update = one AdamW step + re-staging the weights")
    cols = ("total",) + PARTS + ("cpu",)
    print(f"{'precision':10s}" + "".join(f"{c + ' ms':>12s}" for c in cols)
          + f"{'GFLOP/s':>10s}{'MFU':>8s}{'update ms':>11s}{'RSS MB':>9s}{'needed MB':>11s}")
    for r in results:
        vals = [r["ms_fwdbwd_median"]] + [r["breakdown_ms"][c] for c in cols[1:]]
        print(f"{r['precision']:10s}" + "".join(f"{v:12.1f}" for v in vals)
              + f"{r['gflops']:10.1f}{r['mfu']:8.1%}{r['ms_update_median']:11.1f}{r['rss_mb']:9.0f}"
              + f"{r['memory_theoretical_mb']:11.0f}")
    for r in results:
        b = r["breakdown_ms"]
        share = {c: b[c] / r["ms_fwdbwd_median"] for c in cols[1:]}
        print(f"{r['precision']}: " + ", ".join(f"{c} {v:.0%}" for c, v in share.items())
              + f"; host time outside kernels and sgemm (io + cpu) {b['io'] + b['cpu']:.1f} ms")
    if torch_result is None:
        return
    if not torch_result["available"]:
        print(f"--compare torch: {torch_result['reason']}")
        return
    t = torch_result
    print(f"PyTorch {t['version']} eager, CPU, fp32, {t['threads']} threads: {t['ms_fwdbwd_median']:.1f} ms per "
          f"micro-step (forward + backward, median of {len(t['ms_fwdbwd_all'])}), RSS {t['rss_mb']:.0f} MB")
    who = "simulator" if all(r["backend"] == "sim" for r in results) else "anectypes"
    print(f"{who}/torch time ratio (>1: slower than PyTorch): ", end="")
    print(", ".join(f"{r['precision']} {r['ratio_vs_torch']:.2f}x" for r in results))


def cmd_train(args, json_lines=False):
    results, torch_result, peak = train_results(args)
    if args.json and json_lines:            # the historical format of tools/bench_train.py
        for r in results:
            print(json.dumps(r))
        return None
    if args.json:
        return train_report(args, results, torch_result, peak)
    print_train_table(args, results, torch_result, peak)
    return None


# ------------------------------------------------------------------ command line

def parser():
    ap = ArgumentParser(prog="python -m anectypes.bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: the ANE when present, else the simulator (default auto)")
    common.add_argument("--json", action="store_true", help="print one JSON object (schema version 1)")
    sub = ap.add_subparsers(dest="command", required=True)

    def kernel_command(name, help, reps, warmup):
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                       help="fp32 is a simulator mode (default fp16)")
        p.add_argument("--reps", type=int, default=reps, help=f"timed evaluations (default {reps})")
        p.add_argument("--warmup", type=int, default=warmup, help=f"untimed evaluations first (default {warmup})")
        return p

    def chain_shape(p):
        for k, v in PEAK_SHAPE.items():
            p.add_argument(f"--{k}", type=int, default=v, help=f"default {v}")

    p = kernel_command("peak", "peak throughput: N chained 1x1 convs (inmem_peak)", 20, 3)
    chain_shape(p)
    p.add_argument("--sweep", action="store_true",
                   help="run (depth, channels, spatial) in " + ", ".join(map(str, SWEEP)) + " instead")
    chain_shape(kernel_command("int8", "int8 W8A8 chain vs the fp16 chain (ane_int8_bench)", 20, 3))
    kernel_command("dispatch", "eval latency of a tiny kernel", 1000, 20)

    p = sub.add_parser("train", parents=[common], help="training micro-step throughput of a model",
                       description="training micro-step throughput of a model")
    p.add_argument("--model", default="stories15m", help=f"a preset ({', '.join(PRESETS)}) or a JSON config")
    p.add_argument("--precision", choices=("fp16", "fp32", "both"), default="both")
    p.add_argument("--steps", type=int, default=10, help="timed micro-steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed micro-steps first")
    p.add_argument("--rounds", type=int, default=1, help="run each precision (and PyTorch) this many times in "
                                                          "turn, each in a fresh process, and pool their steps")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's, 32000 "
                                                            "for the stories models)")
    p.add_argument("--active", type=int, default=None, help="active (compact) vocabulary size (default: all)")
    p.add_argument("--compare", choices=("torch",), default=None,
                   help="also time the same model in PyTorch eager on the CPU (if PyTorch is installed)")
    return ap


def check_args(args):
    """Refuse flags out of range, and sizes that cannot fit in this machine's memory, before any work."""
    if args.command == "train":
        if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
            raise AnectypesError("--steps and --rounds must be >= 1 and --warmup >= 0")
        cfg = load_config(args.model, vocab=args.vocab, seq=args.seq)    # fail early on a bad model name
        if args.active is not None and not 1 <= args.active <= cfg.vocab:
            raise AnectypesError(f"--active must be in [1, {cfg.vocab}]")
        cfg.check_fits(f"{args.model} with --seq {cfg.seq} --vocab {cfg.vocab}")
        return
    if args.reps < 1 or args.warmup < 0:
        raise AnectypesError("--reps must be >= 1 and --warmup >= 0")
    check_fits(f"--reps {args.reps}", "its timings", TIMING_BYTES * args.reps)
    if args.command in ("peak", "int8"):
        if min(args.depth, args.channels, args.spatial) < 1:
            raise AnectypesError("--depth, --channels and --spatial must be >= 1")
        check_fits(f"--depth {args.depth} --channels {args.channels} --spatial {args.spatial}",
                   "the chain's weights, input and output",
                   chain_bytes(args.depth, args.channels, args.spatial, args.command == "int8"))


def check_fits(flags, what, nbytes):
    memory = physical_memory()
    if memory and nbytes > memory:
        raise AnectypesError(f"{flags}: {what} need at least {nbytes / 2**30:,.1f} GiB but this machine has "
                             f"{memory / 2**30:,.1f} GiB")


COMMANDS = {"peak": cmd_peak, "int8": cmd_int8, "dispatch": cmd_dispatch, "train": cmd_train}


def main(argv=None, json_lines=False):
    """Run one subcommand; json_lines keeps tools/bench_train.py's one-line-per-precision --json."""
    ap = parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
        result = (cmd_train(args, json_lines) if args.command == "train" else COMMANDS[args.command](args))
    except AnectypesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result is not None:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
