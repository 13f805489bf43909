"""The run contract under crashes: SIGKILL at many points (inside checkpoint writes, during --resume, at
random moments), then resume until done; every run must end with the straight run's rows, samples and
checkpoints bit for bit, no duplicated or missing rows and no temporary files. Also: --resume restores
the whole spec, refuses changes to the training math and checkpoints of another run, and tells a dead
trainer from a live one."""

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
from pathlib import Path

import numpy as np
import pytest

from anectypes import runs
from anectypes.formats.checkpoint import load_checkpoint, save_checkpoint
from anectypes.host import processes
from anectypes.host.processes import process_start
from anectypes.model.config import PRESETS, init_params
from anectypes.runs import RunDir
from anectypes.train import main

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--model", "tiny", "--backend", "sim", "--steps", "24", "--accum", "2", "--save-every", "2",
          "--sample-every", "6", "--log-every", "1000"]
pytestmark = [pytest.mark.usefixtures("builtin_cache"), pytest.mark.slow]


def rows(run, kind="loss"):
    """The metrics rows with a `kind` field: training rows ("loss") or validation rows ("val_loss")."""
    return [r for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines()) if kind in r]


def outcome(run):
    """What must not depend on crashes: the rows without their timings, samples, checkpoints' contents."""
    run = Path(run)
    train = [{k: r[k] for k in ("step", "loss", "lr", "grad_norm", "loss_scale")} for r in rows(run)]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1)), "duplicated or missing rows"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    ckpts = {}
    for name in ("latest.ckpt", "best.ckpt"):
        c = load_checkpoint(run / "checkpoints" / name)
        ckpts[name] = (c.state["step"], c.state["best_val_loss"], c.params["embed"].tobytes())
    return train, rows(run, "val_loss"), samples, ckpts


def leftovers(run):
    return sorted(str(p.relative_to(run)) for p in Path(run).rglob(".*.tmp"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, builtin_cache):
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(["--scratch", "--run-dir", str(run), *COMMON]) == 0
    val = rows(run, "val_loss")
    assert len(val) == 6 and load_checkpoint(run / "checkpoints" / "best.ckpt").state["best_val_loss"] == \
        min(r["val_loss"] for r in val)
    return outcome(run)


@pytest.fixture(scope="module")
def overshooting(tmp_path_factory, builtin_cache):
    """A finished run whose learning rate overshoots: best.ckpt (step 12) is behind latest.ckpt (24)."""
    run = tmp_path_factory.mktemp("overshooting") / "run"
    assert main(["--scratch", "--run-dir", str(run), *COMMON, "--lr", "0.05"]) == 0
    assert load_checkpoint(run / "checkpoints" / "best.ckpt").state["step"] < 24
    return run


def trainer(*args, kill_at=None, cwd=ROOT):
    """The trainer in a subprocess (optionally SIGKILLed inside the Nth atomic write of a file)."""
    pre = [str(ROOT / "tests" / "support" / "kill_at.py"), *kill_at] if kill_at else ["-m", "anectypes.train"]
    return subprocess.run([sys.executable, *pre, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def paused_trainer(*args, **popen):
    """The trainer in a subprocess, paused once it has claimed its folder, read the run and compiled, before
    it writes anything (tests/support/pause_at_take_over.py): a line on its stdin lets it go on."""
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "pause_at_take_over.py"), *args], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)
    while (line := p.stdout.readline()) != "paused\n":
        assert line, "the trainer ended before its take-over"
    return p


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in Path(folder).rglob("*")}


def one_error_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def finish(run):
    """Resume until the run is done (a resume of a run killed before its first checkpoint restarts it)."""
    r = trainer("--resume", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kills", [
    [("latest.ckpt", "1", "--scratch")],                        # inside the first checkpoint write
    [("latest.ckpt", "3", "--scratch")],                        # inside a later one
    [("best.ckpt", "2", "--scratch")],
    [("latest.ckpt", "2", "--scratch"), ("metrics.jsonl", "1", "--resume")],   # the rewind during --resume
    [("latest.ckpt", "2", "--scratch"), ("latest.ckpt", "1", "--resume")],     # a resume's first checkpoint
], ids=["first-checkpoint", "later-checkpoint", "best-checkpoint", "during-resume-rewind",
        "during-resume-checkpoint"])
def test_kill_inside_writes_then_resume_matches_the_straight_run(tmp_path, straight, kills):
    run = tmp_path / "run"
    for name, nth, how in kills:
        r = trainer(how, "--run-dir", str(run), *COMMON, kill_at=(name, nth))
        assert r.returncode == -signal.SIGKILL, r.stderr
        assert leftovers(run), "the kill should have left a half-written temporary file"
    finish(run)
    assert outcome(run) == straight
    assert leftovers(run) == []


def test_scratch_into_a_run_killed_before_its_first_checkpoint_starts_it_cleanly(tmp_path, straight):
    run = tmp_path / "run"
    r = trainer("--scratch", "--run-dir", str(run), *COMMON, kill_at=("latest.ckpt", "1"))
    assert r.returncode == -signal.SIGKILL and rows(run)        # rows of the killed attempt are there
    r = trainer("--scratch", "--run-dir", str(run), *COMMON)
    assert r.returncode == 0, r.stderr
    assert outcome(run) == straight and leftovers(run) == []


def test_sigkill_at_random_moments_then_resume_matches_the_straight_run(tmp_path, straight):
    """Kills from outside at seeded random moments: during start-up, training, checkpoints and resumes.
    A run that finishes before 8 kills have landed must match the straight run; the next starts afresh."""
    rng, kills, attempt = random.Random(7), 0, 0
    while kills < 8:
        attempt += 1
        run = tmp_path / f"run{attempt}"
        status = run / "status.json"
        # (a kill may land after the run's last status write: then the run is finished all the same)
        while not (status.exists() and json.loads(status.read_text())["state"] == "finished"):
            how = "--resume" if (run / "config.json").exists() else "--scratch"
            p = subprocess.Popen([sys.executable, "-m", "anectypes.train", how, "--run-dir", str(run), *COMMON],
                                 cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                p.wait(timeout=rng.uniform(0.3, 2.5))
            except subprocess.TimeoutExpired:
                p.kill()
                kills += 1
            _, err = p.communicate()
            assert p.returncode in (0, -signal.SIGKILL), err
        assert outcome(run) == straight and leftovers(run) == []


def test_a_kill_between_the_last_checkpoint_and_the_last_status_is_completed_by_resume(tmp_path, straight, capsys):
    """The end of a run writes its last checkpoint (whose status says running), then the status finished;
    a kill between the two leaves a whole run that --resume marks finished (exit 0), training nothing."""
    run, keys = tmp_path / "run", ("step", "steps", "updates", "loss", "best_val_loss")
    assert main(["--scratch", "--run-dir", str(run), *COMMON]) == 0
    status = json.loads((run / "status.json").read_text())
    RunDir(run).write_status("running", **{k: status[k] for k in keys})
    # and an earlier kill's half-written samples, of a pid no process can have (Linux allows up to 2^22)
    (run / f".samples.jsonl.{2**22 + 1}.0a1b.tmp").write_text('{"step": 2')
    capsys.readouterr()
    assert main(["--resume", "--run-dir", str(run)]) == 0
    assert "marked finished" in capsys.readouterr().out
    again = json.loads((run / "status.json").read_text())
    assert again["state"] == "finished" and {k: again[k] for k in keys} == {k: status[k] for k in keys}
    assert outcome(run) == straight and leftovers(run) == []
    assert main(["--resume", "--run-dir", str(run)]) == 1              # now finished: the usual refusal
    assert "is finished: step 24 of 24" in capsys.readouterr().err


def test_stop_and_resume_keep_the_sample_at_the_stop_step(tmp_path, straight):
    run = tmp_path / "run"
    assert main(["--scratch", "--run-dir", str(run), "--stop-after", "12", *COMMON]) == 0
    assert [s["step"] for s in map(json.loads, (run / "samples.jsonl").read_text().splitlines())] == [6, 12]
    assert json.loads((run / "status.json").read_text())["state"] == "stopped"
    assert main(["--resume", "--run-dir", str(run)]) == 0
    assert outcome(run) == straight


def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path, straight):
    run = tmp_path / "run"
    assert main(["--scratch", "--run-dir", str(run), "--stop-after", "8", *COMMON]) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 6.3')                       # a crash in the middle of a line
    (run / "checkpoints" / f".latest.ckpt.{2**22 + 1}.abc.tmp").write_bytes(b"PK")   # and a stale temp file
    assert main(["--resume", "--run-dir", str(run)]) == 0
    assert outcome(run) == straight and leftovers(run) == []


def test_resume_restores_the_whole_spec_and_refuses_changes_to_the_math(tmp_path, capsys):
    flags = ["--clip", "0.5", "--min-lr-frac", "0.5", "--loss-scale", "128", "--dynamic-loss-scale", "--lr",
             "0.01", "--seed", "3", "--precision", "fp32", *COMMON]
    assert main(["--scratch", "--run-dir", str(tmp_path / "a"), *flags]) == 0
    run = tmp_path / "b"
    assert main(["--scratch", "--run-dir", str(run), "--stop-after", "10", *flags]) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for flag, value in (("--clip", "1.0"), ("--min-lr-frac", "0.1"), ("--loss-scale", "256.0"), ("--seed", "4"),
                        ("--precision", "fp16"), ("--lr", "0.02"), ("--model", "stories15m")):
        capsys.readouterr()
        assert main(["--resume", "--run-dir", str(run), flag, value]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {flag} {value} differs from the run's"), err
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # repeating the run's own values is fine, and a plain --resume trains with all of them
    assert main(["--resume", "--run-dir", str(run), "--clip", "0.5", "--stop-after", "16"]) == 0
    assert main(["--resume", "--run-dir", str(run)]) == 0
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in rows(tmp_path / "a")]
    spec = json.loads((run / "config.json").read_text())["spec"]
    assert (spec["clip"], spec["min_lr_frac"], spec["loss_scale"], spec["dynamic_loss_scale"]) == (0.5, 0.5, 128, True)
    # --steps extends a finished run, recorded in the config and the log
    assert main(["--resume", "--run-dir", str(run)]) == 1
    assert "is finished: step 24 of 24" in capsys.readouterr().err
    assert main(["--resume", "--run-dir", str(run), "--steps", "30"]) == 0
    assert json.loads((run / "config.json").read_text())["spec"]["steps"] == 30
    assert "steps 24 -> 30" in (run / "train.log").read_text()
    assert [r["step"] for r in rows(run)] == list(range(1, 31))


def test_a_checkpoint_of_another_run_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["--scratch", "--run-dir", str(a), "--stop-after", "8", *COMMON]) == 0
    assert main(["--scratch", "--run-dir", str(b), "--stop-after", "4", "--seed", "5", *COMMON]) == 0
    shutil.copy(b / "checkpoints" / "latest.ckpt", a / "checkpoints" / "latest.ckpt")
    before = {p: p.read_bytes() for p in a.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["--resume", "--run-dir", str(a)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not belong to this run" in err[0], err
    assert {p: p.read_bytes() for p in a.rglob("*") if p.is_file()} == before


def test_a_live_trainer_is_told_from_a_dead_one(tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(run),
                          *COMMON, "--steps", "100000"], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "checkpoints" / "latest.ckpt").exists():
            time.sleep(0.05)
        r = trainer("--resume", "--run-dir", str(run))
        assert r.returncode == 1 and f"is being trained by another process (pid {p.pid})" in r.stderr, r.stderr
    finally:
        p.kill()
        p.wait()
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "running"                          # what the killed trainer left
    # a live process with the dead trainer's pid (reused) is not the trainer: pid and start time must match
    status.update(pid=os.getpid(), proc_start=str(int(process_start(os.getpid())) - 1))
    (run / "status.json").write_text(json.dumps(status))
    r = trainer("--resume", "--run-dir", str(run), "--steps", "30")
    assert r.returncode == 0, r.stderr
    assert [r["step"] for r in rows(run)] == list(range(1, 31))


def test_ctrl_c_before_the_first_validation_says_so(tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(run), *COMMON,
                          "--save-every", "1000", "--steps", "100000"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and rows(run)):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "best validation loss – (no validation yet)" in out and "inf" not in out
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped" and status["best_val_loss"] is None
    assert np.isfinite(load_checkpoint(run / "checkpoints" / "latest.ckpt").params["embed"]).all()


@pytest.mark.parametrize("fullfsync", ["answered", "refused", "absent"])
def test_a_checkpoint_is_flushed_with_f_fullfsync_where_fcntl_has_it(tmp_path, monkeypatch, fullfsync):
    """On macOS fsync leaves the data in the drive's cache and F_FULLFSYNC flushes it (fsync(2) there): where
    fcntl has the constant, a checkpoint's temporary file gets it before its rename; fsync where the file
    system refuses it, or where fcntl lacks it (Linux). The constant is faked; the file is a real checkpoint."""
    import errno
    import fcntl
    calls, real_fcntl, fake = [], fcntl.fcntl, 0x3FF1

    def spy_fcntl(fd, cmd, *args):
        if cmd != fake:
            return real_fcntl(fd, cmd, *args)
        calls.append(("F_FULLFSYNC", os.readlink(f"/proc/self/fd/{fd}")))
        if fullfsync == "refused":
            raise OSError(errno.ENOTSUP, "Operation not supported")
        return 0

    if fullfsync == "absent":
        monkeypatch.delattr(fcntl, "F_FULLFSYNC", raising=False)
    else:
        monkeypatch.setattr(fcntl, "F_FULLFSYNC", fake, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", spy_fcntl)
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))))
    cfg = PRESETS["tiny"]
    params = init_params(cfg, np.random.default_rng(0))
    zeros = {k: np.zeros_like(a) for k, a in params.items()}
    save_checkpoint(tmp_path / "latest.ckpt", cfg, params, {"t": 0, "m": zeros, "v": zeros}, {"step": 1})
    temp = {c[1] for c in calls}
    assert len(temp) == 1 and re.fullmatch(rf"{tmp_path}/\.latest\.ckpt\.{os.getpid()}\.[0-9a-f]{{12}}\.tmp", *temp)
    assert [c[0] for c in calls] == {"answered": ["F_FULLFSYNC"], "refused": ["F_FULLFSYNC", "fsync"],
                                     "absent": ["fsync"]}[fullfsync]
    assert load_checkpoint(tmp_path / "latest.ckpt").state == {"step": 1}


def test_only_the_temporary_files_of_dead_writers_are_removed(tmp_path):
    run = tmp_path / "run"
    assert main(["--scratch", "--run-dir", str(run), "--stop-after", "4", *COMMON]) == 0
    dead = run / "checkpoints" / f".latest.ckpt.{2**22 + 1}.0a1b.tmp"      # above Linux's largest pid
    live = run / f".launch.json.{os.getpid()}.0a1b.tmp"                   # a writer that is still running
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    r = trainer("--resume", "--run-dir", str(run), "--stop-after", "8")
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and live.exists()


@pytest.mark.parametrize("damage", ["removed", "a-directory"])
def test_resume_without_its_latest_checkpoint_is_refused_and_changes_nothing(tmp_path, overshooting, damage):
    """Issue 32: with latest.ckpt gone (or a directory in its place), --resume restarted the trained run
    from step 0, cutting its rows and replacing best.ckpt with a worse model. It stops and says how to
    continue from best.ckpt."""
    run = tmp_path / "run"
    shutil.copytree(overshooting, run)
    (run / "checkpoints" / "latest.ckpt").unlink()
    if damage == "a-directory":
        (run / "checkpoints" / "latest.ckpt").mkdir()
    before = tree(run)
    for args in ([], ["--steps", "30"]):
        line = one_error_line(trainer("--resume", "--run-dir", str(run), *args))
        assert "latest.ckpt is " + ("missing" if damage == "removed" else "not a file") in line
        assert "--resume --from best" in line
        assert tree(run) == before


def test_resume_from_best_goes_back_to_its_step_and_continues_like_the_straight_run(tmp_path, overshooting):
    run = tmp_path / "run"
    shutil.copytree(overshooting, run)
    (run / "checkpoints" / "latest.ckpt").unlink()
    best = load_checkpoint(run / "checkpoints" / "best.ckpt").state["step"]
    r = trainer("--resume", "--from", "best", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert f"resumed at step {best} of 24 (from best.ckpt)" in (run / "train.log").read_text()
    assert outcome(run) == outcome(overshooting) and leftovers(run) == []


def test_a_damaged_latest_checkpoint_names_the_way_to_resume_from_best(tmp_path, overshooting):
    run = tmp_path / "run"
    shutil.copytree(overshooting, run)
    latest = run / "checkpoints" / "latest.ckpt"
    latest.write_bytes(latest.read_bytes()[:1000])
    before = tree(run)
    line = one_error_line(trainer("--resume", "--run-dir", str(run)))
    assert "latest.ckpt: not a readable checkpoint" in line
    assert "(--resume --from best continues from best.ckpt)" in line
    assert tree(run) == before


PINNED_CLOCK = ("import sys, time\n"
                "time.strftime = lambda *a: '20260101-000000'    # both start in the same second\n"
                "from anectypes.train import main\n"
                "sys.exit(main(sys.argv[1:]))")


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, straight):
    """Issue 32's `(train --scratch --seed 1 & train --scratch --seed 2 & wait)`, their clocks pinned to
    one second: two whole runs in runs/<time>-tiny and runs/<time>-tiny-2, each its own seed's."""
    procs = [subprocess.Popen([sys.executable, "-c", PINNED_CLOCK, "--scratch", "--seed", seed, *COMMON], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    for p in procs:
        assert p.wait(300) == 0, p.stderr.read()
    runs = sorted((tmp_path / "runs").iterdir())
    assert [r.name for r in runs] == ["20260101-000000-tiny", "20260101-000000-tiny-2"]
    seeds = {json.loads((r / "config.json").read_text())["spec"]["seed"]: r for r in runs}
    assert sorted(seeds) == [1, 2]
    for seed, run in seeds.items():
        alone = tmp_path / f"alone{seed}"
        assert main(["--scratch", "--run-dir", str(alone), "--seed", str(seed), *COMMON]) == 0
        assert outcome(run) == outcome(alone) and leftovers(run) == []
        assert trainer("--resume", "--run-dir", str(run), "--steps", "26").returncode == 0     # resumable
        assert [r["step"] for r in rows(run)] == list(range(1, 27))


def test_a_second_trainer_on_a_claimed_folder_stops_before_it_writes(tmp_path, straight):
    """Two trainers racing on one --run-dir: the one that claimed it trains; the other (a --scratch, then a
    --resume) stops with one line and changes nothing."""
    run = tmp_path / "run"
    first = paused_trainer("--scratch", "--run-dir", str(run), *COMMON, stderr=subprocess.DEVNULL)
    before = tree(tmp_path)
    for how in ("--scratch", "--resume"):
        line = one_error_line(trainer(how, "--run-dir", str(run), *COMMON, "--seed", "5"))
        assert "is being trained by another process" in line
        assert tree(tmp_path) == before
    first.stdin.write("go\n")
    first.stdin.close()
    assert first.wait(300) == 0
    assert outcome(run) == straight and leftovers(run) == []


def test_a_run_folder_deleted_under_its_trainer_stays_gone(tmp_path):
    """Issue 32: a DELETE (rename away, then remove) in the first second of a --resume was undone by the
    trainer recreating the folder. Deleted as the resume starts, or while it trains: it stops, one line."""
    run, gone = tmp_path / "run", tmp_path / "deleted"
    assert main(["--scratch", "--run-dir", str(run), "--stop-after", "8", *COMMON]) == 0
    p = paused_trainer("--resume", "--run-dir", str(run), stderr=subprocess.PIPE)
    run.rename(gone)
    shutil.rmtree(gone)
    p.stdin.write("go\n")
    p.stdin.close()
    err = p.stderr.read().strip().splitlines()
    assert p.wait(300) == 1 and len(err) == 1 and "the run folder was removed or moved away" in err[0], err
    assert not run.exists()
    assert main(["--scratch", "--run-dir", str(run), "--stop-after", "8", *COMMON]) == 0
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--resume", "--run-dir", str(run), "--steps",
                          "100000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(rows(run)) < 12:
        time.sleep(0.05)
    run.rename(gone)
    shutil.rmtree(gone)
    _, err = p.communicate(timeout=120)
    err = err.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "the run folder was removed or moved away" in err[0], err
    assert not run.exists()


def test_a_closed_stdout_does_not_stop_the_trainer(tmp_path, straight):
    """`train ... | head -2`: the reader goes away; the run trains on to its end, its output to nowhere."""
    run = tmp_path / "run"
    p = paused_trainer("--scratch", "--run-dir", str(run), *COMMON, "--log-every", "1", stderr=subprocess.PIPE)
    p.stdout.close()                                  # before the banner and every progress line
    p.stdin.write("go\n")
    p.stdin.close()
    assert p.wait(300) == 0, p.stderr.read()
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert "finished at step 24" in (run / "train.log").read_text()
    assert outcome(run) == straight and leftovers(run) == []


@pytest.fixture(params=["proc", "ps"])
def process_table(request, monkeypatch, tmp_path):
    """Each liveness test twice: with Linux's /proc, and as on macOS, where there is no /proc at all and ps
    and lsof answer (the module's /proc pointed at a folder that does not exist, so those run for real)."""
    if request.param == "ps":
        monkeypatch.setattr(processes, "PROC", str(tmp_path / "no-proc"))
    return request.param


def test_a_process_is_alive_only_while_it_runs(process_table):
    p = subprocess.Popen(["sleep", "300"])
    try:
        start = process_start(p.pid)
        assert start is not None and process_start(p.pid) == start and processes.alive(p.pid, start)
        assert not processes.alive(p.pid, "0" if process_table == "proc" else "Thu Jan  1 00:00:00 1970")
    finally:
        p.kill()
        p.wait()
    assert process_start(p.pid) is None and not processes.alive(p.pid, start)


def test_a_process_start_does_not_depend_on_the_locale_or_time_zone(process_table, monkeypatch):
    """A trainer and a dashboard with different LANG/TZ agree about one process (ps formats lstart by both)."""
    p = subprocess.Popen(["sleep", "300"])
    try:
        monkeypatch.setenv("TZ", "UTC")
        monkeypatch.setenv("LC_ALL", "C")
        start = process_start(p.pid)
        monkeypatch.setenv("TZ", "Asia/Tokyo")
        monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
        monkeypatch.setenv("LANG", "de_DE.UTF-8")
        assert start is not None and process_start(p.pid) == start and processes.alive(p.pid, start)
        assert processes.cpu_ticks(p.pid) == 0                   # TIME read, not lost to a "," decimal point
    finally:
        p.kill()
        p.wait()


def test_a_zombie_is_not_alive(process_table):
    p = subprocess.Popen(["sleep", "300"])
    start = process_start(p.pid)
    p.kill()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)        # ended, not yet reaped: a zombie
    try:
        assert start is not None and not processes.alive(p.pid, start)
    finally:
        p.wait()


def test_another_processs_cpu_time_and_memory_are_the_kernels(process_table):
    """cpu_ticks and rss_mb (the dashboard's /system) against the kernel's other answers: this process's CPU
    time by os.times() read just before and just after (the same counters, in seconds; ps's TIME on Linux holds
    whole seconds), and the RSS of a sleeping child holding 64 MiB by ps. Without /proc (macOS), through ps."""
    sum(i * i for i in range(10**6))                                   # some CPU time to count
    tick = os.sysconf("SC_CLK_TCK")
    before, ticks, after = os.times(), processes.cpu_ticks(os.getpid()), os.times()
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; b = b'x' * (64 << 20); print(flush=True); "
                          "time.sleep(300)"], stdout=subprocess.PIPE)
    try:
        p.stdout.readline()
        rss = processes.rss_mb(p.pid)
        ps_kib = int(subprocess.run(["ps", "-o", "rss=", "-p", str(p.pid)], capture_output=True, text=True).stdout)
    finally:
        p.kill()
        p.wait()
    low = math.floor(before.user + before.system) if process_table == "ps" else before.user + before.system
    assert round(low * tick) <= ticks <= round((after.user + after.system) * tick)
    assert rss > 64 and abs(rss - ps_kib / 1024) < 1, (rss, ps_kib)


def test_only_a_process_training_the_folder_is_its_trainer(tmp_path, process_table):
    """A live process with the pid and start time a status.json names is the run's trainer only if its
    command line runs anectypes.train and names the folder, or it holds a file of the folder open."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    sleep = "import time; time.sleep(300)"
    procs = {"named": [sys.executable, "-c", sleep, "-m", "anectypes.train", "--run-dir", str(run)],
             "holding": [sys.executable, "-c", f"f = open('run/metrics.jsonl'); {sleep}", "-m", "anectypes.train",
                         "--resume", "--run-dir", "run"],
             "relative": [sys.executable, "-c", sleep, "-m", "anectypes.train", "--run-dir", "run"],
             "other run": [sys.executable, "-c", sleep, "-m", "anectypes.train", "--run-dir", str(tmp_path / "x")],
             "not a trainer": [sys.executable, "-c", sleep, str(run)], "sleep": ["sleep", "300"]}
    procs = {k: subprocess.Popen(argv, cwd=tmp_path) for k, argv in procs.items()}
    try:
        deadline = time.monotonic() + 60                     # until the holder has opened the file
        while not any(p.endswith("metrics.jsonl") for p in processes.open_paths(procs["holding"].pid)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        found = {}
        for name, p in procs.items():
            assert runs.is_trainer(p.pid, run) == (name in ("named", "holding")), name
            (run / "status.json").write_text(json.dumps({"state": "running", "pid": p.pid,
                                                          "proc_start": process_start(p.pid)}))
            found[name] = RunDir(run).trainer()
        assert found == {name: (p.pid, name in ("named", "holding")) for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_trainer_started_from_the_command_line_is_told_by_its_open_files(tmp_path):
    """A trainer started with a relative --run-dir (its command line does not name the folder as the
    dashboard's does): what it holds open tells that it is the run's; a second trainer of the run is refused."""
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", "run", *COMMON,
                          "--steps", "100000"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((tmp_path / "run" / "metrics.jsonl").exists() and rows(tmp_path / "run")):
            time.sleep(0.05)
        assert RunDir(tmp_path / "run").trainer() == (p.pid, True)
        r = trainer("--resume", "--run-dir", str(tmp_path / "run"))
        assert r.returncode == 1 and f"is being trained by another process (pid {p.pid})" in r.stderr, r.stderr
    finally:
        p.kill()
        p.wait()
    assert RunDir(tmp_path / "run").trainer() == (p.pid, False)
