"""What the training tests share: the flags of a fast tiny run, and the losses of a run folder."""

import json
from pathlib import Path

FAST = ["--model", "tiny", "--backend", "sim", "--sample-every", "0", "--log-every", "1000"]


def losses(run_dir):
    """The training losses, checking that the rows are steps 1..n, each once."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    return [r["loss"] for r in train]
