"""Hugging Face model folders built in the test, nothing downloaded: a byte-level BPE tokenizer trained with
`tokenizers` (saved as tokenizer.json, with a ChatML chat template in tokenizer_config.json, as Qwen's) and a
tiny Llama saved by transformers' own save_pretrained."""

import json

from anectypes.data.corpus import generate_stories

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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
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
