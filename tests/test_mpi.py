"""Data-parallel training on MPI ranks (anectypes.train.distributed), against one process as the reference.

Every run here is the tiny model on the built-in corpus under `mpirun -n 2` (the `mpi` extra, which
tools/run_tests.sh installs with the test extra); 2 ranks × --accum 2 must train like 1 process ×
--accum 4 (the data-order rule), and resume, a killed rank and the compile-budget restart must
continue exactly as the straight 2-rank run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.formats.checkpoint import load_checkpoint
from anectypes.train.distributed import launch, mpirun_command

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--model", "tiny", "--backend", "sim", "--sample-every", "0", "--log-every", "1000", "--save-every", "5"]
STEPS = ["--steps", "80"]                               # 20 updates of 4 micro-steps
pytestmark = pytest.mark.usefixtures("builtin_cache")


def rows(run_dir):
    """The training rows by step, checking that they are steps 1..n, each once."""
    train = [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    return train


def losses(run_dir):
    return [r["loss"] for r in rows(run_dir)]


def weights(run_dir):
    return load_checkpoint(Path(run_dir) / "checkpoints" / "latest.ckpt").params


def mpirun(*args, ranks=2, program=("-m", "anectypes.train"), timeout=600):
    return subprocess.run([*mpirun_command(ranks), sys.executable, *program, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def train(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "anectypes.train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(2 ranks × accum 2, 1 process × accum 4) run folders, 20 updates, default precision (fp16)."""
    base = tmp_path_factory.mktemp("straight")
    ok(mpirun("--scratch", "--run-dir", str(base / "mpi"), "--accum", "2", *STEPS, *FAST))
    ok(train("--scratch", "--run-dir", str(base / "one"), "--accum", "4", *STEPS, *FAST))
    return base / "mpi", base / "one"


def assert_trains_like_one_process(mpi, one, weights_tol):
    a, b = rows(mpi), rows(one)
    assert len(a) == len(b) == 80
    assert [r["loss"] for r in a[:4]] == [r["loss"] for r in b[:4]]          # the first update: bit for bit
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-4, atol=0)
    assert [r["rank"] for r in a] == [0, 1] * 40                             # micro-step j runs on rank j mod 2
    assert [r["step"] for r in a if r["grad_norm"] is not None] == list(range(4, 81, 4))
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    wa, wb = weights(mpi), weights(one)
    for k in wb:
        np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=weights_tol, err_msg=k)
    assert json.loads((mpi / "config.json").read_text())["spec"]["ranks"] == 2
    status = json.loads((mpi / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 80 and status["updates"] == 20


@pytest.mark.slow
def test_two_ranks_train_like_one_process_with_their_accumulation(straight):
    # fp16 (the default, like the hardware): the summation order's last-bit differences pass through
    # fp16 activations and Adam's per-element normalization; measured: losses 5e-6 relative, weights
    # 1.05e-4 (--exact-accum, below, makes them the same bits)
    assert_trains_like_one_process(*straight, weights_tol=1e-3)


@pytest.mark.slow
def test_with_exact_accumulation_two_ranks_train_bit_for_bit_like_one_process(tmp_path):
    # the micro-steps' gradients summed in float64, where their order does not change the sum: fp16's
    # losses and final weights are the same bits as one process's
    common = [*STEPS, *FAST, "--exact-accum"]
    ok(mpirun("--scratch", "--run-dir", str(tmp_path / "mpi"), "--accum", "2", *common))
    ok(train("--scratch", "--run-dir", str(tmp_path / "one"), "--accum", "4", *common))
    assert_trains_like_one_process(tmp_path / "mpi", tmp_path / "one", weights_tol=0)
    assert losses(tmp_path / "mpi") == losses(tmp_path / "one")
    assert json.loads((tmp_path / "mpi" / "config.json").read_text())["spec"]["exact_accum"] is True


@pytest.mark.slow
def test_two_ranks_train_like_one_process_in_fp32(tmp_path):
    # fp32: only the summation order differs; measured: losses 1e-8 relative, weights 2.4e-7
    common = [*STEPS, *FAST, "--precision", "fp32", "--sample-every", "6"]
    ok(mpirun("--scratch", "--run-dir", str(tmp_path / "mpi"), "--accum", "2", *common))
    ok(train("--scratch", "--run-dir", str(tmp_path / "one"), "--accum", "4", *common))
    assert_trains_like_one_process(tmp_path / "mpi", tmp_path / "one", weights_tol=1e-4)
    # rank 0's samples, also those inside an update (step 6 of 5..8), come from the same weights
    samples = [(tmp_path / run / "samples.jsonl").read_text() for run in ("mpi", "one")]
    assert samples[0] == samples[1] and samples[0].count("\n") == 13


@pytest.mark.slow
def test_an_inf_gradient_skips_the_update_on_every_rank_as_in_one_process(tmp_path):
    # a loss scale of 1e6 overflows fp16 in some updates' micro-steps (measured: steps 4, 8 and 20 of
    # 40): the ranks must skip exactly the updates that one process skips, and halve the scale alike
    common = ["--steps", "40", *FAST, "--dynamic-loss-scale", "--loss-scale", "1e6"]
    ok(mpirun("--scratch", "--run-dir", str(tmp_path / "mpi"), "--accum", "2", *common))
    ok(train("--scratch", "--run-dir", str(tmp_path / "one"), "--accum", "4", *common))
    a, b = rows(tmp_path / "mpi"), rows(tmp_path / "one")
    skipped = [r["step"] for r in b if r["step"] % 4 == 0 and r["grad_norm"] is None]
    assert skipped and len(skipped) < 10                                  # some updates skip, not all
    assert [r["step"] for r in a if r["step"] % 4 == 0 and r["grad_norm"] is None] == skipped
    assert [r["loss_scale"] for r in a] == [r["loss_scale"] for r in b]
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-4, atol=0)


def assert_same_run(run, reference):
    assert losses(run) == losses(reference)
    wa, wb = weights(run), weights(reference)
    assert all(np.array_equal(wa[k], wb[k]) for k in wb)


@pytest.mark.slow
def test_resume_under_mpi_is_bit_identical_and_needs_the_same_ranks(straight, tmp_path):
    run = tmp_path / "run"
    ok(mpirun("--scratch", "--run-dir", str(run), "--accum", "2", "--stop-after", "40", *STEPS, *FAST))
    assert len(losses(run)) == 40
    r = train("--resume", "--run-dir", str(run), "--ranks", "3")
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "error: --ranks 3 differs from the run's 2: it changes the training math, so it cannot change on "
        "--resume; start a new run (--scratch) instead"]
    r = mpirun("--resume", "--run-dir", str(run), ranks=1)
    assert r.returncode != 0 and "error: --ranks 1 differs from the run's 2" in r.stderr
    ok(mpirun("--resume", "--run-dir", str(run)))
    assert_same_run(run, straight[0])


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_and_the_run_resumes(straight, tmp_path):
    run = tmp_path / "run"
    # rank 1 dies at micro-step 34, in the update after the checkpoint at step 20
    r = mpirun("1", "34", "--scratch", "--run-dir", str(run), "--accum", "2", *STEPS, *FAST,
               program=[str(ROOT / "tests" / "support" / "kill_rank_at.py")])
    assert r.returncode != 0
    assert load_checkpoint(run / "checkpoints" / "latest.ckpt").state["step"] == 20
    ok(mpirun("--resume", "--run-dir", str(run)))
    assert_same_run(run, straight[0])
    assert not list(run.rglob(".*.tmp"))


@pytest.mark.slow
def test_compile_budget_restart_relaunches_mpirun(straight, tmp_path):
    run = tmp_path / "run"
    # 10 kernels compile at start; with a budget of 19 every update ends the job with status 75, and
    # --ranks 2 (mpirun's launcher) starts it again with --resume
    r = ok(train("--ranks", "2", "--scratch", "--run-dir", str(run), "--accum", "2", "--compile-budget", "19",
                 "--stop-after", "12", *STEPS, *FAST))
    assert r.stderr.count("every rank exits with status 75") == 2
    assert (run / "train.log").read_text().count("resumed at step") == 2
    assert losses(run) == losses(straight[0])[:12]


@pytest.mark.slow
def test_ranks_writing_to_a_file_print_a_line_every_log_every_steps(tmp_path):
    """Rank 0's stdout is mpirun's pty even when `--ranks 2`'s own is a file: the launcher tells the ranks,
    so the file gets plain progress lines every --log-every steps, no carriage returns."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        r = subprocess.run([sys.executable, "-m", "anectypes.train", "--ranks", "2", "--scratch", "--run-dir",
                            str(tmp_path / "run"), "--accum", "2", "--steps", "16", *FAST, "--log-every", "4"],
                           cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "\r" not in text
    assert [line.split()[1] for line in text.splitlines() if line.startswith("step ")] == ["4/16", "8/16", "12/16",
                                                                                          "16/16"]


@pytest.mark.slow
def test_a_reader_that_goes_away_does_not_stop_the_ranks(tmp_path):
    """`train --ranks 2 ... | head -1`: mpirun aborts the job on SIGPIPE, so the launcher relays its output
    and, once the reader is gone, sends it nowhere; the ranks train to the end."""
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--ranks", "2", "--scratch", "--run-dir", str(run),
                          "--accum", "2", "--steps", "40", *FAST, "--log-every", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith(f"run dir {run} ")
    p.stdout.close()
    assert p.wait(600) == 0, p.stderr.read()
    assert json.loads((run / "status.json").read_text())["state"] == "finished" and len(losses(run)) == 40


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_at_an_update_with_a_checkpoint(straight, tmp_path):
    import signal
    import time
    run = tmp_path / "run"
    # what the dashboard's stop does: SIGTERM to the process group of `--ranks 2` (mpirun has its own)
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--ranks", "2", "--scratch", "--run-dir", str(run),
                          "--accum", "2", *STEPS, *FAST], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(losses(run)) >= 10):
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=120) == 130
    assert json.loads((run / "status.json").read_text())["state"] == "stopped"
    step = load_checkpoint(run / "checkpoints" / "latest.ckpt").state["step"]
    assert step % 4 == 0 and 10 <= step < 80 and len(losses(run)) == step
    ok(train("--resume", "--run-dir", str(run)))                # the run's spec says 2 ranks: mpirun -n 2 again
    assert_same_run(run, straight[0])


@pytest.mark.slow
def test_an_error_every_rank_meets_is_said_once(tmp_path):
    for args, words in ((["--data", str(tmp_path / "missing.bin")], "missing.bin"),
                        (["--ranks", "3"], "--ranks 3 but mpirun started 2 processes")):
        r = mpirun("--scratch", "--run-dir", str(tmp_path / "r"), *args, *FAST, timeout=300)
        lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 1 and len(lines) == 1 and words in lines[0], r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_ranks_check_that_their_weights_agree(tmp_path):
    script = tmp_path / "diverge.py"
    script.write_text("import sys, numpy as np\n"
                      "from anectypes.train.distributed import World\n"
                      "w = World(); a = np.ones(1000, np.float32); w.check_same([a], 1)\n"
                      "a[7] += w.rank * 1e-7\n"
                      "try:\n    w.check_same([a], 2)\nexcept Exception as e:\n    print(w.rank, e)\n")
    r = mpirun(program=[str(script)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(line[:1] for line in r.stdout.splitlines() if "weights diverged at step 2" in line) == ["0", "1"]


def test_mpirun_without_mpi4py_is_one_error_naming_the_extra(tmp_path):
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no MPI here')\n")
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="0", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "error: running under mpirun needs mpi4py: pip install 'anectypes[mpi]'"]
    del env["OMPI_COMM_WORLD_RANK"]                               # not under mpirun: --ranks 2 would start it
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--ranks", "2", "--scratch", "--run-dir",
                        str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "error: --ranks 2 runs mpirun with mpi4py: pip install 'anectypes[mpi]'"]
    assert not (tmp_path / "r").exists()
    r = train("--ranks", "2", "--hostfile", str(tmp_path / "macs.txt"), "--scratch", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: --hostfile {tmp_path / 'macs.txt'}: no such file (one line per machine: NAME slots=1)"]


@pytest.mark.slow
def test_bench_allreduce_reports_each_preset_buffer():
    from jsonschema import validate
    from anectypes.model.config import PRESETS
    r = mpirun("--models", "tiny", "stories15m", "--reps", "2", "--json", program=("-m", "anectypes.bench", "allreduce"),
               timeout=300)
    assert r.returncode == 0, r.stderr
    doc, = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]     # rank 0's only
    validate(doc, json.loads((ROOT / "tools" / "bench_schema.json").read_text()))
    sizes = doc["benchmarks"]["allreduce"]["sizes"]
    assert [s["model"] for s in sizes] == ["tiny", "stories15m"] and doc["summary"]["ranks"] == 2
    for s in sizes:
        cfg = PRESETS[s["model"]]
        assert s["params"] == cfg.n_params() and s["mib"] == round(4 * cfg.n_params() / 2**20, 2)
        assert s["buckets"] == cfg.layers + 1
        assert s["algbw_gbps"] == pytest.approx(4 * cfg.n_params() / s["ms_median"] / 1e6)
        assert s["busbw_gbps"] == s["algbw_gbps"]                         # 2(n-1)/n = 1 for 2 ranks


def test_bench_allreduce_needs_mpirun():
    r = subprocess.run([sys.executable, "-m", "anectypes.bench", "allreduce"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "error: allreduce measures MPI ranks: run it under mpirun with 2 or more processes, e.g. mpirun -n 2 "
        "python -m anectypes.bench allreduce"]


def test_the_dashboard_starts_ranks_through_the_launcher(tmp_path):
    from pydantic import ValidationError
    from anectypes.runs import RunSpec, start_argv
    from anectypes.web.schemas import StartRun
    assert StartRun(ranks=2).ranks == 2
    with pytest.raises(ValidationError):
        StartRun(ranks=0)
    argv = start_argv(RunSpec(ranks=2).resolved(), tmp_path / "run")
    assert "--ranks=2" in argv and argv[1:3] == ["-m", "anectypes.train"]   # the trainer runs mpirun -n 2 itself


@pytest.mark.parametrize("platform", ["darwin", "linux"])
def test_on_macos_mpirun_runs_in_a_short_private_tmpdir_removed_after(monkeypatch, capsys, tmp_path, platform):
    """macOS's long $TMPDIR breaks Open MPI's start-up (open-mpi/ompi#13129): there --ranks's launcher gives mpirun
    a private folder in /tmp, where the ranks and Open MPI's session folder find it, and removes it after;
    elsewhere TMPDIR stays the user's. The platform is faked, mpirun is real."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(sys, "platform", platform)
    show = "import os; t = os.environ['TMPDIR']; print(t, oct(os.stat(t).st_mode & 0o777), *sorted(os.listdir(t)))"
    assert launch(mpirun_command(2), [sys.executable, "-c", show], None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].split()[:2] == lines[1].split()[:2]       # both ranks: one folder
    folder, mode, *inside = lines[0].split()
    assert any(name.startswith(("ompi.", "prterun.")) for name in inside)        # Open MPI's session is there
    if platform == "darwin":
        assert folder.startswith("/tmp/anectypes-mpi.") and len(folder) < 32 and mode == "0o700"
        assert not os.path.exists(folder)
    else:
        assert folder == str(tmp_path)
