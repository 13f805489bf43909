"""fp16 numerics at the bit level: rounding float32 data to fp16 values in place, and exact conversion
between float16 and float32 arrays holding fp16 values (docs/ane-reference.md §3.7).

Each equals numpy's float16 cast (plus, with ftz, the flush of subnormal results to ±0), but for finite
data, the training case, it takes integer bit operations on cache-sized chunks instead of that cast's
scalar loop; on a Mac, vImage's conversions instead (host.accelerate: the same bits, but for signalling
NaNs, which vImage quiets). The MIL interpreter rounds every fp16 op result with `round_to_fp16`, the
model reads fp16 surfaces with `fp16_to_fp32` and writes them with `to_fp16`, and the optimizer walks its
arrays with `host.chunks`.
"""

import ctypes
import platform
import struct
import sys

import numpy as np

from . import accelerate
from .chunks import CONVERT_CHUNK, chunks
from .system import c_function

_TINY, _HUGE = np.float32(2.0 ** -112), np.float32(2.0 ** 112)
_TO_NORMAL = np.float32(2.0 ** -14 - 2.0 ** -25)   # smallest |x| whose fp16 rounding is normal (a tie, to even)
_MIN_NORMAL = np.float32(2.0 ** -14)               # fp16's smallest normal value
_TO_INF = 65520.0                                  # smallest |x| whose fp16 rounding is inf


class SseModes:
    """Two modes of this thread's SSE arithmetic, set through C's fenv on x86-64 Linux (glibc's fenv_t
    keeps the MXCSR register at byte 28): rounding toward zero, and denormal inputs read as ±0 (DAZ).
    They let `round_to_fp16` flush fp16 subnormals without a mask (see `_round_flushed`). `load` reads
    the thread's environment and derives the two from it, `set` sets one, `restore` the thread's own,
    `scale` multiplies in one; an instance serves one thread at a time."""

    RC_TOWARD_ZERO, DAZ, OFFSET = 0x6000, 0x0040, 28

    def __init__(self, fenv):
        self.get, self.set = fenv
        self.saved, self.toward_zero, self.daz = (ctypes.create_string_buffer(64) for _ in range(3))

    def load(self):
        if self.get(self.saved):
            raise OSError("fegetenv failed")
        mxcsr, = struct.unpack_from("<I", self.saved, self.OFFSET)
        for env, bits in ((self.toward_zero, self.RC_TOWARD_ZERO), (self.daz, self.DAZ)):
            env.raw = self.saved.raw
            struct.pack_into("<I", env, self.OFFSET, mxcsr | bits)

    def restore(self):
        self.set(self.saved)

    def scale(self, flat, factor, env):
        """flat *= factor in the mode `env`."""
        try:
            self.set(env)
            flat *= factor
        finally:
            self.restore()


def _fenv():
    """libm's (fegetenv, fesetenv) where SseModes can be set and behave as expected, else None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        libm = ctypes.CDLL("libm.so.6")                 # glibc's (other C libraries: the mask)
    except OSError:
        return None
    modes = SseModes((c_function(libm, "fegetenv", ctypes.c_int, [ctypes.c_void_p]),
                      c_function(libm, "fesetenv", ctypes.c_int, [ctypes.c_void_p])))
    one, tiny = np.ones(4, np.float32), np.full(4, 2.0 ** -130, np.float32)   # tiny: an fp32 subnormal
    modes.load()
    try:
        modes.set(modes.toward_zero)
        truncated = one + np.float32(1.5 * 2.0 ** -24)     # 1 + 0.75 ulp: 1 toward zero, else 1 + 2**-23
        modes.set(modes.daz)
        zeroed = tiny * np.float32(1)
    finally:
        modes.restore()
    rounded = one + np.float32(1.5 * 2.0 ** -24)
    works = ((truncated == 1).all() and (rounded != 1).all() and (zeroed == 0).all()
             and (tiny * np.float32(1) != 0).all())
    return (modes.get, modes.set) if works else None


FENV = _fenv()


class Scratch:
    """Work buffers for the helpers below, for one user at a time (a plan's run, a device's surface writes)."""

    def __init__(self):
        self.words, self.flags = np.empty(CONVERT_CHUNK, np.uint32), np.empty(CONVERT_CHUNK, np.bool_)
        self.spare = np.empty(CONVERT_CHUNK, np.float32)
        self.modes = SseModes(FENV) if FENV else None


def round_to_fp16(x, ftz=True, scratch=None):
    """Round C-contiguous float32 `x` in place to fp16 values: nearest even, ±inf from 65520 on, NaN
    stays NaN, and with ftz results whose fp16 value would be subnormal become ±0. Exactly numpy's
    float16 cast (plus the flush); without overflow, inf or NaN (the training case) it takes bit
    operations instead of that cast's scalar loop, or vImage's conversions there and back where chosen."""
    scratch = scratch or Scratch()
    if accelerate.chosen("fp16") and x.dtype == np.float32:
        for (flat,) in chunks(x):
            half = scratch.words.view(np.float16)[:flat.size]
            accelerate.convert(flat, half)
            if ftz:
                _flush(half.view(np.uint16))
            accelerate.convert(half, flat)
        return
    if ftz and scratch.modes:
        scratch.modes.load()
    for (flat,) in chunks(x):
        if -_TO_INF < flat.min() and flat.max() < _TO_INF:           # NaN fails both
            (_round_flushed if ftz else _round_exact)(flat, scratch)
            continue
        with np.errstate(over="ignore", invalid="ignore"):   # overflow, inf, NaN: numpy's cast
            half = flat.astype(np.float16)
        if ftz:
            _flush(half.view(np.uint16))
        np.copyto(flat, half)


def _flush(bits):
    """fp16 subnormals (exponent 0) to ±0, on the fp16 bits in place."""
    bits &= np.where(bits & 0x7C00, np.uint16(0xFFFF), np.uint16(0x8000))


def _round_flushed(flat, scratch):
    """round_to_fp16 with ftz of finite `flat`: scaled by 2**-112, fp16's subnormal grid is fp32's, so
    rounding at bit 13 rounds to fp16 in every range; results below 2**-126 then are fp16 subnormals.
    With the SSE modes, the scaling truncates (a nearest rounding would double-round the one value
    just below the flush boundary up to it) and the scaling back reads those results as ±0: the flush.
    Without them, a mask taken before the scaling flushes."""
    words, modes = scratch.words[:flat.size], scratch.modes
    if modes:
        modes.scale(flat, _TINY, modes.toward_zero)
    else:
        keep = scratch.flags[:flat.size]
        np.abs(flat, out=words.view(np.float32))
        np.greater_equal(words.view(np.float32), _TO_NORMAL, out=keep)
        flat *= _TINY
    bits = flat.view(np.uint32)
    np.right_shift(bits, 13, out=words)               # round to nearest even at bit 13:
    words &= 1                                        # bits += 0xFFF + (bit 13), then clear bits 0..12
    words += 0xFFF
    bits += words
    bits &= np.uint32(0xFFFFE000)
    if modes:
        modes.scale(flat, _HUGE, modes.daz)
    else:
        flat *= _HUGE
        np.multiply(flat, keep, out=flat)             # ±0 keeps its sign


def _round_exact(flat, scratch):
    """round_to_fp16 without ftz of finite `flat`: |x| + c − c with c = 2**(e+13) for |x|'s exponent e
    (at least -14), since fp32's spacing on [c, 2c) is fp16's at e; one rounding, to nearest even,
    subnormal results included."""
    words = scratch.words[:flat.size]
    c, mag = scratch.spare[:flat.size], words.view(np.float32)
    c_bits = c.view(np.uint32)
    np.abs(flat, out=mag)
    np.bitwise_and(words, np.uint32(0x7F800000), out=c_bits)
    np.maximum(c, _MIN_NORMAL, out=c)
    c_bits += np.uint32(13 << 23)
    mag += c
    mag -= c
    bits = flat.view(np.uint32)
    bits &= np.uint32(0x80000000)                     # the sign, back on the rounded magnitude
    bits |= words


def fp16_to_fp32(src, dst):
    """dst (float32, C-contiguous) = src (float16) exactly: one vImage call where chosen (src may be a strided
    block of a surface), else bit operations for finite data."""
    if accelerate.convert(src, dst):
        return
    for h, f in chunks(np.ascontiguousarray(src).view(np.int16), dst):
        if h.max() >= 0x7C00 or h.view(np.uint16).max() >= 0xFC00:
            np.copyto(f, h.view(np.float16))         # inf/NaN (exponent 31): numpy's cast
            continue
        v = f.view(np.int32)
        np.copyto(v, h)                              # sign-extended: the sign fills bits 15..31
        v <<= 13                                     # exponent and mantissa to bits 13..27
        v &= np.int32(-0x70000001)                   # 0x8FFFFFFF: the sign at bit 31 only
        f *= _HUGE                                   # rebias the exponent (exact for subnormals too)


def fp32_to_fp16(src, dst, scratch=None):
    """dst (float16) = src (float32 holding fp16 values) exactly: vImage where chosen, else bit operations for
    finite data."""
    if accelerate.convert(src, dst):
        return
    if not (dst.flags.c_contiguous and dst.dtype == np.float16):
        np.copyto(dst, src, casting="same_kind")
        return
    scratch = scratch or Scratch()
    for flat, out in chunks(np.ascontiguousarray(src), dst.view(np.uint16)):
        words, negative = scratch.words[:flat.size], scratch.flags[:flat.size]
        with np.errstate(invalid="ignore"):        # signaling NaNs: caught below
            np.multiply(flat, _TINY, out=words.view(np.float32))   # fp16 exponent and mantissa in bits 13..27
        words >>= 13
        np.copyto(out, words, casting="unsafe")      # the low 16 bits: the fp16 magnitude
        if out.max() >= 0x7C00:                      # inf/NaN: numpy's cast
            np.copyto(out.view(np.float16), flat, casting="same_kind")
            continue
        np.signbit(flat, out=negative)
        sign = words.view(np.uint16)[:flat.size]
        np.multiply(negative, np.uint16(0x8000), out=sign)
        out |= sign


def to_fp16(src, dst=None):
    """dst[...] = float32 `src` rounded to fp16 (numpy's cast: nearest even, subnormals kept, ±inf from 65520):
    one vImage call where chosen, even into a strided block of a surface, else numpy's cast (which broadcasts).
    dst None: a new C-contiguous float16 array. Returns dst."""
    src = np.asarray(src)
    if dst is None:
        dst = np.empty(src.shape, np.float16)
    if not accelerate.convert(src, dst):
        np.copyto(dst, src, casting="unsafe")
    return dst
