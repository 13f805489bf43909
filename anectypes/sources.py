"""Model sources: what a path is (a run folder, an anectypes .ckpt, a llama2.c model.bin or its folder, a
Hugging Face Llama folder, a GGUF file, the reference's v2/v4 checkpoint), read as a portable model
with its tokenizer, and a run's vocabulary.
"""

import contextlib
import struct
from pathlib import Path

from .data.corpus import builtin_dataset
from .data.tokenizer import Tokenizer
from .data.tokens import active_vocab, load_tokens
from .formats import gguf, hf, llama2c, reference
from .formats.checkpoint import load_checkpoint
from .formats.portable import FormatError, Portable, check_finite
from .formats.reference import REFERENCE_MAGIC
from .model.config import ModelConfig
from .runs import RunDir


def load(source, checkpoint=None, tokenizer=None):
    """The Portable of SOURCE, detected from its content: a run folder or anectypes .ckpt, a reference
    v2/v4 checkpoint, a llama2.c model.bin (v0/v1), a Hugging Face Llama folder or a GGUF file. The
    tokenizer: `tokenizer` (a tokenizer.bin) if given, else the run's, the one in the file or beside it."""
    path = Path(source)
    if checkpoint and not (path.is_dir() and RunDir(path).exists()):
        raise FormatError(f"{source}: --checkpoint needs a run folder")
    if path.is_dir():
        model = (hf.read(path) if hf.is_hf(path) else read_run(path, checkpoint) if RunDir(path).exists() else
                 llama2c.read(path / "model.bin") if
                 (path / "model.bin").is_file() else None)
        if model is None:
            raise FormatError(f"{source}: not a run folder, a Hugging Face model folder (config.json) or a "
                              "llama2.c folder (model.bin)")
    elif path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        model = (read_ckpt(path) if magic == b"PK\x03\x04" else gguf.read(path) if magic == b"GGUF" else
                 reference.read(path) if magic == struct.pack("<I", REFERENCE_MAGIC) else llama2c.read(path))
    else:
        raise FormatError(f"{source}: no such file or folder")
    if tokenizer:
        model.tokenizer = Tokenizer.load(tokenizer)
    if model.tokenizer is not None and model.tokenizer.vocab_size != model.cfg.vocab:
        raise FormatError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but the model's vocabulary has "
                          f"{model.cfg.vocab}; pass the model's own with --tokenizer")
    check_finite(source, model.params)
    return model


def foreign(path):
    """Whether SOURCE is a model anectypes.generate leaves to `load`: a Hugging Face or llama2.c folder,
    a GGUF file or the reference's checkpoint."""
    path = Path(path)
    if path.is_dir():
        return hf.is_hf(path) or (path / "model.bin").is_file() and not RunDir(path).exists()
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(4) in (b"GGUF", struct.pack("<I", REFERENCE_MAGIC))
    return False


def read_run(path, checkpoint=None):
    """A run folder's checkpoint (best, else latest; or `checkpoint`) with the run's tokenizer."""
    rd = RunDir(path)
    ckpt = {"best": rd.best, "latest": rd.latest}.get(checkpoint or "best", Path(checkpoint or ""))
    if not checkpoint and not ckpt.is_file():
        ckpt = rd.latest                              # a run that has not validated yet
    if not ckpt.is_file():
        raise FormatError(f"{ckpt}: no such checkpoint (--checkpoint latest, best or a file)")
    return read_ckpt(ckpt, path)


def read_ckpt(path, run=None):
    """An anectypes checkpoint, with the tokenizer of its run folder (`run`, else the one it is in, if any)."""
    ckpt = load_checkpoint(path)
    rd = RunDir(run or Path(path).resolve().parent.parent)
    tokenizer = run_vocabulary(rd.read_config()[0])[0] if rd.exists() else None
    return Portable(ModelConfig(**ckpt.config), ckpt.params, tokenizer)


def run_vocabulary(spec, tokenizer_path=None):
    """(tokenizer or None, active ids) of a run's spec: its data's tokenizer (the built-in corpus' for
    the built-in corpus) unless tokenizer_path, and the ids its data holds."""
    if spec.data:
        tokens, tokenizer = load_tokens(spec.data), spec.tokenizer and not tokenizer_path and Tokenizer.load(spec.tokenizer)
    else:
        tokenizer, tokens = builtin_dataset()
    if tokenizer_path:
        tokenizer = Tokenizer.load(tokenizer_path)
    return tokenizer, active_vocab(tokens)
