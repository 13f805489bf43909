"""IOSurface through ctypes (docs/ane-reference.md §1.6): linear byte buffers the ANE reads and writes.

A surface is one row of N bytes (Width = BytesPerRow = AllocSize = N, Height 1, BytesPerElement 1,
PixelFormat 0) holding a channel-first `[1, C, 1, S]` fp16 tensor. The property dictionary is built
with NSDictionary/NSNumber (toll-free bridged to CFDictionary) and keyed by IOSurface's exported
`kIOSurface*` constants, so that part runs on any Objective-C runtime; only the IOSurface C functions
themselves need macOS (tests stand in for them).

The CPU touches a surface's memory only between IOSurfaceLock and IOSurfaceUnlock, as both
references do (§1.15): `with surface.locked(write=True):` around every write, `write=False` (the
read-only lock) around every read or copy. Arrays over the memory hold their own CFRetain, so a
view that outlives `release()` still points at mapped memory.
"""

import ctypes
import sys
from contextlib import contextmanager
from ctypes import c_int32, c_size_t, c_uint32, c_void_p
from types import SimpleNamespace

import numpy as np

from . import objc
from ...errors import DeviceError
from ...host.system import c_function

IOSURFACE_PATH = "/System/Library/Frameworks/IOSurface.framework/IOSurface"
COREFOUNDATION_PATH = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
LOCK_READ_ONLY = 1                      # kIOSurfaceLockReadOnly; writes lock with 0 (§1.6)
KEYS = ("kIOSurfaceWidth", "kIOSurfaceHeight", "kIOSurfaceBytesPerElement", "kIOSurfaceBytesPerRow",
        "kIOSurfaceAllocSize", "kIOSurfacePixelFormat")     # exported CFStringRef constants (§1.6)

_lib = None


def bind(iosurface, corefoundation, keys):
    """Declare the C signatures on a loaded IOSurface and CoreFoundation (or stand-ins for tests);
    `keys`: the value of each of KEYS (a CFStringRef)."""
    return SimpleNamespace(
        create=c_function(iosurface, "IOSurfaceCreate", c_void_p, [c_void_p]),
        lock=c_function(iosurface, "IOSurfaceLock", c_int32, [c_void_p, c_uint32, c_void_p]),     # kern_return_t
        unlock=c_function(iosurface, "IOSurfaceUnlock", c_int32, [c_void_p, c_uint32, c_void_p]),
        base=c_function(iosurface, "IOSurfaceGetBaseAddress", c_void_p, [c_void_p]),
        alloc_size=c_function(iosurface, "IOSurfaceGetAllocSize", c_size_t, [c_void_p]),
        retain=c_function(corefoundation, "CFRetain", c_void_p, [c_void_p]),
        release=c_function(corefoundation, "CFRelease", None, [c_void_p]), keys=dict(keys))


def use_library(iosurface, corefoundation, keys=None):
    """Use these libraries and key constants (tests pass host-memory stand-ins); None: the system's."""
    global _lib
    _lib = None if iosurface is None else bind(iosurface, corefoundation, keys)


def library():
    global _lib
    if _lib is None:
        if sys.platform != "darwin":
            raise DeviceError("IOSurface exists only on macOS")
        lib = ctypes.CDLL(IOSURFACE_PATH)
        _lib = bind(lib, ctypes.CDLL(COREFOUNDATION_PATH), {k: c_void_p.in_dll(lib, k).value for k in KEYS})
    return _lib


class Mapping:
    """A surface's memory for numpy (`np.asarray(Mapping(s))`: bytes), holding its own CFRetain of
    the IOSurface until the last array over it is gone."""

    def __init__(self, surface):
        self.lib, self.ref = surface.lib, surface.lib.retain(surface.ref)
        self.__array_interface__ = dict(version=3, shape=(surface.nbytes,), typestr="|u1",
                                        data=(surface.address, False))

    def __del__(self, _finalizing=sys.is_finalizing):
        if not _finalizing():   # at interpreter shutdown the process is about to unmap everything anyway
            self.lib.release(self.ref)


class IOSurface:
    """One IOSurface of `nbytes` bytes; `address` is its base address (stable for a linear buffer)."""

    def __init__(self, nbytes):
        lib = library()
        props = (("kIOSurfaceWidth", nbytes), ("kIOSurfaceHeight", 1), ("kIOSurfaceBytesPerElement", 1),
                 ("kIOSurfaceBytesPerRow", nbytes), ("kIOSurfaceAllocSize", nbytes), ("kIOSurfacePixelFormat", 0))
        with objc.autorelease_pool():
            ref = lib.create(objc.nsdictionary({lib.keys[k]: objc.nsnumber(v) for k, v in props}))
        if not ref:
            raise DeviceError(f"IOSurfaceCreate failed for {nbytes} bytes")
        self.ref, self.nbytes, self.lib = ref, nbytes, lib
        size = lib.alloc_size(ref)
        if size < nbytes:
            self.release()
            raise DeviceError(f"IOSurfaceCreate gave {size} bytes, {nbytes} were asked for")
        with self.locked(write=False):          # the address, as the references take it: under a lock
            self.address = lib.base(ref)

    @contextmanager
    def locked(self, write):
        """IOSurfaceLock for the block: 0 to write (and read), read-only to read (§1.6, §1.15)."""
        flags = 0 if write else LOCK_READ_ONLY
        kr = self.lib.lock(self.ref, flags, None)
        if kr:
            raise DeviceError(f"IOSurfaceLock failed (kern_return {kr})")
        try:
            yield
        finally:
            kr = self.lib.unlock(self.ref, flags, None)
            if kr:
                raise DeviceError(f"IOSurfaceUnlock failed (kern_return {kr})")

    def array(self, dtype, shape):
        """The first prod(shape) elements of the memory as a numpy array of `shape` (zero copy; it
        keeps the surface alive). Touch its data only inside `locked()`."""
        count = int(np.prod(shape))
        return np.asarray(Mapping(self)).view(dtype)[:count].reshape(shape)

    def release(self):
        if self.ref:
            self.lib.release(self.ref)
            self.ref = None
