"""LoRA (docs/lora.md): adapters on a frozen model, against PyTorch + peft on the same Hugging Face folder."""

import contextlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from support.hf_folders import arch_hf_folder, lora_llama_folder
from support.training import losses
from anectypes.device import open_device
from anectypes.errors import AnectypesError
from anectypes.formats import hf
from anectypes.formats.checkpoint import load_checkpoint
from anectypes.model import config
from anectypes.model.config import ModelConfig
from anectypes.model.lora import TARGETS, Lora, init_adapters
from anectypes.model.transformer import Transformer
from anectypes.train import main

ROOT = Path(__file__).resolve().parent.parent
SIM = ["--backend", "sim", "--sample-every", "0", "--log-every", "1000"]
pytestmark = pytest.mark.usefixtures("builtin_cache")    # one corpus cache for every run here (subprocesses too)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Llama every training test here starts from (its vocabulary is the built-in corpus')."""
    return lora_llama_folder(tmp_path_factory.mktemp("hf") / "lora_llama")

HF_NAMES = dict(wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj", wo="self_attn.o_proj",
                w1="mlp.gate_proj", w3="mlp.up_proj", w2="mlp.down_proj")


def peft_model(folder, lora):
    """transformers' model of the folder in float64 with peft's LoRA on lora's targets."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    targets = [HF_NAMES[w].split(".")[1] for w in lora.targets]
    return get_peft_model(base, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=0.0))


def to_hf(name, value, cfg, part):
    """One adapter matrix in Hugging Face's convention: q's and k's B rows rotate-half permuted, o's and down's B
    with α folded in (ours applies it to the residual branch)."""
    weight = name.split(".")[2]
    if part == "lora_b" and weight in ("wq", "wk"):
        value = hf.rows(value, cfg.heads if weight == "wq" else cfg.kv_heads, to_hf=True)
    if part == "lora_b" and weight in ("wo", "w2"):
        value = value * cfg.alpha
    return value


# a plain Llama; a Qwen3 (QK-norm, head_dim 16 ≠ 32/4); a Llama 3 (llama3 RoPE) with its own classifier
BASES = {"llama": lora_llama_folder, "qwen3": lambda f: arch_hf_folder(f, "qwen3", tied=True) and f,
         "llama3-untied": lambda f: arch_hf_folder(f, "llama3", tied=False) and f}


@pytest.mark.parametrize("arch", BASES)
def test_one_lora_steps_adapter_gradients_equal_peft_autograd_in_float64(tmp_path, arch):
    folder = BASES[arch](tmp_path / arch)
    base = hf.read(folder)
    cfg = replace(base.cfg, seq=16)
    lora = Lora(rank=4, alpha=16.0, targets=tuple(TARGETS.values()))
    rng = np.random.default_rng(1)
    adapters = init_adapters(cfg, lora, rng)
    for name in adapters:            # B is zero at init, where A's gradient is zero too: make both count
        if name.endswith("lora_b"):
            adapters[name] = rng.uniform(-0.3, 0.3, adapters[name].shape).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab, cfg.seq + 1)
    model = Transformer(cfg, open_device("sim", precision="fp32"), {**base.params, **adapters}, np.arange(cfg.vocab),
                        lora=lora)
    loss = model.forward_backward(tokens[:-1], tokens[1:], loss_scale=1.0)
    grads = model.complete_grads()
    assert set(grads) == set(adapters)                       # nothing else has a gradient

    torch_model = peft_model(folder, lora)
    modules = dict(torch_model.named_modules())
    for name, value in adapters.items():
        _, i, weight, part = name.split(".")
        layer = modules[f"base_model.model.model.layers.{i}.{HF_NAMES[weight]}"]
        matrix = getattr(layer, part.replace("lora_a", "lora_A").replace("lora_b", "lora_B"))["default"].weight
        with torch.no_grad():
            matrix.copy_(torch.from_numpy(to_hf(name, value, cfg, part).astype(np.float64)))
    logits = torch_model(torch.from_numpy(tokens[None, :-1])).logits[0]
    want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(tokens[1:]))
    want.backward()
    assert abs(loss - want.item()) < 1e-5 * want.item()
    for name, got in grads.items():
        _, i, weight, part = name.split(".")
        layer = modules[f"base_model.model.model.layers.{i}.{HF_NAMES[weight]}"]
        matrix = getattr(layer, part.replace("lora_a", "lora_A").replace("lora_b", "lora_B"))["default"].weight
        # the gradient of B_hf = α·B (o, down) is ours / α; of a permutation of rows, ours permuted
        theirs = matrix.grad.numpy()
        ours = to_hf(name, got.astype(np.float64), cfg, part)
        if part == "lora_b" and weight in ("wo", "w2"):
            ours = ours / cfg.alpha ** 2
        err = np.abs(ours - theirs).max() / np.abs(theirs).max()
        assert err < 1e-4, (name, err)


def test_adapters_start_as_peft_starts_them():
    """A kaiming-uniform with a = √5 as peft draws it (bound 1/√in), B zero: compared with peft's own layers."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=False))
    theirs = get_peft_model(base, LoraConfig(r=8, target_modules=["0"])).base_model.model[0]
    cfg = ModelConfig(dim=96, hidden=40, heads=4, kv_heads=4, head_dim=24, layers=1)
    ours = init_adapters(cfg, Lora(8, 8.0, ("w1",)), np.random.default_rng(0))
    a, b = ours["layers.0.w1.lora_a"], ours["layers.0.w1.lora_b"]
    their_a, their_b = theirs.lora_A["default"].weight.detach().numpy(), theirs.lora_B["default"].weight.detach().numpy()
    assert a.shape == their_a.shape and b.shape == their_b.shape and not b.any() and not their_b.any()
    bound = 1 / np.sqrt(96)
    for x in (a, their_a):
        assert 0.95 * bound < np.abs(x).max() <= bound and abs(x.mean()) < 0.1 * bound


def test_lora_fine_tuning_lowers_the_validation_loss_and_leaves_the_model_as_it_was(tmp_path, folder):
    """The validation loss after the first update (B was zero before it: about the model's own) and at the end."""
    run = tmp_path / "run"
    assert main(["--init-from", str(folder), "--lora", "8", "--lora-targets", "q,v,down", "--run-dir", str(run),
                 "--steps", "100", "--accum", "1", "--lr", "0.03", "--warmup", "5", "--save-every", "1",
                 "--stop-after", "1", *SIM]) == 0
    assert main(["--resume", "--run-dir", str(run), "--save-every", "50"]) == 0
    val = {r["step"]: r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r}
    assert list(val) == [1, 50, 100] and val[100] < val[1] - 0.2, val
    ckpt, base = load_checkpoint(run / "checkpoints" / "latest.ckpt"), hf.read(folder)
    assert ckpt.lora == Lora(8, 8.0, ("wq", "wv", "w2"))
    assert set(ckpt.optimizer["m"]) == {f"layers.{i}.{w}.{p}" for i in range(2) for w in ("wq", "wv", "w2")
                                        for p in ("lora_a", "lora_b")}
    for name, w in base.params.items():                      # the frozen model, bit for bit
        assert np.array_equal(ckpt.params[name], w), name
    assert all(ckpt.params[f"layers.{i}.w2.lora_b"].any() for i in range(2))
    doc = json.loads((run / "config.json").read_text())
    assert doc["trainable"] == 2 * 8 * ((32 + 32) + (32 + 16) + (48 + 32)) < doc["params"]


def test_a_lora_run_resumes_and_restarts_bit_identically(tmp_path, folder):
    """In fp32 mode, where the frozen weights live in the kernels' surfaces alone (stage_weights): what a
    checkpoint saves of them, and every loss, are as if the run had not been cut."""
    common = ["--init-from", str(folder), "--lora", "4", "--lora-targets", "q,k,v,o,gate,up,down", "--steps", "8",
              "--accum", "2", "--save-every", "1", "--lr", "0.01", "--precision", "fp32", *SIM]
    assert main(["--run-dir", str(tmp_path / "a"), *common]) == 0
    assert main(["--run-dir", str(tmp_path / "b"), "--stop-after", "4", *common]) == 0
    assert len(losses(tmp_path / "b")) == 4
    assert main(["--resume", "--run-dir", str(tmp_path / "b")]) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    # 10 kernels compile at start; with a budget of 19 the next rebuild would not fit: exec + resume
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--run-dir", str(tmp_path / "c"), "--compile-budget",
                        "19", *common], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "restarting the process with --resume" in r.stderr
    assert losses(tmp_path / "c") == losses(tmp_path / "a")
    a, c = (load_checkpoint(tmp_path / x / "checkpoints" / "latest.ckpt") for x in "ac")
    assert all(np.array_equal(a.params[k], c.params[k]) for k in a.params)
    assert all(np.array_equal(c.params[k], w) for k, w in hf.read(folder).params.items())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_frozen_weights_are_held_once_where_the_surfaces_store_them_exactly(folder, precision):
    """fp32 mode: each frozen matrix becomes a view of the surface it was staged into, replacing the caller's array
    (so that its memory goes), with the same values; in fp16 mode (the surfaces round what they store), and in full
    training, the model keeps its float32 weights."""
    base = hf.read(folder)
    lora = Lora(4, 8.0, ("wq", "w2"))
    frozen = {k for k, w in base.params.items() if k.startswith("layers.") and w.ndim == 2}
    for adapt in (lora, None):
        params = {k: v.copy() for k, v in {**base.params, **(init_adapters(base.cfg, lora, np.random.default_rng(3))
                                                              if adapt else {})}.items()}
        with Transformer(base.cfg, open_device("sim", precision=precision), params, np.arange(base.cfg.vocab),
                         lora=adapt) as model:
            assert model.params is params
            assert model.in_surfaces == (frozen if adapt and precision == "fp32" else set())
            surfaces = [s.array for s in model.surfaces()]
            for k, w in base.params.items():
                assert np.array_equal(params[k], w), k
                assert any(np.shares_memory(params[k], a) for a in surfaces) == (k in model.in_surfaces), k


@pytest.mark.parametrize("flags, error", [
    (["--lora", "0"], "error: argument --lora: must be >= 1"),
    (["--lora", "-3"], "error: argument --lora: must be >= 1"),
    (["--lora", "17"], "error: --lora 17: the rank must be at most 16, the smaller side of the model's wk [16, 32]"),
    (["--lora", "4", "--lora-targets", "q,x"], "error: --lora-targets: unknown target 'x'"),
    (["--lora-alpha", "16"], "error: --lora-alpha and --lora-targets go with --lora RANK"),
    (["--lora-targets", "q"], "error: --lora-alpha and --lora-targets go with --lora RANK"),
    (["--lora", "4", "--scratch"], "error: --lora adapts a trained model"),
])
def test_bad_lora_settings_are_one_error_line_and_change_nothing(tmp_path, capsys, folder, flags, error):
    start = [] if "--scratch" in flags else ["--init-from", str(folder)]
    with pytest.raises(SystemExit) if "argument" in error else contextlib.nullcontext():    # argparse's exit
        assert main([*start, *flags, "--run-dir", str(tmp_path / "run"), "--steps", "2", *SIM]) != 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), lines
    assert not (tmp_path / "run").exists()


def test_the_memory_check_counts_what_lora_holds(monkeypatch):
    """A Qwen3-0.6B-shaped model on a 16 GiB Mac: full training does not fit at seq 1024, LoRA rank 16 on the
    attention's projections does."""
    qwen = ModelConfig(dim=1024, hidden=3072, heads=16, kv_heads=8, head_dim=128, layers=28, seq=1024, vocab=151936)
    monkeypatch.setattr(config, "physical_memory", lambda: 16 * 2**30)
    lora = Lora(16, 32.0, ("wq", "wk", "wv", "wo"))
    with pytest.raises(AnectypesError, match="training it needs about 19.1 GiB"):
        qwen.check_fits("qwen3")
    assert qwen.check_fits("qwen3", lora) is qwen
    assert 12 * 2**30 < qwen.training_bytes(lora) < 13 * 2**30


GROWTH = """
import numpy as np
from anectypes.device import open_device
from anectypes.model.config import ModelConfig, init_params
from anectypes.model.lora import Lora, init_adapters
from anectypes.model.transformer import Transformer

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

cfg = ModelConfig(dim=512, hidden=1536, heads=8, kv_heads=4, head_dim=64, layers=4, seq=32, vocab=256).validate()
lora = Lora(4, 8.0, ("wq",))
rng = np.random.default_rng(0)
params = {**init_params(cfg, rng), **init_adapters(cfg, lora, rng)}
before = rss()
model = Transformer(cfg, open_device("sim", precision="fp32"), params, np.arange(cfg.vocab), lora=lora)
print(sum(w.nbytes for w in params.values() if w.base is not None), rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads its memory from Linux's /proc")
def test_building_a_lora_model_in_fp32_costs_about_no_memory_beyond_its_weights():
    """The surfaces take the frozen weights (48 MiB here), whose own arrays are then freed and handed back to the
    system (glibc keeps them resident until malloc_trim): the process grows by a small part of them (2 MiB measured;
    48 without the trim). In a fresh process, whose heap is the test's alone."""
    r = subprocess.run([sys.executable, "-c", GROWTH], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    frozen, growth = map(int, r.stdout.split())
    assert frozen == 4 * (2 * 512 * (512 + 256) + 3 * 512 * 1536) * 4 and growth < frozen / 4


@pytest.mark.parametrize("lora, precision", [(None, "fp32"), (Lora(8, 16.0, ("wq", "wk", "wv", "wo")), "fp16"),
                                             (Lora(8, 16.0, ("wq", "wk", "wv", "wo")), "fp32")],
                         ids=["full", "lora", "lora-fp32"])
def test_the_memory_check_is_what_training_holds_and_a_little_more(lora, precision):
    """The estimate against the arrays a model in training holds once it has run a micro-step (bench train's
    count: weights, gradients, moments, saved activations, the surfaces, the logits): never below, at most a
    quarter above; with LoRA it counts the frozen weights in float32 and in the surfaces, as the ANE holds them (the
    simulator's fp32 mode holds them once: less)."""
    from anectypes.bench.train import footprint_mb
    from anectypes.train.optim import AdamW
    cfg = ModelConfig(dim=128, hidden=384, heads=4, kv_heads=2, head_dim=64, layers=3, seq=64, vocab=2000, qk_norm=True)
    rng = np.random.default_rng(0)
    params = {**config.init_params(cfg, rng), **(init_adapters(cfg, lora, rng) if lora else {})}
    model = Transformer(cfg, open_device("sim", precision=precision), params, np.arange(cfg.vocab), lora=lora)
    try:
        model.forward_backward(rng.integers(0, cfg.vocab, cfg.seq), rng.integers(0, cfg.vocab, cfg.seq), 1.0)
        held = footprint_mb(model, AdamW(model.trainable)) * 2**20
    finally:
        model.close()
    assert held <= cfg.training_bytes(lora) <= (1.25 if precision == "fp16" or not lora else 2) * held


def test_exports_of_a_lora_run_load_in_peft_and_transformers_with_our_logits(tmp_path, folder):
    """--format peft onto the folder the run started from (PeftModel.from_pretrained), and --format hf, the merged
    model: both give the logits our kernels compute with the adapters beside the frozen weights (fp32)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    from anectypes import export
    run = tmp_path / "run"
    assert main(["--init-from", str(folder), "--lora", "4", "--lora-targets", "q,k,v,o,gate,up,down", "--run-dir",
                 str(run), "--steps", "12", "--accum", "1", "--lr", "0.05", "--warmup", "1", *SIM]) == 0
    assert export.main([str(run), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    assert export.main([str(run), "--format", "hf", "--out", str(tmp_path / "merged")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    ckpt = load_checkpoint(run / "checkpoints" / "best.ckpt")
    cfg = ModelConfig(**ckpt.config)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab, cfg.seq)
    with Transformer(cfg, open_device("sim", precision="fp32"), ckpt.params, np.arange(cfg.vocab),
                     lora=ckpt.lora) as model:
        ours = model.logits(tokens).T                                          # [S, vocab]

    def logits(model):
        with torch.no_grad():
            return model(torch.from_numpy(tokens[None])).logits[0].numpy()
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64)
    before = logits(base)
    adapted = logits(PeftModel.from_pretrained(base, tmp_path / "adapter"))
    whole = logits(LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64))
    scale = np.abs(adapted).max()
    assert np.abs(adapted - before).max() > 1e-2 * scale                      # the adapters change the logits
    for theirs in (adapted, whole):
        assert np.abs(ours - theirs).max() < 1e-4 * scale


def test_the_chip_catalogue_checks_the_kernels_with_their_adapters():
    """An adapter's segments widen its weight's inputs (rank columns for each chunk of as many rows as the input
    has channels): a model whose inputs fit M3's 16,384-wide spatial cap without LoRA is refused there with it
    (sdpaFwd's input, 13,856 wide in 32-wide slots, holds wq, wk, wv and their adapters, 3 × (32 + 16 × 4,608 / 64)
    columns more; qBwd and kvBwd read it)."""
    from anectypes.model.chips import by_rule, kernel_findings
    cfg = ModelConfig(dim=64, hidden=128, heads=36, kv_heads=36, head_dim=128, layers=1, seq=16, vocab=64)
    lora = Lora(16, 32.0, ("wq", "wk", "wv"))
    assert "extent" not in by_rule(kernel_findings(cfg, "m3"), "error")
    names, _ = by_rule(kernel_findings(cfg, "m3", lora), "error")["extent"]
    assert names == ["sdpaFwd", "qBwd", "kvBwd"]
    assert "extent" not in by_rule(kernel_findings(cfg, "m4", lora), "error")


def test_an_update_of_a_lora_run_stages_only_the_adapters(tmp_path, folder):
    """The frozen weights are staged once, when the kernels are built; an update re-stages the adapters alone."""
    from anectypes.train.optim import AdamW, update_model
    base = hf.read(folder)
    lora = Lora(4, 8.0, ("wq", "wo", "w2"))
    params = {**base.params, **init_adapters(base.cfg, lora, np.random.default_rng(0))}
    with Transformer(base.cfg, open_device("sim", precision="fp32"), params, np.arange(base.cfg.vocab),
                     lora=lora) as model:
        staged = []
        stage = model.stage
        model.stage = lambda name: (staged.append(name), stage(name))
        tokens = np.random.default_rng(1).integers(0, base.cfg.vocab, base.cfg.seq + 1)
        model.forward_backward(tokens[:-1], tokens[1:])
        assert update_model(model, AdamW(model.trainable), 1e-2, 1.0, 1.0) is not None
    assert sorted(staged) == sorted(init_adapters(base.cfg, lora, np.random.default_rng(0)))


def test_the_adapter_gradients_on_the_ane_s_worker_thread_are_the_same_bits(folder):
    """With the ANE the CPU's gradient work runs on a worker thread while the kernels run (on copies of what the
    kernels wrote); the simulator's, inline: the same adapter gradients either way."""
    base = hf.read(folder)
    lora = Lora(4, 8.0, tuple(TARGETS.values()))
    rng = np.random.default_rng(2)
    adapters = {k: v + rng.uniform(-0.1, 0.1, v.shape).astype(np.float32)
                for k, v in init_adapters(base.cfg, lora, rng).items()}
    tokens = rng.integers(0, base.cfg.vocab, base.cfg.seq + 1)
    grads = []
    for shares_cpu in (True, False):
        device = open_device("sim", precision="fp32")
        device.shares_cpu = shares_cpu
        with Transformer(base.cfg, device, {**base.params, **adapters}, np.arange(base.cfg.vocab), lora=lora) as model:
            assert (model.dw is None) == shares_cpu
            model.forward_backward(tokens[:-1], tokens[1:])
            grads.append({k: v.copy() for k, v in model.complete_grads().items()})
    assert all(np.array_equal(grads[0][k], grads[1][k]) for k in adapters)


def test_the_run_spec_holds_the_lora_settings_for_every_entry_point():
    """The dashboard's API builds a RunSpec too: the same checks (a RunError, its 4xx), and the defaults filled in."""
    from anectypes.runs import RunError, RunSpec
    spec = RunSpec.from_dict({"lora": 16, "init_from": "base", "lora_targets": "v, q,down"}).resolved()
    assert (spec.lora, spec.lora_alpha, spec.lora_targets) == (16, 8.0, "q,v,down")
    assert RunSpec(init_from="base").resolved().lora_alpha is None
    for doc, error in (({"lora": 16}, "--lora adapts a trained model"),
                       ({"lora_alpha": 4.0, "init_from": "base"}, "--lora-alpha and --lora-targets go with --lora"),
                       ({"lora": 4, "init_from": "base", "lora_targets": "q,attn"}, "unknown target 'attn'"),
                       ({"lora": 0, "init_from": "base"}, "lora must be >= 1")):
        with pytest.raises(RunError, match=error):
            RunSpec.from_dict(doc)
