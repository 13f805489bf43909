"""A Hugging Face folder's tokenizer (anectypes.data.hf_tokenizer) against transformers' AutoTokenizer on the
same folder, its use by sources, generate --chat against transformers' own greedy generation, and text --data
(anectypes.data.text): .txt, folders, .jsonl text and chat rows with the assistant-only mask against
transformers' assistant mask, the token cache, fine-tuning on chat rows, and the bad inputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.hf_folders import (TEXT_CHAT_TEMPLATE, text_llama_folder, text_save_model,
                                 text_tokenizer_folder)
from support.training import one_line_error

from anectypes import sources
from anectypes.data.hf_tokenizer import HFTokenizer
from anectypes.data.text import chat_tokens, read_cache, text_tokens
from anectypes.errors import DataError
from anectypes.generate.sampling import TextStream

pytestmark = pytest.mark.usefixtures("builtin_cache")
ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["Once upon a time, there was a little girl named Lily.",
         "naïve café — 東京 ✓ emoji 🙂 and\n\n  spaces\t", "", "<|im_end|> is a special token, <|im_start|>user too",
         "x" * 300 + " tail"]
# the ChatML template with transformers' {% generation %} tags around what the assistant says
TAGGED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 東京"},
        {"role": "assistant", "content": "Hello! café"}, {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "Once upon 🙂"}]


def auto(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def run(module, *argv, cwd=None):
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


# --- the tokenizer against transformers ----------------------------------------------------------------------

@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_encode_decode_and_streamed_pieces_equal_transformers(tmp_path, bos):
    folder = text_tokenizer_folder(tmp_path / "tok", bos=bos)
    ours, theirs = HFTokenizer.load(folder), auto(folder)
    assert ours.vocab_size == len(theirs) == 400
    assert ours.bos == (0 if bos else None) and ours.eos == 2 and ours.stop == {0, 2}
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == (theirs.encode(text) or [0 if bos else 2]), text       # nothing: BOS, else EOS
        assert ours.encode(text, bos=False) == theirs.encode(text, add_special_tokens=False)
        want = theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == want
        stream = TextStream(ours)
        assert "".join(map(stream, ids)) == want, text                      # the pieces generate streams


def test_a_sentencepiece_style_tokenizer_json_equals_transformers_and_ours(tmp_path):
    """The llama2.c-style tokenizer.json our hf export writes (▁ spaces, byte fallback, the first space
    stripped): our reading of it equals AutoTokenizer's and encodes as the tokenizer.bin it came from."""
    from anectypes.data.corpus import builtin_dataset
    from anectypes.formats.hf import tokenizer_json
    tok = builtin_dataset()[0]
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(tok).to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, split_special_tokens=True)))
    ours, theirs = HFTokenizer.load(tmp_path), auto(tmp_path)
    for text in TEXTS + [" leading space"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) == tok.encode(text), text
        want = theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == want and "".join(map(TextStream(ours), ids)) == want, text


def test_chat_template_renders_as_transformers_and_in_a_sandbox(tmp_path):
    folder = text_tokenizer_folder(tmp_path / "tok")
    ours, theirs = HFTokenizer.load(folder), auto(folder)
    for messages in (CHAT, CHAT[1:2]):
        for gen in (False, True):
            assert ours.render_chat(messages, gen) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(DataError, match="unknown role tool"):               # the template's raise_exception
        ours.render_chat([{"role": "tool", "content": "x"}])
    escape = {"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(escape))
    with pytest.raises(DataError, match="unsafe"):                          # data, never code
        HFTokenizer.load(folder).render_chat(CHAT)
    (folder / "tokenizer_config.json").unlink()
    (folder / "chat_template.jinja").write_text(TEXT_CHAT_TEMPLATE + "{# from the file #}")
    assert HFTokenizer.load(folder).render_chat(CHAT) == ours.render_chat(CHAT)


def test_chat_mask_is_transformers_assistant_mask(tmp_path):
    """Our assistant mask (found without {% generation %} tags) equals transformers' (which needs them)."""
    folder = text_tokenizer_folder(tmp_path / "tok", chat_template=TAGGED_TEMPLATE)
    want = auto(folder).apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = chat_tokens(HFTokenizer.load(folder), CHAT, "row")
    assert ids == want["input_ids"] and mask.astype(int).tolist() == want["assistant_masks"]
    assert 0 < mask.sum() < len(mask)


# --- sources and generate -----------------------------------------------------------------------------------

def test_sources_take_the_folders_tokenizer_padded_vocabulary_and_refuse_a_larger_one(tmp_path):
    padded = text_llama_folder(tmp_path / "padded", vocab=416)              # as Qwen3's 151,936 for 151,669
    src = sources.resolve(padded, text=True)
    assert isinstance(src.tokenizer, HFTokenizer) and src.cfg.vocab == 416 and src.tokenizer.vocab_size == 400
    small = text_llama_folder(tmp_path / "small", vocab=300)
    r = run("anectypes.generate", small, "--prompt", "Once", "--steps", "8")
    one_line_error(r, "the tokenizer has 400 tokens but the model's vocabulary has 300")


def ends_its_turn(folder, prompt, k=6):
    """The folder's model with <|endoftext|>'s embedding row (an EOS the prompt does not hold) 1.05 times the
    row of the k-th token greedy decoding gives: the logits it gives are those, and from then on it wins over
    that token, so the reply ends within k tokens. Returns transformers' greedy reply, its EOS included."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def greedy():
        return model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=[0, 2],
                              pad_token_id=0)[0, len(prompt):].tolist()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[0] = 1.05 * embed[greedy()[k - 1]]
    text_save_model(model, folder)
    return greedy()


def test_generate_chat_is_transformers_greedy_generation_up_to_eos(tmp_path):
    folder = text_llama_folder(tmp_path / "m")
    tok = auto(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Once upon a time"}], tokenize=True,
                                     add_generation_prompt=True, return_dict=True)["input_ids"]
    want = ends_its_turn(folder, prompt)
    assert want[-1] == 0 and 2 <= len(want) <= 6, want                     # it ended its turn
    r = run("anectypes.generate", folder, "--chat", "--prompt", "Once upon a time", "--temperature", "0",
            "--steps", "64", "--json")
    got = json.loads(r.stdout)
    assert got["ids"] == prompt + want[:-1] and got["n_prompt"] == len(prompt)
    r = run("anectypes.generate", folder, "--chat", "--prompt", "Once upon a time", "--temperature", "0",
            "--steps", "64")
    assert r.stdout == tok.decode(want[:-1], skip_special_tokens=True) + "\n"   # the reply alone, streamed


def test_without_the_tokenizers_package_one_line_names_the_extra(tmp_path, monkeypatch, capsys):
    from anectypes.generate import main
    folder = text_llama_folder(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "tokenizers", None)                    # as if it were not installed
    capsys.readouterr()
    assert main([str(folder), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "pip install 'anectypes[hf]'" in err, err


def test_export_hf_writes_the_folders_own_tokenizer_and_transformers_reads_it_back(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    folder = text_llama_folder(tmp_path / "m")
    r = run("anectypes.export", folder, "--format", "hf", "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    theirs, again = auto(folder), auto(tmp_path / "out")
    for text in TEXTS:
        assert again(text)["input_ids"] == theirs(text)["input_ids"]
    assert again.apply_chat_template(CHAT, tokenize=False) == theirs.apply_chat_template(CHAT, tokenize=False)
    assert (again.bos_token_id, again.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    ids = torch.tensor([theirs(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        want, got = (AutoModelForCausalLM.from_pretrained(f).eval()(ids).logits for f in (folder, tmp_path / "out"))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert not (tmp_path / "out" / "tokenizer.bin").exists()


@pytest.mark.slow
def test_a_lora_run_from_a_folder_exports_with_its_tokenizer_for_peft_transformers_and_gguf(tmp_path):
    """The walkthrough's path (docs/fine-tuning.md): LoRA on a folder with a tokenizer.json, then the three exports;
    peft's model of the adapter on the folder computes the merged folder's logits, which read back as ours."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    folder = text_llama_folder(tmp_path / "m")
    (tmp_path / "my.txt").write_text("\n\n".join(TEXTS * 30))
    r = run("anectypes.train", "--init-from", folder, "--lora", "4", "--data", tmp_path / "my.txt", "--seq", "32",
            "--steps", "6", "--lr", "1e-2", "--run-dir", tmp_path / "run", "--backend", "sim", "--sample-every", "0")
    assert r.returncode == 0, r.stderr
    for fmt, out in (("peft", "adapter"), ("hf", "merged"), ("gguf", "model.gguf")):
        r = run("anectypes.export", tmp_path / "run", "--format", fmt, "--out", tmp_path / out)
        assert r.returncode == 0, (fmt, r.stderr)
    assert auto(tmp_path / "merged")(TEXTS[0])["input_ids"] == auto(folder)(TEXTS[0])["input_ids"]
    ids = torch.tensor([auto(folder)(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(folder).eval()
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    assert float((adapted - merged).abs().max() / merged.abs().max()) < 1e-5
    assert float((merged - before).abs().max() / before.abs().max()) > 1e-3              # the adapters count
    gguf = sources.resolve(tmp_path / "model.gguf", text=True)
    assert gguf.tokenizer.encode(TEXTS[0], bos=True) == auto(folder)(TEXTS[0])["input_ids"]


def test_export_llama2c_refuses_a_tokenizer_json_it_cannot_hold(tmp_path):
    folder = text_llama_folder(tmp_path / "m")       # (hf: above; gguf: tests/test_interop.py)
    before = tree(tmp_path)
    one_line_error(run("anectypes.export", folder, "--format", "llama2c", "--out", tmp_path / "out"), "tokenizer.json")
    assert tree(tmp_path) == before


def test_generate_chat_needs_a_chat_template(tmp_path):
    folder = text_llama_folder(tmp_path / "m", chat_template=None)
    one_line_error(run("anectypes.generate", folder, "--chat", "--prompt", "hi"), "no chat template")


# --- text data ------------------------------------------------------------------------------------------------

def test_text_sources_tokenize_as_the_tokenizer_and_the_cache_is_reused(tmp_path):
    tok = HFTokenizer.load(text_tokenizer_folder(tmp_path / "tok"))
    (tmp_path / "texts" / "b").mkdir(parents=True)
    (tmp_path / "texts" / "b" / "2.txt").write_text(TEXTS[1])
    (tmp_path / "texts" / "1.txt").write_text(TEXTS[0])
    (tmp_path / "texts" / "skip.md").write_text("not text")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": TEXTS[0]}) + "\n\n" + json.dumps({"messages": CHAT}) + "\n")
    doc = [tok.encode(t, bos=True, eos=True) for t in TEXTS[:2]]
    cache = tmp_path / "tokens.npz"
    tokens, mask = text_tokens(tmp_path / "texts", tok, cache)
    assert tokens.tolist() == doc[0] + doc[1] and mask is None
    tokens, mask = text_tokens(tmp_path / "texts" / "1.txt", tok, cache)    # another source: tokenized again
    assert tokens.tolist() == doc[0] and mask is None
    chat_ids, chat_mask = chat_tokens(tok, CHAT, "row")
    tokens, mask = text_tokens(rows, tok, cache)
    assert tokens.tolist() == doc[0] + chat_ids
    assert mask.tolist() == [True] * len(doc[0]) + chat_mask.tolist()
    stamp = cache.stat().st_mtime_ns, cache.stat().st_ino
    again = text_tokens(rows, tok, cache)                                     # unchanged: read from the cache
    assert (cache.stat().st_mtime_ns, cache.stat().st_ino) == stamp
    assert np.array_equal(again[0], tokens) and np.array_equal(again[1], mask)
    assert read_cache(cache)[2].files == tok.files                           # the cache holds its tokenizer


def finetune(tmp_path, folder, data, *flags):
    return run("anectypes.train", "--init-from", folder, "--data", data, "--run-dir", tmp_path / "run",
               "--backend", "sim", "--precision", "fp32", *flags, cwd=tmp_path)


def chat_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 9, 2))
        rows.append({"messages": [{"role": "user", "content": f"{a} and {b}?"},
                                  {"role": "assistant", "content": f"{a} and {b} make {a + b}."}]})
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_text_folder_trains_from_scratch_with_the_builtin_tokenizer_and_generates(tmp_path):
    from anectypes.data.corpus import builtin_dataset, generate_stories
    stories = generate_stories(60)
    (tmp_path / "texts").mkdir()
    for i, story in enumerate(stories):
        (tmp_path / "texts" / f"{i:03}.txt").write_text(story)
    r = run("anectypes.train", "--scratch", "--data", tmp_path / "texts", "--steps", "4", "--run-dir",
            tmp_path / "run", "--backend", "sim", cwd=tmp_path)
    assert r.returncode == 0 and f"tokenized {tmp_path / 'texts'}: 60 documents" in r.stderr, r.stderr
    tok = builtin_dataset()[0]
    tokens, mask, cached, _ = read_cache(tmp_path / "run" / "tokens.npz")
    assert tokens.tolist() == sum((tok.encode(s, bos=True, eos=True) for s in stories), []) and mask is None
    assert cached.pieces == tok.pieces
    r = run("anectypes.generate", tmp_path / "run", "--prompt", "Once", "--steps", "8", "--seed", "1")
    assert r.returncode == 0 and r.stdout.startswith("Once"), r.stderr


@pytest.mark.slow
def test_finetuning_on_chat_rows_lowers_the_validation_loss_and_resumes_from_the_cache(tmp_path):
    folder = text_llama_folder(tmp_path / "m", vocab=416)
    data = tmp_path / "chat.jsonl"
    data.write_text(chat_rows(200))
    r = finetune(tmp_path, folder, data, "--steps", "60", "--lr", "1e-2", "--accum", "2", "--warmup", "5",
                 "--save-every", "5", "--stop-after", "30")
    assert r.returncode == 0 and "tokenized" in r.stderr and "stopped" in r.stderr, r.stderr
    cache = tmp_path / "run" / "tokens.npz"
    stamp = cache.stat().st_mtime_ns, cache.stat().st_ino
    r = run("anectypes.train", "--resume", "--run-dir", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0 and "tokenized" not in r.stderr, r.stderr
    assert (cache.stat().st_mtime_ns, cache.stat().st_ino) == stamp
    rows = map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())
    val = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(val) == 6 and val[-1] < 0.7 * val[0], val
    r = run("anectypes.generate", tmp_path / "run", "--chat", "--prompt", "3 and 4?", "--temperature", "0",
            "--steps", "64", "--json")
    got = json.loads(r.stdout)
    reply = auto(folder).decode(got["ids"][got["n_prompt"]:])
    assert " make " in reply and len(got["ids"]) < 64, reply               # the rows' shape, and its turn ended


CHAT_ROW = json.dumps({"messages": CHAT})
BAD = [("no-assistant", "rows.jsonl", json.dumps({"messages": CHAT[:2]}) + "\n", True,
        ["line 1", "without an assistant turn"]),
       ("malformed", "rows.jsonl", CHAT_ROW + "\n" + CHAT_ROW[:-3] + "\n", True,
        ["rows.jsonl, line 2", "not readable JSON"]),
       ("not-a-row", "rows.jsonl", CHAT_ROW + "\n\n" + json.dumps({"messages": [{"role": "user"}]}), True,
        ["line 3", '{"messages"']),
       ("empty", "rows.txt", "\n", True, ["rows.txt: the file is empty"]),
       ("no-template", "rows.jsonl", CHAT_ROW + "\n", False, ["no chat template"]),
       ("too-short", "rows.jsonl", CHAT_ROW + "\n", True, ["too short for seq 64"]),
       ("assistant-in-one-part", "rows.jsonl", json.dumps({"messages": [
           {"role": "user", "content": "Once upon a time " * 300}, {"role": "assistant", "content": "Yes."}]}),
        True, ["assistant messages all fall in one part"])]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_text_data_is_one_error_line_and_changes_nothing(tmp_path, case):
    _, name, content, template, words = case
    folder = text_llama_folder(tmp_path / "m", **({} if template else {"chat_template": None}))
    (tmp_path / name).write_text(content)
    before = tree(tmp_path)
    one_line_error(finetune(tmp_path, folder, tmp_path / name, "--steps", "4"), *words)
    assert tree(tmp_path) == before
