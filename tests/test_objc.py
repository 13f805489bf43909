"""anectypes.device.ane.objc through real message sends: GNU Objective-C runtime + GNUstep Foundation (linux-testing.md §A).

CI installs libgnustep-base1.28; there a missing runtime FAILS these tests. Elsewhere they are skipped.
"""

import ctypes
import gc
import os
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

from anectypes.device.ane import objc
from anectypes.device.ane.objc import Object, autorelease_pool, send
from anectypes.errors import DeviceError, ObjCError
from anectypes.host.system import c_function

c_void_p, c_bool, c_size_t, c_uint = ctypes.c_void_p, ctypes.c_bool, ctypes.c_size_t, ctypes.c_uint
pytestmark = pytest.mark.usefixtures("objc_runtime")     # conftest.py: FAILS in CI without it, skips elsewhere


@pytest.fixture
def pool():
    with autorelease_pool():
        yield


def test_import_has_no_side_effects():
    code = ("import os, anectypes.device.ane.objc as o; maps = '/proc/self/maps'; "
            "print(o.runtime.cache_info().currsize, open(maps).read().count('libobjc') if os.path.exists(maps) else 0)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.split() == ["0", "0"]  # nothing loaded until first use


def test_runtime_kind_and_missing_library_message(monkeypatch):
    rt = objc.runtime()
    assert rt is objc.runtime() and rt.kind == ("apple" if sys.platform == "darwin" else "gnu")
    if sys.platform != "darwin":
        monkeypatch.setattr(objc, "_GNU_LIBS", (("no-such-objc", "libno-such-objc.so.9"),) * 2)
        monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
        with pytest.raises(ObjCError, match="apt-get install .*libgnustep-base1.28") as e:
            objc._load()
        assert isinstance(e.value, DeviceError)


def test_class_lookup():
    assert objc.cls("NSObject") and objc.cls("NSString") and objc.cls("NSObject") != objc.cls("NSString")
    assert objc.cls("AnectypesNoSuchClass") is None


def test_class_registered_later_is_found():
    # Private classes appear only after their framework loads (§A2 gotcha 8): a miss must not be cached.
    name = "AnectypesLate" + uuid.uuid4().hex[:8]
    assert objc.cls(name) is None
    lib = ctypes.CDLL(objc.runtime().paths[0])  # own handle: leave the shared CDLL's argtypes alone
    allocate = c_function(lib, "objc_allocateClassPair", c_void_p, [c_void_p, ctypes.c_char_p, c_size_t])
    klass = allocate(objc.cls("NSObject"), name.encode(), 0)
    c_function(lib, "objc_registerClassPair", None, [c_void_p])(klass)
    assert objc.cls(name) == klass
    assert objc.instances_respond(klass, "description") and not objc.instances_respond(klass, "anectypesNope")


def test_selectors_cached():
    assert objc.sel("description") == objc.sel("description") != objc.sel("length")


def test_string_round_trip(pool):
    for text in ["", "hi", "héllo ANE", "@model_path/weights/w.bin", "日本語 ✓ 🚀"]:
        s = objc.nsstring(text)
        assert objc.is_kind(s, "NSString") and objc.to_str(s) == text
    assert send(objc.nsstring("héllo ANE"), "length", restype=c_size_t) == 9  # UTF-16 units, not bytes
    assert objc.to_str(None) is None
    with pytest.raises(ValueError):
        objc.nsstring("a\0b")


def test_nsdata_holds_a_copy(pool):
    """Whoever keeps the NSData (a descriptor) must not depend on Python memory (§1.14)."""
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    d = objc.nsdata(a)
    assert send(d, "bytes") != a.ctypes.data and send(d, "length", restype=c_size_t) == a.nbytes
    a[1, 2] = 2.5                           # later writes do not show through
    del a
    gc.collect()
    assert np.array_equal(np.frombuffer(objc.nsdata_bytes(d), np.float16), np.arange(6))
    buf = bytearray(b"abcd")
    d2 = objc.nsdata(memoryview(buf))
    buf[0] = ord("z")
    assert objc.nsdata_bytes(d2) == b"abcd"
    with pytest.raises(ValueError):
        objc.nsdata(np.zeros(8)[::2])  # not contiguous


def test_nsdata_bytes_round_trip(pool):
    blob = bytes(range(256)) + b"\x00\xff\x00"
    assert objc.nsdata_bytes(objc.nsdata(blob)) == blob and objc.nsdata_bytes(objc.nsdata(b"")) == b""
    assert objc.nsdata_bytes(objc.nsdata(bytearray(b"\xff\x00"))) == b"\xff\x00"


def test_nsnumber(pool):
    for v in [0, 1, -7, 2**40, -(2**63), 2**63 - 1]:
        assert objc.number_value(objc.nsnumber(v)) == v
    assert objc.is_kind(objc.nsnumber(3), "NSNumber")


def test_unsigned_int_argument(pool):
    # The QoS argument of compileWithQoS: is an unsigned int (docs/ane-reference.md §1.14).
    for v in [21, 2**32 - 1]:
        n = send(objc.cls("NSNumber"), "numberWithUnsignedInt:", v, argtypes=(c_uint,))
        assert send(n, "unsignedIntValue", restype=c_uint) == v


def test_bool_returns(pool):
    a, b = objc.nsstring("x"), objc.nsstring("y")
    assert send(a, "isEqual:", objc.nsstring("x"), restype=c_bool, argtypes=(c_void_p,)) is True
    assert send(a, "isEqual:", b, restype=c_bool, argtypes=(c_void_p,)) is False
    assert objc.responds(a, "length") is True and objc.responds(a, "anectypesNoSuchSelector") is False
    assert objc.instances_respond(objc.cls("NSString"), "length") is True
    assert objc.responds(objc.cls("NSString"), "stringWithUTF8String:")  # class methods via the class


def test_array_round_trip(pool):
    items = [objc.nsstring("a"), objc.nsnumber(5), objc.nsdata(b"\x01")]
    arr = objc.nsarray(items)
    assert objc.is_kind(arr, "NSArray") and objc.array_items(arr) == items
    assert objc.array_items(objc.nsarray([])) == []
    with pytest.raises(ObjCError, match="nil"):
        objc.nsarray([items[0], None])


def test_nested_weights_dictionary(pool):
    # The descriptor's weights dict: {"@model_path/weights/w.bin": {"offset": @0, "data": NSData}} (§1.4).
    blob = b"\x00\xffblob"
    inner = objc.nsdictionary({objc.nsstring("offset"): objc.nsnumber(0), objc.nsstring("data"): objc.nsdata(blob)})
    weights = objc.nsdictionary({objc.nsstring("@model_path/weights/w.bin"): inner})
    got = {objc.to_str(k): v for k, v in objc.dict_items(weights).items()}
    assert list(got) == ["@model_path/weights/w.bin"] and objc.is_kind(got["@model_path/weights/w.bin"], "NSDictionary")
    fields = {objc.to_str(k): v for k, v in objc.dict_items(got["@model_path/weights/w.bin"]).items()}
    assert objc.number_value(fields["offset"]) == 0 and objc.nsdata_bytes(fields["data"]) == blob
    assert objc.is_kind(fields["data"], "NSData") and not objc.is_kind(fields["data"], "NSDictionary")
    assert "offset" in objc.description(weights)
    assert objc.dict_items(objc.nsdictionary({})) == {}
    assert send(weights, "objectForKey:", objc.nsstring("missing"), argtypes=(c_void_p,)) is None
    with pytest.raises(ObjCError, match="nil"):
        objc.nsdictionary({objc.nsstring("k"): None})


def test_send_checked_raises_with_nserror_description(pool, tmp_path):
    manager = send(objc.cls("NSFileManager"), "defaultManager")
    missing = objc.nsstring(str(tmp_path / "missing"))
    with pytest.raises(ObjCError, match=r"^removeItemAtPath:error: failed: .*No such file or directory"):
        objc.send_checked(manager, "removeItemAtPath:error:", missing, argtypes=(c_void_p,))
    present = tmp_path / "present"
    present.write_bytes(b"x")
    assert objc.send_checked(manager, "removeItemAtPath:error:", objc.nsstring(str(present)), argtypes=(c_void_p,))
    assert not present.exists()


def test_messaging_nil():
    assert send(None, "description") is None and send(0, "description") is None
    assert send(None, "length", restype=c_size_t) == 0
    assert send(None, "isEqual:", 0, restype=c_bool, argtypes=(c_void_p,)) is False
    assert send(None, "doubleValue", restype=ctypes.c_double) == 0.0
    assert send(None, "release", restype=None) is None
    assert objc.responds(None, "description") is False and objc.to_str(None) is None
    with pytest.raises(ObjCError, match="no error description"):
        objc.send_checked(None, "removeItemAtPath:error:", 0, argtypes=(c_void_p,))


def test_argument_count_must_match_argtypes(pool):
    with pytest.raises(TypeError, match="argtypes"):
        send(objc.nsstring("x"), "isEqual:", 0)  # would otherwise be passed variadically


def test_prototype_and_function_caches():
    p = objc.prototype(c_bool, (c_void_p,))
    assert objc.prototype(c_bool, [c_void_p]) is p
    assert objc.prototype(c_void_p, ()) is objc.prototype() and objc.prototype(c_bool, ()) is not p
    equal = lambda: send(objc.nsstring("a"), "isEqual:", objc.nsstring("a"), restype=c_bool, argtypes=(c_void_p,))
    with autorelease_pool():
        assert equal()
        made = len(objc._functions)
        for _ in range(100):        # a configured function per IMP and signature, made once
            assert equal()
    assert objc.prototype(c_bool, (c_void_p,)) is p and len(objc._functions) == made


def test_autorelease_pool_drains():
    before = objc.live_objects()
    with autorelease_pool():
        ptr = send(objc.cls("NSMutableArray"), "array")  # autoreleased: +1 owned by the pool
        kept = Object.retained(ptr)
        assert objc.retain_count(ptr) == 2 and objc.live_objects() == before + 1
    assert objc.retain_count(kept) == 1  # the pool let go; our retain keeps it alive
    assert send(kept, "count", restype=c_size_t) == 0
    kept.release()
    assert not kept and objc.live_objects() == before


def test_nested_pools():
    obj = Object.owned(send(objc.cls("NSObject"), "new"))
    autorelease = lambda: send(send(obj, "retain"), "autorelease")
    with autorelease_pool():
        autorelease()
        with autorelease_pool():
            autorelease()
            assert objc.retain_count(obj) == 3
        assert objc.retain_count(obj) == 2        # the inner pool drained what it received, only that
    assert objc.retain_count(obj) == 1
    obj.release()


DEALLOCS = []


@pytest.fixture(scope="module")
def autoreleasing_dealloc():
    """A class whose dealloc autoreleases an object (as a framework's may), and that object's class, which
    counts its deallocations: the autoreleased object is freed only if a pool was in place."""
    if objc.runtime().kind != "gnu":
        pytest.skip("classes are defined through the GNU runtime (tests/support/fake_ane.py)")
    from support.fake_ane import define_class, super_dealloc

    def dealloc(receiver):
        send(send(objc.cls("CountsDeallocs"), "new"), "autorelease")
        super_dealloc(receiver)

    if not objc.cls("CountsDeallocs"):
        define_class("CountsDeallocs", {"dealloc": ("v@:", lambda r: (DEALLOCS.append(r), super_dealloc(r)))}, {})
        define_class("AutoreleasesInDealloc", {"dealloc": ("v@:", dealloc)}, {})


def test_no_pool_leak_when_an_object_is_collected_on_another_thread(autoreleasing_dealloc, capfd):
    """Object.__del__ runs wherever the cyclic GC runs, with no pool there: release() brings its own."""
    gc.collect()
    gc.disable()
    try:
        cycle = [Object.owned(send(objc.cls("AutoreleasesInDealloc"), "new"))]
        cycle.append(cycle)                  # only the cyclic collector frees it
        del cycle
        count = len(DEALLOCS)
        thread = threading.Thread(target=gc.collect)
        thread.start()
        thread.join()
    finally:
        gc.enable()
    assert len(DEALLOCS) == count + 1       # what the dealloc autoreleased was drained, on that thread
    assert "without pool" not in capfd.readouterr().err


def test_ownership_owned_and_retained():
    before = objc.live_objects()
    ptr = send(send(objc.cls("NSObject"), "alloc"), "init")  # +1, ours
    send(ptr, "retain")  # an extra reference so the count stays observable after the Objects let go
    start = objc.retain_count(ptr)
    owned = Object.owned(send(ptr, "retain"))  # a +1 handed over, as alloc/copy results are
    assert objc.retain_count(ptr) == start + 1
    retained = Object.retained(ptr)
    assert objc.retain_count(ptr) == start + 2 and objc.live_objects() == before + 2
    assert owned.ptr == retained.ptr == ptr and owned.send("isEqual:", retained, restype=c_bool, argtypes=(c_void_p,))
    owned.release()
    owned.release()  # idempotent
    assert objc.retain_count(ptr) == start + 1 and not owned and retained
    del retained  # __del__ releases
    gc.collect()
    assert objc.retain_count(ptr) == start and objc.live_objects() == before
    send(ptr, "release")
    send(ptr, "release")


def test_live_objects_back_to_zero():
    before = objc.live_objects()
    with autorelease_pool():
        objs = [Object.retained(objc.nsnumber(i)) for i in range(10)]
        objs += [Object.owned(send(objc.cls("NSObject"), "new")) for _ in range(3)]
        assert objc.live_objects() == before + 13
    assert Object.owned(None).ptr is None and not Object.retained(None) and objc.live_objects() == before + 13
    objs[0].release()
    del objs
    gc.collect()
    assert objc.live_objects() == before  # 0 when run alone


def test_temporary_directory():
    path = objc.temporary_directory()
    assert isinstance(path, str) and os.path.isabs(path) and os.path.isdir(path)


def test_sends_from_four_threads():
    results, errors = {}, []

    def work(k):
        try:
            with autorelease_pool():  # every thread needs its own pool (§A2 gotcha 5)
                out = []
                for i in range(200):
                    s = objc.nsstring(f"t{k}-{i}")
                    n = send(objc.cls("NSNumber"), "numberWithUnsignedInt:", i, argtypes=(c_uint,))
                    out.append((objc.to_str(s), send(n, "unsignedIntValue", restype=c_uint)))
                kept = Object.retained(objc.nsarray([objc.nsnumber(k)]))
            results[k] = (out, objc.number_value(objc.array_items(kept)[0]))
            kept.release()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(4):
        out, value = results[k]
        assert out == [(f"t{k}-{i}", i) for i in range(200)] and value == k
