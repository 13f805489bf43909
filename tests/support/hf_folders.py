"""Tiny random Hugging Face checkpoints made by transformers' own classes and save_pretrained (nothing is
downloaded): a Qwen3 (QK-norm, head_dim ≠ hidden/heads) and a Llama 3 (llama3 RoPE), tied or untied,
single or sharded, in float32, float16 or bfloat16 (norm weights drawn away from 1 so that they show in
the logits, QK-norm's permutation included); a plain Llama for LoRA."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.15)
# Llama 3.1's RoPE scaling on a small original context, so that each of its three bands holds some pairs
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)


def arch_hf_config(arch, tied, **changes):
    """transformers' config of the tiny `arch` ("qwen3" or "llama3") model."""
    if arch == "qwen3":
        return Qwen3Config(**SHAPE, head_dim=16, rope_theta=1e6, tie_word_embeddings=tied, **changes)
    return LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=tied,
                       **changes)


def arch_hf_folder(folder, arch, tied, dtype=torch.float32, shard_bytes=None, seed=0, **changes):
    """Save a random tiny `arch` model in `folder` (shards of at most shard_bytes, when given); returns the
    float32 transformers model whose logits the folder's weights give."""
    torch.manual_seed(seed)
    cfg = arch_hf_config(arch, tied, **changes)
    model = (Qwen3ForCausalLM if arch == "qwen3" else LlamaForCausalLM)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(folder, max_shard_size=shard_bytes or "1GB")
    return model.to(torch.float32)


def lora_llama_folder(folder, seed=0, vocab=1024, context=32):
    """A random-initialized plain Llama (GQA, tied) saved with save_pretrained into `folder`: small enough for
    a training step in a second, with the built-in corpus' vocabulary (1024) so that it trains on it."""
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=context,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.2)
    model = LlamaForCausalLM(conf)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
