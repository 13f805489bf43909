"""The trainer: one run's parts (data, device, model, optimizer, loss scaler, sampler) and its loop, window
by window: micro-steps, the update, now and then a checkpoint. Every rank runs the same loop; what a rank
writes goes through its writer (report.py), rank 0's alone writes anything."""

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import replace

import numpy as np

from ..data.tokens import BatchSampler, active_vocab
from ..device import open_device
from ..model.chips import check_training
from ..model.config import init_params
from ..model.kernels import KERNELS
from ..model.lora import init_adapters, of_spec
from ..model.loss import IGNORE, cross_entropy
from ..model.ranges import Scales
from ..model.transformer import TIMES, Transformer, step_parts
from ..runs import LATEST, TOKENS, RunError, default_loss_scale, model_name, python_argv
from .distributed import RESTART_STATUS
from .optim import AdamW, LossScaler, Schedule, update_model
from .report import run_writer
from .setup import data_and_model, split_data


class Trainer:
    """One run: build its parts from the resolved Run (setup.resolve_run), then run() trains it."""

    def __init__(self, args, given, run, world):
        self.args, self.world = args, world
        self.rd, self.spec, self.doc, ckpt, self.extended, ref, self.resumed_from = run
        spec, state = self.spec, ckpt.state if ckpt else {}
        self.tokenizer, tokens, mask, self.cfg = data_and_model(spec, self.doc, ref, given, self.rd / TOKENS,
                                                                write=world.rank == 0)
        self.train_tokens, self.val_tokens, train_mask, self.val_mask = split_data(tokens, self.cfg.seq, mask)
        if not ckpt and "loss_scale" not in given and default_loss_scale(self.cfg) != spec.loss_scale:
            # an imported model (α = 1): at 256 fp16 underflow zeroes most of its attention gradients
            self.spec = spec = replace(spec, loss_scale=default_loss_scale(self.cfg))
            print(f"note: loss scale {spec.loss_scale:g}, as for every model without residual scaling "
                  "(docs/model.md); --loss-scale sets another", file=sys.stderr)
        self.step, self.updates = state.get("step", 0), state.get("updates", 0)
        if self.step >= spec.steps:
            raise RunError(f"{self.rd.path} is finished: step {self.step} of {spec.steps}; to train further, "
                           f"pass --resume --steps N with N > {self.step}")
        # the parts: schedule, device and model (compiled kernels), optimizer, loss scaler, data sampler
        self.schedule = Schedule(spec.lr, spec.warmup, spec.steps, spec.min_lr_frac)
        t0 = time.perf_counter()
        if args.chip and spec.backend == "ane":
            raise RunError("--chip simulates a chip's limits: use it with --backend sim (or auto without an ANE)")
        self.device = open_device(spec.backend, precision=spec.precision, compile_budget=args.compile_budget,
                                  dialect=args.dialect, **({"chip": args.chip} if args.chip else {}))
        if self.device.notice:
            print(self.device.notice, file=sys.stderr)
        self.lora = of_spec(spec)
        check_training(self.cfg, self.device, self.lora)      # what the chip is known to refuse, said at once
        params = ckpt.params if ckpt else ref.params if ref else init_params(self.cfg, np.random.default_rng(spec.seed))
        if ckpt and ckpt.lora != self.lora:
            raise RunError(f"{self.rd.path}: its checkpoint's LoRA ({ckpt.lora}) is not its spec's ({self.lora})")
        if self.lora and not ckpt:   # into the source's own dict, whose frozen arrays go when the model keeps them in
            #                          its surfaces (Transformer.stage_weights)
            params.update(init_adapters(self.cfg, self.lora, np.random.default_rng(spec.seed)))
        vocabulary = np.arange(self.cfg.vocab) if spec.vocabulary == "full" else active_vocab(tokens)
        self.model = Transformer(self.cfg, self.device, params, vocabulary, exact=spec.exact_accum,
                                 lora=self.lora)
        if ckpt and (scales := Scales.from_dict(state.get("fp16_scales"), self.cfg)):
            self.model.restore_scales(scales)      # the scales it computed at: a resume continues bit for bit
        self.compile_s = time.perf_counter() - t0
        self.opt = AdamW(self.model.trainable)
        self.scaler = LossScaler(spec.loss_scale, dynamic=spec.dynamic_loss_scale)
        self.sampler = BatchSampler(self.train_tokens, self.cfg.seq, seed=spec.seed, mask=train_mask)
        if ckpt:
            self.opt.load_state_dict(ckpt.optimizer)
            self.sampler.load_state_dict(state["sampler"])
            self.scaler.load_state_dict(state["scaler"])
        self.doc.update(spec=spec.to_dict(), model=self.cfg.to_dict(), model_name=model_name(spec.model),
                        device=self.device.name, vocabulary=spec.vocabulary, active_vocab=len(self.model.active), params=self.cfg.n_params(),
                        trainable=sum(w.size for w in self.model.trainable.values()))
        # what run() keeps track of
        self.stop_requested = False            # a Ctrl-C/SIGTERM arrived: stop after this micro-step
        self.updates_here = 0                  # updates made by this process (restarts need progress)
        self.t_run = None                      # when run() started: the ETA's and the report's clock
        self.sums, self.n_timed = dict.fromkeys(TIMES, 0.0), 0
        self.out = run_writer(self, state.get("best_val_loss", math.inf))   # the run folder and the terminal

    def run(self):
        """Train until done or stopped; the exit code (130: stopped by a signal)."""
        self.t_run = time.perf_counter()
        self.out.take_over()
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
            with contextlib.suppress(Exception):
                self.model.close()
            self.out.failed(how, why)
            if how == "stopped":
                if self.world.size > 1:
                    self.world.abort(130)
                return 130
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.out.stopped() if state == "stopped" else 0

    def train(self):
        """For each update: its micro-steps, this rank's share of them (all of them in one process: see
        anectypes.train.distributed for the data order), the update, then every save_every updates a
        checkpoint. Returns how the run ended."""
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
                self.out.sample(window_step + j + 1)     # before the update, like the micro-step's weights
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
            self.out.sample(self.step)
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
        """A micro-step's row, written (rank 0 gets every rank's)."""
        self.step = rec["step"]
        self.out.row(rec)

    def update(self, end, window, mine):
        """Sum the gradients over the ranks, then the update (optim.update_model); an inf/NaN gradient
        skips it. The update's time counts in this rank's last row; the window's last row (at step `end`)
        gets the norm and the new loss scale."""
        if self.world.size > 1:
            self.model.wait()
            self.world.sum(self.model.summed)
        norm = update_model(self.model, self.opt, self.schedule.lr(end - 1), self.scaler.scale * window, self.spec.clip)
        self.scaler.update(norm is not None)
        if norm is None:
            self.out.log(f"step {end}: inf/NaN gradient, update skipped (loss scale -> {self.scaler.scale})")
        if note := self.model.adapt_scales(self.world.max if self.world.size > 1 else None):
            self.model.notes.append(note)
        for note in self.model.notes:
            self.out.note(f"step {end}: {note}")
        self.model.notes.clear()
        self.updates += 1
        self.updates_here += 1
        if mine:
            self.time_row(mine[-1])
            if mine[-1]["step"] == end:
                mine[-1].update(grad_norm=norm, loss_scale=self.scaler.scale)

    def checkpoint(self):
        """Under MPI every rank checks first that all hold the same weights; then the writer validates and
        writes the checkpoints."""
        self.world.check_same([*self.model.params.values(), np.frombuffer(repr(self.sampler.state_dict()).encode(),
                                                                         np.uint8)], self.step)
        self.out.checkpoint()

    def val_loss(self, windows=8):
        """Mean loss over fixed windows of the held-out 10% (their targets the mask keeps): the measure for
        `best`."""
        cfg, losses, seen = self.cfg, [], self.model.seen      # what validation shows chooses no scales: a resume
        #                                                          that did not validate must choose as this run does
        starts = np.linspace(0, len(self.val_tokens) - cfg.seq - 1, windows).astype(int)
        for s in starts:
            chunk = np.asarray(self.val_tokens[s:s + cfg.seq + 1], np.int64)
            keep = np.ones(cfg.seq, bool) if self.val_mask is None else self.val_mask[s + 1:s + cfg.seq + 1]
            if np.any(self.model.compact_of[chunk] < 0) or not keep.any():
                continue                                    # a token the training part never had, or no target
            logits = self.model.logits(chunk[:-1])
            losses.append(cross_entropy(logits, np.where(keep, self.model.compact_of[chunk[1:]], IGNORE))[0])
        self.model.seen = seen
        return float(np.mean(losses)) if losses else float("nan")

    def on_signal(self, signum, frame):
        """First Ctrl-C/SIGTERM: stop after this micro-step with a checkpoint; a second one: now."""
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True

    def restart(self):
        """The compile budget left cannot cover rebuilding the kernels: checkpoint, exec a fresh process;
        under mpirun (which exec cannot replace), every rank exits with RESTART_STATUS instead, for
        `--ranks N` (or a loop around mpirun) to start the job again with --resume."""
        self.out.save(LATEST)
        again = (f"every rank exits with status {RESTART_STATUS}: run mpirun again with --resume --run-dir "
                 f"{self.rd.path}" if self.world.mpi else "restarting the process with --resume")
        self.out.restarting(f"compile budget: {self.device.compiles} of {self.device.compile_budget} used; {again} "
                            f"(the ANE compiler leaks after ~119 compiles)")
        self.model.close()                # unload the kernels: exec does not run destructors
        if self.world.mpi:
            self.world.barrier()          # the checkpoint is written before any rank exits
            return RESTART_STATUS
        self.rd.hand_over()               # the new process holds the folder from its first instruction
        os.execv(sys.executable, resume_argv(self.args, self.rd.path))

    def finish(self, state):
        """Finished: a last checkpoint; stopped: latest.ckpt at this update boundary."""
        if state == "finished":
            self.checkpoint()
        else:
            self.out.save(LATEST)
        self.model.close()
        self.out.finished(state)


def resume_argv(args, run_dir):
    """The command that continues the run in run_dir with this process's own options (a restart's)."""
    return python_argv("--resume", "--run-dir", str(run_dir), "--compile-budget", str(args.compile_budget),
                       *(["--stop-after", str(args.stop_after)] if args.stop_after else []),
                       *(["--chip", args.chip] if args.chip else []),
                       *(["--dialect", args.dialect] if args.dialect else []))
