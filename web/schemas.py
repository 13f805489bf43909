"""The API's request and response models, and the error responses it documents (JSON {"detail": ...}).

StartRun and Metrics are generated from the run spec and METRIC_KEYS (anectypes.runs), so a new spec
field or metric needs no change here.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from anectypes.model.config import PRESETS, ModelConfig
from anectypes.runs import METRIC_KEYS, RunSpec

from .security import MAX_BODY

class Health(BaseModel):
    status: Literal["ok"]
    version: str


class Presets(BaseModel):
    presets: dict[str, ModelConfig]          # the model config dataclass itself: one field list
    backends: list[str]
    precisions: list[str]
    defaults: dict[str, Any] = Field(description="every run-spec field's default (null: the preset's schedule)")
    schedules: dict[str, dict[str, float]] = Field(description="each preset's steps, lr, accum and warmup")
    metric_keys: list[str] = Field(description="the metrics a run records per step")
    data_dir: str = Field(description="the folder (--data-dir) that a run's data and tokenizer files must be in")


Tag = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[^,\s]+$")]


class RunMetaIn(BaseModel):
    """What to change of what the user says of a run (meta.json); a field left out (or null) keeps its value."""
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Optional[str] = Field(None, max_length=100)
    tags: Optional[list[Tag]] = Field(None, max_length=20, description="words without spaces or commas")
    notes: Optional[str] = Field(None, max_length=5000)
    archived: Optional[bool] = Field(None, description="archived runs are left out of the default run list")


class RunMeta(BaseModel):
    name: str = ""
    tags: list[str] = []
    notes: str = ""
    archived: bool = False


class RunRow(BaseModel):
    id: str
    state: str
    step: Optional[int] = None
    steps: Optional[int] = None
    model_name: Optional[str] = None
    created: Optional[float] = Field(None, description="Unix seconds")
    updated: Optional[float] = Field(None, description="Unix seconds")
    last_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    pid: Optional[int] = Field(None, description="the trainer's pid while it runs")
    error: Optional[str] = Field(None, description="why a failed run failed (last log lines)")
    duration: Optional[float] = Field(None, description="seconds from its start to its last update")
    position: Optional[int] = Field(None, description="a queued run's place in the queue (1: next)")
    meta: RunMeta = RunMeta()
    spec: dict[str, Union[bool, int, float, str]] = Field({}, description="the run spec's values (lr, model, accum, "
                                                          "seed, ...): the list's config columns")


class RunList(BaseModel):
    runs: list[RunRow]


# what the dashboard accepts beyond the run spec's own bounds (Supervisor.admit)
IN_DATA_DIR = ("; a file in the dashboard's data folder (--data-dir, GET /api/presets' data_dir; a relative path is "
               "taken from there)")
ADMITTED = {"data": IN_DATA_DIR, "tokenizer": IN_DATA_DIR, "ranks": "; at most the CPUs of the dashboard's machine"}


def _start_field(f):
    """A StartRun field from a RunSpec field: its type, bounds and help; omitted means the spec's default."""
    md = f.metadata
    kind = Literal[tuple(PRESETS)] if f.name == "model" else (  # type: ignore[valid-type]
        Literal[md["choices"]] if "choices" in md else {"int": int, "float": float, "bool": bool}.get(md["kind"], str))
    bounds = {k: md[k] for k in ("ge", "gt", "le") if k in md}
    if kind is float:
        bounds["allow_inf_nan"] = False
    if md["kind"] == "path":
        bounds["max_length"] = 4096
    if "names" in md:           # names[-1] alone, or a comma-separated list of the others (RunSpec refuses repeats)
        listed = "|".join(md["names"][:-1])
        bounds["pattern"] = f"^({md['names'][-1]}|({listed})(,({listed}))*)$"
    help = md["help"] + ADMITTED.get(f.name, "")
    return Optional[kind], Field(None, description=help, **bounds)


# a new run: the run spec's fields (init_from only as a run of this dashboard), each optional: omitted (or null)
# takes the spec's default
StartRun = create_model(
    "StartRun", __config__=ConfigDict(extra="forbid", strict=True),
    __doc__="A new training run; omitted fields take the run spec's defaults (GET /api/presets), the schedule "
    "the preset's.",
    init_from_run=(Optional[str], Field(None, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                                        description="fine-tune: start from this run's weights (its checkpoint; "
                                        "the model is the run's), with a fresh optimizer")),
    init_from_folder=(Optional[str], Field(None, max_length=1000,
                                           description="fine-tune a Hugging Face model: a folder in the data folder "
                                           "(the dashboard's --data-dir) with its config.json and safetensors; "
                                           "with lora, its adapters only")),
    **{f.name: _start_field(f) for f in dataclass_fields(RunSpec) if f.name != "init_from"})


SWEEP_FIELDS = ("lr", "seed", "accum", "warmup")


class SweepIn(StartRun):
    """A grid of runs: the run-spec fields as for one run, and several values for some of lr, seed, accum
    and warmup; every combination is started (or queued) with the tag sweep-<id>."""
    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "tiny", "steps": 100,
                                                               "grid": {"lr": [0.003, 0.001], "seed": [1, 2]}}]})

    grid: dict[Literal[SWEEP_FIELDS], Annotated[list[Union[int, float]], Field(min_length=1, max_length=8)]] = Field(
        min_length=1, description="field -> its values (at most 64 runs in all)")


class SweepOut(BaseModel):
    sweep: str = Field(description="the sweep's id; its runs carry the tag sweep-<id>")
    ids: list[str]


class RunId(BaseModel):
    id: str


class Summary(BaseModel):
    last_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    steps_done: int = 0
    tokens_per_s: Optional[float] = None
    ms_step: Optional[float] = None


class RunDetail(BaseModel):
    id: str
    state: str
    meta: RunMeta
    status: dict[str, Any]
    config: dict[str, Any]
    summary: Summary


class StateOut(BaseModel):
    state: str


# columnar metrics (null where absent), down-sampled keeping every bucket's extremes and the last point
Metrics = create_model("Metrics", __doc__="Columnar metrics (null where absent; val_loss only at validation "
                       "steps), down-sampled to max_points rows: the rows split into buckets of consecutive "
                       "steps, each keeping its first and last row and the rows of every metric's minimum and "
                       "maximum (so no spike is lost), the last point always kept.", step=(list[int], ...),
                       **{k: (list[Optional[float]], ...) for k in METRIC_KEYS})


class Lines(BaseModel):
    lines: list[str]


class Sample(BaseModel):
    step: int
    text: str


class Samples(BaseModel):
    samples: list[Sample]


class GenerateIn(BaseModel):
    model_config = ConfigDict(strict=True)           # JSON types as declared: true is not a temperature

    prompt: str = Field("", max_length=1000)
    temperature: float = Field(0.8, ge=0, le=2, allow_inf_nan=False)
    top_k: int = Field(50, ge=0, le=1000, description="0: no top-k cut")
    top_p: float = Field(0.9, ge=0, le=1, allow_inf_nan=False, description="nucleus sampling; 1: off")
    max_tokens: int = Field(64, ge=1, le=256)
    seed: Optional[int] = Field(None, ge=0, le=2**32 - 1, description="default: random")
    checkpoint: Literal["latest", "best"] = Field("latest", description="the run's checkpoint to generate from")


class ExportIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: Literal["llama2c", "hf", "gguf"] = Field(description="llama2c: a zip of model.bin and tokenizer.bin "
                                                     "for run.c; hf: a zip of a transformers folder; gguf: one file")
    dtype: Literal["f32", "f16"] = Field("f32", description="the weights' type (llama2c: f32 only)")
    checkpoint: Optional[Literal["best", "latest"]] = Field(None, description="default: best, else latest")


class GenerateOut(BaseModel):
    text: str
    step: int


class CheckpointInfo(BaseModel):
    name: str
    bytes: int
    sha256: str
    modified: float = Field(description="Unix seconds")
    step: Optional[int] = Field(description="the training step it holds; null where its meta.json is unreadable")
    best_val_loss: Optional[float] = Field(description="the best validation loss when it was written (best.ckpt's "
                                                       "own); null before any validation")


class Checkpoints(BaseModel):
    checkpoints: list[CheckpointInfo]


class System(BaseModel):
    pid: Optional[int] = None
    alive: bool
    cpu_percent: Optional[float] = None
    rss_mb: Optional[float] = None


# --- error responses ---------------------------------------------------------------------------------

ERRORS = {400: "a body that is not UTF-8 JSON, or a malformed Content-Length",
          401: "missing or wrong token", 403: "a foreign Host header, or a cross-site Origin on a POST",
          404: "no such run", 413: f"a body over {MAX_BODY} bytes", 415: "a body that is not application/json",
          429: "too many generation requests waiting"}
POSTED = (400, 413, 415)                            # what SecurityMiddleware answers to any POST


ERROR_BODY = {"application/json": {"schema": {"title": "Error", "type": "object", "required": ["detail"],
                                               "properties": {"detail": {"type": "string"}}}}}


def errors(*codes):
    """OpenAPI responses for error statuses, JSON {"detail": ...} bodies (also on routes of other media
    types, so no `model`): a code, or (code, description)."""
    pairs = [c if isinstance(c, tuple) else (c, ERRORS[c]) for c in codes]
    return {code: {"description": text, "content": ERROR_BODY} for code, text in pairs}

