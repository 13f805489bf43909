"""Token files: flat little-endian uint16 ids with no header (the llama2.c / maderix layout).

`load_tokens` memory-maps and validates one, `write_tokens` writes one atomically, `active_vocab`
lists the ids present (for vocabulary compaction), `split` cuts off the validation tail and
`BatchSampler` draws reproducible, resumable training windows (with a mask: only the tokens it marks
are targets, the others IGNORE).
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import DataError
from ..host.files import atomic_write
from ..model.loss import IGNORE

TOKEN_DTYPE = np.dtype("<u2")


def write_tokens(path, tokens):
    """Write token ids as a flat little-endian uint16 file, atomically."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise DataError(f"{path}: tokens must be a 1-D array of integers, got {ids.dtype} shape {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFF):
        bad = int(np.flatnonzero((ids < 0) | (ids > 0xFFFF))[0])
        raise DataError(f"{path}: token {int(ids[bad])} at position {bad} does not fit uint16 (0..65535)")
    data = np.ascontiguousarray(ids, dtype=TOKEN_DTYPE)
    atomic_write(path, lambda f: f.write(data.tobytes()))


def load_tokens(path, vocab_size=None, seq_len=None):
    """Memory-map a token file read-only, checking it is usable for the given vocab and seq_len."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: token file not found; check the path or make one with tools/tokenize_folder.py")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path}: token file is empty; re-create it with tools/tokenize_folder.py")
    if size % 2:
        raise DataError(f"{path}: {size} bytes is an odd length, so not a uint16 token file (truncated?); re-create it")
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    if seq_len is not None and len(tokens) < seq_len + 1:
        raise DataError(f"{path}: {len(tokens)} tokens, fewer than seq_len+1 = {seq_len + 1}; "
                        "use more text or a shorter seq_len")
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        first = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {int(tokens[first])} at position {first} is >= vocab_size {vocab_size}; "
                        "use the tokenizer the file was made with")
    return tokens


def active_vocab(tokens):
    """Sorted ids that occur in `tokens`: the rows a compacted classifier keeps."""
    return np.flatnonzero(np.bincount(np.asarray(tokens).ravel()))


def split(tokens, val_fraction=0.1):
    """(train, val) views: the last `val_fraction` of the stream is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(tokens) * val_fraction))
    if n_val >= len(tokens):
        raise DataError(f"{len(tokens)} tokens are too few to split off a validation set")
    return tokens[:-n_val], tokens[-n_val:]


class BatchSampler:
    """Random training windows of seq_len+1 tokens, drawn from a private seeded PCG64 stream.

    The stream state is exposed by state_dict() so that a resumed run draws exactly the windows
    an uninterrupted run would have (with the same numpy version).
    """

    def __init__(self, tokens, seq_len, seed=0, mask=None):
        if len(tokens) < seq_len + 1:
            raise DataError(f"{len(tokens)} tokens are fewer than seq_len+1 = {seq_len + 1}")
        if mask is not None and not mask[1:].any():
            raise DataError("no token is a target (the mask is all False)")
        self.tokens, self.seq_len, self.mask = tokens, int(seq_len), mask
        self.rng = np.random.Generator(np.random.PCG64(int(seed)))

    def sample(self):
        """(inputs, targets), each int64 [seq_len]; targets are inputs shifted left by one, IGNORE where
        the mask is False (a window without any target is drawn again)."""
        while True:
            start = int(self.rng.integers(0, len(self.tokens) - self.seq_len))  # last start leaves seq_len+1 tokens
            window = np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)
            if self.mask is None:
                return window[:-1], window[1:]
            keep = self.mask[start + 1:start + self.seq_len + 1]
            if keep.any():
                return window[:-1], np.where(keep, window[1:], IGNORE)

    def state_dict(self):
        return {"seq_len": self.seq_len, "bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        if state["seq_len"] != self.seq_len:
            raise DataError(f"sampler state is for seq_len {state['seq_len']}, this sampler has {self.seq_len}")
        self.rng.bit_generator.state = state["bit_generator"]
