"""Tiny random Hugging Face checkpoints made by transformers' own classes and save_pretrained (nothing is
downloaded): a Qwen3 (QK-norm, head_dim ≠ hidden/heads) and a Llama 3 (llama3 RoPE), tied or untied,
single or sharded, in float32, float16 or bfloat16 (norm weights drawn away from 1 so that they show in
the logits, QK-norm's permutation included); a plain Llama for LoRA; a byte-level BPE tokenizer trained with
`tokenizers` (saved as tokenizer.json, with a ChatML chat template in tokenizer_config.json, as Qwen's) and a
tiny Llama holding it."""

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from anectypes.data.corpus import generate_stories

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.15)
# Llama 3.1's RoPE scaling on a small original context, so that each of its three bands holds some pairs
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)


def arch_hf_config(arch, tied, **changes):
    """transformers' config of the tiny `arch` ("qwen3" or "llama3") model."""
    if arch == "qwen3":
        return Qwen3Config(**SHAPE, head_dim=16, rope_theta=1e6, tie_word_embeddings=tied, **changes)
    return LlamaConfig(**{**SHAPE, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE),
                          "tie_word_embeddings": tied, **changes})


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

# ChatML as Qwen2.5's and SmolLM2's templates write it: a turn per message, the generation prompt on request
TEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def text_tokenizer_folder(folder, vocab=400, chat_template=TEXT_CHAT_TEMPLATE, bos=False):
    """folder with tokenizer.json (byte-level BPE of `vocab` ids trained on the built-in stories and some
    non-ASCII text, specials first; with `bos`, <|endoftext|> put before every text by its post-processor, as
    Llama 3's <|begin_of_text|>), tokenizer_config.json (the chat template, EOS <|im_end|>) and
    generation_config.json. Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=TEXT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generate_stories(200) + ["naïve café — 東京 ✓ emoji 🙂"] * 3, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                           special_tokens=[("<|endoftext|>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    conf = dict(tokenizer_class="PreTrainedTokenizerFast", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                bos_token="<|endoftext|>" if bos else None, clean_up_tokenization_spaces=False,
                model_max_length=64)
    if chat_template is not None:
        conf["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(dict(eos_token_id=[tok.token_to_id("<|im_end|>"),
                                                                                 tok.token_to_id("<|endoftext|>")])))
    return folder


def text_llama_folder(folder, vocab=None, seed=0, **tokenizer):
    """A tied tiny Llama (transformers' LlamaConfig, save_pretrained) with text_tokenizer_folder's tokenizer;
    its vocabulary the tokenizer's, or `vocab` (a config padded beyond the tokenizer, as Qwen3's)."""
    text_tokenizer_folder(folder, **tokenizer)
    n = json.loads((folder / "tokenizer.json").read_text())
    n = max([*n["model"]["vocab"].values(), *(t["id"] for t in n["added_tokens"])]) + 1
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab or n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=0, initializer_range=0.3)
    text_save_model(LlamaForCausalLM(cfg), folder)
    return folder


def text_save_model(model, folder):
    """model.save_pretrained(folder), keeping the folder's generation_config.json (with its EOS), which
    save_pretrained replaces with the model's."""
    kept = (folder / "generation_config.json").read_text()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(kept)


# Qwen2's and Llama 3's pre-tokenizer regex, %s their digits' group
SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def bpe_tokenizer(folder, split_digits, bos, vocab=300):
    """text_tokenizer_folder's byte-level BPE in folder, its pre-tokenizer made Qwen2's (split_digits "")
    or Llama 3's ("{1,3}", with ignore_merges as Llama 3's tokenizer.json): the Split regex, then ByteLevel."""
    text_tokenizer_folder(folder, vocab=vocab, bos=bos)
    doc = json.loads((folder / "tokenizer.json").read_text())
    doc["pre_tokenizer"] = dict(type="Sequence", pretokenizers=[
        dict(type="Split", pattern=dict(Regex=SPLIT % split_digits), behavior="Isolated", invert=False),
        dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=False)])
    doc["model"]["ignore_merges"] = split_digits != ""
    (folder / "tokenizer.json").write_text(json.dumps(doc))
