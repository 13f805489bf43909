"""The built-in story corpus: determinism everywhere, readability, and the cached token stream."""

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.data import corpus
from anectypes.data.corpus import BOYS, GIRLS, builtin_dataset, default_cache_dir, generate_stories
from anectypes.data.tokenizer import BOS

REPO = Path(__file__).resolve().parent.parent
HASH_CODE = ("import hashlib; from anectypes.data.corpus import generate_stories;"
             "print(hashlib.sha256('\\x00'.join(generate_stories(300)).encode()).hexdigest())")


# Pinned so that any change to the generated text is noticed: when it is deliberate, bump
# corpus.BUILTIN_VERSION (it names the cache) and update this value.
STORIES_300_SHA256 = "3685b004c75f5bce5969f6b437edc0b98e1803bc87ed3e4e1c3afa8749fde3a8"


def story_hash(n=300):
    return hashlib.sha256("\x00".join(generate_stories(n)).encode()).hexdigest()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache") / "builtin"
    tok, tokens = builtin_dataset(cache)
    return cache, tok, tokens


def test_same_stories_in_process_and_under_other_hash_seeds():
    here = story_hash()
    assert here == story_hash() == STORIES_300_SHA256
    for seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        out = subprocess.run([sys.executable, "-c", HASH_CODE], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here


def test_prefix_is_stable():
    # generating more stories must not change the earlier ones (one stream, drawn in order)
    assert generate_stories(300)[:50] == generate_stories(50)


def test_stories_are_readable_and_sized():
    stories = generate_stories(500)
    words = [w for s in stories for w in s.split()]
    wordlike = re.compile(r"\"?[A-Za-z]+('[a-z]+)?[.,!?]?\"?")
    assert sum(bool(wordlike.fullmatch(w)) for w in words) / len(words) > 0.95
    lengths = [len(s.split()) for s in stories]
    assert min(lengths) >= 60 and max(lengths) <= 200 and np.std(lengths) > 15
    assert len(set(stories)) == len(stories)
    assert all(s[0].isupper() and s[-1] in '.!"' for s in stories)


def test_pronouns_agree():
    # phrases whose pronouns all refer to one character must agree in gender
    mismatched = re.compile(r"\b(?:[Ss]he (?:loved to play with|played with|told|kept the [a-z ]+ next to) his"
                            r"|[Hh]e (?:loved to play with|played with|told|kept the [a-z ]+ next to) her"
                            r"|[Ss]he had an? [a-z ]+ that he|[Hh]e had an? [a-z ]+ that she)\b")
    stories = generate_stories(500)
    assert not [m.group(0) for s in stories for m in mismatched.finditer(s)]
    # and the hero's pronoun follows the hero's name list
    for story in stories:
        m = re.search(r"^(\w+) was a|(?:named|called) (\w+)", story)  # the opening names the hero first
        name = m.group(1) or m.group(2)
        assert name in GIRLS or name in BOYS
        his = "her" if name in GIRLS else "his"
        for took in re.findall(rf"\b{name} (?:took|hugged) (\w+)", story):
            assert took == his, story


def test_full_corpus_size():
    size = sum(len(s.encode("utf-8")) for s in generate_stories())
    assert 1_500_000 <= size <= 3_000_000


def test_dataset_tokens_decode_to_the_stories(dataset):
    _, tok, tokens = dataset
    assert tokens.dtype == np.uint16 and int(tokens.max()) < tok.vocab_size == corpus.VOCAB_SIZE
    starts = np.flatnonzero(tokens == BOS)
    assert starts[0] == 0 and len(starts) == corpus.N_STORIES  # one BOS per story, nothing else is BOS
    stories = generate_stories(40)
    for i in range(0, 40, 7):
        assert tok.decode(tokens[starts[i]:starts[i + 1]]) == stories[i]
        assert tok.decode(tok.encode(stories[i])) == stories[i]


def test_warm_cache_returns_identical_data(dataset):
    cache, tok, tokens = dataset
    files = sorted(p.name for p in cache.iterdir())
    assert files == ["tokenizer.bin", "tokens.bin"]
    tok2, tokens2 = builtin_dataset(cache)
    assert tok2.to_bytes() == tok.to_bytes() == (cache / "tokenizer.bin").read_bytes()
    np.testing.assert_array_equal(tokens2, tokens)


def test_damaged_cache_is_rebuilt(dataset, tmp_path):
    cache, tok, tokens = dataset
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.bin").write_bytes((cache / "tokenizer.bin").read_bytes()[:100])
    (broken / "tokens.bin").write_bytes(b"\x01")
    tok2, tokens2 = builtin_dataset(broken)
    assert tok2.to_bytes() == tok.to_bytes()
    np.testing.assert_array_equal(tokens2, tokens)


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / "anectypes" / f"builtin-{corpus.BUILTIN_VERSION}")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "anectypes" / f"builtin-{corpus.BUILTIN_VERSION}")
