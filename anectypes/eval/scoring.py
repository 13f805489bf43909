"""The loss of a model source over a token stream, computed on the training kernels (model.transformer's
forward on a simulator or the ANE) over the model's whole vocabulary.

The windows: over a stream of N tokens, window k holds tokens [k·seq, min((k+1)·seq+1, N)) and predicts its
2nd..last token from the ones before it, so every token but the first is predicted exactly once, in
ceil((N-1)/seq) windows. The last, shorter window is padded at its end to the kernels' fixed length and the
padding's targets ignored (attention is causal: what follows a position changes nothing at it). Targets a
chat row's mask leaves out (the prompt's tokens) are ignored too. The loss is the mean cross-entropy in nats
over the predicted tokens, the perplexity its exp.
"""

import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .. import sources
from ..data.text import is_text, tokenize
from ..data.tokens import load_tokens
from ..device import open_device
from ..errors import AnectypesError, DataError
from ..model.chips import check_training
from ..model.loss import IGNORE, cross_entropy_
from ..model.transformer import Transformer
from ..runs import RunDir

SEQ = 256      # the window of a source that is not a run (at most its context)


@dataclass(frozen=True)
class Result:
    loss: float              # mean cross-entropy in nats over the predicted tokens
    perplexity: float
    tokens: int              # the predicted tokens counted
    windows: int
    seq: int
    backend: str             # the device's: "sim" or "ane"
    precision: str
    seconds: float
    checkpoint: str = None   # a run's checkpoint file
    step: int = None         # an anectypes checkpoint's training step

    def to_dict(self):
        return asdict(self)


def windows(n, seq):
    """(start, end) of each window over a stream of n tokens (the module's definition)."""
    return [(k * seq, min((k + 1) * seq + 1, n)) for k in range(math.ceil((n - 1) / seq))]


def window(tokens, mask, start, end, seq):
    """(inputs, targets) int64 [seq] of one window: its tokens but the last, then padding (id 0) whose
    targets are IGNORE, as are those the mask leaves out."""
    ids, targets = np.zeros(seq, np.int64), np.full(seq, IGNORE, np.int64)
    ids[:end - start - 1] = tokens[start:end - 1]
    predicted = np.asarray(tokens[start + 1:end], np.int64)
    targets[:end - start - 1] = predicted if mask is None else np.where(mask[start + 1:end], predicted, IGNORE)
    return ids, targets


def read_data(data, model):
    """(tokens, mask or None) of --data: text tokenized with the model's tokenizer (writing no token cache),
    or a token file in the model's vocabulary."""
    if is_text(data):
        return tokenize(data, model.tokenizer)
    return load_tokens(data, model.cfg.vocab), None


def evaluate(source, data, *, seq=None, backend="auto", precision="fp16", checkpoint=None, tokenizer=None,
             progress=None):
    """The Result of model `source` (anything sources.resolve takes; a run: `checkpoint`, by default its best,
    else latest) on `data` (what train's --data takes), in windows of `seq` predicted tokens (default: a run's
    or checkpoint's seq, else 256 or the model's context if shorter). progress(window, windows, tokens,
    seconds) is called after each window."""
    kind = sources.kind_of(Path(source))
    if kind == "run":
        checkpoint = str(sources.run_checkpoint(RunDir(source), checkpoint))
    model = sources.resolve(source, checkpoint, tokenizer, text=is_text(data), untied=True)
    trained = kind in ("run", "ckpt")             # a checkpoint's seq is its run's, not a context limit
    if seq is not None and (seq < 1 or not trained and seq > model.cfg.seq):
        raise AnectypesError(f"--seq {seq}: must be from 1 to the model's context ({model.cfg.seq})")
    seq = seq or (model.cfg.seq if trained else min(SEQ, model.cfg.seq))
    tokens, mask = read_data(data, model)
    if len(tokens) < 2:
        raise DataError(f"{data}: {len(tokens)} token{'s' * (len(tokens) != 1)}; eval needs at least 2 (one to "
                        "predict)")
    if mask is not None and not mask[1:].any():
        raise DataError(f"{data}: no token is a target (no assistant message after the first token)")
    spans = windows(len(tokens), seq)
    device = open_device(backend, precision=precision)
    if device.notice:
        print(device.notice, file=sys.stderr)
    untied = model.classifier is not None         # a llama2.c model's classifier of its own
    cfg = replace(model.cfg, seq=seq, tied=model.cfg.tied and not untied).validate()
    check_training(cfg, device)                   # what the chip is known to refuse, said before compiling
    params = {**model.params, "classifier": model.classifier} if untied else model.params
    total, counted, t0 = 0.0, 0, time.perf_counter()
    with Transformer(cfg, device, params, np.arange(cfg.vocab)) as net:   # every id: the model's own loss
        for i, (start, end) in enumerate(spans, 1):
            ids, targets = window(tokens, mask, start, end, seq)
            n = int(np.count_nonzero(targets != IGNORE))
            if n:
                total += cross_entropy_(net.logits(ids), targets)[0] * n
                counted += n
            if progress:
                progress(i, len(spans), end - 1, time.perf_counter() - t0)
    loss = total / counted
    return Result(loss, math.exp(loss), counted, len(spans), seq, device.name, precision, time.perf_counter() - t0,
                  str(checkpoint or source) if trained else None, model.step)
