"""What a run writes and prints as it trains: the run folder's files (status, log, metrics and samples rows,
checkpoints; anectypes.runs says what each holds), the progress line and the end-of-run Efficiency Report.

Rank 0 owns the run folder and the terminal: its trainer writes through a RunWriter, the other ranks'
through Silent, which writes nothing, so that the loop reads the same on every rank.
"""

import contextlib
import math
import os
import sys
import time

from ..formats.checkpoint import save_checkpoint
from ..generate.sampling import generate
from ..generate.decoder import Decoder
from ..host.processes import ProcessUsage
from ..model.flops import step_flops
from ..model.kernels import KERNELS
from ..model.lora import merged
from ..model.transformer import step_parts
from ..runs import BEST, LATEST, RunError, finite, model_name
from .distributed import TTY_VARIABLE, launched_rank
from .report_to import Reporters


def run_writer(trainer, best):
    """The trainer's writer: a RunWriter on rank 0 (starting from the best validation loss `best`), Silent
    on the other ranks."""
    return RunWriter(trainer, best) if trainer.world.rank == 0 else Silent()


class Silent:
    """The writer of a rank above 0: every call does nothing."""

    def stopped(self):
        return 0      # not 130: mpirun ends the whole job when a rank exits non-zero, and rank 0 may still be writing

    def __getattr__(self, name):
        return lambda *args, **kw: None


class RunWriter:
    """Rank 0's writes: the run folder and the terminal, from the trainer's state (self.t)."""

    def __init__(self, trainer, best):
        self.t, self.rd, self.spec = trainer, trainer.rd, trainer.spec
        self.best = best                       # the best validation loss so far (checkpoints hold it)
        self.last_loss = None                  # the last row's, for status.json
        self.metrics = None                    # metrics.jsonl, open for appending while training
        self.live = live_progress()            # the progress line rewritten in place (a terminal)
        self.start_step = trainer.step

    # -- the run folder
    def take_over(self):
        """The run folder as this process starts on it (still the folder it claimed: one removed meanwhile
        stays gone): no stale temporary files, latest.ckpt the checkpoint it resumes from, the rows of
        the checkpoint's steps only, the config and a running status; the banner."""
        t, rd, spec, cfg = self.t, self.rd, self.spec, self.t.cfg
        if rd.vanished():
            raise RunError(f"{rd.path}: the run folder was removed or moved away while this trainer started; "
                           "nothing was written")
        rd.checkpoints.mkdir(exist_ok=True)
        rd.clean_temp()
        if t.resumed_from == BEST:
            self.save(LATEST)                      # before the rows go back to its step
        rd.rewind(t.step)                          # rows past the checkpoint are produced again
        rd.write_config(t.doc)
        self.status("running")
        how = "resumed" if t.args.resume else "started"
        notes = ", ".join(n for n in (t.extended, t.resumed_from == BEST and f"from {BEST}") if n)
        rd.log(f"{how} at step {t.step} of {spec.steps}{f' ({notes})' if notes else ''}: {' '.join(spec.argv())}")
        rd.log(f"loss over the {spec.vocabulary} vocabulary ({len(t.model.active)} of {cfg.vocab} ids)")
        print(f"run dir {rd.path} | model {model_name(spec.model)} ({cfg.n_params() / 1e6:.2f}M params, "
              f"{cfg.layers} layers, dim {cfg.dim}, seq {cfg.seq}, vocab {cfg.vocab} -> "
              f"{len(t.model.active)} in the loss, {spec.vocabulary}) | {t.device.name} {spec.precision} | "
              f"{len(KERNELS)} kernels compiled in {t.compile_s:.2f} s"
              f"{f' | {spec.ranks} ranks' if spec.ranks > 1 else ''}", flush=True)
        self.metrics = open(rd / "metrics.jsonl", "a")
        self.usage = ProcessUsage()                # the cpu_pct and rss_mb of the metrics rows
        self.reports = Reporters(rd, spec, rd.read_config()[1], t.step)    # --report-to's, with config.json's document

    def status(self, state, **extra):
        t = self.t
        self.rd.write_status(state, step=t.step, steps=self.spec.steps, updates=t.updates, loss=self.last_loss,
                             best_val_loss=finite(self.best), **extra)

    def log(self, line):
        self.rd.log(line)

    def note(self, line):
        """A line for the run's log that the terminal shows too."""
        self.rd.log(line)
        print(f"note: {line}", file=sys.stderr)

    def save(self, name):
        t = self.t
        state = dict(run_id=t.doc["run_id"], step=t.step, updates=t.updates, best_val_loss=self.best,
                     sampler=t.sampler.state_dict(), scaler=t.scaler.state_dict(),
                     **({"fp16_scales": t.model.scales.to_dict()} if t.model.guarded else {}))
        save_checkpoint(self.rd.checkpoints / name, t.cfg.to_dict(), t.model.params, t.opt.state_dict(), state,
                        mkdir=False, lora=t.lora)

    def row(self, rec):
        """A micro-step's row into metrics.jsonl, and the progress line."""
        self.last_loss = rec["loss"]
        rec.update(t=round(time.time(), 3), **(self.usage.sample() if rec["step"] % self.spec.log_every == 0 else {}))
        self.rd.append(self.metrics, rec)
        self.reports.row(rec)
        self.progress(rec)

    def checkpoint(self):
        """Validate, then write best.ckpt (if better) before latest.ckpt, so that latest's best loss
        is never ahead of best.ckpt."""
        step, val = self.t.step, self.t.val_loss()
        row = dict(step=step, val_loss=finite(val))
        self.rd.append(self.metrics, row)
        self.reports.row(row)
        better = val < self.best
        if better:
            self.best = val
            self.save(BEST)
        self.save(LATEST)
        self.status("running")
        self.log(f"step {step}: val loss {val:.4f}{' (best)' if better else ''}, checkpoint saved")

    def sample(self, step):
        """Every sample_every micro-steps: a sample of text from the weights after `step`."""
        t, every = self.t, self.spec.sample_every
        if not (t.tokenizer and every and step % every == 0):
            return
        params = merged(t.model.params, t.lora) if t.lora else t.model.params
        decoder = Decoder(t.cfg, params, vocab_ids=t.model.active)
        text = generate(decoder, t.tokenizer, steps=min(65, t.cfg.seq), seed=step)
        with open(self.rd / "samples.jsonl", "a") as f:
            self.rd.append(f, dict(step=step, text=text))
        self.reports.sample(step, text)
        shown = text or "(empty: the model's first token ended the text)"     # BOS drawn at once
        print(f"\n--- sample at step {step} ---\n{shown}\n---", flush=True)

    # -- the terminal
    def progress(self, rec):
        steps, step = self.spec.steps, self.t.step
        eta = (time.perf_counter() - self.t.t_run) / (step - self.start_step) * (steps - step)
        line = (f"step {step}/{steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} | "
                f"{rec['ms_step']:.1f} ms/step | {rec['tokens_per_s']:.0f} tok/s | ETA {fmt_time(eta)}")
        due = step % self.spec.log_every == 0 or step == steps
        if self.live:
            print("\r" + line + "\033[K", end="", flush=True)
        elif due:
            print(line, flush=True)
        if due:
            self.status("running", lr=rec["lr"])

    # -- how the run ends
    def stopped(self):
        """A stop at an update boundary (its checkpoint written): the line saying how to go on; the exit code
        (130: stopped by a signal)."""
        print(f"stopped: checkpoint at step {self.t.step}; continue with --resume --run-dir {self.rd.path}",
              file=sys.stderr)
        return 130 if self.t.stop_requested else 0

    def failed(self, how, why):
        """After an exception (`how`: "stopped" by a second signal, or "failed"): what can still be written,
        and nothing where the folder was."""
        gone = self.rd.vanished()
        for write in (self.metrics.close, lambda: self.reports.close(ok=False), *(() if gone else (
                lambda: self.status(how, error=why), lambda: self.log(f"{how} at step {self.t.step}: {why}")))):
            with contextlib.suppress(Exception):
                write()
        if how == "stopped":
            print(f"\nstopped at once; continue from the last checkpoint with --resume --run-dir {self.rd.path}",
                  file=sys.stderr)

    def restarting(self, msg):
        self.metrics.close()
        self.reports.close()
        self.status("restarting")
        self.log(msg)
        print("\n" + msg, file=sys.stderr, flush=True)

    def finished(self, state):
        """The end (finished, or stopped with a checkpoint): the rows of a window cut short go (they are
        redone on resume), the status and log say it, then the report."""
        self.metrics.close()
        self.reports.close()
        self.rd.rewind(self.t.step)
        self.status(state)
        self.log(f"{state} at step {self.t.step}")
        if self.live:
            print()
        if self.t.n_timed:
            self.report()

    def report(self):
        """The reference's end-of-run Efficiency Report (simulator figures on the simulator)."""
        t = self.t
        cfg, n, wall = t.cfg, t.n_timed, time.perf_counter() - t.t_run
        per = {k: v / n for k, v in t.sums.items()}
        flops = step_flops(cfg, len(t.model.active))["total"]
        total = per["total"] or 1e-9
        parts = step_parts(per)
        label = "simulator" if t.device.name == "sim" else t.device.name
        lines = [f"=== Efficiency Report ({label}, {self.spec.precision}) ===",
                 f"micro-steps {n}{f' (rank 0 of {t.world.size})' if t.world.size > 1 else ''}, "
                 f"wall {fmt_time(wall)}, compile {t.compile_s:.2f} s "
                 f"({t.device.compiles} compiles)",
                 f"forward+backward {total:.1f} ms/step, {cfg.seq / total * 1e3:.0f} tokens/s, "
                 f"{flops / total / 1e6:.1f} GFLOP/s"]
        for k, label in (("eval", "kernel eval"), ("io", "surface I/O + fp16"), ("cpu", "CPU ops + loss"),
                         ("cls", "classifier sgemm"), ("dw_wait", "dW sgemm / wait")):
            lines.append(f"  {label:20s} {parts[k]:8.2f} ms  {100 * parts[k] / total:5.1f}%")
        best = f"{self.best:.4f}" if math.isfinite(self.best) else "– (no validation yet)"
        lines.append(f"best validation loss {best}")
        print("\n".join(lines), flush=True)
        self.log("\n".join(lines))


def live_progress():
    """Whether stdout is a terminal, for the progress line. A rank's stdout is mpirun's pty even when
    mpirun's own is a file: `--ranks N` tells the ranks (TTY_VARIABLE); plain mpirun gets plain lines."""
    if launched_rank() is not None:
        return os.environ.get(TTY_VARIABLE) == "1"
    return sys.stdout.isatty()


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
