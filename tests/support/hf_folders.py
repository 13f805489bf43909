"""Tiny Hugging Face model folders made by transformers' own classes and save_pretrained (nothing downloaded)."""

import torch


def lora_llama_folder(folder, seed=0, vocab=1024, context=32):
    """A random-initialized plain Llama (GQA, tied) saved with save_pretrained into `folder`: small enough for
    a training step in a second, with the built-in corpus' vocabulary (1024) so that it trains on it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=context,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.2)
    model = LlamaForCausalLM(conf)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
