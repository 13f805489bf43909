"""Training, `python -m anectypes.train`: the command (command.py: flags, main, the --ranks launch), resolving
a run (setup.py: folder, spec, checkpoint, data, model), the loop (trainer.py), what a run writes and prints
(report.py) and sends to W&B, TensorBoard or MLflow (report_to.py), the optimizer and its update (optim.py)
and data parallelism on MPI ranks (distributed.py)."""

from .command import main

__all__ = ["main"]
