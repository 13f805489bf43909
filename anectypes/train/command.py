"""python -m anectypes.train — train a Llama-style model with the ten dynamic-weight kernels.

    python -m anectypes.train --scratch                 # tiny model on the built-in corpus, offline
    python -m anectypes.train --scratch --model stories15m --data tok.bin --tokenizer tokenizer.bin
    python -m anectypes.train --resume [--run-dir runs/X] [--steps N] [--from best]
    python -m anectypes.train --ranks 2 --scratch        # data-parallel on 2 MPI ranks (train/distributed.py)

The run folder's files and the run spec are anectypes.runs'. Checkpoints are taken at update
boundaries, so --resume (and the restart forced by the compile budget) continues with the same
losses an uninterrupted run would have produced.
"""

import argparse
import contextlib
import errno
import io
import os
import sys
import traceback
from dataclasses import fields

from ..cli import ArgumentParser
from ..device import add_dialect_flag
from ..errors import AnectypesError
from ..host import accelerate, blas
from ..mil.limits import CHIPS
from ..model.lora import DEFAULT_ALPHA, DEFAULT_TARGETS
from ..runs import SCHEDULES, SPEC_FIELDS, RunError, RunSpec, check_value, python_argv
from .distributed import World, launch, launched_rank, mpirun_command
from .setup import complete_cut_short_finish, resolve_run
from .trainer import Trainer, resume_argv

PATH_FIELDS = ("data", "tokenizer", "init_from")
LORA_DEFAULTS = dict(lora="off: full fine-tuning", lora_alpha=f"{DEFAULT_ALPHA:g}, PEFT's", lora_targets=DEFAULT_TARGETS)

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
    if f.name in LORA_DEFAULTS:
        return LORA_DEFAULTS[f.name]
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
                               metavar={"init_from": "SOURCE", "report_to": "NAMES"}.get(f.name))
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
    add_dialect_flag(ap)
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
        accelerate.library()                       # and so does a bad ANECTYPES_ACCELERATE
        run = world.root(resolve_run, args, given, world.size if world.mpi else None)
        if world.root(complete_cut_short_finish, run):
            return 0
        if run.spec.ranks > 1 and not world.mpi:
            return launch_ranks(args, argv, run)
        trainer = world.agree(Trainer, args, given, run, world)
        return trainer.run()
    except AnectypesError as e:
        error = e
    except OSError as e:
        error = AnectypesError(os_error(e, run and run.rd))
    except MemoryError:
        error = AnectypesError("out of memory; choose a smaller model or free memory")
    except BaseException:
        if trainer and world.size > 1:             # the other ranks may be waiting for this one
            traceback.print_exc()
            world.abort(1)
        raise
    finally:
        if run:
            run.rd.release()
    line = world.say(error)
    if line:
        print(line, file=sys.stderr)
    if trainer and world.size > 1:
        world.abort(1)
    return 1


def launch_ranks(args, argv, run):
    """--ranks N outside mpirun: run the ranks under mpirun, and again with --resume after each
    compile-budget stop (RESTART_STATUS)."""
    rd, spec = run.rd, run.spec
    if args.hostfile and not os.path.isfile(args.hostfile):
        raise RunError(f"--hostfile {args.hostfile}: no such file (one line per machine: NAME slots=1)")
    mpirun = mpirun_command(spec.ranks, args.hostfile)
    first = python_argv(*argv, *([] if args.run_dir else ["--run-dir", str(rd.path)]))
    rd.unlock()                                    # rank 0 takes the folder
    return launch(mpirun, first, resume_argv(args, rd.path))


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
