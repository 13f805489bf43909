"""The trainer, pausing just before it takes over its run folder (a test helper): it has claimed the
folder, read the run and compiled its kernels, and written nothing yet. It says "paused" on stdout and
goes on when a line arrives on stdin.

    python tests/support/pause_at_take_over.py TRAIN_ARGS...
"""

import sys

from anectypes.train import main
from anectypes.train.report import RunWriter

take_over = RunWriter.take_over


def paused(self):
    print("paused", flush=True)
    sys.stdin.readline()
    return take_over(self)


RunWriter.take_over = paused
sys.exit(main(sys.argv[1:]))
