"""One rank of an MPI training job SIGKILLs itself as it starts a micro-step (a test helper).

    mpirun -n 2 python tests/support/kill_rank_at.py RANK STEP TRAIN_ARGS...    # STEP: the micro-step's metrics step
"""

import os
import signal
import sys

from anectypes.train import main
from anectypes.train.trainer import Trainer

rank, step = int(sys.argv[1]), int(sys.argv[2])
micro_step = Trainer.micro_step


def dying(self, x, y, s):
    if self.world.rank == rank and s + 1 == step:
        os.kill(os.getpid(), signal.SIGKILL)
    return micro_step(self, x, y, s)


Trainer.micro_step = dying
sys.exit(main(sys.argv[3:]))
