"""The loss on the CPU: cross-entropy over the (compact) vocabulary's logits and its gradient, and
the embedding lookup's backward."""

import numpy as np

from ..host import accelerate

IGNORE = -1        # a target that adds nothing to the loss or its gradient (a chat row's prompt)

SAFE_LOGIT = 60.0   # |logits| under this: exp needs no shift (e^±60, and sums of 10^5 of them, fit float32)
CE_ROWS = 4000      # classes per block of the loss: 4 MB of logits at S = 256


def cross_entropy_(logits, target_idx, bound=np.inf, map=map):
    """Mean cross-entropy over positions of [classes, S] logits; returns (loss, f). The logits turn
    in place into G = exp(logits − m) − onehot·Σ exp(logits − m) (m: a shift per position), whose
    columns scaled by f are the loss's gradient, softmax − onehot over S: the sgemms that consume
    G apply f to their small operands, so no pass over G normalizes it. Positions whose target is
    IGNORE are left out of the mean, and their f is 0: they add nothing to the gradient.

    Blocks of CE_ROWS classes are exponentiated and summed apart (`map` may run them on several
    threads). With `bound`, an upper bound on |logits| under SAFE_LOGIT, nothing can overflow
    unshifted (m = 0); otherwise each block is shifted by its own max and rescaled to the largest."""
    cols, kept = np.arange(logits.shape[1]), target_idx != IGNORE
    n, target_idx, counted = np.count_nonzero(kept), target_idx[kept], cols[kept]
    picked = logits[target_idx, counted].astype(np.float64)
    blocks = [logits[r:r + CE_ROWS] for r in range(0, len(logits), CE_ROWS)]
    shifted = bound >= SAFE_LOGIT

    def exp_sum(block):
        shift = block.max(axis=0) if shifted else np.zeros(len(cols), np.float32)
        if shifted:
            block -= shift
        accelerate.exp(block, block)
        return shift, block.sum(axis=0)

    shifts, sums = (np.array(a, np.float64) for a in zip(*map(exp_sum, blocks)))
    top = shifts.max(axis=0)
    weights = np.exp(shifts - top)                              # [blocks, S]
    if shifted:                                                 # to one shift per position
        factors = weights.astype(np.float32)

        def rescale(i):
            blocks[i] *= factors[i]
        list(map(rescale, range(len(blocks))))
    total = (sums * weights).sum(axis=0)
    logits[target_idx, counted] -= total[kept].astype(np.float32)
    return float(np.mean((np.log(total) + top)[kept] - picked)), (kept / (n * total)).astype(np.float32)

def cross_entropy(logits, target_idx):
    """(loss, dlogits) without touching logits."""
    d = np.array(logits, np.float32)
    loss, f = cross_entropy_(d, target_idx)
    d *= f
    return loss, d


def logit_bound(row_norm, x):
    """An upper bound on |E·x| from the largest row norm of E and x's column norms (Cauchy-Schwarz)."""
    return row_norm * float(np.sqrt(np.einsum("cs,cs->s", x, x).max()))


def scatter_add(table, rows, values):
    """table[rows] += values, each repeated row's values first summed in the order they come (np.add.reduce
    over axis 0 adds the rows one by one): text repeats few rows, so this is several times quicker than
    np.add.reduceat over every row or np.add.at (docs/train-speed.md)."""
    order = np.argsort(rows, kind="stable")
    ids, starts, counts = np.unique(rows[order], return_index=True, return_counts=True)
    grouped = values[order]
    sums = grouped[starts]
    for j in np.flatnonzero(counts > 1):
        np.add.reduce(grouped[starts[j]:starts[j] + counts[j]], axis=0, out=sums[j])
    table[ids] += sums
