"""The llama2.c tokenizer: file format, encode/decode against hand-computed and naive references, BPE training."""

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from anectypes.data.corpus import generate_stories
from anectypes.errors import DataError
from anectypes.data.tokenizer import BOS, EOS, Tokenizer, train_bpe

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]  # ids 0..258 by convention


def tiny_tokenizer():
    """Ids 259.. : ' ' a b c, then merges 'ab' (-1), 'bc' (-0.5), ' a' (-2), ' ab' (-3)."""
    pieces = SPECIALS + [" ", "a", "b", "c", "ab", "bc", " a", " ab"]
    scores = [0.0] * 263 + [-1.0, -0.5, -2.0, -3.0]
    return Tokenizer(pieces, scores)


def reference_encode(tok, text):
    """llama2.c's encode written the slow, obvious way: whole string, rescan all pairs each merge."""
    lookup = {}
    for i, p in enumerate(tok.pieces):
        lookup.setdefault(p, i)
    ids = []
    for ch in (" " + text if text else ""):
        b = ch.encode("utf-8")
        ids += [lookup[b]] if b in lookup else [x + 3 for x in b]
    while True:
        best, best_i = None, -1
        for i in range(len(ids) - 1):
            if ids[i] < 259 or ids[i + 1] < 259:
                continue  # byte-fallback tokens have no text to concatenate
            j = lookup.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if j is not None and (best is None or tok.scores[j] > tok.scores[best]):
                best, best_i = j, i
        if best is None:
            return [BOS] + ids
        ids[best_i:best_i + 2] = [best]


@pytest.fixture(scope="module")
def stories():
    return generate_stories(200)


@pytest.fixture(scope="module")
def story_tok(stories):
    return train_bpe(stories, 700)


# ---- file format ---------------------------------------------------------------------------------


def test_file_layout_matches_hand_packed_bytes(tmp_path):
    tok = tiny_tokenizer()
    path = tmp_path / "tok.bin"
    tok.save(path)
    expected = struct.pack("<i", 6)  # longest pieces: the byte tokens, '<0x00>' etc.
    for p, s in zip(tok.pieces, tok.scores):
        expected += struct.pack("<f", s) + struct.pack("<i", len(p)) + p
    assert path.read_bytes() == expected


def test_write_read_round_trip_is_byte_identical(tmp_path, story_tok):
    path = tmp_path / "tok.bin"
    story_tok.save(path)
    again = Tokenizer.load(path)
    assert again.pieces == story_tok.pieces and again.scores == story_tok.scores
    again.save(tmp_path / "tok2.bin")
    assert (tmp_path / "tok2.bin").read_bytes() == path.read_bytes()


def test_foreign_max_token_length_is_kept(tmp_path):
    data = bytearray(tiny_tokenizer().to_bytes())
    data[0:4] = struct.pack("<i", 64)  # llama2.c files may declare more than the longest piece
    path = tmp_path / "tok.bin"
    path.write_bytes(bytes(data))
    tok = Tokenizer.load(path)
    assert tok.max_token_length == 64 and tok.to_bytes() == bytes(data)


# layout: 4-byte header; '<unk>' entry at 4..17 (8 + 5 bytes); '<s>' entry from 17
@pytest.mark.parametrize("cut, offset", [(2, 0), (4 + 8 + 3, 12), (4 + 8 + 5 + 6, 17)])
def test_truncated_file_names_file_and_offset(tmp_path, cut, offset):
    path = tmp_path / "cut.bin"
    path.write_bytes(tiny_tokenizer().to_bytes()[:cut])
    with pytest.raises(DataError, match=rf"cut\.bin.*offset {offset}\b"):
        Tokenizer.load(path)


def test_corrupt_files(tmp_path):
    good = tiny_tokenizer().to_bytes()
    cases = {
        "empty.bin": (b"", "empty"),
        "neglen.bin": (good[:8] + struct.pack("<i", -7) + good[12:], r"offset 4 .*length -7"),
        "huge.bin": (good[:8] + struct.pack("<i", 1 << 30) + good[12:], r"offset 4 .*length 1073741824"),
        "negmax.bin": (struct.pack("<i", -1) + good[4:], r"max_token_length -1 at byte offset 0"),
        "nobytes.bin": (good[:4 + 13 + 11 + 12], "3 pieces.*llama2.c layout"),  # only <unk> <s> </s>
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=re.escape(name) + ".*" + message):
            Tokenizer.load(tmp_path / name)
    with pytest.raises(DataError, match="missing.bin"):
        Tokenizer.load(tmp_path / "missing.bin")


# ---- encode / decode -----------------------------------------------------------------------------


def test_encode_tiny_vocab_by_hand():
    tok = tiny_tokenizer()
    # " abc" -> [' ','a','b','c']; pairs ' a'(-2) ab(-1) bc(-0.5): bc wins -> [' ','a','bc'];
    # then only ' a'(-2) is a piece ('abc' is not) -> [' a','bc']; ' abc' is not a piece: stop.
    assert tok.encode("abc") == [BOS, 265, 264]
    # " ab" -> ab(-1) beats ' a'(-2) -> [' ','ab'] -> ' ab'(-3) -> [' ab']
    assert tok.encode("ab", eos=True) == [BOS, 266, EOS]
    # " cab" -> [' ','c','a','b']: only ab -> [' ','c','ab']; ' c', 'cab' are not pieces
    assert tok.encode("cab", bos=False) == [259, 262, 263]
    # 'é' is not a piece: its UTF-8 bytes C3 A9 become byte tokens 0xC3+3, 0xA9+3
    assert tok.encode("aé") == [BOS, 265, 0xC3 + 3, 0xA9 + 3]
    assert tok.encode("") == [BOS] and tok.encode("", bos=False) == []


def test_decode_conventions():
    tok = tiny_tokenizer()
    assert tok.decode([BOS, 265, 264]) == "abc"  # the dummy-prefix space after BOS is dropped
    assert tok.decode([265, 264]) == " abc"  # ... and only after BOS
    assert tok.decode([BOS, 259 + 1, 0xC3 + 3, 0xA9 + 3, EOS]) == "aé"  # byte tokens join into UTF-8
    assert tok.decode([BOS, 0xFF + 3, 260]) == "\ufffda"  # invalid UTF-8 is replaced, not raised
    with pytest.raises(DataError, match="outside the vocabulary"):
        tok.decode([10_000])


@pytest.mark.parametrize("text", ["Once upon a time, Tom saw a big dog.", "Café crème, naïve résumé",
                                  "emoji 🙂🐶 and ✨!", "", "a", "  two  spaces\tand\nnew\n\nlines  ",
                                  "literal <0x41> and <s> stay text"])
def test_round_trip(story_tok, text):
    ids = story_tok.encode(text)
    assert story_tok.decode(ids) == text
    assert ids == reference_encode(story_tok, text)  # chunked + cached encode == whole-string llama2.c


def test_unknown_codepoints_use_byte_tokens(story_tok):
    ids = story_tok.encode("🙂")
    assert ids[-4:] == [b + 3 for b in "🙂".encode("utf-8")]


def test_matches_whole_string_reference_on_stories(stories, story_tok):
    for story in stories[:4]:
        assert story_tok.encode(story) == reference_encode(story_tok, story)
        assert story_tok.decode(story_tok.encode(story)) == story


def test_vocab_with_cross_word_pieces_encodes_whole_string():
    # '. T' spans a space, so chunked encoding would be wrong; the tokenizer must notice
    pieces = SPECIALS + [" ", ".", "T", "a", ". ", ". T", " a"]
    tok = Tokenizer(pieces, [0.0] * 263 + [-1.0, -2.0, -3.0])
    text = "a. Ta. a"
    assert tok.encode(text) == reference_encode(tok, text)
    assert 264 in tok.encode(text)  # '. T' was used
    assert tok.decode(tok.encode(text)) == text


# ---- training ------------------------------------------------------------------------------------


def reference_train(docs, vocab_size):
    """Textbook BPE: recount every pair of every chunk before each merge."""
    counts = {}
    for d in docs:
        for w in re.findall(r" ?\S+|\s", " " + d):
            counts[w] = counts.get(w, 0) + 1
    pieces = [s.encode() for s in SPECIALS] + [c.encode() for c in sorted({c for w in counts for c in w})]
    ids = {p: i for i, p in enumerate(pieces)}
    words = [([ids[c.encode()] for c in w], f) for w, f in counts.items()]
    while len(pieces) < vocab_size:
        pairs = {}
        for sym, f in words:
            for p in zip(sym, sym[1:]):
                pairs[p] = pairs.get(p, 0) + f
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, then smallest ids
        new = ids.setdefault(pieces[a] + pieces[b], len(pieces))
        if new == len(pieces):
            pieces.append(pieces[a] + pieces[b])
        for sym, _ in words:
            i = 0
            while i < len(sym) - 1:
                if sym[i] == a and sym[i + 1] == b:
                    sym[i:i + 2] = [new]
                i += 1
    return pieces


def test_first_merges_are_most_frequent_pairs():
    tok = train_bpe("the the the cat", 259 + 6 + 3)  # room for exactly three merges
    # chunks: ' the' x3, ' cat'. Chars ' ',a,c,e,h,t -> ids 259..264.
    # pairs: (' ',t)=3, (t,h)=3, (h,e)=3, (' ',c)=1, (c,a)=1, (a,t)=1
    # tie at 3 goes to smallest ids: (' ',t) = (259, 264) < (h,e) = (263, 262) < (t,h) = (264, 263)
    # then ' t'+h and h+e tie at 3: (h,e) has the smaller left id -> 'he'; then ' t'+'he' -> ' the'
    assert [p.decode() for p in tok.pieces[259:265]] == [" ", "a", "c", "e", "h", "t"]
    assert [p.decode() for p in tok.pieces[265:268]] == [" t", "he", " the"]
    assert tok.scores[265:268] == [0.0, -1.0, -2.0]
    assert tok.encode("the cat the", bos=False) == [267, 259, 261, 260, 264, 267]


def test_training_matches_textbook_bpe(stories):
    docs = stories[:40]
    assert train_bpe(docs, 600).pieces == reference_train(docs, 600)
    odd = ["aaaa abab aaaaaa baba ab ab aaa"] * 3 + ["abcabc bcab cabc"]  # repeats and overlapping pairs
    for size in range(263, 290):
        assert train_bpe(odd, size).pieces == reference_train(odd, size)


def test_training_is_deterministic_across_hash_seeds(tmp_path, stories):
    first = train_bpe(stories[:100], 600).to_bytes()
    assert train_bpe(stories[:100], 600).to_bytes() == first
    code = ("import sys; from anectypes.data.corpus import generate_stories; from anectypes.data.tokenizer import train_bpe;"
            "sys.stdout.buffer.write(train_bpe(generate_stories(200)[:100], 600).to_bytes())")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    assert out == first


def test_merges_never_produce_control_or_byte_tokens():
    # after a newline '<s>' and '<0x41>' are whole chunks, so plain BPE would end by merging them
    # into strings equal to the BOS and byte-0x41 pieces; those merges must be skipped
    tok = train_bpe(["x\n<s>\n<0x41>"] * 5, 400)
    assert all(p not in tok.pieces[259:] for p in tok.pieces[:259])
    assert {b"<s", b"<0x", b"41>"} <= set(tok.pieces)  # training got as far as the last merge
    text = "x\n<s>\n<0x41>"
    ids = tok.encode(text)
    assert all(i >= 259 for i in ids[1:]) and tok.decode(ids) == text


def test_vocab_size_bounds():
    with pytest.raises(ValueError):
        train_bpe("abc", 259)
    assert len(train_bpe("ab", 1000)) == 259 + 3 + 2  # runs out of pairs: ' ','a','b',' a',' ab'
