"""Inference on the CPU with a KV cache: the training architecture (RMSNorm, QK-norm where the model has it,
interleaved-pair RoPE (llama3-scaled where configured), GQA where query head h reads kv head h // ratio,
α-scaled residuals (or α = 1), SwiGLU, tied or untied classifier), computed in float32 with numpy and
`anectypes.host.blas`.

A session feeds tokens at consecutive positions: a prompt in one pass (prefill: every projection one
sgemm over its rows), then one token at a time (decode: every projection one sgemv, bound once per
session, since OpenBLAS's sgemm with one row is many times slower; with several lanes, each sgemv's
rows shared by as many processes, anectypes.generate.lanes), attending to the keys and values of all
earlier positions, which stay in the cache. Every buffer is allocated once per decoder, sized for
`seq` positions; a step only fills views of them.
"""

import functools
import math

import numpy as np

from ..host import accelerate, blas
from ..model.config import rope_tables
from .lanes import Lanes, private_arrays

# a layer's products: the matrices side by side ([in, out] each), the RMSNorm weight that scales their
# input (folded into their rows), the input buffer, the output buffer, whether it adds α times its
# product to the output (a residual)
PROJECTIONS = {"wqkv": (("wq", "wk", "wv"), "rms_att", "xn", "qkv", False), "wo": (("wo",), None, "att", "x", True),
               "w13": (("w1", "w3"), "rms_ffn", "xn", "h13", False), "w2": (("w2",), None, "h1", "x", True)}


def normalize_rows(x, eps, out):
    """out = x / √(mean(x²) + eps) for each row of x [P, dim]: RMSNorm without its weight, which the
    decoder folds into the rows of the matrix that reads `out` (one row, a token step: two calls)."""
    if len(x) == 1:
        return np.multiply(x, 1 / math.sqrt(float(np.dot(x[0], x[0])) / x.shape[1] + eps), out=out)
    rms = np.einsum("pd,pd->p", x, x)[:, None]
    rms *= np.float32(1 / x.shape[1])
    rms += np.float32(eps)
    np.sqrt(rms, out=rms)
    return np.divide(x, rms, out=out)


def stored(shape):
    """(shape, the memory order sgemv reads faster) for a matrix [in, out] (see Decoder)."""
    return shape, "C" if shape[1] > shape[0] else "F"


def softmax_rows(s):
    """Softmax over the last axis, in place."""
    s -= s.max(axis=-1, keepdims=True)
    accelerate.exp(s, s)
    s /= s.sum(axis=-1, keepdims=True)


class Decoder:
    """One model's weights and a KV-cache session: `reset()`, then `forward(tokens)` for the prompt and
    for each new token; `pos` is the number of positions fed so far."""

    def __init__(self, cfg, params, *, alpha=None, classifier=None, vocab_ids=None, lanes=1):
        """params: the model's float32 parameters by name (config.param_shapes); alpha: the residual
        scale (default cfg.alpha; llama2.c's models have none: 1); classifier: the output matrix
        [vocab, dim] when it is not the embedding (default: params' own "classifier" if untied); vocab_ids:
        the ids the logits cover, in order (a compact vocabulary, §4.7; default all); lanes: processes
        that share each token step's products (anectypes.generate.lanes; 1: this one, with its BLAS
        threads). `close()` ends the other lanes."""
        self.cfg, S, r, qd, kvd = cfg, cfg.seq, cfg.gqa_ratio, cfg.q_dim, cfg.kv_dim
        self.alpha = np.float32(cfg.alpha if alpha is None else alpha)
        # the decoder's own copies, so that the caller's (a model file's buffer) can go: each product's
        # matrix [in, out] (those that read the same input side by side, one product each: wq, wk, wv;
        # w1, w3; wq scaled by 1/√hd: the kernels scale q after RoPE, which is linear; w1 and w2 negated,
        # which saves the SwiGLU a negation: W2·(−h1)·h3·σ(h1) = (−W2)·h1·h3·σ(h1); the rows of those
        # that read a normalized input scaled by its norm's weight, the classifier's too), stored in the
        # order OpenBLAS's sgemv streams faster from memory: row-major [in, out] when the output is
        # wider than the input, else row-major [out, in] (docs/decode-speed.md has the measurements),
        # all in one private mapping advised to use huge pages, from which sgemv streams faster (see
        # anectypes.generate.lanes), each built straight into its place (no second copy while building)
        self.embed = np.array(params["embed"])
        cls = params.get("classifier", params["embed"]) if classifier is None else classifier
        self.vocab_ids = None if vocab_ids is None else np.asarray(vocab_ids, np.int64)
        cls = cls if self.vocab_ids is None else cls[self.vocab_ids]
        # (with QK-norm, 1/√hd scales q_norm's weight instead: the norm would undo it on wq)
        scale = {"wq": np.float32(1 / np.sqrt(cfg.head_dim)), "w1": np.float32(-1), "w2": np.float32(-1)}
        layer = lambda i, m: params[f"layers.{i}.{m}"]
        if cfg.qk_norm:
            del scale["wq"]
            q_scale = np.float32(1 / np.sqrt(cfg.head_dim))
            self.qk_norm = [np.concatenate([np.tile(layer(i, "q_norm") * q_scale, (cfg.heads, 1)),
                                            np.tile(layer(i, "k_norm"), (cfg.kv_heads, 1))]) for i in range(cfg.layers)]
        names = [(i, name) for i in range(cfg.layers) for name in PROJECTIONS]
        *matrices, self.cls_t = private_arrays(
            [stored((layer(i, PROJECTIONS[name][0][0]).shape[1], sum(len(layer(i, m)) for m in PROJECTIONS[name][0])))
             for i, name in names] + [stored((cfg.dim, len(cls)))])
        self.layers = [{} for _ in range(cfg.layers)]
        for (i, name), w in zip(names, matrices):
            parts, norm, *_ = PROJECTIONS[name]
            np.concatenate([layer(i, m).T * scale.get(m, np.float32(1)) for m in parts], axis=1, out=w)
            if norm:
                w *= layer(i, norm)[:, None]
            self.layers[i][name] = w
        np.multiply(cls.T, params["rms_final"][:, None], out=self.cls_t)
        # RoPE rotates each pair (a, b) = channels (2j, 2j+1) of a head by its angle: (a + ib)·e^(iθ)
        cos, sin = rope_tables(cfg)                                  # [hd/2, S], as the kernels use them
        self.rotation = np.ascontiguousarray((cos + 1j * sin).T, np.complex64)
        self.mask = np.triu(np.full((S, S), -np.inf, np.float32), 1)   # row: position; column: key
        buf = lambda *shape: np.zeros(shape, np.float32)
        # what the products read and write (q and k side by side in qkv: one rotation)
        vectors = [buf(S, cfg.dim), buf(S, cfg.dim), buf(S, qd + 2 * kvd), buf(S, qd), buf(S, 2 * cfg.hidden),
                   buf(cfg.dim), buf(self.cls_t.shape[1])]
        self.lanes = Lanes(lanes) if lanes > 1 else None
        if self.lanes:                                               # where the other lanes see them
            vectors = self.lanes.share(vectors)
        x, xn, qkv, att, h13, self.xf, self.logits = vectors
        self.buf = dict(x=x, xn=xn, qkv=qkv, q=qkv[:, :qd], att=att,
                        h13=h13, h1=h13[:, :cfg.hidden], h3=h13[:, cfg.hidden:], gate=buf(S, cfg.hidden))
        self.cache = buf(cfg.layers, 2, cfg.kv_heads, S, cfg.head_dim)   # each layer's keys, then its values
        self.scores = buf(cfg.kv_heads * S * r * S)                  # [kv heads, r, rows, keys], flat
        # the decode steps' products: every projection of row 0 as a bound sgemv, and the classifier
        self.gemv = [self.products(w, 1) for w in self.layers]
        self.classify = self.matvec(self.cls_t.T, self.xf, self.logits)
        if self.lanes:
            self.lanes.start()
        self.pos = 0

    @classmethod
    def of(cls, source, lanes=1):
        """The decoder of a model source (anectypes.sources.Source): its classifier, its vocabulary."""
        return cls(source.cfg, source.params, classifier=source.classifier, vocab_ids=source.vocab_ids, lanes=lanes)

    def matvec(self, a, x, y, alpha=1.0, beta=0.0):
        """y = alpha·a·x + beta·y as a call of no arguments, on all lanes."""
        return (self.lanes.product if self.lanes else blas.sgemv_call)(a, x, y, alpha=alpha, beta=beta)

    def close(self):
        """End the other lanes; a decoder that had some is then unusable."""
        if self.lanes:
            self.lanes.close()

    def products(self, w, P):
        """A layer's products of P rows as calls of no arguments: sgemv for one row (bound once:
        OpenBLAS's sgemm of one row is many times slower), else sgemm."""
        calls = {}
        for name, (_, _, src, dst, add) in PROJECTIONS.items():
            alpha, beta = (self.alpha, 1.0) if add else (1.0, 0.0)
            a, b = self.buf[src][:P], self.buf[dst][:P]
            calls[name] = (self.matvec(w[name].T, a[0], b[0], alpha=alpha, beta=beta) if P == 1 else
                           functools.partial(blas.sgemm, a, w[name], b, alpha=alpha, beta=beta))
        return calls

    @property
    def weight_bytes(self):
        """Bytes of weights one decode step reads: every layer's matrices and the classifier (the norms'
        weights are folded into them)."""
        return sum(w.nbytes for layer in self.layers for w in layer.values()) + self.cls_t.nbytes

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
        if self.lanes and P > 1:
            self.lanes.rest()                                        # a prompt's sgemm: all cores to our BLAS
        v = self.views(P)
        np.take(self.embed, tokens, axis=0, out=v["x"])
        for i, w in enumerate(self.layers):
            self.layer(i, w, self.gemv[i] if P == 1 else self.products(w, P), v)
        self.pos += P
        if all_logits:
            xf = normalize_rows(v["x"], cfg.norm_eps, np.empty_like(v["x"]))
            return blas.sgemm(xf, self.cls_t)
        normalize_rows(v["x"][P - 1:], cfg.norm_eps, self.xf[None])
        self.classify()
        return self.logits

    def views(self, P):
        """What the layers of one forward of P rows at positions pos..end-1 work on: views of the
        buffers and of every layer's cache, taken once. Query head h = g·r + j reads kv head g, so the
        heads are laid out [g, j, row, hd]: a group's queries meet its keys in one product."""
        cfg, pos, end = self.cfg, self.pos, self.pos + P
        kvh, r, hd = cfg.kv_heads, cfg.gqa_ratio, cfg.head_dim
        v = {k: b[:P] for k, b in self.buf.items()}
        heads = lambda t, n: t.reshape(P, kvh, n, hd).transpose(1, 2, 0, 3)    # [rows, n·kvh·hd] -> [kvh, n, rows, hd]
        keys, values = self.cache[:, 0, :, None, :end], self.cache[:, 1, :, None, :end]   # [layers, kvh, 1, end, hd]
        v.update(qk=v["qkv"][:, :cfg.q_dim + cfg.kv_dim].view(np.complex64).reshape(P, cfg.heads + kvh, hd // 2),
                 qk_heads=v["qkv"][:, :cfg.q_dim + cfg.kv_dim].reshape(P, cfg.heads + kvh, hd),   # views, for QK-norm
                 rotation=self.rotation[pos:end, None, :], q_heads=heads(v["q"], r), att_heads=heads(v["att"], r),
                 kv_heads=v["qkv"][:, cfg.q_dim:].reshape(P, 2, kvh, hd).transpose(1, 2, 0, 3),   # [2, kvh, rows, hd]
                 new_kv=self.cache[..., pos:end, :], keys_t=keys.swapaxes(-1, -2), values=values,
                 scores=self.scores[:kvh * r * P * end].reshape(kvh, r, P, end),
                 mask=self.mask[pos:end, :end] if P > 1 else None,
                 # the attention's products: numpy's for one row (small: no call overhead), ours for a
                 # prompt (numpy's BLAS is another library, whose threads would compete with ours)
                 matmul=np.matmul if P == 1 else blas.matmul)
        return v

    def layer(self, i, w, mm, v):
        """Layer i with its weights w and its products mm, on the views v of a forward."""
        eps, s = self.cfg.norm_eps, v["scores"]
        normalize_rows(v["x"], eps, v["xn"])
        mm["wqkv"]()
        if self.cfg.qk_norm:                                          # each head of q and k normalized
            t = v["qk_heads"]
            t *= (1 / np.sqrt(np.einsum("phd,phd->ph", t, t) / t.shape[2] + np.float32(eps)))[..., None]
            t *= self.qk_norm[i]
        v["qk"] *= v["rotation"]                                      # RoPE on q and k
        v["new_kv"][i] = v["kv_heads"]                                # into the cache
        v["matmul"](v["q_heads"], v["keys_t"][i], out=s)
        if v["mask"] is not None:
            s += v["mask"]
        softmax_rows(s)
        v["matmul"](s, v["values"][i], out=v["att_heads"])
        mm["wo"]()                                                    # x += α·Wo·att
        normalize_rows(v["x"], eps, v["xn"])
        mm["w13"]()
        h1, gate = v["h1"], v["gate"]                                 # h1 = −W1·xn ← −silu(W1·xn)·h3
        accelerate.exp(h1, gate)
        gate += 1
        h1 *= v["h3"]
        h1 /= gate
        mm["w2"]()                                                    # x += α·W2·h1
