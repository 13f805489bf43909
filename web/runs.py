"""The dashboard's runs: the runs folder (files.py), the trainer processes (processes.py) and text
generation (generation.py) together, and the run list and run detail built from them.

A run is a folder under the runs folder (see anectypes.runs, which owns its files); everything is
recomputed from the files, so the list survives a dashboard restart.
"""

from __future__ import annotations

from anectypes.runs import METRIC_KEYS

from .errors import NotFound
from .files import RunFiles, finite, json_safe, last_value
from .generation import Generator
from .processes import Supervisor


class RunStore:
    def __init__(self, runs_dir, max_running=1, grace_s=10.0):
        self.files = RunFiles(runs_dir)
        self.processes = Supervisor(self.files, max_running, grace_s)
        self.generator = Generator()
        self.closing = False           # set when the server starts shutting down: event streams end

    def begin_shutdown(self):
        self.closing = True

    async def shutdown(self):
        await self.processes.shutdown()
        self.generator.close()

    def summary_row(self, run):
        status = self.processes.status(run)
        config = run.config()
        rows = self.files.metrics_cache(run).refresh()
        spec = config.get("spec") or {}
        model_name = config.get("model_name") or spec.get("model")
        steps = status.get("steps")
        if not isinstance(steps, int):
            steps = spec.get("steps")
        step = status.get("step")
        if not isinstance(step, int):
            step = rows[-1][0] if rows else None
        return {
            "id": run.id, "state": status["state"], "step": step, "steps": steps if isinstance(steps, int) else None,
            "model_name": model_name if isinstance(model_name, str) else None,
            "created": run.created(), "updated": run.updated(status),
            "last_loss": last_value(rows, "loss"), "best_val_loss": best_val_loss(status, rows),
            "pid": status.get("pid") if status.get("alive") else None, "error": status.get("error"),
        }

    def list_runs(self):
        rows = []
        for run in self.files.runs():
            try:
                rows.append(self.summary_row(run))
            except (NotFound, OSError):
                continue
        rows.sort(key=lambda r: (r["created"] or 0, r["id"]), reverse=True)
        return rows

    def detail(self, run):
        status = self.processes.status(run)
        rows = self.files.metrics_cache(run).refresh()
        recent = [r for r in rows[-20:] if r[1] is not None]

        def mean(key):
            vals = [r[1 + METRIC_KEYS.index(key)] for r in recent]
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else None

        steps_done = status.get("step")
        if not isinstance(steps_done, int):
            steps_done = rows[-1][0] if rows else 0
        summary = {"last_loss": last_value(rows, "loss"), "best_val_loss": best_val_loss(status, rows),
                   "steps_done": steps_done, "tokens_per_s": mean("tokens_per_s"), "ms_step": mean("ms_step")}
        return json_safe({"id": run.id, "state": status["state"], "status": status, "config": run.config(),
                          "summary": summary})


def best_val_loss(status, rows):
    """status.json's (live), else the lowest validation loss in the metrics."""
    if finite(status.get("best_val_loss")) is not None:
        return status["best_val_loss"]
    i = 1 + METRIC_KEYS.index("val_loss")
    return min((r[i] for r in rows if r[i] is not None), default=None)
