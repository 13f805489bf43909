"""The run folder: what defines a run (RunSpec) and the files that hold it (RunDir).

The trainer, its compile-budget restart and the dashboard all go through this module; nothing else
knows these file names or formats. That is why it is one module, past 450 lines: the whole contract of
a run folder, in one place.

    runs/<name>/
      config.json      {"format": "anectypes-run", "version": 1, "run_id", "spec": RunSpec fields,
                        "model": ModelConfig fields, "model_name", "device", "active_vocab", "params",
                        "trainable": the parameters trained, fewer than params with LoRA}
      status.json      {"state", "pid", "proc_start", "step", "steps", "updates", "loss", "lr",
                        "best_val_loss", "updated", ["error"]}: live progress, rewritten atomically
      metrics.jsonl    one row per micro-step ({"step", METRIC_KEYS...}: the system ones every
                       log_every steps) and one validation row
                       ({"step", "val_loss"}) per checkpoint
      samples.jsonl    {"step", "text"}
      train.log        the trainer's log
      stdout.log       the trainer's output, when the dashboard launched it
      launch.json      the dashboard's launch record (pid, proc_start, spec, times)
      meta.json        what the dashboard's user says of the run: {"name", "tags", "notes", "archived"}
      checkpoints/     latest.ckpt, best.ckpt (anectypes.formats.checkpoint's format)
      reporting.json   with --report-to: the ids of the runs it continues elsewhere ({"mlflow": {"run_id"}};
                       W&B's run id is run_id)
      tensorboard/     with --report-to tensorboard: TensorBoard's event files
      tokens.npz       text --data tokenized, with its tokenizer (anectypes.data.text's token cache)

A trainer holds an exclusive flock on an fd of its folder for its whole life (RunDir.claim, taken before
it reads anything there; the fd is handed on through the compile-budget restart's exec).

Steps count completed micro-steps: the metrics row of the first micro-step is step 1, a checkpoint,
a validation loss or a sample "at step S" comes after S micro-steps, and the progress line's
"step 370/600" is metrics step 370. Files are written atomically (temporary file ".NAME.*.tmp" beside
the target, then rename) or appended line by line; readers skip a torn last line, and `rewind` cuts
the JSONL files back to a checkpoint's step, so a resumed run never has duplicated or missing rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import math
import os
import secrets
import stat
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

from .host.files import atomic_write, make_folders
from .host.processes import alive, command_line, open_paths, process_start
from .device import BACKENDS
from .errors import AnectypesError
from .model.lora import DEFAULT_ALPHA, DEFAULT_TARGETS, parse_targets, target_names

FORMAT, VERSION = "anectypes-run", 1
CONFIG, STATUS, METRICS, SAMPLES = "config.json", "status.json", "metrics.jsonl", "samples.jsonl"
TRAIN_LOG, STDOUT_LOG, LAUNCH, META = "train.log", "stdout.log", "launch.json", "meta.json"
CHECKPOINTS, LATEST, BEST = "checkpoints", "latest.ckpt", "best.ckpt"
REPORTING, TENSORBOARD = "reporting.json", "tensorboard"
TOKENS = "tokens.npz"
LOCK_FD = "ANECTYPES_RUN_FD"     # the locked run folder's fd, handed to the process a compile-budget restart execs

# a metrics row: "step" plus these (t_*: the step's time split, ms; t: Unix seconds at its end; cpu_pct,
# rss_mb: the trainer's CPU % since the last sample and its memory, every log_every steps; rank: under
# MPI, the rank that ran the micro-step, whose ms_step it is); validation rows: "step", "val_loss"
METRIC_KEYS = ("loss", "lr", "grad_norm", "loss_scale", "ms_step", "tokens_per_s", "t_eval", "t_io", "t_cpu",
               "t_cls", "t_dw_wait", "val_loss", "t", "cpu_pct", "rss_mb", "rank")
ACTIVE_STATES = ("running", "restarting")
TERMINAL_STATES = ("finished", "stopped", "failed", "cancelled")   # cancelled: the dashboard's, a queued run never started
PRECISIONS = ("fp16", "fp32")
REPORTERS = ("wandb", "tensorboard", "mlflow")     # --report-to's libraries (anectypes.train.report_to)
DEFAULT_LOSS_SCALE = 256.0     # the reference's constant (docs/ane-reference.md §4.5)
UNSCALED_LOSS_SCALE = 8192.0   # the default for a model without residual scaling: fp16 underflow (docs/model.md)


def default_loss_scale(cfg):
    """The loss scale a run of `cfg` takes unless --loss-scale is given: an α = 1 model (imported) needs more."""
    return DEFAULT_LOSS_SCALE if cfg.residual_scaled else UNSCALED_LOSS_SCALE


class RunError(AnectypesError):
    """A run folder or run spec that cannot be used."""


# --- the spec ----------------------------------------------------------------------------------------

def _spec(default, help, kind, math_=True, **bounds):
    """A RunSpec field: `kind` names the check; `math_` says whether it changes the training math
    (such a field cannot change on --resume); `bounds`: ge/gt/le, also used by the dashboard's schema."""
    return field(default=default, metadata=dict(help=help, kind=kind, math=math_, **bounds))


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines a run. None in steps/lr/accum/warmup means the preset's schedule."""

    model: str = _spec("tiny", "a preset or a JSON file of ModelConfig fields", "str")
    data: Optional[str] = _spec(None, "llama2.c token file (flat uint16), or text: a .txt file, a folder of .txt, "
                                "a .jsonl of text or chat rows", "path")
    tokenizer: Optional[str] = _spec(None, "llama2.c tokenizer.bin, or a Hugging Face folder's tokenizer, for --data "
                                     "(the vocabulary, samples)", "path")
    init_from: Optional[str] = _spec(None, "start from a model's weights (fresh optimizer): a run folder or .ckpt, "
                                     "the reference's v2/v4 checkpoint, a llama2.c model.bin, a Hugging Face Llama or "
                                     "Qwen3 "
                                     "folder or a GGUF file", "path")
    seq: Optional[int] = _spec(None, "training context, tokens per window; none: the model's seq (a Hugging Face "
                               "folder's max_position_embeddings, at most 2048)", "int", ge=1, le=65536)
    lora: Optional[int] = _spec(None, "LoRA: train low-rank adapters of this rank on --lora-targets, the model "
                                "frozen (with --init-from; docs/lora.md)", "int", ge=1, le=65536)
    lora_alpha: Optional[float] = _spec(None, "with --lora: the adapters' scale is alpha/rank", "float", gt=0, le=1e6)
    lora_targets: Optional[str] = _spec(None, "with --lora: the projections adapted, comma-separated from "
                                        "q,k,v,o,gate,up,down", "str")
    steps: Optional[int] = _spec(None, "micro-steps in total", "int", False, ge=1, le=10**9)
    lr: Optional[float] = _spec(None, "peak learning rate", "float", gt=0, le=1)
    accum: Optional[int] = _spec(None, "micro-steps per optimizer update (per rank: an update of N ranks takes "
                                 "N·accum)", "int", ge=1, le=10**6)
    exact_accum: bool = _spec(False, "sum the micro-steps' gradients in float64, so that N ranks train bit for bit "
                              "like one process with N times the accum (costs a pass over 20 bytes per "
                              "weight per micro-step and 8 bytes per weight of memory)", "bool")
    ranks: int = _spec(1, "MPI processes training data-parallel; outside mpirun, N > 1 runs mpirun -n N "
                       "(anectypes[mpi])", "int", ge=1, le=4096)
    warmup: Optional[int] = _spec(None, "linear warmup micro-steps", "int", ge=0, le=10**9)
    min_lr_frac: float = _spec(0.1, "cosine floor as a fraction of the peak lr", "float", ge=0, le=1)
    clip: float = _spec(1.0, "global gradient-norm clip (0: off)", "float", ge=0, le=1e9)
    loss_scale: float = _spec(DEFAULT_LOSS_SCALE, "fp16 loss scale", "float", gt=0, le=2.0**64)
    dynamic_loss_scale: bool = _spec(False, "halve the loss scale on inf/NaN and skip that update", "bool")
    backend: str = _spec("auto", "auto: the ANE if present, else the simulator", "choice", choices=BACKENDS)
    precision: str = _spec("fp16", "simulator precision (fp16 like the ANE, fp32 exact)", "choice",
                           choices=PRECISIONS)
    seed: int = _spec(42, "init and data-sampling seed", "int", ge=0, le=2**63 - 1)
    log_every: int = _spec(10, "micro-steps between progress lines and status updates", "int", False,
                           ge=1, le=10**9)
    sample_every: int = _spec(500, "micro-steps between samples (0: off)", "int", False, ge=0, le=10**9)
    save_every: int = _spec(50, "updates between checkpoints", "int", False, ge=1, le=10**9)
    report_to: Optional[str] = _spec(None, "also send the metrics, samples and config to these, comma-separated: "
                                     "wandb, tensorboard, mlflow (each needs anectypes[NAME]); none: to no one",
                                     "names", False, names=(*REPORTERS, "none"))

    def __post_init__(self):
        for f in fields(self):
            check_value(f, getattr(self, f.name))
        if self.lora is None and (self.lora_alpha is not None or self.lora_targets is not None):
            raise RunError("--lora-alpha and --lora-targets go with --lora RANK")
        if self.lora is not None and self.init_from is None:
            raise RunError("--lora adapts a trained model, whose weights it freezes: start from one with --init-from "
                           "SOURCE, not --scratch")
        if self.lora_targets is not None:
            try:
                parse_targets(self.lora_targets)
            except AnectypesError as e:
                raise RunError(str(e)) from None

    def resolved(self):
        """The spec with the preset's schedule in place of None."""
        name = model_name(self.model)
        sched = SCHEDULES.get(name, SCHEDULES[None])
        lora = {} if self.lora is None else dict(lora_alpha=self.lora_alpha or DEFAULT_ALPHA,
                                                 lora_targets=target_names(parse_targets(self.lora_targets or
                                                                                         DEFAULT_TARGETS)))
        return replace(self, **lora, **{k: v for k, v in sched.items() if getattr(self, k) is None})

    def schedule(self):
        return {k: getattr(self, k) for k in SCHEDULES[None]}

    @property
    def vocabulary(self):
        """What the loss is over: a model from --init-from trains on its whole vocabulary ("full", its own objective,
        as transformers and peft compute it); a --scratch run on the ids its data holds ("compact", the reference's
        speed trick, docs/ane-reference.md §4.7)."""
        return "full" if self.init_from else "compact"

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, doc, where="run spec"):
        """A spec from a JSON object; unknown fields and bad values raise RunError naming the field."""
        if not isinstance(doc, dict):
            raise RunError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - {f.name for f in fields(cls)})
        if unknown:
            raise RunError(f"{where}: unknown field {unknown[0]!r}")
        try:
            return cls(**doc)
        except RunError as e:
            raise RunError(f"{where}: {e}") from None

    def argv(self):
        """The trainer's command-line flags for this spec (for --scratch); with init_from, no --model: the model
        is the source's."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or v is False or f.name == "model" and self.init_from is not None:
                continue
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if v is True else [f"{flag}={v!r}" if isinstance(v, float) else f"{flag}={v}"]
        return out

    def merge_resume(self, given):
        """This (stored) spec with the flags given to --resume: steps and the intervals may change; a
        flag that changes the training math must repeat the run's own value."""
        for name, value in given.items():
            f = SPEC_FIELDS[name]
            if f.metadata["math"] and value != getattr(self, name):
                raise RunError(f"--{name.replace('_', '-')} {value} differs from the run's "
                               f"{getattr(self, name)}: it changes the training math, so it cannot change "
                               "on --resume; start a new run (--scratch) instead")
        return replace(self, **given)


SPEC_FIELDS = {f.name: f for f in fields(RunSpec)}

# the reference's schedule (docs/ane-reference.md §4.5), and tiny's, tuned to learn visibly in minutes
SCHEDULES = {None: dict(steps=10000, lr=3e-4, accum=10, warmup=100),
             "tiny": dict(steps=2000, lr=3e-3, accum=2, warmup=50)}


def model_name(model):
    """A preset's name, or a JSON model file's stem."""
    return Path(model).stem if model.endswith(".json") else model


def check_value(f, v):
    """Raise RunError unless v suits field f (type, finiteness, bounds, choices)."""
    md, name = f.metadata, f.name
    if v is None and f.default is None:
        return
    kind = md["kind"]
    if kind == "bool":
        ok = isinstance(v, bool)
    elif kind == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind == "float":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    else:
        ok = isinstance(v, str) and v != "" and "\0" not in v
    if not ok:
        want = {"int": "an integer", "float": "a finite number", "bool": "true or false"}.get(kind, "a string")
        raise RunError(f"{name} must be {want}, got {v!r}")
    if "choices" in md and v not in md["choices"]:
        raise RunError(f"{name} must be one of {', '.join(md['choices'])}, got {v!r}")
    if "names" in md and not valid_names(v, md["names"]):
        raise RunError(f"{name} must be {md['names'][-1]}, or some of {', '.join(md['names'][:-1])} separated by "
                       f"commas, got {v!r}")
    if "ge" in md and v < md["ge"] or "gt" in md and v <= md["gt"] or "le" in md and v > md["le"]:
        lo = f">= {md['ge']}" if "ge" in md else f"> {md['gt']}"
        raise RunError(f"{name} must be {lo} and <= {md['le']}, got {v!r}")


def valid_names(v, names):
    """Whether v is names' last alone, or a comma-separated list of the others, each once."""
    listed = v.split(",")
    return v == names[-1] or len(set(listed)) == len(listed) and set(listed) <= set(names[:-1])


def reporters(spec):
    """The libraries a run reports to (its report_to), in the order given."""
    return [] if spec.report_to in (None, "none") else spec.report_to.split(",")


def spec_defaults():
    """Every spec field's default (None: the preset's schedule), for the dashboard's form."""
    return RunSpec().to_dict()


# --- JSON ----------------------------------------------------------------------------------------------

def _no_constant(name):
    raise ValueError(f"{name} is not a finite number")


def loads(text):
    """json.loads that refuses NaN and Infinity (they are not JSON, and not a usable setting)."""
    return json.loads(text, parse_constant=_no_constant)


def read_json_file(path, what):
    """The JSON object in a file, or RunError naming the file and what is wrong."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise RunError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: cannot read {what} ({e})") from None
    if not text.strip():
        raise RunError(f"{path}: the {what} file is empty")
    try:
        doc = loads(text)
    except ValueError as e:
        raise RunError(f"{path}: the {what} file is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RunError(f"{path}: the {what} file must hold a JSON object, not {type(doc).__name__}")
    return doc


def parse_row(line):
    """A JSONL line as a dict with an int step, or None when it is malformed (e.g. torn by a crash)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    step = rec.get("step")
    return rec if isinstance(step, int) and not isinstance(step, bool) else None


def finite(x):
    """x if it is a finite number, else None: what a run file (strict JSON) holds for NaN, inf or a
    value that is not a number."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return x if isinstance(x, int) or math.isfinite(x) else None


# --- processes ------------------------------------------------------------------------------------------

def is_trainer(pid, run_dir):
    """Whether process pid trains run_dir: its command line runs anectypes.train, and either names the
    folder (an absolute path: the dashboard's --run-dir) or it holds the folder or a file in it open
    (the trainer's lock, its metrics.jsonl). A pid read from a file proves nothing by itself."""
    argv = command_line(pid)
    if not any(a == "-m" and b == "anectypes.train" for a, b in zip(argv, argv[1:])):
        return False
    root = Path(run_dir).resolve()

    def inside(path, exact=False):
        try:
            p = Path(path).resolve()
        except (OSError, RuntimeError):
            return False
        return p == root or not exact and p.is_relative_to(root)

    named = (a.removeprefix("--run-dir=") for a in argv)
    return (any(inside(a, exact=True) for a in named if a.startswith("/"))
            or any(inside(p) for p in open_paths(pid)))


# --- the folder -----------------------------------------------------------------------------------------

class RunDir:
    """One run folder. Paths come from here; `file()` confines a name to the folder (no symlink out).
    A trainer `claim`s it first: an exclusive flock on an fd of the folder, held for the trainer's life."""

    def __init__(self, path):
        self.path = Path(path)
        self.fd, self.made = None, []          # the locked fd; the folders claim() created

    def __getstate__(self):                    # another MPI rank gets the path: the lock is this process's
        return {"path": self.path, "fd": None, "made": []}

    def __truediv__(self, name):
        return self.path / name

    @property
    def checkpoints(self):
        return self.path / CHECKPOINTS

    @property
    def latest(self):
        return self.checkpoints / LATEST

    @property
    def best(self):
        return self.checkpoints / BEST

    def file(self, name):
        """The path of `name` (e.g. "metrics.jsonl", "checkpoints/best.ckpt") if it resolves to a regular
        file inside this folder, else None: a symlink pointing out of the run is never followed."""
        try:
            root = self.path.resolve()
            p = (root / name).resolve()
        except (OSError, RuntimeError):
            return None
        return p if p.is_relative_to(root) and p != root and p.is_file() else None

    # -- the trainer's hold on the folder
    def claim(self, create=False, fresh=False):
        """Take the folder for this process before anything in it is read: RunError when it is missing or
        another process holds it. create: make it (and its parents) if missing (a resume never does);
        fresh: a folder of its own, claimed by mkdir: this path if free, else PATH-2, PATH-3, ..."""
        if create or fresh:
            self.made = make_folders(self.path.parent if fresh else self.path)
        base = self.path
        for n in itertools.count(2) if fresh else ():
            try:
                self.path.mkdir()
                self.made.append(self.path)
                break
            except FileExistsError:
                self.path = base.with_name(f"{base.name}-{n}")
        fd = inherited_fd(self.path)
        if fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                raise RunError(f"{self.path}: no such run folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self.made = []                      # the holder's now
            pid, alive = self.trainer()
            raise RunError(f"{self.path} is being trained by another process{f' (pid {pid})' if alive else ''}; "
                           "stop it first") from None
        self.fd = fd
        return self

    def vanished(self):
        """Whether the folder this process holds is no longer at its path (deleted or moved away)."""
        if self.fd is None:
            return False
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return True
        held = os.fstat(self.fd)
        return (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino)

    def hand_over(self):
        """Keep the hold across os.execv: the fd stays open in the new process, which finds it in LOCK_FD."""
        os.set_inheritable(self.fd, True)
        os.environ[LOCK_FD] = str(self.fd)

    def unlock(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def release(self):
        """Let go of the folder; what claim() created is removed again if still empty (a start that failed
        before writing anything leaves nothing behind)."""
        for p in reversed(self.made):
            with contextlib.suppress(OSError):
                p.rmdir()
        self.made = []
        self.unlock()

    def exists(self):
        return any((self.path / n).is_file() for n in (CONFIG, STATUS, LAUNCH, METRICS))

    def has_checkpoint(self):
        return self.latest.is_file()

    # -- config
    def read_config(self):
        """(spec, the whole config document); RunError when missing or malformed."""
        path = self.file(CONFIG)
        if path is None:
            raise RunError(f"{self.path} has no {CONFIG}: it is not a run folder (start one with --scratch)")
        doc = read_json_file(path, "run config")
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise RunError(f"{path}: not an anectypes run config (format {doc.get('format')!r}, version "
                           f"{doc.get('version')!r}; this anectypes writes {FORMAT!r} version {VERSION})")
        return RunSpec.from_dict(doc.get("spec"), f"{path}: spec"), doc

    def write_config(self, doc):
        self.write_json(CONFIG, {**doc, "format": FORMAT, "version": VERSION})

    # -- status
    def read_status(self):
        return self.read_json(STATUS) or {}

    def write_status(self, state, **fields_):
        pid = os.getpid()
        self.write_json(STATUS, dict(state=state, pid=pid, proc_start=process_start(pid), updated=time.time(),
                                     **fields_), sync=False)

    def trainer(self):
        """(pid, alive) of the trainer: the process whose status.json says it is training, or the one
        the dashboard launched (before it writes a status of its own), if it is still that process and
        verifiably trains this folder (is_trainer)."""
        status = self.read_status()
        training = status if status.get("state") in ACTIVE_STATES else {}
        for doc in (training, self.read_json(LAUNCH) or {}):
            pid = doc.get("pid")
            if alive(pid, doc.get("proc_start")) and is_trainer(pid, self.path):
                return pid, True
        return status.get("pid"), False

    # -- JSON files
    def read_json(self, name):
        """A JSON object from a file of the folder, or None (missing, unreadable, outside, not an object)."""
        p = self.file(name)
        if p is None:
            return None
        try:
            doc = loads(p.read_bytes())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def write_json(self, name, doc, sync=True):
        text = json.dumps(doc, indent=1, allow_nan=False).encode()
        atomic_write(self.path / name, lambda f: f.write(text), sync=sync, mkdir=False)

    # -- JSONL files
    def rows(self, name=METRICS):
        """The complete, well-formed rows of a JSONL file (a torn last line is skipped)."""
        p = self.file(name)
        if p is None:
            return []
        data = p.read_bytes()
        return [r for r in map(parse_row, data[:data.rfind(b"\n") + 1].splitlines()) if r is not None]

    def append(self, f, row):
        f.write(json.dumps(row, allow_nan=False) + "\n")
        f.flush()

    def rewind(self, step):
        """Cut metrics and samples back to the rows of steps <= step (what a checkpoint at `step` has
        seen), dropping torn or malformed lines."""
        for name in (METRICS, SAMPLES):
            if (self.path / name).exists():
                text = "".join(json.dumps(r) + "\n" for r in self.rows(name) if r["step"] <= step)
                atomic_write(self.path / name, lambda f: f.write(text.encode()), mkdir=False)

    def clean_temp(self):
        """Remove the temporary files (".NAME.<pid>.<hex>.tmp", data.atomic_write's) that a killed writer
        left: those of this process (before an exec restart) or of a process that is gone."""
        for folder in (self.path, self.checkpoints):
            for p in folder.glob(".*.tmp"):
                pid = p.name.rsplit(".", 3)[-3]
                if not pid.isdigit() or int(pid) == os.getpid() or process_start(int(pid)) is None:
                    p.unlink(missing_ok=True)

    def log(self, line):
        with open(self.path / TRAIN_LOG, "a") as f:
            f.write(line + "\n")


def inherited_fd(path):
    """The locked fd of `path` that the process before an exec restart handed over (LOCK_FD), or None."""
    fd = os.environ.pop(LOCK_FD, "")
    try:
        held, here = os.fstat(int(fd)), os.stat(path)
    except (ValueError, OSError):
        return None
    if not stat.S_ISDIR(held.st_mode) or (held.st_dev, held.st_ino) != (here.st_dev, here.st_ino):
        return None
    os.set_inheritable(int(fd), False)
    return int(fd)


def new_run_id():
    return secrets.token_hex(8)


def python_argv(*flags):
    """The trainer's command line with this interpreter."""
    return [sys.executable, "-m", "anectypes.train", *flags]


def start_argv(spec, run_dir):
    """The command line that starts a new run of `spec` in run_dir."""
    return python_argv(*([] if spec.init_from else ["--scratch"]), "--run-dir", str(run_dir), *spec.argv())
