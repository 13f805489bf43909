"""--report-to: what a run's folder holds (its metrics rows, samples and config) also sent to Weights & Biases,
TensorBoard or MLflow, one adapter per library, called by rank 0's writer (report.py) where it writes the
folder. Each library is an optional extra (anectypes[wandb], anectypes[tensorboard], anectypes[mlflow]): one
that is missing stops the run before it starts (check). Once training, an adapter that fails says so in one
`warning:` line and is left out from then on: reporting never stops training.

A resumed run continues the same run in each library: W&B's run id is the run's own run_id, MLflow's is
kept in the run folder (reporting.json), TensorBoard's events are in the folder (tensorboard/) and those of
the steps after the checkpoint are purged as the run produces them again.
"""

import importlib.util
import json
import os
import re
import sys

from ..errors import AnectypesError
from ..runs import REPORTING, TENSORBOARD, reporters

MODULES = {"wandb": "wandb", "tensorboard": "tensorboardX", "mlflow": "mlflow"}   # name -> what its extra installs
PROJECT = "anectypes"          # the W&B project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_* say


def check(spec):
    """AnectypesError naming the extra of the first library of spec.report_to that is not installed."""
    for name in reporters(spec):
        if importlib.util.find_spec(MODULES[name]) is None:
            raise AnectypesError(f"--report-to {name} needs the {MODULES[name]} package: "
                                 f"pip install 'anectypes[{name}]'")


def warn(name, e):
    why = next(iter(str(e).strip().splitlines()), "") or type(e).__name__
    print(f"warning: --report-to {name}: {why}; training goes on without it", file=sys.stderr, flush=True)


def run_id(value, where):
    """An id read from the run folder (data: it becomes a path in the library's store), if it is only
    letters, digits, _ and -; ValueError otherwise."""
    if not (isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value)):
        raise ValueError(f"{where}: {value!r} is not a run id")
    return value


def values(rec):
    """A metrics row's values by name: all but its step and its time t (each library's time of the point)."""
    return {k: v for k, v in rec.items() if k not in ("step", "t") and v is not None}


class Reporters:
    """The adapters of a run's --report-to, started for the run in rd (config document doc) at `step`; each
    call goes to every adapter that has not failed."""

    def __init__(self, rd, spec, doc, step):
        self.adapters = []
        for name in reporters(spec):
            try:
                self.adapters.append(ADAPTERS[name](rd, doc, step))
            except Exception as e:      # the library's own, whatever it is: training goes on
                warn(name, e)

    def call(self, method, *args):
        for adapter in list(self.adapters):
            try:
                getattr(adapter, method)(*args)
            except Exception as e:
                self.adapters.remove(adapter)
                warn(adapter.name, e)

    def row(self, rec):
        self.call("row", rec)

    def sample(self, step, text):
        self.call("sample", step, text)

    def close(self, ok=True):
        self.call("close", ok)
        self.adapters = []


class WandB:
    """A W&B run whose id is the run's: "step" is the x of every chart (define_metric), so that rows may
    arrive in any order (several ranks' samples come before their window's rows); a row's time is when
    it is logged, as it is written."""
    name = "wandb"

    def __init__(self, rd, doc, step):
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=rd.path.name, resume="allow",
                              id=run_id(doc.get("run_id"), "config.json's run_id"), config=doc,
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.define_metric("*", step_metric="step")

    def row(self, rec):
        self.run.log({"step": rec["step"], **values(rec)})

    def sample(self, step, text):
        self.run.log({"step": step, "sample": self.wandb.Table(columns=["step", "text"], data=[[step, text]])})

    def close(self, ok):
        self.run.finish(exit_code=0 if ok else 1)


class TensorBoard:
    """Event files in the run folder's tensorboard/ (`tensorboard --logdir runs` shows every run): a scalar per
    metric, the samples and the config as text."""
    name = "tensorboard"

    def __init__(self, rd, doc, step):
        from tensorboardX import SummaryWriter
        # purge_step: TensorBoard drops the events of the steps a resumed run produces again
        self.writer = SummaryWriter(str(rd / TENSORBOARD), purge_step=step + 1, flush_secs=10)
        self.writer.add_text("config", f"```json\n{json.dumps(doc, indent=1)}\n```", step)

    def row(self, rec):
        for k, v in values(rec).items():
            self.writer.add_scalar(k, v, rec["step"], walltime=rec.get("t"))

    def sample(self, step, text):
        self.writer.add_text("sample", text, step)

    def close(self, ok):
        self.writer.close()


class MLflow:
    """An MLflow run (MLFLOW_TRACKING_URI's, else MLflow's default store) whose id the run folder keeps in
    reporting.json: the config as parameters (when it is created) and as config.json, each sample a text file."""
    name = "mlflow"

    def __init__(self, rd, doc, step):
        import mlflow
        self.mlflow = mlflow
        if not (os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID")):
            mlflow.set_experiment(PROJECT)
        kept = (rd.read_json(REPORTING) or {}).get("mlflow")
        if isinstance(kept, dict):
            self.run = mlflow.start_run(run_id=run_id(kept.get("run_id"), f"{REPORTING}'s MLflow run_id"))
        else:
            self.run = mlflow.start_run(run_name=rd.path.name)
            rd.write_json(REPORTING, {**(rd.read_json(REPORTING) or {}), "mlflow": {"run_id": self.run.info.run_id}})
            mlflow.log_params(dict(flat(doc)))     # parameters cannot change later: the run's as it starts
        mlflow.log_dict(doc, "config.json")

    def row(self, rec):
        t = rec.get("t")
        self.mlflow.log_metrics(values(rec), step=rec["step"], timestamp=round(t * 1000) if t else None)

    def sample(self, step, text):
        self.mlflow.log_text(text, f"samples/step-{step:09d}.txt")

    def close(self, ok):
        self.mlflow.end_run("FINISHED" if ok else "FAILED")


def flat(doc, prefix=""):
    """(dotted name, value) of every leaf of a JSON object."""
    for k, v in doc.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


ADAPTERS = {"wandb": WandB, "tensorboard": TensorBoard, "mlflow": MLflow}
