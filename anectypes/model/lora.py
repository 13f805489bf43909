"""LoRA (docs/lora.md): low-rank adapters on chosen projections of a frozen model, as PEFT makes them. A
projection W [out, in] becomes W·x + (alpha/rank)·B·(A·x) with A [rank, in] drawn as PEFT draws it
(kaiming-uniform with a = √5: U(±1/√in)) and B [out, rank] zero; the adapters are the only parameters
trained. They are named after their weight: `layers.{i}.wq.lora_a`, `layers.{i}.wq.lora_b`."""

from dataclasses import dataclass

import numpy as np

from ..errors import AnectypesError

# --lora-targets' names (PEFT's target modules without "_proj") -> our weights
TARGETS = dict(q="wq", k="wk", v="wv", o="wo", gate="w1", up="w3", down="w2")
DEFAULT_TARGETS = "q,k,v,o"
DEFAULT_ALPHA = 8.0                    # LoraConfig's lora_alpha
PARTS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    targets: tuple                     # our weight names, in TARGETS' order

    @property
    def scale(self):
        return self.alpha / self.rank

    def to_dict(self):
        return dict(rank=self.rank, alpha=self.alpha, targets=target_names(self.targets))


def parse_targets(text):
    """Our weight names of a --lora-targets list (q,k,v,o,gate,up,down), in TARGETS' order; AnectypesError
    naming an unknown or repeated one."""
    given = [t.strip() for t in text.split(",")]
    if unknown := [t for t in given if t not in TARGETS]:
        raise AnectypesError(f"--lora-targets: unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
    if twice := sorted({t for t in given if given.count(t) > 1}):
        raise AnectypesError(f"--lora-targets {text}: {', '.join(twice)} named twice; name each target once")
    return tuple(w for t, w in TARGETS.items() if t in given)


def target_names(weights):
    """The --lora-targets list of our weight names."""
    return ",".join(t for t, w in TARGETS.items() if w in weights)


def of_spec(spec):
    """The Lora of a run spec (lora, lora_alpha, lora_targets), or None for full training."""
    if spec.lora is None:
        return None
    return Lora(spec.lora, float(spec.lora_alpha or DEFAULT_ALPHA), parse_targets(spec.lora_targets or DEFAULT_TARGETS))


def is_adapter(name):
    return name.rsplit(".", 1)[-1] in PARTS


def weight_shapes(cfg):
    """Each projection's [out, in]."""
    d, h, q, kv = cfg.dim, cfg.hidden, cfg.q_dim, cfg.kv_dim
    return dict(wq=(q, d), wk=(kv, d), wv=(kv, d), wo=(d, q), w1=(h, d), w3=(h, d), w2=(d, h))


def adapter_shapes(cfg, lora):
    """Every adapter's name and shape: A [rank, in] and B [out, rank] of each target in each layer."""
    shapes, sides = {}, weight_shapes(cfg)
    for i in range(cfg.layers):
        for w in lora.targets:
            out, inp = sides[w]
            shapes[f"layers.{i}.{w}.lora_a"] = (lora.rank, inp)
            shapes[f"layers.{i}.{w}.lora_b"] = (out, lora.rank)
    return shapes


def lora_parameters(cfg, lora):
    """What LoRA adds to the weights training holds, in parameters: 5 × the adapters (theirs, their gradients, both
    AdamW moments, their copy in the surfaces)."""
    sides = weight_shapes(cfg)
    return 5 * cfg.layers * sum(lora.rank * (sides[w][0] + sides[w][1]) for w in lora.targets)


def check_rank(cfg, lora):
    """Refuse a rank above the smaller side of a targeted projection (the kernels hold A and B along its sides)."""
    sides = weight_shapes(cfg)
    w = min(lora.targets, key=lambda w: min(sides[w]))
    if lora.rank > min(sides[w]):
        raise AnectypesError(f"--lora {lora.rank}: the rank must be at most {min(sides[w])}, the smaller side of "
                             f"the model's {w} [{sides[w][0]}, {sides[w][1]}]")
    return lora


def init_adapters(cfg, lora, rng):
    """PEFT's initialization: A kaiming-uniform with a = √5 (bound √(6/((1 + a²)·in)) = 1/√in), B zero."""
    adapters = {}
    for name, shape in adapter_shapes(cfg, lora).items():
        adapters[name] = (rng.uniform(-1 / np.sqrt(shape[1]), 1 / np.sqrt(shape[1]), shape).astype(np.float32)
                          if name.endswith("lora_a") else np.zeros(shape, np.float32))
    return adapters


def merged(params, lora):
    """The base parameters with each adapter folded into its weight, W + (alpha/rank)·B·A (float64, rounded once)."""
    out = {k: v for k, v in params.items() if not is_adapter(k)}
    for name in out:
        if name + ".lora_a" in params:
            a, b = (params[f"{name}.{p}"].astype(np.float64) for p in PARTS)
            out[name] = (out[name] + lora.scale * (b @ a)).astype(np.float32)
    return out
