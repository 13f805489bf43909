"""fp16 numerics at the bit level: rounding float32 data to fp16 values in place, and exact conversion
between float16 and float32 arrays holding fp16 values (docs/ane-reference.md §3.7).

Each equals numpy's float16 cast (plus, with ftz, the flush of subnormal results to ±0), but for finite
data, the training case, it takes integer bit operations on cache-sized chunks instead of that cast's
scalar loop. The MIL interpreter rounds every fp16 op result with `round_to_fp16`, the model reads fp16
surfaces with `fp16_to_fp32`, and the optimizer walks its arrays with `chunks`.
"""

import numpy as np

_TINY, _HUGE = np.float32(2.0 ** -112), np.float32(2.0 ** 112)
_TO_NORMAL = np.float32(2.0 ** -14 - 2.0 ** -25)   # smallest |x| whose fp16 rounding is normal (a tie, to even)
_MIN_NORMAL = np.float32(2.0 ** -14)               # fp16's smallest normal value
_TO_INF = 65520.0                                  # smallest |x| whose fp16 rounding is inf
CHUNK = 1 << 18          # elements per pass: the passes below stay in a core's L2 cache (measured 1.3-2x faster)


class Scratch:
    """Work buffers for the helpers below, for one user at a time (a plan's run, a device's surface writes)."""

    def __init__(self):
        self.words, self.flags = np.empty(CHUNK, np.uint32), np.empty(CHUNK, np.bool_)
        self.spare = np.empty(CHUNK, np.float32)


def chunks(*arrays, size=CHUNK):
    """Matching flat slices of at most `size` elements of C-contiguous arrays (views: writes land)."""
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError("chunks() works in place on C-contiguous arrays")
    flats = [a.reshape(-1) for a in arrays]
    for i in range(0, flats[0].size, size):
        yield [f[i:i + size] for f in flats]


def round_to_fp16(x, ftz=True, scratch=None):
    """Round C-contiguous float32 `x` in place to fp16 values: nearest even, ±inf from 65520 on, NaN
    stays NaN, and with ftz results whose fp16 value would be subnormal become ±0. Exactly numpy's
    float16 cast (plus the flush); without overflow, inf or NaN (the training case) it takes bit
    operations instead of that cast's scalar loop."""
    scratch = scratch or Scratch()
    for (flat,) in chunks(x):
        words, flags = scratch.words[:flat.size], scratch.flags[:flat.size]
        np.abs(flat, out=words.view(np.float32))
        if words.view(np.float32).max() < _TO_INF:
            if ftz:
                _round_flushed(flat, words, flags)
            else:
                _round_exact(flat, words, scratch.spare[:flat.size])
            continue
        with np.errstate(over="ignore", invalid="ignore"):   # overflow, inf, NaN: numpy's cast
            half = flat.astype(np.float16)
        if ftz:                                        # exponent 0 -> ±0, on the fp16 bits
            bits = half.view(np.uint16)
            bits &= np.where(bits & 0x7C00, np.uint16(0xFFFF), np.uint16(0x8000))
        np.copyto(flat, half)


def _round_flushed(flat, words, keep):
    """round_to_fp16 with ftz of finite `flat` (words: its magnitudes)."""
    np.greater_equal(words.view(np.float32), _TO_NORMAL, out=keep)   # the flush, decided before scaling
    flat *= _TINY      # fp16's subnormal grid becomes fp32's: [_TO_NORMAL, 2**-14) rounds up below
    bits = flat.view(np.uint32)
    np.right_shift(bits, 13, out=words)               # round to nearest even at bit 13:
    words &= 1                                        # bits += 0xFFF + (bit 13), then clear bits 0..12
    words += 0xFFF
    bits += words
    bits &= np.uint32(0xFFFFE000)
    flat *= _HUGE
    np.multiply(flat, keep, out=flat)                 # ±0 keeps its sign


def _round_exact(flat, words, spare):
    """round_to_fp16 without ftz of finite `flat` (words: its magnitudes; spare: float32 work space):
    |x| + c − c with c = 2**(e+13) for |x|'s exponent e (at least -14), since fp32's spacing on
    [c, 2c) is fp16's at e; one rounding, to nearest even, subnormal results included."""
    c, c_bits, mag = spare, spare.view(np.uint32), words.view(np.float32)
    np.bitwise_and(words, np.uint32(0x7F800000), out=c_bits)
    np.maximum(c, _MIN_NORMAL, out=c)
    c_bits += np.uint32(13 << 23)
    mag += c
    mag -= c
    bits = flat.view(np.uint32)
    bits &= np.uint32(0x80000000)                     # the sign, back on the rounded magnitude
    bits |= words


def fp16_to_fp32(src, dst):
    """dst (float32, C-contiguous) = src (float16) exactly, with bit operations for finite data."""
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
    """dst (float16) = src (float32 holding fp16 values) exactly, with bit operations for finite data."""
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
