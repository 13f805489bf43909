"""This machine: its memory (what every "cannot fit" check compares with), its CPU's vector unit, and its C
libraries' functions as ctypes calls them."""

import os
import platform


def physical_memory():
    """This machine's memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def simd_level():
    """The widest SIMD the CPU offers the BLAS and numpy: "AVX-512", "AVX2", "AVX", "SSE" or "NEON"."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "NEON"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"))
                 if flag in flags), "SSE")


def c_function(lib, name, restype, argtypes):
    """`lib`'s C function `name` with its prototype declared (ctypes would pass and return C ints)."""
    f = getattr(lib, name)
    f.restype, f.argtypes = restype, argtypes
    return f
