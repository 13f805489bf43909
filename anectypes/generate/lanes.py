"""Matrix-vector products shared by processes that wait by spinning: the decoder's token steps on
several cores (Linux on x86-64).

OpenBLAS runs an sgemv on one thread when the matrix has fewer than 460,800 elements (a compile-time
threshold, 115200 · GEMM_MULTITHREAD_THRESHOLD), so stories15M's layers would decode on one core,
and its threads sleep between calls. Here every product is cut into row ranges, one per lane: this
process computes the first, and each partner process (`python -m anectypes.generate.lanes`, started
with the decoder) the next, all with one BLAS thread. Each process reads its rows from memory of its
own, advised to use huge pages (`private_copies`; the partners get theirs once, through a memfd
that is closed once they have copied them): memory shared between processes has 4 KiB pages (shmem's
transparent huge pages are off by default), and a product streams faster from 2 MiB ones. This
process keeps the whole matrices (a prompt's sgemm and a product computed alone read them), so n
lanes hold 1 + (n−1)/n times the weights. The vectors live in a memfd mapping that the partners map
too; a product is handed over through words in it (the product's number and a sequence number, then
each partner's `done` word on its own cache line), which the other side polls: far faster than a
lock and a sleeping thread. Polling relies on x86's ordering of stores, hence the platform.

A partner that found no work for SPIN_S sleeps in a read of its stdin; the lanes write a byte there
to wake it (after a pause, or when a product takes long), and it exits at end of file: when the
decoder is closed or this process dies, however it dies. Polling needs a core per lane: when other
work has the cores, a partner is late, and decoding falls well below one lane's speed, so after LATE
late products in a row this process computes every product alone for ALONE_S, then tries the lanes
again. docs/decode-speed.md has the measurements behind these choices.
"""

import json
import mmap
import os
import platform
import subprocess
import sys
import time
import weakref

import numpy as np

from ..host import blas
from ..errors import AnectypesError

SPIN_S = 0.005        # a partner idle this long goes to sleep
MAX_LANES = 8
LATE, LATE_S, ALONE_S = 3, 0.0001, 1.0   # a partner LATE_S later than this process, LATE times in a row: alone
LINE = 64             # bytes of a cache line: the control words and each lane's first row are aligned to it
STOP, REST = -1, -2   # product numbers that mean: exit; sleep until woken


def layout(sizes, start=0):
    """Offsets of blocks of these byte sizes laid out one after the other from `start`, each on a cache
    line, and the end."""
    offsets = []
    for n in sizes:
        offsets.append(start)
        start += -(-n // LINE) * LINE
    return offsets, start


def order(a):
    """The memory order of an array or of a view of some of its rows: F when its columns run in memory."""
    return "F" if a.ndim == 2 and a.strides[0] < a.strides[1] else "C"


def views(mm, offsets, specs):
    """float32 arrays [(shape, order), ...] in the mapping mm at the offsets."""
    return [np.ndarray(shape, np.float32, mm, off, order=o) for (shape, o), off in zip(specs, offsets)]


def place(arrays, mm, offsets):
    """Copies of the float32 arrays in the mapping mm at the offsets (each in its own memory order)."""
    out = views(mm, offsets, [(a.shape, order(a)) for a in arrays])
    for o, a in zip(out, arrays):
        o[...] = a
    return out


def private_mapping(sizes):
    """A private mapping advised to use huge pages (where the system has them: Linux with transparent
    huge pages not off) for blocks of these byte sizes, and their offsets."""
    offsets, size = layout(sizes)
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return mm, offsets


def private_arrays(specs):
    """float32 arrays [(shape, order), ...], zeros, in one private_mapping."""
    return views(*private_mapping([4 * int(np.prod(shape)) for shape, _ in specs]), specs)


def private_copies(arrays):
    """Copies of the float32 arrays (each in its own memory order) in one private_mapping."""
    return place(arrays, *private_mapping([a.nbytes for a in arrays]))


def supported():
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and hasattr(os, "memfd_create"))


def lanes_for(threads):
    """The lanes of a decoder given `threads` cores: as many, up to MAX_LANES and the cores this process
    may run on (each lane polls on a core of its own: more lanes than cores decode slower), where
    lanes work; else 1 (its BLAS's threads then share the products that are large enough)."""
    return min(threads, MAX_LANES, len(os.sched_getaffinity(0))) if supported() else 1


class Lanes:
    """n lanes over the arrays given: `share(arrays)` copies them into the shared mapping (once,
    before any product), `product(a, x, y, alpha, beta)` returns a function of no arguments that
    computes y = alpha·a·x + beta·y over all lanes (a, x, y among the shared arrays or views of
    them), `start()` starts the partners once the products are known; `rest()` lets them sleep;
    `close()` ends them. From a product until `rest()` or `close()`, this process's BLAS keeps one
    thread (setting it around every product would cost time on every product)."""

    def __init__(self, n):
        if not supported():
            raise AnectypesError(f"decoding on {n} lanes needs Linux on x86-64; use 1 lane")
        self.n, self.products, self.procs, self.seq = n, [], [], 0
        self.mm = self.base = None
        self.awake_until = self.alone_until = 0.0                    # till then the partners surely poll
        self.late = 0                                                # products in a row a partner was late for
        self.threads = None       # while the lanes run: the BLAS threads this process had (it then uses one)

    def share(self, vectors):
        """Copies of the float32 `vectors` (what the products read and write), in one new mapping
        that the partners map too, after the control words."""
        offsets, size = layout([v.nbytes for v in vectors], LINE * (self.n + 1))
        self.fd = os.memfd_create("anectypes-lanes")
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.base = np.frombuffer(self.mm, np.uint8)
        self.seen = np.frombuffer(self.mm, np.int64, 2)            # [sequence, product]
        self.done = [np.frombuffer(self.mm, np.int64, 1, LINE * k) for k in range(1, self.n)]
        return place(vectors, self.mm, offsets)

    def product(self, a, x, y, alpha=1.0, beta=0.0):
        """y = alpha·a·x + beta·y (a: this process's matrix; x, y: among the shared vectors): rows in
        n ranges that start on a cache line of y."""
        m, step = a.shape[0], LINE // y.itemsize
        edges = [min(m, round(m * k / self.n / step) * step) for k in range(self.n)] + [m]
        parts = [(a[r0:r1], x, y[r0:r1], alpha, beta) for r0, r1 in zip(edges, edges[1:])]
        self.products.append(parts[1:])
        mine = blas.sgemv_call(*parts[0][:3], alpha=alpha, beta=beta) if edges[1] > 0 else None
        whole, j = blas.sgemv_call(a, x, y, alpha=alpha, beta=beta), len(self.products) - 1
        return lambda: self.alone(whole) if time.monotonic() < self.alone_until else self.run(j, mine)

    def start(self):
        """Start the partners, hand them their rows of every product (through a memfd each copies
        them from), and return when they are ready."""
        # the partners import this very package, wherever it came from
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        rows = [p[k][0] for k in range(self.n - 1) for p in self.products if len(p[k][0])]   # partner by partner
        offsets, end = layout([a.nbytes for a in rows])
        size = max(end, 1)
        rows_fd = os.memfd_create("anectypes-lanes-rows")
        os.ftruncate(rows_fd, size)
        with mmap.mmap(rows_fd, size) as rows_mm:
            place(rows, rows_mm, offsets)
        at = iter(offsets)
        describe = lambda v: [int(v.ctypes.data - self.base.ctypes.data), v.shape, v.strides]
        for k in range(1, self.n):
            products = [[[next(at), a.shape, order(a)], describe(x), describe(y), float(alpha), float(beta)]
                        if len(a) else None for a, x, y, alpha, beta in (p[k - 1] for p in self.products)]
            spec = dict(fd=self.fd, size=len(self.mm), rows_fd=rows_fd, rows_size=size, lane=k, products=products)
            # a session of their own: the terminal's Ctrl-C goes to the decoder's process, which ends them
            self.procs.append(subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], stdin=subprocess.PIPE,
                                               pass_fds=(self.fd, rows_fd), env=env, start_new_session=True))
            os.set_blocking(self.procs[-1].stdin.fileno(), False)
        os.close(self.fd)                                            # the mapping stays
        os.close(rows_fd)                                            # gone once the partners have copied their rows
        self._finalize = weakref.finalize(self, stop, self.procs, self.seen)
        self.run(REST, None)                                         # each answers when it is ready
        self.own_threads()

    def wake(self):
        for p in self.procs:
            try:
                os.write(p.stdin.fileno(), b"w")
            except (BlockingIOError, BrokenPipeError):               # it has wake-ups enough, or it is gone
                pass

    def run(self, j, mine):
        """Product j (REST: none) on every lane; returns when all are done. A partner late LATE times
        running lets this process compute the products alone for ALONE_S: the cores are busy elsewhere."""
        now = time.monotonic()
        if now > self.awake_until:                                   # the partners may be asleep
            self.wake()
        self.seq += 1
        self.seen[1] = j
        self.seen[0] = self.seq                                      # stored after the product number
        if self.threads is None:                                     # on one thread: the others have the cores
            self.threads = blas.get_num_threads() or 1
            blas.set_num_threads(1)
        if mine:
            mine()
        own = time.monotonic()
        for done, proc in zip(self.done, self.procs):
            spins = 0
            while done[0] != self.seq:
                spins += 1
                if spins % 1024 == 0:                                # a core short: let the partner run
                    os.sched_yield()
                    if proc.poll() is not None:
                        raise AnectypesError(f"decode lane {proc.pid} exited with code {proc.returncode}")
                    if time.monotonic() - now > SPIN_S / 2:          # asleep after all, or slow: wake it
                        self.wake()
        end = time.monotonic()
        self.late = self.late + 1 if end - own > LATE_S + (own - now) else 0
        if self.late == LATE:
            self.late, self.alone_until = 0, end + ALONE_S
        self.awake_until = end + SPIN_S / 2

    def alone(self, whole):
        """A product computed by this process alone, with all its BLAS threads."""
        self.own_threads()
        whole()

    def own_threads(self):
        """Give this process back the BLAS threads it had before the lanes ran."""
        if self.threads is not None:
            blas.set_num_threads(self.threads)
            self.threads = None

    def rest(self):
        """Let the partners sleep until the next product (before other work that wants the cores), and
        give this process its BLAS threads back."""
        if self.procs and time.monotonic() < self.awake_until:
            self.run(REST, None)
            self.awake_until = 0.0
        self.own_threads()

    def close(self):
        self.own_threads()
        if self.procs:
            self._finalize()


def stop(procs, seen):
    seen[1] = STOP
    seen[0] = seen[0] + 1
    for p in procs:
        p.stdin.close()                                              # end of file: a sleeping partner exits
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def partner(spec):
    """A partner's loop: poll for the next product, compute this lane's rows, say so; sleep when idle."""
    mm = mmap.mmap(spec["fd"], spec["size"])
    view = lambda off, shape, strides: np.ndarray(shape, np.float32, mm, off, strides)
    with mmap.mmap(spec["rows_fd"], spec["rows_size"]) as rows_mm:     # this lane's rows, into memory of its own
        mine = [p and np.ndarray(p[0][1], np.float32, rows_mm, p[0][0], order=p[0][2]) for p in spec["products"]]
        rows = iter(private_copies([a for a in mine if a is not None]))
        del mine
    os.close(spec["rows_fd"])
    blas.set_num_threads(1)
    calls = [p and blas.sgemv_call(next(rows), view(*p[1]), view(*p[2]), alpha=p[3], beta=p[4])
             for p in spec["products"]]
    for call in filter(None, calls):                                 # page in its rows: x is still zero
        call()
    seen, done = np.frombuffer(mm, np.int64, 2), np.frombuffer(mm, np.int64, 1, LINE * spec["lane"])
    last, spins = 0, 0                                               # no product is posted before we start
    idle_since = time.monotonic()
    while True:
        if seen[0] == last:
            spins += 1
            if spins % 1024 == 0:
                os.sched_yield()                                     # a core short: let the decoder run
                if time.monotonic() - idle_since > SPIN_S:
                    if not os.read(0, 4096):                         # the decoder is gone
                        return
                    idle_since = time.monotonic()
            continue
        last = int(seen[0])
        j = int(seen[1])
        if j == STOP:
            return
        if j >= 0 and calls[j]:
            calls[j]()
        done[0] = last
        idle_since = 0.0 if j == REST else time.monotonic()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("error: this is a decoder's partner process, which the decoder starts itself")
    partner(json.loads(sys.argv[1]))
