"""train: time per forward+backward micro-step of a model, its breakdown, GFLOP/s, the optimizer update,
MFU against the sgemm peak measured in the same run and peak RSS; each precision (and PyTorch, with
--compare torch) in a fresh process, --rounds times in turn, their steps pooled."""

import multiprocessing
import os
import resource
import statistics
import sys
import time

import numpy as np

from .. import blas
from ..device import open_device
from ..model.config import init_params, load_config
from ..model.flops import step_flops
from ..model.transformer import PARTS, step_parts
from .report import header, note_for, report
from .table import Column, table
from .torch_model import import_torch, torch_inputs, torch_loss, torch_missing

UPDATE_LR = 1e-4
COLUMNS = [Column("precision", 10, "s", lambda r: r["precision"], "<"),
           Column("total ms", 12, ".1f", lambda r: r["ms_fwdbwd_median"]),
           *(Column(f"{c} ms", 12, ".1f", lambda r, c=c: r["breakdown_ms"][c]) for c in PARTS),
           Column("GFLOP/s", 10, ".1f", lambda r: r["gflops"]),
           Column("MFU", 8, ".1%", lambda r: r["mfu"]),
           Column("update ms", 11, ".1f", lambda r: r["ms_update_median"]),
           Column("RSS MB", 9, ".0f", lambda r: r["rss_mb"]),
           Column("needed MB", 11, ".0f", lambda r: r["memory_theoretical_mb"])]


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
    from ..model.transformer import Transformer
    from ..optim import DEFAULT_LOSS_SCALE, AdamW
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
    if dev.chip:
        r["chip"] = dev.chip
    if dev.notice:
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
    parts = [step_parts(s) for s in samples]
    breakdown = {p: statistics.median(x[p] for x in parts) for p in PARTS}
    updates = [u for x in rounds for u in x["ms_update_all"]]
    r.update(ms_fwdbwd_median=ms, ms_fwdbwd_all=[s["total"] for s in samples], breakdown_ms=breakdown,
             gflops=r["flops_total"] / ms / 1e6, ms_update_median=statistics.median(updates),
             ms_update_all=updates, rss_mb=max(x["rss_mb"] for x in rounds))
    r["rss_over_theoretical"] = r["rss_mb"] / r["memory_theoretical_mb"]
    return r


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
    print(table(COLUMNS, results))
    for r in results:
        b = r["breakdown_ms"]
        share = {c: b[c] / r["ms_fwdbwd_median"] for c in PARTS}
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


def command(args):
    """The report, or None once the table is printed."""
    results, torch_result, peak = train_results(args)
    if args.json:
        return train_report(args, results, torch_result, peak)
    print_train_table(args, results, torch_result, peak)
    return None
