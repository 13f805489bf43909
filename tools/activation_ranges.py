"""fp16 ranges of any model source, per layer, before and after the fp16 guards (anectypes/model/ranges.py): one
forward of a window on the simulator in fp32 (the truth), in fp16 at scale 1 (no guard) and in fp16 at the scales
the guards choose. Per layer: the residual stream's largest |value| and its margin to fp16's 65,504, each norm's
largest first sum of squares (the engine's sums must stay under 2^15) and the positions whose normalized input is
all zero (a norm that overflowed), and the loss of the window.

    python tools/activation_ranges.py SOURCE [--data FILE] [--seq 128]

SOURCE is a preset (random weights from its seeded init) or any model source (a run, a checkpoint, a Hugging Face
folder, a GGUF file, a llama2.c model.bin); the window is --data's first tokens (text with the source's tokenizer,
or a token file), else the built-in corpus'. docs/model.md has the table for SmolLM2-135M-Instruct."""

import argparse
from dataclasses import replace

import numpy as np

from anectypes.data.corpus import builtin_dataset
from anectypes.data.text import is_text
from anectypes.data.tokens import load_tokens
from anectypes.device import open_device
from anectypes.model.config import PRESETS, init_params, load_config
from anectypes.model.loss import cross_entropy
from anectypes.model.ranges import norm_names, observe
from anectypes.model.transformer import Transformer
from anectypes.sources import resolve


def window(args, tokenizer):
    """The first seq+1 tokens of --data (text through the source's tokenizer) or of the built-in corpus."""
    if not args.data:
        return builtin_dataset()[1][:args.seq + 1]
    if is_text(args.data):
        with open(args.data, encoding="utf-8") as f:
            return np.array(tokenizer.encode(f.read()), np.int64)[:args.seq + 1]
    return np.asarray(load_tokens(args.data)[:args.seq + 1], np.int64)


def one_forward(cfg, params, tokens, precision, guarded):
    """(loss, per-layer rows) of one forward: the stream's largest |value| (in the model's units), each norm's largest
    first sum of squares as computed, and the positions its output is all zero at."""
    with Transformer(cfg, open_device("sim", precision=precision), dict(params), np.arange(cfg.vocab)) as t:
        if not guarded:
            t.guarded, t.calibrated = False, True        # the kernels at scale 1, nothing checked
        loss = cross_entropy(t.logits(tokens[:-1]), tokens[1:])[0]
        seen, rows = observe(t), []
        for i in range(cfg.layers):
            xn, x2n = t.read("sdpaFwd", t.out_surface("sdpaFwd", i), "xn"), t.read("ffnFused", t.out_surface("ffnFused", i), "x2n")
            x_next = t.read("ffnFused", t.out_surface("ffnFused", i), "x_next")
            sums = {n: c * (seen.need[n][i] * t.scales.first_unit(n, i) * t.scales.norms[n][i]) ** 2
                    for n, c in norm_names(cfg).items()}
            rows.append(dict(stream=float(np.abs(x_next).max()) / t.scales.stream, sums=sums,
                             zeros={"att": int((~np.isfinite(xn) | (xn == 0)).all(axis=0).sum()),
                                    "ffn": int((~np.isfinite(x2n) | (x2n == 0)).all(axis=0).sum())}))
        return loss, rows, t.scales.describe()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a preset or a model source")
    ap.add_argument("--data", help="text or a token file: the window (default: the built-in corpus)")
    ap.add_argument("--seq", type=int, default=128, help="the window's length (default: 128)")
    args = ap.parse_args(argv)
    if args.source in PRESETS:
        cfg = load_config(args.source)
        params, tokenizer = init_params(cfg, np.random.default_rng(42)), None
    else:
        src = resolve(args.source, text=bool(args.data and is_text(args.data)), untied=True)
        cfg, params, tokenizer = src.cfg, src.params, src.tokenizer
    cfg = replace(cfg, seq=args.seq)
    tokens = window(args, tokenizer)
    runs = {name: one_forward(cfg, params, tokens, *how) for name, how in
            (("fp32", ("fp32", False)), ("before", ("fp16", False)), ("after", ("fp16", True)))}
    print(f"{args.source}, {len(tokens) - 1} tokens: loss fp32 {runs['fp32'][0]:.4f}, fp16 at scale 1 (no guard) "
          f"{runs['before'][0]:.4f}, fp16 with the guards {runs['after'][0]:.4f} (scales: {runs['after'][2]})\n")
    print("| layer | stream's largest \\|x\\| (fp32) | margin to 65,504 | first sums of squares, att / ffn: scale 1 | "
          "guarded | positions zeroed, att / ffn: scale 1 | guarded |\n|---|---|---|---|---|---|---|")
    for i, (truth, before, after) in enumerate(zip(*(runs[k][1] for k in ("fp32", "before", "after")))):
        print(f"| {i} | {truth['stream']:.4g} | {65504 / truth['stream']:.3g}× | "
              f"{before['sums']['att']:.3g} / {before['sums']['ffn']:.3g} | "
              f"{after['sums']['att']:.3g} / {after['sums']['ffn']:.3g} | "
              f"{before['zeros']['att']} / {before['zeros']['ffn']} | {after['zeros']['att']} / {after['zeros']['ffn']} |")


if __name__ == "__main__":
    main()
