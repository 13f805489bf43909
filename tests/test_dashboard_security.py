"""The dashboard's defences, against a real uvicorn subprocess: path traversal on every route that takes
a run id or a file name, Host / Origin / content-type / body-size checks, the optional token (bearer
and cookie), disabled CDN doc pages, security headers, and trainers launched from an argv list. Then
what a run folder from someone else may hold (a launch.json with a command, a status.json naming
another process), concurrent changes to one run, the catalogue of bad requests and bad flags.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from anectypes.data.corpus import builtin_dataset
from anectypes.runs import RunSpec
from anectypes.host.processes import process_start
from support.dashboard_server import Dashboard, fake_trainer

SECRET = "TOPSECRET-3f9c"
CONFIG_MARK = "config-mark-71b2"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """runs/run-a (a finished run with a checkpoint and two symlinks out of checkpoints/), runs/linkrun (a
    symlink to a run folder outside runs/), and secret.txt and data/ (the data folder) beside runs/."""
    top = tmp_path_factory.mktemp("sec")
    runs = top / "runs"
    run = runs / "run-a"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_name": "tiny", "note": CONFIG_MARK}))
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 2, "steps": 2, "pid": None}))
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n')
    (run / "stdout.log").write_text("hello\n")
    (run / "checkpoints" / "latest.ckpt").write_bytes(bytes(range(256)) * 4)
    (top / "secret.txt").write_text(SECRET)
    (top / "data").mkdir()                                       # the dashboard's data folder (its cwd's data)
    (run / "checkpoints" / "up.ckpt").symlink_to(Path("..") / "config.json")
    (run / "checkpoints" / "out.ckpt").symlink_to(top / "secret.txt")
    outside = top / "outside-run"
    (outside / "checkpoints").mkdir(parents=True)
    (outside / "config.json").write_text(SECRET)
    (outside / "status.json").write_text(json.dumps({"state": "finished", "note": SECRET}))
    (outside / "checkpoints" / "latest.ckpt").write_text(SECRET)
    (runs / "linkrun").symlink_to(outside)
    # runs/evil: a run folder whose every file is a symlink out of it
    evil = runs / "evil"
    (evil / "checkpoints").mkdir(parents=True)
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "note": SECRET}) + "\n")
    (outside / "samples.jsonl").write_text(json.dumps({"step": 1, "text": SECRET}) + "\n")
    (outside / "launch.json").write_text(json.dumps({"created": 1.0, "spec": {"model": SECRET}}))
    for name in ("config.json", "status.json", "metrics.jsonl", "samples.jsonl", "launch.json"):
        (evil / name).symlink_to(outside / name)
    (evil / "stdout.log").symlink_to("/etc/passwd")
    (evil / "train.log").symlink_to("/etc/passwd")
    (evil / "checkpoints" / "latest.ckpt").symlink_to(outside / "checkpoints" / "latest.ckpt")
    (evil / "marker").write_text("a run folder with nothing of its own but symlinks")
    return top


@pytest.fixture(scope="module")
def dash(tree, builtin_cache):
    # cwd: a scratch folder (tree), where a shell would write
    d = Dashboard(tree / "runs", tree / "dashboard.log", cwd=tree, client_token=False).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def token_dash(tree):
    d = Dashboard(tree / "runs", tree / "dashboard-token.log", token="s3cret-token_42", cwd=tree,
                  client_token=False).start()
    yield d
    d.stop()


def leaked(body):
    text = body.decode("utf-8", "replace")
    return SECRET in text or CONFIG_MARK in text or "root:" in text or "def create_app" in text


BAD_IDS = ["..", "%2e%2e", "%2E%2E", "..%2F..", "..%2F..%2Fsecret.txt", "%2e%2e%2f%2e%2e%2fsecret.txt",
           "..%5C..%5Csecret.txt", "%2Fetc%2Fpasswd", "%2F%2Fetc%2Fpasswd", ".", "...", "linkrun",
           "run-a%00", "-run", "/etc/passwd", "%252e%252e"]
RUN_ROUTES = ["", "/metrics", "/metrics.csv", "/logs", "/samples", "/checkpoints", "/system", "/events",
              "/checkpoints/latest.ckpt"]
BAD_NAMES = ["..", "%2e%2e", "..%2Fconfig.json", "%2e%2e%2fconfig.json", "..%2F..%2F..%2Fsecret.txt",
             "..%5Cconfig.json", "%2Fetc%2Fpasswd", "/etc/passwd", "up.ckpt", "out.ckpt", ".",
             "latest.ckpt%2F..%2F..%2Fconfig.json", "%00latest.ckpt"]


def test_traversal_on_every_route_taking_a_run_id(dash, tree):
    abs_secret = quote(str(tree / "secret.txt"), safe="")
    for rid in BAD_IDS + [abs_secret]:
        for route in RUN_ROUTES:
            status, _, body = dash.raw("GET", f"/api/runs/{rid}{route}")
            assert status in (400, 404), (rid, route, status, body[:200])
            assert not leaked(body), (rid, route)
        for method, route in (("POST", "/stop"), ("POST", "/resume"), ("POST", "/generate"), ("PATCH", ""),
                              ("DELETE", "")):
            status, _, body = dash.raw(method, f"/api/runs/{rid}{route}", {"Content-Type": "application/json"},
                                       b"{}")
            assert status in (400, 404), (rid, method, route, status, body[:200])
        status, _, body = dash.raw("GET", f"/runs/{rid}")
        assert status in (400, 404) and not leaked(body), (rid, status)
    assert "linkrun" not in [r["id"] for r in dash.client().get("/api/runs", params={"archived": True}).json()["runs"]]
    assert (tree / "outside-run" / "config.json").read_text() == SECRET          # nothing deleted through the link


def test_symlinks_inside_a_run_folder_are_not_followed_out_of_it(dash, tree):
    """Every file a route reads must resolve inside its run folder: runs/evil's files all point outside."""
    (tree / "runs" / "evil" / "status.json.real").write_text("")      # no effect: not a name the server reads
    for route in RUN_ROUTES + ["/checkpoints/latest.ckpt?x=1"]:
        status, _, body = dash.raw("GET", f"/api/runs/evil{route}")
        assert status in (200, 404), (route, status, body[:200])
        assert not leaked(body), (route, body[:300])
    status, _, body = dash.raw("POST", "/api/runs/evil/generate", {"Content-Type": "application/json"}, b"{}")
    assert status == 409 and not leaked(body), (status, body[:200])
    status, _, body = dash.raw("GET", "/api/runs")
    assert status == 200 and not leaked(body)
    status, _, body = dash.raw("GET", "/runs/evil")
    assert not leaked(body)


def test_traversal_on_checkpoint_names_and_static_files(dash, tree):
    abs_secret = quote(str(tree / "secret.txt"), safe="")
    for name in BAD_NAMES + [abs_secret, quote(str(tree / "runs" / "run-a" / "config.json"), safe="")]:
        status, _, body = dash.raw("GET", f"/api/runs/run-a/checkpoints/{name}")
        assert status in (400, 404), (name, status, body[:200])
        assert not leaked(body), name
    # the symlinks out of checkpoints/ are not listed either; the real file is served
    names = [ck["name"] for ck in dash.client().get("/api/runs/run-a/checkpoints").json()["checkpoints"]]
    assert names == ["latest.ckpt"]
    status, _, body = dash.raw("GET", "/api/runs/run-a/checkpoints/latest.ckpt")
    assert status == 200 and body == bytes(range(256)) * 4
    for path in ("/static/..%2Fapp.py", "/static/%2e%2e/app.py", "/static/../app.py", "/static/..%2F..%2Fweb%2Fapp.py",
                 "/static/" + abs_secret, "/static//etc/passwd"):
        status, _, body = dash.raw("GET", path)
        assert status in (400, 404), (path, status)
        assert not leaked(body), path


def test_host_header_must_be_local(dash):
    """Host is a name, an IPv4 or a bracketed IPv6 address and an optional numeric port, nothing else
    (whatever preceded the last ':' used to pass)."""
    port = dash.port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "attacker:80",
                 f"127.0.0.1:{port}.evil.example", f"127.0.0.1:{port}@evil.example", "localhost:evil.example",
                 f"localhost:{port}:{port}", "127.0.0.1:", f"[::1]:{port}x", "::1", f"127.0.0.1 :{port}"):
        status, headers, body = dash.raw("GET", "/api/health", {"Host": host})
        assert status == 403 and json.loads(body) == {"detail": "host not allowed"}, host
        assert headers["x-frame-options"] == "DENY"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost", "127.0.0.1", "[::1]",
                 f"LocalHost:{port}"):
        assert dash.raw("GET", "/api/health", {"Host": host})[0] == 200, host


def test_cross_site_post_is_refused_same_origin_accepted(dash):
    c = dash.client()
    for origin in ("http://evil.example", f"http://localhost.evil.example:{dash.port}", "null",
                   f"http://127.0.0.1:{dash.port + 1}"):
        r = c.post("/api/runs", json={"model": "tiny"}, headers={"Origin": origin})
        assert r.status_code == 403, origin
        r = c.post("/api/runs/run-a/stop", headers={"Origin": origin})
        assert r.status_code == 403, origin
        r = c.post("/api/sweeps", json={"grid": {"seed": [1, 2]}}, headers={"Origin": origin})
        assert r.status_code == 403, origin
        for method in ("PATCH", "DELETE"):
            r = c.request(method, "/api/runs/run-a", json={"name": "x"} if method == "PATCH" else None,
                          headers={"Origin": origin})
            assert r.status_code == 403, (method, origin)
    assert (dash.runs_dir / "run-a").is_dir() and not (dash.runs_dir / "run-a" / "meta.json").exists()
    r = c.post("/api/runs/run-a/stop", headers={"Origin": dash.base})
    assert r.status_code == 409                                  # accepted: the run is just not running
    r = c.post("/api/runs", json={"model": "nope"}, headers={"Origin": dash.base})
    assert r.status_code == 422
    # GETs from anywhere stay readable (no CORS headers are sent, so a browser hides them anyway)
    r = c.get("/api/health", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_only_small_json_bodies(dash):
    c = dash.client()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = c.post("/api/runs", content=b'{"model": "tiny"}', headers={"Content-Type": ctype})
        assert r.status_code == 415, ctype
    r = c.post("/api/runs", content=b'{"model": "tiny"}', headers={"Content-Type": ""})
    assert r.status_code == 415
    status, _, _ = dash.raw("POST", "/api/runs", {"Content-Length": "17"}, b'{"model": "tiny"}')
    assert status == 415                                         # a body without a content type
    big = json.dumps({"prompt": "x" * (64 * 1024)}).encode()
    r = c.post("/api/runs/run-a/generate", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413

    def chunks():                                                # no Content-Length: counted while read
        for _ in range(70):
            yield b" " * 1024
    r = c.post("/api/runs/run-a/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        assert c.post("/api/sweeps", content=b'{"grid": {}}', headers={"Content-Type": ctype}).status_code == 415
        assert c.patch("/api/runs/run-a", content=b'{"name": "x"}', headers={"Content-Type": ctype}).status_code == 415
    r = c.post("/api/sweeps", content=json.dumps({"grid": {"seed": [1] * 30000}}).encode(),
               headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    r = c.patch("/api/runs/run-a", content=json.dumps({"notes": "x" * (64 * 1024)}).encode(),
                headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and not (dash.runs_dir / "run-a" / "meta.json").exists()
    r = c.post("/api/runs/run-a/generate", json={"prompt": "x" * 900})
    assert r.status_code == 409                                  # within limits: reaches the route (a fake checkpoint)


def test_docs_off_openapi_on(dash):
    c = dash.client()
    assert c.get("/docs").status_code == 404
    assert c.get("/redoc").status_code == 404
    r = c.get("/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    for p in ("/api/health", "/api/presets", "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/stop",
              "/api/runs/{run_id}/resume", "/api/runs/{run_id}/metrics", "/api/runs/{run_id}/metrics.csv",
              "/api/runs/{run_id}/events",
              "/api/runs/{run_id}/logs", "/api/runs/{run_id}/samples", "/api/runs/{run_id}/generate",
              "/api/runs/{run_id}/checkpoints", "/api/runs/{run_id}/checkpoints/{name}",
              "/api/runs/{run_id}/system"):
        assert p in paths, p
    assert {"get", "patch", "delete"} <= set(paths["/api/runs/{run_id}"])
    assert {"201", "400", "403", "413", "415", "422"} <= set(paths["/api/sweeps"]["post"]["responses"])
    for method, codes in (("patch", {"200", "400", "403", "404", "413", "415", "422"}),
                          ("delete", {"204", "400", "403", "404", "409", "413", "415"})):
        assert codes <= set(paths["/api/runs/{run_id}"][method]["responses"]), method
    assert "post" in paths["/api/runs"] and "get" in paths["/api/runs"]


def test_security_headers(dash):
    c = dash.client()
    for r in (c.get("/api/health"), c.get("/api/runs/nope"), c.get("/"), c.get("/static/style.css"),
              c.post("/api/runs", content=b"x", headers={"Content-Type": "text/plain"})):
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
        assert r.headers["referrer-policy"] == "no-referrer"


def test_token(token_dash):
    d, token = token_dash, token_dash.token
    assert f"/?token={token}" in Path(d.log_path).read_text()     # the printed URL carries it
    c = d.client()
    for path in ("/api/health", "/api/runs", "/", "/api/runs/run-a", "/openapi.json"):
        r = c.get(path)
        assert r.status_code == 401, path
    assert c.post("/api/runs", json={"model": "tiny"}).status_code == 401
    assert c.patch("/api/runs/run-a", json={"name": "x"}).status_code == 401
    assert c.delete("/api/runs/run-a").status_code == 401
    assert c.post("/api/sweeps", json={"grid": {"seed": [1, 2]}}).status_code == 401
    assert (d.runs_dir / "run-a").is_dir()
    assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": f"Bearer {token}x"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": f"Basic {token}"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert c.get("/", params={"token": "wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Host": "evil.example", "Authorization": f"Bearer {token}"}).status_code == 403

    # the browser flow: /?token= sets an HttpOnly SameSite=Strict cookie, which then works alone
    r = c.get("/", params={"token": token})
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and token in cookie
    assert c.cookies                                             # httpx kept it
    assert c.get("/api/runs").status_code == 200
    assert c.get("/api/runs/run-a/metrics").status_code == 200
    fresh = d.client(cookies={cookie.split("=", 1)[0]: "wrong"})
    assert fresh.get("/api/runs").status_code == 401


def proc_argv(pid):
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_trainer_is_launched_from_an_argv_list(dash, tree, builtin_cache):
    c = dash.client()
    r = c.post("/api/runs", json={"model": "tiny; rm -rf /", "steps": 10})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "model"
    # a value that is valid but full of shell syntax reaches the trainer as one argv item, untouched
    marker = tree / "pwned"                                      # the dashboard's cwd is `tree`
    weird = tree / "data" / "tok; touch pwned; $(touch pwned) `touch pwned` && touch pwned.bin"   # --data-dir's default
    _, tokens = builtin_dataset()
    np.asarray(tokens[:20000], "<u2").tofile(weird)
    r = c.post("/api/runs", json={"model": "tiny", "steps": 5000, "data": str(weird), "sample_every": 0,
                                  "backend": "sim"})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    try:
        pid = c.get(f"/api/runs/{run_id}").json()["status"]["pid"]
        argv = proc_argv(pid)
        assert argv[0] == sys.executable.encode() and argv[1:3] == [b"-m", b"anectypes.train"]
        assert f"--data={weird}".encode() in argv
        assert b"--run-dir" in argv and b"sh" not in [Path(a.decode()).name.encode() for a in argv]
        assert os.getpgid(pid) == pid                                # its own session / process group
        time.sleep(0.5)
        assert not marker.exists()
    finally:
        c.post(f"/api/runs/{run_id}/stop")
        deadline = time.monotonic() + 30
        while c.get(f"/api/runs/{run_id}").json()["status"].get("alive") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not marker.exists()


def test_stop_and_system_reach_only_a_verified_trainer(dash, tree):
    """A status.json (or launch.json) naming an unrelated live process, with its real start time, is not
    proof that it is the run's trainer: stop answers 409 and the process lives on, /system says no trainer
    is alive. A process whose command line runs anectypes.train for this run's folder is stopped."""
    sleeper = subprocess.Popen(["sleep", "300"])
    fake, status = fake_trainer(tree / "runs" / "verified-run")
    try:
        victim = {"pid": sleeper.pid, "proc_start": process_start(sleeper.pid)}
        for name, file, doc in (("planted-status", "status.json", {"state": "running", "step": 1, **victim}),
                                ("planted-launch", "launch.json", {"created": 1.0, "queued": False, **victim}),
                                ("verified-run", "status.json", {**status, "step": 1})):
            (tree / "runs" / name).mkdir()
            (tree / "runs" / name / file).write_text(json.dumps(doc))
        c = dash.client()
        for name in ("planted-status", "planted-launch"):
            r = c.post(f"/api/runs/{name}/stop")
            assert r.status_code == 409 and r.json() == {"detail": "the run is not running"}, (name, r.text)
            assert c.get(f"/api/runs/{name}/system").json() == {"pid": sleeper.pid if name == "planted-status" else None,
                                                                "alive": False, "cpu_percent": None, "rss_mb": None}
            assert c.get(f"/api/runs/{name}").json()["status"]["alive"] is False
        assert sleeper.poll() is None and process_start(sleeper.pid) == victim["proc_start"]
        assert c.get("/api/runs/verified-run/system").json()["alive"] is True
        assert c.post("/api/runs/verified-run/stop").status_code == 202
        assert fake.wait(timeout=30) == -signal.SIGTERM
        assert sleeper.poll() is None
    finally:
        for p in (sleeper, fake):
            p.kill()
            p.wait()


def snapshot(folder):
    """Every path under folder with its bytes (None for a folder), to tell that nothing changed."""
    return {str(p.relative_to(folder)): None if p.is_dir() or not p.exists() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


def wait_state(client, run_id, states, timeout=60):
    deadline = time.monotonic() + timeout
    while (d := client.get(f"/api/runs/{run_id}").json())["state"] not in states:
        assert time.monotonic() < deadline, d
        time.sleep(0.1)
    return d


def test_a_planted_launch_json_never_runs_its_argv(tmp_path, builtin_cache):
    """The issue's planted file, {"queued": true, "argv": [...]} in a run folder, is never executed when the
    dashboard starts: a queued run is started from its spec only, checked as a new run's (data outside the
    data folder, a model file: failed, never started; a valid spec trains, its argv ignored). Leftover trash
    of a delete is removed at start."""
    runs, marker = tmp_path / "runs", tmp_path / "pwned"
    np.asarray(builtin_dataset()[1][:20000], "<u2").tofile(tmp_path / "tokens.bin")    # a valid file, outside
    argv = ["-c", f"open({str(marker)!r}, 'w').write('ran')"]
    valid = RunSpec(model="tiny", steps=2, accum=1, save_every=1, sample_every=0, backend="sim", precision="fp32")
    plants = {"planted-argv": {"queued": True, "created": 1.0, "argv": argv},
              "planted-data": {"queued": True, "created": 2.0, "argv": argv,
                               "spec": replace(valid, data=str(tmp_path / "tokens.bin")).to_dict()},
              "planted-model": {"queued": True, "created": 3.0, "spec": {"model": str(tmp_path / "m.json")}},
              "planted-valid": {"queued": True, "created": 4.0, "argv": argv, "spec": valid.to_dict()}}
    for name, launch in plants.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "launch.json").write_text(json.dumps(launch))
    (runs / ".trash-old-run-0a1b" / "checkpoints").mkdir(parents=True)
    d = Dashboard(runs, tmp_path / "dashboard.log", cwd=tmp_path).start()
    try:
        c = d.client()
        ends = {name: wait_state(c, name, ("failed", "finished", "stopped"), 120) for name in plants}
    finally:
        d.stop()
    assert not marker.exists()
    errors = {name: end["status"].get("error") for name, end in ends.items()}
    assert "launch.json: spec: expected a JSON object" in errors["planted-argv"], errors
    assert "data: not a file or folder in the data folder" in errors["planted-data"], errors
    assert "model: must be one of" in errors["planted-model"], errors
    for name in ("planted-argv", "planted-data", "planted-model"):
        assert ends[name]["state"] == "failed" and errors[name].startswith("not started: "), ends[name]
        assert sorted(p.name for p in (runs / name).iterdir()) == ["launch.json", "status.json"], name
    assert ends["planted-valid"]["state"] == "finished", ends["planted-valid"]
    assert ends["planted-valid"]["config"]["spec"] == valid.resolved().to_dict()
    assert not (runs / ".trash-old-run-0a1b").exists()
    assert "Traceback" not in (tmp_path / "dashboard.log").read_text()


@pytest.mark.parametrize("flags, words", [
    (["--port", "99999"], "--port: must be 1-65535"), (["--port", "0"], "--port: must be 1-65535"),
    (["--port", "http"], "--port: must be an integer"), (["--max-running", "-1"], "--max-running: must be >= 0"),
    (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1"),                 # not an address of this machine
    (["--port", "IN-USE"], "Address already in use"),
    (["--data-dir", "secret.txt"], "--data-dir secret.txt: not a folder"),
    (["--runs-dir", "secret.txt/runs"], "--runs-dir secret.txt/runs"), (["--token", "a b"], "the token may only use"),
])
def test_bad_flags_are_one_error_line_before_the_url(tree, flags, words):
    """Every flag is checked before the dashboard says where it listens: one `error:` line, exit non-zero,
    no traceback, no URL, nothing written."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flags = [str(taken.getsockname()[1]) if f == "IN-USE" else f for f in flags]
        before = snapshot(tree)
        r = subprocess.run([sys.executable, "-m", "anectypes.dashboard", "--runs-dir", "fresh-runs", *flags], cwd=tree,
                           capture_output=True, text=True, timeout=60)
    err = r.stderr.splitlines()
    assert r.returncode != 0 and r.stdout == "" and len(err) == 1 and err[0].startswith("error: "), r
    assert words in err[0], err
    assert snapshot(tree) == before


CPUS = len(os.sched_getaffinity(0))
BAD_REQUESTS = [   # (method, path, raw JSON body, the field the 422 names)
    # not a JSON number or not a string, which FastAPI's error echoed back unserializable (a 500)
    *[(m, path, body, field) for m, path in (("POST", "/api/runs/run-a/generate"),
                                             ("POST", "/api/runs/run-a/generate/stream"))
      for body, field in ((b'{"temperature": NaN}', "temperature"), (b'{"top_p": Infinity}', "top_p"),
                          (b'{"temperature": 1e999}', "temperature"), (b'{"prompt": "\\ud800"}', "prompt"))],
    ("POST", "/api/runs", b'{"lr": NaN}', "lr"), ("POST", "/api/runs", b'{"clip": -Infinity}', "clip"),
    ("POST", "/api/runs", b'{"lr": 1e999}', "lr"), ("POST", "/api/runs", b'{"model": "\\ud800"}', "model"),
    ("PATCH", "/api/runs/run-a", b'{"archived": NaN}', "archived"), ("PATCH", "/api/runs/run-a", b'{"name": 1e999}', "name"),
    ("PATCH", "/api/runs/run-a", b'{"name": "\\udc00"}', "name"), ("PATCH", "/api/runs/run-a", b'{"tags": ["\\ud800"]}', "tags"),
    # a blank is not a value (the schema says integer or null)
    *[("POST", "/api/runs", json.dumps({field: ""}).encode(), field) for field in ("seed", "steps", "lr", "accum", "model")],
    # ranks beyond this machine's CPUs; data and tokenizer outside the data folder
    ("POST", "/api/runs", json.dumps({"ranks": CPUS + 1}).encode(), "ranks"),
    ("POST", "/api/runs", b'{"ranks": 4096}', "ranks"),
    ("POST", "/api/sweeps", b'{"ranks": 4096, "grid": {"seed": [1, 2]}}', "ranks"),
    ("POST", "/api/runs", b'{"data": "/etc/passwd"}', "data"),
    ("POST", "/api/runs", b'{"tokenizer": "/etc/passwd"}', "tokenizer"),
    ("POST", "/api/sweeps", b'{"data": "/etc/passwd", "grid": {"seed": [1, 2]}}', "data"),
    ("POST", "/api/runs", b'{"data": "../secret.txt"}', "data"),
    ("POST", "/api/runs", b'{"data": "link.bin"}', "data"),            # a symlink in the data folder, out of it
    ("POST", "/api/runs", b'{"data": "."}', "data"),                   # the folder itself
]


def test_bad_requests_get_a_422_naming_the_field_and_change_nothing(dash, tree):
    (tree / "data" / "link.bin").symlink_to(tree / "secret.txt")
    before = snapshot(tree)
    for method, path, body, field in BAD_REQUESTS:
        status, headers, text = dash.raw(method, path, {"Content-Type": "application/json"}, body)
        assert status == 422 and headers["content-type"] == "application/json", (method, path, body, status, text)
        detail = json.loads(text)["detail"]
        assert any(field in err["loc"] for err in detail), (body, detail)
        if field == "ranks":
            assert str(CPUS) in str(detail), detail
    assert snapshot(tree) == before
    assert dash.client().get("/api/presets").json()["data_dir"] == str(tree / "data")
    assert "Traceback" not in Path(dash.log_path).read_text()


def test_strings_from_run_files_are_served_as_utf8_json(dash, tree):
    """A lone surrogate in a run's status.json, meta.json or samples.jsonl (json.loads reads a "\\ud800"
    escape as one) is answered as "?" in strict UTF-8 JSON, not a 500 (the run list was)."""
    d = tree / "runs" / "odd-strings"
    d.mkdir()
    (d / "status.json").write_text('{"state": "failed", "error": "bad \\ud800", "step": 1}')
    (d / "meta.json").write_text('{"name": "\\udc00"}')
    (d / "samples.jsonl").write_text('{"step": 1, "text": "a\\ud800b"}\n')
    c = dash.client()
    row = {r["id"]: r for r in c.get("/api/runs").json()["runs"]}["odd-strings"]
    assert row["error"] == "bad ?" and row["meta"]["name"] == "?"
    assert c.get("/api/runs/odd-strings").json()["status"]["error"] == "bad ?"
    assert c.get("/api/runs/odd-strings/samples").json() == {"samples": [{"step": 1, "text": "a?b"}]}


def finished_run(runs, name, files=200):
    """A finished run folder with many checkpoint files (a delete of it takes a while)."""
    d = runs / name
    (d / "checkpoints").mkdir(parents=True)
    (d / "status.json").write_text(json.dumps({"state": "finished", "step": 1, "steps": 1}))
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    for i in range(files):
        (d / "checkpoints" / f"old-{i}.ckpt").write_bytes(b"x" * 1000)
    return d


def test_concurrent_deletes_and_patches_of_one_run(dash, tree):
    """20 DELETEs of one run at once: one 204, 19 404s, never a 500. A PATCH racing a DELETE (10 rounds):
    the DELETE's 204 and the PATCH's 200 (before it) or 404 (after), and no folder is left behind (the
    issue's folder with only meta.json, which the API could neither list nor delete)."""
    runs = tree / "runs"

    def at_once(*requests):
        barrier = threading.Barrier(len(requests))

        def send(request):
            method, path, *body = request
            with dash.client() as c:
                barrier.wait()
                r = c.request(method, path, json=body[0] if body else None)
                assert r.status_code == 204 or r.headers["content-type"] == "application/json", r.text
                return r.status_code
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(send, requests))

    finished_run(runs, "doomed")
    assert sorted(at_once(*[("DELETE", "/api/runs/doomed")] * 20)) == [204] + [404] * 19
    assert not (runs / "doomed").exists()
    for i in range(10):
        finished_run(runs, f"raced-{i}")
        deleted, patched = at_once(("DELETE", f"/api/runs/raced-{i}"),
                                   ("PATCH", f"/api/runs/raced-{i}", {"name": "x"}))
        assert deleted == 204 and patched in (200, 404), (i, deleted, patched)
        assert not (runs / f"raced-{i}").exists(), i
    assert not [p.name for p in runs.iterdir() if p.name.startswith(".")]          # no trash left either


def test_a_delete_never_removes_a_folder_a_trainer_holds(dash, tree):
    """A `--resume` from the command line holds its run folder before it writes a status of its own (its
    status.json still says stopped): the DELETE of that moment is refused, so the trainer neither loses
    its folder nor brings it back; once the trainer has ended, the DELETE goes through."""
    run = tree / "runs" / "held"
    common = ["--model", "tiny", "--backend", "sim", "--steps", "8", "--accum", "2", "--sample-every", "0"]
    train = [sys.executable, "-m", "anectypes.train", "--run-dir", str(run), *common]
    assert subprocess.run([*train, "--scratch", "--stop-after", "4"], capture_output=True).returncode == 0
    p = subprocess.Popen([sys.executable, str(Path(__file__).parent / "support" / "pause_at_take_over.py"), "--resume",
                          "--run-dir", str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        while (line := p.stdout.readline()) != "paused\n":
            assert line, "the trainer ended before its take-over"
        assert json.loads((run / "status.json").read_text())["state"] == "stopped"
        with dash.client() as c:
            r = c.delete("/api/runs/held")
            assert r.status_code == 409 and "being trained" in r.json()["detail"], r.text
        p.stdin.write("go\n")
        p.stdin.close()
        assert p.wait(300) == 0
    finally:
        p.kill()
        p.wait()
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    with dash.client() as c:
        assert c.delete("/api/runs/held").status_code == 204
    assert not run.exists()


def test_resume_reads_no_data_outside_the_data_folder(dash, tree):
    """A stopped run from elsewhere whose spec reads a file outside the data folder is not resumed by the
    dashboard (the command line may); nothing is started and nothing in the folder changes."""
    run = tree / "runs" / "foreign"
    (run / "checkpoints").mkdir(parents=True)
    spec = dict(RunSpec().to_dict(), data=str(tree / "secret.txt"))
    (run / "config.json").write_text(json.dumps({"format": "anectypes-run", "version": 1, "spec": spec}))
    (run / "status.json").write_text(json.dumps({"state": "stopped", "step": 4, "steps": 8}))
    before = sorted((p.name, p.read_bytes()) for p in run.iterdir() if p.is_file())
    with dash.client() as c:
        r = c.post("/api/runs/foreign/resume")
    assert r.status_code == 409 and "data folder" in r.json()["detail"] and "--resume" in r.json()["detail"], r.text
    assert sorted((p.name, p.read_bytes()) for p in run.iterdir() if p.is_file()) == before
