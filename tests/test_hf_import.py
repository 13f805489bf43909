"""Real checkpoints' architectures from Hugging Face folders (issue 35 §1-2): tiny random Qwen3 and Llama 3
models made and saved by transformers itself (tests/support/hf_folders.py) give, through our reader, the
logits transformers gives on the same folder, on the training forward (the simulator) and the decoder;
they fine-tune, and export back to a folder transformers reads with the same logits."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from anectypes import sources
from anectypes.data.corpus import builtin_dataset
from anectypes.data.tokenizer import Tokenizer
from anectypes.device import open_device
from anectypes.formats.export import export
from anectypes.generate.decoder import Decoder
from anectypes.model.transformer import Transformer
from support.hf_folders import SHAPE, arch_hf_folder
from support.training import losses

pytestmark = pytest.mark.usefixtures("builtin_cache")
TEXT = "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog. "
# (arch, tied, dtype, shard bytes): each architecture tied and untied, each weight type, single and sharded
CASES = [("qwen3", True, torch.float32, None), ("qwen3", False, torch.bfloat16, 20000),
         ("llama3", True, torch.float16, 20000), ("llama3", False, torch.float32, None)]
IDS = lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}-{str(c[2])[6:]}-{'sharded' if c[3] else 'single'}"  # noqa: E731


def theirs(folder, ids):
    """transformers' logits [S, vocab] (float32) of the folder's model for token ids."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def ours(model, ids):
    """Our logits [S, vocab] for token ids (a full window: seq = len(ids)): the training forward on the
    simulator in fp32, and the decoder's."""
    cfg = replace(model.cfg, seq=len(ids))
    params = {k: v.copy() for k, v in model.params.items()}
    with Transformer(cfg, open_device("sim", precision="fp32"), params, np.arange(cfg.vocab)) as t:
        forward = t.logits(np.asarray(ids)).T.astype(np.float64)
    return forward, Decoder(cfg, model.params).forward(np.asarray(ids), all_logits=True).astype(np.float64)


def rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_imported_logits_equal_transformers(tmp_path, case):
    arch, tied, dtype, shard = case
    arch_hf_folder(tmp_path / "hf", arch, tied, dtype=dtype, shard_bytes=shard)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == bool(shard)
    model = sources.resolve(tmp_path / "hf")
    cfg = model.cfg
    assert (cfg.qk_norm, cfg.rope_type, cfg.tied, cfg.residual_scaled, cfg.alpha) == \
        (arch == "qwen3", "llama3" if arch == "llama3" else "default", tied, False, 1.0)
    ids = list(np.random.default_rng(1).integers(0, SHAPE["vocab_size"], 24))
    want = theirs(tmp_path / "hf", ids)
    forward, decoded = ours(model, ids)
    assert rel(forward, want) < 1e-4 and rel(decoded, want) < 1e-4, (rel(forward, want), rel(decoded, want))


def test_transformers_4_spelling_rope_scaling_reads_as_rope_parameters(tmp_path):
    """transformers 4 wrote rope_theta beside rope_scaling; 5 writes both into rope_parameters."""
    arch_hf_folder(tmp_path / "hf", "llama3", False)
    new = sources.resolve(tmp_path / "hf").cfg
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = conf.pop("rope_parameters")
    conf.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    assert sources.resolve(tmp_path / "hf").cfg == new and new.rope_type == "llama3" and new.rope_theta == 500000.0


def small_tokenizer():
    """The built-in vocabulary's first SHAPE["vocab_size"] pieces (controls, bytes and a few merges)."""
    t = builtin_dataset()[0]
    return Tokenizer(t.pieces[:SHAPE["vocab_size"]], t.scores[:SHAPE["vocab_size"]])


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_export_back_to_hf_gives_the_same_logits_in_transformers(tmp_path, arch):
    arch_hf_folder(tmp_path / "hf", arch, tied=arch == "llama3")
    small_tokenizer().save(tmp_path / "tokenizer.bin")
    model = sources.resolve(tmp_path / "hf", tokenizer=tmp_path / "tokenizer.bin", text=True)
    export(model, "hf", tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}[arch]]
    ids = list(np.random.default_rng(2).integers(0, SHAPE["vocab_size"], 16))
    assert rel(theirs(tmp_path / "out", ids), theirs(tmp_path / "hf", ids)) < 1e-6
    again = sources.resolve(tmp_path / "out")
    assert again.cfg == replace(model.cfg, seq=again.cfg.seq)
    for k, v in model.params.items():
        np.testing.assert_array_equal(again.params[k], v, err_msg=k)


def test_an_alpha_scaled_model_of_these_architectures_exports_and_reads_back_exactly(tmp_path):
    """--scratch's α-scaled model with QK-norm, llama3 RoPE and its own classifier: transformers computes
    it from the folder (α folded into wo and w2), and it reads back as it was, bit for bit."""
    from anectypes.formats.portable import Portable
    from anectypes.model.config import ModelConfig, init_params
    cfg = ModelConfig(dim=32, hidden=48, heads=4, kv_heads=2, head_dim=16, layers=2, seq=16, vocab=SHAPE["vocab_size"],
                      qk_norm=True, rope_type="llama3", rope_original_context=64, rope_theta=1e5, tied=False)
    rng = np.random.default_rng(3)
    params = {k: (rng.uniform(0.5, 1.5, v.shape) if v.ndim == 1 else 8 * v).astype(np.float32)
              for k, v in init_params(cfg, rng).items()}
    model = Portable(cfg, params, small_tokenizer())
    export(model, "hf", tmp_path / "out")
    ids = list(rng.integers(0, cfg.vocab, 16))
    forward, decoded = ours(model, ids)
    want = theirs(tmp_path / "out", ids)
    assert rel(forward, want) < 1e-4 and rel(decoded, want) < 1e-4
    again = sources.resolve(tmp_path / "out")
    assert again.cfg == cfg and again.cfg.alpha == 0.5
    for k, v in params.items():
        np.testing.assert_array_equal(again.params[k], v, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied", [("qwen3", True), ("llama3", False)])
def test_fine_tuning_an_imported_folder_lowers_the_validation_loss(tmp_path, arch, tied):
    from anectypes.train import main as train
    arch_hf_folder(tmp_path / "hf", arch, tied)
    tok = small_tokenizer()
    np.array(tok.encode(TEXT * 40), np.uint16).tofile(tmp_path / "tokens.bin")
    run = tmp_path / "run"
    assert train(["--init-from", str(tmp_path / "hf"), "--data", str(tmp_path / "tokens.bin"), "--seq", "32",
                  "--run-dir", str(run), "--backend", "sim", "--steps", "40", "--accum", "2", "--lr", "3e-3",
                  "--warmup", "2", "--sample-every", "0", "--log-every", "1000", "--save-every", "5"]) == 0
    doc = json.loads((run / "config.json").read_text())
    config = doc["model"]
    assert (config["seq"], config["qk_norm"], config["tied"], config["residual_scaled"]) == \
        (32, arch == "qwen3", tied, False)
    assert doc["spec"]["loss_scale"] == 8192                # α = 1: fp16 gradients underflow at 256 (docs/model.md)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses(run)) == 40 and len(val) >= 2 and val[-1] < val[0] - 0.5, val
    # and the fine-tuned model goes back to a folder transformers reads with our logits
    tok.save(tmp_path / "tokenizer.bin")
    tuned = sources.resolve(run, tokenizer=tmp_path / "tokenizer.bin", text=True)
    export(tuned, "hf", tmp_path / "out")
    ids = list(tok.encode(TEXT)[:20])
    forward, decoded = ours(tuned, ids)
    want = theirs(tmp_path / "out", ids)
    assert rel(forward, want) < 1e-4 and rel(decoded, want) < 1e-4


def test_an_imported_model_takes_loss_scale_8192_unless_told(tmp_path, capsys):
    from anectypes.train import main as train
    arch_hf_folder(tmp_path / "hf", "qwen3", True)
    np.array(small_tokenizer().encode(TEXT * 40), np.uint16).tofile(tmp_path / "tokens.bin")
    for given, want in (([], 8192), (["--loss-scale", "512"], 512)):
        run = tmp_path / f"run{want}"
        assert train(["--init-from", str(tmp_path / "hf"), "--data", str(tmp_path / "tokens.bin"), "--seq", "32",
                      "--run-dir", str(run), "--backend", "sim", "--steps", "1", "--sample-every", "0",
                      *given]) == 0
        assert json.loads((run / "config.json").read_text())["spec"]["loss_scale"] == want
        assert ("note: loss scale 8192" in capsys.readouterr().err) == (not given)


# Qwen/Qwen3-0.6B's config.json as published (transformers 4.51 wrote it)
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
             "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
             "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
             "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_the_qwen3_06b_preset_is_qwen3_06b_with_our_residual_scale(tmp_path):
    from anectypes.formats import hf
    from anectypes.model.config import PRESETS
    hf.refuse_unsupported(tmp_path, QWEN3_06B)
    imported = hf.config_of(QWEN3_06B, qk_norm=True)
    assert imported.seq == 2048 and not imported.residual_scaled and imported.n_params() == 596_049_920
    assert replace(imported, seq=256, residual_scaled=True) == PRESETS["qwen3_06b"]


def test_generate_and_export_commands_take_a_qwen3_folder(tmp_path):
    """The commands a user runs on a folder, as processes: generate decodes it greedily with the ids our
    decoder picks, export writes a folder transformers loads."""
    import subprocess
    import sys
    arch_hf_folder(tmp_path / "hf", "qwen3", tied=False)
    tok = small_tokenizer()
    tok.save(tmp_path / "hf" / "tokenizer.bin")                  # the tokenizer a folder may hold beside it
    r = subprocess.run([sys.executable, "-m", "anectypes.generate", "hf", "--steps", "8", "--temperature", "0",
                        "--prompt", "Once"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    model = sources.resolve(tmp_path / "hf", text=True)
    dec, ids = Decoder(model.cfg, model.params), tok.encode("Once")
    logits = dec.forward(np.array(ids))
    while len(ids) <= 8:                        # run.c's --steps 8: 8 positions fed, each followed by a pick
        ids.append(int(np.argmax(logits)))
        if len(ids) <= 8:
            logits = dec.forward(np.array(ids[-1:]))
    assert r.stdout.splitlines()[0] == tok.decode(ids)
    r = subprocess.run([sys.executable, "-m", "anectypes.export", "hf", "--format", "hf", "--out", "out"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    some = list(np.random.default_rng(5).integers(0, SHAPE["vocab_size"], 12))
    assert rel(theirs(tmp_path / "out", some), theirs(tmp_path / "hf", some)) < 1e-6


IMPORT_PEAK = """
import sys
from pathlib import Path
from anectypes.formats import hf

def peak():      # this process's peak RSS (VmHWM: unlike getrusage's, not the forking parent's)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024

before = peak()
params = hf.read(Path(sys.argv[1])).params
print(sum(w.nbytes for w in params.values()), peak() - before)
"""


def test_importing_a_bf16_folder_holds_its_weights_in_float32_about_once(tmp_path):
    """Each tensor is read into a float32 array of its own and taken as it is: the import's peak is 1.5× the
    weights in float32 here (the rest: RoPE's row order and α's scaling, a matrix at a time), where it was 2.5×
    when the whole file was mapped, converted through two temporaries and copied again. In a fresh process,
    whose peak is the import's alone."""
    arch_hf_folder(tmp_path, "llama3", True, torch.bfloat16, vocab_size=16384, hidden_size=512, intermediate_size=1536,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    r = subprocess.run([sys.executable, "-c", IMPORT_PEAK, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    weights, peak = map(int, r.stdout.split())
    assert weights > 60 * 2**20 and peak < 2 * weights, (weights, peak)
