"""fp16 mode's bit-level helpers against numpy's float16 cast, bit for bit.

In fp16 precision mode the interpreter keeps fp16 tensors in float32 arrays holding fp16 values:
`round_to_fp16` rounds an op's float32 result in place, `fp16_to_fp32` and `fp32_to_fp16` convert
at the program boundary. Each must equal `x.astype(np.float16)` (plus the flush of subnormal
results to ±0 when ftz=True) on every kind of value: all exponent ranges, ties, fp16 and fp32
subnormals, the flush boundary, ±0, overflow from 65520 on, ±inf and NaN. Where Accelerate's fp16
path runs (vImage; tests/test_accelerate.py runs this module through its stand-in), signalling NaNs
come out quiet, as Apple's Conversion.h says; numpy's cast keeps them signalling.
"""

import numpy as np
import pytest

import anectypes.host.fp16
from anectypes.host import accelerate
from anectypes.host.fp16 import Scratch, fp16_to_fp32, fp32_to_fp16, round_to_fp16

ALL_FP16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)


def quiet(a):
    """`a` (float16 or float32) as a vImage conversion gives it: its NaNs quiet (the top mantissa bit set, sign
    and payload kept) where Accelerate's fp16 path runs, else unchanged."""
    a = a.copy()
    if accelerate.chosen("fp16"):
        bits = a.view(np.uint16 if a.dtype == np.float16 else np.uint32)
        bits |= np.where(np.isnan(a), bits.dtype.type(0x200 if a.dtype == np.float16 else 0x400000), bits.dtype.type(0))
    return a


def half(x):
    """numpy's float16 cast of float32 `x`; where Accelerate's fp16 path runs, a NaN is vImage's instead: the sign,
    quiet, and the top ten bits of the payload (numpy's keeps a signalling NaN signalling, setting the lowest
    payload bit where the top ten are 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16)
    if accelerate.chosen("fp16"):
        nan, bits = np.isnan(x), x.view(np.uint32)
        h.view(np.uint16)[nan] = (bits[nan] >> 16 & 0x8000) | 0x7E00 | (bits[nan] >> 13 & 0x3FF)
    return h


def reference(x, ftz):
    """numpy's float16 rounding (nearest even, overflow to ±inf), then flush-to-zero of subnormals."""
    h = half(x)
    if ftz:
        bits = h.view(np.uint16)
        bits &= np.where(bits & 0x7C00, np.uint16(0xFFFF), np.uint16(0x8000))
    return h.astype(np.float32)


def finite_samples(rng, n=1 << 21):
    """Float32 values below the overflow threshold (65520) in magnitude: the rounding's fast path."""
    exponent = rng.integers(0, 143, n, dtype=np.uint32)          # zero/fp32 subnormals up to 2**16
    low = rng.choice(np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF], np.uint32), n)   # ties and neighbours
    mantissa = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    mantissa = np.where(rng.random(n) < 0.5, (mantissa & ~np.uint32(0x1FFF)) | low, mantissa)
    bits = (rng.integers(0, 2, n, dtype=np.uint32) << 31) | (exponent << 23) | mantissa
    fp16 = ALL_FP16[np.isfinite(ALL_FP16)].astype(np.float32)
    t = np.float32(2.0 ** -14 - 2.0 ** -25)                      # rounds (a tie, to even) to 2**-14
    edges = np.array([0.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 65504.0, t], np.float32)
    steps = np.concatenate([np.arange(-0x3000, 0x3000, 7), np.arange(-8, 9)])    # fp32 ulps
    around = (edges.view(np.uint32)[:, None] + steps).ravel()
    around = around[(around >= 0) & (around < 0x477FF000)].astype(np.uint32).view(np.float32)
    x = np.concatenate([bits.view(np.float32), fp16, around, [np.nextafter(np.float32(65520), np.float32(0))]])
    x = x[np.abs(x) < 65520]
    return np.concatenate([x, -x])


def special_samples(rng, n=1 << 20):
    """Any float32 bit pattern: overflow, ±inf and NaNs of every payload among ordinary values."""
    x = rng.integers(0, 1 << 32, n, dtype=np.uint32).view(np.float32)
    edges = np.array([65504, 65519, 65520, 65521, 65536, 1e30, np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([x, edges, -edges, finite_samples(rng, 1 << 16)])


def scratch(modes):
    """Work buffers whose flush uses the SSE modes (x86-64 Linux: CI's machines) or the mask (elsewhere)."""
    s = Scratch()
    if modes:
        assert anectypes.host.fp16.FENV is not None, "the SSE modes should load on x86-64 Linux"
    else:
        s.modes = None
    return s


def assert_rounds_like_numpy(x, ftz, modes):
    want = reference(x, ftz)
    got = x.copy()
    round_to_fp16(got, ftz, scratch(modes))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"{np.sum(got.view(np.uint32) != want.view(np.uint32))} values differ, e.g. " \
        f"{x[got.view(np.uint32) != want.view(np.uint32)][:5]}"


@pytest.mark.parametrize("modes", ["sse-modes", "mask"])
@pytest.mark.parametrize("ftz", [True, False])
@pytest.mark.parametrize("kind", ["finite", "special"])
def test_round_to_fp16_equals_numpy_cast(kind, ftz, modes):
    rng = np.random.default_rng([kind == "finite", ftz])
    x = finite_samples(rng) if kind == "finite" else special_samples(rng)
    assert (np.abs(x).max() < 65520) == (kind == "finite")          # the fast path, or numpy's cast
    assert_rounds_like_numpy(x, ftz, modes == "sse-modes")


@pytest.mark.parametrize("modes", ["sse-modes", "mask"])
def test_round_to_fp16_every_float32_near_the_flush(modes):
    # every float32 within 2**21 ulps of fp16's smallest normal (the flush boundary, its ties and the
    # values that double-round onto them), both signs
    middle = int(np.float32(2.0 ** -14).view(np.uint32))
    x = np.arange(middle - (1 << 21), middle + (1 << 21), dtype=np.uint32).view(np.float32)
    for part in (x, -x):
        assert_rounds_like_numpy(part, True, modes == "sse-modes")


def test_sse_modes_restore_the_thread_environment():
    # the modes hold only inside round_to_fp16: afterwards arithmetic rounds to nearest and keeps
    # subnormals
    one, tiny = np.ones(4, np.float32), np.full(4, 2.0 ** -130, np.float32)
    s = scratch(True)
    round_to_fp16(np.full(1 << 10, 1e-6, np.float32), True, s)
    assert (one + np.float32(1.5 * 2.0 ** -24) != 1).all() and (tiny * np.float32(1) != 0).all()


def test_round_to_fp16_keeps_shape_and_handles_scalars():
    x = np.array([[1 + 2.0 ** -11, -0.0], [3e-8, 70000]], np.float32)
    round_to_fp16(x)
    assert x.shape == (2, 2) and list(x.ravel()) == [1, 0, 0, np.inf] and np.signbit(x[0, 1])
    s = np.array(1 / 3, np.float32)
    round_to_fp16(s)
    assert s == np.float32(np.float16(1 / 3))


def test_fp16_to_fp32_is_exact():
    for h in (ALL_FP16, ALL_FP16[np.isfinite(ALL_FP16)]):       # with inf/NaN (numpy's cast) and without
        out = np.empty(h.shape, np.float32)
        fp16_to_fp32(h, out)
        assert np.array_equal(out.view(np.uint32), quiet(h.astype(np.float32)).view(np.uint32))
    for strided in (ALL_FP16.reshape(256, 256)[:, ::3], ALL_FP16.reshape(256, 256)[:, 10:250]):   # numpy's; vImage's
        out = np.empty(strided.shape, np.float32)
        fp16_to_fp32(strided, out)
        assert np.array_equal(out.view(np.uint32), quiet(strided.astype(np.float32)).view(np.uint32))


def test_fp32_to_fp16_is_exact():
    for h in (ALL_FP16, ALL_FP16[np.isfinite(ALL_FP16)]):
        out = np.empty(h.shape, np.float16)
        fp32_to_fp16(h.astype(np.float32), out, Scratch())
        assert np.array_equal(out.view(np.uint16), quiet(h).view(np.uint16))
    src = ALL_FP16[:30000].astype(np.float32).reshape(100, 300)
    for dst in (np.empty((100, 300), np.float16), np.empty((300, 100), np.float16).T, np.empty((100, 300), np.float32)):
        fp32_to_fp16(src, dst)                                    # numpy's cast for other layouts and dtypes
        assert np.array_equal(dst, src)
