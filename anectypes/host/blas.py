"""float32 GEMM through ctypes: Accelerate on macOS, scipy-openblas32 elsewhere, or the CBLAS library that
ANECTYPES_BLAS names. Never copies operands."""

import contextlib
import ctypes
import functools
import os
import sys
from types import SimpleNamespace

import numpy as np

from ..errors import BlasError
from .system import c_function

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
NEW_LAPACK = "$NEWLAPACK"                 # lapack_version.h's __LAPACK_ALIAS suffix (LP64: C int dimensions)
MULTI_THREADED, SINGLE_THREADED = 0, 1    # thread_api.h's enum BLAS_THREADING
_INT_MAX = 2**31 - 1  # LP64: every dimension and leading dimension is a C int
_ACCELERATE = "/System/Library/Frameworks/Accelerate.framework/Accelerate"


def preferred_coretype(cpuinfo):
    """The OpenBLAS kernel to ask for, given /proc/cpuinfo's text, or None for OpenBLAS's own choice.

    On AMD Zen 4 (family 25 with AVX-512) OpenBLAS picks its SkylakeX AVX-512 kernels, which Zen 4
    runs on 256-bit halves; its Haswell AVX2 kernels are faster there on our GEMM shapes
    (docs/train-speed.md)."""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.split() for k, v in fields.items()}
    zen4 = (fields.get("vendor_id") == ["AuthenticAMD"] and fields.get("cpu family") == ["25"]
            and "avx512f" in fields.get("flags", []))
    return "Haswell" if zen4 else None


def cpu_coretype():
    try:
        with open("/proc/cpuinfo") as f:
            return preferred_coretype(f.read())
    except OSError:
        return None


THREAD_TIMEOUT = "16"


@functools.lru_cache(maxsize=None)
def _lib():
    """Load the BLAS once, on first use (importing this module has no side effects): the file that
    ANECTYPES_BLAS names (a path or a library name the loader finds) when it is set, else
    Accelerate on macOS and scipy-openblas32 elsewhere."""
    chosen = os.environ.get("ANECTYPES_BLAS")
    if sys.platform == "darwin" and not chosen:
        return _bind_library(_ACCELERATE, "")
    # OpenBLAS's idle threads spin 2^28 cycles (about 0.1 s) after a call before they sleep; on
    # few cores that takes the cores from the numpy work between calls (docs/train-speed.md); 2^16
    # cycles is about 25 µs. OpenBLAS reads this
    # when it starts its threads, at the first call; it changes no result, so it stays set.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    # The kernel choice is read when the library loads. A user's setting wins; ours is removed
    # again, so that a child process (the trainer's restart) starts like this one: its numpy,
    # loaded before us, must not pick it up and round differently
    core = None if "OPENBLAS_CORETYPE" in os.environ else cpu_coretype()
    if core:
        os.environ["OPENBLAS_CORETYPE"] = core
    try:
        if chosen:
            return _bind_library(chosen, "", "ANECTYPES_BLAS")
        try:
            import scipy_openblas32 as m  # its import dlopens the library RTLD_GLOBAL
        except ImportError:
            raise BlasError("no BLAS found: run `pip install scipy-openblas32`") from None
        return _bind_library(os.path.join(m.get_lib_dir(), m.get_library(fullname=True)), "scipy_")
    finally:
        if core:
            del os.environ["OPENBLAS_CORETYPE"]


def _bind_library(path, prefix, source=None):
    """The functions anectypes calls in the BLAS at `path`, whose symbols carry `prefix`: cblas_sgemm
    and cblas_sgemv (Accelerate's current ones where present: cblas_new.h's names end in $NEWLAPACK, the
    plain names being its legacy interface), and where present the strided-batch sgemm, the transposing
    copy, the thread control (OpenBLAS's thread count, or Accelerate's BLASSetThreading from macOS 15) and
    OpenBLAS's kernel name."""
    hint = f" (set by {source})" if source else "; reinstall scipy-openblas32 (Accelerate on macOS)"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise BlasError(f"cannot load BLAS at {path}{hint}: {e}") from None
    I, F, P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    if not all(hasattr(lib, prefix + name) for name in ("cblas_sgemm", "cblas_sgemv")):
        raise BlasError(f"{path}{hint} is not a CBLAS library: it has no {prefix}cblas_sgemm and {prefix}cblas_sgemv")
    suffix = NEW_LAPACK if all(hasattr(lib, f"{prefix}{name}{NEW_LAPACK}") for name in ("cblas_sgemm", "cblas_sgemv")) else ""
    optional = lambda name, restype, argtypes: (c_function(lib, prefix + name, restype, argtypes)
                                                 if hasattr(lib, prefix + name) else None)
    threads = _thread_control(lib, optional)
    return SimpleNamespace(
        path=path, sgemm_name=f"{prefix}cblas_sgemm{suffix}", thread_control=threads[0],
        sgemm=c_function(lib, f"{prefix}cblas_sgemm{suffix}", None, [I, I, I, I, I, I, F, P, I, P, I, F, P, I]),
        sgemv=c_function(lib, f"{prefix}cblas_sgemv{suffix}", None, [I, I, I, I, F, P, I, P, I, F, P, I]),
        # OpenBLAS's strided batch loops over its items, so the items' outputs may interleave (one
        # head's columns among the others'); MKL's same-named function refuses that (stridec < ldc·m)
        # and computes nothing, so other libraries go item by item
        sgemm_batch=(optional("cblas_sgemm_batch_strided", None, [I, I, I, I, I, I, F, P, I, I, P, I, I, F, P, I, I, I])
                     if hasattr(lib, prefix + "openblas_get_config") else None),
        omatcopy=optional("cblas_somatcopy", None, [I, I, I, I, F, P, I, P, I]),
        set_threads=threads[1], get_threads=threads[2],
        corename=optional("openblas_get_corename", ctypes.c_char_p, []))


def _thread_control(lib, optional):
    """(the thread control's name, set(n), get()) of a BLAS, or (None, None, None). Accelerate's
    BLASSetThreading (thread_api.h, macOS 15) has two models, per calling thread: single-threaded, or
    Accelerate choosing (multi-threaded, reported as this machine's cores)."""
    openblas = optional("openblas_set_num_threads", None, [ctypes.c_int])
    if openblas:
        return "openblas_set_num_threads", openblas, optional("openblas_get_num_threads", ctypes.c_int, [])
    setter = optional("BLASSetThreading", ctypes.c_int, [ctypes.c_uint])
    getter = optional("BLASGetThreading", ctypes.c_uint, [])
    if not (setter and getter):
        return None, None, None

    def set_threads(n):
        model = SINGLE_THREADED if n == 1 else MULTI_THREADED
        if setter(model):
            raise BlasError(f"BLASSetThreading({model}) failed: Accelerate does not support that threading model here")
    return ("BLASSetThreading", set_threads,
            lambda: 1 if getter() == SINGLE_THREADED else os.cpu_count())


def library_path():
    return _lib().path  # the loaded BLAS file, for logs and bug reports


def corename():
    """The CPU kernel the BLAS picked (e.g. 'Haswell'); benchmarks should print it."""
    f = _lib().corename
    return f().decode() if f else "Accelerate" if _lib().path == _ACCELERATE else "unknown"


def set_num_threads(n):
    """Set BLAS threads: OpenBLAS's count; on Accelerate (macOS 15), 1 is single-threaded and more lets
    Accelerate choose, for the calling thread. No-op where the BLAS has no thread control (thread_control())."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise BlasError(f"set_num_threads: n must be an int >= 1, got {n!r}")
    if _lib().set_threads:
        _lib().set_threads(int(n))


def get_num_threads():
    """BLAS thread count (Accelerate choosing: this machine's cores), or None where the BLAS does not say."""
    f = _lib().get_threads
    return f() if f else None


@contextlib.contextmanager
def threads(n):
    """set_num_threads(n) for a block, and the count before it afterwards: a command called in-process (the
    tests, a library user) leaves no other thread count behind, which would change later sums' last bits."""
    before = get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        if before:
            set_num_threads(before)


def thread_control():
    """The BLAS's thread control: "openblas_set_num_threads", "BLASSetThreading", or None (set_num_threads
    then does nothing: Accelerate before macOS 15, or a library ANECTYPES_BLAS names without one)."""
    return _lib().thread_control


def report():
    """What the doctor and bench say about the BLAS: its file, kernel, the sgemm symbol and the thread control
    in use and its threads; {"error": ...} when no BLAS loads."""
    try:
        return dict(library=library_path(), core=corename(), sgemm=_lib().sgemm_name, threading=thread_control(),
                    threads=get_num_threads())
    except BlasError as e:
        return dict(error=str(e))


def _check(x, name, exact2d):
    if not isinstance(x, np.ndarray):
        raise BlasError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise BlasError(f"{name} has dtype {x.dtype}; float32 is required (convert with .astype(np.float32))")
    if x.ndim < 2 or (exact2d and x.ndim != 2):
        raise BlasError(f"{name} must be {'2-D' if exact2d else 'at least 2-D'}, got ndim={x.ndim}")


def _op_shape(x, t):
    return (x.shape[-1], x.shape[-2]) if t else x.shape[-2:]


def _validate(a, b, out, trans_a, trans_b, beta, exact2d):
    _check(a, "a", exact2d)
    _check(b, "b", exact2d)
    (m, k), (k2, n) = _op_shape(a, trans_a), _op_shape(b, trans_b)
    if k != k2:
        raise BlasError(f"inner dimensions differ: a.shape={a.shape} (trans_a={trans_a}) gives op(a) {m}x{k}, "
                        f"b.shape={b.shape} (trans_b={trans_b}) gives op(b) {k2}x{n}")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise BlasError(f"batch dims of a.shape={a.shape} and b.shape={b.shape} do not broadcast") from None
    if max(m, n, k) > _INT_MAX:
        raise BlasError(f"dimension too large for 32-bit BLAS: M={m}, N={n}, K={k} (max {_INT_MAX})")
    shape = batch + (m, n)
    if out is None:
        if beta != 0:
            raise BlasError(f"beta={beta} needs an existing out to accumulate into; pass out=")
        return np.empty(shape, np.float32)
    _check(out, "out", exact2d)
    if out.shape != shape:
        raise BlasError(f"out has shape {out.shape}; expected {shape} for op(a) {m}x{k} @ op(b) {k}x{n}")
    if not out.flags.writeable:
        raise BlasError("out is read-only; pass a writeable array")
    for x, name in ((a, "a"), (b, "b")):
        if _overlap(out, x):  # BLAS must not read what it writes
            raise BlasError(f"out shares memory with {name}; pass a separate output array")
    return out


def _overlap(x, y):
    try:  # exact answer (disjoint column ranges of one array are fine), bounded so it stays cheap
        return np.shares_memory(x, y, max_work=10_000)
    except np.exceptions.TooHardError:
        return True


def _rows_ld(x):
    """The leading dimension of a 2-D view whose rows are contiguous (any ld >= the row length), or None."""
    (r, c), (s0, s1), sz = x.shape, x.strides, x.itemsize
    if x.flags.aligned and (c == 1 or s1 == sz) and (r == 1 or s0 % sz == 0 and c <= s0 // sz <= _INT_MAX):
        return s0 // sz if r > 1 else c  # one row's stride is arbitrary
    return None


def _layout(x, name):
    """(leading dim, stored-transposed?) for a 2-D view BLAS can read in place; else BlasError."""
    if (ld := _rows_ld(x)) is not None:
        return ld, False
    if name != "out" and (ld := _rows_ld(x.T)) is not None:
        return ld, True  # column-major = transpose of row-major: flip the flag
    need = "unit stride along the last axis" if name == "out" else "unit stride along one axis"
    raise BlasError(f"{name} (shape {x.shape}, strides {x.strides}) is not BLAS-compatible: it needs {need} "
                    f"and a row stride >= the row length; use np.ascontiguousarray({name})")


def _gemm(a, b, out, trans_a, trans_b, alpha, beta, strides=None):
    """One sgemm of 2-D a, b, out; with `strides` (element strides of a, b, out along one batch
    axis), one strided-batch call for the first dim of 3-D ones instead."""
    m, n, k = out.shape[-2], out.shape[-1], _op_shape(a, trans_a)[1]
    if m == 0 or n == 0:
        return
    if k == 0:  # empty sum: out = beta*out, and beta == 0 must not read out (it may hold NaN)
        out[...] = 0 if beta == 0 else out * np.float32(beta)
        return
    first = (0,) * (a.ndim - 2)
    (lda, fa), (ldb, fb), (ldc, _) = _layout(a[first], "a"), _layout(b[first], "b"), _layout(out[first], "out")
    ta, tb = _TRANS if trans_a != fa else _NO_TRANS, _TRANS if trans_b != fb else _NO_TRANS
    if strides:
        _lib().sgemm_batch(_ROW_MAJOR, ta, tb, m, n, k, alpha, a.ctypes.data, lda, strides[0], b.ctypes.data, ldb,
                           strides[1], beta, out.ctypes.data, ldc, strides[2], out.shape[0])
    else:
        _lib().sgemm(_ROW_MAJOR, ta, tb, m, n, k, alpha, a.ctypes.data, lda, b.ctypes.data, ldb,
                     beta, out.ctypes.data, ldc)


def _batch_strides(arrays):
    """Element strides of 3-D arrays along their first (batch) axis when one strided-batch call
    can take them all: a BLAS that has it, more than one element, strides >= 0 and in whole
    elements (a broadcast operand's is 0); else None."""
    sz = arrays[0].itemsize
    strides = [x.strides[0] for x in arrays]
    if _lib().sgemm_batch is None or arrays[-1].shape[0] < 2 or any(s < 0 or s % sz or s // sz > _INT_MAX
                                                                      for s in strides):
        return None
    return [s // sz for s in strides]


def sgemm(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """out = alpha * op(a) @ op(b) + beta * out for 2-D float32 arrays; returns out."""
    return _run(a, b, out, trans_a, trans_b, alpha, beta, True)


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """Batched sgemm: leading dims broadcast like numpy.matmul; one BLAS call per batch element."""
    return _run(a, b, out, trans_a, trans_b, alpha, beta, False)


def _run(a, b, out, trans_a, trans_b, alpha, beta, exact2d):
    trans_a, trans_b, alpha, beta = bool(trans_a), bool(trans_b), float(alpha), float(beta)
    out = _validate(a, b, out, trans_a, trans_b, beta, exact2d)
    batch = out.shape[:-2]
    # where a batch dim broadcasts: views with zero batch strides (the matrix strides are untouched)
    a, b = (x if x.shape[:-2] == batch else np.broadcast_to(x, batch + x.shape[-2:]) for x in (a, b))
    long = [d for d, size in enumerate(batch) if size > 1]
    if len(long) == 1:   # one batch axis (e.g. attention heads): one strided-batch call when it fits
        one = tuple(slice(None) if d == long[0] else 0 for d in range(len(batch)))
        flat = [x[one] for x in (a, b, out)]
        strides = _batch_strides(flat)
        if strides:
            _gemm(*flat, trans_a, trans_b, alpha, beta, strides)
            return out
    for i in np.ndindex(batch):
        _gemm(a[i], b[i], out[i], trans_a, trans_b, alpha, beta)
    return out


def transpose(a, out):
    """out[...] = a.T for 2-D arrays, `out` of the transposed shape: OpenBLAS's transposing copy
    (cblas_somatcopy, alpha 1: exact) where the BLAS has it, both are float32 and their rows are
    contiguous, else numpy's copy of the transposed view, which goes element by element
    (docs/train-speed.md). Returns out."""
    if not (isinstance(a, np.ndarray) and isinstance(out, np.ndarray) and a.ndim == 2 and out.shape == a.shape[::-1]):
        raise BlasError(f"transpose needs a 2-D a and out of its transposed shape, got "
                        f"{np.shape(a)} and {np.shape(out)}")
    if not out.flags.writeable or _overlap(out, a):
        raise BlasError("out must be writeable and share no memory with a")
    f, lda, ldb = _lib().omatcopy, _rows_ld(a), _rows_ld(out)
    if f and a.dtype == out.dtype == np.float32 and a.size and lda and ldb:
        f(_ROW_MAJOR, _TRANS, *a.shape, 1.0, a.ctypes.data, lda, out.ctypes.data, ldb)
    else:
        out[...] = a.T
    return out


def sgemv_call(a, x, y, *, alpha=1.0, beta=0.0):
    """y = alpha * a @ x + beta * y for a 2-D float32 a [m, n] and 1-D x [n], y [m], checked once and
    returned as a function of no arguments that repeats the call on the same arrays (the matrix-vector
    products of a decoder's token steps: an sgemm with one row is many times slower than sgemv in
    OpenBLAS, and the checks cost more than a small product). The arrays must outlive the function."""
    _check(a, "a", True)
    for v, name in ((x, "x"), (y, "y")):
        if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.ndim != 1:
            raise BlasError(f"{name} must be a 1-D float32 numpy.ndarray")
        if v.strides[0] <= 0 or v.strides[0] % v.itemsize:
            raise BlasError(f"{name} (strides {v.strides}) needs a positive stride in whole elements")
    (m, n), (lda, stored_t) = a.shape, _layout(a, "a")
    if x.shape != (n,) or y.shape != (m,):
        raise BlasError(f"a.shape={a.shape} needs x of shape ({n},) and y of shape ({m},), got {x.shape} and {y.shape}")
    if not y.flags.writeable or _overlap(y, a) or _overlap(y, x):
        raise BlasError("y must be writeable and share no memory with a or x")
    if m == 0 or n == 0:
        raise BlasError(f"a has an empty dimension: {a.shape}")
    return functools.partial(_lib().sgemv, _ROW_MAJOR, _TRANS if stored_t else _NO_TRANS,
                             *((n, m) if stored_t else (m, n)), float(alpha), a.ctypes.data, lda, x.ctypes.data,
                             x.strides[0] // x.itemsize, float(beta), y.ctypes.data, y.strides[0] // y.itemsize)
