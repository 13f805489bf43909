"""Sample text from a model with the training kernels (a full forward per token: the ANE has fixed shapes)."""

import numpy as np

from .tokenizer import BOS


def sample_tokens(model, prompt_ids, n_new, temperature=0.8, top_k=50, rng=None):
    """Extend prompt_ids by n_new tokens; the context is the last seq tokens (positions restart at 0)."""
    rng = rng or np.random.default_rng(0)
    seq = model.cfg.seq
    ids = list(prompt_ids) or [BOS]
    for _ in range(n_new):
        window = ids[-seq:]
        tokens = np.full(seq, window[-1], np.int64)           # positions after the last are ignored (causal)
        tokens[:len(window)] = window
        logits = model.logits(tokens)[:, len(window) - 1].astype(np.float64)
        ids.append(int(model.active[pick(logits, temperature, top_k, rng)]))
    return ids


def pick(logits, temperature, top_k, rng):
    """Index drawn from softmax(logits / temperature) restricted to the top_k largest (greedy at T=0)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    if top_k and top_k < len(logits):
        cut = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cut, logits, -np.inf)
    p = np.exp((logits - logits.max()) / temperature)
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(model, tokenizer, prompt="", n_new=64, temperature=0.8, top_k=50, seed=0):
    """Text continuing `prompt` (the prompt included)."""
    ids = tokenizer.encode(prompt, bos=True) if prompt else [BOS]
    return tokenizer.decode(sample_tokens(model, ids, n_new, temperature, top_k, np.random.default_rng(seed)))
