"""python -m anectypes.generate — text from a model, streamed as it is produced, with the KV-cache
decoder on the CPU (anectypes.generate.decoder).

    python -m anectypes.generate runs/<run>                      # its best checkpoint
    python -m anectypes.generate runs/<run> --checkpoint latest --prompt "Once upon a time"
    python -m anectypes.generate model.bin --tokenizer tokenizer.bin --temperature 0 --json
    python -m anectypes.generate ~/models/SmolLM2-135M-Instruct --chat --prompt "What is a llama?"

SOURCE is any model source (anectypes.sources): a run folder, an anectypes .ckpt, a llama2.c model
file (version 0, the one run.c reads, or 1; a shared classifier or its own) or its folder, a Hugging
Face Llama folder, a GGUF file. A run's text uses its tokenizer (the built-in one for the built-in
corpus) and its compact vocabulary (docs/ane-reference.md §4.7); a llama2.c model uses the
tokenizer.bin beside it unless --tokenizer names one, a Hugging Face folder its tokenizer.json.
Generation follows run.c: the prompt after BOS, then tokens until --steps positions are fed or the model
produces BOS (a Hugging Face tokenizer's EOS). --chat takes the prompt as a user's message, written
with the model's chat template and the assistant's turn begun, and prints the reply alone, up to the
end of its turn (each --interactive line is a conversation of its own). Sampling at --temperature (0:
greedy), from the --top-k largest (0: all), then from the smallest set whose probability exceeds
--top-p. On Linux x86-64 each decode step's products are shared by --threads processes, up to 8 and
the cores this process may run on (anectypes.generate.lanes).
"""

import argparse
import json
import math
import os
import sys
import time

from .. import sources
from ..cli import ArgumentParser, at_least, quiet_on_closed_stdout
from ..data.text import chat_text, need_chat
from ..errors import AnectypesError
from ..host import accelerate, blas
from .decoder import Decoder
from .lanes import lanes_for
from .sampling import TEMPERATURE, TOP_K, TOP_P, Sampler, TextStream, stream


def parse_args(argv):
    ap = ArgumentParser(prog="python -m anectypes.generate", description=__doc__.splitlines()[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("source", metavar="SOURCE", help="a run folder, an anectypes .ckpt, a llama2.c model.bin or "
                                                "folder, a Hugging Face Llama folder or a GGUF file")
    ap.add_argument("--checkpoint", help="of a run folder: best (default), latest or a .ckpt file")
    ap.add_argument("--tokenizer", help="a llama2.c tokenizer.bin or a Hugging Face folder's tokenizer (default: "
                    "the run's, the one beside model.bin, or a Hugging Face folder's own)")
    ap.add_argument("--prompt", default="", help="text to continue (default: none, start at BOS)")
    ap.add_argument("--chat", action="store_true", help="the prompt is a user's message to the model, written "
                    "with its chat template (a Hugging Face folder's); the reply is printed")
    ap.add_argument("--steps", type=at_least(1), help="positions in all, prompt included, as run.c's -n "
                                                       "(default: 256, or the model's seq if smaller; at most seq)")
    ap.add_argument("--temperature", type=float, default=TEMPERATURE, help=f"0: greedy (default {TEMPERATURE})")
    ap.add_argument("--top-p", type=float, default=TOP_P, help=f"nucleus sampling, 1: off (default {TOP_P})")
    ap.add_argument("--top-k", type=at_least(0), default=TOP_K,
                    help="sample from the k most probable, 0: all (default 0)")
    ap.add_argument("--seed", type=at_least(0), help="sampling seed (default: a random one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end, not the text")
    ap.add_argument("--interactive", action="store_true", help="read the prompts from stdin, one a line (so not "
                                                                "with --prompt)")
    ap.add_argument("--threads", type=at_least(1), default=os.cpu_count(), help="cores to use: the BLAS's threads "
                    "(Accelerate, macOS 15: 1 is single-threaded, more lets it choose), and on Linux x86-64 the "
                    "decode lanes, up to 8 and the cores available (default: all cores)")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        ap.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 <= args.top_p <= 1:
        ap.error(f"--top-p must be in [0, 1], got {args.top_p}")
    if args.interactive and args.prompt:
        ap.error("--interactive reads every prompt from stdin: pass the first one there, not with --prompt")
    return args


def run_one(decoder, tokenizer, args, prompt, sampler):
    """Generate for one prompt: the text streamed to stdout (or the JSON object), the stats on stderr."""
    steps = args.steps or min(256, decoder.cfg.seq)
    ids = (tokenizer.encode(chat_text(tokenizer, [dict(role="user", content=prompt)], True), bos=False)
           if args.chat else tokenizer.encode(prompt, bos=True))
    if len(ids) > steps:
        what = "in the chat template" if args.chat else "with BOS"
        raise AnectypesError(f"the prompt is {len(ids)} tokens ({what}) but --steps is {steps}")
    out = TextStream(tokenizer, ids[-1] if args.chat else None)
    if not args.json and not args.chat:
        sys.stdout.write("".join(map(out, ids)))
    t0 = time.perf_counter()
    times = []
    for t in stream(decoder, ids, steps, sampler, tokenizer.stop):
        times.append(time.perf_counter())
        ids.append(t)
        if not args.json:
            sys.stdout.write(out(t))
            sys.stdout.flush()
    n_prompt, n = len(ids) - len(times), len(times)
    rate = (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0
    first_ms = (times[0] - t0) * 1e3 if times else 0.0
    if args.json:
        print(json.dumps(dict(ids=ids, text=tokenizer.decode(ids), tokens_per_s=rate, ms_first_token=first_ms,
                              n_prompt=n_prompt, n_generated=n)))
    else:
        print(flush=True)
    print(f"achieved {rate:.1f} tok/s ({n} tokens, first token {first_ms:.1f} ms)", file=sys.stderr, flush=True)


@quiet_on_closed_stdout
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    decoder = None
    try:
        accelerate.library()                       # a bad ANECTYPES_ACCELERATE stops here
        if blas.thread_control() is None and args.threads != os.cpu_count():
            print(f"note: the BLAS ({blas.library_path()}) has no thread control (Accelerate's needs macOS 15): "
                  f"--threads {args.threads} does not limit its threads", file=sys.stderr)
        with blas.threads(args.threads):
            source = sources.resolve(args.source, args.checkpoint, args.tokenizer, text=True, untied=True)
            decoder, tokenizer = Decoder.of(source, lanes_for(args.threads)), source.tokenizer
            if args.chat:
                need_chat(tokenizer)
            if args.steps is not None and args.steps > decoder.cfg.seq:
                raise AnectypesError(f"--steps {args.steps} is beyond the model's seq ({decoder.cfg.seq})")
            sampler = Sampler(len(decoder.logits), args.temperature, args.top_p, args.top_k, args.seed)
            # stdin's lines as bytes: text that is not UTF-8 reaches the tokenizer as a bad --prompt does
            prompts = ((line.decode("utf-8", "surrogateescape").rstrip("\n") for line in sys.stdin.buffer)
                       if args.interactive else [args.prompt])
            for prompt in prompts:
                run_one(decoder, tokenizer, args, prompt, sampler)
    except AnectypesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        if decoder:
            decoder.close()
    return 0
