"""The training command end to end: learning, bit-identical resume and restarts, bad inputs."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from anectypes.train import main
from support.training import FAST, losses, one_line_error

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("builtin_cache")    # one corpus cache for every run here (subprocesses too)


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "anectypes.train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_tiny_model_learns_on_the_builtin_corpus(tmp_path):
    run = tmp_path / "run"
    assert main(["--scratch", "--run-dir", str(run), "--steps", "800", "--accum", "1", *FAST]) == 0
    first, last = losses(run)[0], np.mean(losses(run)[-25:])
    assert last < 0.6 * first, (first, last)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 800
    val = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [r["step"] for r in val] == list(range(50, 801, 50))         # every save_every=50 updates
    assert status["best_val_loss"] == min(r["val_loss"] for r in val) < 0.6 * first
    assert (run / "checkpoints" / "latest.ckpt").is_file() and (run / "checkpoints" / "best.ckpt").is_file()
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[-2])
    for key in ("step", "loss", "lr", "grad_norm", "loss_scale", "ms_step", "tokens_per_s", "t_eval", "t_io",
                "t_cpu", "t_cls", "t_dw_wait"):
        assert key in rec


def test_rows_carry_wall_time_and_the_trainers_cpu_and_memory(tmp_path):
    """Every row its wall time; every log_every-th its process's CPU % and RSS (the dashboard's charts)."""
    t0 = time.time()
    assert main(["--scratch", "--run-dir", str(tmp_path), "--steps", "20", *FAST, "--log-every", "5"]) == 0
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 21))
    times = [r["t"] for r in rows]
    assert t0 < times[0] and times == sorted(times) and times[-1] <= time.time()
    usage = [r for r in rows if "cpu_pct" in r]
    assert [r["step"] for r in usage] == [5, 10, 15, 20] and all("rss_mb" in r for r in usage)
    assert all(r["cpu_pct"] > 0 and 10 < r["rss_mb"] < 100_000 for r in usage), usage


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
    common = ["--steps", "24", "--accum", "3", "--save-every", "2", *FAST]
    assert main(["--scratch", "--run-dir", str(tmp_path / "a"), *common]) == 0
    assert main(["--scratch", "--run-dir", str(tmp_path / "b"), "--stop-after", "12", *common]) == 0
    assert len(losses(tmp_path / "b")) == 12
    assert main(["--resume", "--run-dir", str(tmp_path / "b"), *common]) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


@pytest.mark.slow
def test_compile_budget_restart_continues_bit_identically(tmp_path):
    common = ["--steps", "8", "--accum", "2", "--save-every", "1", *FAST]
    assert main(["--scratch", "--run-dir", str(tmp_path / "a"), *common]) == 0
    # 10 kernels compile at start; with a budget of 19 the next rebuild would not fit: exec + resume
    r = cli("--scratch", "--run-dir", str(tmp_path / "b"), "--compile-budget", "19", *common)
    assert r.returncode == 0, r.stderr
    assert "restarting the process with --resume" in r.stderr
    assert (tmp_path / "b" / "train.log").read_text().count("resumed at step") >= 3
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_matches(tmp_path):
    common = ["--steps", "60", "--accum", "4", *FAST]
    assert main(["--scratch", "--run-dir", str(tmp_path / "a"), *common]) == 0
    run = tmp_path / "b"
    p = subprocess.Popen([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(run), *common],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(losses(run)) >= 6):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 130
    assert json.loads((run / "status.json").read_text())["state"] == "stopped"
    assert main(["--resume", "--run-dir", str(run), *common]) == 0
    assert losses(run) == losses(tmp_path / "a")


def test_stop_after_stops_at_the_end_of_the_update_that_holds_the_step(tmp_path):
    """Checkpoints are at update boundaries: --stop-after 5 with --accum 2 stops at step 6, as --help says."""
    assert main(["--scratch", "--run-dir", str(tmp_path), "--steps", "12", "--accum", "2", "--stop-after", "5",
                 *FAST]) == 0
    assert len(losses(tmp_path)) == 6 and json.loads((tmp_path / "status.json").read_text())["step"] == 6
    help_text = " ".join(cli("--help").stdout.split())
    assert "--stop-after STEP checkpoint and stop at the end of the update that holds this micro-step" in help_text


def test_chip_goes_with_backend_auto_when_it_is_the_simulator(tmp_path):
    """Here (no ANE) auto is the simulator: --chip applies; a training run warns of nothing on stderr (the
    disputed concat report is mil check's); with --backend ane, --chip is refused."""
    r = cli("--scratch", "--run-dir", str(tmp_path / "a"), "--chip", "m4", "--steps", "2", "--accum", "1",
            *[a for a in FAST if a not in ("--backend", "sim")])
    assert r.returncode == 0, r.stderr
    assert [line.split(" (")[0] for line in r.stderr.splitlines()] == ["backend auto: using the simulator"]
    one_line_error(cli("--scratch", "--run-dir", str(tmp_path / "b"), "--backend", "ane", "--chip", "m4"), "--chip")
    assert not (tmp_path / "b").exists()


def test_bad_inputs_fail_with_one_line(tmp_path):
    one_line_error(cli("--scratch", "--data", str(tmp_path / "missing.bin"), "--run-dir", str(tmp_path / "r")),
                   "missing.bin")
    one_line_error(cli("--scratch", "--steps", "-5"), "steps")
    one_line_error(cli("--steps", "5"), "--scratch")
    bad = tmp_path / "bad.bin"
    np.array([1, 2, 3, 60000] * 100, np.uint16).tofile(bad)
    one_line_error(cli("--scratch", "--data", str(bad), "--model", "tiny", "--run-dir", str(tmp_path / "r2")),
                   "60000")


def test_bad_checkpoints_are_refused_and_left_alone(tmp_path):
    run = tmp_path / "run"
    assert main(["--scratch", "--run-dir", str(run), "--steps", "4", "--accum", "2", *FAST]) == 0
    latest = run / "checkpoints" / "latest.ckpt"
    one_line_error(cli("--resume", "--run-dir", str(run), "--model", "stories15m"), "--model stories15m")
    one_line_error(cli("--scratch", "--run-dir", str(run)), "already holds a run")
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    truncated = latest.read_bytes()
    metrics = (run / "metrics.jsonl").read_text()
    one_line_error(cli("--resume", "--run-dir", str(run)), "latest.ckpt", "--resume --from best")
    assert latest.read_bytes() == truncated and (run / "metrics.jsonl").read_text() == metrics


def write_reference_v4(path, cfg, params):
    """The reference's v4 checkpoint (docs/ane-reference.md §4.8), packed by hand: header, then per layer the
    nine tensors and their zero Adam (m, v) pairs, then rms_final and embed with theirs."""
    import struct
    header = (struct.pack("<10i", 0x424C5A54, 4, 0, 100, cfg.layers, cfg.vocab, cfg.dim, cfg.hidden, cfg.heads,
                          cfg.seq) + struct.pack("<2f", 3e-4, 0.0) + struct.pack("<3d", 0, 0, 0)
              + struct.pack("<6i", 0, 0, 0, cfg.kv_heads, cfg.head_dim, cfg.q_dim))
    body = []
    names = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "rms_att", "rms_ffn")
    for i in range(cfg.layers):
        tensors = [params[f"layers.{i}.{n}"].astype("<f4") for n in names]
        body += [t.tobytes() for t in tensors]
        body += [np.zeros(t.size, "<f4").tobytes() for t in tensors for _ in (0, 1)]
    for name in ("rms_final", "embed"):
        body += [params[name].astype("<f4").tobytes()] + [np.zeros(params[name].size, "<f4").tobytes()] * 2
    path.write_bytes(header + b"".join(body))


def test_init_from_reference_checkpoint(tmp_path):
    from anectypes.formats.checkpoint import save_checkpoint
    from anectypes.model.config import PRESETS, init_params
    cfg = PRESETS["tiny"]
    common = ["--steps", "6", "--accum", "2", *FAST]
    init = init_params(cfg, np.random.default_rng(42))
    zero = {k: np.zeros_like(v) for k, v in init.items()}
    save_checkpoint(tmp_path / "init.ckpt", cfg, init, dict(t=0, m=zero, v=zero), {"step": 0})   # ours, as the base
    assert main(["--init-from", str(tmp_path / "init.ckpt"), "--run-dir", str(tmp_path / "a"), "--seed", "42",
                 *common]) == 0
    ref = tmp_path / "ref.bin"
    write_reference_v4(ref, cfg, init)                                         # the same init, as v4
    assert main(["--init-from", str(ref), "--run-dir", str(tmp_path / "b"), "--seed", "42", *common]) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


def test_an_empty_sample_says_so(tmp_path, monkeypatch, capsys):
    """A sample whose first token is BOS (the model ends its text at once) is printed as a note, not as a
    blank between the markers; samples.jsonl keeps the text as it is."""
    from anectypes.train import report
    monkeypatch.setattr(report, "generate", lambda *a, **k: "")
    assert main(["--scratch", "--run-dir", str(tmp_path / "run"), "--steps", "4", "--accum", "2", *FAST,
                 "--sample-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "--- sample at step 2 ---\n(empty: the model's first token ended the text)\n---" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == ["", ""]


def test_a_run_saved_before_the_architecture_fields_resumes_with_their_defaults(tmp_path):
    """Issue 35 added ModelConfig fields: a run folder and checkpoints from before them (config.json's
    model and meta.json's config without them) resume, and train on as the same model."""
    import zipfile
    from anectypes.model.config import ADDED_FIELDS
    run = tmp_path / "run"
    assert main(["--scratch", "--run-dir", str(run), "--steps", "4", "--accum", "2", *FAST]) == 0
    old = lambda config: {k: v for k, v in config.items() if k not in ADDED_FIELDS}  # noqa: E731
    doc = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**doc, "model": old(doc["model"])}))
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        with zipfile.ZipFile(ckpt) as zf:
            members = {n: zf.read(n) for n in zf.namelist()}
        meta = json.loads(members["meta.json"])
        members["meta.json"] = json.dumps({**meta, "config": old(meta["config"])}).encode()
        with zipfile.ZipFile(ckpt, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
    assert main(["--resume", "--run-dir", str(run), "--steps", "6"]) == 0
    assert len(losses(run)) == 6
