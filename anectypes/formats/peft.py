"""PEFT's LoRA adapters (docs/lora.md): a folder of adapter_config.json and adapter_model.safetensors that
`peft.PeftModel.from_pretrained(base, folder)` loads onto the Hugging Face model the run started from.

Our adapters are in training's convention, as its weights are (formats/portable.py): B of q and k has
its rows in our interleaved RoPE order, permuted to Hugging Face's halves as wq's and wk's rows are
(hf.rows; A's columns are the input's, which no permutation touches), and B of o and down takes the
residual scale α that the writers fold into wo and w2. The writer needs the `export` extra (safetensors).
"""

from .hf import NAMES, rows, write_json
from .portable import FormatError, fold, need

HF_PARTS = dict(lora_a="lora_A", lora_b="lora_B")


def hf_adapter(cfg, name, value):
    """One adapter matrix `layers.{i}.<weight>.lora_a|lora_b` in Hugging Face's convention (see the module)."""
    weight, part = name.split(".")[2:]
    if part == "lora_b" and weight in ("wq", "wk"):
        value = rows(value, cfg.heads if weight == "wq" else cfg.kv_heads, to_hf=True)
    if part == "lora_b" and weight in ("wo", "w2"):
        value = fold(value, cfg.alpha)
    return value


def write(model, folder, dtype="f32"):
    if model.lora is None:
        raise FormatError("the source is not a LoRA run (train --lora): it has no adapter to write; export its "
                          "whole model with --format hf")
    st, cfg, lora = need("safetensors.numpy"), model.cfg, model.lora
    tensors = {}
    for name, value in model.adapters.items():
        _, i, weight, part = name.split(".")
        tensors[f"base_model.model.model.layers.{i}.{NAMES[weight]}.{HF_PARTS[part]}.weight"] = \
            hf_adapter(cfg, name, value).astype("<f2" if dtype == "f16" else "<f4")
    write_json(folder / "adapter_config.json", dict(
        peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=model.base, r=lora.rank,
        lora_alpha=lora.alpha, target_modules=sorted(NAMES[w].split(".")[1] for w in lora.targets), lora_dropout=0.0,
        bias="none", fan_in_fan_out=False, use_rslora=False, init_lora_weights=True, inference_mode=True))
    (folder / "adapter_model.safetensors").write_bytes(st.save(tensors, metadata={"format": "pt"}))
