"""The dashboard's run store and supervisor.

A run is a folder under the runs folder (see anectypes.runs, which owns its files). What the
dashboard adds when it launches one is stdout.log (the child's stdout+stderr) and launch.json (the
spec it launched and the child's pid and start time).

Everything is recomputed from those files, so the list survives a dashboard restart. The state
shown is status.json's, corrected by whether the process is really there: a run whose status says
running/restarting but whose process (pid + start time) is gone is `failed`, with the last log lines
as its error (children of this dashboard are checked with Popen.poll()). Every file is read through
RunDir.file, which refuses a path (or symlink) that leads out of the run folder.

Training runs in a subprocess (its own session, so a stop signals its whole process group);
readers tolerate a partial last line and malformed lines in the JSONL files.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from anectypes.runs import (ACTIVE_STATES, CHECKPOINTS, CONFIG, LATEST, LAUNCH, METRIC_KEYS, METRICS, SAMPLES,
                            STATUS, STDOUT_LOG, TERMINAL_STATES, TRAIN_LOG, RunDir, model_name, parse_row, process_start, python_argv,
                            start_argv)

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
NAME_RE = RUN_ID_RE
POLL_S = 0.2                  # SSE file polling interval (≤ 5 messages/s)
SSE_MAX_ROWS = 5000           # metric rows per SSE message (a long replay is spread over several)
SSE_MAX_LOG_LINES = 500
ERROR_LOG_LINES = 20


class RunError(Exception):
    """An expected failure of a run operation; `status` is the HTTP status code to answer with."""

    def __init__(self, status, detail):
        super().__init__(detail)
        self.status, self.detail = status, detail


class NotFound(RunError):
    def __init__(self, detail="no such run"):
        super().__init__(404, detail)


class Conflict(RunError):
    def __init__(self, detail):
        super().__init__(409, detail)


# --- small file helpers -------------------------------------------------------------------------

def finite(x):
    """A JSON-safe number: NaN/inf (and non-numbers) become None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def json_safe(obj):
    """Recursively replace NaN/inf floats by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


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


def parse_metric(line):
    """A metrics.jsonl line as a list [step, *METRIC_KEYS values], or None when malformed."""
    rec = parse_row(line)
    return None if rec is None else [rec["step"], *(finite(rec.get(k)) for k in METRIC_KEYS)]


def parse_sample(line):
    rec = parse_row(line)
    return {"step": rec["step"], "text": rec["text"]} if rec and isinstance(rec.get("text"), str) else None


def merge_rows(rows, new):
    """Append metric rows in step order: a row of the step already last (a validation row) fills in its
    values; a row of an earlier step (a file rewound under a reader) replaces the rows from there on."""
    for r in new:
        while rows and rows[-1][0] > r[0]:
            rows.pop()
        if rows and rows[-1][0] == r[0]:
            rows[-1] = [a if b is None else b for a, b in zip(rows[-1], r)]
        else:
            rows.append(r)
    return rows


def last_value(rows, key):
    """The last non-null value of a metric in merged rows, or None."""
    i = 1 + METRIC_KEYS.index(key)
    return next((r[i] for r in reversed(rows) if r[i] is not None), None)


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
            out = []
            for line in chunk[:end].split(b"\n"):
                if line.strip():
                    rec = self.parse(line)
                    if rec is not None:
                        out.append(rec)
            return reset, out

    def rewritten(self, f):
        """Whether the bytes before the offset are no longer the ones read there."""
        f.seek(self.offset - len(self.last))
        return f.read(len(self.last)) != self.last


class MetricsCache:
    """All parsed rows of one run's metrics.jsonl (validation rows merged in), refreshed incrementally."""

    def __init__(self, rd):
        self.tail = JsonlTail(rd, METRICS, parse_metric)
        self.rows = []
        self.lock = threading.Lock()

    def refresh(self):
        with self.lock:
            reset, new = self.tail.read_new()
            if reset:
                self.rows = []
            merge_rows(self.rows, new)
            return list(self.rows)


# --- processes ------------------------------------------------------------------------------------

def _proc_stat(pid):
    """(state letter, utime+stime ticks) from /proc/<pid>/stat, or None."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            text = f.read()
    except (OSError, ValueError):
        return None
    rest = text[text.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[11]) + int(rest[12])
    except (IndexError, ValueError):
        return None


def _rss_mb(pid):
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def _signal_run(pid, sig):
    """Signal the run's process group (its own session) or, failing that, the process."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Run:
    id: str
    dir: Path

    @property
    def rd(self):
        return RunDir(self.dir)


# --- the store ----------------------------------------------------------------------------------------

class RunStore:
    def __init__(self, runs_dir, max_running=1, grace_s=10.0):
        self.runs_dir = Path(runs_dir).resolve()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.max_running, self.grace_s = max_running, grace_s
        self.children = {}             # run id -> Popen (processes this dashboard launched)
        self.stopping = {}             # run id -> stop task
        self.stop_requested = set()    # run ids stopped through stop() since their last launch
        self.lock = threading.RLock()
        self._metrics = {}
        self._sha = {}                 # path -> ((size, mtime_ns), sha256)
        self._cpu = {}                 # pid -> (ticks, monotonic time)
        self._tasks = set()
        self._gen_lock = None
        self._gen_waiting = 0
        self._model = None             # (key, model, tokenizer, step)
        self.closing = False           # set when the server starts shutting down: event streams end

    def begin_shutdown(self):
        self.closing = True

    # -- lookup
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

    def run_ids(self):
        try:
            entries = list(os.scandir(self.runs_dir))
        except OSError:
            return []
        out = []
        for e in entries:
            if RUN_ID_RE.match(e.name):
                try:
                    self.run(e.name)
                except NotFound:
                    continue
                out.append(e.name)
        return out

    # -- state
    def process(self, run):
        """(pid, alive, exit code or None) of the run's trainer process."""
        with self.lock:
            child = self.children.get(run.id)
        if child is not None:
            rc = child.poll()
            return child.pid, rc is None, rc
        pid, alive = run.rd.trainer()
        return pid, alive, None

    def status(self, run):
        """status.json corrected by the process check (see the module notes); always has `state`."""
        # check the process first: a trainer writes its final status before it exits
        pid, alive, rc = self.process(run)
        status = run.rd.read_status()
        state = status.get("state")
        if alive:
            if state not in ACTIVE_STATES or status.get("pid") != pid:
                status.update(state="running", pid=pid)    # just launched or resumed: no status of its own yet
        elif run.id in self.stop_requested and rc in (None, -signal.SIGTERM, -signal.SIGKILL):
            if state not in TERMINAL_STATES:        # stopped on request before the trainer could checkpoint
                status["state"] = "stopped"
                status["error"] = "stopped before the trainer was ready to save a checkpoint"
        elif state not in TERMINAL_STATES or (rc not in (None, 0, 130) and state != "failed"):
            # gone without a final status, or a child that failed before replacing an older final status
            status["state"] = "failed"
            how = f"exited with code {rc}" if rc is not None else "is gone"
            if rc is not None and rc < 0:
                try:
                    how = f"was killed by {signal.Signals(-rc).name}"
                except ValueError:
                    pass
            lines = self.error_lines(run)
            status["error"] = (f"the trainer process{f' {pid}' if pid else ''} {how} without a final status"
                               + ("; last log lines:\n" + "\n".join(lines) if lines else ""))
        status.setdefault("pid", pid)
        status["alive"] = alive
        return json_safe(status)

    def error_lines(self, run):
        lines = tail_lines(run.rd.file(STDOUT_LOG), ERROR_LOG_LINES)
        return lines or tail_lines(run.rd.file(TRAIN_LOG), ERROR_LOG_LINES)

    def running_count(self):
        n = 0
        for rid in self.run_ids():
            try:
                if self.status(self.run(rid))["alive"]:
                    n += 1
            except NotFound:
                pass
        return n

    # -- listing and details
    def created(self, run):
        launch = run.rd.read_json(LAUNCH) or {}
        if finite(launch.get("created")) is not None:
            return float(launch["created"])
        m = re.match(r"(\d{8}-\d{6})", run.id)
        if m:
            try:
                return time.mktime(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
            except ValueError:
                pass
        times = [p.stat().st_mtime for p in map(run.rd.file, (CONFIG, LAUNCH)) if p]
        return min(times) if times else run.dir.stat().st_mtime

    def updated(self, run, status):
        t = float(finite(status.get("updated")) or 0.0)
        for p in map(run.rd.file, (METRICS, STATUS, STDOUT_LOG)):
            if p:
                t = max(t, p.stat().st_mtime)
        return t or None

    def config(self, run):
        """config.json without its bookkeeping (format, version, run id), or before the trainer wrote it,
        the spec the dashboard launched."""
        doc = run.rd.read_json(CONFIG) or {"spec": (run.rd.read_json(LAUNCH) or {}).get("spec") or {}}
        return {k: v for k, v in doc.items() if k not in ("format", "version", "run_id")}

    def summary_row(self, run):
        status = self.status(run)
        config = self.config(run)
        rows = self.metrics_cache(run).refresh()
        spec = config.get("spec") or {}
        model_name = config.get("model_name") or spec.get("model")
        steps = status.get("steps")
        if not isinstance(steps, int):
            steps = spec.get("steps")
        step = status.get("step")
        if not isinstance(step, int):
            step = rows[-1][0] if rows else None
        return {
            "id": run.id, "state": status["state"], "step": step, "steps": steps if isinstance(steps, int) else None,
            "model_name": model_name if isinstance(model_name, str) else None,
            "created": self.created(run), "updated": self.updated(run, status),
            "last_loss": last_value(rows, "loss"), "best_val_loss": self.best_val_loss(status, rows),
            "pid": status.get("pid") if status.get("alive") else None, "error": status.get("error"),
        }

    @staticmethod
    def best_val_loss(status, rows):
        """status.json's (live), else the lowest validation loss in the metrics."""
        if finite(status.get("best_val_loss")) is not None:
            return status["best_val_loss"]
        i = 1 + METRIC_KEYS.index("val_loss")
        return min((r[i] for r in rows if r[i] is not None), default=None)

    def list_runs(self):
        rows = []
        for rid in self.run_ids():
            try:
                rows.append(self.summary_row(self.run(rid)))
            except (NotFound, OSError):
                continue
        rows.sort(key=lambda r: (r["created"] or 0, r["id"]), reverse=True)
        return rows

    def detail(self, run):
        status = self.status(run)
        rows = self.metrics_cache(run).refresh()
        recent = [r for r in rows[-20:] if r[1] is not None]

        def mean(key):
            vals = [r[1 + METRIC_KEYS.index(key)] for r in recent]
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else None

        steps_done = status.get("step")
        if not isinstance(steps_done, int):
            steps_done = rows[-1][0] if rows else 0
        summary = {"last_loss": last_value(rows, "loss"), "best_val_loss": self.best_val_loss(status, rows),
                   "steps_done": steps_done, "tokens_per_s": mean("tokens_per_s"), "ms_step": mean("ms_step")}
        return json_safe({"id": run.id, "state": status["state"], "status": status, "config": self.config(run),
                          "summary": summary})

    # -- metrics, logs, samples
    def metrics_cache(self, run):
        with self.lock:
            cache = self._metrics.get(run.id)
            if cache is None:
                cache = self._metrics[run.id] = MetricsCache(run.rd)
            return cache

    def metrics(self, run, since_step=-1, max_points=2000):
        rows = [r for r in self.metrics_cache(run).refresh() if r[0] > since_step]
        keep = downsample_index(len(rows), max_points)
        out = {"step": [rows[i][0] for i in keep]}
        for k, key in enumerate(METRIC_KEYS, 1):
            col, prev = [], -1
            for i in keep:
                v = rows[i][k]
                if v is None:                    # sparse columns (grad_norm): the bucket's last value
                    for j in range(i - 1, prev, -1):
                        if rows[j][k] is not None:
                            v = rows[j][k]
                            break
                col.append(v)
                prev = i
            out[key] = col
        return out

    def logs(self, run, tail=200):
        return tail_lines(run.rd.file(STDOUT_LOG), tail)

    def samples(self, run):
        path = run.rd.file(SAMPLES)
        if path is None:
            return []
        data = path.read_bytes()
        return [r for r in map(parse_sample, data[:data.rfind(b"\n") + 1].splitlines()) if r]

    # -- checkpoints
    def checkpoint_path(self, run, name):
        """The checkpoint file `name`, confined to the run's checkpoints folder; NotFound otherwise."""
        p = run.rd.file(f"{CHECKPOINTS}/{name}") if isinstance(name, str) and NAME_RE.match(name) else None
        if p is None or p.parent != (run.dir / CHECKPOINTS).resolve():
            raise NotFound("no such checkpoint")
        return p

    def sha256(self, path):
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        hit = self._sha.get(path)
        if hit and hit[0] == key:
            return hit[1]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        self._sha[path] = (key, h.hexdigest())
        return h.hexdigest()

    def checkpoints(self, run):
        out = []
        try:
            names = sorted(os.listdir(run.dir / CHECKPOINTS))
        except OSError:
            return out
        for name in names:
            if name.startswith("."):                            # atomic_write's temp files
                continue
            try:
                p = self.checkpoint_path(run, name)
                st = p.stat()
                out.append({"name": name, "bytes": st.st_size, "sha256": self.sha256(p),
                            "modified": st.st_mtime})
            except (NotFound, OSError):
                continue
        return out

    # -- system
    async def system(self, run):
        pid, alive, _ = self.process(run)
        if not alive or not os.path.isdir("/proc"):
            return {"pid": pid, "alive": bool(alive), "cpu_percent": None, "rss_mb": None}
        tick = os.sysconf("SC_CLK_TCK")
        st, prev = _proc_stat(pid), self._cpu.get(pid)
        if st is None:
            return {"pid": pid, "alive": False, "cpu_percent": None, "rss_mb": None}
        now = time.monotonic()
        if prev is None or not 0.05 <= now - prev[1] <= 30:    # no recent sample: measure over 0.1 s
            prev = (st[1], now)
            await asyncio.sleep(0.1)
            st, now = _proc_stat(pid), time.monotonic()
            if st is None:
                return {"pid": pid, "alive": False, "cpu_percent": None, "rss_mb": None}
        cpu = round(100.0 * (st[1] - prev[0]) / tick / (now - prev[1]), 1)
        self._cpu[pid] = (st[1], now)
        rss = _rss_mb(pid)
        return {"pid": pid, "alive": True, "cpu_percent": cpu, "rss_mb": round(rss, 1) if rss is not None else None}

    # -- launching
    def _env(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        import anectypes
        root = str(Path(anectypes.__file__).resolve().parent.parent)   # the child imports the same package
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        return env

    def _spawn(self, run_dir, argv, spec):
        """Start a trainer and record the launch (spec, pid and its start time) in launch.json."""
        with open(run_dir / STDOUT_LOG, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self._env(), close_fds=True)
        rd = RunDir(run_dir)
        launch = rd.read_json(LAUNCH) or {"created": time.time()}
        rd.write_json(LAUNCH, dict(launch, spec=spec, argv=argv[1:], pid=proc.pid, proc_start=process_start(proc.pid),
                                   launched=time.time()), sync=False)
        return proc

    def _check_slot(self):
        if self.running_count() >= self.max_running:
            raise Conflict(f"a run is already running (at most {self.max_running} at a time); stop it first")

    def start(self, spec):
        """Launch a new run of a RunSpec; returns its id."""
        with self.lock:
            self._check_slot()
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for _ in range(100):
                run_id = f"{stamp}-{model_name(spec.model)}-{secrets.token_hex(2)}"
                run_dir = self.runs_dir / run_id
                try:
                    run_dir.mkdir()
                    break
                except FileExistsError:
                    continue
            else:
                raise Conflict("could not pick a fresh run id")
            self.children[run_id] = self._spawn(run_dir, start_argv(spec, run_dir), spec.resolved().to_dict())
            self.stop_requested.discard(run_id)
            return run_id

    def resume(self, run):
        """Continue a run with its own spec (from its checkpoint; without one, from its start)."""
        with self.lock:
            status = self.status(run)
            if status["alive"]:
                raise Conflict("the run is running; stop it before resuming")
            if status["state"] == "finished":
                raise Conflict("the run is finished; to train it further, run: python -m anectypes.train "
                               f"--resume --run-dir {run.dir} --steps N")
            if not run.rd.file(CONFIG):
                raise Conflict("the trainer never started this run (no config.json): start a new run")
            self._check_slot()
            spec = self.config(run).get("spec")
            self.children[run.id] = self._spawn(run.dir, python_argv("--resume", "--run-dir", str(run.dir)), spec)
            self.stop_requested.discard(run.id)
            return run.id

    async def stop(self, run):
        """SIGTERM to the run's process group now, SIGKILL after the grace period (in the background)."""
        pid, alive, _ = self.process(run)
        if not alive:
            raise Conflict("the run is not running")
        self.stop_requested.add(run.id)
        _signal_run(pid, signal.SIGTERM)
        if run.id not in self.stopping or self.stopping[run.id].done():
            task = asyncio.get_running_loop().create_task(self._reap(run, pid))
            self.stopping[run.id] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _reap(self, run, pid):
        deadline = time.monotonic() + self.grace_s
        killed = False
        while True:
            _, alive, _ = self.process(run)
            if not alive:
                return
            if not killed and time.monotonic() >= deadline:
                _signal_run(pid, signal.SIGKILL)
                killed = True
            await asyncio.sleep(0.1)

    async def reaper(self):
        """Reap finished children every half second (no zombies between requests)."""
        while True:
            with self.lock:
                children = list(self.children.values())
            for child in children:
                child.poll()
            await asyncio.sleep(0.5)

    async def shutdown(self):
        """Stop the runs this dashboard launched (SIGTERM → checkpoint; SIGKILL after the grace period)."""
        with self.lock:
            live = [(rid, p) for rid, p in self.children.items() if p.poll() is None]
        for _, p in live:
            _signal_run(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while any(p.poll() is None for _, p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for _, p in live:
            if p.poll() is None:
                _signal_run(p.pid, signal.SIGKILL)
                p.wait()
        for t in list(self._tasks):
            t.cancel()

    # -- server-sent events
    async def events(self, run, last_event_id=None, is_disconnected=None):
        """SSE messages for one run: metrics batches, new log lines, samples, status changes, done."""
        from fastapi.sse import ServerSentEvent

        cache_rows = await anyio.to_thread.run_sync(self.metrics_cache(run).refresh)
        if last_event_id is not None:
            cursor = last_event_id
        else:
            cursor = cache_rows[-1][0] if cache_rows else -1
        logs = JsonlTail(run.rd, STDOUT_LOG, lambda b: b.decode("utf-8", "replace"), offset=-1)
        samples = JsonlTail(run.rd, SAMPLES, parse_sample, offset=-1)
        logs.read_new()
        samples.read_new()
        last_status, first = None, True
        last_row = next((r for r in cache_rows if r[0] == cursor), None)
        while True:
            status = self.status(run)
            terminal = not status["alive"] and status["state"] in TERMINAL_STATES
            # rows after the cursor, and the cursor's own row again once a validation loss joined it
            rows = [r for r in await anyio.to_thread.run_sync(self.metrics_cache(run).refresh)
                    if r[0] > cursor or r[0] == cursor and r != last_row]
            if rows:
                rows = rows[:SSE_MAX_ROWS]
                cursor, last_row = rows[-1][0], rows[-1]
                yield ServerSentEvent(event="metrics", id=str(cursor),
                                      data={"rows": [dict(zip(("step", *METRIC_KEYS), r)) for r in rows]})
            _, lines = logs.read_new()
            if lines:
                yield ServerSentEvent(event="log", data={"lines": lines[-SSE_MAX_LOG_LINES:]})
            _, new_samples = samples.read_new()
            for s in new_samples:
                yield ServerSentEvent(event="sample", data=s)
            key = json.dumps(status, sort_keys=True)
            if key != last_status:
                last_status = key
                yield ServerSentEvent(event="status", data=status, id=str(cursor),
                                      retry=2000 if first else None)
                first = False
            more = [r for r in self.metrics_cache(run).rows if r[0] > cursor]
            if terminal and not more:
                yield ServerSentEvent(event="done", data={"state": status["state"]}, id=str(cursor))
                return
            if self.closing or (is_disconnected is not None and await is_disconnected()):
                return
            if not more:
                await asyncio.sleep(POLL_S)

    # -- generation
    async def generate(self, run, prompt="", temperature=0.8, top_k=50, max_tokens=64, seed=None):
        if not run.rd.file(f"{CHECKPOINTS}/{LATEST}"):
            raise Conflict("the run has no checkpoint yet (checkpoints/latest.ckpt)")
        if self._gen_lock is None:
            self._gen_lock = asyncio.Lock()
        if self._gen_waiting >= 4:
            raise RunError(429, "too many generation requests waiting; try again shortly")
        self._gen_waiting += 1
        try:
            async with self._gen_lock:
                seed = secrets.randbits(32) if seed is None else seed
                return await anyio.to_thread.run_sync(
                    self._generate_sync, run, prompt, temperature, top_k, max_tokens, seed)
        finally:
            self._gen_waiting -= 1

    def _load_model(self, run):
        """The run's latest checkpoint as a simulator model (fp32), kept until another one is asked for."""
        from anectypes.checkpoint import load_checkpoint
        from anectypes.corpus import builtin_dataset
        from anectypes.data import active_vocab, load_tokens
        from anectypes.device import open_device
        from anectypes.model.config import ModelConfig
        from anectypes.model.transformer import Transformer
        from anectypes.tokenizer import Tokenizer

        path = run.rd.file(f"{CHECKPOINTS}/{LATEST}")
        if path is None:
            raise Conflict("the run has no checkpoint yet (checkpoints/latest.ckpt)")
        st = path.stat()
        key = (run.id, st.st_size, st.st_mtime_ns)
        if self._model and self._model[0] == key:
            return self._model[1:]
        ckpt = load_checkpoint(path)
        spec = self.config(run).get("spec") or {}
        if spec.get("data"):
            tokens = load_tokens(spec["data"])
            tokenizer = Tokenizer.load(spec["tokenizer"]) if spec.get("tokenizer") else builtin_dataset()[0]
        else:
            tokenizer, tokens = builtin_dataset()
        cfg = ModelConfig(**ckpt.config).validate()
        model = Transformer(cfg, open_device("sim", precision="fp32"), ckpt.params, active_vocab(tokens))
        if self._model:
            self._model[1].close()
        self._model = (key, model, tokenizer, int(ckpt.state.get("step", 0)))
        return self._model[1:]

    def close(self):
        if self._model:
            self._model[1].close()
            self._model = None

    def _generate_sync(self, run, prompt, temperature, top_k, max_tokens, seed):
        from anectypes.errors import AnectypesError
        from anectypes.generate import generate

        try:
            model, tokenizer, step = self._load_model(run)
            if prompt and max(tokenizer.encode(prompt)) >= model.cfg.vocab:
                raise Conflict("the prompt has tokens outside the model's vocabulary")
            text = generate(model, tokenizer, prompt, n_new=max_tokens, temperature=temperature, top_k=top_k,
                            seed=seed)
        except AnectypesError as e:
            raise Conflict(f"cannot generate: {e}") from None
        return {"text": text, "step": step}


def downsample_index(n, max_points):
    """Row indices after striding n rows down to at most max_points, always keeping the last one."""
    if n <= max_points:
        return list(range(n))
    stride = math.ceil(n / max_points)
    idx = list(range(0, n, stride))
    if idx[-1] != n - 1:
        if len(idx) >= max_points:
            idx[-1] = n - 1
        else:
            idx.append(n - 1)
    return idx
