"""The dashboard's run store (RunStore): the runs folder (files.py), the trainer processes (processes.py)
and text generation (generation.py) together, and the run list and run detail built from them.

A run is a folder under the runs folder (see anectypes.runs, which owns its files); everything is
recomputed from the files, so the list survives a dashboard restart.
"""

from __future__ import annotations

import secrets
import shutil

from pydantic import ValidationError

from anectypes.runs import META, METRIC_KEYS, RunDir, RunError, finite

from .api_errors import Conflict, NotFound
from .files import RunFiles, json_safe
from .generation import Generator
from .metrics import last_value
from .processes import Supervisor
from .schemas import RunMeta


class RunStore:
    def __init__(self, runs_dir, data_dir="data", max_running=1, grace_s=10.0):
        self.files = RunFiles(runs_dir)
        self.processes = Supervisor(self.files, data_dir, max_running, grace_s)
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
        best = self.best_val_loss(run, status)             # first: a whole read it needs leaves the cache filled
        rows = self.files.recent_metrics(run)
        spec = config.get("spec") or {}
        model_name = config.get("model_name") or spec.get("model")
        steps = status.get("steps")
        if not isinstance(steps, int):
            steps = spec.get("steps")
        step = status.get("step")
        if not isinstance(step, int):
            step = rows[-1][0] if rows else None
        created, updated = run.created(), run.updated(status)
        return json_safe({
            "id": run.id, "state": status["state"], "step": step, "steps": steps if isinstance(steps, int) else None,
            "model_name": model_name if isinstance(model_name, str) else None,
            "created": created, "updated": updated,
            "last_loss": last_value(rows, "loss"), "best_val_loss": best,
            "pid": status.get("pid") if status.get("alive") else None, "error": status.get("error"),
            "duration": max(0.0, updated - created) if updated and created and status["state"] != "cancelled" else None,
            "meta": read_meta(run),
            "position": status.get("position"),
            # the run spec's plain values, for the list's config columns (a folder's config is data: nothing nested)
            "spec": {k: v for k, v in spec.items() if isinstance(k, str) and isinstance(v, (str, int, float, bool))}
                    if isinstance(spec, dict) else {},
        })

    def best_val_loss(self, run, status):
        """status.json's (live), else the lowest validation loss in the metrics (then read whole)."""
        if finite(status.get("best_val_loss")) is not None:
            return status["best_val_loss"]
        i = 1 + METRIC_KEYS.index("val_loss")
        return min((r[i] for r in self.files.metrics_cache(run).refresh() if r[i] is not None), default=None)

    def list_runs(self, archived=False):
        """The runs, newest first; the archived ones only with `archived`."""
        rows = []
        for run in self.files.runs():
            try:
                row = self.summary_row(run)
            except (NotFound, OSError):
                continue
            if archived or not row["meta"]["archived"]:
                rows.append(row)
        rows.sort(key=lambda r: (r["created"] or 0, r["id"]), reverse=True)
        return rows

    def sweep(self, specs, labels):
        """Start (or queue) the runs of a sweep, each named by its label and tagged sweep-<id>."""
        sweep_id = secrets.token_hex(3)
        ids = [self.processes.start(spec) for spec in specs]
        for run_id, label in zip(ids, labels):
            self.set_meta(self.files.run(run_id), {"name": label, "tags": [f"sweep-{sweep_id}"]})
        return {"sweep": sweep_id, "ids": ids}

    # -- the changes to a run: each under the run's lock (files.locked), so that none acts on a run that
    # a DELETE took away meanwhile (they answer 404)
    def set_meta(self, run, change):
        """meta.json with the fields of `change` replaced; the whole of it."""
        with self.files.locked(run.id) as run:
            meta = {**read_meta(run), **change}
            run.rd.write_json(META, meta, sync=False)
        return meta

    def delete(self, run):
        """Remove the run's folder; refused while its trainer runs."""
        with self.files.locked(run.id) as run, self.processes.lock:
            if self.processes.status(run)["alive"]:
                raise Conflict("the run is running; stop it before deleting it")
            try:
                hold = RunDir(run.dir).claim()          # a trainer holds its folder's lock from its first read
            except RunError:
                raise Conflict("the run is being trained; stop it before deleting it") from None
            try:
                if run.id in self.processes.queue:
                    self.processes.queue.remove(run.id)
                trash = self.files.trash(run)
            finally:
                hold.unlock()
        shutil.rmtree(trash, ignore_errors=True)

    def stop(self, run):
        with self.files.locked(run.id) as run:
            self.processes.stop(run)

    def resume(self, run):
        with self.files.locked(run.id) as run:
            return self.processes.resume(run)

    def detail(self, run):
        status = self.processes.status(run)
        best = self.best_val_loss(run, status)             # (as in summary_row)
        rows = self.files.recent_metrics(run)
        recent = [r for r in rows[-20:] if r[1] is not None]

        def mean(key):
            vals = [r[1 + METRIC_KEYS.index(key)] for r in recent]
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else None

        steps_done = status.get("step")
        if not isinstance(steps_done, int):
            steps_done = rows[-1][0] if rows else 0
        summary = {"last_loss": last_value(rows, "loss"), "best_val_loss": best,
                   "steps_done": steps_done, "tokens_per_s": mean("tokens_per_s"), "ms_step": mean("ms_step")}
        return json_safe({"id": run.id, "state": status["state"], "status": status, "config": run.config(),
                          "summary": summary, "meta": read_meta(run)})


def read_meta(run):
    """meta.json's fields (defaults for what is missing; all defaults when the file is malformed)."""
    try:
        return json_safe(RunMeta.model_validate(run.rd.read_json(META) or {}).model_dump())
    except ValidationError:
        return RunMeta().model_dump()

