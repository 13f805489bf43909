"""Matrix-vector products shared by processes that wait by spinning: the decoder's token steps on
several cores (Linux on x86-64).

OpenBLAS runs an sgemv on one thread when the matrix has fewer than 460,800 elements (a compile-time
threshold, 115200 · GEMM_MULTITHREAD_THRESHOLD), so stories15M's layers would decode on one core,
and its threads sleep between calls. Here every product is cut into row ranges, one per lane: this
process computes the first, and each partner process (`python -m anectypes.model.lanes`, started
with the decoder) the next, all with one BLAS thread. The matrices and the vectors live in one
memfd mapping that the partners map too; a product is handed over through words in that mapping
(the product's number and a sequence number, then each partner's `done` word on its own cache
line), which the other side polls: a hand-off takes about 1 µs, against about 17 µs through a lock
and a sleeping thread (measured on a 2-core VM). Polling relies on x86's ordering of stores, hence
the platform.

A partner that found no work for SPIN_S sleeps in a read of its stdin; the lanes write a byte there
to wake it (after a pause, or when a product takes long), and it exits at end of file: when the
decoder is closed or this process dies, however it dies. Polling needs a core per lane: when other
work has the cores, a partner is late (measured with one busy process beside a 2-lane decoder: 40%
of the products waited > 100 µs longer for the partner than for this process, against 0.2% on an
idle machine; decoding fell from 140 to 55 tok/s), so after LATE late products in a row this
process computes every product alone for ALONE_S, then tries the lanes again.
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

from .. import blas
from ..errors import AnectypesError

SPIN_S = 0.005        # a partner idle this long goes to sleep
MAX_LANES = 8
LATE, LATE_S, ALONE_S = 3, 0.0001, 1.0   # a partner LATE_S later than this process, LATE times in a row: alone
LINE = 64             # bytes of a cache line: the control words and each lane's first row are aligned to it
STOP, REST = -1, -2   # product numbers that mean: exit; sleep until woken


def supported():
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and hasattr(os, "memfd_create"))


def lanes_for(threads):
    """The lanes of a decoder given `threads` cores: as many, up to MAX_LANES, where lanes work; else 1
    (its BLAS's threads then share the products that are large enough)."""
    return min(threads, MAX_LANES) if supported() else 1


class Lanes:
    """n lanes over the arrays given: `share(arrays)` copies them into the shared mapping (once,
    before any product), `product(a, x, y, alpha, beta)` returns a function of no arguments that
    computes y = alpha·a·x + beta·y over all lanes (a, x, y among the shared arrays or views of
    them), `start()` starts the partners once the products are known; `rest()` lets them sleep;
    `close()` ends them. From a product until `rest()` or `close()`, this process's BLAS keeps one
    thread (setting it around every product cost 4 µs a product)."""

    def __init__(self, n):
        if not supported():
            raise AnectypesError(f"decoding on {n} lanes needs Linux on x86-64; use 1 lane")
        self.n, self.products, self.procs, self.seq = n, [], [], 0
        self.mm = self.base = None
        self.awake_until = self.alone_until = 0.0                    # till then the partners surely poll
        self.late = 0                                                # products in a row a partner was late for
        self.threads = None       # while the lanes run: the BLAS threads this process had (it then uses one)

    def share(self, arrays):
        """Copies of the float32 `arrays`, in one new mapping (each in its own memory order)."""
        offsets, size = [], LINE * (self.n + 1)                # the control words first
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // LINE) * LINE
        self.fd = os.memfd_create("anectypes-lanes")
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.base = np.frombuffer(self.mm, np.uint8)
        self.seen = np.frombuffer(self.mm, np.int64, 2)            # [sequence, product]
        self.done = [np.frombuffer(self.mm, np.int64, 1, LINE * k) for k in range(1, self.n)]
        out = []
        for a, off in zip(arrays, offsets):
            order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
            out.append(np.ndarray(a.shape, np.float32, self.mm, off, order=order))
            out[-1][...] = a
        return out

    def product(self, a, x, y, alpha=1.0, beta=0.0):
        """y = alpha·a·x + beta·y: rows in n ranges that start on a cache line of y."""
        m, step = a.shape[0], LINE // y.itemsize
        edges = [min(m, round(m * k / self.n / step) * step) for k in range(self.n)] + [m]
        parts = [(a[r0:r1], x, y[r0:r1], alpha, beta) for r0, r1 in zip(edges, edges[1:])]
        self.products.append(parts[1:])
        mine = blas.sgemv_call(*parts[0][:3], alpha=alpha, beta=beta) if edges[1] > 0 else None
        whole, j = blas.sgemv_call(a, x, y, alpha=alpha, beta=beta), len(self.products) - 1
        return lambda: self.alone(whole) if time.monotonic() < self.alone_until else self.run(j, mine)

    def describe(self, v):
        return [int(v.ctypes.data - self.base.ctypes.data), v.shape, v.strides]

    def start(self):
        # the partners import this very package, wherever it came from
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        for k in range(1, self.n):
            spec = dict(fd=self.fd, size=len(self.mm), lane=k,
                        products=[[self.describe(a), self.describe(x), self.describe(y), float(al), float(be)]
                                  if len(y) else None for a, x, y, al, be in (p[k - 1] for p in self.products)])
            # a session of their own: the terminal's Ctrl-C goes to the decoder's process, which ends them
            self.procs.append(subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], stdin=subprocess.PIPE,
                                               pass_fds=(self.fd,), env=env, start_new_session=True))
            os.set_blocking(self.procs[-1].stdin.fileno(), False)
        os.close(self.fd)                                            # the mapping stays
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
    blas.set_num_threads(1)
    calls = [p and blas.sgemv_call(view(*p[0]), view(*p[1]), view(*p[2]), alpha=p[3], beta=p[4])
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
