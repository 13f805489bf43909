"""Model configuration and parameters: one dataclass, a few presets, custom models from JSON
(docs/ane-reference.md §4.1), the parameters' names and shapes, and their initialization (§4.6)."""

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from ..errors import AnectypesError
from ..host.system import physical_memory
from .lora import lora_parameters


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seq: int = 256
    vocab: int = 32000
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False               # Qwen3: per-head RMSNorm of q and k before RoPE (q_norm, k_norm)
    rope_type: str = "default"          # "default" or "llama3" (Llama 3.1's scaled frequencies, below)
    rope_factor: float = 8.0            # llama3 only: the long wavelengths' slow-down
    rope_low_freq: float = 1.0          # llama3 only: low_freq_factor
    rope_high_freq: float = 4.0         # llama3 only: high_freq_factor
    rope_original_context: int = 8192   # llama3 only: original_max_position_embeddings
    residual_scaled: bool = True        # False: α = 1, as imported checkpoints were trained
    tied: bool = True                   # False: a classifier of its own, `classifier` [vocab, dim]

    @property
    def q_dim(self):
        return self.heads * self.head_dim

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    @property
    def gqa_ratio(self):
        return self.heads // self.kv_heads

    @property
    def alpha(self):
        """Residual branch scale 1/√(2·layers) (DeepNet-style, §4.3), or 1 without residual scaling."""
        return 1.0 / math.sqrt(2 * self.layers) if self.residual_scaled else 1.0

    def validate(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type is bool:
                ok, what = isinstance(v, bool), "true or false"
            elif f.type is str:
                ok, what = v in ROPE_TYPES, " or ".join(map(repr, ROPE_TYPES))
            else:
                ok = (isinstance(v, int) if f.type is int else isinstance(v, (int, float)) and math.isfinite(v)) \
                    and not isinstance(v, bool) and v > 0
                what = "a positive integer" if f.type is int else "a positive finite number"
            if not ok:
                raise AnectypesError(f"model config: {f.name} must be {what}, got {v!r}")
        if self.heads % self.kv_heads:
            raise AnectypesError(f"model config: heads ({self.heads}) must be a multiple of kv_heads "
                                 f"({self.kv_heads})")
        if self.head_dim % 2:
            raise AnectypesError(f"model config: head_dim ({self.head_dim}) must be even for RoPE pairs")
        if self.qk_norm and self.head_dim > self.dim:      # q_norm and k_norm travel as a column of dim channels
            raise AnectypesError(f"model config: qk_norm needs head_dim ({self.head_dim}) <= dim ({self.dim})")
        if self.rope_type == "llama3" and self.rope_high_freq <= self.rope_low_freq:
            raise AnectypesError(f"model config: rope_high_freq ({self.rope_high_freq}) must exceed rope_low_freq "
                                 f"({self.rope_low_freq})")
        return self

    def layer_params(self):
        """The layers' parameters: what the kernels' surfaces hold (once, in the forward kernels' inputs)."""
        return self.layers * (2 * self.dim * (self.q_dim + self.kv_dim) + 3 * self.dim * self.hidden + 2 * self.dim
                              + 2 * self.head_dim * self.qk_norm)

    def n_params(self):
        """param_shapes' total, counted without listing them (a model file may claim 10^9 layers)."""
        return self.layer_params() + self.dim + (2 - self.tied) * self.vocab * self.dim

    def training_bytes(self, lora=None):
        """About what training holds (float32): weights, gradients and both AdamW moments (4 × params), the
        layers' weights once more in the kernels' surfaces (the forward kernels hold them), each
        layer's activations and gradients in their surfaces, and the logits with their gradient. With LoRA (a
        model.lora.Lora) the weights once without their gradients and moments, and 5 × the adapters."""
        per_layer = self.seq * (4 * self.q_dim + 4 * self.kv_dim + 6 * self.dim + 6 * self.hidden
                                + 2 * self.heads * self.seq + 2 * (self.q_dim + self.kv_dim) * self.qk_norm)
        weights = (4 * self.n_params() if lora is None else self.n_params() + lora_parameters(self, lora)) \
            + self.layer_params()
        return 4 * (weights + self.layers * per_layer + 2 * self.seq * self.vocab)

    def check_fits(self, name, lora=None):
        """Refuse, up front, a model whose training cannot fit in this machine's memory."""
        need, have = self.training_bytes(lora), physical_memory()
        if have and need > have:
            raise AnectypesError(f"model {name}: training it needs about {need / 2**30:,.1f} GiB "
                                 f"(weights, AdamW state, gradients, activations) but this machine has "
                                 f"{have / 2**30:,.1f} GiB; choose a smaller model")
        return self

    def to_dict(self):
        return asdict(self)


# the fields added since checkpoints and runs were first saved: a file without them has their defaults
ADDED_FIELDS = ("qk_norm", "rope_type", "rope_factor", "rope_low_freq", "rope_high_freq", "rope_original_context",
                "residual_scaled", "tied")


def with_defaults(config):
    """A dict of ModelConfig fields with the defaults of the ADDED_FIELDS it lacks."""
    return {**{f.name: f.default for f in fields(ModelConfig) if f.name in ADDED_FIELDS}, **config}


def param_shapes(cfg):
    """Every parameter's name and shape: per layer the projections ([out, in]) and both norms' weights,
    (with qk_norm, q_norm and k_norm [head_dim]), then the final norm's, the embedding and, untied, the
    classifier (tied: the embedding is the classifier)."""
    shapes = {}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        shapes.update({p + "wq": (cfg.q_dim, cfg.dim), p + "wk": (cfg.kv_dim, cfg.dim),
                       p + "wv": (cfg.kv_dim, cfg.dim), p + "wo": (cfg.dim, cfg.q_dim),
                       p + "w1": (cfg.hidden, cfg.dim), p + "w2": (cfg.dim, cfg.hidden),
                       p + "w3": (cfg.hidden, cfg.dim), p + "rms_att": (cfg.dim,), p + "rms_ffn": (cfg.dim,)})
        if cfg.qk_norm:
            shapes.update({p + "q_norm": (cfg.head_dim,), p + "k_norm": (cfg.head_dim,)})
    shapes.update({"rms_final": (cfg.dim,), "embed": (cfg.vocab, cfg.dim)})
    if not cfg.tied:
        shapes["classifier"] = (cfg.vocab, cfg.dim)
    return shapes


def rope_frequencies(cfg):
    """The angle per position of each pair j: θ^(−2j/hd), with llama3 scaling as transformers'
    _compute_llama3_parameters: wavelengths above original_context/low_freq slowed by factor, those
    under original_context/high_freq kept, those between blended."""
    freq = cfg.rope_theta ** (-2.0 * np.arange(cfg.head_dim // 2) / cfg.head_dim)
    if cfg.rope_type != "llama3":
        return freq
    wavelen = 2 * np.pi / freq
    smooth = (cfg.rope_original_context / wavelen - cfg.rope_low_freq) / (cfg.rope_high_freq - cfg.rope_low_freq)
    blended = (1 - smooth) * freq / cfg.rope_factor + smooth * freq
    return np.where(wavelen > cfg.rope_original_context / cfg.rope_low_freq, freq / cfg.rope_factor,
                    np.where(wavelen < cfg.rope_original_context / cfg.rope_high_freq, freq, blended))


def rope_tables(cfg):
    """cos/sin [hd/2, S] of the angle of pair j (channels 2j, 2j+1 of a head) at position s."""
    angle = rope_frequencies(cfg)[:, None] * np.arange(cfg.seq)[None, :]
    return np.cos(angle), np.sin(angle)


def init_params(cfg, rng):
    """Uniform(−a, a) init of §4.6: 1/√fan_in, residual outputs scaled by 1/√(2L); norms at 1."""
    a = {"wq": 1 / np.sqrt(cfg.dim), "wk": 1 / np.sqrt(cfg.dim), "wv": 1 / np.sqrt(cfg.dim),
         "wo": cfg.alpha / np.sqrt(cfg.q_dim), "w1": 1 / np.sqrt(cfg.hidden), "w3": 1 / np.sqrt(cfg.hidden),
         "w2": cfg.alpha / np.sqrt(cfg.dim), "embed": 0.02, "classifier": 0.02}
    params = {}
    for name, shape in param_shapes(cfg).items():
        kind = name.rsplit(".", 1)[-1]
        params[name] = (np.ones(shape, np.float32) if len(shape) == 1 else
                        rng.uniform(-a[kind], a[kind], shape).astype(np.float32))
    return params


ROPE_TYPES = ("default", "llama3")

PRESETS = {
    "tiny": ModelConfig(dim=64, hidden=176, heads=4, kv_heads=4, head_dim=16, layers=2, seq=64, vocab=1024),
    "stories15m": ModelConfig(dim=288, hidden=768, heads=6, kv_heads=6, head_dim=48, layers=6),
    "stories42m": ModelConfig(dim=512, hidden=1376, heads=8, kv_heads=8, head_dim=64, layers=8),
    "stories110m": ModelConfig(dim=768, hidden=2048, heads=12, kv_heads=12, head_dim=64, layers=12),
    # Qwen/Qwen3-0.6B's config.json (the reference's models/qwen3_06b.h: vocab 151,936), with our α for --scratch
    "qwen3_06b": ModelConfig(dim=1024, hidden=3072, heads=16, kv_heads=8, head_dim=128, layers=28, vocab=151936,
                             rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True),
}


def load_config(name_or_path, **overrides):
    """A preset by name, or a JSON file of ModelConfig fields; `overrides` (e.g. vocab) win over a
    preset's values, and must agree with what a file sets."""
    if name_or_path in PRESETS:
        cfg = replace(PRESETS[name_or_path], **{k: v for k, v in overrides.items() if v is not None})
    else:
        data = read_model_file(name_or_path)
        for k, v in overrides.items():
            if v is not None and k in data and data[k] != v:
                raise AnectypesError(f"model file {name_or_path}: {k} is {data[k]!r} but the data needs {v!r}; "
                                     f"set {k} to {v!r} or leave it out")
        cfg = ModelConfig(**{**data, **{k: v for k, v in overrides.items() if v is not None}})
    try:
        return cfg.validate()
    except AnectypesError as e:
        raise AnectypesError(f"{name_or_path}: {e}") from None


def read_model_file(name):
    """The ModelConfig fields in a JSON file, checked for unknown and missing fields."""
    path = Path(name)
    if not path.is_file():
        raise AnectypesError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}) and not a JSON file")
    try:
        text = path.read_text()
        data = json.loads(text, parse_constant=lambda c: float("nan")) if text.strip() else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:   # RecursionError: nested 10^5 deep
        raise AnectypesError(f"model file {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        found = "the file is empty" if data is None else f"found {type(data).__name__}"
        raise AnectypesError(f"model file {path}: {found}; expected a JSON object of ModelConfig fields "
                             f"({', '.join(f.name for f in fields(ModelConfig))})")
    known = [f.name for f in fields(ModelConfig)]
    required = [f.name for f in fields(ModelConfig) if f.default is MISSING]
    unknown, missing = sorted(set(data).difference(known)), [k for k in required if k not in data]
    if unknown:
        raise AnectypesError(f"model file {path}: unknown field {unknown[0]!r}; allowed: {', '.join(known)}")
    if missing:
        raise AnectypesError(f"model file {path}: missing field{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)}")
    return data
