"""The real dashboard as a test fixture: `python -m anectypes.dashboard` on a free 127.0.0.1 port.

Shared by tests/test_dashboard_api.py, tests/test_dashboard_security.py, tests/test_dashboard_schema.py and
tests/test_dashboard_browser.py (`from support.dashboard_server import ...`), with `fake_trainer`, a
process the dashboard takes for a run's trainer. The differences between
those tests are options of `Dashboard`: the folder it runs in (`cwd`), extra environment (`env`),
an optional token (`token`) and whether `client()` sends it (`client_token`).
"""

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from anectypes.host.processes import process_start

ROOT = Path(__file__).resolve().parents[2]


def fake_trainer(run_dir, seconds=300):
    """A sleeping process that the dashboard verifies as the trainer of run_dir (its command line runs
    anectypes.train and names the folder, as the dashboard's own trainers do): (its Popen, the
    status.json fields of a live trainer). The caller kills it."""
    p = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})", "-m", "anectypes.train",
                          "--run-dir", str(Path(run_dir).resolve())])
    return p, {"state": "running", "pid": p.pid, "proc_start": process_start(p.pid)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dashboard:
    """`python -m anectypes.dashboard` on a free 127.0.0.1 port, polled until /api/health answers.

    runs_dir, log_path: its --runs-dir and the file its stdout and stderr are appended to.
    token: passed as --token; the health poll always sends it, `client()` only with client_token.
    cwd: where it runs (the repository root by default); anywhere else the repository root is put
        in front of PYTHONPATH, so that `-m anectypes.dashboard` is still this checkout.
    env: extra environment variables, over os.environ as it is at each start().
    args: more command-line arguments (e.g. ["--max-running", "0"]).
    It runs in its own session (stop() can kill its whole process group) with stdin from /dev/null.
    start() may be called again after stop(); each start takes a new free port.
    """

    def __init__(self, runs_dir, log_path, token=None, *, cwd=ROOT, env=None, client_token=True, args=()):
        self.runs_dir, self.log_path, self.token = Path(runs_dir), Path(log_path), token
        self.cwd, self.extra_env, self.client_token = Path(cwd), dict(env or {}), client_token
        self.args, self.proc = list(args), None

    def start(self, timeout=30):
        self.port = free_port()
        argv = [sys.executable, "-m", "anectypes.dashboard", "--port", str(self.port),
                "--runs-dir", str(self.runs_dir), *self.args] + (["--token", self.token] if self.token else [])
        env = dict(os.environ, **self.extra_env)
        if self.cwd.resolve() != ROOT:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(f"{self.base}/api/health", headers=self.auth_headers(), timeout=5)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                text = self.log_path.read_text(errors="replace")
                pytest.fail(f"the dashboard did not come up (exit {self.proc.returncode}):\n{text}")
            time.sleep(0.1)

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    def auth_headers(self):
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, **kw):
        headers = self.auth_headers() if self.client_token else {}
        return httpx.Client(base_url=self.base, timeout=30, headers=headers, **kw)

    def raw(self, method, path, headers=None, body=None):
        """A request sent exactly as written (no client-side path normalisation): (status, headers, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def stop(self, timeout=30, check=True):
        """SIGTERM (the dashboard stops its runs on the way out), then wait; after timeout seconds its
        process group is killed, and with check the timeout is raised."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill()
                if check:
                    raise

    def _kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
