"""IOSurface through ctypes (docs/ane-reference.md §1.6): linear byte buffers the ANE reads and writes.

A surface is one row of N bytes (Width = BytesPerRow = AllocSize = N, Height 1, BytesPerElement 1,
PixelFormat 0) holding a channel-first `[1, C, 1, S]` fp16 tensor. The property dictionary is built
with NSDictionary/NSNumber/NSString (toll-free bridged to CFDictionary), so that part runs on any
Objective-C runtime; only the IOSurface C functions themselves need macOS (tests stand in for them).
"""

import ctypes
import sys
from ctypes import c_int32, c_size_t, c_uint32, c_void_p
from types import SimpleNamespace

from . import objc
from ...errors import DeviceError

IOSURFACE_PATH = "/System/Library/Frameworks/IOSurface.framework/IOSurface"
COREFOUNDATION_PATH = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
LOCK_READ_ONLY = 1                      # kIOSurfaceLockReadOnly; writes lock with 0 (§1.6)

_lib = None


def bind(iosurface, corefoundation):
    """Declare the C signatures on a loaded IOSurface and CoreFoundation (or stand-ins for tests)."""
    f = SimpleNamespace(create=iosurface.IOSurfaceCreate, lock=iosurface.IOSurfaceLock,
                        unlock=iosurface.IOSurfaceUnlock, base=iosurface.IOSurfaceGetBaseAddress,
                        alloc_size=iosurface.IOSurfaceGetAllocSize, release=corefoundation.CFRelease)
    f.create.argtypes, f.create.restype = [c_void_p], c_void_p
    for fn in (f.lock, f.unlock):
        fn.argtypes, fn.restype = [c_void_p, c_uint32, c_void_p], c_int32     # kern_return_t
    f.base.argtypes, f.base.restype = [c_void_p], c_void_p
    f.alloc_size.argtypes, f.alloc_size.restype = [c_void_p], c_size_t
    f.release.argtypes, f.release.restype = [c_void_p], None
    return f


def use_library(iosurface, corefoundation):
    """Use these libraries (tests pass host-memory stand-ins that export the same functions); None: the system's."""
    global _lib
    _lib = None if iosurface is None else bind(iosurface, corefoundation)


def library():
    global _lib
    if _lib is None:
        if sys.platform != "darwin":
            raise DeviceError("IOSurface exists only on macOS")
        _lib = bind(ctypes.CDLL(IOSURFACE_PATH), ctypes.CDLL(COREFOUNDATION_PATH))
    return _lib


class IOSurface:
    """One IOSurface of `nbytes` bytes; `address` is its base address (stable for a linear buffer)."""

    def __init__(self, nbytes):
        lib = library()
        props = (("IOSurfaceWidth", nbytes), ("IOSurfaceHeight", 1), ("IOSurfaceBytesPerElement", 1),
                 ("IOSurfaceBytesPerRow", nbytes), ("IOSurfaceAllocSize", nbytes), ("IOSurfacePixelFormat", 0))
        with objc.autorelease_pool():
            ref = lib.create(objc.nsdictionary({objc.nsstring(k): objc.nsnumber(v) for k, v in props}))
        if not ref:
            raise DeviceError(f"IOSurfaceCreate failed for {nbytes} bytes")
        self.ref, self.nbytes, self.lib = ref, nbytes, lib
        size = lib.alloc_size(ref)
        if size < nbytes:
            self.release()
            raise DeviceError(f"IOSurfaceCreate gave {size} bytes, {nbytes} were asked for")
        self.lock()
        self.address = lib.base(ref)
        self.unlock()

    def lock(self, read_only=False):
        kr = self.lib.lock(self.ref, LOCK_READ_ONLY if read_only else 0, None)
        if kr:
            raise DeviceError(f"IOSurfaceLock failed (kern_return {kr})")

    def unlock(self, read_only=False):
        kr = self.lib.unlock(self.ref, LOCK_READ_ONLY if read_only else 0, None)
        if kr:
            raise DeviceError(f"IOSurfaceUnlock failed (kern_return {kr})")

    def buffer(self):
        """The surface's bytes as a ctypes array (zero copy): wrap it with numpy."""
        return (ctypes.c_char * self.nbytes).from_address(self.address)

    def release(self):
        if self.ref:
            self.lib.release(self.ref)
            self.ref = None
