"""Every checkpoint a run writes reads back in every command that takes one, as a user runs them: runs from a Hugging
Face folder in both precisions, full and LoRA with two target sets, each generated from, exported in the four
formats, evaluated and resumed (bit for bit: stopped and resumed, its weights are those of the straight run).
(A fp32 LoRA run's frozen weights are views of its surfaces: its checkpoints were written in Fortran order and
refused by every reader, issue 42 §2.)"""

import subprocess
import sys

import numpy as np
import pytest

from support.hf_folders import text_llama_folder
from anectypes.data.corpus import generate_stories
from anectypes.formats.checkpoint import load_checkpoint

GRID = [(precision, lora) for precision in ("fp16", "fp32") for lora in (None, "q,k,v,o", "gate,up,down,q,k,v,o")]


def command(module, *argv):
    return subprocess.run([sys.executable, "-m", f"anectypes.{module}", *map(str, argv)], capture_output=True,
                          text=True)


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def folder_and_text(tmp_path_factory):
    where = tmp_path_factory.mktemp("grid")
    text = where / "stories.txt"
    text.write_text("\n\n".join(generate_stories(60, seed=3)))
    return text_llama_folder(where / "hf"), text


@pytest.mark.slow
@pytest.mark.parametrize("precision,lora", GRID, ids=[f"{p}-{t or 'full'}" for p, t in GRID])
def test_every_checkpoint_reads_back_in_generate_export_eval_and_resume(tmp_path, folder_and_text, precision, lora):
    folder, text = folder_and_text
    train = ["--init-from", folder, "--data", text, "--seq", 32, "--steps", 6, "--accum", 2, "--save-every", 1,
             "--precision", precision, "--backend", "sim", "--sample-every", 0, "--lr", 1e-3,
             *(["--lora", 4, "--lora-targets", lora] if lora else [])]
    straight, run = tmp_path / "straight", tmp_path / "run"
    ok(command("train", *train, "--run-dir", straight))
    ok(command("train", *train, "--run-dir", run, "--stop-after", 3))
    for checkpoint in ("best", "latest"):
        ok(command("generate", run, "--checkpoint", checkpoint, "--prompt", "Once upon", "--steps", 8,
                   "--temperature", 0))
        got = ok(command("eval", run, "--checkpoint", checkpoint, "--data", text, "--seq", 32, "--backend", "sim",
                         "--precision", precision, "--json"))
        assert '"loss"' in got.stdout
    for fmt, out in (("hf", "hf"), ("gguf", "model.gguf"), ("peft", "adapter"), ("llama2c", "model.bin")):
        r = command("export", run, "--format", fmt, "--out", tmp_path / out)
        if fmt == "peft" and not lora or fmt == "llama2c":    # no adapter to write; run.c has no byte-level BPE
            assert r.returncode != 0 and r.stderr.count("\n") == 1 and "checkpoint" not in r.stderr.lower(), r.stderr
            assert r.stderr.startswith("error:") and ("LoRA" in r.stderr or "tokenizer" in r.stderr), r.stderr
        else:
            ok(r)
    ok(command("train", "--resume", "--run-dir", run))
    a, b = (load_checkpoint(p / "checkpoints" / "latest.ckpt") for p in (straight, run))
    assert a.state["step"] == b.state["step"] == 6
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params), "the resumed run differs"
