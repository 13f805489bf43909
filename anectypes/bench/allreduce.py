"""allreduce (under mpirun): what summing the gradients over the ranks costs, per preset.

For each preset's gradient buffer (all its parameters in fp32, the trainer's one flat buffer), the
in-place MPI Allreduce's median time over --reps, and its bandwidths as nccl-tests reports them:
algbw = bytes / time and busbw = algbw · 2(n−1)/n (what each link carries in a ring; comparable
across rank counts). Then the same buffer in per-layer buckets with non-blocking Iallreduce, alone and
started before a stand-in for the backward's remaining work (a sleep as long as the flat Allreduce:
on the ANE the CPU mostly waits for the engine), to see how much of it overlaps; and the latency of
a 4-byte Allreduce (OSU's osu_allreduce smallest size).
"""

import statistics
import time

import numpy as np

from ..train.distributed import World
from ..errors import AnectypesError
from ..model.config import PRESETS
from .report import report
from .timing import timing

NOTE = "MPI figures (mpirun's transport between these ranks)"
LATENCY_REPS = 1000


def buckets(cfg, buffer):
    """The flat buffer cut into per-layer pieces (the non-layer parameters last): the sizes a backward
    would hand to Iallreduce as each layer's gradients complete."""
    per_layer = (cfg.n_params() - cfg.vocab * cfg.dim - cfg.dim) // cfg.layers
    edges = [i * per_layer for i in range(cfg.layers + 1)] + [buffer.size]
    return [buffer[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def timed_together(world, fn, reps, warmup):
    """Per-rep times (ms) of fn on all ranks together, each rep starting at a barrier; the slowest rank's."""
    times = []
    for i in range(warmup + reps):
        world.barrier()
        t0 = time.perf_counter()
        fn()
        ms = world.comm.allreduce((time.perf_counter() - t0) * 1e3, op=world.MPI.MAX)
        if i >= warmup:
            times.append(ms)
    return times


def measure(world, name, reps, warmup):
    MPI, comm, n = world.MPI, world.comm, world.size
    cfg = PRESETS[name]
    buffer = np.ones(cfg.n_params(), np.float32)
    pieces = buckets(cfg, buffer)
    flat = timed_together(world, lambda: comm.Allreduce(MPI.IN_PLACE, buffer), reps, warmup)
    bucketed = timed_together(world, lambda: MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, p) for p in pieces]),
                     reps, warmup)
    compute = statistics.median(flat) / 1e3

    def overlapped():
        requests = [comm.Iallreduce(MPI.IN_PLACE, p) for p in pieces]
        time.sleep(compute)                           # the rest of the backward, without MPI calls
        MPI.Request.Waitall(requests)

    over = timed_together(world, overlapped, reps, warmup)
    t, tb, to = (statistics.median(x) for x in (flat, bucketed, over))
    algbw = buffer.nbytes / (t / 1e3) / 1e9
    return dict(model=name, params=cfg.n_params(), mib=round(buffer.nbytes / 2**20, 2), **timing(flat),
                algbw_gbps=algbw, busbw_gbps=algbw * 2 * (n - 1) / n, buckets=len(pieces), ms_buckets_median=tb,
                ms_compute=compute * 1e3, ms_overlapped_median=to,
                hidden_fraction=min(1.0, max(0.0, (compute * 1e3 + tb - to) / tb)))


def run(args):
    """(the benchmark's figures, the summary's) on rank 0; None on the others."""
    world = World()
    if world.size < 2:
        raise AnectypesError("allreduce measures MPI ranks: run it under mpirun with 2 or more processes, "
                             "e.g. mpirun -n 2 python -m anectypes.bench allreduce")
    tiny = np.zeros(1, np.float32)
    latency = timed_together(world, lambda: world.comm.Allreduce(world.MPI.IN_PLACE, tiny), LATENCY_REPS, 10)
    sizes = [measure(world, name, args.reps, args.warmup) for name in args.models]
    if world.rank:
        return None
    big = max(sizes, key=lambda s: s["params"])
    return (dict(ranks=world.size, reps=args.reps, warmup=args.warmup,
                 latency_us_median=statistics.median(latency) * 1e3, sizes=sizes),
            dict(ranks=world.size, allreduce_busbw_gbps=big["busbw_gbps"],
                 allreduce_latency_us=statistics.median(latency) * 1e3))


def text(args, r):
    lines = [f"allreduce over {r['ranks']} ranks (in place, fp32; median of {r['reps']} after {r['warmup']} "
             f"warm-up); 4-byte latency {r['latency_us_median']:.1f} us",
             f"{'preset':12s} {'MiB':>9s} {'ms':>9s} {'algbw GB/s':>11s} {'busbw GB/s':>11s} "
             f"{'buckets':>7s} {'bucketed ms':>11s} {'overlap ms':>10s} {'hidden':>6s}"]
    for s in r["sizes"]:
        lines.append(f"{s['model']:12s} {s['mib']:9.1f} {s['ms_median']:9.2f} {s['algbw_gbps']:11.2f} "
                     f"{s['busbw_gbps']:11.2f} {s['buckets']:7d} {s['ms_buckets_median']:11.2f} "
                     f"{s['ms_overlapped_median']:10.2f} {100 * s['hidden_fraction']:5.0f}%")
    lines.append("overlap ms: the buckets' Iallreduce started, then a sleep as long as the flat Allreduce (the "
                 "backward's other work), then waited for; hidden: the share of the bucketed time it hid")
    return "\n".join(lines)


def command(args):
    """The subcommand: the report on rank 0 (printed as text there, or returned for --json)."""
    out = run(args)
    if out is None:
        return None
    figures, summary = out
    if args.json:
        return report("mpi", "fp32", None, {"allreduce": dict(note=NOTE, **figures)}, dict(note=NOTE, **summary))
    print(NOTE)
    print(text(args, figures))
    return None
