"""The dashboard's run store and supervisor.

A run is a directory under the runs folder, written by `python -m anectypes.train --run-dir DIR`
(config.json, status.json, metrics.jsonl, samples.jsonl, train.log, checkpoints/) plus what the
dashboard adds when it launches one: stdout.log (the child's stdout+stderr) and dashboard.json (the
launch request, so a resume can pass the same options again).

Everything is recomputed from those files, so the list survives a dashboard restart. The state
shown is status.json's, corrected by whether the process is really there: a run whose status says
running/restarting but whose process is gone is `failed`, with the last log lines as its error
(children of this dashboard are checked with Popen.poll(), others through /proc/<pid>).

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
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import anyio

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
NAME_RE = RUN_ID_RE
METRIC_KEYS = ("loss", "lr", "grad_norm", "loss_scale", "ms_step", "tokens_per_s", "t_eval", "t_io", "t_cpu",
               "t_cls", "t_dw_wait")
ACTIVE_STATES = ("running", "restarting")
TERMINAL_STATES = ("finished", "stopped", "interrupted", "failed")
LAUNCH_FILE = "dashboard.json"
LOG_FILE = "stdout.log"
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


def read_json(path):
    """A JSON object from a file, or None when it is missing, unreadable or not an object."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def tail_lines(path, n, max_bytes=4 << 20):
    """The last n lines of a text file (reading backwards, at most max_bytes)."""
    if n <= 0:
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
    """A metrics.jsonl line as a tuple (step, *METRIC_KEYS values), or None when malformed."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return (step, *(finite(rec.get(k)) for k in METRIC_KEYS))


def parse_sample(line):
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
        return None
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return {"step": step, "text": rec["text"]}


class JsonlTail:
    """Incremental reader of an append-only JSONL file: only complete lines, malformed ones skipped.

    A file replaced under the same name (the trainer rewrites metrics.jsonl atomically on resume)
    or truncated is read again from its start.
    """

    def __init__(self, path, parse, offset=None):
        self.path, self.parse = path, parse
        self.ident, self.offset, self.start = None, 0, offset
        self.lock = threading.Lock()

    def read_new(self):
        """(reset, new parsed records): reset is True when the file was replaced or truncated."""
        with self.lock:
            try:
                f = open(self.path, "rb")
            except OSError:
                reset = self.ident is not None
                self.ident, self.offset, self.start = None, 0, None   # when it appears, read it all
                return reset, []
            with f:
                st = os.fstat(f.fileno())
                ident, reset = (st.st_dev, st.st_ino), False
                if ident != self.ident or st.st_size < self.offset:
                    reset = self.ident is not None
                    self.ident, self.offset = ident, 0
                    if self.start is not None:          # first open: begin where asked (e.g. at the end)
                        self.offset = min(self.start, st.st_size) if self.start >= 0 else st.st_size
                        self.start = None
                        if self.offset:
                            f.seek(self.offset - 1)
                            if f.read(1) != b"\n":      # started inside a line: skip to the next one
                                rest = f.readline()
                                self.offset += len(rest)
                if st.st_size <= self.offset:
                    return reset, []
                f.seek(self.offset)
                chunk = f.read(st.st_size - self.offset)
            end = chunk.rfind(b"\n")
            if end < 0:
                return reset, []
            self.offset += end + 1
            out = []
            for line in chunk[:end].split(b"\n"):
                if line.strip():
                    rec = self.parse(line)
                    if rec is not None:
                        out.append(rec)
            return reset, out


class MetricsCache:
    """All parsed rows of one run's metrics.jsonl, refreshed incrementally."""

    def __init__(self, path):
        self.tail = JsonlTail(path, parse_metric)
        self.rows = []
        self.lock = threading.Lock()

    def refresh(self):
        with self.lock:
            reset, new = self.tail.read_new()
            if reset:
                self.rows = []
            self.rows.extend(new)
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


def _proc_cmdline(pid):
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except (OSError, ValueError):
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


def is_trainer(pid, run_dir):
    """Whether pid is a live (non-zombie) `anectypes.train` process of this run."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if not os.path.isdir("/proc"):                          # not Linux: best effort
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    argv = _proc_cmdline(pid)
    if not argv or "anectypes.train" not in argv:
        return False
    for i, a in enumerate(argv):                           # a --run-dir must be this run's
        value = argv[i + 1] if a == "--run-dir" and i + 1 < len(argv) else (
            a.split("=", 1)[1] if a.startswith("--run-dir=") else None)
        if value is not None:
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
                return Path(cwd, value).resolve() == Path(run_dir).resolve()
            except OSError:
                return True
    return True


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
        self._best = {}                # path -> ((size, mtime_ns), best val loss)
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
        if d.parent != self.runs_dir or not d.is_dir() or not self._is_run_dir(d):
            raise NotFound()
        return Run(run_id, d)

    @staticmethod
    def _is_run_dir(d):
        return any((d / n).is_file() for n in ("config.json", "status.json", LAUNCH_FILE, "metrics.jsonl"))

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
        pid, alive = self._recorded_process(run)
        return pid, alive, None

    @staticmethod
    def _recorded_process(run):
        """(pid, alive) from status.json's pid or, for a launch not yet reported, dashboard.json's."""
        pids = [(read_json(run.dir / name) or {}).get("pid") for name in ("status.json", LAUNCH_FILE)]
        pids = [p for p in pids if isinstance(p, int) and not isinstance(p, bool)]
        for pid in pids:
            if is_trainer(pid, run.dir):
                return pid, True
        return (pids[0] if pids else None), False

    def status(self, run):
        """status.json corrected by the process check (see the module notes); always has `state`."""
        # check the process first: a trainer writes its final status before it exits
        with self.lock:
            child = self.children.get(run.id)
        if child is not None:
            rc = child.poll()
            pid, alive = child.pid, rc is None
        else:
            rc = None
            pid, alive = self._recorded_process(run)
        status = dict(read_json(run.dir / "status.json") or {})
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
        lines = tail_lines(run.dir / LOG_FILE, ERROR_LOG_LINES)
        return lines or tail_lines(run.dir / "train.log", ERROR_LOG_LINES)

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
        launch = read_json(run.dir / LAUNCH_FILE) or {}
        if finite(launch.get("created")) is not None:
            return float(launch["created"])
        m = re.match(r"(\d{8}-\d{6})", run.id)
        if m:
            try:
                return time.mktime(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
            except ValueError:
                pass
        times = [p.stat().st_mtime for p in (run.dir / "config.json", run.dir / LAUNCH_FILE) if p.exists()]
        return min(times) if times else run.dir.stat().st_mtime

    def updated(self, run, status):
        if finite(status.get("updated")) is not None:
            t = float(status["updated"])
        else:
            t = 0.0
        for name in ("metrics.jsonl", "status.json", LOG_FILE):
            try:
                t = max(t, (run.dir / name).stat().st_mtime)
            except OSError:
                pass
        return t or None

    def last_metric(self, run):
        rows = tail_lines(run.dir / "metrics.jsonl", 50, max_bytes=65536)
        complete = rows
        try:
            with open(run.dir / "metrics.jsonl", "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    complete = rows[:-1]                    # a partial last line
        except OSError:
            return None
        for line in reversed(complete):
            rec = parse_metric(line)
            if rec is not None:
                return dict(zip(("step", *METRIC_KEYS), rec))
        return None

    def best_val_loss(self, run):
        """The best validation loss: best.ckpt's state (exact), else train.log's `val loss` lines."""
        path = run.dir / "checkpoints" / "best.ckpt"
        try:
            st = path.stat()
            key = (st.st_size, st.st_mtime_ns)
            hit = self._best.get(path)
            if hit and hit[0] == key:
                return hit[1]
            with zipfile.ZipFile(path) as zf:
                meta = json.loads(zf.read("meta.json"))
            value = finite(meta.get("state", {}).get("best_val_loss"))
            self._best[path] = (key, value)
            return value
        except (OSError, KeyError, ValueError, zipfile.BadZipFile, AttributeError):
            pass
        best = None
        try:
            with open(run.dir / "train.log", errors="replace") as f:
                for line in f:
                    m = re.search(r"val loss (\S+)", line)
                    if m:
                        try:
                            v = float(m.group(1).rstrip(","))
                        except ValueError:
                            continue
                        if math.isfinite(v) and (best is None or v < best):
                            best = v
        except OSError:
            pass
        return best

    def summary_row(self, run):
        status = self.status(run)
        config = read_json(run.dir / "config.json") or {}
        launch = read_json(run.dir / LAUNCH_FILE) or {}
        last = self.last_metric(run)
        model_name = config.get("model_name") or (launch.get("request") or {}).get("model")
        steps = status.get("steps")
        if not isinstance(steps, int):
            steps = (config.get("schedule") or {}).get("steps") or (launch.get("request") or {}).get("steps")
        step = status.get("step")
        if not isinstance(step, int):
            step = last["step"] + 1 if last else None
        return {
            "id": run.id, "state": status["state"], "step": step, "steps": steps if isinstance(steps, int) else None,
            "model_name": model_name if isinstance(model_name, str) else None,
            "created": self.created(run), "updated": self.updated(run, status),
            "last_loss": last["loss"] if last else None, "best_val_loss": self.best_val_loss(run),
            "pid": status.get("pid") if status.get("alive") else None, "error": status.get("error"),
        }

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
        config = read_json(run.dir / "config.json")
        if config is None:                                   # not written by the trainer yet
            config = dict((read_json(run.dir / LAUNCH_FILE) or {}).get("request") or {})
        rows = self.metrics_cache(run).refresh()
        recent = rows[-20:]

        def mean(i):
            vals = [r[i] for r in recent if r[i] is not None]
            return sum(vals) / len(vals) if vals else None

        last = rows[-1] if rows else None
        steps_done = status.get("step")
        if not isinstance(steps_done, int):
            steps_done = last[0] + 1 if last else 0
        summary = {"last_loss": last[1] if last else None, "best_val_loss": self.best_val_loss(run),
                   "steps_done": steps_done, "tokens_per_s": mean(1 + METRIC_KEYS.index("tokens_per_s")),
                   "ms_step": mean(1 + METRIC_KEYS.index("ms_step"))}
        return json_safe({"id": run.id, "state": status["state"], "status": status, "config": config,
                          "summary": summary})

    # -- metrics, logs, samples
    def metrics_cache(self, run):
        with self.lock:
            cache = self._metrics.get(run.id)
            if cache is None:
                cache = self._metrics[run.id] = MetricsCache(run.dir / "metrics.jsonl")
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
        return tail_lines(run.dir / LOG_FILE, tail)

    def samples(self, run):
        out = []
        try:
            with open(run.dir / "samples.jsonl", "rb") as f:
                data = f.read()
        except OSError:
            return out
        end = data.rfind(b"\n")
        for line in data[:end + 1].split(b"\n"):
            if line.strip():
                rec = parse_sample(line)
                if rec:
                    out.append(rec)
        return out

    # -- checkpoints
    def checkpoint_dir(self, run):
        return (run.dir / "checkpoints").resolve()

    def checkpoint_path(self, run, name):
        """The checkpoint file `name`, confined to the run's checkpoints folder; NotFound otherwise."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise NotFound("no such checkpoint")
        base = self.checkpoint_dir(run)
        try:
            p = (base / name).resolve()
        except (OSError, RuntimeError):
            raise NotFound("no such checkpoint") from None
        if p.parent != base or not p.is_relative_to(run.dir) or not p.is_file():
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
        base, out = self.checkpoint_dir(run), []
        try:
            names = sorted(os.listdir(base))
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

    def _spawn(self, run_dir, argv):
        with open(run_dir / LOG_FILE, "ab") as log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self._env(), close_fds=True)

    def _check_slot(self):
        if self.running_count() >= self.max_running:
            raise Conflict(f"a run is already running (at most {self.max_running} at a time); stop it first")

    def start(self, req):
        """Launch a new run from a validated request dict; returns its id."""
        with self.lock:
            self._check_slot()
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for _ in range(100):
                run_id = f"{stamp}-{req['model']}-{secrets.token_hex(2)}"
                run_dir = self.runs_dir / run_id
                try:
                    run_dir.mkdir()
                    break
                except FileExistsError:
                    continue
            else:
                raise Conflict("could not pick a fresh run id")
            argv = [sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(run_dir),
                    "--model", req["model"], "--backend", req["backend"], "--precision", req["precision"],
                    "--seed", str(req["seed"]), "--clip", repr(float(req["clip"])),
                    "--sample-every", str(req["sample_every"]), "--log-every", str(req["log_every"]),
                    "--save-every", str(req["save_every"])]
            for key, flag in (("steps", "--steps"), ("lr", "--lr"), ("accum", "--accum"), ("warmup", "--warmup")):
                if req.get(key) is not None:
                    argv += [flag, repr(req[key]) if isinstance(req[key], float) else str(req[key])]
            for key in ("data", "tokenizer"):
                if req.get(key):
                    argv.append(f"--{key}={req[key]}")           # one argv item, never an option itself
            launch = {"created": time.time(), "request": req, "argv": argv[1:]}
            self._write_launch(run_dir, launch)
            proc = self._spawn(run_dir, argv)
            self.children[run_id] = proc
            self.stop_requested.discard(run_id)
            self._write_launch(run_dir, dict(launch, pid=proc.pid))
            return run_id

    @staticmethod
    def _write_launch(run_dir, doc):
        tmp = run_dir / f".{LAUNCH_FILE}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, run_dir / LAUNCH_FILE)

    def resume(self, run):
        with self.lock:
            if self.status(run)["alive"]:
                raise Conflict("the run is running; stop it before resuming")
            if not (run.dir / "checkpoints" / "latest.ckpt").is_file():
                raise Conflict("the run has no checkpoint yet (checkpoints/latest.ckpt) to resume from")
            self._check_slot()
            config = read_json(run.dir / "config.json") or {}
            launch = read_json(run.dir / LAUNCH_FILE) or {}
            req = launch.get("request") or {}
            argv = [sys.executable, "-m", "anectypes.train", "--resume", "--run-dir", str(run.dir)]
            backend = req.get("backend") or config.get("backend")
            if backend in ("auto", "sim", "ane"):
                argv += ["--backend", backend]
            if config.get("precision") in ("fp16", "fp32"):
                argv += ["--precision", config["precision"]]
            for key, flag in (("seed", "--seed"), ("clip", "--clip"), ("loss_scale", "--loss-scale")):
                v = config.get(key)
                if finite(v) is not None:
                    argv += [flag, str(int(v)) if key == "seed" else repr(float(v))]
            if config.get("dynamic_loss_scale") is True:
                argv.append("--dynamic-loss-scale")
            for key, flag in (("sample_every", "--sample-every"), ("log_every", "--log-every"),
                              ("save_every", "--save-every")):
                v = req.get(key)
                if isinstance(v, int) and not isinstance(v, bool):
                    argv += [flag, str(v)]
            proc = self._spawn(run.dir, argv)
            self.children[run.id] = proc
            self.stop_requested.discard(run.id)
            self._write_launch(run.dir, dict(launch, pid=proc.pid, resumed=time.time()))
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
        logs = JsonlTail(run.dir / LOG_FILE, lambda b: b.decode("utf-8", "replace"), offset=-1)
        samples = JsonlTail(run.dir / "samples.jsonl", parse_sample, offset=-1)
        logs.read_new()
        samples.read_new()
        last_status, first = None, True
        while True:
            status = self.status(run)
            terminal = not status["alive"] and status["state"] in TERMINAL_STATES
            rows = [r for r in await anyio.to_thread.run_sync(self.metrics_cache(run).refresh) if r[0] > cursor]
            if rows:
                rows = rows[:SSE_MAX_ROWS]
                cursor = rows[-1][0]
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
        if not (run.dir / "checkpoints" / "latest.ckpt").is_file():
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
        from anectypes.checkpoint import load_checkpoint
        from anectypes.corpus import builtin_dataset
        from anectypes.data import active_vocab, load_tokens
        from anectypes.device import open_device
        from anectypes.model.config import ModelConfig
        from anectypes.model.transformer import Transformer
        from anectypes.tokenizer import Tokenizer

        path = run.dir / "checkpoints" / "latest.ckpt"
        st = path.stat()
        key = (run.id, st.st_size, st.st_mtime_ns)
        if self._model and self._model[0] == key:
            return self._model[1:]
        ckpt = load_checkpoint(path)
        config = read_json(run.dir / "config.json") or {}
        data, tok_path = config.get("data"), config.get("tokenizer")
        if data:
            tokens = load_tokens(data)
            tokenizer = Tokenizer.load(tok_path) if tok_path else builtin_dataset()[0]
        else:
            tokenizer, tokens = builtin_dataset()
        cfg = ModelConfig(**ckpt.config).validate()
        model = Transformer(cfg, open_device("sim", precision="fp32"), ckpt.params, active_vocab(tokens))
        if self._model:
            self._model[1].dw.shutdown(wait=False)
        self._model = (key, model, tokenizer, int(ckpt.state.get("step", 0)))
        return self._model[1:]

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
