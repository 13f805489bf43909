"""python -m anectypes.eval — the loss and perplexity of a model on a test set, on the training kernels.

    python -m anectypes.eval runs/<run> --data test.txt                  # its best checkpoint, else latest
    python -m anectypes.eval ~/models/SmolLM2-135M-Instruct --data test.jsonl --precision fp32 --json

SOURCE is any model source (anectypes.sources): a run folder (LoRA runs with their adapters merged), an
anectypes .ckpt, a llama2.c model file or folder, a Hugging Face Llama or Qwen3 folder, a GGUF file. --data
is what train takes: a .txt file or a folder of them, a .jsonl of {"text"} or chat {"messages"} rows (only
the assistant's tokens count), or a llama2.c token file (.bin); text is tokenized with the source's
tokenizer (or --tokenizer's) and no token cache is written. The stream is cut into consecutive windows of
--seq predicted tokens, each token but the first predicted once, and scored over the model's whole
vocabulary with the training kernels' forward (docs/eval.md has the definition and the transformers code
that computes the same figure).
"""

import argparse
import json
import sys

from ..cli import ArgumentParser, at_least, one_line_errors, quiet_on_closed_stdout
from ..device import BACKENDS
from .scoring import SEQ, evaluate


def parse_args(argv):
    ap = ArgumentParser(prog="python -m anectypes.eval", description=__doc__.splitlines()[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("source", metavar="SOURCE", help="a run folder, an anectypes .ckpt, a llama2.c model.bin or "
                                                "folder, a Hugging Face folder or a GGUF file")
    ap.add_argument("--data", required=True, metavar="FILE", help="a .txt file or folder, a .jsonl file or a "
                                                                  "llama2.c token file (.bin)")
    ap.add_argument("--seq", type=at_least(1), help=f"predicted tokens per window (default: a run's seq, else {SEQ} "
                                                     "or the model's context if shorter; at most that context)")
    ap.add_argument("--backend", choices=BACKENDS, default="auto",
                    help="auto: the ANE if present, else the simulator (default: auto)")
    ap.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                    help="simulator precision: fp16 like the ANE, fp32 exact (default: fp16)")
    ap.add_argument("--checkpoint", help="of a run folder: best, latest or a .ckpt file (default: best, else latest)")
    ap.add_argument("--tokenizer", help="a llama2.c tokenizer.bin or a Hugging Face folder's tokenizer (default: "
                    "the source's own)")
    ap.add_argument("--json", action="store_true", help="print one JSON object, not a summary")
    return ap.parse_args(argv)


def progress_line(out):
    """A progress callback that rewrites one line on a terminal (None elsewhere: logs get the summary alone)."""
    if not out.isatty():
        return None

    def show(i, n, tokens, seconds):
        out.write(f"\rwindow {i} of {n}, {tokens / max(seconds, 1e-9):,.0f} tokens/s" + ("\n" if i == n else ""))
        out.flush()
    return show


@quiet_on_closed_stdout
@one_line_errors
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    r = evaluate(args.source, args.data, seq=args.seq, backend=args.backend, precision=args.precision,
                 checkpoint=args.checkpoint, tokenizer=args.tokenizer, progress=progress_line(sys.stderr))
    if args.json:
        print(json.dumps(dict(source=args.source, data=args.data, **r.to_dict())))
    else:
        which = f" ({r.checkpoint}, step {r.step})" if r.checkpoint else ""
        print(f"{args.source}{which} on {args.data}: loss {r.loss:.4f} nats, perplexity {r.perplexity:.2f}\n"
              f"{r.tokens:,} tokens predicted in {r.windows:,} windows of {r.seq} ({r.backend}, {r.precision}, "
              f"{r.seconds:.1f} s)")
    return 0
