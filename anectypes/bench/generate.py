"""generate: the KV-cache decoder (anectypes.generate.decoder) on the CPU: prefill and decode tokens/s,
ms per decoded token (median, p99), and the roofline.

A preset's model gets random weights (its full vocabulary, BOS's embedding row zero so that greedy
decoding never stops early); a path is any model source (anectypes.sources; its tokenizer is not
needed). Either decodes on --lanes lanes (anectypes.generate.lanes; default: as many as --threads
where they work). Prefill times one pass over --steps random tokens (median of 3); decode times
greedy decoding from BOS for --steps positions, each step a forward and an argmax, and splits a step's median time into the
classifier's product, the layers' products (the same bound sgemv calls timed alone) and the rest
(numpy's and Python's work between them). The roofline is the decode rate the memory
allows: the bytes of weights one step reads, divided by the read bandwidth measured in the same run
(the best of 5 sgemv of our BLAS, with its threads, over a 256 MiB matrix: larger than any cache;
measured before and after decoding, the better of the two, since a machine's memory speed can drift).
--write DIR also saves a preset's model as llama2.c's model.bin and a tokenizer.bin of its vocabulary,
for run.c on the same file.
"""

import os
import statistics
import time

import numpy as np

from ..host import blas
from ..data.corpus import builtin_dataset
from .. import sources
from ..errors import AnectypesError
from ..formats.llama2c import write_model
from ..model.config import PRESETS, init_params, load_config
from ..generate.decoder import Decoder
from ..generate.lanes import lanes_for
from ..data.tokenizer import BOS, Tokenizer
from .table import Column, table
from .timing import timed, timing

BANDWIDTH_BYTES = 256 * 2**20
COLUMNS = [Column("", 9, "s", lambda r: r[0], "<"),
           Column("tokens", 8, "d", lambda r: r[1]["tokens"]),
           Column("ms", 10, ".3f", lambda r: r[1]["ms_median"]),
           Column("ms p99", 10, ".3f", lambda r: r[1]["ms_p99"]),
           Column("tok/s", 10, ".1f", lambda r: r[1]["tokens_per_s"])]


def bench_model(args):
    """The decoder to time: a preset with random weights, or a model file / run folder."""
    lanes = args.lanes or lanes_for(args.threads)
    if args.model not in PRESETS:
        return Decoder.of(sources.resolve(args.model, untied=True), lanes)
    cfg = load_config(args.model)
    params = init_params(cfg, np.random.default_rng(0))
    params["embed"][BOS] = 0
    if args.write:
        try:
            write_model(os.path.join(args.write, "model.bin"), cfg, params)
            bench_tokenizer(cfg.vocab).save(os.path.join(args.write, "tokenizer.bin"))
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""          # a full disk names no file
            raise AnectypesError(f"--write {args.write}: {where}{e.strerror or e}") from None
    return Decoder(cfg, params, alpha=1.0, lanes=lanes)


def bench_tokenizer(vocab):
    """The built-in tokenizer's pieces, then made-up ones up to `vocab` (run.c needs one of the model's size)."""
    tok = builtin_dataset()[0]
    extra = max(0, vocab - tok.vocab_size)
    return Tokenizer((tok.pieces + [b" w%d" % i for i in range(extra)])[:vocab],
                     (tok.scores + [-1e6] * extra)[:vocab])


def read_bandwidth(nbytes=BANDWIDTH_BYTES, reps=5):
    """Bytes per second one sgemv reads from a matrix of nbytes (best of reps, after one untimed)."""
    n = 4096
    a = np.ones((nbytes // 4 // n, n), np.float32)
    x, y = np.ones(n, np.float32), np.empty(len(a), np.float32)
    call = blas.sgemv_call(a, x, y)
    call()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def decode_times(decoder, steps):
    """ms of each greedy step after the first position (a forward of the last token, and the argmax)."""
    decoder.reset()
    logits, times = decoder.forward(np.array([BOS])), []
    while decoder.pos < steps:
        t0 = time.perf_counter()
        logits = decoder.forward(np.array([int(np.argmax(logits))]))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def breakdown(decoder, decode_ms, reps=20):
    """A decoded token's ms by part: the classifier's sgemv, the layers' sgemv (the same bound calls
    in a loop, median of reps), and the rest of the median step (numpy's work, Python's, the argmax)."""
    products = [call for layer in decoder.gemv for call in layer.values()]
    classifier = statistics.median(timed(decoder.classify, reps, 1))
    layers = statistics.median(timed(lambda: [call() for call in products], reps, 1))
    return dict(classifier=classifier, layer_products=layers, rest=max(0.0, decode_ms - classifier - layers))


def run(args):
    """(the benchmark's figures, the summary's)"""
    decoder = bench_model(args)                                    # (bench's main sets --threads)
    before = read_bandwidth()                                      # the other lanes sleep till the first product
    cfg, steps = decoder.cfg, min(args.steps, decoder.cfg.seq)
    prompt = np.random.default_rng(1).integers(3, cfg.vocab, steps)
    decode_times(decoder, min(steps, 16))                          # warm-up: first touches, BLAS threads
    prefill = []
    for _ in range(3):
        decoder.reset()
        t0 = time.perf_counter()
        decoder.forward(prompt)
        prefill.append((time.perf_counter() - t0) * 1e3)
    times = [t for _ in range(args.rounds) for t in decode_times(decoder, steps)]
    parts = breakdown(decoder, statistics.median(times))
    decoder.close()
    after = read_bandwidth()
    bandwidth = max(before, after)
    roofline = bandwidth / decoder.weight_bytes
    rate = len(times) / sum(times) * 1e3
    figures = dict(model=args.model, config=cfg.to_dict(), weight_bytes=decoder.weight_bytes,
                   steps=steps, rounds=args.rounds,
                   prefill=dict(tokens=steps, tokens_per_s=steps / statistics.median(prefill) * 1e3, **timing(prefill)),
                   decode=dict(tokens=len(times), tokens_per_s=rate, **timing(times)),
                   lanes=decoder.lanes.n if decoder.lanes else 1, breakdown_ms=parts,
                   bandwidth_gbs=bandwidth / 1e9, bandwidth_before_after_gbs=[before / 1e9, after / 1e9],
                   roofline_tokens_per_s=roofline, roofline_ratio=roofline / rate)
    summary = dict(model=args.model, decode_tokens_per_s=rate,
                   prefill_tokens_per_s=figures["prefill"]["tokens_per_s"], roofline_ratio=roofline / rate)
    return figures, summary


def text(args, f):
    cfg, (before, after) = f["config"], f["bandwidth_before_after_gbs"]
    return (f"generate: {args.model} (dim {cfg['dim']}, {cfg['layers']} layers, vocab {cfg['vocab']}), "
            f"{f['weight_bytes'] / 1e6:.1f} MB of weights per decoded token, BLAS {blas.corename()} "
            f"({blas.get_num_threads()} threads, decode on {f['lanes']} lane{'s' * (f['lanes'] > 1)}); "
            f"prefill: median of 3 passes over {f['steps']} tokens; "
            f"decode: greedy, per token\n"
            + table(COLUMNS, [("prefill", f["prefill"]), ("decode", f["decode"])]) +
            f"\nroofline: read bandwidth {f['bandwidth_gbs']:.1f} GB/s (sgemv over 256 MiB: {before:.1f} before "
            f"decoding, {after:.1f} after) / {f['weight_bytes'] / 1e6:.1f} MB = {f['roofline_tokens_per_s']:.1f} tok/s; "
            f"decode is {f['roofline_ratio']:.2f}x below it\n"
            "a decoded token's median ms: classifier {classifier:.3f}, layers' products {layer_products:.3f}, "
            "the rest (numpy, Python) {rest:.3f}".format(**f["breakdown_ms"]))
