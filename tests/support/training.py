"""What the training tests share: the flags of a fast tiny run, the losses of a run folder, a one-line error."""

import json
from pathlib import Path

FAST = ["--model", "tiny", "--backend", "sim", "--sample-every", "0", "--log-every", "1000"]


def losses(run_dir):
    """The training losses, checking that the rows are steps 1..n, each once."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    return [r["loss"] for r in train]


def one_line_error(r, *words):
    """A finished command (subprocess.run's result) that failed with exactly one `error:` line on stderr, no
    traceback, the line holding each of `words`."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
