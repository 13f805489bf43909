"""Token files, vocabulary listing, train/val split and the resumable batch sampler."""

import json

import numpy as np
import pytest

from anectypes.data.tokens import BatchSampler, active_vocab, load_tokens, split, write_tokens
from anectypes.errors import DataError


def test_round_trip_and_layout(tmp_path):
    path = tmp_path / "t.bin"
    ids = np.array([1, 258, 65535, 0, 7], dtype=np.int64)
    write_tokens(path, ids)
    assert path.read_bytes() == b"\x01\x00\x02\x01\xff\xff\x00\x00\x07\x00"  # uint16 little-endian, no header
    got = load_tokens(path, vocab_size=65536, seq_len=4)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, ids)
    with pytest.raises(ValueError):
        got[0] = 3  # read-only map
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]  # no temp file left behind


def test_write_rejects_ids_outside_uint16(tmp_path):
    for bad, pos in (([5, 65536], 1), ([-1, 2], 0)):
        with pytest.raises(DataError, match=f"position {pos}"):
            write_tokens(tmp_path / "t.bin", np.array(bad))
    with pytest.raises(DataError):
        write_tokens(tmp_path / "t.bin", np.array([0.5, 1.0]))
    assert not list(tmp_path.iterdir())


def test_errors_are_one_line_and_name_the_file(tmp_path):
    cases = {
        "odd.bin": (b"\x01\x00\x02", "odd length"),
        "empty.bin": (b"", "empty"),
    }
    for name, (data, what) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=f"{name}.*{what}") as e:
            load_tokens(tmp_path / name)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="missing.bin.*not found"):
        load_tokens(tmp_path / "missing.bin")


def test_id_beyond_vocab_reports_first_position(tmp_path):
    path = tmp_path / "t.bin"
    write_tokens(path, [3, 4, 999, 5, 1200, 2])
    with pytest.raises(DataError, match=r"t\.bin: token id 999 at position 2 is >= vocab_size 512"):
        load_tokens(path, vocab_size=512)
    assert len(load_tokens(path, vocab_size=1201)) == 6


def test_too_short_for_seq_len(tmp_path):
    path = tmp_path / "t.bin"
    write_tokens(path, np.arange(8))
    assert len(load_tokens(path, seq_len=7)) == 8  # exactly seq_len + 1 is enough
    with pytest.raises(DataError, match="8 tokens, fewer than seq_len\\+1 = 9"):
        load_tokens(path, seq_len=8)


def test_active_vocab_matches_unique():
    rng = np.random.default_rng(0)
    tokens = rng.choice(np.array([0, 3, 17, 17, 900, 65535]), size=5000).astype(np.uint16)
    np.testing.assert_array_equal(active_vocab(tokens), np.unique(tokens))
    np.testing.assert_array_equal(active_vocab(np.array([], dtype=np.uint16)), [])


def test_split_takes_the_tail_as_views():
    tokens = np.arange(100, dtype=np.uint16)
    train, val = split(tokens, 0.1)
    np.testing.assert_array_equal(train, np.arange(90))
    np.testing.assert_array_equal(val, np.arange(90, 100))
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    with pytest.raises(ValueError):
        split(tokens, 1.0)


def test_sampler_windows_are_shifted_and_cover_every_start():
    tokens = np.arange(20, dtype=np.uint16)
    sampler = BatchSampler(tokens, seq_len=16, seed=3)  # starts 0..3 leave seq_len+1 tokens
    starts = set()
    for _ in range(200):
        x, y = sampler.sample()
        assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == y.shape == (16,)
        np.testing.assert_array_equal(y, x + 1)
        starts.add(int(x[0]))
    assert starts == {0, 1, 2, 3}


def test_sampler_resumes_exactly():
    tokens = np.random.default_rng(1).integers(0, 1000, size=10_000).astype(np.uint16)
    uninterrupted = BatchSampler(tokens, seq_len=32, seed=42)
    first = [uninterrupted.sample() for _ in range(7)]
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # must survive a JSON checkpoint
    expected = [uninterrupted.sample() for _ in range(11)]

    resumed = BatchSampler(tokens, seq_len=32, seed=999)  # the seed is overridden by the state
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip((resumed.sample() for _ in range(11)), expected):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)
    again = BatchSampler(tokens, seq_len=32, seed=42)  # same seed, same stream
    assert all(np.array_equal(again.sample()[0], x) for x, _ in first)
    with pytest.raises(DataError, match="seq_len"):
        BatchSampler(tokens, seq_len=16).load_state_dict(state)
