"""python -m anectypes.train — train a Llama-style model with the ten dynamic-weight kernels.

    python -m anectypes.train --scratch                 # tiny model on the built-in corpus, offline
    python -m anectypes.train --scratch --model stories15m --data tok.bin --tokenizer tokenizer.bin
    python -m anectypes.train --resume [--run-dir runs/X]

A run directory holds config.json, status.json, metrics.jsonl (one JSON line per micro-step),
samples.jsonl, train.log and checkpoints/{latest,best}.ckpt. Checkpoints are taken at update
boundaries, so --resume (and the restart forced by the compile budget) continues with the same
losses an uninterrupted run would have produced.
"""

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import check_compatible, load_checkpoint, read_reference_checkpoint, save_checkpoint
from .corpus import builtin_dataset
from .data import BatchSampler, active_vocab, atomic_write, load_tokens, split
from .device import BACKENDS, open_device
from .errors import AnectypesError
from .generate import generate
from .model.config import PRESETS, ModelConfig, load_config
from .model.flops import step_flops
from .model.kernels import KERNELS
from .model.transformer import TIMES, Transformer, cross_entropy, init_params
from .optim import DEFAULT_LOSS_SCALE, AdamW, LossScaler, Schedule, unscale_and_clip
from .tokenizer import Tokenizer


@dataclass
class Defaults:
    steps: int = 10000
    lr: float = 3e-4
    accum: int = 10
    warmup: int = 100


# the reference's defaults (§4.5), except for `tiny`, tuned to learn visibly in a few minutes on 2 cores
DEFAULTS = {"tiny": Defaults(steps=2000, lr=3e-3, accum=2, warmup=50)}


def parse_args(argv):
    ap = OneLineArgumentParser(prog="python -m anectypes.train", description=__doc__.splitlines()[0])
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--scratch", action="store_true", help="start from a fresh random init")
    start.add_argument("--resume", action="store_true", help="continue the run in --run-dir (default: newest)")
    start.add_argument("--init-from", metavar="CKPT", help="start from the reference's v2/v4 checkpoint")
    ap.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a JSON file (default: tiny)")
    ap.add_argument("--data", help="llama2.c token file (flat uint16); default: the built-in corpus")
    ap.add_argument("--tokenizer", help="llama2.c tokenizer.bin for --data (gives the vocab and samples)")
    ap.add_argument("--steps", type=positive, help="micro-steps in total (default 10000; tiny: 2000)")
    ap.add_argument("--lr", type=positive_float, help="peak learning rate (default 3e-4; tiny: 3e-3)")
    ap.add_argument("--accum", type=positive, help="micro-steps per update (default 10; tiny: 2)")
    ap.add_argument("--warmup", type=non_negative, help="warmup micro-steps (default 100; tiny: 50)")
    ap.add_argument("--clip", type=non_negative_float, default=1.0, help="global grad-norm clip (0: off)")
    ap.add_argument("--min-lr-frac", type=non_negative_float, default=0.1, help="cosine floor / peak lr")
    ap.add_argument("--loss-scale", type=positive_float, default=DEFAULT_LOSS_SCALE)
    ap.add_argument("--dynamic-loss-scale", action="store_true", help="back off on inf/NaN, skip that update")
    ap.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: the ANE if present, else sim")
    ap.add_argument("--precision", choices=("fp16", "fp32"), default="fp16", help="simulator precision mode")
    ap.add_argument("--compile-budget", type=positive, default=119, help="compiles per process (ANE leak)")
    ap.add_argument("--run-dir", help="default: runs/<time>-<model> (new) or the newest run (--resume)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--log-every", type=positive, default=10)
    ap.add_argument("--sample-every", type=non_negative, default=500, help="micro-steps between samples (0: off)")
    ap.add_argument("--save-every", type=positive, default=50, help="updates between checkpoints")
    ap.add_argument("--stop-after", type=positive, metavar="STEP", help="checkpoint and stop at this micro-step")
    return ap.parse_args(argv)


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def positive(text):
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def non_negative(text):
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return v


def positive_float(text):
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def non_negative_float(text):
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return v


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        return Trainer(args, argv).run()
    except AnectypesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


class Trainer:
    def __init__(self, args, argv):
        self.args, self.argv = args, argv
        if not (args.scratch or args.resume or args.init_from):
            raise AnectypesError("say how to start: --scratch, --resume or --init-from CKPT")
        self.run_dir = self.choose_run_dir()
        ckpt = load_checkpoint(self.run_dir / "checkpoints" / "latest.ckpt") if args.resume else None
        stored = json.loads((self.run_dir / "config.json").read_text()) if args.resume else {}
        self.model_name = (args.model or stored.get("model_name")
                           or (Path(args.init_from).stem if args.init_from else "tiny"))
        # data: the built-in corpus unless --data; the tokenizer gives the vocabulary
        data = args.data or stored.get("data")
        tok_path = args.tokenizer or stored.get("tokenizer")
        self.tokenizer = Tokenizer.load(tok_path) if tok_path else None
        if data:
            vocab = self.tokenizer.vocab_size if self.tokenizer else load_config(self.model_name).vocab
            tokens = load_tokens(data, vocab)
        else:
            self.tokenizer, tokens = builtin_dataset()
            vocab = self.tokenizer.vocab_size
        ref = read_reference_checkpoint(args.init_from) if args.init_from else None
        if ckpt:                                # the model is the checkpoint's; --model may only agree
            if args.model:
                check_compatible(ckpt, load_config(args.model, vocab=vocab).to_dict())
            self.cfg = ModelConfig(**ckpt.config).validate()
        else:
            self.cfg = ref.config if ref else load_config(self.model_name, vocab=vocab)
            if ref and args.model and load_config(args.model, vocab=vocab) != ref.config:
                raise AnectypesError(f"--init-from {args.init_from} holds a model unlike --model {args.model}: "
                                     f"{ref.config}")
        if self.cfg.vocab < vocab:
            raise AnectypesError(f"the model's vocabulary ({self.cfg.vocab}) is smaller than the data's ({vocab})")
        self.train_tokens, self.val_tokens = split(tokens)
        if len(self.train_tokens) < self.cfg.seq + 1 or len(self.val_tokens) < self.cfg.seq + 1:
            raise AnectypesError(f"data has {len(tokens)} tokens: too short for seq {self.cfg.seq} "
                                 "(need seq+1 tokens in both the training and the 10% validation part)")
        d = Defaults(**stored["schedule"]) if ckpt else DEFAULTS.get(self.model_name, Defaults())
        self.steps, self.accum = args.steps or d.steps, args.accum or d.accum
        self.schedule = Schedule(args.lr or d.lr, d.warmup if args.warmup is None else args.warmup,
                                 self.steps, args.min_lr_frac)
        # device, model, optimizer, sampler
        t0 = time.perf_counter()
        self.device = open_device(args.backend, precision=args.precision, compile_budget=args.compile_budget)
        if getattr(self.device, "notice", None):
            print(self.device.notice, file=sys.stderr)
        backend = self.device.name
        if ckpt:
            params = ckpt.params
        elif ref:
            params = ref.params
        else:
            params = init_params(self.cfg, np.random.default_rng(args.seed))
        self.model = Transformer(self.cfg, self.device, params, active_vocab(tokens))
        self.compile_s = time.perf_counter() - t0
        self.opt = AdamW(self.model.params)
        self.scaler = LossScaler(args.loss_scale, dynamic=args.dynamic_loss_scale)
        self.sampler = BatchSampler(self.train_tokens, self.cfg.seq, seed=args.seed)
        self.step, self.updates, self.best = 0, 0, float("inf")
        self.updates_here = 0                  # updates made by this process (restarts need progress)
        if ckpt:
            self.opt.load_state_dict(ckpt.optimizer)
            s = ckpt.state
            self.sampler.load_state_dict(s["sampler"])
            self.scaler.load_state_dict(s["scaler"])
            self.step, self.updates, self.best = s["step"], s["updates"], s["best_val_loss"]
        self.config_doc = dict(model=self.cfg.to_dict(), model_name=self.model_name, data=data, tokenizer=tok_path,
                               backend=backend, precision=args.precision, seed=args.seed,
                               active_vocab=len(self.model.active), params=self.cfg.n_params(),
                               schedule=dict(steps=self.steps, lr=self.schedule.max_lr, accum=self.accum,
                                             warmup=self.schedule.warmup), clip=args.clip,
                               loss_scale=args.loss_scale, dynamic_loss_scale=args.dynamic_loss_scale)

    def choose_run_dir(self):
        a = self.args
        if a.run_dir:
            path = Path(a.run_dir)
        elif a.resume:
            runs = sorted(Path("runs").glob("*/checkpoints/latest.ckpt"), key=lambda p: p.stat().st_mtime)
            if not runs:
                raise AnectypesError("--resume: no run with a checkpoint under runs/; pass --run-dir")
            path = runs[-1].parent.parent
        else:
            path = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(a.model or 'tiny').stem}"
        if a.resume and not (path / "checkpoints" / "latest.ckpt").is_file():
            raise AnectypesError(f"--resume: {path} has no checkpoints/latest.ckpt")
        if not a.resume and (path / "checkpoints").is_dir() and any((path / "checkpoints").iterdir()):
            raise AnectypesError(f"{path} already holds a run; use --resume or another --run-dir")
        return path

    # -- run directory
    def write_json(self, name, doc):
        atomic_write(self.run_dir / name, lambda f: f.write(json.dumps(doc, indent=1).encode()))

    def status(self, state, **extra):
        self.write_json("status.json", dict(state=state, step=self.step, steps=self.steps, updates=self.updates,
                                            pid=os.getpid(), updated=time.time(), **extra))

    def log(self, line):
        with open(self.run_dir / "train.log", "a") as f:
            f.write(line + "\n")

    def save(self, name):
        state = dict(step=self.step, updates=self.updates, best_val_loss=self.best,
                     sampler=self.sampler.state_dict(), scaler=self.scaler.state_dict())
        save_checkpoint(self.run_dir / "checkpoints" / name, self.cfg.to_dict(), self.model.params,
                        self.opt.state_dict(), state)

    def truncate_metrics(self):
        """On resume, drop metric lines past the checkpoint: they will be produced again."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.run_dir / name
            if path.exists():
                keep = [ln for ln in path.read_text().splitlines(keepends=True)
                        if ln.strip() and json.loads(ln).get("step", 0) < self.step]
                atomic_write(path, lambda f: f.write("".join(keep).encode()))

    # -- the loop
    def run(self):
        a, cfg = self.args, self.cfg
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        if a.resume:
            self.truncate_metrics()
        self.write_json("config.json", self.config_doc)
        self.status("running")
        self.log(f"{'resumed' if a.resume else 'started'} at step {self.step}: {' '.join(self.argv)}")
        print(f"run dir {self.run_dir} | model {self.model_name} ({cfg.n_params() / 1e6:.2f}M params, "
              f"{cfg.layers} layers, dim {cfg.dim}, seq {cfg.seq}, vocab {cfg.vocab} -> "
              f"{len(self.model.active)} active) | {self.device.name} {a.precision} | "
              f"{len(KERNELS)} kernels compiled in {self.compile_s:.2f} s", flush=True)
        self.stop_requested = False
        previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.metrics = open(self.run_dir / "metrics.jsonl", "a")
        self.t_run, self.start_step = time.perf_counter(), self.step
        self.sums, self.n_timed = dict.fromkeys(TIMES, 0.0), 0
        try:
            state = self.loop()
        except BaseException as e:
            self.metrics.close()
            self.status("failed", error=f"{type(e).__name__}: {e}")
            self.log(f"failed at step {self.step}: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                self.model.close()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.finish(state)
        if state == "interrupted":
            print(f"stopped: checkpoint at step {self.step}; continue with --resume --run-dir {self.run_dir}",
                  file=sys.stderr)
            return 130
        return 0

    def loop(self):
        """Accumulation windows until done; returns how the run ended."""
        a = self.args
        while self.step < self.steps:
            if a.stop_after and self.step >= a.stop_after:
                return "stopped"
            if self.updates_here and self.device.compile_budget - self.device.compiles < len(KERNELS):
                self.restart()
            window = min(self.accum, self.steps - self.step)
            window_step, window_sampler = self.step, self.sampler.state_dict()
            for micro in range(window):
                self.micro_step(update_after=window if micro == window - 1 else 0)
                if self.stop_requested and micro < window - 1:
                    # an unfinished window: drop its gradients, it is redone on resume
                    self.step = window_step
                    self.sampler.load_state_dict(window_sampler)
                    self.model.zero_grads()
                    return "interrupted"
            if self.stop_requested:
                return "interrupted"
            if self.updates % a.save_every == 0 and self.step < self.steps:
                self.checkpoint()
        return "finished"

    def micro_step(self, update_after):
        """One sequence forward+backward (plus the update that closes a window); logs its metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self.model.reset_times()
        x, y = self.sampler.sample()
        loss = self.model.forward_backward(x, y, self.scaler.scale)
        lr = self.schedule.lr(self.step)
        norm = self.update(update_after, lr) if update_after else None
        ms = (time.perf_counter() - t0) * 1e3
        t = self.model.times
        parts = dict(t_eval=t["eval"], t_io=t["io"], t_cls=t["cls"], t_dw_wait=t["dw_wait"])
        parts["t_cpu"] = max(0.0, t["total"] - sum(parts.values()))
        rec = dict(step=self.step, loss=loss, lr=lr, grad_norm=norm, loss_scale=self.scaler.scale, ms_step=ms,
                   tokens_per_s=cfg.seq / ms * 1e3, **{k: round(v, 3) for k, v in parts.items()})
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        for k in TIMES:
            self.sums[k] += t[k]
        self.n_timed += 1
        self.step += 1
        self.progress(rec)
        if self.args.sample_every and self.step % self.args.sample_every == 0:
            self.sample()

    def update(self, window, lr):
        """Unscale, clip, AdamW, re-stage weights; an inf/NaN gradient skips the update."""
        self.model.wait()
        norm = unscale_and_clip(self.model.grads, self.scaler.scale * window, self.args.clip)
        self.scaler.update(norm is not None)
        if norm is not None:
            self.opt.step(self.model.params, self.model.grads, lr)
            self.model.stage_weights()
        else:
            self.log(f"step {self.step}: inf/NaN gradient, update skipped (loss scale -> {self.scaler.scale})")
        self.model.zero_grads()
        self.updates += 1
        self.updates_here += 1
        return norm

    def checkpoint(self):
        val = self.val_loss()
        self.save("latest.ckpt")
        best = val < self.best
        if best:
            self.best = val
            self.save("best.ckpt")
        self.log(f"step {self.step}: val loss {val:.4f}{' (best)' if best else ''}, checkpoint saved")

    def val_loss(self, windows=8):
        """Mean loss over fixed windows of the held-out 10%: the measure for `best`."""
        cfg, losses = self.cfg, []
        starts = np.linspace(0, len(self.val_tokens) - cfg.seq - 1, windows).astype(int)
        for s in starts:
            chunk = np.asarray(self.val_tokens[s:s + cfg.seq + 1], np.int64)
            if np.any(self.model.compact_of[chunk] < 0):
                continue                                    # a token the training part never had
            logits = self.model.logits(chunk[:-1])
            losses.append(cross_entropy(logits, self.model.compact_of[chunk[1:]])[0])
        return float(np.mean(losses)) if losses else float("nan")

    def sample(self):
        if not self.tokenizer:
            return
        text = generate(self.model, self.tokenizer, n_new=min(64, self.cfg.seq), seed=self.step)
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.write(json.dumps(dict(step=self.step, text=text)) + "\n")
        print(f"\n--- sample at step {self.step} ---\n{text}\n---", flush=True)

    def progress(self, rec):
        done = self.step - self.start_step
        eta = (time.perf_counter() - self.t_run) / done * (self.steps - self.step)
        line = (f"step {self.step}/{self.steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} | "
                f"{rec['ms_step']:.1f} ms/step | {rec['tokens_per_s']:.0f} tok/s | ETA {fmt_time(eta)}")
        if sys.stdout.isatty():
            print("\r" + line + "\033[K", end="", flush=True)
        elif self.step % self.args.log_every == 0 or self.step == self.steps:
            print(line, flush=True)

    def on_signal(self, signum, frame):
        """First Ctrl-C/SIGTERM: stop after this micro-step with a checkpoint; a second one: now."""
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True

    def restart(self):
        """The compile budget left cannot cover rebuilding the kernels: checkpoint, exec a fresh process."""
        self.save("latest.ckpt")
        self.status("restarting")
        msg = (f"compile budget: {self.device.compiles} of {self.device.compile_budget} used; restarting "
               f"the process with --resume (the ANE compiler leaks after ~119 compiles)")
        self.log(msg)
        print("\n" + msg, file=sys.stderr, flush=True)
        self.model.close()                # unload the kernels: exec does not run destructors
        argv = [x for x in restart_args(self.argv)] + ["--resume", "--run-dir", str(self.run_dir)]
        os.execv(sys.executable, [sys.executable, "-m", "anectypes.train", *argv])

    def finish(self, state):
        self.metrics.close()
        if state == "finished":
            self.checkpoint()
        else:
            self.save("latest.ckpt")
        self.model.close()
        self.status(state)
        self.log(f"{state} at step {self.step}")
        if sys.stdout.isatty():
            print()
        if self.n_timed:
            self.report(self.sums, self.n_timed, time.perf_counter() - self.t_run)

    def report(self, sums, n, wall):
        """The reference's end-of-run Efficiency Report (simulator figures on the simulator)."""
        cfg, per = self.cfg, {k: v / n for k, v in sums.items()}
        flops = step_flops(cfg, len(self.model.active))["total"]
        total = per["total"] or 1e-9
        cpu = max(0.0, total - per["eval"] - per["io"] - per["cls"] - per["dw_wait"])
        label = "simulator" if self.device.name == "sim" else self.device.name
        lines = [f"=== Efficiency Report ({label}, {self.args.precision}) ===",
                 f"micro-steps {n}, wall {fmt_time(wall)}, compile {self.compile_s:.2f} s "
                 f"({self.device.compiles} compiles)",
                 f"forward+backward {total:.1f} ms/step, {cfg.seq / total * 1e3:.0f} tokens/s, "
                 f"{flops / total / 1e6:.1f} GFLOP/s"]
        for k, v in (("kernel eval", per["eval"]), ("surface I/O + fp16", per["io"]), ("CPU ops + loss", cpu),
                     ("classifier sgemm", per["cls"]), ("dW sgemm / wait", per["dw_wait"])):
            lines.append(f"  {k:20s} {v:8.2f} ms  {100 * v / total:5.1f}%")
        lines.append(f"best validation loss {self.best:.4f}")
        print("\n".join(lines), flush=True)
        self.log("\n".join(lines))


def restart_args(argv):
    """The command line minus how it started (--scratch/--init-from/--resume/--run-dir)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--scratch", "--resume"):
            continue
        elif x in ("--init-from", "--run-dir"):
            skip = True
        elif not x.startswith(("--init-from=", "--run-dir=")):
            out.append(x)
    return out


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


if __name__ == "__main__":
    sys.exit(main())
