"""The dashboard's REST API and SSE stream, against a real uvicorn subprocess and real training runs.

One tiny run goes through its whole life: start, live metrics over SSE and JSON, stop (checkpoint),
resume (steps continue), checkpoint download (full and ranged), Last-Event-ID replay, generation,
and a dashboard restart that still lists it. Then crashes, malformed files and bad requests.
"""

import collections
import csv
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support.dashboard_server import ROOT, Dashboard, fake_trainer
from support.hf_folders import lora_llama_folder

from anectypes.formats.checkpoint import load_checkpoint
from anectypes.model.config import PRESETS
from anectypes.runs import METRIC_KEYS, RunSpec

pytestmark = pytest.mark.slow

TINY = dict(model="tiny", steps=4000, accum=2, sample_every=0, save_every=5, log_every=5, backend="sim",
            precision="fp32")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def dash(builtin_cache, runs_dir, tmp_path_factory):
    d = Dashboard(runs_dir, tmp_path_factory.mktemp("log") / "dashboard.log").start()
    yield d
    d.stop()


def wait_for(fn, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def sse_events(client, path, until, headers=None, timeout=60, method="GET", body=None):
    """Parsed SSE events ({event, id, data}) from path until until(events) is true or the stream ends."""
    events, cur = [], {}
    deadline = time.monotonic() + timeout
    with client.stream(method, path, headers=headers or {}, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            assert time.monotonic() < deadline, f"SSE timed out; got {[e['event'] for e in events]}"
            if line.startswith(":"):
                continue
            if not line:
                if "event" in cur or "data" in cur:
                    cur["data"] = json.loads(cur["data"]) if "data" in cur else None
                    events.append(cur)
                    if until(events):
                        break
                cur = {}
                continue
            field, _, value = line.partition(":")
            cur[field] = value[1:] if value.startswith(" ") else value
    return events


def state_of(client, run_id):
    return client.get(f"/api/runs/{run_id}").json()


def wait_terminal(client, run_id, timeout=60):
    return wait_for(lambda: (d := state_of(client, run_id))["state"] in ("finished", "stopped", "failed") and d,
                    timeout, "the run to end")


def test_run_lifecycle(dash, runs_dir):
    c = dash.client()
    r = c.post("/api/runs", json=TINY)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    assert re.fullmatch(r"\d{8}-\d{6}-tiny-[0-9a-f]{4}", run_id)
    run_dir = runs_dir / run_id

    # one run at a time: a second one is queued, and can be cancelled
    r = c.post("/api/runs", json=TINY)
    assert r.status_code == 201, r.text
    queued = r.json()["id"]
    assert state_of(c, queued)["status"] == {"state": "queued", "position": 1, "pid": None, "alive": False}
    assert c.post(f"/api/runs/{queued}/stop").status_code == 202
    d = state_of(c, queued)
    assert d["state"] == "cancelled" and d["status"]["error"] is None
    assert not (runs_dir / queued / "config.json").exists()                      # it never started

    # live metrics over SSE: batches of rows, id = the batch's last step
    events = sse_events(c, f"/api/runs/{run_id}/events",
                        lambda evs: sum(e["event"] == "metrics" for e in evs) >= 3)
    batches = [e for e in events if e["event"] == "metrics"]
    rows = [row for b in batches for row in b["data"]["rows"]]
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and len(set(steps)) >= 3
    for a, b in zip(rows, rows[1:]):               # a step comes again only with its validation loss added
        assert a["step"] < b["step"] or (a["val_loss"] is None and b["val_loss"] is not None
                                         and b["loss"] == a["loss"]), (a, b)
    for b in batches:
        assert b["id"] == str(b["data"]["rows"][-1]["step"])
        assert {"loss", "lr", "grad_norm", "ms_step", "tokens_per_s", "t_eval"} <= set(b["data"]["rows"][0])
    assert any(e["event"] == "status" and e["data"]["state"] == "running" for e in events)

    # ... and through the JSON endpoint, columnar
    m = c.get(f"/api/runs/{run_id}/metrics").json()
    assert len(m["step"]) >= 3 and len(m["loss"]) == len(m["step"]) == len(m["t_dw_wait"])
    assert m["step"] == sorted(m["step"]) and all(isinstance(x, float) for x in m["loss"])
    small = c.get(f"/api/runs/{run_id}/metrics", params={"max_points": 2}).json()
    assert len(small["step"]) <= 2
    since = c.get(f"/api/runs/{run_id}/metrics", params={"since_step": m["step"][-2]}).json()
    assert since["step"] and since["step"][0] == m["step"][-1]

    # live progress: once the first checkpoint is written, the list, the detail and a new stream's first
    # status show the real step and the validation loss; the validation curve is in the metrics
    latest = run_dir / "checkpoints" / "latest.ckpt"
    wait_for(latest.is_file, 90, "the first checkpoint")
    wait_for(lambda: state_of(c, run_id)["status"]["step"] >= 15, 90, "a status update after the checkpoint")
    row = {row["id"]: row for row in c.get("/api/runs").json()["runs"]}[run_id]
    assert row["state"] == "running" and row["step"] >= 15 and row["steps"] == 4000
    assert row["best_val_loss"] is not None and row["last_loss"] is not None
    first = sse_events(c, f"/api/runs/{run_id}/events", lambda evs: evs[-1]["event"] == "status")[-1]["data"]
    assert first["step"] >= row["step"] and first["loss"] is not None
    assert first["best_val_loss"] <= row["best_val_loss"]            # (a checkpoint may have come between)
    m = c.get(f"/api/runs/{run_id}/metrics", params={"max_points": 100000}).json()
    assert [s for s, v in zip(m["step"], m["val_loss"]) if v is not None][0] == 10       # save_every 5 × accum 2

    # stop: SIGTERM → checkpoint → stopped
    r = c.post(f"/api/runs/{run_id}/stop")
    assert r.status_code == 202 and r.json() == {"state": "stopping"}
    d = wait_terminal(c, run_id)
    assert d["state"] == "stopped", d
    assert latest.is_file()
    stopped_at = d["status"]["step"]
    assert c.post(f"/api/runs/{run_id}/stop").status_code == 409

    # resume: a new process continues from the checkpoint; steps continue without a gap or repeat
    r = c.post(f"/api/runs/{run_id}/resume")
    assert r.status_code == 202 and r.json() == {"id": run_id}
    assert c.post(f"/api/runs/{run_id}/resume").status_code == 409        # running already
    wait_for(lambda: (s := c.get(f"/api/runs/{run_id}/metrics").json()["step"]) and s[-1] >= stopped_at + 6,
             90, "steps after the resume")
    r = c.post(f"/api/runs/{run_id}/stop")
    assert r.status_code == 202
    d = wait_terminal(c, run_id)
    assert d["state"] == "stopped" and d["status"]["step"] > stopped_at
    steps = c.get(f"/api/runs/{run_id}/metrics", params={"max_points": 100000}).json()["step"]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= stopped_at + 6
    assert "run dir" in "\n".join(c.get(f"/api/runs/{run_id}/logs", params={"tail": 50}).json()["lines"])

    # checkpoints: listing with sha256, download byte-identical, Range → 206
    cks = {ck["name"]: ck for ck in c.get(f"/api/runs/{run_id}/checkpoints").json()["checkpoints"]}
    assert "latest.ckpt" in cks
    data = latest.read_bytes()
    assert cks["latest.ckpt"]["bytes"] == len(data)
    assert cks["latest.ckpt"]["sha256"] == hashlib.sha256(data).hexdigest()
    r = c.get(f"/api/runs/{run_id}/checkpoints/latest.ckpt")
    assert r.status_code == 200 and r.content == data
    # saved under the run's name and the step it holds, which the listing gives with the best validation loss
    assert cks["latest.ckpt"]["step"] == load_checkpoint(latest).state["step"] == d["status"]["step"]
    assert r.headers["content-disposition"] == f'attachment; filename="{run_id}-latest-step{d["status"]["step"]}.ckpt"'
    best = load_checkpoint(latest.with_name("best.ckpt")).state
    assert (cks["best.ckpt"]["step"], cks["best.ckpt"]["best_val_loss"]) == (best["step"], best["best_val_loss"])
    assert cks["best.ckpt"]["best_val_loss"] == d["status"]["best_val_loss"]
    r = c.get(f"/api/runs/{run_id}/checkpoints/latest.ckpt", headers={"Range": "bytes=0-99"})
    assert r.status_code == 206 and r.content == data[:100]
    assert r.headers["content-range"] == f"bytes 0-99/{len(data)}"

    # Last-Event-ID replays only later steps, then the stream ends with `done`
    k = steps[-1] - 5
    events = sse_events(c, f"/api/runs/{run_id}/events", lambda evs: evs[-1]["event"] == "done",
                        headers={"Last-Event-ID": str(k)})
    replay = [row["step"] for e in events if e["event"] == "metrics" for row in e["data"]["rows"]]
    assert replay == list(range(k + 1, steps[-1] + 1))
    assert events[-1]["event"] == "done" and events[-1]["data"]["state"] == "stopped"
    events = sse_events(c, f"/api/runs/{run_id}/events", lambda evs: evs[-1]["event"] == "done")
    assert not [e for e in events if e["event"] == "metrics"]           # no Last-Event-ID: only what is new

    # generation from the latest checkpoint
    r = c.post(f"/api/runs/{run_id}/generate", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"].startswith("Once upon a time") and len(out["text"]) > len("Once upon a time")
    assert out["step"] == d["status"]["step"]
    r2 = c.post(f"/api/runs/{run_id}/generate", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                      "temperature": 0})
    assert r2.json() == out                                            # greedy is deterministic
    r = c.post(f"/api/runs/{run_id}/generate", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                     "temperature": 0, "checkpoint": "best"})
    assert r.status_code == 200 and r.json()["step"] == best["step"], r.text

    # the dashboard restarts: the run is listed with its state
    summary = {row["id"]: row for row in c.get("/api/runs").json()["runs"]}[run_id]
    dash.stop()
    dash.start()
    c = dash.client()
    rows = {row["id"]: row for row in c.get("/api/runs").json()["runs"]}
    assert rows[run_id]["state"] == d["state"] and rows[run_id]["step"] == d["status"]["step"]
    assert rows[run_id]["model_name"] == "tiny" and rows[run_id]["last_loss"] == summary["last_loss"]
    assert rows[run_id]["best_val_loss"] is not None and rows[run_id]["pid"] is None
    detail = c.get(f"/api/runs/{run_id}").json()
    assert detail["config"]["model_name"] == "tiny" and detail["summary"]["steps_done"] == d["status"]["step"]
    assert detail["config"]["spec"]["save_every"] == 5 and detail["config"]["spec"]["steps"] == 4000

    # generation from another run, then from this one again (each model is closed when replaced)
    r = c.post("/api/runs", json=dict(TINY, steps=6))
    assert r.status_code == 201, r.text
    other = r.json()["id"]
    assert wait_terminal(c, other)["state"] == "finished"
    for rid in (other, run_id, other):
        r = c.post(f"/api/runs/{rid}/generate", json={"prompt": "Once", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    assert r.json()["step"] == 6


def test_a_killed_run_is_listed_as_failed_with_its_last_log_lines(dash, runs_dir):
    c = dash.client()
    r = c.post("/api/runs", json=TINY)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    log = runs_dir / run_id / "stdout.log"
    wait_for(lambda: log.is_file() and "run dir" in log.read_text(), 60, "the trainer's first line")
    pid = state_of(c, run_id)["status"]["pid"]
    system = c.get(f"/api/runs/{run_id}/system").json()
    assert system["pid"] == pid and system["alive"] and system["rss_mb"] > 1 and system["cpu_percent"] >= 0
    os.killpg(pid, signal.SIGKILL)
    d = wait_for(lambda: (d := state_of(c, run_id))["state"] == "failed" and d, 30, "failed")
    last = log.read_text().splitlines()[-1]
    assert last in d["status"]["error"] and "SIGKILL" in d["status"]["error"]
    row = {row["id"]: row for row in c.get("/api/runs").json()["runs"]}[run_id]
    assert row["state"] == "failed" and last in row["error"]
    assert c.get(f"/api/runs/{run_id}/system").json()["alive"] is False


def write_run(runs_dir, run_id, status, metrics=None, log_lines=()):
    d = runs_dir / run_id
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "format": "anectypes-run", "version": 1, "run_id": run_id, "model_name": "tiny",
        "spec": dict(RunSpec(model="tiny", steps=10, backend="sim").resolved().to_dict()),
        "model": PRESETS["tiny"].to_dict() | {"vocab": 1024}}))
    (d / "status.json").write_text(json.dumps(status))
    if metrics is not None:
        (d / "metrics.jsonl").write_text(metrics)
    (d / "stdout.log").write_text("".join(f"{line}\n" for line in log_lines))
    return d


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_run_whose_process_is_gone_is_failed(dash, runs_dir):
    write_run(runs_dir, "crashed-run", {"state": "running", "step": 3, "steps": 10, "pid": dead_pid(),
                                        "updated": time.time()}, log_lines=[f"line {i}" for i in range(30)])
    # a live pid that is not a trainer (this test process) counts as gone too
    write_run(runs_dir, "reused-pid", {"state": "restarting", "step": 3, "steps": 10, "pid": os.getpid()},
              log_lines=["Traceback: boom"])
    c = dash.client()
    rows = {row["id"]: row for row in c.get("/api/runs").json()["runs"]}
    assert rows["crashed-run"]["state"] == "failed"
    assert "line 29" in rows["crashed-run"]["error"] and "line 5\n" not in rows["crashed-run"]["error"]
    assert rows["reused-pid"]["state"] == "failed" and "Traceback: boom" in rows["reused-pid"]["error"]
    d = state_of(c, "crashed-run")
    assert d["state"] == "failed" and d["status"]["state"] == "failed" and "line 29" in d["status"]["error"]
    (runs_dir / "never-started").mkdir()                                     # launched, no config.json yet
    (runs_dir / "never-started" / "status.json").write_text(json.dumps({"state": "failed"}))
    assert c.post("/api/runs/never-started/resume").status_code == 409
    assert c.post("/api/runs/crashed-run/generate", json={}).status_code == 409
    assert c.post("/api/runs/crashed-run/stop").status_code == 409


def test_malformed_metric_lines_are_skipped(dash, runs_dir):
    lines = ['{"step": 0, "loss": 6.0, "lr": 0.001, "grad_norm": null}',
             '{not json',
             '[1, 2, 3]',
             '{"step": "one", "loss": 1.0}',
             '{"step": 1, "loss": 5.5, "grad_norm": 0.5}',
             '{"step": 2, "loss": NaN, "lr": Infinity}',
             '']
    write_run(runs_dir, "messy-run", {"state": "finished", "step": 3, "steps": 3, "pid": None},
              metrics="\n".join(lines) + '{"step": 3, "lo')                  # a partial last line
    c = dash.client()
    r = c.get("/api/runs/messy-run/metrics")
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["step"] == [0, 1, 2] and m["loss"] == [6.0, 5.5, None] and m["lr"] == [0.001, None, None]
    assert m["grad_norm"] == [None, 0.5, None] and m["t_io"] == [None, None, None]
    r = c.get("/api/runs/messy-run/metrics.csv")                          # every row, as CSV
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert r.headers["content-disposition"] == 'attachment; filename="messy-run-metrics.csv"'
    table = list(csv.DictReader(io.StringIO(r.text)))
    assert list(table[0]) == ["step", *METRIC_KEYS]
    assert [(t["step"], t["loss"], t["grad_norm"]) for t in table] == [("0", "6.0", ""), ("1", "5.5", "0.5"), ("2", "", "")]
    assert c.get("/api/runs/no-such-run/metrics.csv").status_code == 404
    assert c.get("/api/runs/messy-run").status_code == 200
    row = {row["id"]: row for row in c.get("/api/runs").json()["runs"]}["messy-run"]
    assert row["state"] == "finished" and row["last_loss"] == 5.5                  # before step 2's NaN
    events = sse_events(c, "/api/runs/messy-run/events", lambda evs: evs[-1]["event"] == "done",
                        headers={"Last-Event-ID": "-1"})
    assert [row["step"] for e in events if e["event"] == "metrics" for row in e["data"]["rows"]] == [0, 1, 2]
    (runs_dir / "messy-run" / "samples.jsonl").write_text('{"step": 5, "text": "hi"}\nnot json\n{"step": 6}\n')
    assert c.get("/api/runs/messy-run/samples").json() == {"samples": [{"step": 5, "text": "hi"}]}


def reference_metric(line):
    """A metrics.jsonl row as the dashboard must read it, by Python's json module: an object with an integer
    step; the rank an integer, every other metric a finite number as a float, anything else None."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or type(rec.get("step")) is not int:
        return None
    def value(key):
        v = rec.get(key)
        if key == "rank":
            return v if type(v) is int else None
        return float(v) if type(v) in (int, float) and math.isfinite(v) else None
    return (rec["step"], *map(value, METRIC_KEYS))


def test_metric_rows_are_read_as_the_json_module_reads_them():
    """The dashboard's row reader (msgspec for a well-formed row, pydantic-core field by field for any
    other) against json.loads and the rule, on 3,000 generated lines: numbers written as integers or
    floats, NaN, infinities and out-of-range numbers, wrong types, unknown keys, bad steps, torn lines."""
    from anectypes.web.metrics import parse_metric
    rng = random.Random(7)
    values = ["1", "-2", "3.5", "1e-300", "1e308", "-0.0", "123456789012345678901234567890", "NaN", "Infinity",
              "-Infinity", "1e999", "true", "null", '"x"', "[1]", "{}"]
    steps = ["0", "7", "-1", "9223372036854775808", "1.0", "true", '"3"', "null"]
    keys = [*METRIC_KEYS, "other"]
    kinds = collections.Counter()
    for _ in range(3000):
        fields = [f'"{k}": {rng.choice(values)}' for k in rng.sample(keys, rng.randint(0, 6))]
        if rng.random() < 0.9:
            fields.insert(rng.randint(0, len(fields)), f'"step": {rng.choice(steps)}')
        line = "{" + ", ".join(fields) + "}"
        if rng.random() < 0.05:
            line = line[:rng.randint(0, len(line) - 1)]
        want = reference_metric(line)
        got = parse_metric(line.encode())
        assert [(type(v), v) for v in got or ()] == [(type(v), v) for v in want or ()] and (got is None) == (
            want is None), (line, got, want)
        kinds["row" if want else "not a row"] += 1
    assert min(kinds.values()) > 500, kinds


def test_the_run_list_reads_a_long_runs_tail_unless_it_needs_the_whole_file(tmp_path, monkeypatch):
    """The run list and a run's detail take the last loss, the step and the recent means from the last
    lines of metrics.jsonl, and the best validation loss from status.json: a listing of many long runs
    reads no whole file. Without status.json's best, the lowest validation loss in the whole file counts
    (here one 5,000 rows before the end). Checked against the rows as json reads them."""
    from anectypes.web.store import RunStore
    rows = [{"step": s, "loss": 10 - s / 1000, "tokens_per_s": 100.0 + s} for s in range(1, 5001)]
    rows.insert(10, {"step": 10, "val_loss": 0.5})
    rows += [{"step": 5000, "val_loss": 2.0}, '{"step": 5001, "lo']                     # a torn last line
    metrics = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)[:-1]
    status = {"state": "finished", "steps": 5000, "pid": None}
    write_run(tmp_path, "no-best", status, metrics=metrics)
    write_run(tmp_path, "best", status | {"best_val_loss": 0.75}, metrics=metrics)
    store = RunStore(tmp_path)
    want = {"step": 5000, "last_loss": 10 - 5000 / 1000, "tokens_per_s": sum(100.0 + s for s in range(4981, 5001)) / 20}
    listed = {r["id"]: r for r in store.list_runs()}
    assert listed["no-best"]["best_val_loss"] == 0.5 and store.detail(store.files.run("no-best"))["summary"][
        "best_val_loss"] == 0.5
    monkeypatch.setattr(store.files, "metrics_cache", lambda run: pytest.fail(f"{run.id}: metrics read whole"))
    row, detail = store.summary_row(store.files.run("best")), store.detail(store.files.run("best"))["summary"]
    assert (row["step"], row["last_loss"], row["best_val_loss"]) == (want["step"], want["last_loss"], 0.75)
    assert (detail["steps_done"], detail["last_loss"], detail["best_val_loss"]) == (want["step"], want["last_loss"], 0.75)
    assert detail["tokens_per_s"] == pytest.approx(want["tokens_per_s"], rel=1e-12)


def test_a_trainers_cpu_and_memory_without_proc(tmp_path, monkeypatch):
    """A run's /system as on macOS, where there is no /proc (the module's /proc pointed at a folder that does not
    exist, so ps answers for real): the trainer's CPU % and its RSS, which ps reports too."""
    import asyncio
    from anectypes.host import processes
    from anectypes.web.store import RunStore
    monkeypatch.setattr(processes, "PROC", str(tmp_path / "no-proc"))
    (tmp_path / "runs").mkdir()
    trainer, status = fake_trainer(tmp_path / "runs" / "live")
    try:
        write_run(tmp_path / "runs", "live", status)
        store = RunStore(tmp_path / "runs")
        system = asyncio.run(store.processes.system(store.files.run("live")))
        ps_kib = int(subprocess.run(["ps", "-o", "rss=", "-p", str(trainer.pid)], capture_output=True,
                                    text=True).stdout)
    finally:
        trainer.kill()
        trainer.wait()
    assert system["pid"] == trainer.pid and system["alive"] and 0 <= system["cpu_percent"] <= 100
    assert abs(system["rss_mb"] - ps_kib / 1024) < 1


def test_down_sampling_keeps_every_ranks_rows(dash, runs_dir):
    """An MPI run's rows take turns (micro-step j ran on rank j mod 2): a stride of 10 over all rows would
    keep rank 0's only; each rank's rows are strided apart, half the points each."""
    rows = [{"step": s, "loss": 1.0, "ms_step": 10.0 + s % 2, "rank": (s - 1) % 2} for s in range(1, 1001)]
    write_run(runs_dir, "mpi-run", {"state": "finished", "step": 1000, "steps": 1000, "pid": None},
              metrics="".join(json.dumps(r) + "\n" for r in rows))
    m = dash.client().get("/api/runs/mpi-run/metrics", params={"max_points": 100}).json()
    assert len(m["step"]) == 100 and m["step"] == sorted(m["step"]) and m["step"][-2:] == [999, 1000]
    assert [m["rank"].count(r) for r in (0, 1)] == [50, 50], m["rank"]
    assert all(rank == (s - 1) % 2 and ms == 10.0 + s % 2 for s, rank, ms in zip(m["step"], m["rank"], m["ms_step"]))


def reference_extremes(values, buckets):
    """extremes_index by brute force: per bucket (rows n*b//buckets up to n*(b+1)//buckets), its first and last
    row and, per column, the first row holding the bucket's smallest and largest value (NaN: absent)."""
    n, keep = len(values), set()
    for b in range(buckets):
        lo, hi = n * b // buckets, n * (b + 1) // buckets
        keep |= {lo, hi - 1}
        for col in zip(*values[lo:hi]):
            present = [(v, lo + i) for i, v in enumerate(col) if not math.isnan(v)]
            if present:
                keep.add(min(present, key=lambda p: (p[0], p[1]))[1])
                keep.add(min(present, key=lambda p: (-p[0], p[1]))[1])
    return sorted(keep)


def test_down_sampling_keeps_every_buckets_minimum_and_maximum():
    """Issue 36 §1: down-sampled metrics keep each bucket's extremes of every metric, checked against a brute-force
    reference on random columns (ties, absent values, a column absent in whole buckets), and as many buckets as
    fit in max_points: never fewer than max_points // (2 + 2 * columns)."""
    import numpy as np
    from anectypes.web.metrics import extremes_downsample, extremes_index

    rng = np.random.default_rng(36)
    for n, k in ((1, 1), (7, 2), (1000, 3), (4999, 5)):
        values = rng.integers(0, 6, (n, k)).astype(float)                 # small integers: many ties
        values[rng.random((n, k)) < 0.3] = np.nan
        values[: n // 3, 0] = np.nan
        for buckets in sorted({1, 2, 3, n // 7 + 1, n // 2 + 1, n}):
            if buckets <= n:
                assert extremes_index(values, buckets).tolist() == reference_extremes(values.tolist(), buckets)
        for max_points in (2 + 2 * k, 50, 400, 2000):
            keep = extremes_downsample(values, max_points)
            if n <= max_points:
                assert keep == list(range(n))
                continue
            assert len(keep) <= max_points and keep[-1] == n - 1
            fits = [b for b in range(max_points // (2 + 2 * k), max_points // 2 + 1)
                    if reference_extremes(values.tolist(), b) == keep]
            assert fits, (n, k, max_points)


def test_a_spike_survives_down_sampling_and_a_step_range_is_served_whole(dash, runs_dir):
    """Issue 36 §1: 100,000 rows, losses 2-7 and one of 15.0 at step 50,017: the page's 2,000 points of the
    whole run hold it (striding by 50 did not), and from_step/to_step 49,000-51,000 give every row there."""
    rng = random.Random(36)
    losses = {s: 15.0 if s == 50_017 else 2 + 5 * rng.random() for s in range(1, 100_001)}
    write_run(runs_dir, "spike-run", {"state": "finished", "step": 100_000, "steps": 100_000, "pid": None},
              metrics="".join(f'{{"step": {s}, "loss": {v!r}, "ms_step": {9 + s % 3}}}\n' for s, v in losses.items()))
    c = dash.client()
    m = c.get("/api/runs/spike-run/metrics", params={"max_points": 2000}).json()
    assert len(m["step"]) <= 2000 and m["step"][-1] == 100_000
    assert dict(zip(m["step"], m["loss"]))[50_017] == 15.0
    assert all(losses[s] == v for s, v in zip(m["step"], m["loss"]))           # every point at its own step
    zoom = c.get("/api/runs/spike-run/metrics", params={"from_step": 49_000, "to_step": 51_000,
                                                               "max_points": 5000}).json()
    assert zoom["step"] == list(range(49_000, 51_001)) and zoom["loss"] == [losses[s] for s in zoom["step"]]
    tail = c.get("/api/runs/spike-run/metrics", params={"from_step": 99_990, "since_step": 99_995}).json()
    assert tail["step"] == list(range(99_996, 100_001))
    assert c.get("/api/runs/spike-run/metrics", params={"from_step": 10, "to_step": 9}).json()["step"] == []


@pytest.mark.parametrize("field, value", [("steps", -1), ("steps", 0), ("model", "nope"), ("lr", 0),
                                          ("lr", 2), ("accum", 0), ("precision", "fp8"), ("backend", "gpu"),
                                          ("sample_every", -1), ("data", "no/such/file.bin"), ("seed", -3),
                                          ("lrr", 1), ("clip", "Infinity"), ("loss_scale", 0),
                                          ("report_to", "wandb,comet"), ("report_to", "none,mlflow"),
                                          ("report_to", "")])
def test_invalid_start_bodies_get_422_naming_the_field(dash, field, value):
    r = dash.client().post("/api/runs", json=dict(TINY, **{field: value}))
    assert r.status_code == 422, r.text
    assert any(err["loc"][-1] == field for err in r.json()["detail"]), r.json()


def test_invalid_generate_and_query_values_get_422(dash, runs_dir):
    write_run(runs_dir, "plain-run", {"state": "finished", "step": 0, "steps": 0, "pid": None})
    c = dash.client()
    for body in ({"max_tokens": 0}, {"max_tokens": 257}, {"temperature": 3}, {"top_k": -1},
                 {"prompt": "x" * 1001}):
        r = c.post("/api/runs/plain-run/generate", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == next(iter(body)), r.text
    assert c.get("/api/runs/plain-run/metrics", params={"max_points": 0}).status_code == 422
    assert c.get("/api/runs/plain-run/logs", params={"tail": -1}).status_code == 422
    assert c.get("/api/runs/no-such-run").status_code == 404


def test_a_run_stopped_right_after_its_start_is_not_failed(dash, runs_dir):
    c = dash.client()
    r = c.post("/api/runs", json=TINY)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    assert c.post(f"/api/runs/{run_id}/stop").status_code == 202
    d = wait_terminal(c, run_id)
    assert d["state"] == "stopped", d
    assert c.post("/api/runs", json=dict(TINY, model="nope")).status_code == 422


def test_a_resume_that_fails_at_once_is_failed_with_the_trainers_error(dash, runs_dir):
    d = write_run(runs_dir, "broken-ckpt", {"state": "stopped", "step": 4, "steps": 10, "pid": None})
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "latest.ckpt").write_bytes(b"not a zip file")
    c = dash.client()
    r = c.post("/api/runs/broken-ckpt/resume")
    assert r.status_code == 202, r.text
    d = wait_for(lambda: (d := state_of(c, "broken-ckpt"))["state"] == "failed" and d, 60, "failed")
    assert "exited with code 1" in d["status"]["error"] and "not a readable checkpoint" in d["status"]["error"]


def test_a_run_started_from_the_command_line_shows_its_train_log(dash, runs_dir):
    d = write_run(runs_dir, "cli-run", {"state": "finished", "step": 10, "steps": 10, "pid": None})
    (d / "stdout.log").unlink()                                   # the dashboard did not launch it
    (d / "train.log").write_text("started at step 0 of 10\nfinished at step 10\n")
    c = dash.client()
    assert c.get("/api/runs/cli-run/logs").json()["lines"] == ["started at step 0 of 10", "finished at step 10"]


def test_json_types_are_strict(dash, runs_dir):
    """true is not a number and "5" is not an integer (schemathesis found `"temperature": true` accepted)."""
    c = dash.client()
    assert c.post("/api/runs/no-such-run/generate", json={"temperature": True}).status_code in (404, 422)
    write_run(runs_dir, "strict-run", {"state": "finished", "step": 0, "steps": 0, "pid": None})
    for body in ({"temperature": True}, {"max_tokens": "5"}, {"top_k": 5.0}):
        r = c.post("/api/runs/strict-run/generate", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == next(iter(body)), r.text
    for body in ({"steps": "10"}, {"lr": True}, {"dynamic_loss_scale": 1}):
        r = c.post("/api/runs", json=dict(TINY, **body))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == next(iter(body)), r.text


def test_name_tags_notes_archive_and_delete(dash, runs_dir):
    d = write_run(runs_dir, "meta-run", {"state": "finished", "step": 10, "steps": 10, "pid": None})
    c = dash.client()
    r = c.patch("/api/runs/meta-run", json={"name": "baseline", "tags": ["lr-3e-3", "tiny"], "notes": "first try"})
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "baseline", "tags": ["lr-3e-3", "tiny"], "notes": "first try", "archived": False}
    assert json.loads((d / "meta.json").read_text())["name"] == "baseline"          # in the run folder
    r = c.patch("/api/runs/meta-run", json={"notes": "second try", "name": None})   # the rest is kept
    assert r.json() == {"name": "baseline", "tags": ["lr-3e-3", "tiny"], "notes": "second try", "archived": False}
    for bad in ({"name": 1}, {"tags": ["a b"]}, {"tags": ["a,b"]}, {"tags": "tiny"}, {"tags": [""]},
                {"colour": "red"}, {"archived": "yes"}, {"name": "x" * 101}, {"tags": ["t"] * 21}):
        assert c.patch("/api/runs/meta-run", json=bad).status_code == 422, bad
    assert c.patch("/api/runs/no-such-run", json={"name": "x"}).status_code == 404
    row = {r["id"]: r for r in c.get("/api/runs").json()["runs"]}["meta-run"]
    assert row["meta"]["name"] == "baseline" and row["duration"] >= 0
    assert c.get("/api/runs/meta-run").json()["meta"]["notes"] == "second try"

    # archive: out of the default list, in the whole one, and back
    assert c.patch("/api/runs/meta-run", json={"archived": True}).json()["archived"] is True
    assert "meta-run" not in [r["id"] for r in c.get("/api/runs").json()["runs"]]
    assert "meta-run" in [r["id"] for r in c.get("/api/runs", params={"archived": True}).json()["runs"]]
    assert c.get("/api/runs/meta-run").status_code == 200

    # a malformed meta.json reads as no meta at all
    (d / "meta.json").write_text('{"name": 5}')
    assert c.get("/api/runs/meta-run").json()["meta"] == {"name": "", "tags": [], "notes": "", "archived": False}

    # delete: refused while the trainer runs, then the folder is gone
    sleeper, status = fake_trainer(runs_dir / "live-run", 60)
    try:
        live = write_run(runs_dir, "live-run", {**status, "step": 1, "steps": 10})
        r = c.delete("/api/runs/live-run")
        assert r.status_code == 409 and "running" in r.json()["detail"] and live.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert c.delete("/api/runs/live-run").status_code == 204 and not live.exists()
    r = c.delete("/api/runs/meta-run")
    assert r.status_code == 204 and r.content == b"" and not d.exists()
    assert c.get("/api/runs/meta-run").status_code == 404
    assert c.delete("/api/runs/meta-run").status_code == 404
    assert "meta-run" not in [r["id"] for r in c.get("/api/runs", params={"archived": True}).json()["runs"]]


def test_queued_runs_start_in_order_when_a_slot_frees(dash, runs_dir):
    c = dash.client()
    first = c.post("/api/runs", json=TINY).json()["id"]
    short = dict(TINY, steps=6, save_every=1)
    second, third = (c.post("/api/runs", json=short).json()["id"] for _ in range(2))
    rows = {r["id"]: r for r in c.get("/api/runs").json()["runs"]}
    assert [rows[i]["state"] for i in (first, second, third)] == ["running", "queued", "queued"]
    assert [rows[i]["position"] for i in (second, third)] == [1, 2]
    assert c.delete(f"/api/runs/{third}").status_code == 204                     # a queued run can go too
    assert c.post(f"/api/runs/{first}/stop").status_code == 202
    wait_terminal(c, first)
    d = wait_terminal(c, second, timeout=120)                                    # started by itself, finished
    assert d["state"] == "finished" and d["summary"]["steps_done"] == 6
    launch = json.loads((runs_dir / second / "launch.json").read_text())
    assert launch["queued"] is False and launch["launched"] > launch["created"]
    assert not (runs_dir / third).exists()


def test_a_cancelled_run_is_queued_again_at_the_end(tmp_path):
    """Cancel takes a queued run out of the queue (cancelled, not "stopped" with the seconds it waited);
    resume puts it back at the end of the queue, kept over a restart (--max-running 0: nothing starts)."""
    (tmp_path / "runs").mkdir()
    dash = Dashboard(tmp_path / "runs", tmp_path / "dashboard.log", args=["--max-running", "0"]).start()
    try:
        c = dash.client()
        first, second = (c.post("/api/runs", json=TINY).json()["id"] for _ in range(2))
        assert c.post(f"/api/runs/{first}/stop").status_code == 202
        assert state_of(c, first)["state"] == "cancelled"
        assert state_of(c, second)["status"]["position"] == 1
        row = {r["id"]: r for r in c.get("/api/runs").json()["runs"]}[first]
        assert row["state"] == "cancelled" and row["duration"] is None                # it never ran
        assert c.post(f"/api/runs/{first}/stop").status_code == 409                   # not running, not queued
        r = c.post(f"/api/runs/{first}/resume")
        assert r.status_code == 202 and r.json() == {"id": first}
        assert state_of(c, first)["status"] == {"state": "queued", "position": 2, "pid": None, "alive": False}
        dash.stop()
        dash.start()
        c = dash.client()
        assert [state_of(c, i)["status"].get("position") for i in (first, second)] == [2, 1]
        assert not (tmp_path / "runs" / first / "config.json").exists()              # never started
    finally:
        dash.stop()


def test_a_sweep_queues_its_grid(dash, runs_dir):
    c = dash.client()
    for bad in ({"grid": {"lr": [2.0]}}, {"grid": {"clip": [1.0, 2.0]}}, {"grid": {"lr": []}},
                {"grid": {"seed": list(range(9))}}, {"grid": {"lr": [0.1] * 8, "seed": list(range(8)), "accum": [1, 2]}},
                {"grid": {"seed": ["1"]}}, {"model": "tiny"}, {"grid": {}}, {"grid": {"seed": [1]}, "colour": 1}):
        r = c.post("/api/sweeps", json=bad)
        assert r.status_code == 422, (bad, r.text)
    assert "lr" in str(c.post("/api/sweeps", json={"grid": {"lr": [2.0]}}).json()["detail"])
    r = c.post("/api/sweeps", json=dict(TINY, steps=4, save_every=1, grid={"lr": [0.003, 0.001], "seed": [1, 2]}))
    assert r.status_code == 201, r.text
    sweep, ids = r.json()["sweep"], r.json()["ids"]
    rows = {r["id"]: r for r in c.get("/api/runs").json()["runs"]}
    assert [rows[i]["state"] for i in ids] == ["running", "queued", "queued", "queued"]
    assert [rows[i]["meta"]["name"] for i in ids] == ["lr=0.003 seed=1", "lr=0.003 seed=2", "lr=0.001 seed=1",
                                                      "lr=0.001 seed=2"]
    assert all(rows[i]["meta"]["tags"] == [f"sweep-{sweep}"] for i in ids)
    assert [(rows[i]["spec"]["lr"], rows[i]["spec"]["seed"]) for i in ids] == [(0.003, 1), (0.003, 2), (0.001, 1), (0.001, 2)]
    for run_id in ids:
        assert wait_terminal(c, run_id, timeout=120)["state"] == "finished"
    specs = [state_of(c, i)["config"]["spec"] for i in ids]
    assert [(s["lr"], s["seed"], s["steps"]) for s in specs] == [(0.003, 1, 4), (0.003, 2, 4), (0.001, 1, 4), (0.001, 2, 4)]


def test_the_run_list_carries_each_runs_plain_spec_values(dash, runs_dir):
    """The list's config columns: the spec's numbers, strings and booleans; a planted folder's nested or
    odd values are left out, a spec that is not an object gives none."""
    d = write_run(runs_dir, "odd-spec", {"state": "finished", "step": 10, "steps": 10})
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"spec": config["spec"] | {"lr": 0.02, "grid": {"lr": [1]},
                                                                                   "tags": ["a"], "note": None}}))
    write_run(runs_dir, "list-spec", {"state": "finished", "step": 10, "steps": 10})
    config = json.loads((runs_dir / "list-spec" / "config.json").read_text())
    (runs_dir / "list-spec" / "config.json").write_text(json.dumps(config | {"spec": [1, 2]}))
    rows = {r["id"]: r for r in dash.client().get("/api/runs").json()["runs"]}
    spec = rows["odd-spec"]["spec"]
    want = {k: v for k, v in config["spec"].items() if isinstance(v, (str, int, float, bool))} | {"lr": 0.02}
    assert spec == want and {"model", "seed", "accum", "steps"} <= spec.keys() and type(spec["seed"]) is int
    assert rows["list-spec"]["spec"] == {}


def test_fine_tune_from_a_runs_checkpoint(dash, runs_dir):
    c = dash.client()
    write_run(runs_dir, "no-ckpt", {"state": "stopped", "step": 1, "steps": 10, "pid": None})
    for bad in ("no-such-run", "no-ckpt", "../no-ckpt", "/etc"):
        r = c.post("/api/runs", json=dict(TINY, init_from_run=bad))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "init_from_run", (bad, r.text)
    source = c.post("/api/runs", json=dict(TINY, steps=40, save_every=5)).json()["id"]
    wait_terminal(c, source, timeout=120)
    tuned = c.post("/api/runs", json=dict(TINY, steps=4, init_from_run=source)).json()["id"]
    d = wait_terminal(c, tuned, timeout=120)
    assert d["state"] == "finished" and d["config"]["spec"]["init_from"] == str(runs_dir / source / "checkpoints" /
                                                                              "best.ckpt")

    def first_loss(run_id):
        return c.get(f"/api/runs/{run_id}/metrics").json()["loss"][0]
    # it starts from the trained weights: over the whole vocabulary (a fine-tune's objective), well under a fresh
    # model's ln(1024) = 6.93 (the source's own loss is over the ids its data holds: another objective)
    assert d["config"]["vocabulary"] == "full" and first_loss(tuned) < math.log(d["config"]["model"]["vocab"]) - 0.3


def test_fine_tune_a_hugging_face_folder_with_lora(builtin_cache, tmp_path):
    """The form's "Fine-tune a Hugging Face model" with LoRA: a folder inside the data folder only, a model's
    folder only, not with a run as well; the run trains the adapters alone, as config.json counts them."""
    data = tmp_path / "data"
    lora_llama_folder(data / "llama")
    (data / "notes").mkdir()
    outside = lora_llama_folder(tmp_path / "outside")
    d = Dashboard(tmp_path / "runs", tmp_path / "dashboard.log", args=("--data-dir", str(data))).start()
    try:
        c = d.client()
        for bad in ("notes", "no-such-folder", "../outside", str(outside)):
            r = c.post("/api/runs", json=dict(TINY, steps=4, lora=4, init_from_folder=bad))
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "init_from_folder", (bad, r.text)
        r = c.post("/api/runs", json=dict(TINY, steps=4, init_from_folder="llama", init_from_run="some-run"))
        assert r.status_code == 422 and "not both" in r.text
        assert not list((tmp_path / "runs").iterdir())                      # nothing was started or created
        r = c.post("/api/runs", json=dict(TINY, steps=6, lora=4, lora_alpha=8.0, init_from_folder="llama"))
        assert r.status_code == 201, r.text
        done = wait_terminal(c, r.json()["id"], timeout=180)
        assert done["state"] == "finished", c.get(f"/api/runs/{r.json()['id']}/logs", params={"tail": 20}).json()
        config = done["config"]
        assert config["spec"]["init_from"] == str((data / "llama").resolve())
        # rank 4 on q, k, v, o of 2 layers: A [4, in] and B [out, 4] each (dim 32, q 32, k and v 16 wide)
        assert config["trainable"] == 2 * 4 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32)) < config["params"]
    finally:
        d.stop()


@pytest.fixture(scope="module")
def trained(builtin_cache, tmp_path_factory):
    """A real run of four steps (best.ckpt and latest.ckpt), outside the dashboard's runs folder."""
    run = tmp_path_factory.mktemp("trained") / "run"
    subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(run), "--steps", "4",
                    "--accum", "2", "--save-every", "1", "--sample-every", "0", "--backend", "sim", "--precision",
                    "fp32"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return run


def planted_run(runs_dir, name, trained, link):
    """A run folder with the trained run's config and its checkpoints: symlinks to them (link) or copies."""
    d = runs_dir / name
    (d / "checkpoints").mkdir(parents=True)
    shutil.copy(trained / "config.json", d / "config.json")
    (d / "status.json").write_text(json.dumps({"state": "finished", "step": 4, "steps": 4}))
    for ckpt in ("best.ckpt", "latest.ckpt"):
        if link:
            (d / "checkpoints" / ckpt).symlink_to(trained / "checkpoints" / ckpt)
        else:
            shutil.copy(trained / "checkpoints" / ckpt, d / "checkpoints" / ckpt)
    return d


def test_checkpoints_symlinked_out_of_the_run_are_read_by_no_route(dash, runs_dir, trained):
    """checkpoints/best.ckpt and latest.ckpt symlinked to a valid checkpoint outside the run: export (best,
    latest, the default), generation and a fine-tune from the run all refuse, as the download does; the same
    checkpoints copied into a run are exported and generate."""
    planted_run(runs_dir, "linked-ckpt", trained, link=True)
    planted_run(runs_dir, "copied-ckpt", trained, link=False)
    c = dash.client()
    for which in ({"checkpoint": "best"}, {"checkpoint": "latest"}, {}):
        r = c.post("/api/runs/linked-ckpt/export", json={"format": "gguf", **which})
        assert r.status_code == 409 and "has no" in r.json()["detail"], (which, r.text)
        assert c.post("/api/runs/copied-ckpt/export", json={"format": "gguf", **which}).content[:4] == b"GGUF"
    for route in ("generate", "generate/stream"):
        r = c.post(f"/api/runs/linked-ckpt/{route}", json={"max_tokens": 2})
        assert r.status_code == 409 and r.json() == {"detail": "the run has no latest checkpoint yet (checkpoints/latest.ckpt)"}
        assert c.post(f"/api/runs/copied-ckpt/{route}", json={"max_tokens": 2}).status_code == 200
    r = c.post("/api/runs", json=dict(TINY, init_from_run="linked-ckpt"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "init_from_run"], r.text
    for ckpt in ("best.ckpt", "latest.ckpt"):
        assert c.get(f"/api/runs/linked-ckpt/checkpoints/{ckpt}").status_code == 404
    assert "Traceback" not in dash.log_path.read_text()


def test_a_tiny_temperature_is_greedy(dash, runs_dir, trained):
    """Any temperature above 0 that the schema admits samples (1e-39 and 5e-324 used to crash the sampler:
    a 500 from /generate, a stream cut after its first event); in the limit, greedy."""
    planted_run(runs_dir, "tiny-temperature", trained, link=False)
    c = dash.client()
    ask = {"prompt": "Once upon a time", "max_tokens": 12, "seed": 3}
    greedy = c.post("/api/runs/tiny-temperature/generate", json=dict(ask, temperature=0)).json()
    for t in (1e-39, 5e-324):
        r = c.post("/api/runs/tiny-temperature/generate", json=dict(ask, temperature=t))
        assert r.status_code == 200 and r.json() == greedy, (t, r.text)
        events = sse_events(c, "/api/runs/tiny-temperature/generate/stream", lambda evs: evs[-1]["event"] == "done",
                            method="POST", body=dict(ask, temperature=t))
        assert [e["event"] for e in events][-1] == "done"
        assert "".join(e["data"]["text"] for e in events if e["event"] == "token") == greedy["text"]
