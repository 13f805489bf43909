"""Inference on the CPU with a KV cache: the training architecture (RMSNorm, interleaved-pair RoPE, GQA
where query head h reads kv head h // ratio, α-scaled residuals, SwiGLU, tied classifier), computed in
float32 with numpy and `anectypes.blas`.

A session feeds tokens at consecutive positions: a prompt in one pass (prefill: every projection one
sgemm over its rows), then one token at a time (decode: every projection one sgemv, bound once per
session, since OpenBLAS's sgemm with one row is many times slower), attending to the keys and values
of all earlier positions, which stay in the cache. Every buffer is allocated once per decoder, sized
for `seq` positions; a step only fills views of them.
"""

import numpy as np

from .. import blas
from .kernels import rope_tables

LAYER_PARAMS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "rms_att", "rms_ffn")
# projection: (input buffer, output buffer, adds into the output (a residual, scaled by α))
PROJECTIONS = {"wq": ("xn", "q", False), "wk": ("xn", "k", False), "wv": ("xn", "v", False),
               "wo": ("att", "x", True), "w1": ("xn", "h1", False), "w3": ("xn", "h3", False),
               "w2": ("h1", "x", True)}


def rmsnorm_rows(x, w, eps, out):
    """out = x / √(mean(x²) + eps) · w for each row of x [P, dim]."""
    inv = 1.0 / np.sqrt(np.einsum("pd,pd->p", x, x) / np.float32(x.shape[1]) + np.float32(eps))
    np.multiply(x, inv[:, None], out=out)
    out *= w
    return out


def rope_rows(t, heads, cos, sin):
    """Rotate each pair (a, b) of channels (2j, 2j+1) of each head of t [P, heads·hd] in place to
    (a·cos − b·sin, b·cos + a·sin), with cos/sin [P, hd/2] of the rows' positions (§3.4)."""
    pairs = t.reshape(len(t), heads, -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    a_sin = a * s
    a *= c
    a -= b * s
    b *= c
    b += a_sin


def softmax_rows(s):
    """Softmax over the last axis, in place."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)


class Decoder:
    """One model's weights and a KV-cache session: `reset()`, then `forward(tokens)` for the prompt and
    for each new token; `pos` is the number of positions fed so far."""

    def __init__(self, cfg, params, *, alpha=None, classifier=None, vocab_ids=None):
        """params: the model's float32 parameters by name (config.param_shapes); alpha: the residual
        scale (default cfg.alpha; llama2.c's models have none: 1); classifier: the output matrix
        [vocab, dim] when it is not the embedding; vocab_ids: the ids the logits cover, in order (a
        compact vocabulary, §4.7; default all)."""
        self.cfg, S, r = cfg, cfg.seq, cfg.gqa_ratio
        self.alpha = np.float32(cfg.alpha if alpha is None else alpha)
        self.embed, self.rms_final = params["embed"], params["rms_final"]
        cls = params["embed"] if classifier is None else classifier
        self.vocab_ids = None if vocab_ids is None else np.asarray(vocab_ids, np.int64)
        self.cls = cls if self.vocab_ids is None else np.ascontiguousarray(cls[self.vocab_ids])
        self.layers = [{k: params[f"layers.{i}.{k}"] for k in LAYER_PARAMS} for i in range(cfg.layers)]
        cos, sin = rope_tables(cfg)                                  # [hd/2, S], as the kernels use them
        self.cos, self.sin = (np.ascontiguousarray(t.T, np.float32) for t in (cos, sin))
        self.mask = np.triu(np.full((S, S), -np.inf, np.float32), 1)   # row: position; column: key
        buf = lambda *shape: np.zeros(shape, np.float32)
        self.buf = dict(x=buf(S, cfg.dim), xn=buf(S, cfg.dim), q=buf(S, cfg.q_dim), k=buf(S, cfg.kv_dim),
                        v=buf(S, cfg.kv_dim), att=buf(S, cfg.q_dim), h1=buf(S, cfg.hidden), h3=buf(S, cfg.hidden),
                        gate=buf(S, cfg.hidden))
        self.keys, self.values = buf(cfg.layers, cfg.kv_heads, S, cfg.head_dim), buf(cfg.layers, cfg.kv_heads, S, cfg.head_dim)
        self.scores = buf(cfg.kv_heads * S * r * S)                  # [kv heads, rows·r, keys], flat
        self.xf, self.logits = buf(cfg.dim), buf(len(self.cls))
        # decode: every projection of row 0 as a bound sgemv, and the classifier
        self.gemv = [{name: blas.sgemv_call(w[name], self.buf[src][0], self.buf[dst][0],
                                            alpha=self.alpha if add else 1.0, beta=1.0 if add else 0.0)
                      for name, (src, dst, add) in PROJECTIONS.items()} for w in self.layers]
        self.classify = blas.sgemv_call(self.cls, self.xf, self.logits)
        self.pos = 0

    @property
    def weight_bytes(self):
        """Bytes of weights one decode step reads: every layer's, the final norm's and the classifier's."""
        return sum(w.nbytes for layer in self.layers for w in layer.values()) + self.rms_final.nbytes + self.cls.nbytes

    def token_id(self, index):
        """The token id of an index into the logits."""
        return index if self.vocab_ids is None else int(self.vocab_ids[index])

    def reset(self):
        """Start a new sequence at position 0 (the cache's old entries are overwritten as it goes)."""
        self.pos = 0

    def forward(self, tokens, all_logits=False):
        """Feed `tokens` at positions pos, pos+1, ...; the logits after the last one (a view, valid
        until the next call), or with all_logits those after each one [P, vocab] (a new array)."""
        P, cfg = len(tokens), self.cfg
        if not 1 <= P <= cfg.seq - self.pos:
            raise ValueError(f"{P} tokens at position {self.pos} do not fit in seq {cfg.seq}")
        x = self.buf["x"][:P]
        np.take(self.embed, tokens, axis=0, out=x)
        for i in range(cfg.layers):
            self.layer(i, P)
        self.pos += P
        if all_logits:
            xf = rmsnorm_rows(x, self.rms_final, cfg.norm_eps, np.empty_like(x))
            return blas.sgemm(xf, self.cls, trans_b=True)
        rmsnorm_rows(x[P - 1:], self.rms_final, cfg.norm_eps, self.xf[None])
        self.classify()
        return self.logits

    def project(self, i, name, P):
        """A projection of P rows: the bound sgemv for one, else one sgemm."""
        if P == 1:
            return self.gemv[i][name]()
        src, dst, add = PROJECTIONS[name]
        blas.sgemm(self.buf[src][:P], self.layers[i][name], self.buf[dst][:P], trans_b=True,
                   alpha=self.alpha if add else 1.0, beta=1.0 if add else 0.0)

    def layer(self, i, P):
        cfg, w, b = self.cfg, self.layers[i], {k: v[:P] for k, v in self.buf.items()}
        pos, end, kvh, r, hd = self.pos, self.pos + P, cfg.kv_heads, cfg.gqa_ratio, cfg.head_dim
        rmsnorm_rows(b["x"], w["rms_att"], cfg.norm_eps, b["xn"])
        for name in ("wq", "wk", "wv"):
            self.project(i, name, P)
        cos, sin = self.cos[pos:end], self.sin[pos:end]
        rope_rows(b["q"], cfg.heads, cos, sin)
        rope_rows(b["k"], kvh, cos, sin)
        b["q"] *= np.float32(1.0 / np.sqrt(hd))                       # on q, as the kernels scale it
        keys, values = self.keys[i, :, :end], self.values[i, :, :end]      # [kv heads, positions, hd]
        keys[:, pos:] = b["k"].reshape(P, kvh, hd).transpose(1, 0, 2)
        values[:, pos:] = b["v"].reshape(P, kvh, hd).transpose(1, 0, 2)
        # query head h = g·r + j reads kv head g: the rows of group g are its queries (position, j)
        q = b["q"].reshape(P, kvh, r, hd).transpose(1, 0, 2, 3).reshape(kvh, P * r, hd)
        s = self.scores[:kvh * P * r * end].reshape(kvh, P * r, end)
        np.matmul(q, keys.transpose(0, 2, 1), out=s)
        if P > 1:
            s.reshape(kvh, P, r, end)[...] += self.mask[pos:end, :end][:, None, :]
        softmax_rows(s)
        heads = np.matmul(s, values)                                  # [kv heads, P·r, hd]
        b["att"][...] = heads.reshape(kvh, P, r, hd).transpose(1, 0, 2, 3).reshape(P, cfg.q_dim)
        self.project(i, "wo", P)                                      # x += α·Wo·att
        rmsnorm_rows(b["x"], w["rms_ffn"], cfg.norm_eps, b["xn"])
        self.project(i, "w1", P)
        self.project(i, "w3", P)
        h1, gate = b["h1"], b["gate"]                                 # h1 ← silu(h1)·h3
        np.negative(h1, out=gate)
        np.exp(gate, out=gate)
        gate += 1
        h1 *= b["h3"]
        h1 /= gate
        self.project(i, "w2", P)                                      # x += α·W2·h1
