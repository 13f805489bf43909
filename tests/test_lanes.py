"""The decoder's lanes (anectypes.generate.lanes) as processes: they end with their decoder however it
ends, a lane that dies is an error and not a hang, Ctrl-C is the decoder's alone, a late lane hands
the products back to the decoder's process, and where lanes cannot work there is one. (Their results are checked against the
training forward in test_decoder.py, and through the command against run.c's math in test_generate.py.)"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from anectypes.host import blas
from anectypes.errors import AnectypesError
from anectypes.generate import lanes
from anectypes.model.config import ModelConfig, init_params
from anectypes.generate.decoder import Decoder

pytestmark = pytest.mark.skipif(not lanes.supported(), reason="lanes need Linux on x86-64")

CFG = ModelConfig(dim=64, hidden=160, heads=8, kv_heads=2, head_dim=8, layers=2, seq=32, vocab=96)
PARAMS = init_params(CFG, np.random.default_rng(0))

# a decoder on 2 lanes in a process of its own, which prints its partners' pids and then obeys stdin
# (Ctrl-C while it waits: it ends its lanes and exits 130, as the generate command does)
SCRIPT = textwrap.dedent("""
    import signal, sys, numpy as np
    # Ctrl-C as in a terminal, also when this test runs in a job that ignores SIGINT (a script's `&`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from anectypes.errors import AnectypesError
    from anectypes.model.config import ModelConfig, init_params
    from anectypes.generate import lanes
    from anectypes.generate.decoder import Decoder
    lanes.LATE = 10**9                          # on a busy machine too, every product goes to the lanes
    cfg = ModelConfig(**{cfg})
    dec = Decoder(cfg, init_params(cfg, np.random.default_rng(0)), lanes=2)
    dec.forward(np.array([1]))
    print(*(p.pid for p in dec.lanes.procs), flush=True)
    try:
        sys.stdin.readline()
    except KeyboardInterrupt:
        dec.close()
        sys.exit(130)
    dec.lanes.alone_until = 0.0      # to the lanes: a busy machine may have made the partner late, sending it alone
    try:
        dec.forward(np.array([2]))
    except AnectypesError as e:
        print("error:", e, flush=True)
    sys.stdin.readline()
""").format(cfg=CFG.to_dict())


def alive(pid):
    """Whether process pid runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def until(condition, within):
    """Whether condition() holds, polled for up to `within` seconds."""
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def ended(pids, within=20):
    return until(lambda: not any(map(alive, pids)), within)


def reads_stdin(pid):
    """Whether process pid waits in a read of its stdin (x86-64's system call 0 on fd 0)."""
    with open(f"/proc/{pid}/syscall") as f:
        return f.read().split()[:2] == ["0", "0x0"]


def decoder_process():
    """SCRIPT's process, in a process group of its own (as a terminal's foreground job)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 1 and alive(pids[0])
    return proc, pids


def test_a_killed_decoder_takes_its_lanes_along():
    proc, pids = decoder_process()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ended(pids)


def test_a_dead_lane_is_an_error_not_a_hang():
    proc, pids = decoder_process()
    os.kill(pids[0], signal.SIGKILL)
    out, _ = proc.communicate("\n\n", timeout=60)
    assert out.startswith(f"error: decode lane {pids[0]} exited with code -9"), out


def test_ctrl_c_reaches_the_decoder_not_its_lanes():
    """The terminal sends SIGINT to the whole foreground process group: the decoder's process ends its
    partners; they print no traceback of their own."""
    proc, pids = decoder_process()
    assert until(lambda: all(map(reads_stdin, [proc.pid, *pids])), 60)   # the decoder waits, its partner sleeps
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert ended(pids)


def test_close_ends_the_lanes_and_leaves_the_blas_threads(monkeypatch):
    monkeypatch.setattr(lanes, "LATE", 10**9)           # 3 lanes on 2 cores must not go alone here
    threads = blas.get_num_threads()
    dec = Decoder(CFG, PARAMS, lanes=3)
    dec.forward(np.array([1, 5, 7]))
    dec.forward(np.array([9]))
    pids = [p.pid for p in dec.lanes.procs]
    assert len(pids) == 2 and all(map(alive, pids))
    assert blas.get_num_threads() == 1                  # token steps: one thread here, the lanes have the cores
    sgemm, seen = blas.sgemm, set()
    monkeypatch.setattr(blas, "sgemm", lambda *a, **kw: (seen.add(blas.get_num_threads()), sgemm(*a, **kw))[1])
    dec.forward(np.array([2, 3]))
    assert seen == {threads}                            # a prompt's sgemm: all of them
    dec.forward(np.array([4]))
    dec.close()
    assert ended(pids, within=0) and blas.get_num_threads() == threads


def test_late_lanes_hand_the_products_back(monkeypatch):
    """Every product counts late: after LATE of them this process computes alone, with the same logits."""
    one = Decoder(CFG, PARAMS)
    expected = [one.forward(np.array([t])).copy() for t in (1, 5, 7, 9)]
    monkeypatch.setattr(lanes, "LATE_S", -1.0)
    dec = Decoder(CFG, PARAMS, lanes=2)
    got = [dec.forward(np.array([t])).copy() for t in (1, 5, 7, 9)]
    assert dec.lanes.alone_until > time.monotonic()
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-6, atol=1e-6)
    dec.close()


def test_one_lane_where_lanes_cannot_work(monkeypatch):
    monkeypatch.setattr(lanes.platform, "machine", lambda: "arm64")
    assert lanes.lanes_for(4) == 1
    with pytest.raises(AnectypesError, match="needs Linux on x86-64"):
        Decoder(CFG, PARAMS, lanes=2)
    monkeypatch.undo()
    monkeypatch.setattr(lanes.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert lanes.lanes_for(4) == 4 and lanes.lanes_for(64) == lanes.MAX_LANES
    monkeypatch.setattr(lanes.os, "sched_getaffinity", lambda pid: {0, 1})   # a lane beyond the cores only waits
    assert lanes.lanes_for(4) == 2 and lanes.lanes_for(1) == 1


def mapping_of(pid, address):
    """The /proc/PID/smaps block of the mapping that holds `address`: its header line and its fields."""
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().split("\n")
    # a mapping's header starts with its address range "lo-hi"; its fields ("Name: value") follow
    heads = [i for i, line in enumerate(lines) if line.split() and "-" in line.split()[0] and ":" not in line.split()[0]]
    for i, j in zip(heads, heads[1:] + [len(lines)]):
        lo, hi = (int(x, 16) for x in lines[i].split()[0].split("-"))
        if lo <= address < hi:
            return lines[i], dict(f.split(":", 1) for f in lines[i + 1:j] if ":" in f)
    raise AssertionError(f"no mapping of {address:#x} in {pid}")


def fd_targets(pid):
    """What the open file descriptors of process pid point at."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:                     # closed meanwhile (listdir's own)
            pass


def test_each_lane_reads_rows_of_its_own_and_the_hand_over_is_freed():
    """The partners copy their rows out of the hand-over memfd into private memory; once they are
    ready nobody holds that memfd (its memory is freed). The decoder's matrices are private too."""
    dec = Decoder(CFG, PARAMS, lanes=3)
    pids = [os.getpid()] + [p.pid for p in dec.lanes.procs]
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "anectypes-lanes-rows" not in f.read(), pid
        assert not any("anectypes-lanes-rows" in target for target in fd_targets(pid)), pid
    header, _ = mapping_of(os.getpid(), dec.cls_t.ctypes.data)
    assert "memfd" not in header and header.split()[1].endswith("p"), header    # private, not shared
    np.testing.assert_allclose(dec.forward(np.array([3])), Decoder(CFG, PARAMS).forward(np.array([3])), rtol=1e-6, atol=1e-6)
    dec.close()


def test_the_matrices_are_in_memory_advised_to_huge_pages():
    """Their mapping carries madvise(MADV_HUGEPAGE)'s flag (smaps' VmFlags "hg"), which the kernel
    honours where transparent huge pages are not off."""
    w = lanes.private_copies([np.ones((512, 1024), np.float32)])[0]
    _, fields = mapping_of(os.getpid(), w.ctypes.data)
    assert "hg" in fields["VmFlags"].split()
