"""AdamW, global-norm clipping, the warmup + cosine schedule and loss scaling (docs/ane-reference.md §4.5), and
the update that applies them to a model (update_model)."""

import math
from dataclasses import dataclass

import numpy as np

from ..host import accelerate
from ..host.chunks import UPDATE_CHUNK, chunks, in_lanes


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


class AdamW:
    """Bias-corrected Adam with decoupled weight decay scaled by lr; no decay on norm weights."""

    def __init__(self, params, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1):
        self.b1, self.b2, self.eps, self.wd = b1, b2, eps, weight_decay
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    @staticmethod
    def decays(name):
        return "rms" not in name and not name.endswith("_norm")

    def step(self, params, grads, lr, scale=1.0, zero_grads=False, stage=None, map=map, lanes=1):
        """w ← w·(1 − lr·wd) − lr·m̂/(√v̂ + eps) for the gradient scale·g, in place, in one pass over
        cache-sized pieces, dealt to `lanes` lanes (in_lanes: numpy lets go of the GIL inside each call).
        Every piece's arithmetic is the same on any lane, so the result does not depend on `lanes`.

        scale: unscaling and clipping in one factor (see clip_scales); zero_grads: the pass zeroes
        each gradient once read; stage(name): called when a weight is updated (the model re-stages it).
        The constants are folded: m ← b1·m + u with u = (1 − b1)·scale·g, v ← b2·v + u²·(1 − b2)/(1 − b1)²,
        and lr·m̂/(√v̂ + eps) = (lr·√c2/c1)·m/(√v + eps·√c2)."""
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        gm, gv = (1 - self.b1) * scale, (1 - self.b2) / (1 - self.b1) ** 2
        step_size, eps = lr * math.sqrt(c2) / c1, self.eps * math.sqrt(c2)
        work = np.empty((lanes, 2, min(UPDATE_CHUNK, max(w.size for w in params.values()))), np.float32)
        for k, w in params.items():
            decay = lr * self.wd if self.decays(k) else 0.0

            def lane(i, pieces):
                for w_, g, m, v in pieces:
                    u, t = work[i, 0, :w_.size], work[i, 1, :w_.size]
                    if accelerate.adamw(w_, g, m, v, t, self.b1, gm, self.b2, gv, eps, step_size, 1 - decay,
                                        zero_grads):
                        continue                             # the same operations in vDSP, in 9 passes
                    np.multiply(g, gm, out=u)
                    if zero_grads:
                        g.fill(0)
                    m *= self.b1
                    m += u
                    u *= u
                    u *= gv
                    v *= self.b2
                    v += u
                    np.sqrt(v, out=t)
                    t += eps
                    np.divide(m, t, out=t)
                    t *= step_size
                    if decay:
                        w_ *= 1 - decay
                    w_ -= t
            in_lanes(lane, list(chunks(w, grads[k], self.m[k], self.v[k], size=UPDATE_CHUNK)), lanes, map)
            if stage:
                stage(k)

    def state_dict(self):
        return {"t": self.t, "m": self.m, "v": self.v}

    def load_state_dict(self, state):
        self.t = int(state["t"])
        for k in self.m:
            self.m[k][...] = state["m"][k]
            self.v[k][...] = state["v"][k]


def global_norm(grads, scale=1.0, map=map, lanes=1):
    """The L2 norm of scale·g over all gradients, in pieces dealt to `lanes` lanes like AdamW.step's
    (nothing written); the pieces' sums of squares are added in order, whatever the lanes."""
    pieces = [flat for g in grads.values() for (flat,) in chunks(g, size=UPDATE_CHUNK)]
    squares = np.zeros(len(pieces))

    def lane(_, numbered):
        work = np.empty(UPDATE_CHUNK, np.float32)
        for j, piece in numbered:
            fast = accelerate.sum_squares(piece)              # one pass instead of two; scaled in float64
            if fast is not None:
                squares[j] = fast * scale * scale
                continue
            t = work[:piece.size]
            np.multiply(piece, scale, out=t)
            squares[j] = np.dot(t, t)
    in_lanes(lane, list(enumerate(pieces)), lanes, map)
    total = 0.0
    for x in squares:
        total += x
    return math.sqrt(total)


def clip_scales(grads, divisor, clip, map=map, lanes=1):
    """(norm, scale): the norm of the gradients divided by loss_scale·accum, and the one factor that
    unscales them and clips them to global L2 norm `clip`; (None, None) when a gradient is inf/NaN
    (the update must then be skipped)."""
    norm = global_norm(grads, 1.0 / divisor, map, lanes)
    if not math.isfinite(norm):
        return None, None
    return norm, (clip / norm if clip and norm > clip else 1.0) / divisor


class LossScaler:
    """Static or dynamic loss scaling (the run spec's default scale is the reference's 256).

    Dynamic: halve on an inf/NaN gradient (that update is skipped), double after `growth_interval`
    clean updates.
    """

    def __init__(self, scale, dynamic=False, growth_interval=200, max_scale=2.0 ** 16):
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


def update_model(model, opt, lr, divisor, clip):
    """One update of a Transformer's weights from its gradients: unscale them by `divisor`, clip them to
    norm `clip`, take an AdamW step that zeroes them in the same pass, and have the model re-stage each
    weight as soon as it is updated. Returns the norm, or None for an inf/NaN gradient (then the weights
    are left alone and the gradients zeroed)."""
    grads = model.complete_grads()
    norm, scale = clip_scales(grads, divisor, clip, model.cpu.map, model.lanes)
    if norm is None:
        model.zero_grads()
        return None
    opt.step(model.trainable, grads, lr, scale, zero_grads=True, stage=model.stage, map=model.cpu.map, lanes=model.lanes)
    if "embed" in model.trainable:
        model.refresh_embedding()
    return norm
