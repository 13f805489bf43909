"""What the dashboard reads from the run folders: which runs there are, their config, metrics (each row as
metrics.py parses it), logs, samples and checkpoints (anectypes.runs owns the file names and formats).

Every file is read through RunDir.file, which refuses a path (or symlink) that leads out of the run
folder; readers tolerate a partial last line and malformed lines in the JSONL files.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import math
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anectypes.errors import CheckpointError
from anectypes.formats.checkpoint import read_meta
from anectypes.runs import (BEST, CHECKPOINTS, CONFIG, LATEST, LAUNCH, METRIC_KEYS, METRICS, SAMPLES, STATUS,
                            STDOUT_LOG, TRAIN_LOG, RunDir, finite, model_name, parse_row)

from .api_errors import Conflict, NotFound
from .metrics import EXTREMES, columns, merge_rows, metric_values, parse_metric

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
TRASH = ".trash-"                          # a deleted run's folder until it is removed (never a run id)
NAME_RE = RUN_ID_RE


# --- JSON values ----------------------------------------------------------------------------------

def json_safe(obj):
    """Recursively replace NaN/inf floats by None and lone surrogates in strings by "?" (strict JSON in
    UTF-8)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, str):
        return obj.encode("utf-8", "replace").decode()
    if isinstance(obj, dict):
        return {json_safe(str(k)): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# --- lines and JSONL files ------------------------------------------------------------------------

def tail_lines(path, n, max_bytes=4 << 20):
    """The last n lines of a text file (reading backwards, at most max_bytes); [] for no file."""
    if n <= 0 or path is None:
        return []
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        f.seek(0, os.SEEK_END)
        pos = size = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= n and size - pos < max_bytes:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode("utf-8", "replace").splitlines()
    if pos > 0 and lines:
        lines = lines[1:]           # the first one is cut
    return lines[-n:]


def as_sample(rec):
    """A samples.jsonl row (parsed) as {"step", "text"}, or None when it has no text."""
    return {"step": rec["step"], "text": json_safe(rec["text"])} if rec and isinstance(rec.get("text"), str) else None


def parse_sample(line):
    return as_sample(parse_row(line))


class JsonlTail:
    """Incremental reader of an append-only JSONL file of a run: only complete lines, malformed ones
    skipped, the file located through RunDir.file (never outside the run).

    A file rewritten under the same name (the trainer rewinds metrics.jsonl atomically on resume) is
    read again from its start unless it still holds, where reading stopped, the bytes read last: the
    content decides, not the inode, which a file system may give the next file again.
    """

    KEEP = 256                  # bytes before the offset compared on each read

    def __init__(self, rd, name, parse, offset=None):
        self.rd, self.name, self.parse = rd, name, parse
        self.seen, self.offset, self.last, self.start = False, 0, b"", offset
        self.lock = threading.Lock()

    def read_new(self):
        """(reset, new parsed records): reset is True when the file was replaced or truncated."""
        with self.lock:
            path = self.rd.file(self.name)
            try:
                f = open(path, "rb") if path else None
            except OSError:
                f = None
            if f is None:
                reset = self.seen
                self.seen, self.offset, self.last, self.start = False, 0, b"", None   # when it appears, read all
                return reset, []
            with f:
                size = os.fstat(f.fileno()).st_size
                reset = self.seen and (size < self.offset or self.rewritten(f))
                if reset:
                    self.offset, self.last = 0, b""
                if not self.seen and self.start is not None:    # first open: begin where asked (the end: -1)
                    self.offset = min(self.start, size) if self.start >= 0 else size
                    f.seek(max(0, self.offset - self.KEEP))
                    self.last = f.read(self.offset - f.tell())
                    if self.last and not self.last.endswith(b"\n"):  # inside a line: skip to the next one
                        rest = f.readline()
                        self.offset, self.last = self.offset + len(rest), (self.last + rest)[-self.KEEP:]
                self.seen, self.start = True, None
                if size <= self.offset:
                    return reset, []
                f.seek(self.offset)
                chunk = f.read(size - self.offset)
            end = chunk.rfind(b"\n")
            if end < 0:
                return reset, []
            self.offset += end + 1
            self.last = (self.last + chunk[:end + 1])[-self.KEEP:]
            lines = [line for line in chunk[:end].split(b"\n") if line.strip()]
            return reset, [r for r in map(self.parse, lines) if r is not None]

    def rewritten(self, f):
        """Whether the bytes before the offset are no longer the ones read there."""
        f.seek(self.offset - len(self.last))
        return f.read(len(self.last)) != self.last


class MetricsCache:
    """All parsed rows of one run's metrics.jsonl (validation rows merged in), refreshed incrementally, and
    their metric_values as far as asked for (converted once: a long run's take a while)."""

    def __init__(self, rd):
        self.tail = JsonlTail(rd, METRICS, parse_metric)
        self.rows = []
        self.values = np.empty((0, len(EXTREMES)))      # of rows[:len(values)]
        self.lock = threading.Lock()

    def refresh(self):
        with self.lock:
            return list(self._refresh())

    def _refresh(self):
        reset, new = self.tail.read_new()
        if reset:
            self.rows = []
        if new:     # the rows from the first new step on may change; the values of those before hold
            changed = bisect.bisect_left(self.rows, min(r[0] for r in new), key=lambda r: r[0])
            self.values = self.values[:min(changed, len(self.values))]
        merge_rows(self.rows, new)
        self.values = self.values[:len(self.rows)]
        return self.rows

    def snapshot(self):
        """The rows and their metric_values."""
        with self.lock:
            rows = self._refresh()
            if len(self.values) < len(rows):
                self.values = np.concatenate([self.values, metric_values(rows[len(self.values):])])
            return list(rows), self.values


# --- one run --------------------------------------------------------------------------------------

@dataclass
class Run:
    id: str
    dir: Path

    @property
    def rd(self):
        return RunDir(self.dir)

    @property
    def log_name(self):
        """The log to show: the trainer's output when the dashboard launched it, else (a run started
        from the command line) its train.log."""
        return STDOUT_LOG if self.rd.file(STDOUT_LOG) else TRAIN_LOG

    def config(self):
        """config.json without its bookkeeping (format, version, run id), or before the trainer wrote it,
        the spec the dashboard launched."""
        doc = self.rd.read_json(CONFIG) or {"spec": (self.rd.read_json(LAUNCH) or {}).get("spec") or {}}
        return {k: v for k, v in doc.items() if k not in ("format", "version", "run_id")}

    def created(self):
        launch = self.rd.read_json(LAUNCH) or {}
        if finite(launch.get("created")) is not None:
            return float(launch["created"])
        m = re.match(r"(\d{8}-\d{6})", self.id)
        if m:
            try:
                return time.mktime(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
            except ValueError:
                pass
        times = [p.stat().st_mtime for p in map(self.rd.file, (CONFIG, LAUNCH)) if p]
        return min(times) if times else self.dir.stat().st_mtime

    def updated(self, status):
        t = float(finite(status.get("updated")) or 0.0)
        for p in map(self.rd.file, (METRICS, STATUS, STDOUT_LOG)):
            if p:
                t = max(t, p.stat().st_mtime)
        return t or None

    def logs(self, tail=200):
        return tail_lines(self.rd.file(self.log_name), tail)

    def samples(self):
        return [s for s in map(as_sample, self.rd.rows(SAMPLES)) if s]

    def checkpoint_path(self, name):
        """The checkpoint file `name`, confined to the run's checkpoints folder; NotFound otherwise."""
        p = self.rd.file(f"{CHECKPOINTS}/{name}") if isinstance(name, str) and NAME_RE.match(name) else None
        if p is None or p.parent != self.rd.checkpoints.resolve():
            raise NotFound("no such checkpoint")
        return p

    def checkpoint(self, which=None):
        """The path of the run's "best" or "latest" checkpoint (default: best, else latest), confined as
        checkpoint_path; NotFound when there is none."""
        try:
            return self.checkpoint_path(LATEST if which == "latest" else BEST)
        except NotFound:
            if which:
                raise
        return self.checkpoint_path(LATEST)


# --- the runs folder ------------------------------------------------------------------------------

class RunFiles:
    """The runs folder: lookup confined to it, new run folders, and caches of what is costly to re-read
    (parsed metrics, checkpoint hashes)."""

    def __init__(self, runs_dir):
        self.runs_dir = Path(runs_dir).resolve()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self._locks = {}               # run id -> the lock every change to that run takes
        self._metrics = {}             # run id -> MetricsCache
        self._sha = {}                 # path -> ((size, mtime_ns), sha256)
        self._meta = {}                # checkpoint path -> ((size, mtime_ns), its step and best validation loss)
        for trash in self.runs_dir.glob(TRASH + "*"):          # deletes a stopped dashboard left unfinished
            shutil.rmtree(trash, ignore_errors=True)

    def run(self, run_id):
        """The Run for an id, confined to the runs folder; NotFound otherwise."""
        if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
            raise NotFound()
        try:
            d = (self.runs_dir / run_id).resolve()
        except (OSError, RuntimeError):
            raise NotFound() from None
        if d.parent != self.runs_dir or not d.is_dir() or not RunDir(d).exists():
            raise NotFound()
        return Run(run_id, d)

    @contextlib.contextmanager
    def locked(self, run_id):
        """The run (looked up again: NotFound once it is deleted) under its lock, which every change to
        a run holds: a PATCH, a stop or a resume comes wholly before or after a DELETE."""
        run = self.run(run_id)                                 # (no lock is made for a run that is not there)
        with self.lock:
            lock = self._locks.setdefault(run.id, threading.Lock())
        with lock:
            yield self.run(run_id)

    def trash(self, run):
        """Take a run out of the runs folder (under its lock) by an atomic rename to a hidden name, which
        no request finds and no trainer started later writes into; the new path, to remove."""
        trash = self.runs_dir / f"{TRASH}{run.id}-{secrets.token_hex(4)}"
        try:
            os.rename(run.dir, trash)
        except FileNotFoundError:
            raise NotFound() from None
        self.forget(run)
        return trash

    def checkpoint_run(self, path):
        """The run whose checkpoint file (confined, as Run.checkpoint_path) `path` is; NotFound otherwise."""
        p = Path(path)
        if p.parent.parent.parent == self.runs_dir:
            run = self.run(p.parent.parent.name)
            if run.checkpoint_path(p.name) == p:
                return run
        raise NotFound("no such checkpoint")

    def runs(self):
        try:
            entries = list(os.scandir(self.runs_dir))
        except OSError:
            return []
        out = []
        for e in entries:
            if RUN_ID_RE.match(e.name):
                try:
                    out.append(self.run(e.name))
                except NotFound:
                    continue
        return out

    def new_run_dir(self, spec):
        """A fresh folder for a new run of `spec`, named by time, model and a random suffix."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for _ in range(100):
            run_dir = self.runs_dir / f"{stamp}-{model_name(spec.model)}-{secrets.token_hex(2)}"
            try:
                run_dir.mkdir()
                return run_dir
            except FileExistsError:
                continue
        raise Conflict("could not pick a fresh run id")

    def metrics_cache(self, run):
        with self.lock:
            cache = self._metrics.get(run.id)
            if cache is None:
                cache = self._metrics[run.id] = MetricsCache(run.rd)
            return cache

    def forget(self, run):
        """Drop what is cached of a run (its folder is gone)."""
        with self.lock:
            self._metrics.pop(run.id, None)

    def recent_metrics(self, run, n=200):
        """The last metric rows of a run: all those its cache holds once a page or a stream has read the
        file, else (a listing of many long runs reads no whole file) the rows of the file's last n lines."""
        with self.lock:
            cache = self._metrics.get(run.id)
        if cache is not None:
            return cache.refresh()
        return merge_rows([], [r for r in map(parse_metric, tail_lines(run.rd.file(METRICS), n)) if r is not None])

    def metrics(self, run, since_step=-1, max_points=2000, from_step=None, to_step=None):
        """The rows after since_step and within [from_step, to_step], down-sampled to max_points columns."""
        rows, values = self.metrics_cache(run).snapshot()
        lo = bisect.bisect_right(rows, max(since_step, -math.inf if from_step is None else from_step - 1),
                                 key=lambda r: r[0])
        hi = len(rows) if to_step is None else bisect.bisect_right(rows, to_step, key=lambda r: r[0])
        return columns(rows[lo:hi], max_points, values[lo:hi])

    def metrics_csv(self, run):
        """Every metric row as CSV: a header of step and METRIC_KEYS, then the values, blank where absent."""
        lines = [",".join(("step", *METRIC_KEYS))]
        lines += [",".join("" if v is None else repr(v) for v in r) for r in self.metrics_cache(run).refresh()]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _cached(cache, path, compute):
        """compute(path), remembered in `cache` until the file's size or modification time changes."""
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        hit = cache.get(path)
        if not (hit and hit[0] == key):
            hit = cache[path] = (key, compute(path))
        return hit[1]

    def sha256(self, path):
        def digest(path):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            return h.hexdigest()
        return self._cached(self._sha, path, digest)

    def checkpoint_state(self, path):
        """{"step", "best_val_loss"} of a checkpoint's meta.json (None each where it is not readable), cached
        like the hashes."""
        def state(path):
            try:
                state = read_meta(path)["state"]
            except CheckpointError:
                state = {}
            best = state.get("best_val_loss")
            return {"step": state.get("step"),
                    "best_val_loss": best if isinstance(best, (int, float)) and math.isfinite(best) else None}
        return self._cached(self._meta, path, state)

    def checkpoints(self, run):
        out = []
        try:
            names = sorted(os.listdir(run.rd.checkpoints))
        except OSError:
            return out
        for name in names:
            if name.startswith("."):                            # atomic_write's temp files
                continue
            try:
                p = run.checkpoint_path(name)
                st = p.stat()
                out.append({"name": name, "bytes": st.st_size, "sha256": self.sha256(p),
                            "modified": st.st_mtime, **self.checkpoint_state(p)})
            except (NotFound, OSError):
                continue
        return out
