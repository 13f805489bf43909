"""LoRA (docs/lora.md): adapters on a frozen model, against PyTorch + peft on the same Hugging Face folder."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from support.hf_folders import lora_llama_folder
from anectypes.device import open_device
from anectypes.formats import hf
from anectypes.model.lora import TARGETS, Lora, init_adapters
from anectypes.model.transformer import Transformer

HF_NAMES = dict(wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj", wo="self_attn.o_proj",
                w1="mlp.gate_proj", w3="mlp.up_proj", w2="mlp.down_proj")


def peft_model(folder, lora):
    """transformers' model of the folder in float64 with peft's LoRA on lora's targets."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64)
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


def test_one_lora_steps_adapter_gradients_equal_peft_autograd_in_float64(tmp_path):
    folder = lora_llama_folder(tmp_path / "lora_llama")
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
