"""Checkpoints: our own resumable format (the reference's v4/v2 files: formats/reference.py).

Our format (version 1) is one uncompressed zip file, laid out like numpy's `.npz`:

    meta.json              UTF-8 JSON: {"format": "anectypes-checkpoint", "version": 1,
                           "config": ModelConfig fields, "adam_t": int, "state": {...},
                           ["lora": {"rank", "alpha", "targets"}]}
    param/<name>.npy       every parameter, float32, shape from `param_shapes(config)`
    adam_m/<name>.npy      AdamW first moment of every trained parameter, same names and shapes
    adam_v/<name>.npy      AdamW second moment

`<name>` is `layers.{i}.wq|wk|wv|wo|w1|w2|w3|rms_att|rms_ffn`, `rms_final` or `embed`; matrices are
[out, in] row-major. A LoRA run's checkpoint (meta.json's "lora", docs/lora.md) holds the frozen model and
the adapters `layers.{i}.<weight>.lora_a|lora_b` as params, and AdamW's moments of the adapters alone. `state` is free-form JSON written by the trainer (step, best loss, sampler RNG,
loss scaler, schedule, ...); it round-trips exactly (big ints, float reprs, NaN/inf), except that
tuples come back as lists and dict keys must be strings. `np.load(path)["param/embed"]` and
`unzip -p path meta.json` both work on it.

The file is written through `data.atomic_write` (temp file beside it, fsync, os.replace), so a crash
never leaves a half-written checkpoint and never destroys the previous one. Loading never unpickles,
and every problem raises one `CheckpointError` line saying what is wrong and what to do.
"""

import json
import math
import os
import zipfile
import zlib
from dataclasses import MISSING, dataclass, fields

import numpy as np

from ..host.files import atomic_write
from ..errors import AnectypesError, CheckpointError
from ..model.config import ADDED_FIELDS, ModelConfig, param_shapes
from ..model.lora import Lora, adapter_shapes, check_rank, parse_targets

FORMAT = "anectypes-checkpoint"
VERSION = 1
GROUPS = ("param", "adam_m", "adam_v")


@dataclass
class Checkpoint:
    config: dict      # ModelConfig fields
    params: dict      # name -> float32 array
    optimizer: dict   # {"t", "m", "v"}, the shape of AdamW.state_dict()
    state: dict       # the trainer's free-form JSON state
    lora: Lora = None  # a LoRA run's: its params hold the adapters, its optimizer theirs alone


def model_config(config, where):
    """ModelConfig from a dict (or a ModelConfig), validated; problems become CheckpointError."""
    if isinstance(config, ModelConfig):
        config = config.to_dict()
    try:
        return ModelConfig(**config).validate()
    except TypeError as e:
        raise CheckpointError(f"{where}: bad model config ({e})") from None
    except AnectypesError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _unlike(key, dtype, shape, need):
    return f"{key} is {dtype} {list(shape)} but the model config needs float32 {list(need)}"


def _shapes(cfg, lora):
    """{group: {name: shape}} of a checkpoint: every parameter (with LoRA also the adapters) and the moments of
    the trained ones."""
    base, adapters = param_shapes(cfg), adapter_shapes(cfg, lora) if lora else {}
    trained = adapters if lora else base
    return {"param": {**base, **adapters}, "adam_m": trained, "adam_v": trained}


def _tensor_problem(cfg, groups, lora=None):
    """The first thing wrong with {group: {name: array}} for this config, or None."""
    every = _shapes(cfg, lora)
    for group, tensors in groups.items():
        shapes = every[group]
        extra = sorted(set(tensors) - set(shapes))
        if extra:
            return f"{group}/{extra[0]} is not a parameter of the model (dim={cfg.dim}, layers={cfg.layers})"
        for name, shape in shapes.items():
            a = tensors.get(name)
            if a is None:
                return f"{group}/{name} is missing"
            if a.dtype != np.float32 or a.shape != shape:
                return _unlike(f"{group}/{name}", a.dtype, a.shape, shape)
            if not np.isfinite(a).all():
                return f"{group}/{name} contains NaN or inf"
    return None


def _json_scalar(obj):
    # numpy scalars (a loss as np.float32, a step as np.int64) are stored as their exact Python value
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON")


def save_checkpoint(path, config, params, optimizer, state, mkdir=True, lora=None):
    """Write params, AdamW state ({"t", "m", "v"}) and the trainer's JSON `state` to `path` atomically
    (`mkdir`: create its folder if missing); `lora`: a LoRA run's (params hold the adapters too).

    Everything is validated first, so a bad save raises CheckpointError and keeps the previous file.
    """
    path = os.fspath(path)
    cfg = model_config(config, f"not saving {path}")
    groups = {"param": params, "adam_m": optimizer["m"], "adam_v": optimizer["v"]}
    groups = {g: {k: np.asarray(a, dtype=np.float32) for k, a in t.items()} for g, t in groups.items()}
    problem = _tensor_problem(cfg, groups, lora)
    if problem:
        raise CheckpointError(f"not saving {path}: {problem}; the previous checkpoint is kept")
    meta = {"format": FORMAT, "version": VERSION, "config": cfg.to_dict(), "adam_t": int(optimizer["t"]),
            "state": state, **({"lora": lora.to_dict()} if lora else {})}
    try:
        text = json.dumps(meta, default=_json_scalar)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"not saving {path}: state is not JSON ({e}); keep it to dicts with str "
                              "keys, lists, str, int, float, bool and None") from None

    def write(f):
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("meta.json", text)
            for group, tensors in groups.items():
                for name, a in tensors.items():
                    # force_zip64: zipfile cannot grow a streamed member past 2 GiB unless told up front
                    with zf.open(f"{group}/{name}.npy", "w", force_zip64=True) as member:
                        # C order, one tensor at a time: a frozen weight may be a transposed view of its surface
                        np.lib.format.write_array(member, np.ascontiguousarray(a), allow_pickle=False)

    atomic_write(path, write, mkdir=mkdir)


def _kind(v):
    """What a meta.json value is, for a message: missing, a short number or string, or its JSON type."""
    if v is MISSING:
        return "missing"
    if isinstance(v, (int, float)) and not isinstance(v, bool) or isinstance(v, str) and len(v) <= 40:
        return repr(v)
    return {dict: "an object", list: "an array", str: "a long string", bool: repr(v).lower()}.get(type(v), "null")


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _meta_problem(meta):
    """The first thing wrong with meta.json's config, adam_t or state (step), or None."""
    names = [f.name for f in fields(ModelConfig)]
    config, state = meta.get("config", MISSING), meta.get("state", MISSING)
    if not isinstance(config, dict):
        return f"config is {_kind(config)}, not an object of the model's fields ({', '.join(names)})"
    unknown, missing = sorted(set(config) - set(names)), [k for k in names if k not in config and k not in ADDED_FIELDS]
    if unknown:
        return f"config has an unknown field {unknown[0]!r}"
    if missing:
        return f"config lacks {', '.join(missing)}"
    if not _count(meta.get("adam_t")):
        return f"adam_t is {_kind(meta.get('adam_t', MISSING))}, not an integer >= 0"
    if not isinstance(state, dict):
        return f"state is {_kind(state)}, not an object"
    if "step" in state and not _count(state["step"]):
        return f"state's step is {_kind(state['step'])}, not an integer >= 0"
    return None


def _read_meta(zf, path):
    if "meta.json" not in zf.namelist():
        raise CheckpointError(f"{path}: no meta.json inside, so this zip is not an anectypes checkpoint; "
                              "pass a file written by save_checkpoint")
    try:
        meta = json.loads(zf.read("meta.json"))
    except (ValueError, RecursionError) as e:       # RecursionError: arrays nested thousands deep
        raise CheckpointError(f"{path}: meta.json is not valid JSON ({str(e)[:200]}); the file is damaged, "
                              "resume from another checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: meta.json is {_kind(meta)}, not an object; pass a file written by "
                              "save_checkpoint")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format is {_kind(meta.get('format', MISSING))}, not {FORMAT!r}; pass a file "
                              "written by save_checkpoint (reference files: formats/reference.py)")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {_kind(meta.get('version', MISSING))} is not supported "
                              f"(this anectypes reads version {VERSION}); use the anectypes version that wrote it")
    problem = _meta_problem(meta)
    if problem:
        raise CheckpointError(f"{path}: meta.json's {problem}; the file is damaged, resume from another checkpoint")
    return meta


def _lora(meta, cfg, path):
    """The Lora of meta.json's "lora" (None without one), checked against the model."""
    if "lora" not in meta:
        return None
    doc = meta["lora"]
    rank, alpha, targets = (doc.get(k) if isinstance(doc, dict) else None for k in ("rank", "alpha", "targets"))
    try:
        if not (_count(rank) and rank > 0 and isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                and math.isfinite(alpha) and alpha > 0 and isinstance(targets, str)):
            raise AnectypesError(f"{_kind(doc)} is not a LoRA setting {{rank, alpha, targets}}")
        return check_rank(cfg, Lora(rank, float(alpha), parse_targets(targets)))
    except AnectypesError as e:
        raise CheckpointError(f"{path}: meta.json's lora: {e}; the file is damaged, resume from another "
                              "checkpoint") from None


def _read_tensor(zf, member, need, path):
    """The float32 array of one member, its .npy header checked against the shape `need` and the file's
    size before any memory is allocated for it (a header and a model config may claim any size)."""
    with zf.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"{member} is a version {version[0]}.{version[1]} .npy file")
        shape, _, dtype = getattr(np.lib.format, f"read_array_header_{version[0]}_0")(f)
        if dtype != np.float32 or shape != need:
            raise CheckpointError(f"{path}: {_unlike(member[:-4], dtype, shape, need)}; resume from another "
                                  "checkpoint or start a new run")
        nbytes, size = 4 * math.prod(need), os.path.getsize(path)
        if nbytes > size:                                     # the zip is uncompressed: a member fits in the file
            raise CheckpointError(f"{path}: {member} needs {nbytes:,} bytes but the file is {size:,}; the file is "
                                  "truncated or damaged, resume from another checkpoint")
        f.seek(0)
        # Fortran order too: checkpoints of fp32 LoRA runs of 2026-12-07 hold their frozen weights so
        return np.ascontiguousarray(np.lib.format.read_array(f, allow_pickle=False))


def read_meta(path):
    """A checkpoint's validated meta.json alone (its config, adam_t and the trainer's state: step, best_val_loss),
    without reading a tensor: what a listing shows."""
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as zf:
            return _read_meta(zf, path)
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, zlib.error) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None


def load_checkpoint(path):
    """Read and validate a checkpoint written by save_checkpoint; returns a Checkpoint."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file; check the path")
    try:
        with zipfile.ZipFile(path) as zf:
            meta = _read_meta(zf, path)
            cfg = model_config(meta["config"], path)
            if 9 * cfg.layers > len(zf.namelist()):   # before naming 9 tensors a layer: a config may claim 10^9
                raise CheckpointError(f"{path}: its config's {cfg.layers} layers need {3 * (9 * cfg.layers + 2)} "
                                      f"tensors but the file holds {len(zf.namelist()) - 1}; the file is damaged, "
                                      "resume from another checkpoint")
            lora = _lora(meta, cfg, path)
            shapes, groups = _shapes(cfg, lora), {g: {} for g in GROUPS}
            for member in zf.namelist():
                if member == "meta.json":
                    continue
                group, _, name = member.partition("/")
                name = name.removesuffix(".npy")
                if group not in groups or not member.endswith(".npy"):
                    raise CheckpointError(f"{path}: unexpected member {member[:80]!r}; pass a file written by "
                                          "save_checkpoint")
                if name not in shapes[group]:
                    raise CheckpointError(f"{path}: {group}/{name[:80]} is not a parameter of the model "
                                          f"(dim={cfg.dim}, layers={cfg.layers}); resume from another checkpoint")
                groups[group][name] = _read_tensor(zf, member, shapes[group][name], path)
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, zlib.error) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e}); the file is truncated or damaged, "
                              "resume from another checkpoint") from None
    problem = _tensor_problem(cfg, groups, lora)
    if problem:
        raise CheckpointError(f"{path}: {problem}; resume from another checkpoint or start a new run")
    return Checkpoint(config=cfg.to_dict(), params=groups["param"],
                      optimizer={"t": meta["adam_t"], "m": groups["adam_m"], "v": groups["adam_v"]},
                      state=meta["state"], lora=lora)


def check_compatible(ckpt, config):
    """Raise CheckpointError naming every model field where the checkpoint and the run differ."""
    saved = model_config(ckpt.config, "checkpoint").to_dict()
    run = model_config(config, "run").to_dict()
    diff = [f.name for f in fields(ModelConfig) if saved[f.name] != run[f.name]]
    if diff:
        was = ", ".join(f"{k}={saved[k]}" for k in diff)
        now = ", ".join(f"{k}={run[k]}" for k in diff)
        raise CheckpointError(f"checkpoint was saved for {was} but the run uses {now}; resume with the "
                              "checkpoint's model config or start a new run")
