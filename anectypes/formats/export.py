"""Export: a portable model written in one of the formats, through a temporary name beside the output
that a killed export leaves for the next one to remove; and a folder zipped for a download.

Adding a format is adding its module (a `write(model, out, dtype)`) and its line in WRITERS.
"""

import glob
import os
import re
import secrets
import shutil
import zipfile
from pathlib import Path

import numpy as np

from ..data.tokenizer import Tokenizer
from ..host.processes import process_start
from . import gguf, hf, llama2c, peft
from .portable import FormatError, fold, scaled_params

# gguf writes a file, the others a folder; peft a LoRA run's adapter alone
WRITERS = {"llama2c": llama2c.write, "hf": hf.write, "gguf": gguf.write, "peft": peft.write}
FORMATS = tuple(WRITERS)


def check_target(model, fmt, dtype):
    """Refuse, with the reason, a model the target cannot represent."""
    if fmt == "llama2c" and model.tokenizer is not None and not isinstance(model.tokenizer, Tokenizer):
        raise FormatError("the source's tokenizer is a Hugging Face tokenizer.json, which llama2.c's format cannot "
                          "hold: export with --format hf or gguf, or pass a llama2.c tokenizer.bin with --tokenizer")
    if fmt == "llama2c":
        llama2c.check(model, dtype)
    cfg = model.cfg
    beyond = [f"{k}={getattr(cfg, k)!r}" for k, plain in (("qk_norm", False), ("rope_type", "default"), ("tied", True))
              if getattr(cfg, k) != plain]
    if beyond and fmt == "llama2c":                # llama2.c's Llama has no field for them
        raise FormatError(f"{fmt} cannot hold this model's {', '.join(beyond)}: export it with --format hf or gguf")
    if model.classifier is not None:
        raise FormatError("the model's classifier is not its embedding: every format here writes a tied one")
    if model.tokenizer is None and fmt != "peft":
        raise FormatError("the source has no tokenizer (a run on --data without --tokenizer): pass --tokenizer")
    if fmt == "gguf":
        gguf.check(model)
    if dtype == "f16":
        for name, w in scaled_params(model.params, model.cfg, fold).items():
            top = np.abs(w).max()
            if top >= 65520:                                      # float16 rounds these to inf
                raise FormatError(f"{name} holds values up to {top:.4g}, beyond float16's 65504: export with "
                                  "--dtype f32")


def clean_temp(out):
    """Remove what exports to `out` that were killed left beside it: their temporary file or folder
    (".NAME.<pid>.<hex>.tmp") and the one being replaced (".tmp.old"), if their process is gone."""
    name = re.compile(re.escape(f".{out.name}.") + r"(\d+)\.[0-9a-f]{12}\.tmp(\.old)?")
    for p in out.parent.glob(glob.escape(f".{out.name}.") + "*.tmp*"):
        found = name.fullmatch(p.name)
        if found and process_start(int(found[1])) is None:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def export(model, fmt, out, dtype="f32", force=False):
    """Write `model` as `fmt` to `out` (a folder for llama2c and hf, a file for gguf) through a temporary
    name beside it, then rename; an existing `out` is replaced only with force. The files written."""
    check_target(model, fmt, dtype)
    out = Path(out)
    if out.name in ("", ".."):
        raise FormatError(f"{out}: name the file or folder to write, not . or ..")
    if (out.exists() or out.is_symlink()) and not force:
        raise FormatError(f"{out} exists; pass --force to replace it")
    if out.is_dir() != (fmt != "gguf") and out.exists():
        raise FormatError(f"{out} is a {'folder' if out.is_dir() else 'file'}; {fmt} writes a "
                          f"{'file' if fmt == 'gguf' else 'folder'}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_temp(out)
        if fmt == "gguf":
            WRITERS[fmt](model, tmp, dtype)
        else:
            tmp.mkdir()
            WRITERS[fmt](model, tmp, dtype)
            old = out.with_name(tmp.name + ".old")
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return sorted(out.iterdir())
        os.replace(tmp, out)
        return [out]
    except OSError as e:
        where = f"{e.filename}: " if e.filename and tmp.name not in str(e.filename) else ""   # out's parents
        reason = e.strerror or f"a write was cut short ({e}); is the disk full?"   # numpy's tofile gives no errno
        raise FormatError(f"cannot write {out}: {where}{reason}") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():                        # (unlinking a missing file on a read-only disk is EROFS)
            tmp.unlink()


def zip_folder(folder, dest):
    """An uncompressed zip of a folder's files (under the folder's name), for a download."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(Path(folder).iterdir()):
            zf.write(p, f"{Path(folder).name}/{p.name}")
