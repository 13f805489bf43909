"""The trainer processes: launching, stopping and reaping them, their state and their CPU and memory.

What the dashboard adds when it launches a run is stdout.log (the child's stdout+stderr) and
launch.json (the spec it launched, or queued, and the child's pid and start time); anectypes.runs
builds the command lines and tells a live trainer by pid + start time and its identity. launch.json
holds no command: a queued run's command is built again from its spec, checked as a new run's is
(admit), since a run folder may come from anyone.

The state shown is status.json's, corrected by whether the process is really there: a run whose
status says running/restarting but whose process is gone is `failed`, with the last log lines as its
error (children of this dashboard are checked with Popen.poll()). Everything is recomputed from the
files, so the state survives a dashboard restart. Training runs in a subprocess in its own session,
so a stop signals its whole process group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import anyio

import anectypes
from anectypes.errors import AnectypesError
from anectypes.formats import hf
from anectypes.model.config import PRESETS
from anectypes.train import report_to
from anectypes.runs import (ACTIVE_STATES, CONFIG, LAUNCH, STATUS, STDOUT_LOG, TERMINAL_STATES, TRAIN_LOG, RunDir,
                            RunError, RunSpec, finite, python_argv, start_argv)
from anectypes.host.processes import cpu_ticks, process_start, rss_mb

from .api_errors import Conflict, Invalid, NotFound
from .files import json_safe, tail_lines

ERROR_LOG_LINES = 20
PACKAGE_ROOT = str(Path(anectypes.__file__).resolve().parent.parent)   # the child imports the same package


# --- signals and the environment ------------------------------------------------------------------

def signal_run(pid, sig):
    """Signal the run's process group (its own session) or, failing that, the process."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def error_lines(run):
    """The last lines of the trainer's output (stdout.log, else train.log)."""
    lines = tail_lines(run.rd.file(STDOUT_LOG), ERROR_LOG_LINES)
    return lines or tail_lines(run.rd.file(TRAIN_LOG), ERROR_LOG_LINES)


def usable_cpus():
    """The CPUs this process may run on: what the ranks of a run started here share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def trainer_env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


# --- the supervisor -------------------------------------------------------------------------------

class Supervisor:
    """The trainers of the runs in `files` (a RunFiles): at most max_running alive at a time, reading
    their data from files in data_dir."""

    def __init__(self, files, data_dir="data", max_running=1, grace_s=10.0):
        self.files, self.max_running, self.grace_s = files, max_running, grace_s
        self.data_dir = Path(data_dir).resolve()
        self.children = {}             # run id -> Popen (processes this dashboard launched)
        self.stopping = {}             # run id -> stop task
        self.stop_requested = set()    # run ids stopped through stop() since their last launch
        self.lock = threading.RLock()
        self._cpu = {}                 # pid -> (ticks, monotonic time)
        self._tasks = set()
        # run ids waiting for a slot, oldest first (launch.json {"queued": true}: kept over a restart; a run
        # queued again after a cancel is as old as its "requeued" time)
        queued = {}
        for r in files.runs():
            launch = r.rd.read_json(LAUNCH) or {}
            if launch.get("queued"):
                queued[r.id] = (finite(launch.get("requeued")) or r.created(), r.id)
        self.queue = sorted(queued, key=queued.get)

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
        with self.lock:
            if run.id in self.queue:
                return {"state": "queued", "position": self.queue.index(run.id) + 1, "pid": None, "alive": False}
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
            lines = error_lines(run)
            status["error"] = (f"the trainer process{f' {pid}' if pid else ''} {how} without a final status"
                               + ("; last log lines:\n" + "\n".join(lines) if lines else ""))
        status.setdefault("pid", pid)
        status["alive"] = alive
        return json_safe(status)

    def running_count(self):
        return sum(self.status(run)["alive"] for run in self.files.runs())

    async def system(self, run):
        """The trainer's CPU % (over the time since the last call, else over 0.1 s) and RSS."""
        pid, alive, _ = self.process(run)
        gone = {"pid": pid, "alive": False, "cpu_percent": None, "rss_mb": None}
        if not alive:
            return gone
        ticks, prev = cpu_ticks(pid), self._cpu.get(pid)
        if ticks is None:
            return gone
        now = time.monotonic()
        if prev is None or not 0.05 <= now - prev[1] <= 30:    # no recent sample: measure over 0.1 s
            prev = (ticks, now)
            await asyncio.sleep(0.1)
            ticks, now = cpu_ticks(pid), time.monotonic()
            if ticks is None:
                return gone
        cpu = round(100.0 * (ticks - prev[0]) / os.sysconf("SC_CLK_TCK") / (now - prev[1]), 1)
        self._cpu[pid] = (ticks, now)
        rss = rss_mb(pid)
        return {"pid": pid, "alive": True, "cpu_percent": cpu, "rss_mb": round(rss, 1) if rss is not None else None}

    # -- launching
    def admit(self, spec):
        """The spec as this dashboard starts it (data and tokenizer as resolved paths), if it may start
        it: beyond RunSpec's own checks, a preset model (with init_from, the source run's), data and
        tokenizer files inside the data folder, init_from a checkpoint of one of its runs or a Hugging Face
        folder inside the data folder, report_to's
        libraries installed, and no more ranks than this machine's CPUs; Invalid naming the field
        otherwise. Every run it starts, new or queued, passes here."""
        paths = {name: str(self.data_file(name, getattr(spec, name)))
                 for name in ("data", "tokenizer") if getattr(spec, name) is not None}
        models = PRESETS
        if spec.init_from is not None and not self.in_data_folder(spec.init_from):
            try:
                models = [(self.files.checkpoint_run(spec.init_from).config().get("spec") or {}).get("model")]
            except NotFound:
                raise Invalid("not a checkpoint of a run of this dashboard", "init_from") from None
        elif spec.init_from is not None:
            paths["init_from"] = str(self.model_folder(spec.init_from))
        if spec.model not in models:
            raise Invalid(f"must be one of {', '.join(map(str, models))}", "model")
        try:
            report_to.check(spec)
        except AnectypesError as e:
            raise Invalid(str(e), "report_to") from None
        cpus = usable_cpus()
        if spec.ranks > cpus:
            raise Invalid(f"at most {cpus}, the CPUs of the dashboard's machine (it starts --ranks N there)",
                          "ranks")
        return replace(spec, **paths)

    def in_data_folder(self, value):
        """The resolved path of `value` (relative to the data folder, or absolute) if it exists inside the data
        folder (not the folder itself), else None."""
        try:
            p = (self.data_dir / Path(value).expanduser()).resolve()
            return p if p.is_relative_to(self.data_dir) and p != self.data_dir and p.exists() else None
        except (OSError, RuntimeError, ValueError):
            return None

    def data_file(self, name, value):
        """The resolved path of data or a tokenizer: a file or a folder (of text, a Hugging Face model's
        tokenizer) inside the data folder."""
        p = self.in_data_folder(value)
        if p is None:
            raise Invalid(f"not a file or folder in the data folder {self.data_dir} (the dashboard's --data-dir)",
                          name)
        return p

    def model_folder(self, value, name="init_from_folder"):
        """The resolved path of a Hugging Face model folder inside the data folder."""
        p = self.data_file(name, value)
        if not hf.is_hf(p):
            raise Invalid("not a Hugging Face model folder (its config.json with a model_type, and safetensors)", name)
        return p

    def spawn(self, run_id, run_dir, argv, spec):
        """Start a trainer and record the launch (spec, pid and its start time) in launch.json."""
        with open(run_dir / STDOUT_LOG, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=trainer_env(), close_fds=True)
        rd = RunDir(run_dir)
        launch = rd.read_json(LAUNCH) or {"created": time.time()}
        rd.write_json(LAUNCH, dict(launch, spec=spec, pid=proc.pid, proc_start=process_start(proc.pid),
                                   launched=time.time(), queued=False), sync=False)
        self.children[run_id] = proc
        self.stop_requested.discard(run_id)

    def check_slot(self):
        if self.running_count() >= self.max_running:
            raise Conflict(f"a run is already running (at most {self.max_running} at a time); stop it first")

    def start(self, spec):
        """Launch a new run of an admitted RunSpec, or queue it while max_running trainers run (or others
        wait); returns its id."""
        with self.lock:
            run_dir = self.files.new_run_dir(spec)
            record = spec.resolved().to_dict()
            if self.queue or self.running_count() >= self.max_running:
                RunDir(run_dir).write_json(LAUNCH, {"created": time.time(), "spec": record, "queued": True},
                                           sync=False)
                self.queue.append(run_dir.name)
            else:
                self.spawn(run_dir.name, run_dir, start_argv(spec, run_dir), record)
            return run_dir.name

    def start_queued(self):
        """Launch the oldest queued runs while there are free slots (a run deleted meanwhile is dropped),
        each from its spec admitted again (a launch.json may come from anyone): one that does not pass
        fails, never started."""
        with self.lock:
            while self.queue and self.running_count() < self.max_running:
                try:
                    run = self.files.run(self.queue.pop(0))
                except NotFound:
                    continue
                try:
                    spec = self.admit(RunSpec.from_dict((run.rd.read_json(LAUNCH) or {}).get("spec"),
                                                        f"{LAUNCH}: spec"))
                except (RunError, Invalid) as e:
                    self.end_queued(run, "failed", f"not started: {e}")
                    continue
                self.spawn(run.id, run.dir, start_argv(spec, run.dir), spec.resolved().to_dict())

    def cancel(self, run):
        """Take a queued run out of the queue: it ends cancelled, never started (resume queues it again)."""
        with self.lock:
            self.queue.remove(run.id)
            self.end_queued(run, "cancelled", None)

    def requeue(self, run):
        """A cancelled run back at the end of the queue (started at once when a slot is free)."""
        with self.lock:
            run.rd.write_json(LAUNCH, dict(run.rd.read_json(LAUNCH) or {}, queued=True, requeued=time.time()),
                              sync=False)
            self.queue.append(run.id)
            self.start_queued()
            return run.id

    def end_queued(self, run, state, error):
        run.rd.write_json(LAUNCH, dict(run.rd.read_json(LAUNCH) or {}, queued=False), sync=False)
        run.rd.write_json(STATUS, {"state": state, "error": error, "updated": time.time()}, sync=False)

    def resume(self, run):
        """Continue a run with its own spec (from its checkpoint; without one, from its start); a cancelled
        run is queued again."""
        with self.lock:
            status = self.status(run)
            if status["state"] == "cancelled":
                return self.requeue(run)
            if status["alive"]:
                raise Conflict("the run is running; stop it before resuming")
            if status["state"] == "finished":
                raise Conflict("the run is finished; to train it further, run: python -m anectypes.train "
                               f"--resume --run-dir {run.dir} --steps N")
            if not run.rd.file(CONFIG):
                raise Conflict("the trainer never started this run (no config.json): start a new run")
            spec = run.config().get("spec") or {}
            try:                                   # a run folder may come from elsewhere: its files as a new run's
                for name in ("data", "tokenizer"):
                    if spec.get(name) is not None:
                        self.data_file(name, spec[name])
            except Invalid as e:
                raise Conflict(f"the run's {e.msg}; resume it from the command line: python -m anectypes.train "
                               f"--resume --run-dir {run.dir}") from None
            self.check_slot()
            self.spawn(run.id, run.dir, python_argv("--resume", "--run-dir", str(run.dir)), spec)
            return run.id

    # -- stopping
    def stop(self, run):
        """SIGTERM to the run's process group now, SIGKILL after the grace period (in the background, on
        the running event loop); a queued run is cancelled."""
        if run.id in self.queue:
            return self.cancel(run)
        pid, alive, _ = self.process(run)
        if not alive:
            raise Conflict("the run is not running")
        self.stop_requested.add(run.id)
        signal_run(pid, signal.SIGTERM)
        if run.id not in self.stopping or self.stopping[run.id].done():
            task = asyncio.get_running_loop().create_task(self.kill_after_grace(run, pid))
            self.stopping[run.id] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def kill_after_grace(self, run, pid):
        deadline = time.monotonic() + self.grace_s
        killed = False
        while True:
            _, alive, _ = self.process(run)
            if not alive:
                return
            if not killed and time.monotonic() >= deadline:
                signal_run(pid, signal.SIGKILL)
                killed = True
            await asyncio.sleep(0.1)

    async def reaper(self):
        """Reap finished children every half second (no zombies between requests), and start queued runs
        when slots are free."""
        while True:
            with self.lock:
                children = list(self.children.values())
            for child in children:
                child.poll()
            if self.queue:
                await anyio.to_thread.run_sync(self.start_queued)
            await asyncio.sleep(0.5)

    async def shutdown(self):
        """Stop the runs this dashboard launched (SIGTERM → checkpoint; SIGKILL after the grace period)."""
        with self.lock:
            live = [p for p in self.children.values() if p.poll() is None]
        for p in live:
            signal_run(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for p in live:
            if p.poll() is None:
                signal_run(p.pid, signal.SIGKILL)
                p.wait()
        for t in list(self._tasks):
            t.cancel()

