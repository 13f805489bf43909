"""Apple's Accelerate through ctypes, for the CPU half's hottest loops on a Mac (docs/accelerate.md): the fp16
conversions (vImage), exp (vForce), the staging transposes, the AdamW update and the gradient norm (vDSP).

Each use takes Accelerate when the library has every symbol it needs, else numpy; ANECTYPES_ACCELERATE=0
forces numpy everywhere, ANECTYPES_ACCELERATE=<path> loads that library instead of the framework (the tests'
stand-in, tests/support/accelerate_standin.c). The prototypes are Apple's headers', cited in docs/accelerate.md.
The rest of the code calls the small functions here, each of which falls back to numpy itself or says it did
nothing (returns False or None) for its caller to."""

import ctypes
import functools
import math
import os
import sys

import numpy as np

from ..errors import AnectypesError
from . import blas
from .system import c_function

FRAMEWORK = "/System/Library/Frameworks/Accelerate.framework/Accelerate"
SWITCH = "ANECTYPES_ACCELERATE"
DO_NOT_TILE = 16                 # kvImageDoNotTile: on the calling thread (the callers deal work to lanes themselves)
INT_MAX = 2**31 - 1              # vForce counts with a C int


class Buffer(ctypes.Structure):
    """vImage_Buffer (vImage_Types.h): vImagePixelCount is an unsigned long, rowBytes a size_t."""
    _fields_ = [("data", ctypes.c_void_p), ("height", ctypes.c_ulong), ("width", ctypes.c_ulong),
                ("rowBytes", ctypes.c_size_t)]


_P, _F, _D = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)
_N, _L, _S = ctypes.POINTER(ctypes.c_int), ctypes.c_ulong, ctypes.c_long   # const int *n, vDSP_Length, vDSP_Stride
_CONVERT = (ctypes.c_ssize_t, [ctypes.POINTER(Buffer), ctypes.POINTER(Buffer), ctypes.c_uint32])   # vImage_Error f(src, dest, flags)
PROTOTYPES = {
    "vImageConvert_PlanarFtoPlanar16F": _CONVERT,
    "vImageConvert_Planar16FtoPlanarF": _CONVERT,
    "vvexpf": (None, [_P, _P, _N]),                            # y, x, n
    "vvexp": (None, [_P, _P, _N]),
    "vvsqrtf": (None, [_P, _P, _N]),
    "vDSP_mtrans": (None, [_P, _S, _P, _S, _L, _L]),           # A, IA, C, IC, M, N
    "vDSP_vsmul": (None, [_P, _S, _F, _P, _S, _L]),            # A, IA, B, C, IC, N: C = A·B
    "vDSP_vsma": (None, [_P, _S, _F, _P, _S, _P, _S, _L]),     # A, IA, B, C, IC, D, ID, N: D = A·B + C
    "vDSP_vsmsma": (None, [_P, _S, _F, _P, _S, _F, _P, _S, _L]),   # A, IA, B, C, IC, D, E, IE, N: E = A·B + C·D
    "vDSP_vsq": (None, [_P, _S, _P, _S, _L]),                  # A, IA, C, IC, N: C = A²
    "vDSP_vsadd": (None, [_P, _S, _F, _P, _S, _L]),            # A, IA, B, C, IC, N: C = A + B
    "vDSP_vdiv": (None, [_P, _S, _P, _S, _P, _S, _L]),         # B, IB, A, IA, C, IC, N: C = A / B (divisor first)
    "vDSP_vclr": (None, [_P, _S, _L]),                         # C, IC, N: C = 0
    "vDSP_svesq": (None, [_P, _S, _F, _L]),                    # A, IA, C, N: C = Σ A²
}
# each use of Accelerate: the part of it that serves it, and the symbols it needs
USES = {"fp16": ("vImage", ("vImageConvert_PlanarFtoPlanar16F", "vImageConvert_Planar16FtoPlanarF")),
        "exp": ("vForce", ("vvexpf", "vvexp")),
        "transpose": ("vDSP", ("vDSP_mtrans",)),
        "adamw": ("vDSP", ("vDSP_vsmul", "vDSP_vsma", "vDSP_vsq", "vDSP_vsmsma", "vDSP_vclr", "vvsqrtf", "vDSP_vsadd",
                           "vDSP_vdiv")),
        "norm": ("vDSP", ("vDSP_svesq",))}
_used = set()                    # the uses that have run through Accelerate in this process


@functools.lru_cache(maxsize=None)
def _library():
    """(path, {symbol: function}) of the library this process uses, or (None, {}): the framework on macOS unless
    ANECTYPES_ACCELERATE is 0 or names another library (a bad name is an error, as for ANECTYPES_BLAS)."""
    chosen = os.environ.get(SWITCH, "")
    if chosen == "0" or (chosen in ("", "1") and sys.platform != "darwin"):
        return None, {}
    path = FRAMEWORK if chosen in ("", "1") else chosen
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        hint = "" if path == FRAMEWORK else f" (set by {SWITCH}; {SWITCH}=0 uses numpy)"
        raise AnectypesError(f"cannot load Accelerate at {path}{hint}: {e}") from None
    return path, {name: c_function(lib, name, *proto) for name, proto in PROTOTYPES.items() if hasattr(lib, name)}


def library():
    """The Accelerate file loaded, or None (not macOS, or switched off); a bad ANECTYPES_ACCELERATE raises here,
    so commands call this first."""
    return _library()[0]


@functools.lru_cache(maxsize=None)
def chosen(use):
    """Whether `use` (a key of USES) runs through Accelerate in this process."""
    return all(name in _library()[1] for name in USES[use][1])


def _fn(name):
    return _library()[1][name]


def report():
    """What the doctor and bench say about Accelerate: the file loaded (None: not macOS, or ANECTYPES_ACCELERATE=0),
    why it did not load (error), each symbol found, the path each use takes ("vImage", "vForce", "vDSP" or "numpy"),
    the uses that have run through Accelerate so far, and the BLAS (blas.report())."""
    try:
        path, found = _library()
        error = None
    except AnectypesError as e:
        path, found, error = None, {}, str(e)
    return dict(library=path, error=error, switch=os.environ.get(SWITCH),
                symbols={name: name in found for name in PROTOTYPES},
                paths={use: part if all(s in found for s in names) else "numpy" for use, (part, names) in USES.items()},
                used=used(), blas=blas.report())


def used():
    """The uses that have run through Accelerate in this process, sorted."""
    return sorted(_used)


def _rows(x):
    """(height, rowBytes) of a view as rows of unit stride once its size-1 axes are dropped (a block of a
    surface), or None."""
    v = np.squeeze(x)
    if v.ndim == 2 and v.strides[1] == x.itemsize and v.strides[0] >= v.shape[1] * x.itemsize:
        return v.shape[0], v.strides[0]
    return None


def convert(src, dst):
    """dst[...] = src between float32 and float16 (same shape) with vImage when the fp16 path is chosen: one call
    where each is C-contiguous or rows of unit stride (a strided block of a surface: rowBytes), else through a
    contiguous copy. vImage rounds to the nearest even fp16, keeps subnormals, gives ±inf from 65520 on: numpy's
    cast, bit for bit, but for signalling NaNs, which come out quiet (Conversion.h). Returns whether it did."""
    name = {(np.float32, np.float16): "vImageConvert_PlanarFtoPlanar16F",
            (np.float16, np.float32): "vImageConvert_Planar16FtoPlanarF"}.get((src.dtype.type, dst.dtype.type))
    if name is None or src.shape != dst.shape or not dst.flags.writeable or not chosen("fp16"):
        return False
    if not src.size:
        return True
    if not src.flags.c_contiguous and _rows(src) is None:
        src = np.ascontiguousarray(src)
    if np.may_share_memory(src, dst) or not dst.flags.c_contiguous and _rows(dst) is None:
        dense = np.empty(dst.shape, dst.dtype)
        convert(src, dense)
        dst[...] = dense
        return True
    strided = [x for x in (src, dst) if not x.flags.c_contiguous]
    height = _rows(strided[0])[0] if strided else 1
    width = src.size // height
    row_bytes = [width * x.itemsize if x.flags.c_contiguous else _rows(x)[1] for x in (src, dst)]
    err = _fn(name)(Buffer(src.ctypes.data, height, width, row_bytes[0]),
                    Buffer(dst.ctypes.data, height, width, row_bytes[1]), DO_NOT_TILE)
    if err:
        raise RuntimeError(f"{name} failed with vImage error {err}")
    _used.add("fp16")
    return True


def exp(x, out):
    """out = e**x, elementwise (out may be x): vvexpf for float32, vvexp for float64, when the exp path is chosen
    and both are C-contiguous, else np.exp. vForce documents no error bound: docs/accelerate.md states the one
    the tests hold it to. Returns out."""
    f = {np.float32: "vvexpf", np.float64: "vvexp"}.get(x.dtype.type)
    if (f is None or out.dtype != x.dtype or out.shape != x.shape or not chosen("exp")
            or not (x.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable)):
        return np.exp(x, out=out)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    for i in range(0, x.size, INT_MAX):
        n = min(INT_MAX, x.size - i)
        _fn(f)(flat_out[i:].ctypes.data, flat_x[i:].ctypes.data, ctypes.byref(ctypes.c_int(n)))
    _used.add("exp")
    return out


def transpose(a, out):
    """out[...] = a.T for 2-D arrays: vDSP_mtrans when the transpose path is chosen, both are float32 and a is
    C-contiguous (through a dense copy when out's rows are strided: vDSP_mtrans writes dense matrices), else
    blas.transpose (OpenBLAS's transposing copy, or numpy's). Returns out."""
    if (chosen("transpose") and isinstance(a, np.ndarray) and isinstance(out, np.ndarray) and a.ndim == 2
            and out.shape == a.shape[::-1] and a.dtype == out.dtype == np.float32 and a.flags.c_contiguous and a.size
            and out.flags.writeable and out.strides[1] == 4 and not np.may_share_memory(a, out)):
        dense = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        _fn("vDSP_mtrans")(a.ctypes.data, 1, dense.ctypes.data, 1, a.shape[1], a.shape[0])   # M: a's columns, N: its rows
        if dense is not out:
            out[...] = dense
        _used.add("transpose")
        return out
    return blas.transpose(a, out)


def adamw(w, g, m, v, t, b1, gm, b2, gv, eps, step, keep, zero):
    """One piece of AdamW.step (train/optim.py) in nine vDSP passes, numpy's fourteen: t = gm·g; m = b1·m + t;
    t = t²; v = b2·v + gv·t; g = 0 (zero); t = √v + eps; t = m / t; w = keep·w − step·t. The same float32 operations
    in the same order as numpy's, so the same bits where vDSP does not fuse a multiply-add. Arrays: float32,
    C-contiguous, of one size. Returns False (nothing done) when the adamw path is not chosen."""
    if not chosen("adamw"):
        return False
    n, f = w.size, lambda x: ctypes.byref(ctypes.c_float(x))
    pw, pg, pm, pv, pt = (x.ctypes.data for x in (w, g, m, v, t))
    _fn("vDSP_vsmul")(pg, 1, f(gm), pt, 1, n)
    _fn("vDSP_vsma")(pm, 1, f(b1), pt, 1, pm, 1, n)
    _fn("vDSP_vsq")(pt, 1, pt, 1, n)
    _fn("vDSP_vsmsma")(pv, 1, f(b2), pt, 1, f(gv), pv, 1, n)
    if zero:
        _fn("vDSP_vclr")(pg, 1, n)
    _fn("vvsqrtf")(pt, pv, ctypes.byref(ctypes.c_int(n)))
    _fn("vDSP_vsadd")(pt, 1, f(eps), pt, 1, n)
    _fn("vDSP_vdiv")(pt, 1, pm, 1, pt, 1, n)
    if keep == 1:
        _fn("vDSP_vsma")(pt, 1, f(-step), pw, 1, pw, 1, n)
    else:
        _fn("vDSP_vsmsma")(pw, 1, f(keep), pt, 1, f(-step), pw, 1, n)
    _used.add("adamw")
    return True


def sum_squares(x):
    """Σ x² of a C-contiguous float32 array in one vDSP_svesq pass (float32 sums), or None when the norm path is
    not chosen or the sum is not finite (the caller's numpy pass, which scales first, then decides)."""
    if not chosen("norm"):
        return None
    total = ctypes.c_float()
    _fn("vDSP_svesq")(x.ctypes.data, 1, ctypes.byref(total), x.size)
    _used.add("norm")
    return total.value if math.isfinite(total.value) else None
