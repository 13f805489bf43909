"""This machine: its memory (what every "cannot fit" check compares with), its CPU's vector unit, and its C
libraries' functions as ctypes calls them."""

import ctypes
import os
import platform


def physical_memory():
    """This machine's memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def return_freed_memory():
    """Hand the memory freed so far back to the system, where the C library keeps it: glibc's malloc leaves freed
    blocks below its heaps' tops resident (arrays of up to 32 MiB land there once larger ones have been freed, by its
    sliding mmap threshold), and malloc_trim releases them. Other C libraries have no malloc_trim: nothing to do."""
    try:
        trim = c_function(ctypes.CDLL(None), "malloc_trim", ctypes.c_int, [ctypes.c_size_t])
    except AttributeError:
        return
    trim(0)


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
