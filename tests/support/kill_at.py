"""The trainer, SIGKILLed by itself halfway through the Nth atomic write of one file (a test helper).

    python tests/support/kill_at.py NAME N TRAIN_ARGS...     # e.g. latest.ckpt 2 --scratch --run-dir R ...

The temporary file beside NAME is then half written and never renamed, as after a crash.
"""

import os
import signal
import sys

import anectypes.formats.checkpoint
import anectypes.runs
from anectypes.host.files import atomic_write
from anectypes.train import main

name, nth, calls = sys.argv[1], int(sys.argv[2]), 0


def dying_write(path, write, sync=True, mkdir=True):
    global calls
    if os.path.basename(path) == name:
        calls += 1
        if calls == nth:
            def torn(f):
                write(f)
                f.flush()
                f.truncate(f.tell() // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            return atomic_write(path, torn, sync, mkdir)
    return atomic_write(path, write, sync, mkdir)


anectypes.formats.checkpoint.atomic_write = anectypes.runs.atomic_write = dying_write
sys.exit(main(sys.argv[3:]))
