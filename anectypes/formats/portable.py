"""The portable model: what every format's reader gives and every writer takes (docs/ane-reference.md §8).

A `Portable` is a model in our own terms: the ModelConfig, the parameters by our names in training's
convention (residual branches scaled by α = 1/√(2L) at run time, §4.3), the tokenizer when known and
the classifier when it is not the embedding (a llama2.c model.bin's may be its own; ours is tied).
The other tools have no residual scale, so writing folds α into wo and w2 and reading divides it out
again, choosing for each weight the float32 that folds back to the same bits (`unfold`): export →
import → export is byte-identical.
"""

from dataclasses import dataclass

import numpy as np

from ..errors import AnectypesError
from ..model.config import ModelConfig, param_shapes

SPACE = "\u2581"            # SentencePiece's visible space, in the pieces of HF's and GGUF's vocabularies


class FormatError(AnectypesError):
    """A model that cannot be read or written in a format, saying why."""


@dataclass
class Portable:
    cfg: ModelConfig
    params: dict                # our names and shapes, float32, α applied at run time
    tokenizer: object = None    # Tokenizer, or None when the source has none
    classifier: object = None   # [vocab, dim] float32 when it is not the embedding, else None
    dequantized: tuple = ()     # the quantized tensor types (a GGUF's Q4_1, ...) the float32 weights were read from
    context: int = None         # the context the file says the model was trained for, when it says one


def need(module):
    """Import one of the export extra's libraries, or stop with one line naming the extra."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise FormatError(f"this needs the {module.split('.')[0]} package: pip install 'anectypes[export]'") from None


# --- α: folded into wo and w2 for the tools that have no residual scale ----------------------------------

def fold(x, alpha):
    """x·α rounded once to float32."""
    return (np.asarray(x, np.float64) * alpha).astype(np.float32)


def unfold(y, alpha):
    """The float32 x nearest y/α, moved by one step where needed so that fold(x) == y whenever y is a fold."""
    y = np.asarray(y, np.float32)
    x = (y.astype(np.float64) / alpha).astype(np.float32)
    for toward in (np.inf, -np.inf):
        miss = fold(x, alpha) != y
        nudged = np.nextafter(x, np.float32(toward))
        x = np.where(miss & (fold(nudged, alpha) == y), nudged, x)
    return x


def scaled_params(params, cfg, scale):
    """params with each layer's wo and w2 mapped by scale(w, α); the rest as they are."""
    return {k: scale(v, cfg.alpha) if k.rsplit(".", 1)[-1] in ("wo", "w2") else v for k, v in params.items()}


# --- what the readers share ------------------------------------------------------------------------------

def check_finite(source, params):
    """Refuse weights that hold NaN or inf: the model's text would be noise (its sampler has nothing to
    draw from), its training NaN."""
    for name, a in params.items():
        if not np.isfinite(a).all():
            raise FormatError(f"{source}: its {name} holds NaN or inf; the model is damaged")


def from_names(path, cfg, tensors, top, layer, kinds):
    """Our parameters from a file's tensors, each checked against its shape: `top` names the embedding's
    and the final norm's, `layer` (with i and name) each layer's, for its kinds {ours: theirs}."""
    need = len(kinds) * cfg.layers + len(top)
    if need > len(tensors):                       # before naming them: a config may claim 10^9 layers
        raise FormatError(f"{path}: its config's {cfg.layers} layers need {need} tensors, the file holds "
                          f"{len(tensors)}")
    names = dict(top, **{f"layers.{i}.{k}": layer.format(i=i, name=v) for i in range(cfg.layers)
                         for k, v in kinds.items()})
    params = {}
    for ours, shape in param_shapes(cfg.validate()).items():
        a = tensors.get(names[ours])
        if a is None or a.shape != shape:
            found = "missing" if a is None else f"{list(a.shape)}"
            raise FormatError(f"{path}: tensor {names[ours]} is {found}; the config needs {list(shape)}")
        params[ours] = np.require(a, np.float32, ["C", "W", "O"])  # our own, writable (training updates it): a copy
        #                                                          unless the reader made it so already
    return params


def piece_text(piece):
    """A vocabulary piece as HF's and GGUF's vocabularies hold it: UTF-8 text, spaces as SPACE."""
    try:
        return piece.decode("utf-8").replace(" ", SPACE)
    except UnicodeDecodeError:
        raise FormatError(f"the vocabulary's piece {piece!r} is not UTF-8, which tokenizer.json cannot hold") from None
