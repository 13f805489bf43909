"""Fake private ANE classes and a host-memory IOSurface, for the GNU Objective-C runtime (linux-testing.md §A).

installed() (the `fake_ane` fixture of conftest.py) defines, once per process, `_ANEInMemoryModelDescriptor`,
`_ANEInMemoryModel`, `_ANERequest`, `_ANEIOSurfaceObject` and `_ANEDeviceInfo` as NSObject subclasses. Every method
checks the arguments it receives against docs/ane-reference.md §1.2; a breach is recorded in FAKE.violations and fails
the call (NO with an NSError, or nil). Compile builds the simulator's fp16 plan, evaluate runs it on the IOSurfaces'
host memory, laid out as its modelAttributes says (FAKE.layout: packed, or a strided engine's). FAKE also keeps the ordered selector log, the live fake instances, the switches that make calls fail,
and the fake surfaces; `LIBRARY` stands in for IOSurface.framework and CoreFoundation while installed() runs.

Each fake surface is its own anonymous mapping. With FAKE.protect set (before the surfaces are made) the mapping is
inaccessible except between IOSurfaceLock and IOSurfaceUnlock (read-only under a read-only lock) and while the fake
engine evaluates: any other access by the CPU is a segmentation fault where it happens. Released memory is poisoned
(0xFF bytes: fp16 NaN), so a dangling view reads NaN instead of the old values.
"""

import atexit
import ctypes
import hashlib
import mmap
import os
import re
import shutil
import sys
import time
from collections import Counter, deque
from contextlib import contextmanager
from ctypes import c_bool, c_char_p, c_int32, c_size_t, c_uint, c_uint32, c_void_p
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from anectypes.device import ane
from anectypes.device.ane import iosurface, objc
from anectypes.errors import AnectypesError
from anectypes.host.system import c_function
from anectypes.mil import Plan, parse

QOS = 21
MODEL_PATH = "@model_path/"
ERROR_DOMAIN = "com.apple.appleneuralengine"
SURFACE_KEYS = ("IOSurfaceWidth", "IOSurfaceHeight", "IOSurfaceBytesPerElement", "IOSurfaceBytesPerRow",
                "IOSurfaceAllocSize", "IOSurfacePixelFormat")      # the text of the kIOSurface* constants
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
# FAKE.layout -> (rows padded to a multiple of, bytes added to each plane, batches padded to a multiple of): how the
# engine lays out each tensor, reports in modelAttributes and reads and writes it (docs/ane-reference.md §1.6)
# "silent" pads rows as "strided" does and reports nothing: its instances answer no modelAttributes
LAYOUTS = {"packed": (2, 0, 2), "strided": (64, 0, 65536), "planes": (64, 64, 65536), "silent": (64, 0, 2)}


class Violation(Exception):
    """The library broke the private API contract (§1.2): recorded, and the call fails."""


class Refused(Exception):
    """A failure the fake framework reports on purpose (a switch, or MIL its compiler rejects); `underlying`, the
    description of an NSError it carries under NSUnderlyingError, as Apple's frameworks nest their causes."""

    def __init__(self, message, underlying=None):
        super().__init__(message)
        self.underlying = underlying


class FakeANE:
    def __init__(self):
        self.objects = {}       # address -> state of every live fake instance
        self.surfaces = {}      # IOSurfaceRef -> state of every live fake surface
        self.identifiers = set()  # every hexStringIdentifier handed out
        self.freed = deque()    # released surfaces, poisoned, kept mapped for a while (see drop)
        self.reset()

    def reset(self):
        self.subtype = "h16"    # what +[_ANEDeviceInfo aneSubType] answers (an int: an NSNumber, not an NSString)
        self.has_ane, self.virtual_machine = True, False     # +hasANE, +isVirtualMachine
        self.protect = False    # surfaces made from now on are inaccessible outside locks (see the module doc)
        self.log = []           # selectors received, in order
        self.surface_log = []   # (function, IOSurfaceRef, lock flags)
        self.violations = []
        self.mil_texts = []     # the MIL bytes each descriptor received
        self.folders = []       # the hexStringIdentifier of each model, in order
        self.fail_compile = None  # an error description: compile returns NO with it
        self.fail_load = 0      # loads still to refuse (1: once, the device's retry succeeds)
        self.fail_evaluate = None
        self.before_compile = None  # called with the folder as compile begins, before the fake reads it
        # faults aimed at one program each (the MIL bytes it is compiled from), for the doctor's ladder:
        self.refuse = set()     # compile returns NO, its NSError's cause only under NSUnderlyingError
        self.crash = set()      # evaluate dereferences NULL: the process dies of SIGSEGV inside the send
        self.declared_order = set()  # evaluate binds the inputs in declared order, not alphabetical: wrong numbers
        self.hang = set()       # compile never returns
        # one of LAYOUTS; or, read packed: "absent" (instances answer no modelAttributes), "keyless" (it answers a
        # dictionary without NetworkStatusList), "malformed" (each Width an NSString)
        self.layout = "packed"

    def live(self):
        return Counter(s.kind for s in self.objects.values())

    def need(self, ok, message):
        if not ok:
            raise Violation(message)


FAKE = FakeANE()
SESSION = os.environ.setdefault("FAKE_ANE_SESSION", str(os.getpid()))   # inherited by the session's subprocesses


# ---------------------------------------------------------------- defining classes through the runtime

_KEEP = []              # every CFUNCTYPE thunk: a collected one is undefined behaviour (§A2)
_TYPES = {"@": c_void_p, "^@": c_void_p, "^v": c_void_p, ":": c_void_p, "I": c_uint, "C": c_bool, "v": None}
_lib = None


class _ObjcSuper(ctypes.Structure):
    _fields_ = [("receiver", c_void_p), ("super_class", c_void_p)]


def _runtime():
    """Our own handle on libobjc for the class-definition calls (the library's CDLL keeps its declarations)."""
    global _lib
    if _lib is None:
        rt = objc.runtime()
        if rt.kind != "gnu":
            raise RuntimeError("the fake ANE classes are defined for the GNU runtime (linux-testing.md §A)")
        lib = ctypes.CDLL(rt.paths[0])
        for name, restype, argtypes in [
                ("objc_allocateClassPair", c_void_p, [c_void_p, c_char_p, c_size_t]),
                ("objc_registerClassPair", None, [c_void_p]),
                ("class_addMethod", c_bool, [c_void_p, c_void_p, c_void_p, c_char_p]),
                ("objc_msg_lookup_super", c_void_p, [ctypes.POINTER(_ObjcSuper), c_void_p]),
                ("object_getClassName", c_char_p, [c_void_p])]:
            c_function(lib, name, restype, argtypes)
        _lib = lib
    return _lib


def class_name(obj):
    return _runtime().object_getClassName(obj).decode() if obj else "nil"


def define_class(name, instance_methods, class_methods):
    """A new NSObject subclass; methods are {selector: (type encoding, function(self, *args))}."""
    lib = _runtime()
    klass = lib.objc_allocateClassPair(objc.cls("NSObject"), name.encode(), 0)
    if not klass:
        raise RuntimeError(f"class {name} exists already: define the fakes once per process")
    meta = c_void_p.from_address(klass).value           # GNU runtime: a class's isa is its metaclass
    for target, methods in ((klass, instance_methods), (meta, class_methods)):
        for selector, (encoding, fn) in methods.items():
            types = [_TYPES[t] for t in re.findall(r"\^?.", encoding)]   # return, self, _cmd, arguments
            imp = ctypes.CFUNCTYPE(*types)(_guarded(selector, types[0], encoding.endswith("^@"), fn))
            _KEEP.append(imp)
            assert lib.class_addMethod(target, objc.sel(selector), ctypes.cast(imp, c_void_p), encoding.encode())
    lib.objc_registerClassPair(klass)
    return klass


def _guarded(selector, restype, has_error_out, fn):
    """An IMP never lets a Python exception out (ctypes would return garbage, §A2): it fails the call instead."""
    def imp(receiver, _cmd, *args):
        try:
            return fn(receiver, *args)
        except Exception as e:
            if isinstance(e, Violation):
                FAKE.violations.append(f"{selector}: {e}")
            elif not isinstance(e, Refused):        # a bug in the fake itself, or an unforeseen argument
                FAKE.violations.append(f"{selector}: {type(e).__name__}: {e}")
            if has_error_out and args[-1]:
                c_void_p.from_address(args[-1]).value = nserror(f"{e}", -3, getattr(e, "underlying", None))
            return False if restype is c_bool else None
    return imp


def nserror(text, code, underlying=None):
    """An autoreleased NSError whose localizedDescription is `text`; with `underlying`, an NSError of that
    description under NSUnderlyingError in its userInfo."""
    key = c_void_p.in_dll(objc.runtime().foundation, "NSLocalizedDescriptionKey").value
    info = {key: objc.nsstring(text)}
    if underlying:
        info[objc.nsstring("NSUnderlyingError")] = nserror(underlying, 1)
    return objc.send(objc.cls("NSError"), "errorWithDomain:code:userInfo:", objc.nsstring(ERROR_DOMAIN), code,
                     objc.nsdictionary(info), argtypes=(c_void_p, ctypes.c_long, c_void_p))


def new_instance(kind, **state):
    """[[[kind alloc] init] autorelease], as the framework's factories return, with its state kept in FAKE."""
    obj = objc.send(objc.send(objc.cls(kind), "alloc"), "init")
    FAKE.objects[obj] = SimpleNamespace(kind=kind, retains=[], **state)
    return objc.send(obj, "autorelease")


def dealloc(receiver):
    state = FAKE.objects.pop(receiver, None)
    for obj in state.retains if state else ():
        objc.send(obj, "release")
    for ref in getattr(state, "surface_refs", ()):
        LIBRARY.drop(ref)
    super_dealloc(receiver)


def super_dealloc(receiver):
    """[super dealloc] for a direct NSObject subclass."""
    sup = _ObjcSuper(receiver, objc.cls("NSObject"))
    sel = objc.sel("dealloc")
    ctypes.CFUNCTYPE(None, c_void_p, c_void_p)(_runtime().objc_msg_lookup_super(ctypes.byref(sup), sel))(receiver, sel)


def state_of(obj, kind, what):
    state = FAKE.objects.get(obj)
    FAKE.need(state is not None and state.kind == kind, f"{what} must be a {kind}, got {class_name(obj)}")
    return state


def check_qos_and_options(qos, options=None, with_options=True):
    FAKE.need(qos == QOS, f"QoS must be {QOS} (unsigned int), got {qos}")
    if with_options:
        FAKE.need(objc.is_kind(options, "NSDictionary"), f"options must be an NSDictionary, got {class_name(options)}")


def logged(selector, fn):
    def method(*args):
        FAKE.log.append(selector)
        return fn(*args)
    return method


# ---------------------------------------------------------------- the five classes (§1.2)

def descriptor_new(cls, text, weights, options_plist):
    FAKE.need(objc.is_kind(text, "NSData"), f"MIL text must be NSData, got {class_name(text)}")
    mil = objc.nsdata_bytes(text)
    FAKE.mil_texts.append(mil)
    try:
        parse(mil)
    except AnectypesError as e:
        raise Violation(f"the MIL text does not parse: {e}") from None
    FAKE.need(objc.is_kind(weights, "NSDictionary"), f"weights must be an NSDictionary (never nil), got "
              f"{class_name(weights)}")
    blobs = {}
    for key, entry in objc.dict_items(weights).items():
        FAKE.need(objc.is_kind(key, "NSString"), f"weights key must be an NSString, got {class_name(key)}")
        path = objc.to_str(key)
        FAKE.need(re.fullmatch(r"@model_path/weights/[^/]+\.bin", path), f"weights key {path!r} is not "
                  "@model_path/weights/X.bin")
        FAKE.need(objc.is_kind(entry, "NSDictionary"), f"weights[{path!r}] must be an NSDictionary")
        fields = {objc.to_str(k): v for k, v in objc.dict_items(entry).items()}
        FAKE.need(set(fields) == {"offset", "data"}, f"weights[{path!r}] has keys {sorted(fields)}, not offset, data")
        FAKE.need(objc.is_kind(fields["offset"], "NSNumber") and objc.number_value(fields["offset"]) == 0,
                  f"weights[{path!r}] offset must be NSNumber 0")
        FAKE.need(objc.is_kind(fields["data"], "NSData"), f"weights[{path!r}] data must be NSData")
        blobs[path] = objc.nsdata_bytes(fields["data"])
    FAKE.need(options_plist is None, f"optionsPlist must be nil, got {class_name(options_plist)}")
    return new_instance("_ANEInMemoryModelDescriptor", mil=mil, weights=blobs)


def model_new(cls, descriptor):
    d = state_of(descriptor, "_ANEInMemoryModelDescriptor", "the descriptor")
    # MIL, weight names, options (not weight data), as the framework's: the processes of one test session share a
    # folder as a Mac's do; and the session, since concurrent test sessions share GNUstep's temporary folder
    parts = (d.mil, "\n".join(sorted(d.weights)).encode(), b"", SESSION.encode())
    identifier = hashlib.sha256(b"".join(hashlib.sha256(part).digest() for part in parts)).hexdigest()
    FAKE.identifiers.add(identifier)
    FAKE.folders.append(identifier)
    model = new_instance("_ANEInMemoryModel", mil=d.mil, weights=d.weights, identifier=identifier, plan=None,
                         loaded=False)
    objc.send(descriptor, "retain")
    FAKE.objects[model].retains.append(descriptor)
    return model


def hex_string_identifier(model):
    return objc.nsstring(state_of(model, "_ANEInMemoryModel", "the receiver").identifier)


def compile_model(model, qos, options, error):
    m = state_of(model, "_ANEInMemoryModel", "the receiver")
    check_qos_and_options(qos, options)
    FAKE.need(error, "compile needs an NSError ** out-parameter")
    folder = Path(objc.temporary_directory()) / m.identifier      # the compiler reads these files (§1.5)
    if FAKE.before_compile:
        FAKE.before_compile(folder)
    mil_file = folder / "model.mil"
    FAKE.need(mil_file.is_file() and mil_file.read_bytes() == m.mil, f"{mil_file} missing or not the MIL text")
    for path, blob in m.weights.items():
        f = folder / path[len(MODEL_PATH):]
        FAKE.need(f.is_file() and f.read_bytes() == blob, f"{f} missing or not the blob of {path}")
    if FAKE.fail_compile:
        raise Refused(FAKE.fail_compile)
    while m.mil in FAKE.hang:
        time.sleep(60)
    if m.mil in FAKE.refuse:
        raise Refused("ANECCompile() FAILED", "fake compiler: this program is refused on purpose")
    try:
        m.plan = Plan(parse(m.mil), m.weights, precision="fp16")
    except AnectypesError as e:
        raise Refused(f"ANECCompile() FAILED: {e}") from None
    return True


def load_model(model, qos, options, error):
    m = state_of(model, "_ANEInMemoryModel", "the receiver")
    check_qos_and_options(qos, options)
    FAKE.need(m.plan is not None and not m.loaded, "load of a model that is not compiled, or already loaded")
    if FAKE.fail_load > 0:
        FAKE.fail_load -= 1
        raise Refused("fake load failure: no free ANE program slot")
    m.loaded = True
    return True


def layout(shape):
    """How the engine lays out an fp16 [1, C, H, W] tensor under FAKE.layout, in modelAttributes' terms."""
    row, extra, batch = LAYOUTS.get(FAKE.layout, LAYOUTS["packed"])
    *_, c, h, w = (1, 1, 1, *shape)
    up = lambda n, m: -(-n // m) * m
    plane = up(2 * w, row) * h + extra
    return dict(Width=w, Height=h, Channels=c, RowStride=up(2 * w, row), PlaneStride=plane,
                BatchStride=up(plane * c, batch), Interleave=1)


def model_attributes(model):
    m = state_of(model, "_ANEInMemoryModel", "the receiver")
    FAKE.need(m.loaded, "modelAttributes of a model that is not loaded")
    if FAKE.layout == "keyless":
        return objc.nsdictionary({})
    entry = lambda name, t: objc.nsdictionary({objc.nsstring("Symbol"): objc.nsstring(name), **{
        objc.nsstring(k): objc.nsstring(str(v)) if FAKE.layout == "malformed" and k == "Width" else objc.nsnumber(v)
        for k, v in layout(t.shape).items()}})
    lists = {objc.nsstring("LiveInputList"): objc.nsarray([entry(n, m.plan.inputs[n]) for n in sorted(m.plan.inputs)]),
             objc.nsstring("LiveOutputList"): objc.nsarray([entry(n + "@output", m.plan.outputs[n])
                                                            for n in sorted(m.plan.outputs)])}
    return objc.nsdictionary({objc.nsstring("NetworkStatusList"): objc.nsarray([objc.nsdictionary(lists)])})


def instances_respond(cls, selector):
    """+instancesRespondToSelector:, but NO for modelAttributes under FAKE.layout "absent" or "silent"."""
    if selector == objc.sel("modelAttributes") and FAKE.layout in ("absent", "silent"):
        return False
    sup = _ObjcSuper(cls, c_void_p.from_address(objc.cls("NSObject")).value)      # NSObject's metaclass
    sel = objc.sel("instancesRespondToSelector:")
    imp = _runtime().objc_msg_lookup_super(ctypes.byref(sup), sel)
    return ctypes.CFUNCTYPE(c_bool, c_void_p, c_void_p, c_void_p)(imp)(cls, sel, selector)


def surface_array(ref, shape, what):
    """The tensor in the surface's memory, laid out as the engine lays it out (layout())."""
    s = FAKE.surfaces.get(ref)
    FAKE.need(s is not None, f"{what}: IOSurface {ref} was released")
    FAKE.need(s.lock is None, f"{what}: IOSurface is locked during evaluation")
    at = layout(shape)
    FAKE.need(at["BatchStride"] <= s.nbytes, f"{what}: surface of {s.nbytes} bytes is smaller than BatchStride "
              f"{at['BatchStride']} of fp16 {list(shape)}: status=0x1d")
    strides = (at["BatchStride"], at["PlaneStride"], at["RowStride"], 2)[-len(shape):]
    return np.ndarray(shape, np.float16, buffer=s.memory, strides=strides)


@contextmanager
def engine_access(refs):
    """The engine reads and writes the surfaces while it evaluates, whatever the CPU may touch."""
    for ref in refs:
        protect(FAKE.surfaces[ref], PROT_READ | PROT_WRITE)
    try:
        yield
    finally:
        for ref in refs:
            protect(FAKE.surfaces[ref], PROT_NONE)


def evaluate(model, qos, options, request, error):
    m = state_of(model, "_ANEInMemoryModel", "the receiver")
    check_qos_and_options(qos, options)
    r = state_of(request, "_ANERequest", "the request")
    FAKE.need(m.loaded, "evaluate of a model that is not loaded")
    if FAKE.fail_evaluate:
        raise Refused(FAKE.fail_evaluate)
    if m.mil in FAKE.crash:
        ctypes.string_at(0)             # a NULL dereference inside the send: SIGSEGV
    bound = {}
    for declared, refs, indices, what in ((m.plan.inputs, r.inputs, r.input_indices, "input"),
                                          (m.plan.outputs, r.outputs, r.output_indices, "output")):
        # the hardware binds by alphabetical order of the names (§1.9)
        names = list(declared) if what == "input" and m.mil in FAKE.declared_order else sorted(declared)
        FAKE.need(len(refs) == len(names), f"the request has {len(refs)} {what}s, the program {len(names)}")
        sizes = sorted({FAKE.surfaces[ref].nbytes for ref in refs if ref in FAKE.surfaces})
        FAKE.need(len(sizes) <= 1, f"{what} surfaces of mixed allocation sizes {sizes}: status=0x1d")
        bound[what] = {names[i]: surface_array(ref, declared[names[i]].shape, f"{what} {names[i]}")
                       for i, ref in zip(indices, refs)}
    with engine_access(r.inputs + r.outputs):
        m.plan.run(bound["input"], bound["output"])
    return True


def unload(model, qos, error):
    m = state_of(model, "_ANEInMemoryModel", "the receiver")
    check_qos_and_options(qos, with_options=False)
    FAKE.need(m.loaded, "unload of a model that is not loaded")
    m.loaded = False
    shutil.rmtree(Path(objc.temporary_directory()) / m.identifier, ignore_errors=True)   # as the framework does (§1.5)
    return True


def surface_object_new(cls, ref):
    FAKE.need(ref in FAKE.surfaces, f"objectWithIOSurface: needs a live IOSurfaceRef, got {ref}")
    FAKE.surfaces[ref].refs += 1            # the object keeps its surface alive, as CFRetain would
    return new_instance("_ANEIOSurfaceObject", surface=ref, surface_refs=[ref])


def request_new(cls, inputs, input_indices, outputs, output_indices, weights_buffer, perf_stats, procedure):
    def surfaces(array, what):
        FAKE.need(objc.is_kind(array, "NSArray"), f"{what} must be an NSArray, got {class_name(array)}")
        return [state_of(o, "_ANEIOSurfaceObject", f"each of {what}") for o in objc.array_items(array)]

    def indices(array, n, what):
        FAKE.need(objc.is_kind(array, "NSArray"), f"{what} must be an NSArray, got {class_name(array)}")
        items = objc.array_items(array)
        FAKE.need(all(objc.is_kind(i, "NSNumber") for i in items) and
                  [objc.number_value(i) for i in items] == list(range(n)), f"{what} must be NSNumbers 0..{n - 1}")
        return list(range(n))

    ins, outs = surfaces(inputs, "inputs"), surfaces(outputs, "outputs")
    state = dict(inputs=[s.surface for s in ins], outputs=[s.surface for s in outs],
                 input_indices=indices(input_indices, len(ins), "inputIndices"),
                 output_indices=indices(output_indices, len(outs), "outputIndices"))
    FAKE.need(weights_buffer is None, "weightsBuffer must be nil")
    FAKE.need(perf_stats is None, "perfStats must be nil")
    FAKE.need(objc.is_kind(procedure, "NSNumber") and objc.number_value(procedure) == 0,
              f"procedureIndex must be the NSNumber object @0, got {class_name(procedure)}")
    request = new_instance("_ANERequest", **state)
    for array in (inputs, outputs):         # the request keeps its surface objects alive
        for o in objc.array_items(array):
            FAKE.objects[request].retains.append(objc.send(o, "retain"))
    return request


def ane_sub_type(cls):
    return objc.nsstring(FAKE.subtype) if isinstance(FAKE.subtype, str) else objc.nsnumber(FAKE.subtype)


def has_ane(cls):
    return FAKE.has_ane


def is_virtual_machine(cls):
    return FAKE.virtual_machine


REQUEST = "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:"
CLASSES = {
    "_ANEInMemoryModelDescriptor": ({}, {"modelWithMILText:weights:optionsPlist:": ("@@:@@@", descriptor_new)}),
    "_ANEInMemoryModel": ({"hexStringIdentifier": ("@@:", hex_string_identifier),
                           "compileWithQoS:options:error:": ("C@:I@^@", compile_model),
                           "loadWithQoS:options:error:": ("C@:I@^@", load_model),
                           "evaluateWithQoS:options:request:error:": ("C@:I@@^@", evaluate),
                           "unloadWithQoS:error:": ("C@:I^@", unload),
                           "modelAttributes": ("@@:", model_attributes)},
                          {"inMemoryModelWithDescriptor:": ("@@:@", model_new),
                           "instancesRespondToSelector:": ("C@::", instances_respond)}),
    "_ANERequest": ({}, {REQUEST: ("@@:@@@@@@@", request_new)}),
    "_ANEIOSurfaceObject": ({}, {"objectWithIOSurface:": ("@@:^v", surface_object_new)}),
    "_ANEDeviceInfo": ({}, {"aneSubType": ("@@:", ane_sub_type), "hasANE": ("C@:", has_ane),
                            "isVirtualMachine": ("C@:", is_virtual_machine)}),
}


# ---------------------------------------------------------------- IOSurface and CoreFoundation in host memory

class _CFunction(ctypes._CFuncPtr):     # what a CDLL attribute is: typed by its user's argtypes/restype
    _flags_ = ctypes._FUNCFLAG_CDECL
    _restype_ = ctypes.c_int


_libc = ctypes.CDLL(None, use_errno=True)
c_function(_libc, "mprotect", ctypes.c_int, [c_void_p, c_size_t, ctypes.c_int])


def protect(s, prot):
    """Set the access the CPU has to a fake surface's mapping (only for surfaces made under FAKE.protect)."""
    if s.protected and _libc.mprotect(ctypes.addressof(s.memory), len(s.map), prot):
        raise OSError(ctypes.get_errno(), "mprotect failed")


class FakeSurfaceLibrary:
    """IOSurfaceCreate/Lock/Unlock/GetBaseAddress/GetAllocSize, CFRetain and CFRelease as real C function pointers;
    `keys`, the kIOSurface* constants (NSStrings of their names), made by installed()."""

    def __init__(self):
        self.keys = {}
        bad_argument = 0xE00002C2                   # kIOReturnBadArgument
        for name, restype, argtypes, fn, failed in [
                ("IOSurfaceCreate", c_void_p, [c_void_p], self.create, None),
                ("IOSurfaceLock", c_int32, [c_void_p, c_uint32, c_void_p], self.lock, bad_argument),
                ("IOSurfaceUnlock", c_int32, [c_void_p, c_uint32, c_void_p], self.unlock, bad_argument),
                ("IOSurfaceGetBaseAddress", c_void_p, [c_void_p], self.base_address, None),
                ("IOSurfaceGetAllocSize", c_size_t, [c_void_p], self.alloc_size, 0),
                ("CFRetain", c_void_p, [c_void_p], self.cf_retain, None),
                ("CFRelease", None, [c_void_p], self.cf_release, None)]:
            thunk = ctypes.CFUNCTYPE(restype, *argtypes)(self.guarded(name, fn, failed))
            _KEEP.append(thunk)
            setattr(self, name, _CFunction(ctypes.cast(thunk, c_void_p).value))

    @staticmethod
    def guarded(name, fn, failed):
        def call(*args):
            try:
                return fn(*args)
            except Exception as e:
                FAKE.violations.append(f"{name}: {e}")
                return failed
        return call

    def create(self, properties):
        FAKE.need(objc.is_kind(properties, "NSDictionary"), "IOSurfaceCreate needs a dictionary")
        items = objc.dict_items(properties)
        FAKE.need(set(items) <= {k.ptr for k in self.keys.values()}, "IOSurfaceCreate keys must be the exported "
                  "kIOSurface* constants, not strings of the same text")
        props = {objc.to_str(k): objc.number_value(v) for k, v in items.items()}
        FAKE.need(sorted(props) == sorted(SURFACE_KEYS), f"IOSurfaceCreate keys {sorted(props)}")
        n = props["IOSurfaceWidth"]
        want = dict(IOSurfaceWidth=n, IOSurfaceHeight=1, IOSurfaceBytesPerElement=1, IOSurfaceBytesPerRow=n,
                    IOSurfaceAllocSize=n, IOSurfacePixelFormat=0)
        FAKE.need(n > 0 and props == want, f"IOSurfaceCreate properties {props}, expected {want} (§1.6)")
        handle = ctypes.create_string_buffer(8)       # the IOSurfaceRef: distinct from the base address
        ref = ctypes.addressof(handle)
        mapping = mmap.mmap(-1, n)
        s = SimpleNamespace(handle=handle, map=mapping, memory=(ctypes.c_char * n).from_buffer(mapping), nbytes=n,
                            refs=1, lock=None, protected=FAKE.protect)
        protect(s, PROT_NONE)
        FAKE.surfaces[ref] = s
        return ref

    def surface(self, ref):
        s = FAKE.surfaces.get(ref)
        FAKE.need(s is not None, f"unknown or released IOSurfaceRef {ref}")
        return s

    def lock(self, ref, flags, seed):
        s = self.surface(ref)
        FAKE.surface_log.append(("IOSurfaceLock", ref, flags))
        FAKE.need(flags in (0, iosurface.LOCK_READ_ONLY) and s.lock is None, f"lock({flags}) while lock={s.lock}")
        s.lock = flags
        protect(s, PROT_READ if flags == iosurface.LOCK_READ_ONLY else PROT_READ | PROT_WRITE)
        return 0

    def unlock(self, ref, flags, seed):
        s = self.surface(ref)
        FAKE.surface_log.append(("IOSurfaceUnlock", ref, flags))
        FAKE.need(s.lock == flags, f"unlock({flags}) does not pair with lock({s.lock})")
        s.lock = None
        protect(s, PROT_NONE)
        return 0

    def base_address(self, ref):
        return ctypes.addressof(self.surface(ref).memory)

    def alloc_size(self, ref):
        return self.surface(ref).nbytes

    def cf_retain(self, ref):
        self.surface(ref).refs += 1
        return ref

    def cf_release(self, ref):
        self.surface(ref)
        self.drop(ref)

    def drop(self, ref):
        """One reference less; at none the memory is poisoned and, after 64 more, unmapped."""
        s = FAKE.surfaces[ref]
        s.refs -= 1
        if s.refs == 0:
            FAKE.need(s.lock is None, "IOSurface released while locked")
            del FAKE.surfaces[ref]
            protect(s, PROT_READ | PROT_WRITE)
            ctypes.memset(s.memory, 0xFF, s.nbytes)
            protect(s, PROT_NONE)
            FAKE.freed.append(s)
            if len(FAKE.freed) > 64:
                old = FAKE.freed.popleft()
                old.memory = None
                old.map.close()


LIBRARY = FakeSurfaceLibrary()


def install():
    """FAKE, reset, with the fake classes and IOSurface functions from now on, and this process an arm64 one as a
    native process on Apple Silicon reports; returns what installed() restores afterwards. The classes are defined
    on first use and stay (the runtime cannot unregister a class)."""
    if not objc.cls("_ANEDeviceInfo"):
        for name, (instance_methods, class_methods) in CLASSES.items():
            instance_methods = {s: (enc, logged(s, fn)) for s, (enc, fn) in instance_methods.items()}
            class_methods = {s: (enc, fn if s == "instancesRespondToSelector:" else logged(s, fn))   # answers()'s
                             for s, (enc, fn) in class_methods.items()}
            if name != "_ANEDeviceInfo":
                instance_methods["dealloc"] = ("v@:", dealloc)
            define_class(name, instance_methods, class_methods)
    if not LIBRARY.keys:
        with objc.autorelease_pool():
            LIBRARY.keys = {f"k{name}": objc.Object.retained(objc.nsstring(name)) for name in SURFACE_KEYS}
    FAKE.reset()
    iosurface.use_library(LIBRARY, LIBRARY, {k: v.ptr for k, v in LIBRARY.keys.items()})
    machine, ane.MACHINE = ane.MACHINE, "arm64"
    return machine


@contextmanager
def installed():
    """FAKE, installed for the block's duration; IOSurface goes back to the system's afterwards (absent off
    macOS), so available() is False again and open_device("auto") gives the simulator."""
    machine = install()
    try:
        yield FAKE
    finally:
        iosurface.use_library(None, None)
        ane.MACHINE = machine


def arm(spec):
    """install(), with faults aimed at the programs of the doctor's probes: `spec` maps "refuse", "crash",
    "declared_order" or "hang" (FakeANE.reset says what each does) to a probe ("binding", "kernel woFwd", ...),
    "model" to the preset whose kernels those are (default tiny), "layout" to FAKE.layout. Violations are reported at exit."""
    from anectypes.doctor.programs import build
    from anectypes.mil import DIALECTS
    from anectypes.model.config import load_config
    install()
    cfg = load_config(spec.get("model", "tiny"))
    FAKE.layout = spec.get("layout", "packed")
    for fault in ("refuse", "crash", "declared_order", "hang"):
        if fault in spec:
            getattr(FAKE, fault).update(build(spec[fault], cfg, d).text.encode() for d in DIALECTS)
    atexit.register(report_violations)


def report_violations():
    """At the exit of a process that arm() set up: a broken contract fails the process (exit 3), named on stderr."""
    if FAKE.violations:
        print("fake ANE violations:", *FAKE.violations, sep="\n", file=sys.stderr, flush=True)
        os._exit(3)
