"""tools/tokenize_folder.py run as a user would: a subprocess on a temp folder."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.data.tokens import load_tokens
from anectypes.data.tokenizer import BOS, train_bpe

TOOL = Path(__file__).resolve().parent.parent / "tools" / "tokenize_folder.py"
TEXTS = {  # relative path -> text; sorted order is a.txt, b/c.txt, b/d.txt
    "b/d.txt": "The end.\n",
    "a.txt": "Once upon a time, a cat sat on a mat.\nThe cat was happy.",
    "b/c.txt": "Ünïcödé and emoji 🐱 fall back to bytes.",
    "skip.md": "not a text file",
}


def run(*args, cwd=None):
    # run from another folder: the tool must find the checkout's anectypes by itself
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def setup(tmp_path):
    folder = tmp_path / "docs"
    for rel, text in TEXTS.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text, encoding="utf-8")
    tok = train_bpe(["Once upon a time, the cat sat on the mat. The end."] * 20, 300)
    tok.save(tmp_path / "tok.bin")
    return tmp_path, folder, tok


def test_encodes_each_file_as_a_document(setup):
    tmp_path, folder, tok = setup
    out = tmp_path / "out" / "data.bin"
    r = run("--tokenizer", tmp_path / "tok.bin", "--out", out, folder, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    tokens = load_tokens(out, vocab_size=tok.vocab_size)
    starts = list(np.flatnonzero(tokens == BOS)) + [len(tokens)]
    docs = [tok.decode(tokens[a:b]) for a, b in zip(starts, starts[1:])]
    assert docs == [TEXTS["a.txt"], TEXTS["b/c.txt"], TEXTS["b/d.txt"]]
    expected = sum((tok.encode(TEXTS[k]) for k in ["a.txt", "b/c.txt", "b/d.txt"]), [])
    np.testing.assert_array_equal(tokens, expected)
    assert len(r.stderr.strip().splitlines()) == 3 and "b/c.txt" in r.stderr  # one progress line per file
    assert f"3 files, {len(tokens)} tokens, {len(np.unique(tokens))} distinct ids" in r.stdout


def test_ext_selects_files(setup):
    tmp_path, folder, tok = setup
    r = run("--tokenizer", tmp_path / "tok.bin", "--out", tmp_path / "md.bin", "--ext", ".md", folder)
    assert r.returncode == 0, r.stderr
    assert tok.decode(load_tokens(tmp_path / "md.bin")) == TEXTS["skip.md"]


def test_errors_exit_2_with_one_line(setup):
    tmp_path, folder, tok = setup
    good = tmp_path / "tok.bin"
    (tmp_path / "bad.bin").write_bytes(good.read_bytes()[:50])
    cases = [
        (("--tokenizer", good, "--out", tmp_path / "x.bin", tmp_path / "nowhere"), "no such folder"),
        (("--tokenizer", good, "--out", tmp_path / "x.bin", "--ext", ".rst", folder), "no files ending in '.rst'"),
        (("--tokenizer", tmp_path / "bad.bin", "--out", tmp_path / "x.bin", folder), "bad.bin: truncated"),
        (("--tokenizer", tmp_path / "none.bin", "--out", tmp_path / "x.bin", folder), "none.bin: cannot read"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.bin").exists()
