"""python -m anectypes.bench — the reference's benchmarks on this machine, as a table or one JSON object.

    python -m anectypes.bench peak [--depth 128 --channels 512 --spatial 64] [--sweep] [--reps 20]
    python -m anectypes.bench int8 [--depth 128 --channels 512 --spatial 64] [--reps 20]
    python -m anectypes.bench dispatch [--reps 1000]
    python -m anectypes.bench train --model PRESET|CONFIG|DIR [--precision fp16|fp32|both] [--steps 10] [--warmup 2]
                                    [--seq N] [--vocab N] [--active N] [--compare torch]
                                    [--lora RANK [--lora-alpha A] [--lora-targets q,k,v,o]]
    python -m anectypes.bench gemm [--ic 768 --seq 256 --oc 2048] [--reps 20]
    python -m anectypes.bench generate --model PRESET|SOURCE [--steps 256] [--rounds 1] [--threads N] [--lanes N]
                                       [--write DIR] [--compare llama.cpp]
    mpirun -n N python -m anectypes.bench allreduce [--models PRESET ...] [--reps 5] [--warmup 1]
    every subcommand: [--json]; peak, int8, dispatch, train: [--backend auto|sim|ane] [--dialect ios16|ios18];
    peak, int8, dispatch: [--precision fp16|fp32]

peak      the reference's peak program (inmem_peak, docs/ane-reference.md §5.2): N chained 1×1 convs of C
          channels on an fp16 input [1, C, 1, S], the N weights as N chunks of one BLOBFILE;
          TFLOPS = 2·N·C²·S / median eval time. --sweep runs a few (depth, channels, spatial) shapes.
int8      the same chain as W8A8 (ane_int8_bench.m): int8 weights through constexpr_affine_dequantize
          and int8 activations through quantize/dequantize between the convs, next to the fp16
          chain; prints both and the speed-up (fp16 time / int8 time).
dispatch  the eval latency of a tiny kernel (one 1×1 conv, 128 channels, spatial 64): median, p99.
train     time per forward+backward micro-step of a model with its breakdown, GFLOP/s (model FLOPs of
          anectypes.model.flops), the optimizer update (one AdamW step + re-staging the weights),
          MFU against the sgemm peak measured in the same run, peak RSS; each precision in a fresh
          process. --compare torch times the same architecture in PyTorch eager on the CPU (fp32); with
          --lora, the same model in transformers with peft's adapters. Also what the ANE would run per
          micro-step: kernel evaluations, their FLOPs and the CPU's, the bytes staged in fp16.
gemm      the simulator's dynamic matmul (§3.4) in fp32 and fp16 next to numpy.matmul on the same
          shapes: ms, GFLOP/s, time relative to numpy, max relative error.
generate  the KV-cache decoder on the CPU: prefill and decode tokens/s, ms per decoded token (median,
          p99) and the roofline (the bytes of weights a decoded token reads / the read bandwidth
          measured in the same run); a preset with random weights, or a run folder, .ckpt or model.bin.
          --write DIR saves a preset's model as llama2.c's model.bin + tokenizer.bin (for run.c).
allreduce under mpirun: the in-place Allreduce of each preset's gradient buffer (fp32), time, algbw and
          busbw as nccl-tests reports them; per-layer Iallreduce buckets, alone and overlapped with a
          stand-in for the backward; the 4-byte latency (the mpi extra: pip install 'anectypes[mpi]').

Flags out of range, and sizes that cannot fit in this machine's memory, are refused before any work.
On the ANE backend the figures are the engine's. On the simulator they are "simulator figures":
numpy and the CPU BLAS executing the same MIL, which says nothing about the ANE's speed; the table
header and the "note" fields say so. `--json` prints one object of schema version 1
(tools/bench_schema.json): {"schema_version": 1, "system": {...}, "benchmarks": {...}, "summary": {...}},
in the spirit of the community benchmark schema (docs/ane-reference.md §6.3).
"""

import argparse
import contextlib
import json
import os
import sys

from ..cli import ArgumentParser, at_least, quiet_on_closed_stdout
from ..device import BACKENDS, add_dialect_flag, open_device
from ..errors import AnectypesError
from ..generate import lanes
from ..model.config import PRESETS, load_config
from ..model.lora import DEFAULT_TARGETS, check_rank
from ..host import blas
from ..host.system import physical_memory
from . import allreduce, dispatch, gemm, generate, int8, peak, train
from .report import header, note_for, report
from .timing import TIMING_BYTES


def parser():
    ap = ArgumentParser(prog="python -m anectypes.bench", description=__doc__.splitlines()[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n".join(__doc__.splitlines()[2:]))
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="print one JSON object (schema version 1)")
    common = argparse.ArgumentParser(add_help=False, parents=[json_flag])
    common.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: the ANE when present, else the simulator (default auto)")
    add_dialect_flag(common)
    sub = ap.add_subparsers(dest="command", required=True)

    def kernel_command(name, help, reps, warmup):
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                       help="fp32 is a simulator mode (default fp16)")
        p.add_argument("--reps", type=at_least(1), default=reps, help=f"timed evaluations (default {reps})")
        p.add_argument("--warmup", type=at_least(0), default=warmup,
                       help=f"untimed evaluations first (default {warmup})")
        return p

    def chain_shape(p):
        for k, v in peak.PEAK_SHAPE.items():
            p.add_argument(f"--{k}", type=at_least(1), default=v, help=f"default {v}")

    p = kernel_command("peak", "peak throughput: N chained 1x1 convs (inmem_peak)", 20, 3)
    chain_shape(p)
    p.add_argument("--sweep", action="store_true",
                   help="run (depth, channels, spatial) in " + ", ".join(map(str, peak.SWEEP)) + " instead")
    chain_shape(kernel_command("int8", "int8 W8A8 chain vs the fp16 chain (ane_int8_bench)", 20, 3))
    kernel_command("dispatch", "eval latency of a tiny kernel", 1000, 20)

    p = sub.add_parser("train", parents=[common], help="training micro-step throughput of a model",
                       description="training micro-step throughput of a model")
    p.add_argument("--model", default="stories15m", help=f"a preset ({', '.join(PRESETS)}), a JSON config or a "
                                                         "Hugging Face folder (its config.json; random weights)")
    p.add_argument("--precision", choices=("fp16", "fp32", "both"), default="both")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed micro-steps")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed micro-steps first")
    p.add_argument("--rounds", type=at_least(1), default=1, help="run each precision (and PyTorch) this many "
                                                                 "times in turn, each in a fresh process, and pool "
                                                                 "their steps")
    p.add_argument("--seq", type=at_least(1), default=None, help="sequence length (default: the preset's)")
    p.add_argument("--vocab", type=at_least(1), default=None, help="vocabulary size (default: the preset's, "
                                                                   "32000 for the stories models)")
    p.add_argument("--active", type=at_least(1), default=None, help="active (compact) vocabulary size (default: all)")
    p.add_argument("--compare", choices=("torch",), default=None,
                   help="also time the same model in PyTorch eager on the CPU (if PyTorch is installed)")
    p.add_argument("--accum", type=at_least(1), default=10, help="micro-steps per update, for the time per "
                                                                 "micro-step with the update amortized (default 10)")
    p.add_argument("--lora", type=at_least(1), metavar="RANK", help="LoRA fine-tuning instead of full training: "
                   "adapters of this rank, the model frozen; --compare torch then runs transformers + peft "
                   "(default: off)")
    p.add_argument("--lora-alpha", type=float, metavar="A", help="with --lora: the adapters' scale is A/RANK "
                                                                "(default 2·RANK)")
    p.add_argument("--lora-targets", metavar="LIST", help="with --lora: the projections adapted, comma-separated "
                                                          f"from q,k,v,o,gate,up,down (default {DEFAULT_TARGETS})")

    about = "the simulator's dynamic matmul next to numpy.matmul"
    p = sub.add_parser("gemm", parents=[json_flag], help=about, description=about)
    for k, v in gemm.SHAPE.items():
        p.add_argument(f"--{k}", type=at_least(1), default=v, help=f"default {v}")
    p.add_argument("--reps", type=at_least(1), default=20, help="timed evaluations (default 20)")
    p.set_defaults(precision="both")

    about = "the KV-cache decoder's speed on the CPU, and the roofline"
    p = sub.add_parser("generate", parents=[json_flag], help=about, description=about)
    p.add_argument("--model", default="stories15m", help=f"a preset ({', '.join(PRESETS)}; random weights) or "
                                                         "a run folder, .ckpt or llama2.c model.bin")
    p.add_argument("--steps", type=at_least(1), default=256, help="positions decoded from BOS, and the "
                                                                  "prefill's tokens (default 256, at most the "
                                                                  "model's seq)")
    p.add_argument("--rounds", type=at_least(1), default=1, help="decode runs, their steps pooled (default 1)")
    p.add_argument("--threads", type=at_least(1), default=os.cpu_count(),
                   help=f"BLAS threads (default: all cores, {os.cpu_count()} here)")
    p.add_argument("--lanes", type=at_least(1), help="processes sharing each decode product (default: as many as "
                                                     "--threads, up to 8, on Linux x86-64; else 1)")
    p.add_argument("--write", metavar="DIR", help="save a preset's model as DIR/model.bin and DIR/tokenizer.bin")
    p.add_argument("--compare", choices=["llama.cpp"], help="also time llama.cpp (llama-cpp-python, the llamacpp "
                                                             "extra) on the model's GGUF export in f32, same threads")
    p.set_defaults(precision="fp32")

    about = "under mpirun: the gradient Allreduce's time and bandwidth per preset, bucketed and overlapped"
    p = sub.add_parser("allreduce", parents=[json_flag], help=about, description=about)
    p.add_argument("--models", nargs="+", choices=list(PRESETS), default=list(PRESETS),
                   help="the presets whose gradient buffers to sum (default: all)")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed Allreduces per size (default 5)")
    p.add_argument("--warmup", type=at_least(0), default=1, help="untimed ones first (default 1)")
    p.set_defaults(precision="fp32")
    return ap


def check_args(args):
    """Refuse what the parser cannot (each flag's bound is its type), and sizes that cannot fit in this
    machine's memory, before any work."""
    if args.command == "train":
        cfg = train.bench_config(args.model, args.seq, args.vocab)       # fail early on a bad model name
        if args.active is not None and args.active > cfg.vocab:
            raise AnectypesError(f"--active must be at most the vocabulary's {cfg.vocab}, got {args.active}")
        if args.lora is None and (args.lora_alpha is not None or args.lora_targets is not None):
            raise AnectypesError("--lora-alpha and --lora-targets go with --lora RANK")
        if args.lora_alpha is not None and not 0 < args.lora_alpha < float("inf"):
            raise AnectypesError(f"--lora-alpha must be a positive finite number, got {args.lora_alpha}")
        lora = args.lora and check_rank(cfg, train.bench_lora(args.lora, args.lora_alpha, args.lora_targets))
        cfg.check_fits(f"{args.model} with --seq {cfg.seq} --vocab {cfg.vocab}", lora)
        return
    if args.command == "generate":
        if args.lanes and args.lanes > 1 and not lanes.supported():
            raise AnectypesError("--lanes above 1 needs Linux on x86-64")
        if args.write and args.model not in PRESETS:
            raise AnectypesError("--write saves a preset's random model; --model is not a preset")
        if args.compare:
            generate.llama_cpp()
        if args.model in PRESETS:
            check_fits(f"--model {args.model}", "its weights and the bandwidth test",
                       4 * load_config(args.model).n_params() + generate.BANDWIDTH_BYTES)
        return
    if args.command == "allreduce":
        check_fits(f"--models {' '.join(args.models)}", "the largest gradient buffer and MPI's copy of it",
                   8 * max(PRESETS[m].n_params() for m in args.models))
        return
    if args.command == "gemm":
        check_fits(f"--ic {args.ic} --seq {args.seq} --oc {args.oc}", "the matmul's operands and results",
                   gemm.gemm_bytes(args.ic, args.seq, args.oc))
        return
    check_fits(f"--reps {args.reps}", "its timings", TIMING_BYTES * args.reps)
    if args.command in ("peak", "int8"):
        check_fits(f"--depth {args.depth} --channels {args.channels} --spatial {args.spatial}",
                   "the chain's weights, input and output",
                   peak.chain_bytes(args.depth, args.channels, args.spatial, args.command == "int8"))


def check_fits(flags, what, nbytes):
    memory = physical_memory()
    if memory and nbytes > memory:
        raise AnectypesError(f"{flags}: {what} need at least {nbytes / 2**30:,.1f} GiB but this machine has "
                             f"{memory / 2**30:,.1f} GiB")


def show(args, backend, chip, benchmark, figures, summary):
    """The report, or None once `benchmark`'s text (its module's) is printed under whose figures these are."""
    note = note_for(backend)
    if args.json:
        return report(backend, args.precision, chip, {args.command: dict(note=note, **figures)},
                      dict(note=note, **summary))
    print(f"{header(backend, chip)}; {args.precision}")
    print(benchmark.text(args, figures))
    return None


def on_device(args, benchmark):
    """peak, int8 and dispatch: run `benchmark` on the device --backend opens."""
    dev = open_device(args.backend, precision=args.precision, dialect=args.dialect)
    if dev.notice:
        print(dev.notice, file=sys.stderr)
    return show(args, dev.name, dev.chip, benchmark, *benchmark.run(dev, args))


COMMANDS = {"peak": lambda args: on_device(args, peak), "int8": lambda args: on_device(args, int8),
            "dispatch": lambda args: on_device(args, dispatch),
            "gemm": lambda args: show(args, "sim", None, gemm, *gemm.run(args)), "train": train.command,
            "generate": lambda args: show(args, "cpu", None, generate, *generate.run(args)),
            "allreduce": allreduce.command}


@quiet_on_closed_stdout
def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
        threads = getattr(args, "threads", None)               # bench generate's BLAS threads, for its run only
        with blas.threads(threads) if threads else contextlib.nullcontext():
            result = COMMANDS[args.command](args)
    except AnectypesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result is not None:
        print(json.dumps(result))
    return 0
