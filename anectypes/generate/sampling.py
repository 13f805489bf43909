"""Sampling, as llama2.c's run.c does it: the next token of a decoder's logits (greedy, or at a
temperature from the top-k and then the nucleus), the tokens of one generation, and the text each new
token adds. The generate command, the dashboard and training's samples use it.
"""

import codecs

import numpy as np

from ..errors import AnectypesError
from ..host import accelerate

TEMPERATURE, TOP_P, TOP_K = 1.0, 0.9, 0           # run.c's defaults; top-k off


class Sampler:
    """The next token's index in a decoder's logits: greedy at temperature 0, else drawn from
    softmax(logits / T), restricted to the top_k largest (0: all), then by run.c's nucleus rule to the
    most probable ones whose probabilities first sum beyond top_p (1 or 0: all)."""

    def __init__(self, n, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=None):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.rng = np.random.default_rng(seed)
        self.p = np.empty(n, np.float64)

    def __call__(self, logits):
        if self.temperature == 0:
            return int(np.argmax(logits))
        p, top = self.p, logits.max()
        if not np.isfinite(top):
            raise AnectypesError("the model's logits are not finite (its weights overflowed): nothing to sample from")
        np.subtract(logits, top, out=p)
        with np.errstate(over="ignore"):
            p /= self.temperature       # <= 0, the largest 0: a tiny T gives -inf (probability 0), never NaN
        if 0 < self.top_k < len(p):
            p[p < np.partition(p, -self.top_k)[-self.top_k]] = -np.inf
        accelerate.exp(p, p)
        p /= p.sum()
        coin = self.rng.random()
        if 0 < self.top_p < 1:
            # only probabilities >= (1 - top_p) / (n - 1) can be in the nucleus (run.c's cut)
            idx = np.flatnonzero(p >= (1 - self.top_p) / (len(p) - 1))
            idx = idx[np.argsort(-p[idx], kind="stable")]
            cdf = np.cumsum(p[idx])
            cdf = cdf[:np.searchsorted(cdf, self.top_p, side="right") + 1]
            return int(idx[min(np.searchsorted(cdf, coin * cdf[-1], side="right"), len(cdf) - 1)])
        return int(min(np.searchsorted(np.cumsum(p), coin, side="right"), len(p) - 1))


def stream(decoder, prompt_ids, steps, sampler, stop):
    """Yield each new token id: the prompt is fed in one pass, then each new token, until `steps`
    positions are fed (as run.c's -n) or the model produces one of the ids `stop` (not yielded): the
    tokenizer's, BOS for a tokenizer.bin, EOS for a Hugging Face one."""
    decoder.reset()
    logits = decoder.forward(np.asarray(prompt_ids, np.int64))
    while True:
        t = decoder.token_id(sampler(logits))
        if t in stop:
            return
        yield t
        if decoder.pos >= steps:
            return
        logits = decoder.forward(np.array([t]))


class TextStream:
    """The text that each new token adds (UTF-8 split across byte tokens is held until complete)."""

    def __init__(self, tokenizer, prev=None):
        self.tokenizer, self.prev = tokenizer, prev
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, t):
        piece, self.prev = self.tokenizer.piece(self.prev, t), t
        return self.utf8.decode(piece)


def generate(decoder, tokenizer, prompt="", steps=None, seed=None, **sampling):
    """Text continuing `prompt` (the prompt included): positions up to `steps` (default: seq)."""
    ids = tokenizer.encode(prompt, bos=True)
    ids += stream(decoder, ids, steps or decoder.cfg.seq, Sampler(len(decoder.logits), seed=seed, **sampling),
                  tokenizer.stop)
    return tokenizer.decode(ids)
