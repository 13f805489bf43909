"""llama2.c's model files (docs/ane-reference.md §4.12, §8.1): read as any model source, written by
export (model.bin and tokenizer.bin for run.c), the tests and the benchmark (random weights of a
model's shape).

    version 0 (legacy, what run.c reads): 7 int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads,
        vocab_size (negative: a classifier of its own follows), seq_len; then float32 tensors: the
        embedding, each kind across all layers (rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3), rms_final,
        two RoPE tables of seq_len × head_size/2 values that readers skip, [the classifier]
    version 1: 256-byte header: uint32 magic "ak42", int32 version 1, the 7 int32 (vocab_size
        positive), uint8 shared_classifier, zeros; then rms_att and rms_ffn of all layers, rms_final,
        the embedding, each matrix kind across all layers (wq, wk, wv, wo, w1, w2, w3), [the classifier]

Matrices are [out, in] row-major, as ours; head_size is dim / n_heads. The models have no residual
scale (α = 1) and use RMSNorm's eps 1e-5 and RoPE's θ 10000.
"""

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.tokenizer import Tokenizer
from ..errors import AnectypesError
from ..host.files import atomic_write
from ..model.config import ModelConfig, rope_tables
from .portable import FormatError, Portable, fold, scaled_params, unfold

MAGIC, HEADER_V1 = 0x616B3432, 256
DIMS = struct.Struct("<7i")
V1_HEAD = struct.Struct("<Ii7iB")
V0_ORDER = ("embed", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final", "rope")
V1_ORDER = ("rms_att", "rms_ffn", "rms_final", "embed", "wq", "wk", "wv", "wo", "w1", "w2", "w3")


class ModelFileError(AnectypesError):
    """A file that is not a llama2.c model, or a truncated one."""


@dataclass
class Llama2cModel:
    cfg: ModelConfig
    params: dict               # our names (model.config.param_shapes)
    classifier: object         # [vocab, dim] float32, or None when it is the embedding
    version: int


def shapes(cfg):
    """Each tensor kind's shape, with the layers first for the per-layer kinds."""
    L, D = cfg.layers, cfg.dim
    return dict(embed=(cfg.vocab, D), rms_att=(L, D), wq=(L, cfg.q_dim, D), wk=(L, cfg.kv_dim, D),
                wv=(L, cfg.kv_dim, D), wo=(L, D, cfg.q_dim), rms_ffn=(L, D), w1=(L, cfg.hidden, D),
                w2=(L, D, cfg.hidden), w3=(L, cfg.hidden, D), rms_final=(D,), rope=(2, cfg.seq, cfg.head_dim // 2),
                classifier=(cfg.vocab, D))


def read_model(path):
    """A llama2.c model file (version 0 or 1) as a Llama2cModel; ModelFileError saying what is wrong."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_V1)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror})") from None
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == MAGIC:
        if len(head) < HEADER_V1:
            raise ModelFileError(f"{path}: {size} bytes is shorter than the 256-byte header of a version 1 model")
        _, version, *dims, shared = V1_HEAD.unpack_from(head)
        if version != 1:
            raise ModelFileError(f"{path}: llama2.c model version {version} is not supported (only 0 and 1: "
                                 "version 2 is int8-quantized)")
        offset, order = HEADER_V1, V1_ORDER
    elif len(head) >= DIMS.size:
        dims, version, offset, order = list(DIMS.unpack_from(head)), 0, DIMS.size, V0_ORDER
        shared, dims[5] = dims[5] > 0, abs(dims[5])
    else:
        raise ModelFileError(f"{path}: {size} bytes is shorter than the 28-byte header of a llama2.c model")
    cfg = config_of(path, *dims)
    order = order + (() if shared else ("classifier",))
    kinds = shapes(cfg)
    expected = offset + 4 * sum(int(np.prod(kinds[k])) for k in order)
    if size != expected:
        problem = "truncated" if size < expected else "longer than its header says"
        raise ModelFileError(f"{path}: {problem}: {size} bytes, but a version {version} model of its header "
                             f"(dim {cfg.dim}, hidden {cfg.hidden}, layers {cfg.layers}, heads {cfg.heads}, "
                             f"kv_heads {cfg.kv_heads}, vocab {cfg.vocab}, seq {cfg.seq}) is {expected} bytes")
    body, tensors, pos = np.fromfile(path, "<f4", offset=offset), {}, 0
    for kind in order:
        n = int(np.prod(kinds[kind]))
        tensors[kind], pos = body[pos:pos + n].reshape(kinds[kind]), pos + n
    params = {f"layers.{i}.{k}": tensors[k][i] for i in range(cfg.layers) for k in LAYER_KINDS}
    params.update(embed=tensors["embed"], rms_final=tensors["rms_final"])
    return Llama2cModel(cfg, params, tensors.get("classifier"), version)


LAYER_KINDS = ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3")


def config_of(path, dim, hidden, layers, heads, kv_heads, vocab, seq):
    """The ModelConfig of a header's dimensions; ModelFileError when they are impossible."""
    named = dict(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, vocab_size=vocab,
                 seq_len=seq)
    bad = [f"{k}={v}" for k, v in named.items() if not 0 < v < 2**24]
    if not bad and (dim % heads or heads % kv_heads or dim // heads % 2):
        bad = [f"dim={dim}, n_heads={heads}, n_kv_heads={kv_heads}"]
    if bad:
        raise ModelFileError(f"{path}: not a llama2.c model (its header's {', '.join(bad)} is impossible)")
    return ModelConfig(dim=dim, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=dim // heads, layers=layers,
                       seq=seq, vocab=vocab)


def write_model(path, cfg, params, classifier=None, version=0):
    """Write a model (head_dim = dim / heads) as llama2.c's version 0 or 1, atomically."""
    if cfg.head_dim * cfg.heads != cfg.dim:
        raise ModelFileError(f"llama2.c models need head_dim = dim / heads; this one has {cfg.head_dim}")
    kinds = shapes(cfg)
    tensors = {k: np.stack([params[f"layers.{i}.{k}"] for i in range(cfg.layers)]) for k in LAYER_KINDS}
    tensors.update(embed=params["embed"], rms_final=params["rms_final"], classifier=classifier,
                   rope=np.stack([t.T for t in rope_tables(cfg)]))    # cos, sin [seq, hd/2], as export.py's
    shared = classifier is None
    dims = (cfg.dim, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.vocab, cfg.seq)
    if version == 0:
        header = DIMS.pack(*dims[:5], cfg.vocab if shared else -cfg.vocab, cfg.seq)
        order = V0_ORDER
    else:
        header = V1_HEAD.pack(MAGIC, 1, *dims, shared).ljust(HEADER_V1, b"\0")
        order = V1_ORDER
    order = order + (() if shared else ("classifier",))

    def write(f):
        f.write(header)
        for k in order:
            f.write(np.ascontiguousarray(tensors[k], "<f4").reshape(kinds[k]).tobytes())

    atomic_write(os.fspath(path), write)


# --- as a portable model (α divided out on reading, folded in on writing: §8) ------------------------------

def read(path):
    """A llama2.c model file as a Portable, with the tokenizer.bin beside it if there is one, and its
    classifier if it has one of its own."""
    m = read_model(path)
    beside = Path(path).parent / "tokenizer.bin"
    return Portable(m.cfg, scaled_params(m.params, m.cfg, unfold), Tokenizer.load(beside) if beside.is_file() else None,
                    m.classifier)


def check(model, dtype):
    """Refuse, with the reason, a model or dtype that run.c cannot read."""
    cfg = model.cfg
    if cfg.head_dim * cfg.heads != cfg.dim:
        raise FormatError(f"llama2.c's run.c computes head_size as dim / n_heads ({cfg.dim} / {cfg.heads}), "
                          f"but this model's head_dim is {cfg.head_dim}: export it as hf or gguf")
    fixed = {k: v for k, v in (("rope_theta", 10000.0), ("norm_eps", 1e-5)) if getattr(cfg, k) != v}
    if fixed:
        want = ", ".join(f"{k} = {v}" for k, v in fixed.items())
        have = ", ".join(f"{k} = {getattr(cfg, k)}" for k in fixed)
        raise FormatError(f"llama2.c's run.c fixes {want}; this model has {have}: export it as hf or gguf")
    if dtype == "f16":
        raise FormatError("llama2.c's run.c reads float32 only: --dtype f16 is for hf and gguf")


def write(model, folder, dtype="f32"):
    """model.bin (version 0, what run.c reads) and tokenizer.bin in folder."""
    write_model(folder / "model.bin", model.cfg, scaled_params(model.params, model.cfg, fold), version=0)
    model.tokenizer.save(folder / "tokenizer.bin")
