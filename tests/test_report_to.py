"""train --report-to wandb,tensorboard,mlflow (anectypes/train/report_to.py): what the run folder holds (every
metrics row, the samples, the config) read back through each library's own reader, offline: W&B's offline run
file through `wandb leet inspect --json`, TensorBoard's event files through its EventAccumulator, MLflow's local
file store through MlflowClient. Offline by each library's own switch (W&B's offline mode, MLflow's file
store, TensorBoard's event files): nothing here reaches the network."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.training import FAST

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("builtin_cache")


def offline(tmp):
    """The environment of a trainer reporting offline into tmp: W&B's offline mode, MLflow's file store."""
    return dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp), MLFLOW_TRACKING_URI=f"file:{tmp / 'mlruns'}",
                MLFLOW_ALLOW_FILE_STORE="true")


def train(tmp, *args, program=("-m", "anectypes.train")):
    """The trainer (a command line), reporting offline into tmp."""
    return subprocess.run([sys.executable, *program, *args], cwd=tmp, env=offline(tmp), capture_output=True,
                          text=True, timeout=600)


def ok(r):
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning:" not in r.stderr, r.stderr
    return r


def rows(run, name="metrics.jsonl"):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def points(run):
    """{(metric, step): value} of metrics.jsonl, each row's time t apart (each library's time of the point)."""
    return {(k, r["step"]): v for r in rows(run) for k, v in r.items() if k not in ("step", "t") and v is not None}


def config(run):
    return json.loads((run / "config.json").read_text())


# --- each library's own reader

def wandb_runs(tmp):
    """Each offline W&B run under tmp, as [(its folder, its records)]: wandb's reader of the .wandb file."""
    out = []
    for f in sorted((tmp / "wandb").glob("offline-run-*/run-*.wandb")):
        r = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out.append((f.parent, [json.loads(line) for line in r.stdout.splitlines()]))
    return out


def wandb_read(tmp):
    """(run ids, {(metric, step): value}, {step: sample text}, config of the first run) of W&B's offline runs."""
    ids, got, samples, conf = [], {}, {}, None
    for folder, records in wandb_runs(tmp):
        run = next(r["run"] for r in records if r["type"] == "run")
        ids.append(run["run_id"])
        conf = conf or {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        for item in (r["history"]["item"] for r in records if r["type"] == "history"):
            if "sample.path" in item:
                table = json.loads((folder / "files" / item["sample.path"]).read_text())
                assert table["columns"] == ["step", "text"]
                samples.update({s: text for s, text in table["data"]})
            logged = {(k, item["step"]): v for k, v in item.items() if not k.startswith(("_", "sample", "step"))}
            assert not logged.keys() & got.keys(), "a step logged twice"
            got.update(logged)
    return ids, got, samples, conf


def tensorboard_read(folder):
    """({(metric, step): value}, {step: sample}, the latest config) of the event files in folder: TensorBoard's
    reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    events = [(tag, e) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    got = {(tag, e.step): e.value for tag, e in events}
    assert len(got) == len(events), "a step logged twice"
    texts = {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors(tag)}
             for tag in acc.Tags()["tensors"]}
    configs = texts["config/text_summary"]                        # one per start of a process
    conf = configs[max(configs)].removeprefix("```json\n").removesuffix("\n```")
    return got, texts.get("sample/text_summary", {}), json.loads(conf)


def mlflow_read(tmp, run_id, keys, dst):
    """({(metric, step): value}, {(metric, step): timestamp}, {step: sample}, params, config.json, runs in all) of
    the MLflow run run_id in tmp's file store: MLflow's client."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    history = [(k, m) for k in keys for m in client.get_metric_history(run_id, k)]
    got = {(k, m.step): m.value for k, m in history}
    assert len(got) == len(history), "a step logged twice"
    samples = {int(Path(a.path).stem.removeprefix("step-")):
               Path(client.download_artifacts(run_id, a.path, str(dst))).read_text()
               for a in client.list_artifacts(run_id, "samples")}
    run = client.get_run(run_id)
    conf = json.loads(Path(client.download_artifacts(run_id, "config.json", str(dst))).read_text())
    n = len(client.search_runs([run.info.experiment_id]))
    return (got, {(k, m.step): m.timestamp for k, m in history},
            samples, run.data.params, conf, n)


def flat(doc, prefix=""):
    return {k2: v2 for k, v in doc.items()
            for k2, v2 in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])}


@pytest.mark.slow
def test_a_stopped_and_resumed_run_reaches_each_library_whole(tmp_path, monkeypatch):
    """Every metrics row (step and value), every sample and the config, through each reader; the resumed
    run continues the same W&B and MLflow run."""
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--steps", "8", "--accum", "2", "--save-every", "1", *FAST, "--sample-every", "3"]
    ok(train(tmp_path, "--scratch", *args, "--stop-after", "4", "--report-to", "wandb,tensorboard,mlflow"))
    mlflow_id = json.loads((run / "reporting.json").read_text())["mlflow"]["run_id"]
    ok(train(tmp_path, "--resume", *args))                       # the run's own spec: it reports as it did
    assert json.loads((run / "reporting.json").read_text())["mlflow"]["run_id"] == mlflow_id
    want, samples, doc = points(run), {r["step"]: r["text"] for r in rows(run, "samples.jsonl")}, config(run)
    assert {s for _, s in want} == set(range(1, 9)) and ("val_loss", 4) in want and set(samples) == {3, 6}
    assert doc["spec"]["report_to"] == "wandb,tensorboard,mlflow"

    ids, got, got_samples, conf = wandb_read(tmp_path)
    assert ids == [doc["run_id"]] * 2                            # two processes, one W&B run
    assert got == want and got_samples == samples and conf == doc

    got, got_samples, conf = tensorboard_read(run / "tensorboard")
    assert got == {k: float(np.float32(v)) for k, v in want.items()}     # TensorBoard's scalars are float32
    assert got_samples == samples and conf == doc

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    got, stamps, got_samples, params, conf, n = mlflow_read(tmp_path, mlflow_id, {k for k, _ in want}, tmp_path / "dl")
    assert got == want and got_samples == samples and conf == doc and n == 1
    assert params == {k: str(v) for k, v in flat(doc).items()}
    assert all(stamps[k, r["step"]] == round(r["t"] * 1000) for r in rows(run) if "t" in r for k in r
               if k not in ("step", "t") and r[k] is not None)


# the trainer, stopped as by Ctrl-C right after the metrics row of step argv[1]
STOP_AFTER_ROW = """
import os, signal, sys
from anectypes.train import main
from anectypes.train.report import RunWriter
row = RunWriter.row
def stopping(self, rec):
    row(self, rec)
    if rec["step"] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGINT)
RunWriter.row = stopping
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_tensorboard_keeps_the_steps_a_resume_trains_again_once(tmp_path):
    """Stopped after step 6, inside the window of steps 5-8, the run keeps its checkpoint at step 4 and drops
    the rows of 5 and 6, which TensorBoard has: the resumed run's rows of 5 and 6 replace them there."""
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--steps", "8", "--accum", "4", "--save-every", "1", *FAST]
    r = train(tmp_path, "6", "--scratch", *args, "--report-to", "tensorboard", program=("-c", STOP_AFTER_ROW))
    assert r.returncode == 130, r.stderr
    assert {k for k in tensorboard_read(run / "tensorboard")[0] if k[0] == "loss"} == {("loss", s) for s in range(1, 7)}
    assert max(r["step"] for r in rows(run)) == 4
    ok(train(tmp_path, "--resume", *args))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("ms_step")] == list(range(1, 9))       # each step once
    assert tensorboard_read(run / "tensorboard")[0] == {k: float(np.float32(v)) for k, v in points(run).items()}


@pytest.mark.parametrize("lib, module", [("wandb", "wandb"), ("tensorboard", "tensorboardX"), ("mlflow", "mlflow")])
def test_a_missing_library_is_named_with_its_extra_before_anything_is_made(tmp_path, lib, module):
    """Without the library: one error line naming the extra, exit 1, no run folder."""
    program = ("-c", f"import sys; sys.modules[{module!r}] = None; from anectypes.train import main; "
                     "sys.exit(main(sys.argv[1:]))")                # as if it were not installed
    r = train(tmp_path, "--scratch", "--run-dir", "run", *FAST, "--report-to", "wandb,tensorboard,mlflow",
              program=program)
    assert r.returncode == 1
    assert r.stderr == f"error: --report-to {lib} needs the {module} package: pip install 'anectypes[{lib}]'\n"
    assert not (tmp_path / "run").exists() and r.stdout == ""


@pytest.mark.slow
def test_a_library_that_fails_is_one_warning_and_training_goes_on(tmp_path):
    """TensorBoard cannot make its folder (a file holds its name) and the MLflow run id the folder holds is a
    path out of MLflow's store (data, never used as a path): one warning line each; the run trains to its end,
    W&B gets every row."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("not a folder")
    (run / "reporting.json").write_text(json.dumps({"mlflow": {"run_id": "../../escaped"}}))
    r = train(tmp_path, "--scratch", "--run-dir", str(run), "--steps", "4", "--accum", "2", *FAST,
              "--report-to", "tensorboard,mlflow,wandb")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert [w.split(":")[1] for w in warnings] == [" --report-to tensorboard", " --report-to mlflow"], r.stderr
    assert all(w.endswith("; training goes on without it") for w in warnings)
    assert "reporting.json's MLflow run_id: '../../escaped' is not a run id" in warnings[1]
    assert not list(tmp_path.rglob("escaped"))
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert {s for _, s in points(run)} == {1, 2, 3, 4}
    assert wandb_read(tmp_path)[1] == points(run)


@pytest.mark.slow
def test_on_two_ranks_rank_0_alone_reports(tmp_path, monkeypatch):
    """--ranks 2: one MLflow run, one W&B run, one TensorBoard event file, each with every row of the run."""
    run = tmp_path / "run"
    ok(train(tmp_path, "--ranks", "2", "--scratch", "--run-dir", str(run), "--steps", "8", "--accum", "1",
             "--save-every", "2", *FAST, "--report-to", "wandb,tensorboard,mlflow"))
    want = points(run)
    assert {r.get("rank") for r in rows(run) if "loss" in r} == {0, 1}
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert tensorboard_read(run / "tensorboard")[0] == {k: float(np.float32(v)) for k, v in want.items()}
    ids, got, _, _ = wandb_read(tmp_path)
    assert len(ids) == 1 and got == want
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow_id = json.loads((run / "reporting.json").read_text())["mlflow"]["run_id"]
    got, *_, n = mlflow_read(tmp_path, mlflow_id, {k for k, _ in want}, tmp_path / "dl")
    assert got == want and n == 1


@pytest.mark.slow
def test_a_run_the_dashboard_starts_reports_and_a_missing_library_is_a_422(tmp_path, monkeypatch):
    """report_to in the dashboard's start request reaches the trainer; a library missing where the
    dashboard runs (blocked by a sitecustomize) is refused with a 422 naming the field and the extra."""
    from support.dashboard_server import Dashboard
    from test_dashboard_api import wait_terminal
    body = dict(model="tiny", steps=6, accum=2, save_every=1, sample_every=3, log_every=1000, backend="sim",
                report_to="tensorboard,mlflow,wandb")
    env = {k: v for k, v in offline(tmp_path).items() if k.startswith(("WANDB", "MLFLOW"))}
    dash = Dashboard(tmp_path / "runs", tmp_path / "dashboard.log", env=env).start()
    try:
        c = dash.client()
        r = c.post("/api/runs", json=body)
        assert r.status_code == 201, r.text
        run = tmp_path / "runs" / r.json()["id"]
        d = wait_terminal(c, r.json()["id"], timeout=300)
        assert d["state"] == "finished", (run / "stdout.log").read_text()
    finally:
        dash.stop()
    assert "warning:" not in (run / "stdout.log").read_text()
    want = points(run)
    assert tensorboard_read(run / "tensorboard")[0] == {k: float(np.float32(v)) for k, v in want.items()}
    assert wandb_read(tmp_path)[1] == want
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow_id = json.loads((run / "reporting.json").read_text())["mlflow"]["run_id"]
    assert mlflow_read(tmp_path, mlflow_id, {k for k, _ in want}, tmp_path / "dl")[0] == want

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    dash = Dashboard(tmp_path / "runs2", tmp_path / "dashboard2.log",
                     env={"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])})
    dash.start()
    try:
        r = dash.client().post("/api/runs", json=dict(body, report_to="wandb,mlflow"))
    finally:
        dash.stop()
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == [{"loc": ["body", "report_to"], "type": "value_error", "msg":
                                   "--report-to mlflow needs the mlflow package: pip install 'anectypes[mlflow]'"}]
    assert not any((tmp_path / "runs2").iterdir())
