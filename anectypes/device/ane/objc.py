"""Objective-C messaging through ctypes: Apple's runtime on macOS, the GNU runtime + GNUstep Foundation elsewhere.

    with autorelease_pool():                      # factory results are autoreleased: valid until the pool drains
        keep = Object.retained(nsarray([nsstring("@model_path/weights/w.bin")]))   # +1 that outlives the pool
    send(keep, "count", restype=ctypes.c_size_t)  # -> 1; keep.release() (or __del__) gives the reference back

Every send uses one fixed prototype per signature, never a variadic call (linux-testing.md §A2 gotcha 2,
docs/ane-reference.md §1.14). A selector the receiver lacks kills the process (GNUstep exits on the uncaught exception,
macOS aborts): check responds()/instances_respond() before any private selector (§A2 gotcha 8).
The runtime loads on first use, not at import.
"""

import ctypes
import ctypes.util
import functools
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from ...errors import ObjCError
from ...host.system import c_function

c_void_p, c_bool, c_size_t = ctypes.c_void_p, ctypes.c_bool, ctypes.c_size_t
_APPLE_LIBS = ("/usr/lib/libobjc.A.dylib", "/System/Library/Frameworks/Foundation.framework/Foundation")
_GNU_LIBS = (("objc", "libobjc.so.4"), ("gnustep-base", "libgnustep-base.so.1.28"))  # linux-testing.md §A1
_GNU_HINT = "install GNUstep Foundation (Debian/Ubuntu: apt-get install -y --no-install-recommends libgnustep-base1.28)"


def _load():
    """Load libobjc + Foundation and bind the few C entry points (uncached; runtime() caches it)."""
    apple = sys.platform == "darwin"
    paths = _APPLE_LIBS if apple else tuple(ctypes.util.find_library(n) or default for n, default in _GNU_LIBS)
    try:  # RTLD_GLOBAL: gnustep-base resolves its objc_* symbols against the already loaded runtime (§A1)
        objc, foundation = (ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL) for p in paths)
        rt = SimpleNamespace(kind="apple" if apple else "gnu", objc=objc, foundation=foundation, paths=paths)
        rt.get_class = c_function(objc, "objc_getClass", c_void_p, [ctypes.c_char_p])  # default c_int truncates (§A2)
        rt.register_sel = c_function(objc, "sel_registerName", c_void_p, [ctypes.c_char_p])
        rt.temporary_directory = c_function(foundation, "NSTemporaryDirectory", c_void_p, [])
        if apple:
            msg_send = ctypes.cast(objc.objc_msgSend, c_void_p).value
            rt.imp = lambda receiver, selector: msg_send
            rt.pool_push = c_function(objc, "objc_autoreleasePoolPush", c_void_p, [])  # what @autoreleasepool calls
            rt.pool_pop = c_function(objc, "objc_autoreleasePoolPop", None, [c_void_p])
        else:  # the GNU runtime has no objc_msgSend: look the IMP up, then call it with the same prototype (§A TL;DR)
            rt.imp = c_function(objc, "objc_msg_lookup", c_void_p, [c_void_p, c_void_p])
            # nor objc_autoreleasePoolPush/Pop (§A2 gotcha 5): a pool object, drained to pop
            rt.pool_push = lambda: send(cls("NSAutoreleasePool"), "new")
            rt.pool_pop = lambda pool: send(pool, "drain", restype=None)
    except (OSError, AttributeError) as e:
        hint = "Foundation ships with macOS" if apple else _GNU_HINT
        raise ObjCError(f"cannot load the Objective-C runtime and Foundation ({e}); {hint}") from None
    return rt


@functools.cache
def runtime():
    """The loaded runtime: .kind ("apple" or "gnu"), .objc and .foundation (CDLLs), .paths. Raises ObjCError."""
    return _load()


def available():
    """True when the Objective-C runtime and Foundation can be loaded."""
    try:
        return bool(runtime())
    except ObjCError:
        return False


_classes, _selectors, _prototypes, _functions = {}, {}, {}, {}


def cls(name):
    """The class pointer for `name`, or None if no such class is registered (yet)."""
    ptr = _classes.get(name)
    if ptr is None:
        ptr = runtime().get_class(name.encode())
        if ptr:  # cache hits only: private classes appear once their framework (or a test fake) loads (§A2 gotcha 8)
            _classes[name] = ptr
    return ptr


def sel(name):
    return _selectors.get(name) or _selectors.setdefault(name, runtime().register_sel(name.encode()))


def prototype(restype=c_void_p, argtypes=()):
    """The cached CFUNCTYPE(restype, id, SEL, *argtypes) for one message signature."""
    key = (restype, tuple(argtypes))
    return _prototypes.get(key) or _prototypes.setdefault(key, ctypes.CFUNCTYPE(restype, c_void_p, c_void_p, *key[1]))


def function(imp, restype, argtypes):
    """The callable for one IMP (on macOS always objc_msgSend) and signature, made once and cached."""
    key = (imp, restype, argtypes)
    f = _functions.get(key)
    if f is None:
        f = _functions[key] = prototype(restype, argtypes)(imp)
    return f


def _ptr(x):  # an int, an Object, a c_void_p or None -> an int or None
    x = getattr(x, "_as_parameter_", x)
    return (x.value if isinstance(x, c_void_p) else x) or None


def send(receiver, selector, *args, restype=c_void_p, argtypes=()):
    """[receiver selector args...] with an explicit signature. Object results come back as int or None."""
    if len(args) != len(argtypes):  # a CFUNCTYPE would pass extra arguments variadically (§A2 gotcha 2)
        raise TypeError(f"{selector}: {len(args)} arguments but {len(argtypes)} argtypes")
    receiver = _ptr(receiver)
    if receiver is None:  # messaging nil does nothing and returns zero, as in Objective-C
        zero = restype() if restype is not None else None
        return getattr(zero, "value", zero)
    s = _selectors.get(selector) or sel(selector)
    return function(runtime().imp(receiver, s), restype, tuple(argtypes))(receiver, s, *args)


def send_checked(receiver, selector, *args, argtypes=()):
    """Send a BOOL method whose last parameter is NSError **; on NO raise ObjCError with the error's description."""
    error = c_void_p()
    if send(receiver, selector, *args, ctypes.byref(error), restype=c_bool,
            argtypes=(*argtypes, ctypes.POINTER(c_void_p))):
        return True
    raise ObjCError(f"{selector} failed: {error_text(error.value)}")


def error_text(error):
    """An NSError in one line: its localized description, then its domain, code and userInfo (where a framework
    puts the underlying error and the compiler's own messages, which the localized description leaves out)."""
    if not is_kind(error, "NSError"):
        return description(error) if error else "no error description"
    text, domain = to_str(send(error, "localizedDescription")), to_str(send(error, "domain"))
    code, info = send(error, "code", restype=ctypes.c_long), description(send(error, "userInfo"))
    return " ".join(f"{text} (domain {domain}, code {code}, userInfo {info})".split())   # Apple's info spans lines


def responds(receiver, selector):  # receiver: an instance or a class; False for nil
    return send(receiver, "respondsToSelector:", sel(selector), restype=c_bool, argtypes=(c_void_p,))


def instances_respond(cls_ptr, selector):  # whether instances of the class cls_ptr implement selector
    return send(cls_ptr, "instancesRespondToSelector:", sel(selector), restype=c_bool, argtypes=(c_void_p,))


# Foundation helpers: each returns an autoreleased pointer (int), valid inside autorelease_pool(); retain to keep.

def nsstring(text):
    data = text.encode()
    if b"\0" in data:  # stringWithUTF8String: stops at the first NUL
        raise ValueError("nsstring: text must not contain NUL characters")
    return send(cls("NSString"), "stringWithUTF8String:", data, argtypes=(ctypes.c_char_p,))


def to_str(nsstring_ptr):
    raw = send(nsstring_ptr, "UTF8String", restype=ctypes.c_char_p)
    return None if raw is None else raw.decode()


def nsdata(buffer):
    """An NSData holding a COPY of bytes, bytearray, memoryview or a C-contiguous numpy array (ValueError if not
    contiguous): whoever keeps the NSData (a descriptor keeps its MIL text and weights until it saves the model's
    files) never depends on Python memory. A copy costs far less than the compile it feeds (§1.14)."""
    flat = np.frombuffer(buffer, dtype=np.uint8)
    return send(cls("NSData"), "dataWithBytes:length:", flat.ctypes.data, flat.nbytes, argtypes=(c_void_p, c_size_t))


def nsdata_bytes(ptr):
    size = send(ptr, "length", restype=c_size_t)
    return ctypes.string_at(send(ptr, "bytes"), size) if size else b""


def nsnumber(value):  # long long covers every index and offset the ANE calls pass (§1.14)
    return send(cls("NSNumber"), "numberWithLongLong:", int(value), argtypes=(ctypes.c_longlong,))


def number_value(ptr):
    return send(ptr, "longLongValue", restype=ctypes.c_longlong)


def _id_array(items, what):
    ptrs = [_ptr(x) for x in items]
    if not all(ptrs):  # a nil element raises NSInvalidArgumentException, which kills the process on GNUstep
        raise ObjCError(f"{what} cannot hold nil (element {ptrs.index(None)})")
    return (c_void_p * len(ptrs))(*ptrs)


def nsarray(items):  # items: object pointers (ints or Objects), none nil
    items = list(items)
    return send(cls("NSArray"), "arrayWithObjects:count:", _id_array(items, "NSArray"), len(items),
                argtypes=(c_void_p, c_size_t))


def nsdictionary(mapping):  # {key pointer: value pointer}, ints or Objects, none nil
    keys = list(mapping)
    values = _id_array([mapping[k] for k in keys], "NSDictionary value")
    return send(cls("NSDictionary"), "dictionaryWithObjects:forKeys:count:", values,
                _id_array(keys, "NSDictionary key"), len(keys), argtypes=(c_void_p, c_void_p, c_size_t))


def array_items(ptr):
    count = send(ptr, "count", restype=c_size_t)
    return [send(ptr, "objectAtIndex:", i, argtypes=(c_size_t,)) for i in range(count)]


def dict_items(ptr):
    return {k: send(ptr, "objectForKey:", k, argtypes=(c_void_p,)) for k in array_items(send(ptr, "allKeys"))}


def description(ptr):  # -description as str, for messages and debugging
    return to_str(send(ptr, "description"))


def is_kind(obj, class_name):  # False if the class does not exist or obj is nil
    klass = cls(class_name)
    return bool(klass) and send(obj, "isKindOfClass:", klass, restype=c_bool, argtypes=(c_void_p,))


def retain_count(ptr):  # for tests and leak hunting only
    return send(ptr, "retainCount", restype=c_size_t)


def temporary_directory():  # NSTemporaryDirectory(): the framework reads this directory (docs/ane-reference.md §1.14)
    with autorelease_pool():
        return to_str(runtime().temporary_directory())


@contextmanager
def autorelease_pool():
    """Drain autoreleased objects on exit. Pools nest; every thread that sends needs its own (§A2 gotcha 5)."""
    rt = runtime()
    token = rt.pool_push()
    try:
        yield
    finally:
        rt.pool_pop(token)


_held = set()  # ids of Objects holding a reference; set.add/discard are atomic under the GIL


def live_objects():  # Object references held and not yet released, for leak checks
    return len(_held)


class Object:
    """Owns one +1 reference to an Objective-C object; release() or __del__ gives it back. Nil is allowed (falsy)."""

    __slots__ = ("ptr", "__weakref__")

    def __init__(self, ptr):  # takes over a +1 reference the caller already holds
        self.ptr = _ptr(ptr)
        if self.ptr:
            _held.add(id(self))

    @classmethod
    def owned(klass, ptr):  # results of alloc/init, new, copy, mutableCopy are already +1
        return klass(ptr)

    @classmethod
    def retained(klass, ptr):  # autoreleased factory results: retain so they outlive the pool (§A2 gotcha 9)
        return klass(send(ptr, "retain"))

    _as_parameter_ = property(lambda self: self.ptr)  # lets an Object go wherever ctypes expects a c_void_p

    def send(self, selector, *args, restype=c_void_p, argtypes=()):
        return send(self.ptr, selector, *args, restype=restype, argtypes=argtypes)

    def release(self):  # idempotent; in a pool of its own: __del__ may run on any thread (cyclic GC), with none
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            _held.discard(id(self))
            with autorelease_pool():               # what the last release's dealloc autoreleases is drained here
                send(ptr, "release", restype=None)

    def __del__(self, _finalizing=sys.is_finalizing):
        if not _finalizing():  # at interpreter shutdown module globals and the runtime may already be gone
            self.release()

    def __bool__(self):
        return bool(self.ptr)
