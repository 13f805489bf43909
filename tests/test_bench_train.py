"""`python -m anectypes.bench train --json` end to end on the tiny preset: output format and internal
consistency, never speed."""

import json
import subprocess
import sys
from dataclasses import replace
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
    assert report["model"] == "tiny" and report["note"] == "simulator figures" and report["loss_scale"] == 256
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


def test_the_lora_case_counts_and_stages_the_adapters_alone_beside_peft():
    """--lora RANK with train's --lora-alpha and --lora-targets: the same micro-step with the model frozen and
    adapters on those projections, beside transformers + peft on the same model; its FLOPs, update bytes and the
    ANE's staging are LoRA's, peft trains as many parameters as our adapters hold, its report validates."""
    from jsonschema import validate
    from anectypes.model.lora import Lora, adapter_shapes
    proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", "tiny", "--backend", "sim",
                           "--steps", "2", "--warmup", "1", "--precision", "fp32", "--lora", "4", "--lora-alpha", "6",
                           "--lora-targets", "down,q,v", "--compare", "torch", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    validate(doc, json.loads((ROOT / "tools" / "bench_schema.json").read_text()))
    report, cfg = doc["benchmarks"]["train"], PRESETS["tiny"]
    lora = Lora(4, 6.0, ("wq", "wv", "w2"))
    assert (report["lora"], report["lora_alpha"], report["lora_targets"]) == (4, 6.0, "q,v,down")
    assert report["flops_total"] == step_flops(cfg, report["n_active"], lora)["total"] < \
        step_flops(cfg, report["n_active"])["total"]
    adapters = sum(a * b for a, b in adapter_shapes(cfg, lora).values())
    fp32 = report["precisions"]["fp32"]
    assert fp32["update_bytes"] == 36 * adapters + 4 * adapters       # AdamW's pass, then staging each adapter
    # the ANE's per-step work: 10 kernels a layer; the weights, norms and adapters in fp16, each once (in the
    # forward kernel that holds it, where the backward kernels read it)
    d, h, L = cfg.dim, cfg.hidden, cfg.layers
    weights = L * (4 * d * d + 3 * d * h)
    assert report["ane"]["evals_per_step"] == 10 * L and report["ane"]["kernels"] == 10
    assert report["ane"]["bytes_staged_once"] == 2 * (weights + 2 * L * d + adapters)
    assert report["ane"]["bytes_staged_per_update"] == 2 * adapters
    assert report["ane"]["flops_kernels"] + report["ane"]["flops_cpu"] == report["flops_total"]
    torch = report["compare"]["torch"]
    assert torch["available"] and torch["ms_fwdbwd_median"] > 0
    assert "transformers" in torch["implementation"] and "LlamaForCausalLM + peft" in torch["implementation"]
    assert torch["trainable"] == adapters


def test_the_ane_figures_count_the_evaluations_a_step_makes():
    """ane_work's evaluations per micro-step are the device's evaluations in a real LoRA step of a QK-norm model."""
    from dataclasses import replace
    import numpy as np
    from anectypes.bench.train import ane_work, bench_lora
    from anectypes.device import open_device
    from anectypes.model.config import init_params
    from anectypes.model.lora import init_adapters
    from anectypes.model.transformer import Transformer
    cfg, rng = replace(PRESETS["tiny"], qk_norm=True), np.random.default_rng(0)
    lora, active = bench_lora(2, None, "q,k,v,o,gate,up,down"), np.arange(cfg.vocab)
    params = {**init_params(cfg, rng), **init_adapters(cfg, lora, rng)}
    dev = open_device("sim", precision="fp32")
    evals, eval_ = [], dev.eval
    dev.eval = lambda request: (evals.append(request), eval_(request))
    with Transformer(cfg, dev, params, active, lora=lora) as model:
        model.forward_backward(rng.choice(active, cfg.seq), rng.choice(active, cfg.seq))
        model.wait()
        assert len(evals) == ane_work(model, step_flops(cfg, len(active), lora))["evals_per_step"] == 20


def test_lora_flags_are_checked_before_any_work():
    """An unknown target, --lora-alpha without --lora, a non-positive alpha: one error line, exit 1."""
    for flags, says in ((["--lora", "4", "--lora-targets", "q,x"], "unknown target 'x'"),
                        (["--lora-alpha", "8"], "go with --lora RANK"),
                        (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha must be a positive")):
        proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", "tiny", *flags],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 1 and proc.stdout == ""
        line, = proc.stderr.splitlines()
        assert line.startswith("error: ") and says in line, line


def test_an_imported_architecture_is_compared_with_peft_on_transformers_qwen3(tmp_path):
    """A Qwen3-shaped config (QK-norm, head_dim ≠ dim/heads, no residual scale, untied) with LoRA: peft wraps
    transformers' Qwen3 model of the same fields, and trains as many parameters as our adapters hold."""
    from anectypes.model.config import load_config
    from anectypes.model.lora import Lora, adapter_shapes
    model = tmp_path / "qwen3.json"
    model.write_text(json.dumps(dict(dim=64, hidden=96, heads=4, kv_heads=2, head_dim=32, layers=2, seq=32,
                                     vocab=512, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                                     residual_scaled=False, tied=False)))
    proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", str(model), "--backend", "sim",
                           "--steps", "1", "--warmup", "0", "--precision", "fp32", "--lora", "2", "--compare", "torch",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["benchmarks"]["train"]
    torch = report["compare"]["torch"]
    assert torch["available"] and "Qwen3ForCausalLM + peft" in torch["implementation"]
    adapters = adapter_shapes(load_config(str(model)), Lora(2, 4.0, ("wq", "wk", "wv", "wo")))
    assert torch["trainable"] == sum(a * b for a, b in adapters.values())
    assert report["ane"]["evals_per_step"] == 20


def test_a_hugging_face_folder_is_timed_by_its_config_beside_peft(tmp_path):
    """--model DIR: a Hugging Face folder's config.json as train --init-from reads it (an untied Llama 3: llama3
    RoPE, no residual scale), --seq over its context, random weights; peft wraps transformers' Llama of the same
    fields. A folder holding what anectypes does not compute is one error line before any work."""
    from support.hf_folders import arch_hf_folder
    from anectypes.formats import hf
    from anectypes.model.lora import Lora, adapter_shapes
    arch_hf_folder(tmp_path / "llama3", "llama3", tied=False)
    cfg = replace(hf.read_config(tmp_path / "llama3"), seq=16)
    proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", str(tmp_path / "llama3"),
                           "--backend", "sim", "--steps", "1", "--warmup", "0", "--precision", "fp32", "--seq", "16",
                           "--lora", "2", "--compare", "torch", "--json"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["benchmarks"]["train"]
    assert (report["seq"], report["vocab"], report["params"]) == (16, cfg.vocab, cfg.n_params())
    assert report["loss_scale"] == 8192                     # the trainer's for a model without residual scaling
    assert report["flops_total"] == step_flops(cfg, cfg.vocab, Lora(2, 4.0, ("wq", "wk", "wv", "wo")))["total"]
    torch = report["compare"]["torch"]
    assert torch["available"] and "LlamaForCausalLM + peft" in torch["implementation"]
    assert torch["trainable"] == sum(a * b for a, b in adapter_shapes(cfg, Lora(2, 4.0, ("wq", "wk", "wv", "wo"))).values())
    conf = json.loads((tmp_path / "llama3" / "config.json").read_text())
    (tmp_path / "llama3" / "config.json").write_text(json.dumps(dict(conf, attention_bias=True)))
    proc = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", str(tmp_path / "llama3")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    line, = proc.stderr.splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and line.startswith("error: ") and "attention_bias" in line, line
