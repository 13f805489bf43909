"""Quantized GGUF files (anectypes/formats/gguf.py's read): every tensor type gguf-py dequantizes is read as its
dequantization, one that it cannot is one error line; and the real SmolLM2-135M-Instruct (Q8_0 and Q4_1,
tests/support/real_model.py) read by generate, train --init-from and export gives the logits and greedy ids of
transformers' own GGUF loader, its blocks decoded here in float64 from their layout."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from support.real_model import NAME, english

from anectypes import sources
from anectypes.data.corpus import builtin_dataset
from anectypes.formats import gguf as ours_gguf
from anectypes.formats.export import export
from anectypes.formats.portable import Portable
from anectypes.generate.decoder import Decoder
from anectypes.model.config import ModelConfig, init_params

T = gguf.GGMLQuantizationType
PROMPT = "Once upon a time, there was a little girl named"


def command(module, *args):
    return subprocess.run([sys.executable, "-m", f"anectypes.{module}", *map(str, args)], capture_output=True, text=True)


# --- every tensor type, on a tiny model ------------------------------------------------------------------

def quantized_file(path, qtype, monkeypatch):
    """A tiny llama GGUF (rows of 256, the K-quants' block) whose matrices are random blocks of qtype, every byte
    below 0x7C so that no float16 in a block is inf or NaN; returns its raw tensors by name."""
    cfg = ModelConfig(dim=256, hidden=256, heads=4, kv_heads=2, head_dim=64, layers=1, seq=32, vocab=1024,
                      residual_scaled=False)
    params = {k: v.astype(np.float32) for k, v in init_params(cfg, np.random.default_rng(0)).items()}
    rng, raw, add = np.random.default_rng(int(qtype)), {}, gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, **kw):
        if tensor.ndim == 2:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            tensor = rng.integers(0, 0x7C, (tensor.shape[0], tensor.shape[1] // block * size), dtype=np.uint8)
            kw = dict(raw_dtype=qtype)
        raw[name] = tensor
        return add(self, name, tensor, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    export(Portable(cfg, params, builtin_dataset()[0]), "gguf", path)
    monkeypatch.undo()
    return raw


def dequantizes(qtype):
    """Whether gguf-py's dequantize knows qtype (the reference of what must be read)."""
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        return True
    except NotImplementedError:
        return False


@pytest.mark.parametrize("qtype", [t for t in T if t not in (T.F32, T.F16)], ids=lambda t: t.name)
def test_every_type_gguf_py_dequantizes_is_read_as_its_dequantization_and_the_rest_is_one_error(
        tmp_path, monkeypatch, qtype):
    """Each matrix read equals gguf-py's dequantization of its blocks, and the model names the quantized type its
    weights are a copy of (none for BF16, which float32 holds exactly: no note); a type gguf-py cannot
    dequantize stops generate with one error line naming the tensor and the type, and export writes nothing."""
    raw = quantized_file(tmp_path / "m.gguf", qtype, monkeypatch)
    if dequantizes(qtype):
        model = ours_gguf.read(tmp_path / "m.gguf")
        for name, ours in (("token_embd.weight", "embed"), ("blk.0.attn_q.weight", "layers.0.wq"),
                           ("blk.0.ffn_down.weight", "layers.0.w2")):
            np.testing.assert_array_equal(model.params[ours], gguf.quants.dequantize(raw[name], qtype), err_msg=name)
        assert model.dequantized == (() if qtype == T.BF16 else (qtype.name,))
        return
    r = command("generate", tmp_path / "m.gguf", "--steps", "4")
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and f"tensor token_embd.weight is {qtype.name}, which the gguf package " \
        "cannot dequantize" in r.stderr, r.stderr
    before = sorted(os.listdir(tmp_path))
    r = command("export", tmp_path / "m.gguf", "--format", "hf", "--out", tmp_path / "hf")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and qtype.name in r.stderr
    assert sorted(os.listdir(tmp_path)) == before


# --- the real model --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(smollm2_gguf):
    """The real GGUF as generate reads it (its tokenizer, its classifier tied)."""
    return sources.resolve(smollm2_gguf, text=True, untied=True)


@pytest.fixture(scope="module")
def transformers_gguf(smollm2_gguf):
    """transformers' own GGUF loader (it dequantizes through gguf-py): the tokenizer and float32 model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = smollm2_gguf.parent
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=NAME)
    return tok, AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME, dtype=torch.float32).eval()


def logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def f16(a, at):
    return a[..., at:at + 2].copy().view(np.float16).astype(np.float64)[..., 0]


@pytest.mark.slow
def test_the_real_ggufs_weights_are_its_q8_0_and_q4_1_blocks_decoded(real, smollm2_gguf):
    """token_embd (Q8_0: blocks of 32 as a float16 scale d and 32 int8, d·q) and a Q4_1 matrix (blocks of 32 as
    float16 d and m, 16 bytes of nibbles, low nibbles the first 16 values: d·q + m), decoded here in float64 from
    ggml's block layout, are the weights read, the F32 norms as they are."""
    reader = gguf.GGUFReader(smollm2_gguf)
    t = {x.name: x for x in reader.tensors}
    assert {x.tensor_type.name for x in reader.tensors} == {"Q8_0", "Q4_1", "F32"}
    q8 = np.asarray(t["token_embd.weight"].data).reshape(-1, 34)
    embed = (f16(q8, 0)[:, None] * q8[:, 2:].view(np.int8)).reshape(real.params["embed"].shape)
    np.testing.assert_allclose(real.params["embed"], embed, rtol=1e-6, atol=0)
    q4 = np.asarray(t["blk.7.ffn_down.weight"].data).reshape(-1, 20)
    nibbles = np.concatenate([q4[:, 4:] & 15, q4[:, 4:] >> 4], axis=1)
    w2 = (f16(q4, 0)[:, None] * nibbles + f16(q4, 2)[:, None]).reshape(real.params["layers.7.w2"].shape)
    np.testing.assert_allclose(real.params["layers.7.w2"], w2, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(real.params["layers.7.rms_att"], t["blk.7.attn_norm.weight"].data)
    assert (real.cfg.dim, real.cfg.hidden, real.cfg.heads, real.cfg.kv_heads, real.cfg.layers, real.cfg.vocab,
            real.cfg.rope_theta, real.cfg.tied) == (576, 1536, 9, 3, 30, 49152, 100000.0, True)


@pytest.mark.slow
def test_the_real_ggufs_logits_and_ids_are_transformers_gguf_loaders(real, transformers_gguf):
    """On real English (the GPL-3's preamble, 56 tokens), the GGUF's own tokenizer through our source gives
    transformers' ids, and the CPU decoder over the dequantized weights its logits within 1e-4 (relative)."""
    tok, model = transformers_gguf
    text = english(300)
    ids = tok(text)["input_ids"]
    assert real.tokenizer.encode(text) == ids and len(ids) > 40
    theirs = logits(model, ids)
    ours = Decoder(real.cfg, real.params).forward(np.array(ids), all_logits=True)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.slow
def test_generate_on_the_real_gguf_says_it_dequantized_and_continues_greedily_as_transformers(
        smollm2_gguf, transformers_gguf):
    """`generate SMOL.gguf --temperature 0` as a user runs it: transformers' greedy ids from its GGUF loader (" Emma
    who loved to play ..."), and the one note saying the weights are a dequantized copy."""
    import torch
    tok, model = transformers_gguf
    r = command("generate", smollm2_gguf, "--prompt", PROMPT, "--temperature", "0", "--steps", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ids"][:out["n_prompt"]] == tok(PROMPT)["input_ids"] and out["n_generated"] >= 12, out
    with torch.no_grad():
        want = model.generate(torch.tensor([out["ids"][:out["n_prompt"]]]), do_sample=False,
                              max_new_tokens=out["n_generated"])[0].tolist()
    assert out["ids"] == want and out["text"] == tok.decode(want), (out["text"], tok.decode(want))
    assert r.stderr.count("is quantized (Q4_1, Q8_0): its weights are read as a dequantized float32 copy") == 1


@pytest.mark.slow
def test_the_real_ggufs_hf_export_loads_in_transformers_with_its_logits(smollm2_hf, transformers_gguf):
    """`export SMOL.gguf --format hf` (the smollm2_hf fixture): a float32 folder transformers loads on its own,
    whose tokenizer and logits are those of transformers' GGUF loader on the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok, model = transformers_gguf
    text = english(200)
    ids = tok(text)["input_ids"]
    assert AutoTokenizer.from_pretrained(smollm2_hf)(text)["input_ids"] == ids
    folder = AutoModelForCausalLM.from_pretrained(smollm2_hf).eval()
    assert json.loads((smollm2_hf / "config.json").read_text())["tie_word_embeddings"] is True
    theirs = logits(model, ids)
    assert np.abs(logits(folder, ids) - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.slow
def test_training_from_the_real_gguf_starts_from_its_weights(smollm2_gguf, tmp_path):
    """`train --init-from SMOL.gguf` on real English in fp32: the run holds the GGUF's model and its first loss is
    a pretrained model's (near 3 nats), far below any untrained one's; it said once that it dequantized."""
    (tmp_path / "gpl.txt").write_text(english(6000))
    r = command("train", "--init-from", smollm2_gguf, "--data", tmp_path / "gpl.txt", "--seq", "32", "--steps", "1",
                "--precision", "fp32", "--backend", "sim", "--sample-every", "0", "--run-dir", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("is quantized (Q4_1, Q8_0): its weights are read as a dequantized float32 copy") == 1
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (cfg["dim"], cfg["layers"], cfg["vocab"], cfg["tied"], cfg["residual_scaled"]) == (576, 30, 49152, True, False)
    loss = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]
    assert loss and loss[0] < 5, loss
