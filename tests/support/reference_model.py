"""Independent float64 numpy reference of the anectypes Llama-style model.

This module is the ground truth that the training pipeline is tested against.
It deliberately shares no code with the ``anectypes`` package: everything is
plain numpy in float64, with an analytic backward pass.

Model contract (one sequence of length S):

* ``x = embed[tokens]``
* per layer ``i`` (``alpha = 1/sqrt(2*layers)``, or 1 when ``residual_scaled`` is False)::

      xn  = rmsnorm(x, rms_att)
      q, k, v = xn @ wq.T, xn @ wk.T, xn @ wv.T        # split into heads
      q, k = rmsnorm(q, q_norm), rmsnorm(k, k_norm)     # per head, only with qk_norm
      q, k = rope(q), rope(k)                           # interleaved pairs (llama3-scaled frequencies
                                                        # with rope_type "llama3")
      attn = causal softmax(q k^T / sqrt(head_dim)) v   # GQA: head h -> kv h // ratio
      x2  = x + alpha * (attn @ wo.T)
      x2n = rmsnorm(x2, rms_ffn)
      g   = silu(x2n @ w1.T) * (x2n @ w3.T)
      x   = x2 + alpha * (g @ w2.T)

* ``logits = rmsnorm(x, rms_final) @ embed[active].T`` (tied, compact vocab; ``classifier`` in place
  of ``embed`` when ``tied`` is False)
* ``loss = mean_s CE(logits[s], index of targets[s] in active)``

Matrices are stored ``[out, in]`` like ``nn.Linear``.  Head layout: channel
``c`` of q belongs to head ``c // head_dim``, dimension ``c % head_dim``.

Public API
----------
``init_params(cfg, seed, std=0.02)``, ``forward``, ``backward``,
``loss_and_grads``, ``param_shapes``, plus piecewise references:
``rmsnorm``/``rmsnorm_backward``, ``rope``/``rope_backward``,
``attention_forward``/``attention_backward``, ``silu``,
``silu_gate``/``silu_gate_backward``, ``cross_entropy``,
``to_heads``/``from_heads``, ``target_indices``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "RefConfig",
    "alpha",
    "param_shapes",
    "init_params",
    "rmsnorm",
    "rmsnorm_backward",
    "rope_tables",
    "rope",
    "rope_backward",
    "to_heads",
    "from_heads",
    "attention_forward",
    "attention_backward",
    "sigmoid",
    "silu",
    "silu_gate",
    "silu_gate_backward",
    "cross_entropy",
    "target_indices",
    "forward",
    "backward",
    "loss_and_grads",
]

LAYER_KEYS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "rms_att", "rms_ffn")


@dataclass
class RefConfig:
    """Convenience config; any object with these attributes is accepted."""

    dim: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seq: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


# --------------------------------------------------------------------------
# config helpers
# --------------------------------------------------------------------------

def _eps(cfg) -> float:
    return float(getattr(cfg, "norm_eps", 1e-5))


def _theta(cfg) -> float:
    return float(getattr(cfg, "rope_theta", 10000.0))


def _dims(cfg):
    heads, kv_heads, hd = int(cfg.heads), int(cfg.kv_heads), int(cfg.head_dim)
    if heads % kv_heads:
        raise ValueError(f"heads={heads} not a multiple of kv_heads={kv_heads}")
    if hd % 2:
        raise ValueError(f"head_dim={hd} must be even for RoPE")
    return heads, kv_heads, hd, heads * hd, kv_heads * hd


def alpha(cfg) -> float:
    """Residual scale 1/sqrt(2*layers), or 1 without residual scaling."""
    return 1.0 / math.sqrt(2.0 * int(cfg.layers)) if getattr(cfg, "residual_scaled", True) else 1.0


def frequencies(cfg, head_dim: int):
    """theta^(-2j/hd) per pair j; with rope_type "llama3", Meta's scaling of Llama 3.1, written out as
    its reference code (apply_scaling in llama/model.py) does it, frequency by frequency."""
    freqs = _theta(cfg) ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)
    if getattr(cfg, "rope_type", "default") != "llama3":
        return freqs
    factor, low, high, old = cfg.rope_factor, cfg.rope_low_freq, cfg.rope_high_freq, cfg.rope_original_context
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def param_shapes(cfg) -> dict:
    """Ordered mapping of parameter name -> shape."""
    dim, hidden = int(cfg.dim), int(cfg.hidden)
    _, _, _, q_dim, kv_dim = _dims(cfg)
    shapes = {}
    for i in range(int(cfg.layers)):
        p = f"layers.{i}."
        shapes[p + "wq"] = (q_dim, dim)
        shapes[p + "wk"] = (kv_dim, dim)
        shapes[p + "wv"] = (kv_dim, dim)
        shapes[p + "wo"] = (dim, q_dim)
        shapes[p + "w1"] = (hidden, dim)
        shapes[p + "w2"] = (dim, hidden)
        shapes[p + "w3"] = (hidden, dim)
        shapes[p + "rms_att"] = (dim,)
        shapes[p + "rms_ffn"] = (dim,)
        if getattr(cfg, "qk_norm", False):
            shapes[p + "q_norm"] = (int(cfg.head_dim),)
            shapes[p + "k_norm"] = (int(cfg.head_dim),)
    shapes["rms_final"] = (dim,)
    shapes["embed"] = (int(cfg.vocab), dim)
    if not getattr(cfg, "tied", True):
        shapes["classifier"] = (int(cfg.vocab), dim)
    return shapes


def init_params(cfg, seed: int = 0, std: float = 0.02, norm_std: float = 0.1) -> dict:
    """Random float64 parameters.

    Matrices and the embedding are ``std * normal``; RMSNorm weights are
    ``1 + norm_std * normal`` so that their gradients are exercised.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            params[name] = 1.0 + norm_std * rng.standard_normal(shape)
        else:
            params[name] = std * rng.standard_normal(shape)
    return params


# --------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------

def rmsnorm(x, w, eps: float = 1e-5):
    """x / sqrt(mean(x^2, -1) + eps) * w."""
    x = np.asarray(x, dtype=np.float64)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w


def rmsnorm_backward(x, w, dy, eps: float = 1e-5):
    """Gradients of rmsnorm wrt x and w.  Returns (dx, dw); dw is summed over
    all leading axes."""
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * r
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    dxhat = dy * w
    # d(xhat)/dx = r (I - xhat xhat^T / n)
    dx = r * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx, dw


# --------------------------------------------------------------------------
# RoPE (interleaved pairs)
# --------------------------------------------------------------------------

def rope_tables(seq_len: int, head_dim: int, theta=10000.0, positions=None):
    """cos, sin tables of shape [S, head_dim/2]; theta: the base, or a config (its frequencies)."""
    if positions is None:
        positions = np.arange(seq_len, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.float64)
    j = np.arange(head_dim // 2, dtype=np.float64)
    freq = theta ** (-2.0 * j / head_dim) if np.isscalar(theta) else frequencies(theta, head_dim)
    ang = positions[:, None] * freq[None, :]
    return np.cos(ang), np.sin(ang)


def _rotate(x, cos, sin):
    a = x[..., 0::2]
    b = x[..., 1::2]
    out = np.empty_like(x, dtype=np.float64)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def rope(x, theta=10000.0, positions=None):
    """Rotate pairs (2j, 2j+1) of x[..., S, head_dim] by pos * theta^(-2j/hd).

    Positions default to 0..S-1 along axis -2.
    """
    x = np.asarray(x, dtype=np.float64)
    cos, sin = rope_tables(x.shape[-2], x.shape[-1], theta, positions)
    return _rotate(x, cos, sin)


def rope_backward(g, theta=10000.0, positions=None):
    """Transpose (= inverse) of rope: rotation by the negative angle."""
    g = np.asarray(g, dtype=np.float64)
    cos, sin = rope_tables(g.shape[-2], g.shape[-1], theta, positions)
    return _rotate(g, cos, -sin)


# --------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------

def to_heads(a, n_heads: int, head_dim: int):
    """[S, n*hd] -> [n, S, hd] (channel c -> head c // hd, dim c % hd)."""
    S = a.shape[0]
    return a.reshape(S, n_heads, head_dim).transpose(1, 0, 2)


def from_heads(a):
    """[n, S, hd] -> [S, n*hd]."""
    n, S, hd = a.shape
    return a.transpose(1, 0, 2).reshape(S, n * hd)


def _expand_kv(t, ratio: int):
    # query head h uses kv head h // ratio
    return np.repeat(t, ratio, axis=0)


def _reduce_kv(t, ratio: int):
    n, S, hd = t.shape
    return t.reshape(n // ratio, ratio, S, hd).sum(axis=1)


def attention_forward(q, k, v):
    """Causal scaled-dot-product attention with GQA.

    q: [heads, S, hd] (already RoPE'd); k, v: [kv_heads, S, hd].
    Query head h attends with kv head h // (heads // kv_heads).
    Returns (out [heads, S, hd], probs [heads, S, S]).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    H, S, hd = q.shape
    kvh = k.shape[0]
    if H % kvh:
        raise ValueError("heads must be a multiple of kv_heads")
    ratio = H // kvh
    ke = _expand_kv(k, ratio)
    ve = _expand_kv(v, ratio)
    scores = (q @ ke.transpose(0, 2, 1)) / math.sqrt(hd)
    mask = np.triu(np.ones((S, S), dtype=bool), k=1)  # key > query
    scores = np.where(mask, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    probs = e / e.sum(axis=-1, keepdims=True)
    out = probs @ ve
    return out, probs


def attention_backward(q, k, v, probs, dout):
    """Backward of attention_forward.  Returns (dq, dk, dv) with the shapes of
    q, k, v (dk, dv summed over each kv head's group of query heads)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    dout = np.asarray(dout, dtype=np.float64)
    H, S, hd = q.shape
    ratio = H // k.shape[0]
    ke = _expand_kv(k, ratio)
    ve = _expand_kv(v, ratio)
    scale = 1.0 / math.sqrt(hd)
    dve = probs.transpose(0, 2, 1) @ dout
    dprobs = dout @ ve.transpose(0, 2, 1)
    ds = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True))
    dq = (ds @ ke) * scale
    dke = (ds.transpose(0, 2, 1) @ q) * scale
    return dq, _reduce_kv(dke, ratio), _reduce_kv(dve, ratio)


# --------------------------------------------------------------------------
# SwiGLU gate
# --------------------------------------------------------------------------

def sigmoid(z):
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def silu(z):
    z = np.asarray(z, dtype=np.float64)
    return z * sigmoid(z)


def silu_gate(h1, h3):
    """g = silu(h1) * h3."""
    return silu(h1) * h3


def silu_gate_backward(h1, h3, dg):
    """Returns (dh1, dh3) for g = silu(h1) * h3."""
    h1 = np.asarray(h1, dtype=np.float64)
    s = sigmoid(h1)
    dh3 = dg * h1 * s
    dh1 = dg * h3 * s * (1.0 + h1 * (1.0 - s))
    return dh1, dh3


# --------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------

def cross_entropy(logits, target_idx):
    """Mean cross-entropy over rows.  Returns (loss, dlogits) where dlogits is
    (softmax - onehot) / n_rows.  Rows whose target index is -1 are left out: not in the mean, no
    gradient."""
    logits = np.asarray(logits, dtype=np.float64)
    target_idx = np.asarray(target_idx, dtype=np.int64)
    m = logits.max(axis=-1, keepdims=True)
    z = logits - m
    lse = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = z - lse
    rows = np.flatnonzero(target_idx >= 0)
    losses = -logp[rows, target_idx[rows]]
    dlogits = np.exp(logp)
    dlogits[rows, target_idx[rows]] -= 1.0
    dlogits[target_idx < 0] = 0.0
    return float(losses.mean()), dlogits / len(rows)


def _per_position_ce(logits, target_idx):
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -logp[np.arange(logits.shape[0]), target_idx]


def target_indices(active, targets):
    """Index of each target within the sorted compact vocabulary ``active``; a target -1 stays -1."""
    active = np.asarray(active, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.int64)
    if active.ndim != 1 or active.size == 0:
        raise ValueError("active must be a non-empty 1-D array")
    if np.any(np.diff(active) <= 0):
        raise ValueError("active must be sorted and unique")
    idx = np.searchsorted(active, targets)
    idx_c = np.minimum(idx, active.size - 1)
    if np.any((active[idx_c] != targets) & (targets != -1)):
        raise ValueError("every target must be in active")
    return np.where(targets == -1, -1, idx_c)


# --------------------------------------------------------------------------
# full model
# --------------------------------------------------------------------------

def forward(params, cfg, tokens, targets, active):
    """Forward pass for one sequence.  Returns (loss, cache).

    ``cache`` holds every activation needed by :func:`backward`, plus
    ``logits`` [S, len(active)] and ``losses`` (per-position cross-entropy).
    """
    heads, kv_heads, hd, q_dim, kv_dim = _dims(cfg)
    eps, theta, a = _eps(cfg), cfg, alpha(cfg)          # theta: the config, for its frequencies
    qk_norm = getattr(cfg, "qk_norm", False)
    tokens = np.asarray(tokens, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.int64)
    active = np.asarray(active, dtype=np.int64)
    if tokens.ndim != 1 or tokens.shape != targets.shape:
        raise ValueError("tokens and targets must be 1-D and of equal length")
    tidx = target_indices(active, targets)

    embed = params["embed"]
    x = embed[tokens].astype(np.float64)
    layers = []
    for i in range(int(cfg.layers)):
        p = f"layers.{i}."
        lc = {"x": x}
        xn = rmsnorm(x, params[p + "rms_att"], eps)
        q = to_heads(xn @ params[p + "wq"].T, heads, hd)
        k = to_heads(xn @ params[p + "wk"].T, kv_heads, hd)
        v = to_heads(xn @ params[p + "wv"].T, kv_heads, hd)
        lc.update(q_pre=q, k_pre=k)
        if qk_norm:
            q, k = rmsnorm(q, params[p + "q_norm"], eps), rmsnorm(k, params[p + "k_norm"], eps)
        qr = rope(q, theta)
        kr = rope(k, theta)
        attn_h, probs = attention_forward(qr, kr, v)
        attn = from_heads(attn_h)
        o = attn @ params[p + "wo"].T
        x2 = x + a * o
        x2n = rmsnorm(x2, params[p + "rms_ffn"], eps)
        h1 = x2n @ params[p + "w1"].T
        h3 = x2n @ params[p + "w3"].T
        g = silu_gate(h1, h3)
        x = x2 + a * (g @ params[p + "w2"].T)
        lc.update(xn=xn, qr=qr, kr=kr, v=v, probs=probs, attn=attn,
                  x2=x2, x2n=x2n, h1=h1, h3=h3, g=g)
        layers.append(lc)

    xf = rmsnorm(x, params["rms_final"], eps)
    logits = xf @ params.get("classifier", embed)[active].T
    loss, dlogits = cross_entropy(logits, tidx)
    cache = {
        "tokens": tokens,
        "targets": targets,
        "active": active,
        "target_idx": tidx,
        "layers": layers,
        "x_final_in": x,
        "xf": xf,
        "logits": logits,
        "losses": _per_position_ce(logits, tidx),
        "dlogits": dlogits,
        "loss": loss,
    }
    return loss, cache


def backward(params, cfg, cache):
    """Analytic float64 gradients of the mean loss; same keys/shapes as params."""
    heads, kv_heads, hd, q_dim, kv_dim = _dims(cfg)
    eps, theta, a = _eps(cfg), cfg, alpha(cfg)
    tokens, active = cache["tokens"], cache["active"]
    embed = params["embed"]
    grads = {}

    dlogits = cache["dlogits"]
    dembed = np.zeros_like(embed, dtype=np.float64)
    # the classifier: logits = xf @ cls[active].T  (active is unique); tied, cls is the embedding
    untied = "classifier" in params
    cls = params["classifier"] if untied else embed
    dcls = np.zeros_like(cls, dtype=np.float64) if untied else dembed
    dcls[active] += dlogits.T @ cache["xf"]
    if untied:
        grads["classifier"] = dcls
    dxf = dlogits @ cls[active]
    dx, grads["rms_final"] = rmsnorm_backward(
        cache["x_final_in"], params["rms_final"], dxf, eps)

    for i in reversed(range(int(cfg.layers))):
        p = f"layers.{i}."
        lc = cache["layers"][i]
        # FFN: x_out = x2 + a * g @ w2.T
        dffn = a * dx
        grads[p + "w2"] = dffn.T @ lc["g"]
        dg = dffn @ params[p + "w2"]
        dh1, dh3 = silu_gate_backward(lc["h1"], lc["h3"], dg)
        grads[p + "w1"] = dh1.T @ lc["x2n"]
        grads[p + "w3"] = dh3.T @ lc["x2n"]
        dx2n = dh1 @ params[p + "w1"] + dh3 @ params[p + "w3"]
        dx2_norm, grads[p + "rms_ffn"] = rmsnorm_backward(
            lc["x2"], params[p + "rms_ffn"], dx2n, eps)
        dx2 = dx + dx2_norm
        # attention: x2 = x + a * attn @ wo.T
        do = a * dx2
        grads[p + "wo"] = do.T @ lc["attn"]
        dattn = to_heads(do @ params[p + "wo"], heads, hd)
        dqr, dkr, dv = attention_backward(lc["qr"], lc["kr"], lc["v"], lc["probs"], dattn)
        dq, dk = rope_backward(dqr, theta), rope_backward(dkr, theta)
        if p + "q_norm" in params:
            dq, grads[p + "q_norm"] = rmsnorm_backward(lc["q_pre"], params[p + "q_norm"], dq, eps)
            dk, grads[p + "k_norm"] = rmsnorm_backward(lc["k_pre"], params[p + "k_norm"], dk, eps)
        dq, dk = from_heads(dq), from_heads(dk)
        dv = from_heads(dv)
        xn = lc["xn"]
        grads[p + "wq"] = dq.T @ xn
        grads[p + "wk"] = dk.T @ xn
        grads[p + "wv"] = dv.T @ xn
        dxn = dq @ params[p + "wq"] + dk @ params[p + "wk"] + dv @ params[p + "wv"]
        dx_norm, grads[p + "rms_att"] = rmsnorm_backward(
            lc["x"], params[p + "rms_att"], dxn, eps)
        dx = dx2 + dx_norm

    np.add.at(dembed, tokens, dx)
    grads["embed"] = dembed
    return {name: grads[name] for name in params}


def loss_and_grads(params, cfg, tokens, targets, active):
    """Convenience: (loss, grads) for one sequence."""
    loss, cache = forward(params, cfg, tokens, targets, active)
    return loss, backward(params, cfg, cache)
