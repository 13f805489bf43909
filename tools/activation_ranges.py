"""The fp16 ranges of a real-shaped model's activations and gradients, α-scaled against α = 1: one micro-step
on the fp16 simulator from the seeded init, each tensor the CPU reads from the kernels' surfaces summarized
(largest |value|, the share of exact zeros: fp16 flushes what is under 2^-24 to 0), per layer.
`python tools/activation_ranges.py [--model qwen3_06b] [--loss-scale 256]`; docs/model.md has the results."""

import argparse
from dataclasses import replace

import numpy as np

from anectypes.data.corpus import builtin_dataset
from anectypes.device import open_device
from anectypes.model.config import init_params, load_config
from anectypes.model.transformer import Transformer


def ranges(cfg, tokens, loss_scale, seed):
    """{(kernel, segment): [(max |x|, zero share) per read]} and the loss of one micro-step."""
    seen = {}
    window = tokens[:cfg.seq + 1]
    with Transformer(cfg, open_device("sim", precision="fp16"), init_params(cfg, np.random.default_rng(seed)),
                     np.unique(window)) as t:
        read = t.read

        def recording(kernel, surface, *names):
            result = read(kernel, surface, *names)
            for name, a in zip(names, result if len(names) > 1 else [result]):
                seen.setdefault((kernel, name), []).append((float(np.abs(a).max()), float((a == 0).mean())))
            return result
        t.read = recording
        loss = t.forward_backward(window[:-1], window[1:], loss_scale=loss_scale)
    return seen, loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_06b", help="a preset or a JSON file (default: qwen3_06b)")
    ap.add_argument("--loss-scale", type=float, default=256.0, help="the loss scale (default: 256)")
    ap.add_argument("--seed", type=int, default=42, help="init seed (default: 42)")
    args = ap.parse_args(argv)
    cfg = load_config(args.model)
    tokens = builtin_dataset()[1]
    print(f"| {args.model}, loss scale {args.loss_scale:g} | α | loss | tensor | max |x| (layer of it) | "
          "zeros (mean over layers) |\n|---|---|---|---|---|---|")
    for scaled in (True, False):
        c = replace(cfg, residual_scaled=scaled)
        seen, loss = ranges(c, tokens, args.loss_scale, args.seed)
        for (kernel, name), values in seen.items():
            tops = [v[0] for v in values]
            layer = int(np.argmax(tops)) if len(values) == c.layers else "-"
            print(f"| | {c.alpha:.4g} | {loss:.4f} | {kernel}.{name} | {max(tops):.4g} ({layer}) | "
                  f"{np.mean([v[1] for v in values]):.2%} |")


if __name__ == "__main__":
    main()
