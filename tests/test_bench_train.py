"""`python -m anectypes.bench train --json` end to end on the tiny preset: output format and internal
consistency, never speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anectypes.model.config import PRESETS
from anectypes.model.flops import step_flops

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"precision", "ms_fwdbwd_median", "gflops", "breakdown_ms", "mfu", "rss_mb", "backend", "note"}


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", "tiny", "--backend", "sim",
                           "--steps", "2", "--warmup", "1", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    line, = proc.stdout.splitlines()
    return json.loads(line)["benchmarks"]["train"]


def test_one_entry_per_precision(report):
    assert report["model"] == "tiny" and report["note"] == "simulator figures"
    assert list(report["precisions"]) == ["fp16", "fp32"]
    for precision, r in report["precisions"].items():
        assert KEYS <= set(r), KEYS - set(r)
        assert r["precision"] == precision and r["backend"] == "sim" and r["note"] == "simulator figures"
        assert set(r["breakdown_ms"]) == {"eval", "io", "cls", "dw_wait", "cpu"}


def test_figures_are_consistent(report):
    assert report["flops_total"] == step_flops(PRESETS["tiny"], report["n_active"])["total"]
    for r in report["precisions"].values():
        ms, parts = r["ms_fwdbwd_median"], r["breakdown_ms"]
        assert ms > 0 and all(v >= 0 for v in parts.values())
        assert all(v <= ms * (1 + 1e-9) for v in parts.values())   # each part of a step lies inside it
        assert r["gflops"] == pytest.approx(report["flops_total"] / ms / 1e6, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["gflops"] / report["sgemm_peak_gflops"], rel=1e-12)
        assert r["rss_mb"] > 0
        assert r["ms_amortized"] == pytest.approx(ms + r["ms_update_median"] / report["accum"], rel=1e-12)
        assert r["update_gbs"] == pytest.approx(r["update_bytes"] / r["ms_update_median"] / 1e6, rel=1e-12)
    assert report["simd"] in ("AVX-512", "AVX2", "AVX", "SSE", "NEON") and report["accum"] == 10


def test_the_lora_case_counts_and_stages_the_adapters_alone():
    """--lora RANK: the same micro-step with the model frozen and adapters on q,k,v,o, beside PyTorch's LoRA;
    its FLOPs and update bytes are LoRA's, its report validates."""
    from jsonschema import validate
    from anectypes.model.lora import Lora, adapter_shapes
    proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", "tiny", "--backend", "sim",
                           "--steps", "2", "--warmup", "1", "--precision", "fp32", "--lora", "4", "--compare", "torch",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    validate(doc, json.loads((ROOT / "tools" / "bench_schema.json").read_text()))
    report, cfg = doc["benchmarks"]["train"], PRESETS["tiny"]
    lora = Lora(4, 8.0, ("wq", "wk", "wv", "wo"))
    assert report["lora"] == 4
    assert report["flops_total"] == step_flops(cfg, report["n_active"], lora)["total"] < \
        step_flops(cfg, report["n_active"])["total"]
    adapters = sum(a * b for a, b in adapter_shapes(cfg, lora).values())
    fp32 = report["precisions"]["fp32"]
    assert fp32["update_bytes"] == 36 * adapters + 4 * 2 * adapters       # AdamW's pass, two staged places each
    assert report["compare"]["torch"]["available"] and report["compare"]["torch"]["ms_fwdbwd_median"] > 0
