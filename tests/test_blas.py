"""anectypes.host.blas against an independent float64 numpy reference."""

import itertools
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.host import blas
from anectypes.errors import BlasError

rng = np.random.default_rng(1234)


def rand(*shape):
    return rng.standard_normal(shape, dtype=np.float32)


def reference(a, b, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c0=None):
    """float64 result and the magnitude |alpha|*|op(a)|@|op(b)| + |beta*c0| that bounds its rounding error."""
    A, B = a.astype(np.float64), b.astype(np.float64)
    A, B = (np.swapaxes(A, -1, -2) if trans_a else A), (np.swapaxes(B, -1, -2) if trans_b else B)
    ref, mag = alpha * (A @ B), abs(alpha) * (np.abs(A) @ np.abs(B))
    if beta:
        ref, mag = ref + beta * c0.astype(np.float64), mag + abs(beta * c0.astype(np.float64))
    return ref, mag


def assert_close(got, a, b, **kw):
    # The float32 inputs are exact in float64, so all the error is float32 accumulation over K terms plus the final
    # rounding: typically ~sqrt(K)*2**-24 times the magnitude of the terms (worst case K*2**-24). 1e-6*sqrt(K) leaves
    # ~16x headroom for blocked / FMA summation orders, while a wrong index, stride or flag misses by O(1).
    ref, mag = reference(a, b, **kw)
    k = a.shape[-2] if kw.get("trans_a") else a.shape[-1]
    assert got.dtype == np.float32 and got.shape == ref.shape
    err = np.abs(got - ref)
    assert np.all(err <= 1e-6 * np.sqrt(max(k, 1)) * mag + 1e-30), np.max(err / (mag + 1e-30))


@pytest.fixture
def calls(monkeypatch):
    """Record every sgemm call (pointers and leading dims) while still running it; strided-batch
    calls are recorded as ("batch", args)."""
    lib, log = blas._lib(), []

    def spy(name, real):
        def record(*args):
            log.append(("batch", args) if name == "sgemm_batch" else args)
            return real(*args)
        return record

    for name in ("sgemm", "sgemm_batch"):
        if getattr(lib, name):
            monkeypatch.setattr(lib, name, spy(name, getattr(lib, name)))
    return log


def operand(rows, cols, trans):
    """A float32 matrix whose op() is rows x cols, stored transposed when trans."""
    return rand(cols, rows) if trans else rand(rows, cols)


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("m,n,k", [(5, 7, 3), (33, 17, 300), (1, 9, 4), (6, 1, 1)])
def test_sgemm_transposes_and_beta(trans_a, trans_b, beta, m, n, k):
    a, b = operand(m, k, trans_a), operand(k, n, trans_b)
    c0 = rand(m, n)
    out = c0.copy() if beta else None
    got = blas.sgemm(a, b, out, trans_a=trans_a, trans_b=trans_b, beta=beta)
    if beta:
        assert got is out  # accumulated in place
    assert_close(got, a, b, trans_a=trans_a, trans_b=trans_b, beta=beta, c0=c0)


def test_alpha_and_beta_scaling():
    a, b, c0 = rand(8, 5), rand(5, 6), rand(8, 6)
    got = blas.sgemm(a, b, c0.copy(), alpha=-0.5, beta=2.0)
    assert_close(got, a, b, alpha=-0.5, beta=2.0, c0=c0)


def test_beta_zero_ignores_garbage_in_out():
    a, b = rand(4, 3), rand(3, 2)
    out = np.full((4, 2), np.nan, np.float32)
    assert_close(blas.sgemm(a, b, out), a, b)


def test_column_range_views_are_used_in_place(calls):
    wide_a, wide_b, wide_out = rand(6, 20), rand(5, 30), np.zeros((6, 12), np.float32)
    a, b, out = wide_a[:, 3:8], wide_b[:, 10:17], wide_out[:, 4:11]
    assert not (a.flags.c_contiguous or a.flags.f_contiguous or b.flags.c_contiguous or out.flags.c_contiguous)
    blas.sgemm(a, b, out)
    assert_close(out, a, b)
    assert not wide_out[:, :4].any() and not wide_out[:, 11:].any()  # only the out columns written
    (_, ta, tb, m, n, k, _, pa, lda, pb, ldb, _, pc, ldc), = calls
    assert (ta, tb, m, n, k) == (111, 111, 6, 7, 5)
    assert (pa, lda, pb, ldb, pc, ldc) == (a.ctypes.data, 20, b.ctypes.data, 30, out.ctypes.data, 12)  # no copies


def test_transposed_views_flip_the_flag_instead_of_copying(calls):
    x, wide = rand(5, 6), rand(7, 40)
    a = x.T                  # 6x5, column-major
    b = wide[:, 2:9].T       # 7x7 transpose of a column range: unit stride on axis 0, row stride 40
    assert not a.flags.c_contiguous and not (b.flags.c_contiguous or b.flags.f_contiguous)
    c = rand(7, 3)
    assert_close(blas.sgemm(b, c), b, c)
    _, ta, tb, m, n, k, _, pa, lda, *_ = calls[-1]
    assert (ta, tb, m, n, k, pa, lda) == (112, 111, 7, 3, 7, b.ctypes.data, 40)
    y = rand(5, 4)
    assert_close(blas.sgemm(a, y), a, y)
    _, ta, tb, m, n, k, _, pa, lda, *_ = calls[-1]
    assert (ta, tb, m, n, k, pa, lda) == (112, 111, 6, 4, 5, x.ctypes.data, 6)
    z = rand(4, 6)
    assert_close(blas.sgemm(a, z.T, trans_a=True), a, z.T, trans_a=True)  # requested and stored transposes cancel
    _, ta, tb, m, n, k, _, pa, lda, pb, ldb, *_ = calls[-1]
    assert (ta, tb, m, n, k, pa, lda, pb, ldb) == (111, 112, 5, 4, 6, x.ctypes.data, 6, z.ctypes.data, 6)
    assert_close(blas.sgemm(b, b, trans_a=True, trans_b=True), b, b, trans_a=True, trans_b=True)


def test_single_row_and_column_views_with_odd_strides():
    big = rand(9, 9)
    a, b = big[2:3, 1:8], big[:7, 4:5]  # 1x7 row, 7x1 column of a wider array
    assert_close(blas.sgemm(a, b), a, b)
    assert_close(blas.sgemm(b, a), b, a)


def test_matmul_broadcasts_batches():
    a, b = rand(2, 1, 4, 5), rand(3, 5, 6)
    assert_close(blas.matmul(a, b), a, b)
    np.testing.assert_allclose(blas.matmul(a, b), np.matmul(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
def test_matmul_transposes_beta_alpha(trans_a, trans_b):
    a = rand(3, 7, 4) if trans_a else rand(3, 4, 7)
    b = rand(6, 7) if trans_b else rand(7, 6)
    c0 = rand(3, 4, 6)
    got = blas.matmul(a, b, c0.copy(), trans_a=trans_a, trans_b=trans_b, alpha=0.25, beta=1.0)
    assert_close(got, a, b, trans_a=trans_a, trans_b=trans_b, alpha=0.25, beta=1.0, c0=c0)


def test_matmul_call_count(calls):
    blas.matmul(rand(4, 5), rand(5, 3))
    assert len(calls) == 1  # a batch of one is one call
    blas.matmul(rand(2, 1, 4, 5), rand(3, 5, 3))
    assert len(calls) == 1 + 6


@pytest.mark.parametrize("m,n,k", [(0, 4, 3), (4, 0, 3), (0, 0, 0)])
def test_zero_size_output(calls, m, n, k):
    out = blas.sgemm(rand(m, k), rand(k, n))
    assert out.shape == (m, n) and not calls


def test_zero_inner_dimension(calls):
    out = np.full((3, 4), np.nan, np.float32)
    assert not blas.sgemm(rand(3, 0), rand(0, 4), out).any()  # beta=0: the empty sum, NaNs not read
    c0 = rand(3, 4)
    np.testing.assert_array_equal(blas.sgemm(rand(3, 0), rand(0, 4), c0.copy(), beta=2.0), 2 * c0)
    assert blas.matmul(rand(2, 3, 0), rand(0, 4)).shape == (2, 3, 4)
    assert blas.matmul(rand(0, 3, 2), rand(2, 4)).shape == (0, 3, 4)
    assert not calls


@pytest.mark.parametrize("call,words", [
    (lambda: blas.sgemm(rand(3, 4).astype(np.float64), rand(4, 5)), ["a", "float64", "float32"]),
    (lambda: blas.sgemm(rand(3, 4), rand(4, 5).astype(np.float16)), ["b", "float16", "float32"]),
    (lambda: blas.sgemm(rand(3, 4), rand(4, 5), np.zeros((3, 5))), ["out", "float64", "float32"]),
    (lambda: blas.sgemm(rand(4), rand(4, 5)), ["a", "2-D", "ndim=1"]),
    (lambda: blas.sgemm(rand(2, 3, 4), rand(4, 5)), ["a", "2-D", "ndim=3"]),
    (lambda: blas.matmul(rand(4), rand(4, 5)), ["a", "at least 2-D", "ndim=1"]),
    (lambda: blas.sgemm([[1.0]], rand(1, 1)), ["a", "ndarray", "list"]),
    (lambda: blas.sgemm(rand(3, 4), rand(5, 6)), ["inner", "(3, 4)", "(5, 6)", "trans_a=False", "trans_b=False"]),
    (lambda: blas.sgemm(rand(3, 4), rand(3, 5), trans_a=True, trans_b=True), ["inner", "trans_a=True", "trans_b=True"]),
    (lambda: blas.matmul(rand(2, 3, 4), rand(3, 4, 5)), ["batch", "(2, 3, 4)", "(3, 4, 5)", "broadcast"]),
    (lambda: blas.sgemm(rand(3, 4), rand(4, 5), np.zeros((5, 3), np.float32)), ["out", "(5, 3)", "(3, 5)"]),
    (lambda: blas.matmul(rand(2, 3, 4), rand(4, 5), np.zeros((3, 5), np.float32)), ["out", "(3, 5)", "(2, 3, 5)"]),
    (lambda: blas.sgemm(rand(3, 8)[:, ::2], rand(4, 5)), ["a", "strides", "ascontiguousarray"]),
    (lambda: blas.sgemm(rand(3, 4), rand(4, 10)[:, ::2]), ["b", "strides", "ascontiguousarray"]),
    (lambda: blas.sgemm(rand(3, 4), rand(4, 5), np.zeros((5, 3), np.float32).T), ["out", "last axis"]),
    (lambda: blas.sgemm(rand(3, 4), rand(4, 5), beta=1.0), ["beta", "out"]),
])
def test_refusals(call, words):
    with pytest.raises(BlasError) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_out_must_not_alias_inputs():
    a, b = rand(4, 4), rand(4, 4)
    with pytest.raises(BlasError, match="out shares memory with a"):
        blas.sgemm(a, b, a)
    with pytest.raises(BlasError, match="out shares memory with b"):
        blas.sgemm(a, b[:, :2], b[:, 1:3], beta=1.0)  # column 1 overlaps
    wide = rand(4, 8)  # disjoint column ranges of one array do not alias
    assert_close(blas.sgemm(wide[:, :4], b, wide[:, 4:]), wide[:, :4], b)


def test_read_only_out_and_int32_dims():
    out = np.zeros((2, 2), np.float32)
    out.flags.writeable = False
    with pytest.raises(BlasError, match="out is read-only"):
        blas.sgemm(rand(2, 2), rand(2, 2), out)
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (2**31, 1), (0, 4))  # no memory behind it
    with pytest.raises(BlasError, match="too large for 32-bit BLAS"):
        blas.sgemm(huge, rand(1, 1))


def test_import_has_no_side_effects():
    root = Path(__file__).resolve().parents[1]
    code = "import sys, anectypes.host.blas; assert 'scipy_openblas32' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


def test_library_info_and_threads():
    assert isinstance(blas.corename(), str) and blas.corename()
    assert os.path.exists(blas.library_path())
    with pytest.raises(BlasError, match="n must be an int >= 1"):
        blas.set_num_threads(0)
    control = blas.thread_control()
    assert control in ("openblas_set_num_threads", "BLASSetThreading", None)
    if control is None:          # Accelerate before macOS 15: a documented no-op
        blas.set_num_threads(1)
        assert blas.get_num_threads() is None
        return
    old = blas.get_num_threads()
    assert old >= 1
    try:
        blas.set_num_threads(1)
        assert blas.get_num_threads() == 1
        blas.set_num_threads(2)  # Accelerate: more than one lets it choose, up to all cores
        assert blas.get_num_threads() == (2 if control == "openblas_set_num_threads" else os.cpu_count())
    finally:
        blas.set_num_threads(old)
    assert blas.get_num_threads() == old


def cpuinfo(vendor, family, flags):
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\n"
            f"flags\t\t: fpu sse2 avx2 fma {flags}\n\nprocessor\t: 1\n")


@pytest.mark.parametrize("info, want", [
    (cpuinfo("AuthenticAMD", 25, "avx512f avx512bw"), "Haswell"),     # Zen 4: AVX-512 on 256-bit halves
    (cpuinfo("AuthenticAMD", 25, ""), None),                          # Zen 3: OpenBLAS picks Zen itself
    (cpuinfo("AuthenticAMD", 26, "avx512f"), None),                   # Zen 5: full-width AVX-512
    (cpuinfo("GenuineIntel", 6, "avx512f"), None),
    ("", None),
])
def test_preferred_coretype(info, want):
    assert blas.preferred_coretype(info) == want


@pytest.mark.skipif(sys.platform == "darwin", reason="Accelerate has no kernel choice")
@pytest.mark.parametrize("given", [None, "Sandybridge"])
def test_kernel_choice_is_applied_and_a_users_wins(given):
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_THREAD_TIMEOUT")}
    env.update(PYTHONPATH=str(root), **({"OPENBLAS_CORETYPE": given, "OPENBLAS_THREAD_TIMEOUT": "20"} if given else {}))
    code = ("import os; from anectypes.host import blas; print(blas.corename(), os.environ.get('OPENBLAS_CORETYPE'), "
            "os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True).stdout
    name, left, timeout = out.split()
    assert left == str(given)            # ours is not left for child processes; a user's stays
    assert timeout == ("20" if given else blas.THREAD_TIMEOUT)   # a user's wins; ours stays (no result changes)
    want = given or blas.cpu_coretype()
    if want:
        assert name == want


def test_batched_views_with_any_batch_strides(calls):
    """Batch elements at their own pointers: reversed, strided, broadcast and transposed-matrix
    batch views, as the interpreter passes attention heads, with no copies: one strided-batch call
    where one batch axis has non-negative strides (where the BLAS has it), else one call each."""
    a = rand(6, 8, 5)[::-2]                              # batch stride negative and doubled
    b = rand(3, 5, 4)
    assert_close(blas.matmul(a, b), a, b)
    heads = rand(1, 3, 5, 8).transpose(0, 1, 3, 2)       # [1, 3, 8, 5]: each matrix stored transposed
    w = rand(5, 4)
    assert_close(blas.matmul(heads, w), heads, w)
    out = np.full((3, 8, 4), np.nan, np.float32)[::-1]   # an output with a negative batch stride
    assert blas.matmul(a, b, out) is out
    assert_close(out, a, b)
    a4, b4 = a[:, None], rand(2, 5, 4)                    # [3, 1, 8, 5] x [2, 5, 4] -> [3, 2, 8, 4]
    assert_close(blas.matmul(a4, b4), a4, b4)
    batched = [c for c in calls if c[0] == "batch"]
    if blas._lib().sgemm_batch:
        assert len(batched) == 1 and batched[0][1][-1] == 3 and batched[0][1][12] == 0   # heads x w: b's stride 0
        assert len(calls) == 3 + 1 + 3 + 6
    else:
        assert len(calls) == 3 + 3 + 3 + 6


@pytest.mark.parametrize("layout", ["rows", "columns", "strided x and y"])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (0.5, 1.0)])
def test_sgemv_call_repeats_one_product(layout, alpha, beta):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5)).astype(np.float32)
    a = np.asfortranarray(a) if layout == "columns" else a
    x = rng.standard_normal(10).astype(np.float32)[::2] if layout.startswith("strided") else \
        rng.standard_normal(5).astype(np.float32)
    y = np.ones(14, np.float32)[::2] if layout.startswith("strided") else np.ones(7, np.float32)
    call = blas.sgemv_call(a, x, y, alpha=alpha, beta=beta)
    expected = alpha * a.astype(np.float64) @ x + beta
    call()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    x *= 2                                       # the same arrays, new values: the call reads them again
    call()
    np.testing.assert_allclose(y, alpha * a.astype(np.float64) @ x + beta * expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, words", [
    ((np.zeros((3, 2), np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)), "x of shape (2,)"),
    ((np.zeros((3, 2), np.float64), np.zeros(2, np.float32), np.zeros(3, np.float32)), "float32"),
    ((np.zeros((3, 2), np.float32), np.zeros(2, np.float32), np.zeros((3, 1), np.float32)), "1-D"),
])
def test_sgemv_call_refusals(args, words):
    with pytest.raises(BlasError, match=re.escape(words)):
        blas.sgemv_call(*args)
    y = np.zeros(4, np.float32)
    with pytest.raises(BlasError, match="share no memory"):
        blas.sgemv_call(np.zeros((4, 4), np.float32), y, y)


@pytest.fixture(scope="module")
def system_openblas():
    """The file of the system's OpenBLAS (Debian: libopenblas0-pthread, which the test script installs),
    as the loader finds it: missing, it FAILS in CI and skips elsewhere (conftest)."""
    code = ("import ctypes, ctypes.util; name = ctypes.util.find_library('openblas'); ctypes.CDLL(name); "
            "print(next(line.split()[-1] for line in open('/proc/self/maps') if 'openblas' in line))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if sys.platform != "linux" or r.returncode:
        pytest.skip("no system OpenBLAS (Debian: apt install libopenblas0-pthread)")
    return r.stdout.strip()


def test_anectypes_blas_loads_another_cblas_library(system_openblas):
    # this file's and the decoder's tests (float64 references, the training forward) pass on it
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, ANECTYPES_BLAS=system_openblas, PYTHONPATH=str(root))
    code = "from anectypes.host import blas; print(blas.library_path(), blas.corename(), blas.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    path, name, threads = out.split()
    assert path == system_openblas and name not in ("unknown", "Accelerate") and int(threads) >= 1
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_blas.py",
                        "tests/test_decoder.py", "-k", "not anectypes_blas"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("value, words", [
    ("no-such-blas.so", "cannot load BLAS at no-such-blas.so (set by ANECTYPES_BLAS)"),
    ("libm.so.6" if sys.platform == "linux" else "libSystem.dylib", "is not a CBLAS library"),
])
def test_anectypes_blas_that_is_no_blas_is_one_error_line(tmp_path, value, words):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, ANECTYPES_BLAS=value, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", "--model", "tiny", "--steps", "2",
                        "--run-dir", str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [r.stderr.strip()]
    assert words in r.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("path", ["omatcopy", "numpy"])
@pytest.mark.parametrize("shape", [(5, 3), (1, 7), (7, 1), (128, 768)])
def test_transpose_copies_exactly_into_strided_blocks(monkeypatch, path, shape):
    # the block a surface holds a weight in (a column range of a wider array), from a row band of
    # a wider matrix; every bit as numpy's transposed view has it (subnormals, -0, inf)
    if path == "omatcopy" and not blas._lib().omatcopy:
        pytest.skip("this BLAS has no cblas_somatcopy (Accelerate); OpenBLAS has")    # a failure in CI
    if path == "numpy":
        monkeypatch.setattr(blas._lib(), "omatcopy", None)
    r, c = shape
    source = rand(r + 3, c + 2)
    source.flat[:4] = [1e-40, -0.0, np.inf, -3e-39]
    a = source[1:r + 1, :c]
    surface = np.full((c, r + 9), 7.0, np.float32)
    out = surface[:, 4:4 + r]
    assert blas.transpose(a, out) is out
    assert np.array_equal(out.view(np.uint32), np.ascontiguousarray(a.T).view(np.uint32))
    assert (surface[:, :4] == 7).all() and (surface[:, 4 + r:] == 7).all()     # nothing beside the block


def test_transpose_of_other_dtypes_and_layouts_and_refusals():
    h = rand(6, 4).astype(np.float16)
    assert np.array_equal(blas.transpose(h, np.empty((4, 6), np.float16)), h.T)    # an ANE surface's fp16
    f = np.asfortranarray(rand(6, 4))
    assert np.array_equal(blas.transpose(f, np.empty((4, 6), np.float32)), f.T)
    with pytest.raises(BlasError, match=re.escape("transposed shape, got (6, 4) and (6, 4)")):
        blas.transpose(f, np.empty((6, 4), np.float32))
    square = rand(4, 4)
    with pytest.raises(BlasError, match="share no memory"):
        blas.transpose(square, square)
