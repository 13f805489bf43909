"""train: time per forward+backward micro-step of a model, its breakdown, GFLOP/s, the optimizer update
(and its memory bandwidth against the read bandwidth measured in the same run), the micro-step with
the update amortized over --accum, MFU against the sgemm peak measured in the same run and peak RSS;
each precision (and PyTorch, with --compare torch) in a fresh process, --rounds times in turn, their
steps pooled. The CPU's SIMD level and the BLAS kernel are reported with the figures, and what the ANE would
run per micro-step: its kernels, their FLOPs and the bytes staged into their surfaces."""

import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..host import accelerate, blas
from ..device import open_device
from ..formats.hf import config_json, is_hf, read_config, tensors_of, write_json
from ..formats.portable import need
from ..model.config import init_params, load_config
from ..model.flops import step_flops
from ..model.lora import DEFAULT_TARGETS, Lora, init_adapters, parse_targets, target_names
from ..model.transformer import PARTS, STAGING, layer_weight, step_parts
from ..host.system import simd_level
from .generate import read_bandwidth
from .report import header, note_for, report
from .table import Column, table
from .torch_model import import_torch, peft_loss, peft_model, torch_inputs, torch_loss, torch_missing

UPDATE_LR = 1e-4
CLIP = 1.0                       # the trainer's default
COLUMNS = [Column("precision", 10, "s", lambda r: r["precision"], "<"),
           Column("total ms", 12, ".1f", lambda r: r["ms_fwdbwd_median"]),
           *(Column(f"{c} ms", 12, ".1f", lambda r, c=c: r["breakdown_ms"][c]) for c in PARTS),
           Column("GFLOP/s", 10, ".1f", lambda r: r["gflops"]),
           Column("MFU", 8, ".1%", lambda r: r["mfu"]),
           Column("update ms", 11, ".1f", lambda r: r["ms_update_median"]),
           Column("upd GB/s", 10, ".1f", lambda r: r["update_gbs"]),
           Column("amortized ms", 14, ".1f", lambda r: r["ms_amortized"]),
           Column("RSS MB", 9, ".0f", lambda r: r["rss_mb"]),
           Column("needed MB", 11, ".0f", lambda r: r["memory_theoretical_mb"])]


def peak_rss_mb():
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def sgemm_peak_gflops(n=2048, reps=3):
    """Best of `reps` n³ float32 GEMMs through anectypes.host.blas, after one warm-up call."""
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


def bench_lora(rank, alpha=None, targets=None):
    """--lora RANK's adapters: on --lora-targets (q, k, v and o), alpha --lora-alpha (twice the rank); None
    without it."""
    return rank and Lora(rank, float(alpha or 2 * rank), parse_targets(targets or DEFAULT_TARGETS))


def bench_config(model_name, seq=None, vocab=None):
    """A preset, a JSON file of ModelConfig fields, or a Hugging Face folder's config.json (the shape of a model
    you have, as train --init-from reads it; its weights are not read), with --seq and --vocab."""
    path = Path(model_name)
    if path.is_dir() and is_hf(path):
        return replace(read_config(path), **{k: v for k, v in dict(seq=seq, vocab=vocab).items() if v}).validate()
    return load_config(model_name, vocab=vocab, seq=seq)


def train_setup(model_name, seq, vocab, n_active, lora=None):
    """The config, the rng, the active vocabulary and the parameters (with LoRA's adapters) both the simulator
    and the PyTorch runs start from: the same seed gives the same model and the same token stream."""
    cfg = bench_config(model_name, seq, vocab)
    rng = np.random.default_rng(0)
    active = (np.arange(cfg.vocab) if n_active is None else
              np.sort(rng.choice(cfg.vocab, n_active, replace=False)))
    params = init_params(cfg, rng)
    return cfg, rng, active, {**params, **(init_adapters(cfg, lora, rng) if lora else {})}


def footprint_mb(model, opt):
    """What training must hold: weights, gradients, AdamW moments, the activations the last forward
    saved for the backward beyond the output surfaces (see Transformer.forward) and the surfaces (the frozen
    weights that are views of them counted there)."""
    arrays = [*(v for k, v in model.params.items() if k not in model.in_surfaces), *model.grads.values(),
              *opt.m.values(), *opt.v.values()]
    if not model.full_vocab:
        arrays.append(model.compact_grad)
    # an IOSurface holds its whole allocation (§1.9: surfaces read together are allocated alike);
    # the simulator's surfaces hold only their tensors
    surfaces = sum(s.alloc if s.handle is not None else s.nbytes for s in model.surfaces())
    return (sum(a.nbytes for a in arrays) + model.saved_nbytes + surfaces + model.logits_buf.nbytes) / 2**20


def staged_elements(params):
    """How many elements staging `params` writes into the kernels' surfaces: each layer weight (and adapter)
    once, into the forward kernel that holds it."""
    return sum(w.size for k, w in params.items() if layer_weight(k)[1] in STAGING)


def update_bytes(model):
    """Bytes one update moves at the least: the gradient norm reads every gradient; the pass reads each
    weight, gradient and both moments and writes the weight, the moments and the zeroed gradient;
    staging writes each layer weight into its surfaces; with LoRA, of the adapters alone."""
    n = sum(w.size for w in model.trainable.values())
    itemsize = next(iter(model.inp["sdpaFwd"][0].values())).array.itemsize
    return 4 * n + 32 * n + itemsize * staged_elements(model.trainable)


def ane_work(model, flops):
    """What the ANE would run for this model per micro-step, whatever device timed it: each kernel once per
    layer, the FLOPs of the kernels (projections, attention, input gradients) and of the CPU beside them
    (the classifier, the weight or adapter gradients), and the bytes staged into the surfaces in fp16 (as
    the ANE holds them): once at the start, and by each update (with LoRA, the adapters alone)."""
    device = ("fwd_proj", "fwd_attn", "bwd_dx", "bwd_attn")
    return dict(kernels=len(model.kernels), evals_per_step=len(model.kernels) * model.cfg.layers,
                flops_kernels=sum(flops[k] for k in device),
                flops_cpu=sum(v for k, v in flops.items() if k not in device and k != "total"),
                bytes_staged_once=2 * staged_elements(model.params),
                bytes_staged_per_update=2 * staged_elements(model.trainable),
                surface_bytes=2 * sum(s.nbytes // s.array.itemsize for s in model.surfaces()))


def bench_precision(model_name, precision, steps, warmup, seq, vocab, n_active, backend="sim", dialect=None,
                    lora=None):
    """Time micro-steps and optimizer updates of one model in one precision (with `lora`, a model.lora.Lora);
    the per-precision dict."""
    from ..model.transformer import Transformer
    from ..train.optim import AdamW, update_model
    from ..runs import default_loss_scale
    cfg, rng, active, params = train_setup(model_name, seq, vocab, n_active, lora)
    dev = open_device(backend, precision=precision, dialect=dialect)
    model = Transformer(cfg, dev, params, active, lora=lora)
    opt, scale = AdamW(model.trainable), default_loss_scale(cfg)
    samples, updates = [], []
    try:
        for i in range(warmup + steps):
            tokens, targets = rng.choice(active, cfg.seq), rng.choice(active, cfg.seq)   # ids the model knows
            model.reset_times()
            t0 = time.perf_counter()
            model.forward_backward(tokens, targets, scale)   # gradients as training scales them
            model.wait()        # a no-op after forward_backward, but part of the step if it ever isn't
            step_ms = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            # what the trainer does once per update: unscale, clip, AdamW, re-stage, zero the gradients
            update_model(model, opt, UPDATE_LR, scale, CLIP)
            update_ms = (time.perf_counter() - t1) * 1e3
            if i >= warmup:     # every timed part lies inside [t0, t0 + step], so the parts sum to <= step_ms
                samples.append(dict(model.times, total=step_ms))
                updates.append(update_ms)
        flops = step_flops(cfg, len(active), lora)
        theory_mb, moved, ane = footprint_mb(model, opt), update_bytes(model), ane_work(model, flops)
    finally:
        model.close()
    r = dict(model=model_name, **lora_keys(lora), loss_scale=scale, ane=ane, precision=precision, backend=dev.name,
             note=note_for(dev.name),
             seq=cfg.seq, vocab=cfg.vocab, n_active=len(active), params=cfg.n_params(),
             steps=steps, warmup=warmup, samples=samples, flops_total=flops["total"],
             flops_parts={k: v for k, v in flops.items() if k != "total"},
             ms_update_all=updates, update_bytes=moved, rss_mb=peak_rss_mb(), memory_theoretical_mb=theory_mb,
             accelerate_used=accelerate.used())
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
    update = statistics.median(updates)
    r.update(ms_fwdbwd_median=ms, ms_fwdbwd_all=[s["total"] for s in samples], breakdown_ms=breakdown,
             gflops=r["flops_total"] / ms / 1e6, ms_update_median=update, ms_update_all=updates,
             update_gbs=r["update_bytes"] / update / 1e6, rss_mb=max(x["rss_mb"] for x in rounds))
    r["rss_over_theoretical"] = r["rss_mb"] / r["memory_theoretical_mb"]
    return r


def lora_keys(lora):
    """The report's description of LoRA's adapters (a rank of None: full training)."""
    return dict(lora=lora and lora.rank, **(dict(lora_alpha=lora.alpha, lora_targets=target_names(lora.targets))
                                            if lora else {}))


def write_folder(model_name, seq, vocab, n_active, folder, micro_steps):
    """The model train_setup makes, as a Hugging Face folder (config.json, model.safetensors: what a user
    fine-tunes with transformers and peft), its compact vocabulary (None: every id) and a token stream over it:
    (tokens, compact targets) of each micro-step. In a fresh process of its own, so that neither side's RSS
    counts these copies."""
    cfg, rng, active, params = train_setup(model_name, seq, vocab, n_active)
    write_json(folder / "config.json", config_json(cfg))
    need("safetensors.numpy").save_file(tensors_of(params, cfg), str(folder / "model.safetensors"))
    compact_of = np.full(cfg.vocab, -1, np.int64)
    compact_of[active] = np.arange(len(active))
    return (None if n_active is None else active,
            [(rng.choice(active, cfg.seq), compact_of[rng.choice(active, cfg.seq)]) for _ in range(micro_steps)])


def bench_torch(model_name, steps, warmup, seq, vocab, n_active, threads, lora=None, folder=None, written=None):
    """Forward + backward of the loss in PyTorch eager, fp32 on the CPU, batch 1, same model and tokens,
    and torch.optim.AdamW's step (its default implementation, our hyperparameters) after each; with `lora`,
    the model of `folder` (`written`: write_folder's vocabulary and token stream) in transformers wrapped by peft,
    autograd and AdamW over the adapters alone, as a user fine-tunes it."""
    torch, why = import_torch()
    if torch is None:
        return dict(available=False, reason=why)
    torch.set_num_threads(threads)
    if lora:
        model, implementation = peft_model(torch, folder, lora)
        active, stream = written
        active_t = None if active is None else torch.tensor(active)
        trainable = [t for t in model.parameters() if t.requires_grad]
        loss = lambda tokens, targets: peft_loss(torch, model, active_t, tokens, targets)
    else:
        cfg, rng, active, params = train_setup(model_name, seq, vocab, n_active)
        # the tensors share the arrays' memory: one copy of the model, as the simulator holds it
        p = {k: torch.from_numpy(v).requires_grad_() for k, v in params.items()}
        compact_of = np.full(cfg.vocab, -1, np.int64)
        compact_of[active] = np.arange(len(active))
        active_t = torch.tensor(active)
        cos, sin, mask = torch_inputs(torch, cfg)
        trainable, implementation = list(p.values()), "the anectypes model in torch operations"
        loss = lambda tokens, targets: torch_loss(torch, cfg, p, active_t, tokens, targets, cos, sin, mask)
        stream = [(t, compact_of[y]) for t, y in ((rng.choice(active, cfg.seq), rng.choice(active, cfg.seq))
                                                  for _ in range(warmup + steps))]
    opt = torch.optim.AdamW(trainable, lr=UPDATE_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    times, updates = [], []
    for i, (tokens, targets) in enumerate(stream):
        tokens_t, targets_t = torch.tensor(tokens), torch.tensor(targets)
        t0 = time.perf_counter()
        loss(tokens_t, targets_t).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
            updates.append((t2 - t1) * 1e3)
        opt.zero_grad()
    # a plain str: torch's version object would import torch into the parent when unpickled there
    return dict(available=True, version=str(torch.__version__), implementation=implementation, dtype="fp32",
                device="cpu", threads=threads, trainable=sum(t.numel() for t in trainable),
                ms_fwdbwd_median=statistics.median(times), ms_fwdbwd_all=times, ms_adamw_all=updates,
                rss_mb=peak_rss_mb())


def _child(fn, args):
    return fn(*args)


def in_fresh_process(fn, *args):
    """fn(*args) in a new process: ru_maxrss is a high-water mark, so each run must have its own;
    spawn (not fork) so the child starts small."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child, (fn, args))


MODEL_KEYS = ("model", "lora", "lora_alpha", "lora_targets", "loss_scale", "ane", "seq", "vocab", "n_active", "params", "steps",
              "warmup", "flops_total", "flops_parts")


def train_results(args):
    """(per-precision flat dicts, the torch dict or None, sgemm peak)."""
    precisions = ("fp16", "fp32") if args.precision == "both" else (args.precision,)
    why = torch_missing() if args.compare == "torch" else None
    torch_result = dict(available=False, reason=why) if why else None
    threads = blas.get_num_threads() or os.cpu_count() or 1
    lora = bench_lora(args.lora, args.lora_alpha, args.lora_targets)
    rounds, torch_rounds = {p: [] for p in precisions}, []
    with tempfile.TemporaryDirectory(prefix="anectypes-bench-") as folder:
        # peft's side loads the model as a user's Hugging Face folder
        written = (lora and torch_result is None and args.compare == "torch" and
                   in_fresh_process(write_folder, args.model, args.seq, args.vocab, args.active, Path(folder),
                                    args.warmup + args.steps))
        for _ in range(args.rounds):     # in turn, so that a machine whose speed drifts favours no one
            for p in precisions:
                rounds[p].append(in_fresh_process(bench_precision, args.model, p, args.steps, args.warmup, args.seq,
                                                  args.vocab, args.active, args.backend, args.dialect, lora))
            if args.compare == "torch" and torch_result is None:
                torch_rounds.append(in_fresh_process(bench_torch, args.model, args.steps, args.warmup, args.seq,
                                                     args.vocab, args.active, threads, lora, folder, written))
    results = [pooled(rounds[p]) for p in precisions]
    if torch_rounds and not torch_rounds[0]["available"]:       # found, but its import failed
        torch_result = torch_rounds[0]
    elif torch_rounds:
        pool = lambda key: [t for x in torch_rounds for t in x[key]]
        times, updates = pool("ms_fwdbwd_all"), pool("ms_adamw_all")
        torch_result = dict(torch_rounds[0], ms_fwdbwd_median=statistics.median(times), ms_fwdbwd_all=times,
                            ms_adamw_median=statistics.median(updates), ms_adamw_all=updates,
                            rss_mb=max(x["rss_mb"] for x in torch_rounds))
        torch_result["ms_amortized"] = torch_result["ms_fwdbwd_median"] + torch_result["ms_adamw_median"] / args.accum
    peak, bandwidth = sgemm_peak_gflops(), read_bandwidth()
    for r in results:
        r.update(sgemm_peak_gflops=peak, mfu=r["gflops"] / peak, blas=blas.corename(),
                 blas_threads=blas.get_num_threads(), simd=simd_level(), read_bandwidth_gbs=bandwidth / 1e9,
                 accum=args.accum, ms_amortized=r["ms_fwdbwd_median"] + r["ms_update_median"] / args.accum)
        if torch_result and torch_result["available"]:
            t = torch_result
            r.update(ratio_vs_torch=r["ms_fwdbwd_median"] / t["ms_fwdbwd_median"],
                     update_ratio_vs_torch_adamw=r["ms_update_median"] / t["ms_adamw_median"],
                     amortized_ratio_vs_torch=r["ms_amortized"] / t["ms_amortized"])
    return results, torch_result, peak


def train_report(args, results, torch_result, peak):
    backends = sorted({r["backend"] for r in results}, key=lambda b: b != "ane")
    chip = next((r["chip"] for r in results if r.get("chip")), None)
    notes = {r["note"] for r in results}
    note = notes.pop() if len(notes) == 1 else " and ".join(f"{r['note']} ({r['precision']})" for r in results)
    train = {k: results[0][k] for k in MODEL_KEYS if k in results[0]}
    train.update(note=note, sgemm_peak_gflops=peak, rounds=args.rounds,
                 simd=results[0]["simd"], blas_core=results[0]["blas"], accum=args.accum,
                 read_bandwidth_gbs=results[0]["read_bandwidth_gbs"],
                 precisions={r["precision"]: {k: v for k, v in r.items() if k not in MODEL_KEYS
                                              and k not in ("sgemm_peak_gflops", "blas", "blas_threads", "simd",
                                                            "read_bandwidth_gbs", "accum", "accelerate_used")}
                             for r in results})
    if torch_result is not None:
        train["compare"] = dict(torch=torch_result)
    per = lambda key: {r["precision"]: r[key] for r in results}
    summary = dict(note=note, model=args.model, ms_fwdbwd_median=per("ms_fwdbwd_median"), gflops=per("gflops"),
                   mfu=per("mfu"), ms_update_median=per("ms_update_median"), ms_amortized=per("ms_amortized"),
                   simd=results[0]["simd"])
    if torch_result is not None:
        ok = torch_result["available"]
        summary.update(torch_ms_fwdbwd_median=torch_result["ms_fwdbwd_median"] if ok else None,
                       ratio_vs_torch=per("ratio_vs_torch") if ok else None)
    return report("+".join(backends), args.precision, chip, dict(train=train), summary,
                  used=[u for r in results for u in r["accelerate_used"]])     # the runs' processes


def print_train_table(args, results, torch_result, peak):
    r0 = results[0]
    for notice in dict.fromkeys(r["notice"] for r in results if r.get("notice")):
        print(notice)
    heads = {r["precision"]: header(r["backend"], r.get("chip")) for r in results}
    print(heads[r0["precision"]] if len(set(heads.values())) == 1 else
          "; ".join(f"{p}: {h}" for p, h in heads.items()))
    lora = (f", LoRA rank {args.lora} alpha {r0['lora_alpha']:g} on {r0['lora_targets']} (the model frozen)"
            if args.lora else "")
    print(f"{args.model}{lora}: {r0['params'] / 1e6:.1f}M params, seq {r0['seq']}, vocab {r0['vocab']} "
          f"({r0['n_active']} active), {r0['flops_total'] / 1e9:.2f} GFLOP per micro-step")
    runs = f"{args.rounds} rounds in turn of " if args.rounds > 1 else ""
    print(f"median of {runs}{args.steps} micro-steps after {args.warmup} warm-up; CPU {r0['simd']}, BLAS "
          f"{r0['blas']} ({r0['blas_threads']} threads), sgemm peak {peak:.1f} GFLOP/s (2048³, best of 3), read "
          f"bandwidth {r0['read_bandwidth_gbs']:.1f} GB/s (sgemv over 256 MiB); update = gradient norm and "
          f"clipping, one AdamW step, re-staging the weights and zeroing the gradients (upd GB/s: the bytes it "
          f"must move / its time); amortized = micro-step + update / {args.accum} (--accum)")
    print(table(COLUMNS, results))
    ane = r0["ane"]
    print(f"on the ANE a micro-step would run {ane['evals_per_step']} kernel evaluations ({ane['kernels']} kernels "
          f"× {ane['evals_per_step'] // ane['kernels']} layers), {ane['flops_kernels'] / 1e9:.2f} GFLOP in them and "
          f"{ane['flops_cpu'] / 1e9:.2f} on the CPU (classifier, {'adapter' if args.lora else 'weight'} gradients); "
          f"fp16 bytes staged: {ane['bytes_staged_once'] / 2**20:,.1f} MiB once, "
          f"{ane['bytes_staged_per_update'] / 2**20:,.1f} MiB per update; surfaces "
          f"{ane['surface_bytes'] / 2**20:,.0f} MiB")
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
    print(f"PyTorch {t['version']} eager ({t['implementation']}), CPU, fp32, {t['threads']} threads: "
          f"{t['ms_fwdbwd_median']:.1f} ms per "
          f"micro-step (forward + backward, median of {len(t['ms_fwdbwd_all'])}), torch.optim.AdamW step "
          f"{t['ms_adamw_median']:.1f} ms, amortized {t['ms_amortized']:.1f} ms, RSS {t['rss_mb']:.0f} MB")
    who = "simulator" if all(r["backend"] == "sim" for r in results) else "anectypes"
    for label, key in (("micro-step", "ratio_vs_torch"), ("update vs AdamW", "update_ratio_vs_torch_adamw"),
                       ("amortized", "amortized_ratio_vs_torch")):
        print(f"{who}/torch {label} time ratio (>1: slower than PyTorch): "
              + ", ".join(f"{r['precision']} {r[key]:.2f}x" for r in results))


def command(args):
    """The report, or None once the table is printed."""
    results, torch_result, peak = train_results(args)
    if args.json:
        return train_report(args, results, torch_result, peak)
    print_train_table(args, results, torch_result, peak)
    return None
