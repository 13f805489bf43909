"""Accelerate's paths (anectypes/host/accelerate.py, and Accelerate's BLAS in host/blas.py) on Linux, through a
stand-in library with Apple's prototypes and the real arithmetic (tests/support/accelerate_standin.c, built here
with gcc): each binding's argument order, types and struct layout proved by its numbers against numpy and float64
(bit for bit where Apple documents exact rounding), the switch to numpy, the BLAS's current symbols and thread
control, what bench reports, the other modules' tests run through the stand-in, and mutated bindings caught."""

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from jsonschema import validate

from anectypes.device import open_device
from anectypes.device.protocol import Surface
from anectypes.errors import AnectypesError
from anectypes.data.tokenizer import CONTROL_PIECES, FIRST_PIECE, Tokenizer, byte_piece
from anectypes.formats.llama2c import write_model
from anectypes.generate import command, main as generate
from anectypes.host import accelerate, blas, fp16
from anectypes.model.config import ModelConfig, init_params
from anectypes.model.loss import cross_entropy
from anectypes.model.transformer import Transformer
from anectypes.train.optim import AdamW, global_norm
from support.accelerate import build

ROOT = Path(__file__).resolve().parents[1]
ALL_PATHS = dict(fp16="vImage", exp="vForce", transpose="vDSP", adamw="vDSP", norm="vDSP")


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build(tmp_path_factory.mktemp("accelerate"))


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """Accelerate before macOS 13.3 and 15: no $NEWLAPACK CBLAS, no BLASSetThreading."""
    return build(tmp_path_factory.mktemp("legacy"), legacy_only=True)


def reload():
    accelerate._library.cache_clear()
    accelerate.chosen.cache_clear()
    accelerate._used.clear()


@pytest.fixture
def use(monkeypatch):
    """use(value): ANECTYPES_ACCELERATE is `value` (None: unset) for the test, the library loaded afresh."""
    def set_switch(value):
        if value is None:
            monkeypatch.delenv(accelerate.SWITCH, raising=False)
        else:
            monkeypatch.setenv(accelerate.SWITCH, str(value))
        reload()
    yield set_switch
    monkeypatch.undo()
    reload()


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


def counted(monkeypatch, name):
    """The calls into Accelerate's `name` from now on, as a list that grows."""
    calls, functions = [], accelerate._library()[1]
    real = functions[name]
    monkeypatch.setitem(functions, name, lambda *args: (calls.append(args), real(*args))[1])
    return calls


def bits(a):
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def fp32_samples(rng, n=1 << 16):
    """Float32 values of every fp16 kind: ties at each exponent, fp16 subnormals, overflow from 65520, ±inf, ±0."""
    exponent = rng.integers(97, 145, n, dtype=np.uint32)          # fp32 exponents from fp16's subnormals to inf
    mantissa = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    mantissa = np.where(rng.random(n) < 0.3, (mantissa & ~np.uint32(0x1FFF)) | 0x1000, mantissa)   # ties
    x = ((rng.integers(0, 2, n, dtype=np.uint32) << 31) | (exponent << 23) | mantissa).view(np.float32)
    return np.concatenate([x, np.float32([0, -0.0, 65504, 65519.996, 65520, np.inf, -np.inf, 2 ** -24, 2 ** -25])])


# ------------------------------------------------------------------ which path each use takes

def test_each_use_takes_accelerate_where_its_symbols_exist_and_the_switch_forces_numpy(use, standin, tmp_path):
    use(standin)
    r = accelerate.report()
    assert r["library"] == str(standin) and r["error"] is None and all(r["symbols"].values())
    assert r["paths"] == ALL_PATHS and all(accelerate.chosen(u) for u in ALL_PATHS)
    use(0)                                                   # the switch: numpy everywhere
    r = accelerate.report()
    assert r["library"] is None and r["paths"] == dict.fromkeys(ALL_PATHS, "numpy") and not any(r["symbols"].values())
    if sys.platform != "darwin":                             # off macOS, no library unless one is named
        use(None)
        assert accelerate.library() is None and accelerate.report()["paths"] == dict.fromkeys(ALL_PATHS, "numpy")
    partial = build(tmp_path, source=standin_without(tmp_path, "vvexp"))   # one symbol missing: only its use
    use(partial)
    assert accelerate.report()["paths"] == dict(ALL_PATHS, exp="numpy") and not accelerate.report()["symbols"]["vvexp"]
    x = np.linspace(-3, 3, 7)
    assert np.array_equal(accelerate.exp(x, np.empty_like(x)), np.exp(x)) and accelerate.used() == []


def standin_without(directory, symbol):
    """The stand-in's source with `symbol` renamed away."""
    path = Path(directory) / "partial.c"
    path.write_text(f"#define {symbol} hidden_{symbol}\n" + Path(build.__globals__["SOURCE"]).read_text())
    return path


def test_a_library_that_does_not_load_is_one_error_line(use, tmp_path):
    use(tmp_path / "no-such-accelerate.so")
    with pytest.raises(AnectypesError, match="cannot load Accelerate at .*no-such-accelerate.so \\(set by "
                                             "ANECTYPES_ACCELERATE; ANECTYPES_ACCELERATE=0 uses numpy\\)"):
        accelerate.library()
    assert "cannot load Accelerate" in accelerate.report()["error"]          # the doctor still gets its report
    env = dict(os.environ, ANECTYPES_ACCELERATE=str(tmp_path / "no-such-accelerate.so"), PYTHONPATH=str(ROOT))
    for argv in (["generate", str(tmp_path / "x")], ["train", "--run-dir", str(tmp_path / "run"), "--steps", "1"]):
        r = subprocess.run([sys.executable, "-m", f"anectypes.{argv[0]}", *argv[1:]], env=env, capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: cannot load Accelerate"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []                 # no run folder made before the check


# ------------------------------------------------------------------ fp16: vImage

def test_vimage_fills_a_strided_block_of_a_surface_in_one_call_bit_for_bit(use, standin, monkeypatch):
    use(standin)
    rng = np.random.default_rng(0)
    surface = np.full((1, 300, 1, 260), np.float16(-7), np.float16)           # [1, C, 1, S], a block of width 240
    block = surface[0, :, 0, 11:251]
    x = rng.choice(fp32_samples(rng), block.shape).astype(np.float32)
    calls = counted(monkeypatch, "vImageConvert_PlanarFtoPlanar16F")
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert fp16.to_fp16(x, block) is block and len(calls) == 1                # one call: rowBytes strides the rows
    assert np.array_equal(bits(block), bits(want))
    assert (surface[0, :, 0, :11] == -7).all() and (surface[0, :, 0, 251:] == -7).all()   # nothing beside it
    back = np.empty(block.shape, np.float32)
    calls = counted(monkeypatch, "vImageConvert_Planar16FtoPlanarF")
    fp16.fp16_to_fp32(block, back)                                            # and back, from the strided block
    assert len(calls) == 1 and np.array_equal(bits(back), bits(want.astype(np.float32)))
    assert accelerate.used() == ["fp16"]


@pytest.mark.parametrize("ftz", [True, False])
def test_rounding_in_place_through_vimage_is_the_numpy_path_bit_for_bit(use, standin, ftz):
    rng = np.random.default_rng(1)
    x = np.concatenate([fp32_samples(rng, 1 << 19), np.float32([2 ** -14 - 2 ** -25, 2 ** -14 - 2 ** -24])])
    x = np.concatenate([x, -x])
    use(0)
    want = x.copy()
    fp16.round_to_fp16(want, ftz)                       # numpy's path: bit operations, ftz's flush
    use(standin)
    got = x.copy()
    fp16.round_to_fp16(got, ftz)
    assert np.array_equal(bits(got), bits(want)) and accelerate.used() == ["fp16"]


def test_vimage_quiets_signalling_nans_where_numpys_cast_keeps_them(use, standin):
    use(standin)
    nans = np.uint32([0x7F800001, 0xFF800001, 0x7FA00000, 0x7FC00001, 0xFFFFE000]).view(np.float32)
    half = fp16.to_fp16(nans)
    # sign, then quiet, then the payload's top ten bits (Conversion.h: "all signaling NaNs are quieted")
    assert list(bits(half)) == [0x7E00, 0xFE00, 0x7F00, 0x7E00, 0xFFFF]
    numpy = np.uint16([0x7C01, 0xFC01, 0x7D00, 0x7E00, 0xFFFF])          # numpy's: signalling NaNs stay so
    assert list(bits(nans.astype(np.float16))) in (list(numpy), list(bits(half)))   # (x86's F16C quiets too)
    back = np.empty(5, np.float32)
    fp16.fp16_to_fp32(np.uint16([0x7C01, 0xFD00, 0x7E00, 0x8001, 0x3C00]).view(np.float16), back)
    assert list(bits(back)) == [0x7FC02000, 0xFFE00000, 0x7FC00000, 0x80000000 | 0x33800000, 0x3F800000]


def test_surface_writes_to_fp16_memory_convert_through_vimage(use, standin, monkeypatch):
    use(standin)
    s = Surface(np.zeros((1, 64, 1, 48), np.float16))                   # the ANE's kind: fp16 memory, no convert
    value = np.random.default_rng(2).standard_normal((48, 40)).astype(np.float32) * 300
    calls = counted(monkeypatch, "vImageConvert_PlanarFtoPlanar16F")
    s.write(value, (0, slice(8, 56), 0, slice(4, 44)))                   # a [C, width] block of a packed input
    assert len(calls) == 1 and np.array_equal(bits(s.array[0, 8:56, 0, 4:44]), bits(value.astype(np.float16)))
    s.write(value.T, (0, slice(0, 40), 0, slice(0, 48)))                 # a transposed view: through a copy
    assert np.array_equal(bits(s.array[0, :40, 0, :48]), bits(value.T.astype(np.float16)))
    assert (s.array[0, 56:] == 0).all() and np.array_equal(s.stored(value), value.astype(np.float16))


# ------------------------------------------------------------------ exp: vForce

EXP_ULPS = 2.0 ** -21      # vvexpf: within 4 float32 ulps of e**x (relative), where e**x is a normal float32
EXP64 = 2.0 ** -50         # vvexp: within 4 float64 ulps of e**x, computed in long double


def test_vvexpf_is_within_four_ulps_of_float64(use, standin, monkeypatch):
    use(standin)
    x = np.concatenate([np.linspace(-87.3, 88.7, 200001, dtype=np.float32),
                        np.random.default_rng(3).uniform(-87.3, 88.7, 1 << 16).astype(np.float32)])
    y = accelerate.exp(x, np.empty_like(x))
    ref = np.exp(x.astype(np.float64))
    assert np.all(np.abs(y - ref) <= EXP_ULPS * ref)
    edges = np.float32([np.inf, -np.inf, np.nan, 89, -104, -100, 0])
    e = accelerate.exp(edges, edges.copy())
    assert e[0] == np.inf and e[1] == 0 and np.isnan(e[2]) and e[3] == np.inf and e[4] == 0 and e[6] == 1
    assert 0 <= e[5] <= np.exp(-100.0) * (1 + EXP_ULPS) + 2.0 ** -149      # subnormal: vForce may flush it
    monkeypatch.setattr(accelerate, "INT_MAX", 7)                          # counts past a C int: in pieces
    calls = counted(monkeypatch, "vvexpf")
    z = x[:40].copy()
    assert accelerate.exp(z, z) is z and len(calls) == 6                   # in place, 40 = 5·7 + 5
    assert np.array_equal(z, accelerate.exp(x[:40], np.empty(40, np.float32)))
    assert accelerate.used() == ["exp"]


def test_vvexp_is_within_four_ulps_of_long_double(use, standin):
    use(standin)
    x = np.concatenate([np.linspace(-700, 700, 100001), [-np.inf, 0.0]])
    y = accelerate.exp(x, np.empty_like(x))
    ref = np.exp(x.astype(np.longdouble))
    assert np.finfo(np.longdouble).eps < 2.0 ** -60, "long double is not wider than double here"
    assert np.all(np.abs(y - ref) <= EXP64 * ref) and y[-2] == 0 and y[-1] == 1


def test_the_loss_the_decoder_and_the_sampler_exp_through_vforce(use, standin, monkeypatch, tmp_path, capsys):
    use(standin)
    single, double = counted(monkeypatch, "vvexpf"), counted(monkeypatch, "vvexp")
    logits = np.random.default_rng(10).standard_normal((300, 16)).astype(np.float32)
    loss, _ = cross_entropy(logits, np.arange(16))
    assert len(single) == 1 and len(double) == 0
    shifted = logits - logits.max(axis=0)
    assert loss == pytest.approx(np.mean(np.log(np.exp(shifted.astype(np.float64)).sum(0)) - shifted[np.arange(16), np.arange(16)]))
    assert generate([str(tiny_model(tmp_path)), "--steps", "6", "--temperature", "0.8", "--seed", "1", "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)["n_generated"]
    assert drawn == 6 and len(double) == drawn and len(single) > 1 + drawn   # the sampler's draws; the decoder's


def test_exp_takes_numpy_for_what_vforce_cannot_read(use, standin):
    use(standin)
    x = np.linspace(-5, 5, 60, dtype=np.float32).reshape(6, 10)[:, ::2]    # not contiguous
    assert np.array_equal(accelerate.exp(x, np.empty_like(x)), np.exp(x)) and accelerate.used() == []
    h = np.linspace(-2, 2, 9, dtype=np.float16)
    assert np.array_equal(accelerate.exp(h, np.empty_like(h)), np.exp(h))


# ------------------------------------------------------------------ the staging transposes: vDSP_mtrans

def test_vdsp_mtrans_transposes_into_dense_and_strided_outputs(use, standin, monkeypatch):
    use(standin)
    a = np.random.default_rng(4).standard_normal((37, 130)).astype(np.float32)   # not square: M, N told apart
    calls = counted(monkeypatch, "vDSP_mtrans")
    assert np.array_equal(accelerate.transpose(a, np.empty((130, 37), np.float32)), a.T)
    wide = np.full((130, 50), np.nan, np.float32)
    accelerate.transpose(a, wide[:, 5:42])                                        # a block of a surface's rows
    assert np.array_equal(wide[:, 5:42], a.T) and np.isnan(wide[:, :5]).all() and np.isnan(wide[:, 42:]).all()
    assert len(calls) == 2
    accelerate.transpose(a.T.copy().T, np.empty((130, 37), np.float32))          # column-major a: blas.transpose
    assert len(calls) == 2 and accelerate.used() == ["transpose"]


def test_the_ane_staging_converts_and_transposes_through_accelerate(use, standin, fake_ane, monkeypatch):
    """fp16 memory (the ANE's, here the fake's): each band is transposed in float32 by vDSP_mtrans, then converted
    into its place by one vImage call; every surface holds the numpy path's bits."""
    cfg = ModelConfig(dim=32, hidden=48, heads=4, kv_heads=2, head_dim=8, layers=1, seq=16, vocab=64).validate()
    params = init_params(cfg, np.random.default_rng(9))
    held = []
    for switch in (0, standin):
        use(switch)
        with Transformer(cfg, open_device("ane"), {k: v.copy() for k, v in params.items()}, np.arange(cfg.vocab)) as m:
            if switch != 0:
                convert, mtrans = counted(monkeypatch, "vImageConvert_PlanarFtoPlanar16F"), counted(monkeypatch, "vDSP_mtrans")
                m.stage("layers.0.wq")                 # 32 rows, one band, transposed into sdpaFwd's input
                assert (len(convert), len(mtrans)) == (1, 1)
            held.append([bits(s.read()) for s in m.surfaces()])
    assert all(np.array_equal(a, b) for a, b in zip(*held)) and {"fp16", "transpose"} <= set(accelerate.used())


# ------------------------------------------------------------------ AdamW and the gradient norm: vDSP

def adamw_run(n, zero):
    rng = np.random.default_rng(5)
    params = {"layers.0.wq": rng.standard_normal((n // 64, 64)).astype(np.float32),
              "layers.0.rms_att": rng.standard_normal(n // 3).astype(np.float32)}
    opt = AdamW(params)
    for step in range(3):
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) * 10.0 ** (step - 2) for k, v in params.items()}
        opt.step(params, grads, lr=3e-3 * (step + 1), scale=0.25, zero_grads=zero)
    return params, opt.m, opt.v, grads


@pytest.mark.parametrize("zero", [True, False])
def test_adamw_through_vdsp_is_the_numpy_update_bit_for_bit(use, standin, zero):
    """The stand-in neither fuses multiply-adds nor rounds a square root otherwise: the nine vDSP passes give
    numpy's fourteen's bits (with the decay, on the matrix, and without, on the norm weight)."""
    n = 2 * 65536 + 4096                                 # several pieces, and a short last one
    use(0)
    want = adamw_run(n, zero)
    use(standin)
    got = adamw_run(n, zero)
    for w, g in zip(want, got):
        for k in w:
            assert np.array_equal(bits(w[k]), bits(g[k])), k
    assert accelerate.used() == ["adamw"] and (not zero or not got[3]["layers.0.wq"].any())


def test_the_gradient_norm_sums_squares_in_one_pass(use, standin):
    use(standin)
    rng = np.random.default_rng(6)
    grads = {"a": rng.standard_normal((700, 300)).astype(np.float32) * 50, "b": rng.standard_normal(999).astype(np.float32)}
    ref = np.sqrt(sum(np.sum((g.astype(np.float64) * 0.01) ** 2) for g in grads.values()))
    assert global_norm(grads, 0.01) == pytest.approx(ref, rel=1e-5) and accelerate.used() == ["norm"]
    huge = {"a": np.full(5000, 1e25, np.float32)}        # squares overflow float32: numpy's pass, scaled first
    assert global_norm(huge, 1e-20) == pytest.approx(np.sqrt(5000) * 1e5, rel=1e-6)
    assert np.isinf(global_norm({"a": np.float32([1, np.inf])}))


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


def test_generate_threads_reaches_accelerates_thread_control(blas_from, standin, tmp_path, capsys, monkeypatch):
    lib = blas_from(standin)
    lib.BLASGetThreading.restype = ctypes.c_uint
    model, seen = tiny_model(tmp_path), []
    run_one = command.run_one
    monkeypatch.setattr(command, "run_one", lambda *a: (seen.append(lib.BLASGetThreading()), run_one(*a)))
    try:
        before = lib.BLASGetThreading()
        assert generate([str(model), "--threads", "1", "--steps", "6", "--temperature", "0", "--json"]) == 0
        assert seen == [1]                        # the decoder's thread ran single-threaded
        assert lib.BLASGetThreading() == before   # and the command left the setting as it found it
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


# ------------------------------------------------------------------ what bench and the doctor are told

def test_bench_reports_the_paths_each_use_took_and_which_ran(standin, tmp_path):
    env = dict(os.environ, ANECTYPES_ACCELERATE=str(standin), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "anectypes.bench", "train", "--model", "tiny", "--steps", "1",
                        "--warmup", "0", "--precision", "fp16", "--json"], env=env, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validate(doc, json.loads((ROOT / "tools" / "bench_schema.json").read_text()))
    # a micro-step and an update in the benchmark's own process take every path
    assert doc["system"]["accelerate"] == dict(library=str(standin), error=None, paths=ALL_PATHS, used=sorted(ALL_PATHS))
    assert {k: doc["system"]["blas"][k] for k in ("sgemm", "threading")} == \
        {k: blas.report()[k] for k in ("sgemm", "threading")}


def test_the_doctor_names_each_path_and_times_it_against_numpy(standin, tmp_path):
    env = dict(os.environ, ANECTYPES_ACCELERATE=str(standin), PYTHONPATH=str(ROOT), TEMP=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "anectypes.doctor", "--json", "--reps", "2"], env=env,
                       capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    doc = json.loads(r.stdout)
    validate(doc, json.loads((ROOT / "tools" / "doctor_schema.json").read_text()))
    row = {row["probe"]: row for row in doc["rows"]}["accelerate"]
    assert row["status"] == "OK" and row["summary"] == ", ".join(f"{u}: {p}" for u, p in ALL_PATHS.items())
    facts = row["facts"]
    assert facts["library"] == str(standin) and facts["paths"] == ALL_PATHS and all(facts["symbols"].values())
    timed = facts["ms_accelerate_vs_numpy"]
    assert set(timed) == {"fp16", "exp", "transpose", "norm"} and all(len(t) == 2 and min(t) > 0 for t in timed.values())
    blas_row = {row["probe"]: row for row in doc["rows"]}["blas"]
    assert blas_row["facts"]["threading"] in ("openblas_set_num_threads", "BLASSetThreading")

def test_the_package_has_no_compiled_code():
    compiled = {".c", ".h", ".so", ".dylib", ".o", ".pyd", ".dll", ".a"}
    found = [p for p in (ROOT / "anectypes").rglob("*") if p.suffix in compiled and "web" not in p.parts]
    assert not found


# ------------------------------------------------------------------ the other modules' tests, through the stand-in

@pytest.mark.slow
def test_the_fp16_optimizer_decoder_and_ane_tests_pass_through_the_standin(standin):
    """The modules whose code takes these paths (the interpreter's rounding, the ANE backend's surface writes,
    reads and staging against the simulator, bit for bit, the optimizer, the loss, the decoder, the sampler)
    pass with every path on Accelerate's stand-in, and test_blas with the stand-in's CBLAS."""
    env = dict(os.environ, ANECTYPES_ACCELERATE=str(standin), PYTHONPATH=str(ROOT))
    runs = [(["tests/test_fp16_rounding.py", "tests/test_optim.py", "tests/test_decoder.py", "tests/test_ane_backend.py",
              "tests/test_gradients.py", "tests/test_generate.py", "-m", "not slow"], env),
            (["tests/test_blas.py", "-k", "not kernel_choice and not anectypes_blas and not omatcopy"], dict(env, ANECTYPES_BLAS=str(standin)))]
    for args, environment in runs:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], env=environment,
                           cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:]


# each: (what is mutated, the text in anectypes/host/accelerate.py or blas.py, its mutation, the tests that must fail)
MUTATIONS = [
    ("vDSP_vdiv's divisor and dividend swapped", 'accelerate.py', '_fn("vDSP_vdiv")(pt, 1, pm, 1, pt, 1, n)',
     '_fn("vDSP_vdiv")(pm, 1, pt, 1, pt, 1, n)', "adamw"),
    ("vDSP_vsmsma's two scalars swapped", 'accelerate.py', '_fn("vDSP_vsmsma")(pv, 1, f(b2), pt, 1, f(gv), pv, 1, n)',
     '_fn("vDSP_vsmsma")(pv, 1, f(gv), pt, 1, f(b2), pv, 1, n)', "adamw"),
    ("vDSP_mtrans's M and N swapped", 'accelerate.py', 'a.shape[1], a.shape[0])', 'a.shape[0], a.shape[1])', "mtrans"),
    ("vImage's source and destination rowBytes swapped", 'accelerate.py',
     'Buffer(src.ctypes.data, height, width, row_bytes[0])', 'Buffer(src.ctypes.data, height, width, row_bytes[1])',
     "strided_block"),
    ("vImagePixelCount as a 32-bit int", 'accelerate.py', '("height", ctypes.c_ulong), ("width", ctypes.c_ulong)',
     '("height", ctypes.c_uint), ("width", ctypes.c_uint)', "strided_block"),
    ("BLAS_THREADING's two models swapped", 'blas.py', 'MULTI_THREADED, SINGLE_THREADED = 0, 1',
     'MULTI_THREADED, SINGLE_THREADED = 1, 0', "blassetthreading"),
]


@pytest.mark.slow
def test_mutated_bindings_fail_these_tests(tmp_path):
    """A copy of the package with one binding mutated (an argument order, a type, a constant): the tests of its
    path fail; the unmutated copy passes them (the control)."""
    def run(name, mutate=None):
        copy = tmp_path / name
        shutil.copytree(ROOT / "anectypes", copy / "anectypes", ignore=shutil.ignore_patterns("web", "__pycache__"))
        if mutate:
            path = copy / "anectypes" / "host" / mutate[0]
            text = path.read_text()
            assert text.count(mutate[1]) == 1, mutate[1]
            path.write_text(text.replace(mutate[1], mutate[2]))
        env = dict(os.environ, PYTHONPATH=str(copy))
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                               str(ROOT / "tests" / "test_accelerate.py"), "-k", mutate[3] if mutate else
                               " or ".join(m[4] for m in MUTATIONS)], env=env, cwd=copy, capture_output=True,
                              text=True, timeout=900)
    control = run("control")
    assert control.returncode == 0 and " passed" in control.stdout, control.stdout[-3000:]
    for i, (what, file, text, mutated, tests) in enumerate(MUTATIONS):
        r = run(f"m{i}", (file, text, mutated, tests))
        assert r.returncode != 0 and ("failed" in r.stdout or "Fatal Python error" in r.stderr), what
