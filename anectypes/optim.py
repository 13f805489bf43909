"""AdamW, global-norm clipping, the warmup + cosine schedule and loss scaling (docs/ane-reference.md §4.5)."""

import math
from dataclasses import dataclass

import numpy as np


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


CHUNK = 1 << 15          # elements per piece of the update, about: its arrays stay in a core's cache


def pieces(*arrays):
    """Matching flat views of whole rows of C-contiguous arrays of one shape, about CHUNK elements
    each, with the rows they hold: (rows, flat views)."""
    n = len(arrays[0]) if arrays[0].ndim else 1
    per_row = arrays[0].size // max(n, 1) or 1
    step = max(1, CHUNK // per_row)
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        yield rows, [a[rows].reshape(-1) for a in arrays]


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

    def step(self, params, grads, lr, scales=(), zero_grads=False, stage=None, groups=None, map=map):
        """w ← w·(1 − lr·wd) − lr·m̂/(√v̂ + eps), in place, in one pass over cache-sized pieces of rows.

        scales: factors the gradient is multiplied by first, in order (see clip_scales); zero_grads:
        the pass zeroes each gradient once read. stage(name, rows): called after those rows of a weight
        are updated, while they are in cache (the model re-stages them into its surfaces). groups:
        lists of names updated one after another, the groups concurrently through `map` (e.g. an
        executor's); one group's stage must not touch what another group's does."""
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t

        def update(names):
            work = np.empty((2, CHUNK), np.float32)
            for k in names:
                decay = lr * self.wd if self.decays(k) else 0.0
                for rows, (w, g, m, v) in pieces(params[k], grads[k], self.m[k], self.v[k]):
                    t, u = work[0, :w.size], work[1, :w.size]
                    np.multiply(g, scales[0], out=u) if scales else np.copyto(u, g)
                    for s in scales[1:]:
                        u *= s
                    if zero_grads:
                        g.fill(0)
                    m *= self.b1
                    np.multiply(u, 1 - self.b1, out=t)
                    m += t
                    v *= self.b2
                    u *= u
                    u *= 1 - self.b2
                    v += u
                    np.sqrt(v, out=t)                     # √v̂ + eps = √v/√c2 + eps
                    t *= 1 / math.sqrt(c2)
                    t += self.eps
                    np.divide(m, t, out=t)
                    t *= lr / c1                          # lr·m̂/(√v̂ + eps)
                    if decay:
                        w *= 1 - decay
                    w -= t
                    if stage:
                        stage(k, rows)

        for _ in map(update, groups or [list(params)]):
            pass

    def state_dict(self):
        return {"t": self.t, "m": self.m, "v": self.v}

    def load_state_dict(self, state):
        self.t = int(state["t"])
        for k in self.m:
            self.m[k][...] = state["m"][k]
            self.v[k][...] = state["v"][k]


def global_norm(grads, scale=1.0):
    """The L2 norm of scale·g over all gradients, in pieces (nothing written)."""
    work, total = np.empty(CHUNK, np.float32), 0.0
    for g in grads.values():
        for _, (flat,) in pieces(g):
            t = work[:flat.size]
            np.multiply(flat, scale, out=t)
            total += float(np.dot(t, t))
    return math.sqrt(total)


def clip_scales(grads, divisor, clip):
    """(norm, scales) to unscale gradients by loss_scale·accum and clip them to global L2 norm `clip`:
    the norm before clipping and the factors AdamW.step applies, or (None, None) when a gradient is
    inf/NaN (the update must then be skipped)."""
    norm = global_norm(grads, 1.0 / divisor)
    if not math.isfinite(norm):
        return None, None
    return norm, (1.0 / divisor, clip / norm) if clip and norm > clip else (1.0 / divisor,)


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
