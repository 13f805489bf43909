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
for run.c on the same file. --compare llama.cpp times llama.cpp (llama-cpp-python) the same way on the
model's own GGUF export (f32 tensors, f32 KV cache, --threads threads) in the same run, and says for how
many steps its greedy tokens equal ours.
"""

import os
import statistics
import tempfile
import time
from dataclasses import replace

import numpy as np

from ..host import blas
from ..data.corpus import builtin_dataset
from .. import sources
from ..errors import AnectypesError
from ..formats import gguf
from ..formats.export import check_target
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


def bench_source(args):
    """The model to time: a preset with random weights (α = 1, as run.c's and llama.cpp's models, and BOS's
    embedding row zero; bench_tokenizer's for --write and --compare); or a model source (anectypes.sources)."""
    if args.model not in PRESETS:
        return sources.resolve(args.model, untied=True)
    cfg = replace(load_config(args.model), residual_scaled=False)
    params = init_params(cfg, np.random.default_rng(0))
    params["embed"][BOS] = 0
    model = sources.Source(cfg, params, bench_tokenizer(cfg.vocab) if args.write or args.compare else None)
    if args.write:
        try:
            write_model(os.path.join(args.write, "model.bin"), cfg, params)
            model.tokenizer.save(os.path.join(args.write, "tokenizer.bin"))
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""          # a full disk names no file
            raise AnectypesError(f"--write {args.write}: {where}{e.strerror or e}") from None
    return model


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
    """ms of each greedy step after the first position (a forward of the last token, and the argmax), and the
    tokens decoded."""
    decoder.reset()
    logits, times, tokens = decoder.forward(np.array([BOS])), [], []
    while decoder.pos < steps:
        t0 = time.perf_counter()
        tokens.append(int(np.argmax(logits)))
        logits = decoder.forward(np.array(tokens[-1:]))
        times.append((time.perf_counter() - t0) * 1e3)
    return times, tokens


def breakdown(decoder, decode_ms, reps=20):
    """A decoded token's ms by part: the classifier's sgemv, the layers' sgemv (the same bound calls
    in a loop, median of reps), and the rest of the median step (numpy's work, Python's, the argmax)."""
    products = [call for layer in decoder.gemv for call in layer.values()]
    classifier = statistics.median(timed(decoder.classify, reps, 1))
    layers = statistics.median(timed(lambda: [call() for call in products], reps, 1))
    return dict(classifier=classifier, layer_products=layers, rest=max(0.0, decode_ms - classifier - layers))


def llama_cpp():
    """llama-cpp-python's module, or one line naming the extra that brings it."""
    try:
        import llama_cpp as module
    except ImportError:
        raise AnectypesError("--compare llama.cpp needs llama-cpp-python: pip install 'anectypes[llamacpp]'") from None
    return module


def llama_cpp_run(model, prompt, steps, threads, rounds):
    """llama.cpp (through llama-cpp-python) on the model's own GGUF export, f32 tensors and an f32 KV cache (as our
    decoder's), on `threads` threads: a prefill over `prompt` (median of 3) and greedy decoding from BOS for
    `steps` positions, each step an argmax and an eval of one token, timed as ours."""
    module = llama_cpp()
    if model.tokenizer is None:                                          # a run on --data without one
        model = replace(model, tokenizer=bench_tokenizer(model.cfg.vocab))
    try:
        check_target(model, "gguf", "f32")
    except AnectypesError as e:
        raise AnectypesError(f"--compare llama.cpp: the model has no GGUF export: {e}") from None
    n = model.cfg.seq
    with tempfile.TemporaryDirectory(prefix="anectypes-bench-") as folder:
        path = os.path.join(folder, "model.gguf")
        gguf.write(model, path, "f32")
        llm = module.Llama(path, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads, n_threads_batch=threads,
                           type_k=0, type_v=0, verbose=False)            # 0: GGML_TYPE_F32
        try:
            vocab = llm.n_vocab()
            logits = lambda: np.ctypeslib.as_array(module.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))

            def decode(positions):
                llm.reset()
                llm.eval([BOS])
                times, tokens = [], []
                while llm.n_tokens < positions:
                    t0 = time.perf_counter()
                    tokens.append(int(np.argmax(logits())))
                    llm.eval(tokens[-1:])
                    times.append((time.perf_counter() - t0) * 1e3)
                return times, tokens

            decode(min(steps, 16))                                       # warm-up, as ours
            prefill = []
            for _ in range(3):
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(prompt.tolist())
                prefill.append((time.perf_counter() - t0) * 1e3)
            runs = [decode(steps) for _ in range(rounds)]
        finally:
            llm.close()
    times = [t for run, _ in runs for t in run]
    return dict(version=module.__version__, threads=threads, tensors="f32", kv_cache="f32",
                prefill=dict(tokens=len(prompt), tokens_per_s=len(prompt) / statistics.median(prefill) * 1e3,
                             **timing(prefill)),
                decode=dict(tokens=len(times), tokens_per_s=len(times) / sum(times) * 1e3, **timing(times)),
                greedy=runs[0][1])


def run(args):
    """(the benchmark's figures, the summary's)"""
    model = bench_source(args)
    decoder = Decoder.of(model, args.lanes or lanes_for(args.threads))      # (bench's main sets --threads)
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
    runs = [decode_times(decoder, steps) for _ in range(args.rounds)]
    times = [t for run, _ in runs for t in run]
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
    if args.compare == "llama.cpp":
        theirs = llama_cpp_run(model, prompt, steps, args.threads, args.rounds)
        ours = runs[0][1]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs.pop("greedy"))) if a != b), len(ours))
        theirs.update(greedy_equal=same, decode_ratio=theirs["decode"]["tokens_per_s"] / rate,
                      prefill_ratio=theirs["prefill"]["tokens_per_s"] / figures["prefill"]["tokens_per_s"])
        figures["compare"] = {"llama.cpp": theirs}
        summary.update(llama_cpp_decode_tokens_per_s=theirs["decode"]["tokens_per_s"],
                       decode_time_ratio_vs_llama_cpp=theirs["decode_ratio"])
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
            "the rest (numpy, Python) {rest:.3f}".format(**f["breakdown_ms"])
            + ("" if "compare" not in f else "\n" + compared(f["compare"]["llama.cpp"], f["steps"] - 1)))


def compared(t, decoded):
    return (f"llama.cpp (llama-cpp-python {t['version']}) on this model's GGUF export, f32 tensors and KV cache, "
            f"{t['threads']} threads\n" + table(COLUMNS, [("prefill", t["prefill"]), ("decode", t["decode"])]) +
            f"\nour decode takes {t['decode_ratio']:.2f}x llama.cpp's time per token (prefill "
            f"{t['prefill_ratio']:.2f}x); greedy tokens equal for the first {t['greedy_equal']} of {decoded}")
