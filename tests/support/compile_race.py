"""One of two processes compiling one program at once on the fake ANE, each with its own weights (a test helper).

    python tests/support/compile_race.py B MARKS            # started first: waits until A is inside its compile
    python tests/support/compile_race.py A MARKS B_PID      # pauses inside its compile until B has written its
                                                            # files, removed them, or waits for a lock

One MIL text and one weight name (w.bin), other data: one hexStringIdentifier, so one temporary folder (§1.5),
as for MPI ranks on one Mac. Each process evaluates its kernel, checks it against the simulator with its own
weights, frees it and prints the folder; a violation of the fake's contract (a compile that read files it did
not write, or none) fails it.
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.fake_ane import installed  # noqa: E402

from anectypes.device import open_device  # noqa: E402
from anectypes.device.ane import ANEDevice  # noqa: E402
from anectypes.mil import Builder  # noqa: E402

role, marks = sys.argv[1], Path(sys.argv[2])
deadline = time.monotonic() + 240          # only against a hang: every wait ends on an event


def wait(condition, what):
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role}: no {what}")
        time.sleep(0.01)


def waits_for_a_lock(pid):
    """Whether process pid is blocked on a file lock: its line "N: -> FLOCK ADVISORY WRITE PID ..." in /proc/locks."""
    return any(f[1:2] == ["->"] and f[5:6] == [str(pid)] for f in map(str.split, open("/proc/locks")))


def evaluate(dev, kernel, x):
    xs, ys = dev.surface(kernel.inputs["x"].shape), dev.surface(kernel.outputs["y"].shape)
    xs.write(x)
    dev.eval(dev.request(kernel, {"x": xs}, {"y": ys}))
    return ys.read()


b = Builder()
w = np.linspace(-2, 2, 32).reshape(1, 4, 1, 8) * (1 if role == "A" else 3)
b.output(b.mul(x=b.input("x", [1, 4, 1, 8]), y=b.weight(w, "w.bin"), name="y"))
text, weights = b.text(), b.weights()
x = np.arange(32, dtype=np.float16).reshape(1, 4, 1, 8) / 8

with installed() as fake:
    if role == "A":
        other, mine = int(sys.argv[3]), weights["@model_path/weights/w.bin"]

        def pause(folder):
            (marks / "A-compiling").touch()
            blob = folder / "weights" / "w.bin"
            wait(lambda: not blob.is_file() or blob.read_bytes() != mine or waits_for_a_lock(other),
                 "sign of B's compile")
        fake.before_compile = pause
    else:
        wait((marks / "A-compiling").exists, "compile of A")
    dev = ANEDevice()
    kernel = dev.compile(text, weights)
    got = evaluate(dev, kernel, x)
    sim = open_device("sim")
    want = evaluate(sim, sim.compile(text, weights), x)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (role, got, want)
    kernel.free()
    assert fake.violations == [], fake.violations
    print(kernel.folder)
