"""tools/bench_train.py end to end on the tiny preset: output format and internal consistency, never speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anectypes.model.config import PRESETS
from anectypes.model.flops import step_flops

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"model", "precision", "ms_fwdbwd_median", "gflops", "breakdown_ms", "sgemm_peak_gflops", "mfu",
        "rss_mb", "backend", "note", "flops_total"}


@pytest.fixture(scope="module")
def lines():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_train.py"), "--model", "tiny",
                           "--steps", "2", "--warmup", "1", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_one_json_line_per_precision(lines):
    assert [r["precision"] for r in lines] == ["fp16", "fp32"]
    for r in lines:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["model"] == "tiny" and r["backend"] == "sim" and r["note"] == "simulator figures"
        assert set(r["breakdown_ms"]) == {"eval", "io", "cls", "dw_wait", "cpu"}


def test_figures_are_consistent(lines):
    for r in lines:
        ms, parts = r["ms_fwdbwd_median"], r["breakdown_ms"]
        assert ms > 0 and all(v >= 0 for v in parts.values())
        assert all(v <= ms * (1 + 1e-9) for v in parts.values())   # each part of a step lies inside it
        assert r["flops_total"] == step_flops(PRESETS["tiny"], r["n_active"])["total"]
        assert r["gflops"] == pytest.approx(r["flops_total"] / ms / 1e6, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["gflops"] / r["sgemm_peak_gflops"], rel=1e-12)
        assert r["rss_mb"] > 0
