"""The one answer to "what is this model source; give me its weights, tokenizer and vocabulary", with one
set of rules for every command that takes a source: generate, train --init-from, export, bench generate
and the dashboard's export and generation.

A source is told apart by its content:

    a run folder             its best checkpoint, else its latest (one that has not validated yet);
                             or --checkpoint best, latest or a .ckpt file
    an anectypes .ckpt       (a zip) in a run folder's checkpoints/, or anywhere
    a llama2.c model.bin     version 0 or 1, or a folder holding one that is not a run's
    a Hugging Face folder    config.json of a LlamaForCausalLM or Qwen3ForCausalLM and its safetensors
    a GGUF file              of architecture llama or qwen3
    a reference checkpoint   the reference's v2/v4 file

The tokenizer is --tokenizer's (a tokenizer.bin, or a Hugging Face folder's tokenizer.json) if given, else a
run's (its data's; the built-in corpus' for the built-in corpus), a GGUF file's own, the tokenizer.bin beside
a model.bin or in a Hugging Face folder, else that folder's tokenizer.json (anectypes.data.hf_tokenizer). A
tokenizer with more ids than the model's vocabulary is refused; a Hugging Face model's vocabulary may be
padded beyond its tokenizer's (Qwen3's 151,936 for 151,669 tokens), a tokenizer.bin's must be the model's.
The vocabulary the logits cover is a run's compact one (the ids its data holds, docs/ane-reference.md §4.7),
else all ids. A command asks for what it needs beyond the weights:
`text` (the tokenizer: generate, export, the dashboard) and `untied` (a classifier of its own, which
a llama2.c model.bin may have: the decoder reads it; training and export refuse it, ours is tied).
A quantized GGUF's weights are a dequantized float32 copy, which resolve says in one note on stderr.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

from .data.corpus import builtin_dataset
from .data.hf_tokenizer import HFTokenizer, load_tokenizer
from .data.text import is_text, read_cache
from .data.tokens import active_vocab, load_tokens
from .errors import AnectypesError
from .host.untrusted import open_regular
from .formats import gguf, hf, llama2c, reference
from .formats.checkpoint import load_checkpoint
from .formats.portable import Portable, check_finite
from .model.config import ModelConfig
from .model.lora import is_adapter, merged
from .runs import TOKENS, RunDir

READERS = {"llama2c": llama2c.read, "hf": hf.read, "gguf": gguf.read, "reference": reference.read}
MAGIC = {b"PK\x03\x04": "ckpt", b"GGUF": "gguf", reference.REFERENCE_MAGIC.to_bytes(4, "little"): "reference"}
NO_TOKENIZER = {"run": "its run trained on --data without --tokenizer", "ckpt": "it is not in a run folder",
                "llama2c": "no tokenizer.bin beside it", "hf": "no tokenizer.bin or tokenizer.json in it",
                "gguf": "none in the file",
                "reference": "the reference's checkpoints hold none"}


class SourceError(AnectypesError):
    """A path that is not a model source, or a source without what a command needs."""


@dataclass
class Source(Portable):
    """A model source, read: the portable model (weights in training's convention, the tokenizer or None,
    the classifier when it is not the embedding) and what a run adds."""
    vocab_ids: object = None    # the ids the logits cover, in order (a run's data's); None: all
    step: int = None            # a checkpoint's training step
    lora: object = None         # a LoRA run's model.lora.Lora: params hold its adapters merged, adapters them alone
    adapters: dict = None
    base: str = None            # the model a LoRA run started from (its --init-from), or None


def resolve(source, checkpoint=None, tokenizer=None, *, text=False, untied=False):
    """The Source at path `source`, with `checkpoint` of a run (best, latest or a .ckpt file; default:
    best, else latest) and `tokenizer` (a tokenizer.bin or a Hugging Face tokenizer) in place of the source's
    own. SourceError when it has no tokenizer and `text`, or a classifier of its own and not `untied`."""
    path = Path(source)
    kind, run = kind_of(path), None
    if checkpoint and kind != "run":
        raise SourceError(f"{source}: --checkpoint needs a run folder")
    if kind == "run":
        path, run = run_checkpoint(RunDir(path), checkpoint), path
    elif kind == "ckpt":
        run = path.resolve().parent.parent                               # RUN/checkpoints/X.ckpt, if so
        run = run if RunDir(run).exists() else None
    if kind in ("run", "ckpt"):
        model = read_checkpoint(path, run, tokenizer)
    else:
        model = Source(**vars(READERS[kind](path / "model.bin" if kind == "llama2c" and path.is_dir() else path)))
        if kind == "hf" and model.tokenizer is None and (path / "tokenizer.json").is_file():
            model.tokenizer = HFTokenizer.load(path)
        if tokenizer:
            model.tokenizer = same_vocabulary(load_tokenizer(tokenizer), model.tokenizer, tokenizer, source)
    if model.tokenizer is None and text:
        raise SourceError(f"{source} has no tokenizer ({NO_TOKENIZER['run' if run else kind]}): pass the model's "
                          "tokenizer.bin with --tokenizer")
    if model.tokenizer is not None and not fits(model.tokenizer, model.cfg.vocab):
        raise SourceError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but the model's vocabulary has "
                          f"{model.cfg.vocab}; pass the model's own with --tokenizer")
    if model.classifier is not None and not untied:
        raise SourceError(f"{source}: its classifier is not the embedding (unshared), but ours is tied: this "
                          "model can be generated from, not trained or exported")
    check_finite(source, model.params if model.classifier is None else {**model.params, "classifier": model.classifier})
    if model.dequantized:           # said once the source is read, so that a refused one gives its error line alone
        print(f"note: {source} is quantized ({', '.join(model.dequantized)}): its weights are read as a dequantized "
              "float32 copy", file=sys.stderr)
    return model


def same_vocabulary(given, own, given_path, source):
    """The tokenizer `given` (--tokenizer's), refused when the source has one of its own (`own`, or None) of
    another vocabulary: its ids would mean other tokens to the model."""
    if own is None:
        return given
    vocab = lambda t: t.tok.get_vocab(with_added_tokens=True) if isinstance(t, HFTokenizer) else t.pieces
    same = (vocab(given) == vocab(own) if type(given) is type(own) else given.vocab_size == own.vocab_size)
    if not same:
        raise SourceError(f"the tokenizer has another vocabulary ({given.vocab_size} tokens) than {source}'s own "
                          f"({own.vocab_size}): the ids of --tokenizer {given_path} would mean other tokens to it")
    return given


def fits(tokenizer, vocab):
    """Whether a tokenizer's ids are a model's: all of them for a tokenizer.bin, within them for a Hugging
    Face tokenizer (whose model's vocabulary may be padded)."""
    n = tokenizer.vocab_size
    return n <= vocab if isinstance(tokenizer, HFTokenizer) else n == vocab


def kind_of(path):
    """What the source at path is, by its content (see the module's table)."""
    if path.is_dir():
        if hf.is_hf(path):
            return "hf"
        if RunDir(path).exists():
            return "run"
        if (path / "model.bin").is_file():
            return "llama2c"
        raise SourceError(f"{path}: not a run folder, a Hugging Face model folder (config.json) or a llama2.c "
                          "folder (model.bin)")
    try:
        with open_regular(path) as f:
            return MAGIC.get(f.read(4), "llama2c")
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file or folder") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror})") from None


def run_checkpoint(rd, checkpoint=None):
    """The checkpoint file of a run: `checkpoint` (best, latest or a .ckpt file), by default best, else
    latest (a run that has not validated yet)."""
    path = {"best": rd.best, "latest": rd.latest}.get(checkpoint or "best", Path(checkpoint or ""))
    if not checkpoint and not path.is_file():
        path = rd.latest
    if not path.is_file():
        raise SourceError(f"{path}: no such checkpoint (--checkpoint latest, best or a file)")
    return path


def read_checkpoint(path, run, tokenizer):
    """An anectypes checkpoint with the tokenizer and vocabulary of its run folder `run` (None: not in one)."""
    ckpt = load_checkpoint(path)
    spec = RunDir(run).read_config()[0] if run else None
    tok, vocab_ids = (run_vocabulary(RunDir(run), tokenizer) if run else
                      (tokenizer and load_tokenizer(tokenizer), None))
    lora = ckpt.lora and dict(lora=ckpt.lora, adapters={k: v for k, v in ckpt.params.items() if is_adapter(k)},
                              base=spec and spec.init_from)
    return Source(ModelConfig(**ckpt.config), merged(ckpt.params, ckpt.lora) if ckpt.lora else ckpt.params, tok,
                  vocab_ids=vocab_ids, step=int(ckpt.state.get("step", 0)), **(lora or {}))


def run_vocabulary(rd, tokenizer_path=None):
    """(tokenizer or None, active ids) of a run: tokenizer_path's, else its data's tokenizer (the built-in
    corpus' for the built-in corpus, the token cache's for text), and the ids its data holds."""
    spec = rd.read_config()[0]
    if spec.data and is_text(spec.data):
        tokens, _, tokenizer, _ = read_cache(rd / TOKENS)
    else:
        tokenizer, tokens = (None, load_tokens(spec.data)) if spec.data else builtin_dataset()
    path = tokenizer_path or spec.data and spec.tokenizer
    return load_tokenizer(path) if path else tokenizer, None if spec.vocabulary == "full" else active_vocab(tokens)
