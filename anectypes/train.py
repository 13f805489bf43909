"""python -m anectypes.train — train a Llama-style model with the ten dynamic-weight kernels.

    python -m anectypes.train --scratch                 # tiny model on the built-in corpus, offline
    python -m anectypes.train --scratch --model stories15m --data tok.bin --tokenizer tokenizer.bin
    python -m anectypes.train --resume [--run-dir runs/X] [--steps N] [--from best]
    python -m anectypes.train --ranks 2 --scratch        # data-parallel on 2 MPI ranks (anectypes.distributed)

The run folder's files and the run spec are anectypes.runs'. Checkpoints are taken at update
boundaries, so --resume (and the restart forced by the compile budget) continues with the same
losses an uninterrupted run would have produced.
"""

import argparse
import contextlib
import errno
import io
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import fields
from pathlib import Path

import numpy as np

from .host import blas
from .cli import ArgumentParser
from .formats.checkpoint import load_checkpoint, save_checkpoint
from .data.corpus import builtin_dataset
from .data.tokens import BatchSampler, active_vocab, load_tokens, split
from .device import open_device
from .distributed import RESTART_STATUS, TTY_VARIABLE, World, launch, launched_rank, mpirun_command
from .mil.limits import CHIPS
from .errors import AnectypesError, CheckpointError
from .generate.sampling import generate
from .sources import resolve as load_source
from .model.config import ModelConfig, init_params, load_config
from .generate.decoder import Decoder
from .model.flops import step_flops
from .model.chips import check_training
from .model.kernels import KERNELS
from .model.loss import cross_entropy
from .model.transformer import TIMES, Transformer, step_parts
from .optim import AdamW, LossScaler, Schedule
from .runs import (BEST, LATEST, SCHEDULES, SPEC_FIELDS, RunDir, RunError, RunSpec, check_value, model_name, new_run_id,
                   python_argv)
from .host.processes import ProcessUsage
from .data.tokenizer import Tokenizer

PATH_FIELDS = ("data", "tokenizer", "init_from")


# --- the command line -----------------------------------------------------------------------------------

def spec_type(f):
    """argparse type for a RunSpec field: parse, then the spec's own check."""
    parse = {"int": int, "float": float}.get(f.metadata["kind"], str)

    def convert(text):
        try:
            value = parse(text)
            check_value(f, value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if parse is int else 'a number'}, "
                                             f"got {text!r}") from None
        except RunError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{f.name} ")) from None
        return value
    return convert


def spec_default(f):
    if f.name in SCHEDULES[None]:
        return f"{SCHEDULES[None][f.name]:g}; tiny: {SCHEDULES['tiny'][f.name]:g}"
    if f.name in ("data", "tokenizer"):
        return "the built-in corpus" + ("'s" if f.name == "tokenizer" else "")
    return "off" if f.default is False else "none" if f.default is None else f.default


def parse_args(argv):
    """(args, the spec fields given on the command line)."""
    ap = ArgumentParser(prog="python -m anectypes.train", description=__doc__.splitlines()[0])
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--scratch", action="store_true", help="start a new run from a fresh random init")
    start.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir (default: the newest run) with its own spec")
    ap.add_argument("--from", dest="resume_from", choices=("latest", "best"),
                    help="with --resume: the checkpoint to continue from; best rewinds the run to best.ckpt's "
                         "step, dropping what came after (default: latest)")
    for f in fields(RunSpec):
        flag, text = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {spec_default(f)})"
        group = start if f.name == "init_from" else ap
        if f.metadata["kind"] == "bool":
            group.add_argument(flag, action="store_const", const=True, help=text)
        else:
            group.add_argument(flag, type=spec_type(f), choices=f.metadata.get("choices"), help=text,
                               metavar="SOURCE" if f.name == "init_from" else None)
    ap.add_argument("--run-dir", help="the run folder (default: runs/<time>-<model> for a new run, the newest "
                                      "run with a checkpoint for --resume)")
    ap.add_argument("--compile-budget", type=spec_type(SPEC_FIELDS["steps"]), default=119,
                    help="compiles per process before it checkpoints and restarts, for the ANE compiler's "
                         "leak (default: 119)")
    ap.add_argument("--stop-after", type=spec_type(SPEC_FIELDS["steps"]), metavar="STEP",
                    help="checkpoint and stop at the end of the update that holds this micro-step, as checkpoints "
                         "are taken at update boundaries (default: train to --steps)")
    ap.add_argument("--hostfile", help="with --ranks N: mpirun's hostfile, the machines to run the ranks on "
                                       "(default: this machine)")
    ap.add_argument("--chip", choices=list(CHIPS), help="on the simulator (--backend sim, or auto without an "
                    "ANE): apply this chip's known limits (docs/ane-reference.md §3.10) and its MIL dialect "
                    "(default: none, i.e. m5 and ios18)")
    args = ap.parse_args(argv)
    if args.resume_from and not args.resume:
        ap.error(f"--from {args.resume_from} goes with --resume")
    given = {f.name: getattr(args, f.name) for f in fields(RunSpec) if getattr(args, f.name) is not None}
    for k in PATH_FIELDS:
        if k in given:
            given[k] = os.path.abspath(given[k])
    if given.get("model", "").endswith(".json"):
        given["model"] = os.path.abspath(given["model"])
    return args, given


class Unbroken:
    """The trainer's stdout or stderr, whose reader may go away (`train ... | head`): the run goes on,
    its output to /dev/null from then on (train.log and metrics.jsonl have it all)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.unless_broken("write", text)

    def flush(self):
        self.unless_broken("flush")

    def unless_broken(self, name, *args):
        try:
            return getattr(self.stream, name)(*args)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())   # also for what is still buffered

    def __getattr__(self, name):
        return getattr(self.stream, name)


def main(argv=None):
    with contextlib.redirect_stdout(Unbroken(sys.stdout)), contextlib.redirect_stderr(Unbroken(sys.stderr)):
        return train(sys.argv[1:] if argv is None else argv)


def train(argv):
    try:
        world = World()
    except AnectypesError as e:
        if not launched_rank():                    # rank 0 (or no rank) says it once
            print(f"error: {e}", file=sys.stderr)
        return 1
    with contextlib.redirect_stderr(io.StringIO()) if world.rank else contextlib.nullcontext():
        args, given = parse_args(argv)            # a bad flag: rank 0 says so
    trainer, error, run = None, None, None
    try:
        blas.library_path()                        # a BLAS that does not load stops here, before the run folder
        run = world.root(resolve_run, args, given, world.size if world.mpi else None)
        if world.root(complete_cut_short_finish, run):
            return 0
        if run[1].ranks > 1 and not world.mpi:
            return launch_ranks(args, argv, run)
        trainer = world.agree(Trainer, args, given, run, world)
        return trainer.run()
    except AnectypesError as e:
        error = e
    except OSError as e:
        error = AnectypesError(os_error(e, run and run[0]))
    except MemoryError:
        error = AnectypesError("out of memory; choose a smaller model or free memory")
    except BaseException:
        if trainer and world.size > 1:             # the other ranks may be waiting for this one
            traceback.print_exc()
            world.abort(1)
        raise
    finally:
        if run:
            run[0].release()
    line = world.say(error)
    if line:
        print(line, file=sys.stderr)
    if trainer and world.size > 1:
        world.abort(1)
    return 1


def launch_ranks(args, argv, run):
    """--ranks N outside mpirun: run the ranks under mpirun, and again with --resume after each
    compile-budget stop (RESTART_STATUS)."""
    rd, spec = run[0], run[1]
    if args.hostfile and not os.path.isfile(args.hostfile):
        raise RunError(f"--hostfile {args.hostfile}: no such file (one line per machine: NAME slots=1)")
    mpirun = mpirun_command(spec.ranks, args.hostfile)
    first = python_argv(*argv, *([] if args.run_dir else ["--run-dir", str(rd.path)]))
    rd.unlock()                                    # rank 0 takes the folder
    return launch(mpirun, first, resume_argv(args, rd.path))


def resume_argv(args, run_dir):
    """The command that continues the run in run_dir with this process's own options (a restart's)."""
    return python_argv("--resume", "--run-dir", str(run_dir), "--compile-budget", str(args.compile_budget),
                       *(["--stop-after", str(args.stop_after)] if args.stop_after else []),
                       *(["--chip", args.chip] if args.chip else []))


def os_error(e, rd=None):
    """One line for a failed file operation of the run in `rd`: which file, and what to do for the usual causes."""
    where = f"{e.filename}: " if e.filename else ""
    if rd and rd.vanished():
        return f"{rd.path}: the run folder was removed or moved away; stopping"
    if e.errno == errno.ENOSPC:
        if rd and not (rd.latest.is_file() or rd.best.is_file()):
            return f"{where}disk full before the run's first checkpoint: free space, then start it again with --resume"
        return f"{where}disk full; the last checkpoint is kept: free space, then continue with --resume"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{where}{e.strerror}: the run folder must be writable; choose another --run-dir"
    return f"{where}{e.strerror or e}"


# --- resolving a run: folder, spec, checkpoint, data, model (nothing is written before all checks out) ---

def open_run(rd, args, given):
    """(spec, config document, checkpoint or None, what --resume extended or None, the checkpoint's file
    name or None) of the run in the claimed folder rd."""
    if not args.resume:
        if rd.has_checkpoint():
            raise RunError(f"{rd.path} already holds a run; use --resume or another --run-dir")
        label = {"model": Path(args.init_from).stem} if args.init_from else {}   # the source holds the model
        return RunSpec(**{**label, **given}).resolved(), {"run_id": new_run_id()}, None, None, None
    stored, doc = rd.read_config()
    spec = stored.merge_resume(given)
    ckpt, name = resume_checkpoint(rd, doc, args.resume_from or "latest")
    if ckpt and spec.steps != stored.steps and spec.steps <= ckpt.state["step"]:
        raise RunError(f"--steps {spec.steps}: the run's {name} is at step {ckpt.state['step']} already; to train "
                       f"further, pass --steps N with N > {ckpt.state['step']}")
    extended = f"steps {stored.steps} -> {spec.steps}" if spec.steps != stored.steps else None
    return spec, doc, ckpt, extended, name


def resolve_run(args, given, ranks=None):
    """The claimed run folder, open_run's answer and the --init-from source (None on a resume): what
    rank 0 reads from files. Under mpirun, `ranks` is its process count: the run's rank count (given or
    stored) must be it."""
    if ranks and given.setdefault("ranks", ranks) != ranks:
        raise RunError(f"--ranks {given['ranks']} but mpirun started {ranks} processes")
    if not (args.scratch or args.resume or args.init_from):
        raise AnectypesError("say how to start: --scratch, --resume or --init-from SOURCE")
    rd = claim_run_dir(args, given)
    try:
        spec, doc, ckpt, extended, name = open_run(rd, args, given)
        ref = load_source(spec.init_from) if spec.init_from and not ckpt else None
    except BaseException:
        rd.release()
        raise
    return rd, spec, doc, ckpt, extended, ref, name


def complete_cut_short_finish(run):
    """Whether the run's last checkpoint is at its last step while its status does not say finished (a
    kill landed between the two writes that end a run: the checkpoint, then the status); if so, what
    that end did not write: the status and the log line (the run's files are whole)."""
    rd, spec, _, ckpt = run[:4]
    status = rd.read_status()
    if not ckpt or ckpt.state.get("step", 0) < spec.steps or status.get("state") == "finished":
        return False
    state, step = ckpt.state, ckpt.state["step"]
    rd.write_status("finished", step=step, steps=spec.steps, updates=state.get("updates", 0), loss=status.get("loss"),
                    best_val_loss=finite(state.get("best_val_loss", math.inf)))
    rd.log(f"finished at step {step}")
    print(f"{rd.path}: its last checkpoint, at step {step} of {spec.steps}, was written before it was stopped; "
          "marked finished")
    return True


def resume_checkpoint(rd, doc, which):
    """(checkpoint, its file name) that --resume continues from (`which`: latest or best), or (None, None)
    for a run without any checkpoint (killed before its first: it starts again, nothing trained is lost).
    Without latest.ckpt the resume stops, changing nothing, unless best.ckpt is the newest checkpoint
    the run took (a kill inside the first latest.ckpt write, which comes after best's)."""
    if which == "best":
        return checkpoint_of_run(rd.best, rd, doc), BEST
    if rd.latest.is_file():
        return checkpoint_of_run(rd.latest, rd, doc), LATEST
    if not rd.latest.exists() and not rd.best.exists():
        return None, None
    if not rd.latest.exists() and rd.best.is_file():
        ckpt = checkpoint_of_run(rd.best, rd, doc)
        if all(r["step"] <= ckpt.state["step"] for r in rd.rows() if "val_loss" in r):
            return ckpt, BEST
    raise RunError(f"{rd.latest} is {'not a file' if rd.latest.exists() else 'missing'}: --resume continues from it; "
                   + ("to continue from best.ckpt instead (the run goes back to its step), pass --resume --from best"
                      if rd.best.is_file() else "the run has no best.ckpt either, so nothing to continue from"))


def checkpoint_of_run(path, rd, doc):
    """The checkpoint at path, refused unless it belongs to this run (its id and model)."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        if path == rd.latest and rd.best.is_file():
            raise CheckpointError(f"{e} (--resume --from best continues from best.ckpt)") from None
        raise
    if ckpt.state.get("run_id") != doc.get("run_id") or ckpt.config != doc.get("model"):
        raise CheckpointError(f"{path} does not belong to this run (another run's or another "
                              "model's checkpoint); remove it, or resume the run it came from")
    return ckpt


def data_and_model(spec, doc, ref, given):
    """(tokenizer, tokens, ModelConfig): the built-in corpus unless --data (the tokenizer gives the
    vocabulary); the model is the run's own (a resume), the --init-from source's (interop.load), or the
    spec's."""
    base = ModelConfig(**doc["model"]).validate() if "model" in doc else ref.cfg if ref else None
    if ref and "model" in given and load_config(spec.model, vocab=ref.cfg.vocab) != ref.cfg:
        raise AnectypesError(f"--init-from {spec.init_from} holds a model unlike --model {spec.model}: {ref.cfg}")
    tokenizer = Tokenizer.load(spec.tokenizer) if spec.tokenizer else None
    if spec.data:
        vocab = tokenizer.vocab_size if tokenizer else None
        tokens = load_tokens(spec.data, vocab or (base or load_config(spec.model)).vocab)
    else:
        tokenizer, tokens = builtin_dataset()
        vocab = tokenizer.vocab_size
    cfg = (base or load_config(spec.model, vocab=vocab)).check_fits(spec.model)
    if vocab and cfg.vocab < vocab:
        raise AnectypesError(f"the model's vocabulary ({cfg.vocab}) is smaller than the data's ({vocab})")
    if ref and vocab and cfg.vocab != vocab:
        raise AnectypesError(f"--init-from {spec.init_from} has a vocabulary of {cfg.vocab} tokens but the "
                             f"tokenizer has {vocab}: pass the source's own with --tokenizer (and data in it)")
    return tokenizer, tokens, cfg


def split_data(tokens, seq):
    """The training part and the held-out last 10%, each long enough for one window."""
    train, val = split(tokens)
    if len(train) < seq + 1 or len(val) < seq + 1:
        raise AnectypesError(f"data has {len(tokens)} tokens: too short for seq {seq} "
                             "(need seq+1 tokens in both the training and the 10% validation part)")
    return train, val


# --- the trainer --------------------------------------------------------------------------------------

class Trainer:
    """One run: resolve its spec, build its parts, then run() trains it window by window."""

    def __init__(self, args, given, run, world):
        self.args, self.world, self.lead = args, world, world.rank == 0     # rank 0 writes the run folder
        self.rd, self.spec, self.doc, ckpt, self.extended, ref, self.resumed_from = run
        spec, state = self.spec, ckpt.state if ckpt else {}
        self.tokenizer, tokens, self.cfg = data_and_model(spec, self.doc, ref, given)
        self.train_tokens, self.val_tokens = split_data(tokens, self.cfg.seq)
        self.step, self.updates = state.get("step", 0), state.get("updates", 0)
        self.best = state.get("best_val_loss", math.inf)
        if self.step >= spec.steps:
            raise RunError(f"{self.rd.path} is finished: step {self.step} of {spec.steps}; to train further, "
                           f"pass --resume --steps N with N > {self.step}")
        # the parts: schedule, device and model (compiled kernels), optimizer, loss scaler, data sampler
        self.schedule = Schedule(spec.lr, spec.warmup, spec.steps, spec.min_lr_frac)
        t0 = time.perf_counter()
        if args.chip and spec.backend == "ane":
            raise RunError("--chip simulates a chip's limits: use it with --backend sim (or auto without an ANE)")
        self.device = open_device(spec.backend, precision=spec.precision, compile_budget=args.compile_budget,
                                  **({"chip": args.chip} if args.chip else {}))
        if self.device.notice:
            print(self.device.notice, file=sys.stderr)
        check_training(self.cfg, self.device)            # what the chip is known to refuse, said at once
        params = ckpt.params if ckpt else ref.params if ref else init_params(self.cfg, np.random.default_rng(spec.seed))
        self.model = Transformer(self.cfg, self.device, params, active_vocab(tokens), exact=spec.exact_accum)
        self.compile_s = time.perf_counter() - t0
        self.opt = AdamW(self.model.params)
        self.scaler = LossScaler(spec.loss_scale, dynamic=spec.dynamic_loss_scale)
        self.sampler = BatchSampler(self.train_tokens, self.cfg.seq, seed=spec.seed)
        if ckpt:
            self.opt.load_state_dict(ckpt.optimizer)
            self.sampler.load_state_dict(state["sampler"])
            self.scaler.load_state_dict(state["scaler"])
        self.doc.update(spec=spec.to_dict(), model=self.cfg.to_dict(), model_name=model_name(spec.model),
                        device=self.device.name, active_vocab=len(self.model.active), params=self.cfg.n_params())
        # what run() keeps track of
        self.metrics = None                    # metrics.jsonl, open for appending while training
        self.stop_requested = False            # a Ctrl-C/SIGTERM arrived: stop after this micro-step
        self.updates_here = 0                  # updates made by this process (restarts need progress)
        self.last_loss = None
        self.live = live_progress()           # the progress line rewritten in place (a terminal)
        self.start_step, self.t_run = self.step, None
        self.sums, self.n_timed = dict.fromkeys(TIMES, 0.0), 0

    # -- run folder
    def status(self, state, **extra):
        if self.lead:
            self.rd.write_status(state, step=self.step, steps=self.spec.steps, updates=self.updates,
                                 loss=self.last_loss, best_val_loss=finite(self.best), **extra)

    def log(self, line):
        if self.lead:
            self.rd.log(line)

    def save(self, name):
        if not self.lead:
            return
        state = dict(run_id=self.doc["run_id"], step=self.step, updates=self.updates, best_val_loss=self.best,
                     sampler=self.sampler.state_dict(), scaler=self.scaler.state_dict())
        save_checkpoint(self.rd.checkpoints / name, self.cfg.to_dict(), self.model.params, self.opt.state_dict(),
                        state, mkdir=False)

    # -- the loop
    def run(self):
        """Train until done or stopped; the exit code (130: stopped by a signal)."""
        self.take_over()
        # under mpirun, a launcher's stop arrives as SIGUSR1 (mpirun forwards it, see distributed.launch)
        signals = (signal.SIGINT, signal.SIGTERM, *([signal.SIGUSR1] if self.world.mpi else []))
        previous = {sig: signal.signal(sig, self.on_signal) for sig in signals}
        try:
            state = self.train()
            if state == "restarting":
                return self.restart()
            self.finish(state)
        except BaseException as e:
            how = "stopped" if isinstance(e, KeyboardInterrupt) else "failed"
            why = "stopped at once; the last checkpoint is kept" if how == "stopped" else f"{type(e).__name__}: {e}"
            gone = self.rd.vanished()               # nothing is written where the folder was
            for cleanup in (self.metrics.close, self.model.close, *(() if gone else (
                    lambda: self.status(how, error=why), lambda: self.log(f"{how} at step {self.step}: {why}")))):
                with contextlib.suppress(Exception):
                    cleanup()
            if how == "stopped":
                if self.lead:
                    print(f"\nstopped at once; continue from the last checkpoint with --resume --run-dir "
                          f"{self.rd.path}", file=sys.stderr)
                if self.world.size > 1:
                    self.world.abort(130)
                return 130
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if state == "stopped" and self.lead:
            print(f"stopped: checkpoint at step {self.step}; continue with --resume --run-dir {self.rd.path}",
                  file=sys.stderr)
            return 130 if self.stop_requested else 0
        return 0

    def take_over(self):
        """The run folder as this process starts on it (still the folder it claimed: one removed meanwhile
        stays gone): no stale temporary files, latest.ckpt the checkpoint it resumes from, the rows of
        the checkpoint's steps only, the config and a running status; the banner."""
        cfg, spec, rd = self.cfg, self.spec, self.rd
        self.t_run = time.perf_counter()
        if not self.lead:
            return
        if rd.vanished():
            raise RunError(f"{rd.path}: the run folder was removed or moved away while this trainer started; "
                           "nothing was written")
        rd.checkpoints.mkdir(exist_ok=True)
        rd.clean_temp()
        if self.resumed_from == BEST:
            self.save(LATEST)                      # before the rows go back to its step
        rd.rewind(self.step)                       # rows past the checkpoint are produced again
        rd.write_config(self.doc)
        self.status("running")
        how = "resumed" if self.args.resume else "started"
        notes = ", ".join(n for n in (self.extended, self.resumed_from == BEST and f"from {BEST}") if n)
        rd.log(f"{how} at step {self.step} of {spec.steps}{f' ({notes})' if notes else ''}: {' '.join(spec.argv())}")
        print(f"run dir {rd.path} | model {model_name(spec.model)} ({cfg.n_params() / 1e6:.2f}M params, "
              f"{cfg.layers} layers, dim {cfg.dim}, seq {cfg.seq}, vocab {cfg.vocab} -> "
              f"{len(self.model.active)} active) | {self.device.name} {spec.precision} | "
              f"{len(KERNELS)} kernels compiled in {self.compile_s:.2f} s"
              f"{f' | {spec.ranks} ranks' if spec.ranks > 1 else ''}", flush=True)
        self.metrics = open(rd / "metrics.jsonl", "a")
        self.usage = ProcessUsage()                # the cpu_pct and rss_mb of the metrics rows

    def train(self):
        """For each update: its micro-steps, this rank's share of them (all of them in one process: see
        anectypes.distributed for the data order), the update, then every save_every updates a checkpoint.
        Returns how the run ended."""
        spec, stop_after, world = self.spec, self.args.stop_after, self.world
        while self.step < spec.steps:
            if world.any(self.stop_requested or stop_after and self.step >= stop_after):
                return "stopped"
            if self.updates_here and world.any(self.device.compile_budget - self.device.compiles < len(KERNELS)):
                return "restarting"
            window = min(spec.accum * world.size, spec.steps - self.step)
            window_step, window_sampler = self.step, self.sampler.state_dict()
            mine = []                                    # this rank's metrics rows of the window
            for j in range(window):
                batch = self.sampler.sample()
                if j % world.size == world.rank:
                    mine.append(self.micro_step(*batch, window_step + j))
                if j == window - 1:
                    break
                if world.size == 1:
                    self.emit(mine.pop())
                self.sample(window_step + j + 1)         # before the update, like the micro-step's weights
                if self.stop_requested and world.size == 1:
                    # an unfinished window: drop its gradients, it is redone on resume
                    self.step = window_step
                    self.sampler.load_state_dict(window_sampler)
                    self.model.zero_grads()
                    return "stopped"
            self.update(window_step + window, window, mine)
            for rec in sorted(world.gather(mine) or [], key=lambda r: r["step"]):
                self.emit(rec)
            self.step = window_step + window
            self.sample(self.step)
            if self.updates % spec.save_every == 0 and self.step < spec.steps:
                self.checkpoint()
        return "finished"

    def micro_step(self, x, y, step):
        """Forward+backward of one sequence, global micro-step `step` (0-based): its metrics row."""
        self.t_micro = time.perf_counter()
        self.model.reset_times()
        loss = self.model.forward_backward(x, y, self.scaler.scale)
        rec = dict(step=step + 1, loss=loss, lr=self.schedule.lr(step), grad_norm=None, loss_scale=self.scaler.scale)
        self.time_row(rec)
        for k in TIMES:
            self.sums[k] += self.model.times[k]
        self.n_timed += 1
        if self.world.size > 1:
            rec["rank"] = self.world.rank
        return rec

    def time_row(self, rec):
        """A row's step time (from its micro-step's start until now) and breakdown."""
        ms = (time.perf_counter() - self.t_micro) * 1e3
        rec.update(ms_step=ms, tokens_per_s=self.cfg.seq / ms * 1e3,
                   **{f"t_{k}": round(v, 3) for k, v in step_parts(self.model.times).items()})

    def emit(self, rec):
        """Rank 0: a micro-step's row into metrics.jsonl and the progress line."""
        self.step, self.last_loss = rec["step"], rec["loss"]
        rec.update(t=round(time.time(), 3), **(self.usage.sample() if self.step % self.spec.log_every == 0 else {}))
        self.rd.append(self.metrics, rec)
        self.progress(rec)

    def update(self, end, window, mine):
        """Sum the gradients over the ranks, then unscale, clip, AdamW, re-stage weights, zero the
        gradients (one pass); an inf/NaN gradient skips the update. The update's time counts in this
        rank's last row; the window's last row (at step `end`) gets the norm and the new loss scale."""
        if self.world.size > 1:
            self.model.wait()
            self.world.sum(self.model.summed)
        norm = self.model.update(self.opt, self.schedule.lr(end - 1), self.scaler.scale * window, self.spec.clip)
        self.scaler.update(norm is not None)
        if norm is None:
            self.log(f"step {end}: inf/NaN gradient, update skipped (loss scale -> {self.scaler.scale})")
        self.updates += 1
        self.updates_here += 1
        if mine:
            self.time_row(mine[-1])
            if mine[-1]["step"] == end:
                mine[-1].update(grad_norm=norm, loss_scale=self.scaler.scale)

    def checkpoint(self):
        """Validate, then write best.ckpt (if better) before latest.ckpt, so that latest's best loss
        is never ahead of best.ckpt. Under MPI every rank checks first that all hold the same weights."""
        self.world.check_same([*self.model.params.values(), np.frombuffer(repr(self.sampler.state_dict()).encode(),
                                                                         np.uint8)], self.step)
        if not self.lead:
            return
        val = self.val_loss()
        self.rd.append(self.metrics, dict(step=self.step, val_loss=finite(val)))
        better = val < self.best
        if better:
            self.best = val
            self.save("best.ckpt")
        self.save("latest.ckpt")
        self.status("running")
        self.log(f"step {self.step}: val loss {val:.4f}{' (best)' if better else ''}, checkpoint saved")

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

    def sample(self, step):
        """Rank 0, every sample_every micro-steps: a sample of text from the weights after `step`."""
        every = self.spec.sample_every
        if not (self.lead and self.tokenizer and every and step % every == 0):
            return
        decoder = Decoder(self.cfg, self.model.params, vocab_ids=self.model.active)
        text = generate(decoder, self.tokenizer, steps=min(65, self.cfg.seq), seed=step)
        with open(self.rd / "samples.jsonl", "a") as f:
            self.rd.append(f, dict(step=step, text=text))
        print(f"\n--- sample at step {step} ---\n{text}\n---", flush=True)

    def progress(self, rec):
        steps, done = self.spec.steps, self.step - self.start_step
        eta = (time.perf_counter() - self.t_run) / done * (steps - self.step)
        line = (f"step {self.step}/{steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} | "
                f"{rec['ms_step']:.1f} ms/step | {rec['tokens_per_s']:.0f} tok/s | ETA {fmt_time(eta)}")
        due = self.step % self.spec.log_every == 0 or self.step == steps
        if self.live:
            print("\r" + line + "\033[K", end="", flush=True)
        elif due:
            print(line, flush=True)
        if due:
            self.status("running", lr=rec["lr"])

    def on_signal(self, signum, frame):
        """First Ctrl-C/SIGTERM: stop after this micro-step with a checkpoint; a second one: now."""
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True

    def restart(self):
        """The compile budget left cannot cover rebuilding the kernels: checkpoint, exec a fresh process;
        under mpirun (which exec cannot replace), every rank exits with RESTART_STATUS instead, for
        `--ranks N` (or a loop around mpirun) to start the job again with --resume."""
        self.save("latest.ckpt")
        again = (f"every rank exits with status {RESTART_STATUS}: run mpirun again with --resume --run-dir "
                 f"{self.rd.path}" if self.world.mpi else "restarting the process with --resume")
        msg = (f"compile budget: {self.device.compiles} of {self.device.compile_budget} used; {again} "
               f"(the ANE compiler leaks after ~119 compiles)")
        if self.lead:
            self.metrics.close()
            self.status("restarting")
            self.log(msg)
            print("\n" + msg, file=sys.stderr, flush=True)
        self.model.close()                # unload the kernels: exec does not run destructors
        if self.world.mpi:
            self.world.barrier()          # the checkpoint is written before any rank exits
            return RESTART_STATUS
        self.rd.hand_over()               # the new process holds the folder from its first instruction
        os.execv(sys.executable, resume_argv(self.args, self.rd.path))

    def finish(self, state):
        if state == "finished":
            self.checkpoint()
        else:
            self.save("latest.ckpt")
        if not self.lead:
            self.model.close()
            return
        self.metrics.close()
        self.rd.rewind(self.step)            # a stop inside a window: its rows are redone on resume
        self.model.close()
        self.status(state)
        self.log(f"{state} at step {self.step}")
        if self.live:
            print()
        if self.n_timed:
            self.report(self.sums, self.n_timed, time.perf_counter() - self.t_run)

    def report(self, sums, n, wall):
        """The reference's end-of-run Efficiency Report (simulator figures on the simulator)."""
        cfg, per = self.cfg, {k: v / n for k, v in sums.items()}
        flops = step_flops(cfg, len(self.model.active))["total"]
        total = per["total"] or 1e-9
        parts = step_parts(per)
        label = "simulator" if self.device.name == "sim" else self.device.name
        lines = [f"=== Efficiency Report ({label}, {self.spec.precision}) ===",
                 f"micro-steps {n}{f' (rank 0 of {self.world.size})' if self.world.size > 1 else ''}, "
                 f"wall {fmt_time(wall)}, compile {self.compile_s:.2f} s "
                 f"({self.device.compiles} compiles)",
                 f"forward+backward {total:.1f} ms/step, {cfg.seq / total * 1e3:.0f} tokens/s, "
                 f"{flops / total / 1e6:.1f} GFLOP/s"]
        for k, label in (("eval", "kernel eval"), ("io", "surface I/O + fp16"), ("cpu", "CPU ops + loss"),
                         ("cls", "classifier sgemm"), ("dw_wait", "dW sgemm / wait")):
            lines.append(f"  {label:20s} {parts[k]:8.2f} ms  {100 * parts[k] / total:5.1f}%")
        best = f"{self.best:.4f}" if math.isfinite(self.best) else "– (no validation yet)"
        lines.append(f"best validation loss {best}")
        print("\n".join(lines), flush=True)
        self.log("\n".join(lines))


def claim_run_dir(args, given):
    """The run folder (RunDir.claim: taken for this process before anything in it is read): --run-dir, the
    newest run with a checkpoint for --resume, or a new runs/<time>-<model>[-N]."""
    if args.run_dir:
        path = Path(args.run_dir)
        if path.exists() and not path.is_dir():
            raise RunError(f"--run-dir {path} is a file, not a folder; choose another --run-dir")
        return RunDir(path).claim(create=not args.resume)
    if args.resume:
        runs = sorted(Path("runs").glob("*/checkpoints/latest.ckpt"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise RunError("--resume: no run with a checkpoint under runs/; pass --run-dir")
        return RunDir(runs[-1].parent.parent).claim()
    name = model_name(given.get("model") or (Path(args.init_from).stem if args.init_from else "tiny"))
    return RunDir(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}").claim(fresh=True)


def live_progress():
    """Whether stdout is a terminal, for the progress line. A rank's stdout is mpirun's pty even when
    mpirun's own is a file: `--ranks N` tells the ranks (TTY_VARIABLE); plain mpirun gets plain lines."""
    if launched_rank() is not None:
        return os.environ.get(TTY_VARIABLE) == "1"
    return sys.stdout.isatty()


def finite(x):
    return x if x is not None and math.isfinite(x) else None


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


if __name__ == "__main__":
    sys.exit(main())
