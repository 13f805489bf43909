"""AdamW, global-norm clipping, the warmup + cosine schedule and loss scaling (docs/ane-reference.md §4.5)."""

import math
from dataclasses import dataclass

import numpy as np

from .fp16 import chunks


@dataclass
class Schedule:
    """Linear warmup over `warmup` micro-steps, then cosine from max_lr down to min_frac·max_lr."""
    max_lr: float = 3e-4
    warmup: int = 100
    total: int = 10000
    min_frac: float = 0.1

    def lr(self, step):
        if step < self.warmup:
            return self.max_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        lo = self.min_frac * self.max_lr
        return lo + 0.5 * (self.max_lr - lo) * (1 + math.cos(math.pi * progress))


CHUNK = 1 << 16          # elements per piece of the update: its five arrays stay in a core's L2 cache


class AdamW:
    """Bias-corrected Adam with decoupled weight decay scaled by lr; no decay on norm weights."""

    def __init__(self, params, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1):
        self.b1, self.b2, self.eps, self.wd = b1, b2, eps, weight_decay
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    @staticmethod
    def decays(name):
        return "rms" not in name

    def step(self, params, grads, lr):
        """w ← w·(1 − lr·wd) − lr·m̂/(√v̂ + eps), in place, in cache-sized pieces with one work buffer."""
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        work = np.empty(min(CHUNK, max(w.size for w in params.values())), np.float32)
        for k, w in params.items():
            decay = lr * self.wd if self.decays(k) else 0.0
            for w_, g, m, v in chunks(w, grads[k], self.m[k], self.v[k], size=CHUNK):
                t = work[:w_.size]
                m *= self.b1
                np.multiply(g, 1 - self.b1, out=t)
                m += t
                v *= self.b2
                np.multiply(g, g, out=t)
                t *= 1 - self.b2
                v += t
                np.sqrt(v, out=t)                     # √v̂ + eps = √v/√c2 + eps
                t *= 1 / math.sqrt(c2)
                t += self.eps
                np.divide(m, t, out=t)
                t *= lr / c1                          # lr·m̂/(√v̂ + eps)
                if decay:
                    w_ *= 1 - decay
                w_ -= t

    def state_dict(self):
        return {"t": self.t, "m": self.m, "v": self.v}

    def load_state_dict(self, state):
        self.t = int(state["t"])
        for k in self.m:
            self.m[k][...] = state["m"][k]
            self.v[k][...] = state["v"][k]


def global_norm(grads):
    return math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads.values()))


def unscale_and_clip(grads, divisor, clip):
    """Divide gradients by loss_scale·accum, clip to global L2 norm `clip`; returns the norm before
    clipping, or None when a gradient is inf/NaN (the update must then be skipped)."""
    for g in grads.values():
        g *= 1.0 / divisor
    norm = global_norm(grads)
    if not math.isfinite(norm):
        return None
    if clip and norm > clip:
        for g in grads.values():
            g *= clip / norm
    return norm


DEFAULT_LOSS_SCALE = 256.0     # the reference's constant


class LossScaler:
    """Static (by default the reference's constant 256) or dynamic loss scaling.

    Dynamic: halve on an inf/NaN gradient (that update is skipped), double after `growth_interval`
    clean updates.
    """

    def __init__(self, scale=DEFAULT_LOSS_SCALE, dynamic=False, growth_interval=200, max_scale=2.0 ** 16):
        self.scale, self.dynamic = float(scale), dynamic
        self.growth_interval, self.max_scale, self.clean = growth_interval, max_scale, 0

    def update(self, finite):
        if not self.dynamic:
            return
        if not finite:
            self.scale, self.clean = max(1.0, self.scale / 2), 0
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale, self.clean = min(self.max_scale, self.scale * 2), 0

    def state_dict(self):
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state):
        self.scale, self.clean = float(state["scale"]), int(state["clean"])
