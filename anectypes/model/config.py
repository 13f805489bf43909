"""Model configuration: one dataclass, a few presets, custom models from JSON (ane-reference.md §4.1)."""

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ..errors import AnectypesError


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
        """Residual branch scale 1/√(2·layers) (DeepNet-style, §4.3)."""
        return 1.0 / math.sqrt(2 * self.layers)

    def validate(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise AnectypesError(f"model config: {f.name} must be a positive number, got {v!r}")
        if self.heads % self.kv_heads:
            raise AnectypesError(f"model config: heads ({self.heads}) must be a multiple of kv_heads "
                                 f"({self.kv_heads})")
        if self.head_dim % 2:
            raise AnectypesError(f"model config: head_dim ({self.head_dim}) must be even for RoPE pairs")
        return self

    def n_params(self):
        per_layer = (2 * self.q_dim * self.dim + 2 * self.kv_dim * self.dim + 3 * self.hidden * self.dim
                     + 2 * self.dim)
        return self.layers * per_layer + self.dim + self.vocab * self.dim

    def to_dict(self):
        return asdict(self)


PRESETS = {
    "tiny": ModelConfig(dim=64, hidden=176, heads=4, kv_heads=4, head_dim=16, layers=2, seq=64, vocab=1024),
    "stories15m": ModelConfig(dim=288, hidden=768, heads=6, kv_heads=6, head_dim=48, layers=6),
    "stories42m": ModelConfig(dim=512, hidden=1376, heads=8, kv_heads=8, head_dim=64, layers=8),
    "stories110m": ModelConfig(dim=768, hidden=2048, heads=12, kv_heads=12, head_dim=64, layers=12),
    "qwen3_06b": ModelConfig(dim=1024, hidden=3072, heads=16, kv_heads=8, head_dim=128, layers=28),
}


def load_config(name_or_path, **overrides):
    """A preset by name, or a JSON file of ModelConfig fields; `overrides` (e.g. vocab) win."""
    if name_or_path in PRESETS:
        cfg = PRESETS[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise AnectypesError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                                 "and not a JSON file")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise AnectypesError(f"model file {path}: {e}") from None
        known = {f.name for f in fields(ModelConfig)}
        if not isinstance(data, dict) or set(data) - known:
            extra = sorted(set(data) - known) if isinstance(data, dict) else data
            raise AnectypesError(f"model file {path}: unknown fields {extra}; allowed: {', '.join(sorted(known))}")
        try:
            cfg = ModelConfig(**data)
        except TypeError as e:
            raise AnectypesError(f"model file {path}: {e}") from None
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None}).validate()
