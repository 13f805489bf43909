"""The reference's checkpoint (maderix's ANE trainer, docs/ane-reference.md §4.8): version 4 (dynamic,
GQA) and version 2 (static, full MHA), read into our names with their AdamW state: a 96-byte header,
then each layer's nine weights followed by their (m, v) pairs, then rms_final and the embedding, each
with its m and v, all float32. Nothing writes this format here.
"""

import math
import os
import struct
from dataclasses import dataclass, fields

import numpy as np

from ..errors import CheckpointError
from ..model.config import ModelConfig, param_shapes
from .checkpoint import model_config
from .portable import Portable

REFERENCE_MAGIC = 0x424C5A54  # "BLZT", bytes on disk 54 5A 4C 42
_REF_HEADER = struct.Struct("<10i2f3d6i")  # 96 bytes, no padding needed at these offsets
_REF_FIELDS = ("magic", "version", "step", "total_steps", "n_layers", "vocab_size", "dim", "hidden_dim",
               "n_heads", "seq_len", "lr", "loss", "cum_compile", "cum_train", "cum_wall", "cum_steps",
               "cum_batches", "adam_t", "kv_heads", "head_dim", "q_dim")
_REF_LAYER = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "rms_att", "rms_ffn")


@dataclass
class ReferenceCheckpoint:
    version: int
    step: int
    total_steps: int
    lr: float
    loss: float
    cum_compile: float
    cum_train: float
    cum_wall: float
    cum_steps: int
    cum_batches: int
    adam_t: int
    config: ModelConfig
    params: dict   # our names and shapes; views into one buffer read once from the file
    m: dict
    v: dict

    @property
    def optimizer(self):
        return {"t": self.adam_t, "m": self.m, "v": self.v}


def read_reference_checkpoint(path):
    """Read the reference's checkpoint (version 4 dynamic, or version 2 static) into our names."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_REF_HEADER.size)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror}); check the path") from None
    if len(head) < _REF_HEADER.size:
        raise CheckpointError(f"{path}: {size} bytes is shorter than the 96-byte reference header; the file "
                              "is truncated or not a reference checkpoint")
    h = dict(zip(_REF_FIELDS, _REF_HEADER.unpack(head)))
    if h["magic"] != REFERENCE_MAGIC:
        raise CheckpointError(f"{path}: magic 0x{h['magic'] & 0xFFFFFFFF:08X} is not the reference's "
                              f"0x{REFERENCE_MAGIC:08X}; this is not a reference checkpoint")
    if h["version"] not in (2, 4):
        raise CheckpointError(f"{path}: reference checkpoint version {h['version']} is not supported; only "
                              "4 (dynamic) and 2 (static) are")
    heads, dim = h["n_heads"], h["dim"]
    if h["version"] == 2:
        # v2 has pad[3] there: static-pipeline attention is full MHA with dim×dim matrices (§4.8)
        h.update(kv_heads=heads, head_dim=dim // heads if heads > 0 else 0, q_dim=dim)
    dims = ("n_layers", "vocab_size", "dim", "hidden_dim", "n_heads", "seq_len", "kv_heads", "head_dim",
            "q_dim")
    bad = [f"{k}={h[k]}" for k in dims if h[k] <= 0]
    if not bad and h["q_dim"] != heads * h["head_dim"]:
        bad = [f"q_dim={h['q_dim']} != n_heads*head_dim={heads}*{h['head_dim']}"]
    if bad:
        raise CheckpointError(f"{path}: header has impossible dimensions ({', '.join(bad)}); the file is "
                              "damaged or not a reference checkpoint")
    if 24 * h["n_layers"] * dim > size:    # each layer's two norms: dim floats each, with their m and v
        raise CheckpointError(f"{path}: {size} bytes cannot hold the header's {h['n_layers']} layers of dim {dim}; "
                              "the file is truncated or damaged")
    cfg = model_config(dict(dim=dim, hidden=h["hidden_dim"], heads=heads, kv_heads=h["kv_heads"],
                             head_dim=h["head_dim"], layers=h["n_layers"], seq=h["seq_len"],
                             vocab=h["vocab_size"]), path)
    shapes = param_shapes(cfg)
    expected = _REF_HEADER.size + 4 * 3 * sum(math.prod(s) for s in shapes.values())  # weights + m + v
    if size != expected:
        raise CheckpointError(f"{path}: file is {size} bytes but its header (layers={cfg.layers}, dim={dim}, "
                              f"hidden={cfg.hidden}, vocab={cfg.vocab}) needs {expected}; the file is "
                              "truncated or damaged")
    body = np.fromfile(path, dtype="<f4", offset=_REF_HEADER.size)
    params, m, v, pos = {}, {}, {}, 0

    def take(name):
        nonlocal pos
        n = math.prod(shapes[name])
        pos += n
        return body[pos - n:pos].reshape(shapes[name])

    for i in range(cfg.layers):
        names = [f"layers.{i}.{k}" for k in _REF_LAYER]
        for name in names:              # the nine weights, then their (m, v) pairs
            params[name] = take(name)
        for name in names:
            m[name], v[name] = take(name), take(name)
    for name in ("rms_final", "embed"):  # each followed by its m and v
        params[name], m[name], v[name] = take(name), take(name), take(name)
    header = {f.name: h[f.name] for f in fields(ReferenceCheckpoint) if f.name in h}
    return ReferenceCheckpoint(**header, config=cfg, params=params, m=m, v=v)


def read(path):
    """A reference checkpoint as a Portable (no tokenizer: the reference's files hold none)."""
    ref = read_reference_checkpoint(path)
    return Portable(ref.config, ref.params)
