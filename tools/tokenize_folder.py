"""Tokenize a folder of text files into one uint16 token file for training.

    python tools/tokenize_folder.py --tokenizer tok.bin --out data.bin FOLDER [--ext .txt]

Every file whose name ends with --ext, searched recursively and taken in sorted order of its
relative path, is one document: BOS, then its UTF-8 text encoded with the llama2.c tokenizer.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # use the checkout's anectypes

import numpy as np  # noqa: E402

from anectypes.data.tokens import write_tokens
from anectypes.errors import DataError  # noqa: E402
from anectypes.data.tokenizer import Tokenizer


def fail(message):
    print(f"tokenize_folder: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Encode every text file in FOLDER into one uint16 token file.")
    ap.add_argument("folder", metavar="FOLDER", type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path, help="llama2.c tokenizer.bin")
    ap.add_argument("--out", required=True, type=Path, help="token file to write (uint16, little-endian)")
    ap.add_argument("--ext", default=".txt", help="file name ending to include (default .txt)")
    args = ap.parse_args(argv)

    if not args.folder.is_dir():
        fail(f"{args.folder}: no such folder")
    files = sorted((p for p in args.folder.rglob("*") if p.is_file() and p.name.endswith(args.ext)),
                   key=lambda p: p.relative_to(args.folder).as_posix())
    if not files:
        fail(f"{args.folder}: no files ending in '{args.ext}'; pass --ext to choose another ending")
    try:
        tokenizer = Tokenizer.load(args.tokenizer)
    except DataError as e:
        fail(f"bad tokenizer: {e}")
    if tokenizer.vocab_size > 65536:
        fail(f"{args.tokenizer}: {tokenizer.vocab_size} tokens do not fit a uint16 token file")

    parts = []
    for n, path in enumerate(files, 1):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            fail(f"{path}: not UTF-8 text (byte {e.start}); convert it or leave it out with --ext")
        ids = np.array(tokenizer.encode(text, bos=True), dtype=np.uint16)
        parts.append(ids)
        print(f"[{n}/{len(files)}] {path.relative_to(args.folder).as_posix()}: {len(text)} chars, {len(ids)} tokens",
              file=sys.stderr)
    tokens = np.concatenate(parts)
    write_tokens(args.out, tokens)
    distinct = int(np.count_nonzero(np.bincount(tokens)))
    print(f"{len(files)} files, {len(tokens)} tokens, {distinct} distinct ids -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
