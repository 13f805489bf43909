"""Training-step throughput on the simulator: a thin wrapper of `python -m anectypes.bench train`.

    python tools/bench_train.py --model stories15m [--precision fp16|fp32|both] [--steps 10]
                                [--warmup 2] [--seq N] [--vocab N] [--active N] [--compare torch] [--json]

Same flags and figures as `python -m anectypes.bench train --backend sim` (pass --backend to change
it): per precision, in a fresh process, the median forward+backward micro-step time and its
breakdown, GFLOP/s, the optimizer update, MFU against the sgemm peak, peak RSS. `--json` keeps this
tool's historical format: one JSON line per precision (the bench's own --json is one object).

These are simulator figures (numpy + the CPU BLAS), not ANE figures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from anectypes import bench  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    return bench.main(["train", "--backend", "sim", *argv], json_lines=True)


if __name__ == "__main__":
    sys.exit(main())
