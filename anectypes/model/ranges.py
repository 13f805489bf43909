"""fp16 ranges: the powers of two at which the kernels hold a real checkpoint inside fp16 (docs/model.md, fp16
ranges). Real models' residual streams reach hundreds to tens of thousands, and a norm squares its input: in fp16
|x| > 255.9 squares to inf. So the kernels compute at scales, each a power of two (exact in binary floating point):

    stream      the residual stream is carried as x·stream: the embedding is written so, Wo and W2 (and their
                adapters' B) are staged so, and the CPU divides it out of the final hidden state
    norms       each RMSNorm (and QK-norm) squares its input twice (kernels.rmsnorm): first at a power of two ρ per
                layer (for the stream's norms, times the last norm's 1/rms at each position: ρ covers the growth
                since), then at that first estimate; ρ is staged beside the norm's weight with √ε times the scale
                of the norm's input (RMSNorm is scale-invariant: the same x̂)
    proj        with QK-norm, Wq and Wk (and their adapters' B) staged at a scale per layer: QK-norm cancels it

Each is chosen from measured ranges (`choose`): at the first forward from a float32 run of the same kernels
(the simulator's fp32 mode), then from every fp16 forward's own outputs. The backward reads 1/rms of what the
forward normalized, so its kernels need no scale; its ranges are the loss scale's (train/optim.py)."""

import math
from dataclasses import dataclass

import numpy as np

# a norm's sum of squares: a partial sum reaching 2^15 can come back as zero on the engine (docs/ane-reference.md
# §3.7, "H15NOTES"); chosen at 2^12 at most, chosen again past 2^14 or under 2^4 (small squares flush to zero)
SUM_LIMIT, SUM_TARGET, SUM_HIGH, SUM_LOW = 2.0 ** 15, 2.0 ** 12, 2.0 ** 14, 2.0 ** 4
# the stream's (and QK-norm's inputs') largest |value|: fp16 ends at 65,504
VALUE_LIMIT, VALUE_TARGET, VALUE_HIGH = 65504.0, 2.0 ** 13, 2.0 ** 14.5


def pow2_floor(v, low=-14, high=14):
    """The largest power of two at most v, within 2^low..2^high (fp16 holds both ends as normal numbers)."""
    return 2.0 ** min(high, max(low, math.floor(math.log2(v)))) if v > 0 and math.isfinite(v) else 1.0


STREAM_NORMS = ("att", "ffn")


def norm_names(cfg):
    """{norm: channels it sums over}: the attention's and the FFN's RMSNorm, and with QK-norm q's and k's."""
    return {"att": cfg.dim, "ffn": cfg.dim, **({"qn": cfg.head_dim, "kn": cfg.head_dim} if cfg.qk_norm else {})}


@dataclass
class Scales:
    """The kernels' scales (see the module): `stream` a number, `norms` and `proj` arrays of one per layer."""
    stream: float
    norms: dict
    proj: dict

    @classmethod
    def ones(cls, cfg):
        return cls(1.0, {n: np.ones(cfg.layers) for n in norm_names(cfg)},
                   {n: np.ones(cfg.layers) for n in (("wq", "wk") if cfg.qk_norm else ())})

    def input_scale(self, norm, layer):
        """The scale of what a norm reads: the stream's, or for QK-norm its projection's."""
        return self.stream if norm in STREAM_NORMS else self.proj["wq" if norm == "qn" else "wk"][layer]

    def first_unit(self, norm, layer):
        """What a norm's ρ multiplies beside the observed `need` (Observed.need): nothing for the stream's norms
        (their need is a ratio), the projection's scale for QK-norm's."""
        return 1.0 if norm in STREAM_NORMS else self.input_scale(norm, layer)

    def weight_factor(self, weight, layer):
        """What a layer weight (and its adapter's B) is staged times: the stream's for Wo and W2, which write it."""
        if weight in ("wo", "w2"):
            return self.stream
        return self.proj[weight][layer] if weight in self.proj else 1.0

    def to_dict(self):
        return {"stream": self.stream, "norms": {k: v.tolist() for k, v in self.norms.items()},
                "proj": {k: v.tolist() for k, v in self.proj.items()}}

    @classmethod
    def from_dict(cls, doc, cfg):
        """From to_dict's JSON (a checkpoint's state), checked against the model: None if it does not fit."""
        ones = cls.ones(cfg)
        try:
            out = cls(float(doc["stream"]), {k: np.array(doc["norms"][k], float) for k in ones.norms},
                      {k: np.array(doc["proj"][k], float) for k in ones.proj})
        except (KeyError, TypeError, ValueError):
            return None
        every = [out.stream, *(x for v in (*out.norms.values(), *out.proj.values()) for x in v)]
        shapes = all(len(v) == cfg.layers for v in (*out.norms.values(), *out.proj.values()))
        return out if shapes and all(x > 0 and math.isfinite(x) for x in every) else None

    def describe(self):
        """One line: the stream's scale and each scale's range over the layers, as powers of two."""
        def p(x):
            return f"2^{int(math.log2(x))}"
        parts = [f"stream {p(self.stream)}"] + [f"{k} {p(v.min())}..{p(v.max())}" if v.min() != v.max() else
                                                f"{k} {p(v.min())}" for k, v in {**self.norms, **self.proj}.items()]
        return ", ".join(parts)


@dataclass
class Observed:
    """What a forward showed, in the model's own units (whatever the scales): the stream's largest |value|, each
    norm's `need` per layer (the stream's norms: the largest growth of rms at a position since the last norm; QK-norm:
    the largest rms of a head at a position), and with QK-norm the projections' largest |value|. `broken` names the
    first tensor that left fp16 (or a sum's limit), else None."""
    stream: float
    need: dict
    proj: dict
    broken: str = None

    def merged(self, other):
        """The larger of two observations, elementwise."""
        if other is None:
            return self
        return Observed(max(self.stream, other.stream), {k: np.maximum(v, other.need[k]) for k, v in self.need.items()},
                        {k: np.maximum(v, other.proj[k]) for k, v in self.proj.items()}, self.broken or other.broken)

    def as_array(self):
        return np.concatenate([[self.stream], *self.need.values(), *self.proj.values()])

    def from_array(self, a):
        """The same observation with its numbers from as_array's layout (after a maximum over ranks)."""
        out, at = Observed(float(a[0]), {}, {}, self.broken), 1
        for group, target in ((self.need, out.need), (self.proj, out.proj)):
            for k, v in group.items():
                target[k], at = np.array(a[at:at + len(v)]), at + len(v)
        return out


def choose(seen, cfg):
    """The scales for what was observed: the stream's largest |value| at VALUE_TARGET at most (never above 1:
    a stream inside fp16 stays as it is), each norm's largest first sum of squares at SUM_TARGET at most, and as
    large as that allows (the small squares of the other positions stay above fp16's flush to zero)."""
    stream = min(1.0, pow2_floor(VALUE_TARGET / seen.stream))
    proj = {k: np.array([min(1.0, pow2_floor(VALUE_TARGET / m)) for m in v]) for k, v in seen.proj.items()}
    out = Scales(stream, {}, proj)
    for norm, channels in norm_names(cfg).items():
        out.norms[norm] = np.array([pow2_floor(math.sqrt(SUM_TARGET / channels) / (out.first_unit(norm, i) * r))
                                    for i, r in enumerate(seen.need[norm])])
    return out


def needs_choosing(scales, seen, cfg):
    """Whether what was seen lies outside the band its scales were chosen for (its largest sum of squares above
    SUM_HIGH or under SUM_LOW, a value above VALUE_HIGH): then `choose` again."""
    if seen.stream * scales.stream > VALUE_HIGH or any(
            (m * scales.proj[k] > VALUE_HIGH).any() for k, m in seen.proj.items()):
        return True
    for norm, channels in norm_names(cfg).items():
        for i, r in enumerate(seen.need[norm]):
            ss = channels * (r * scales.first_unit(norm, i) * scales.norms[norm][i]) ** 2
            if not SUM_LOW <= ss <= SUM_HIGH:
                return True
    return False


def observe(model):
    """The Observed of a Transformer's last forward, read from its kernels' output surfaces (each layer's
    sdpaFwd and ffnFused outputs are its own; the first layer's last norm is the embedding's, on the bottom surface)."""
    cfg, sc = model.cfg, model.scales
    qk = ("q_inv", "k_inv", "q_pre", "k_pre") if cfg.qk_norm else ()
    need = {n: np.zeros(cfg.layers) for n in norm_names(cfg)}
    proj = {n: np.zeros(cfg.layers) for n in sc.proj}
    stream, broken = model.embed_max, None
    prev = model.read("ffnFused", model.bottom, "x2n_inv")

    def note(what, layer, value):
        nonlocal broken
        if broken is None and not (np.isfinite(value).all() and (value != 0).all() if what.endswith("norm") else
                                   np.isfinite(value).all()):
            broken = f"layer {layer}'s {what}"

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i in range(cfg.layers):
            fwd = dict(zip(("xn_inv", *qk), model.read("sdpaFwd", model.out_surface("sdpaFwd", i), "xn_inv", *qk)))
            x_next, x2, x2n_inv = model.read("ffnFused", model.out_surface("ffnFused", i), "x_next", "x2", "x2n_inv")
            for what, a in (("attention output (x2)", x2), ("output", x_next)):
                note(what, i, a)
                stream = max(stream, float(np.abs(a).max()) / sc.stream)
            # growth since the last norm (its 1/rms over this one's), or the largest rms of a head (QK-norm)
            for norm, inv, before in (("att", fwd["xn_inv"], prev), ("ffn", x2n_inv, fwd["xn_inv"]),
                                      *((("qn", fwd["q_inv"], None), ("kn", fwd["k_inv"], None)) if qk else ())):
                note(f"{norm} norm", i, inv)
                unit = sc.first_unit(norm, i)
                need[norm][i] = float((1 / inv if before is None else before / inv).max()) / unit
                if broken is None and norm_names(cfg)[norm] * (need[norm][i] * unit * sc.norms[norm][i]) ** 2 >= SUM_LIMIT:
                    broken = f"layer {i}'s {norm} norm (its first sum of squares reached 2^15)"
            for name, key in (("wq", "q_pre"), ("wk", "k_pre")) if qk else ():
                note(f"{name} projection", i, fwd[key])
                proj[name][i] = float(np.abs(fwd[key]).max()) / sc.proj[name][i]
            prev = x2n_inv
    if broken is None and stream * sc.stream >= VALUE_LIMIT:
        broken = "residual stream"
    return Observed(stream, need, proj, broken)
