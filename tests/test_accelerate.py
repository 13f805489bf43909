"""Accelerate's BLAS (anectypes/host/blas.py) on Linux, through a stand-in library with Apple's prototypes and the
real arithmetic (tests/support/accelerate_standin.c, built here with gcc): the current CBLAS preferred to the
legacy one, the thread control, and generate --threads reaching it."""

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from anectypes.data.tokenizer import CONTROL_PIECES, FIRST_PIECE, Tokenizer, byte_piece
from anectypes.formats.llama2c import write_model
from anectypes.generate import main as generate
from anectypes.host import blas
from anectypes.model.config import ModelConfig, init_params
from support.accelerate import build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build(tmp_path_factory.mktemp("accelerate"))


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """Accelerate before macOS 13.3 and 15: no $NEWLAPACK CBLAS, no BLASSetThreading."""
    return build(tmp_path_factory.mktemp("legacy"), legacy_only=True)


@pytest.fixture
def blas_from(monkeypatch):
    """blas_from(path): the BLAS this process loads is the library at `path` (ANECTYPES_BLAS) for the test."""
    def set_blas(path):
        monkeypatch.setenv("ANECTYPES_BLAS", str(path))
        blas._lib.cache_clear()
        return ctypes.CDLL(str(path))                   # the same loaded library: its counters, its thread model
    yield set_blas
    monkeypatch.undo()
    blas._lib.cache_clear()


# ------------------------------------------------------------------ Accelerate's BLAS

def test_the_current_cblas_is_preferred_to_the_legacy_one(blas_from, standin, legacy):
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((30, 20)).astype(np.float32), rng.standard_normal((30, 25)).astype(np.float32)
    x, y = rng.standard_normal(20).astype(np.float32), np.zeros(30, np.float32)
    for library, symbol in ((standin, "cblas_sgemm$NEWLAPACK"), (legacy, "cblas_sgemm")):
        lib = blas_from(library)
        assert blas.report()["sgemm"] == symbol
        np.testing.assert_allclose(blas.sgemm(a, b, trans_a=True), a.T.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
        blas.sgemv_call(a, x, y, alpha=2.0)()
        np.testing.assert_allclose(y, 2.0 * a.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)
        assert (lib.standin_legacy_calls() > 0) == (library == legacy)     # no legacy call where the current exists


def test_set_num_threads_backs_onto_blassetthreading_for_the_calling_thread(blas_from, standin, legacy):
    lib = blas_from(standin)
    lib.BLASGetThreading.restype = ctypes.c_uint
    assert blas.thread_control() == "BLASSetThreading" and blas.report()["threading"] == "BLASSetThreading"
    try:
        blas.set_num_threads(1)
        assert lib.BLASGetThreading() == 1 and blas.get_num_threads() == 1        # BLAS_THREADING_SINGLE_THREADED
        seen = []
        other = threading.Thread(target=lambda: seen.append(lib.BLASGetThreading()))
        other.start()
        other.join()
        assert seen == [0]                            # per thread (thread_api.h): another thread keeps its own
        blas.set_num_threads(3)
        assert lib.BLASGetThreading() == 0 and blas.get_num_threads() == os.cpu_count()   # MULTI: Accelerate chooses
    finally:
        blas.set_num_threads(3)
    blas_from(legacy)                                 # before macOS 15: no thread control, set does nothing
    blas.set_num_threads(1)
    assert blas.thread_control() is None and blas.get_num_threads() is None


def tiny_model(folder):
    """A llama2.c model.bin with its tokenizer.bin: the control and byte tokens and a few words."""
    cfg = ModelConfig(dim=32, hidden=64, heads=4, kv_heads=2, head_dim=8, layers=1, seq=16, vocab=300)
    write_model(folder / "model.bin", cfg, init_params(cfg, np.random.default_rng(8)), None)
    words = [f" w{i}" for i in range(cfg.vocab - FIRST_PIECE)]
    Tokenizer([*CONTROL_PIECES, *map(byte_piece, range(256)), *words], [0.0] * cfg.vocab).save(folder / "tokenizer.bin")
    return folder / "model.bin"


def test_generate_threads_reaches_accelerates_thread_control(blas_from, standin, tmp_path, capsys):
    lib = blas_from(standin)
    lib.BLASGetThreading.restype = ctypes.c_uint
    model = tiny_model(tmp_path)
    try:
        assert generate([str(model), "--threads", "1", "--steps", "6", "--temperature", "0", "--json"]) == 0
        assert lib.BLASGetThreading() == 1                   # the decoder's thread runs single-threaded
        assert "note:" not in capsys.readouterr().err
    finally:
        blas.set_num_threads(2)


def test_generate_says_when_the_blas_cannot_limit_its_threads(legacy, tmp_path):
    model = tiny_model(tmp_path)
    env = dict(os.environ, ANECTYPES_BLAS=str(legacy), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "anectypes.generate", str(model), "--threads", "1", "--steps", "6",
                        "--temperature", "0", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"note: the BLAS ({legacy}) has no thread control" in r.stderr and "--threads 1 does not limit" in r.stderr


def test_the_package_has_no_compiled_code():
    compiled = {".c", ".h", ".so", ".dylib", ".o", ".pyd", ".dll", ".a"}
    found = [p for p in (ROOT / "anectypes").rglob("*") if p.suffix in compiled and "web" not in p.parts]
    assert not found
