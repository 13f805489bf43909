"""python -m anectypes.export — write a model for llama2.c's run.c, Hugging Face transformers or llama.cpp.

    python -m anectypes.export runs/X --format llama2c --out out/model     # model.bin + tokenizer.bin
    python -m anectypes.export runs/X --format hf --out out/hf             # transformers' folder
    python -m anectypes.export runs/X --format gguf --out out/model.gguf   # llama.cpp, Ollama, LM Studio
    python -m anectypes.export runs/X --format peft --out out/adapter      # a LoRA run's adapter, for peft

SOURCE is a run folder (its best checkpoint, or --checkpoint latest: a running run exports fine), an
anectypes .ckpt, or any model `train --init-from` reads (llama2.c model.bin, a Hugging Face folder, a
GGUF file). The residual scale α is folded into wo and w2 (the targets have none), and the full
vocabulary is written; a LoRA run's adapters are merged into the weights they adapt, or written alone
by --format peft (docs/lora.md). Formats and conventions: docs/ane-reference.md §8.
"""

import argparse
import sys
from pathlib import Path

from . import sources
from .cli import ArgumentParser, quiet_on_closed_stdout
from .errors import AnectypesError
from .formats.export import FORMATS, export


@quiet_on_closed_stdout
def main(argv=None):
    doc = __doc__.splitlines()
    ap = ArgumentParser(prog="python -m anectypes.export", description=doc[0], epilog="\n".join(doc[2:]),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", metavar="SOURCE", help="a run folder, an anectypes .ckpt or another model file")
    ap.add_argument("--format", required=True, choices=FORMATS, help="llama2c (a folder), hf (a folder), gguf (a file), "
                    "peft (a LoRA run's adapter alone, a folder)")
    ap.add_argument("--out", required=True, metavar="PATH", help="the folder or .gguf file to write")
    ap.add_argument("--checkpoint", help="of a run folder: best (default), latest or a .ckpt file")
    ap.add_argument("--tokenizer", help="a llama2.c tokenizer.bin, or a Hugging Face tokenizer.json (gguf only; "
                    "default: the source's)")
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                    help="the weights' type (hf, gguf, peft; default f32)")
    ap.add_argument("--force", action="store_true", help="replace PATH if it exists")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    out, source = Path(args.out).resolve(), Path(args.source).resolve()
    if out == source or out in source.parents:          # --force would replace the model being exported
        ap.error(f"--out {args.out} holds SOURCE {args.source}: write the export elsewhere")
    try:
        model = sources.resolve(args.source, args.checkpoint, args.tokenizer, text=args.format != "peft")
        files = export(model, args.format, args.out, args.dtype, args.force)
    except AnectypesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or args.source}: {e.strerror or e}", file=sys.stderr)
        return 1
    cfg = model.cfg
    print(f"wrote {args.format} ({cfg.n_params() / 1e6:.2f}M params, {cfg.layers} layers, dim {cfg.dim}, "
          f"vocab {cfg.vocab}, {args.dtype}):")
    for f in files:
        print(f"  {f}  {f.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
