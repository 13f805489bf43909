"""The ANE device: the private in-memory MIL path of docs/ane-reference.md §1, driven through objc.py.

compile: MIL text as NSData + weights {"@model_path/weights/X.bin": {"offset": @0, "data": NSData}}
(or @{}) -> _ANEInMemoryModelDescriptor -> _ANEInMemoryModel; NSTemporaryDirectory()/<hexStringIdentifier>/
is filled with model.mil and weights/*.bin; compileWithQoS, then loadWithQoS (one retry), under a lock of
every process (folders_locked). The MIL dialect is the chip's, by the family of its aneSubType (dialect_for).
layout: after load, -[model modelAttributes] → NetworkStatusList[0] → LiveInputList / LiveOutputList, where the
framework says how the engine lays out each tensor (§1.6): a tensor not laid out packed, as our surfaces are written, is
refused; BatchStride, where larger than the tensor, sizes its surfaces (docs/ane-backend.md).
request: IOSurfaces wrapped as _ANEIOSurfaceObject, bound by index in alphabetical order of the MIL
names (§1.9), procedureIndex @0. eval: evaluateWithQoS:21. free: unloadWithQoS, remove the folder.
available() first asks whether this process can reach a Neural Engine at all (§1.16).
"""

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import shutil
import sys
import time
from ctypes import c_bool, c_uint, c_void_p
from pathlib import Path

import numpy as np

from ...errors import AnectypesError, DeviceError, LayoutError, ObjCError
from ...host import files
from ...mil import limits, parse
from ...mil.types import DIALECTS
from ..protocol import (DEFAULT_COMPILE_BUDGET, Device, Kernel, Request, Surface, allocation, check_compile_budget,
                check_uniform)
from . import iosurface, objc

FRAMEWORK = "/System/Library/PrivateFrameworks/AppleNeuralEngine.framework/AppleNeuralEngine"
CLASSES = ("_ANEInMemoryModelDescriptor", "_ANEInMemoryModel", "_ANERequest", "_ANEIOSurfaceObject")  # required
REQUEST = "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:"
ERROR = ctypes.POINTER(c_void_p)          # an NSError ** out-parameter: msg() passes it and raises on NO
# Every private method this backend sends, with its class and signature, declared once (§1.2).
# "+" marks a class method; selector -> (class, result type, argument types).
METHODS = {
    "+modelWithMILText:weights:optionsPlist:": ("_ANEInMemoryModelDescriptor", c_void_p, (c_void_p,) * 3),
    "+inMemoryModelWithDescriptor:": ("_ANEInMemoryModel", c_void_p, (c_void_p,)),
    "hexStringIdentifier": ("_ANEInMemoryModel", c_void_p, ()),
    "compileWithQoS:options:error:": ("_ANEInMemoryModel", c_bool, (c_uint, c_void_p, ERROR)),
    "loadWithQoS:options:error:": ("_ANEInMemoryModel", c_bool, (c_uint, c_void_p, ERROR)),
    "evaluateWithQoS:options:request:error:": ("_ANEInMemoryModel", c_bool, (c_uint, c_void_p, c_void_p, ERROR)),
    "unloadWithQoS:error:": ("_ANEInMemoryModel", c_bool, (c_uint, ERROR)),
    "+" + REQUEST: ("_ANERequest", c_void_p, (c_void_p,) * 7),
    "modelAttributes": ("_ANEInMemoryModel", c_void_p, ()),  # optional: without it the layout is unchecked
    "+objectWithIOSurface:": ("_ANEIOSurfaceObject", c_void_p, (c_void_p,)),
    "+aneSubType": ("_ANEDeviceInfo", c_void_p, ()),       # optional: without it the chip is unknown
    "+hasANE": ("_ANEDeviceInfo", c_bool, ()),              # optional, each asked only when present (§1.16)
    "+isVirtualMachine": ("_ANEDeviceInfo", c_bool, ()),
}
QOS = 21                                  # the reference's QoS everywhere in training (§1.3)
DIALECT_VARIABLE = "ANECTYPES_DIALECT"    # the MIL dialect, instead of the chip's (as --dialect does)
MODEL_PATH = "@model_path/"
KEEP_FAILED = "ANECTYPES_KEEP_FAILED_COMPILE"   # "1": a failed compile leaves its folder for a bug report
MACHINE = platform.machine()              # "arm64" for a native process on Apple Silicon (§1.16)
LOCK_FILE = "anectypes-ane.lock"          # in NSTemporaryDirectory(): see folders_locked
OPTIONAL = {"modelAttributes"}            # of the CLASSES' selectors, the ones a macOS may lack
LAYOUT = ("Width", "Height", "Channels", "RowStride", "PlaneStride", "BatchStride", "Interleave")   # §1.6, NSNumbers


def msg(selector, *args, to=None):
    """Send one of METHODS with its declared signature: to the instance `to`, or ("+") to its class.
    A method ending in NSError ** raises ObjCError with the framework's description when it answers NO."""
    klass, restype, argtypes = METHODS[selector]
    receiver, name = (objc.cls(klass), selector[1:]) if selector.startswith("+") else (to, selector)
    if argtypes[-1:] == (ERROR,):
        return objc.send_checked(receiver, name, *args, argtypes=argtypes[:-1])
    return objc.send(receiver, name, *args, restype=restype, argtypes=argtypes)


def load():
    """Make the private classes available (dlopen the framework unless they are registered already)."""
    if not all(objc.cls(c) for c in CLASSES):
        try:
            ctypes.CDLL(FRAMEWORK, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            raise DeviceError("AppleNeuralEngine.framework not found: the ANE backend needs macOS on "
                              "Apple Silicon (use --backend sim elsewhere)") from None
    missing = [c for c in CLASSES if not objc.cls(c)]
    if missing:
        raise DeviceError(f"class {missing[0]} not found in AppleNeuralEngine.framework "
                          "(this macOS lacks the in-memory MIL path)")
    for selector, (name, _, _) in METHODS.items():     # sending a missing one would abort the process
        if name in CLASSES and selector not in OPTIONAL and not answers(selector):
            raise DeviceError(f"{name} lacks the selector {selector.lstrip('+')} (this macOS's private API "
                              "differs)")


def answers(selector):
    """Whether the class of a METHODS selector (or, without "+", its instances) implements it; False without the class."""
    klass = objc.cls(METHODS[selector][0])
    return objc.responds(klass, selector[1:]) if selector.startswith("+") else objc.instances_respond(klass, selector)


@functools.cache
def rosetta():
    """Whether this process is an x86_64 one translated by Rosetta (sysctl.proc_translated, §1.16)."""
    if sys.platform != "darwin":
        return False
    value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    found = libc.sysctlbyname(b"sysctl.proc_translated", ctypes.byref(value), ctypes.byref(size), None, 0) == 0
    return found and value.value == 1


def check_host():
    """Refuse, before loading anything, a process that cannot reach a Neural Engine (§1.16)."""
    if rosetta():
        raise DeviceError("this Python is an x86_64 build running under Rosetta: the ANE needs an arm64 Python "
                          "(see the README's Mac instructions)")
    if MACHINE != "arm64":
        raise DeviceError(f"the ANE needs macOS on Apple Silicon (arm64); this is {platform.system()} {MACHINE}")


def check_device():
    """Refuse what the framework itself reports: no Neural Engine, or a virtual machine (§1.16)."""
    if answers("+hasANE") and not msg("+hasANE"):
        raise DeviceError("the framework reports no Neural Engine on this Mac (+[_ANEDeviceInfo hasANE] is NO)")
    if answers("+isVirtualMachine") and msg("+isVirtualMachine"):
        raise DeviceError("macOS runs in a virtual machine, where the ANE cannot evaluate "
                          "(evaluateWithQoS: fails with \"host too old\")")


def open_path():
    """Everything the device needs, checked in order; raises DeviceError (or ObjCError) with the reason."""
    check_host()
    objc.runtime()
    load()
    check_device()
    iosurface.library()


def available():
    """(True, chip) when the ANE path can be used here, else (False, why)."""
    try:
        open_path()
        return True, chip()
    except AnectypesError as e:
        return False, str(e)


def chip():
    """`+[_ANEDeviceInfo aneSubType]` (e.g. "h16" on M4), or None when the class is absent."""
    if answers("+aneSubType"):
        with objc.autorelease_pool():
            name = msg("+aneSubType")
            # another class would not answer UTF8String, and an unrecognized selector aborts the process
            return objc.to_str(name) if objc.is_kind(name, "NSString") else name and objc.description(name)
    return None


def dialect_for(subtype, override=None):
    """(the MIL dialect for a Neural Engine, why): `override` (--dialect), else $ANECTYPES_DIALECT, else by
    the family of its aneSubType ("h13g" is h13): h13, h14 (M1, M2) read ios16, h15 and newer ios18 (§1.13,
    §3.5); a name of no known family gets ios18."""
    for value, source in ((override, "--dialect"), (os.environ.get(DIALECT_VARIABLE), DIALECT_VARIABLE)):
        if value:
            if value not in DIALECTS:
                raise DeviceError(f"{source} {value!r}: the MIL dialects are {', '.join(sorted(DIALECTS))}")
            return value, f"chosen by {source}"
    chip, n = limits.chip_of(subtype), limits.family(subtype)
    if chip:
        return limits.CHIPS[chip][1], f"aneSubType {subtype!r} is family h{n}, {chip}"
    if n is not None and n > max(limits.family(s) for s, _ in limits.CHIPS.values()):
        return "ios18", f"aneSubType {subtype!r} is family h{n}, newer than any known chip"
    return "ios18", f"aneSubType {subtype!r} is of no known family" if subtype else "the framework names no chip"


@functools.cache
def no_options():
    """One retained empty NSDictionary for every options: argument (the reference passes @{})."""
    with objc.autorelease_pool():
        return objc.Object.retained(objc.nsdictionary({}))


class ANEKernel(Kernel):
    def __init__(self, model, folder, inputs, outputs, name):
        self.model, self.folder, self.inputs, self.outputs, self.name = model, folder, inputs, outputs, name
        self.layout, self.sizes = None, {}      # set by check_layout

    def free(self):
        """Unload and remove the folder, as the references do (a loaded kernel does not read it, §1.5)."""
        if not self.model:
            return
        with objc.autorelease_pool(), folders_locked():
            with contextlib.suppress(ObjCError):                          # ignored, as the reference does
                msg("unloadWithQoS:error:", QOS, to=self.model)
            shutil.rmtree(self.folder, ignore_errors=True)
        self.model.release()
        self.model = None


def field(d, key, kind, where):
    """d[key], which must be an instance of `kind` (what modelAttributes holds comes from a private API)."""
    value = objc.send(d, "objectForKey:", objc.nsstring(key), argtypes=(c_void_p,))
    if not objc.is_kind(value, kind):
        raise DeviceError(f"{where}{key} is {'not an ' + kind if value else 'absent'}")
    return value


def live_io(model):
    """{"inputs": [...], "outputs": [...]}: LiveInputList and LiveOutputList of -[model modelAttributes]
    → NetworkStatusList[0], each entry {"Symbol": str, and each of LAYOUT: int} (§1.6). DeviceError: why not."""
    if not answers("modelAttributes"):
        raise DeviceError("_ANEInMemoryModel does not answer modelAttributes")
    with objc.autorelease_pool():
        attributes = msg("modelAttributes", to=model)
        if not objc.is_kind(attributes, "NSDictionary"):
            raise DeviceError(f"modelAttributes is {'not an NSDictionary' if attributes else 'nil'}")
        networks = objc.array_items(field(attributes, "NetworkStatusList", "NSArray", ""))
        if not networks or not objc.is_kind(networks[0], "NSDictionary"):
            raise DeviceError("NetworkStatusList holds no dictionary")
        layout = {}
        for what, key in (("inputs", "LiveInputList"), ("outputs", "LiveOutputList")):
            entries = objc.array_items(field(networks[0], key, "NSArray", "NetworkStatusList[0]."))
            layout[what] = []
            for i, e in enumerate(entries):
                where = f"{key}[{i}]."
                if not objc.is_kind(e, "NSDictionary"):
                    raise DeviceError(f"{key}[{i}] is not an NSDictionary")
                layout[what].append({"Symbol": objc.to_str(field(e, "Symbol", "NSString", where)),
                                     **{k: objc.number_value(field(e, k, "NSNumber", where)) for k in LAYOUT}})
        return layout


def packed(shape):
    """The layout of an fp16 [1, C, H, W] tensor written packed, as our surfaces are (§1.6)."""
    *_, c, h, w = (1, 1, 1, *shape)
    return dict(Width=w, Height=h, Channels=c, RowStride=2 * w, PlaneStride=2 * w * h, Interleave=1)


def check_layout(kernel):
    """Refuse (LayoutError) a tensor the engine lays out otherwise than packed; record the lists and what the
    engine touches of each surface (BatchStride). Returns why the layout went unchecked, or None."""
    try:
        layout = live_io(kernel.model)
    except DeviceError as e:
        return str(e)
    kernel.layout, sizes = layout, {}
    for what, declared, entries in (("input", kernel.inputs, layout["inputs"]),
                                    ("output", kernel.outputs, layout["outputs"])):
        by = {e["Symbol"].removesuffix("@output"): e for e in entries}    # outputs' symbols carry "@output"
        if set(by) != set(declared):
            return f"its Live{what.title()}List names {sorted(by)}, the program {sorted(declared)}"
        for name, t in declared.items():
            e, want = by[name], packed(t.shape)
            if any(e[k] != v for k, v in want.items()) or e["BatchStride"] < want["PlaneStride"] * want["Channels"]:
                found = ", ".join(f"{k} {e[k]}" for k in LAYOUT)
                raise LayoutError(f"kernel {kernel.name} {what} '{name}' {list(t.shape)}: the engine lays it out "
                                  f"{found}; anectypes writes it packed (RowStride {want['RowStride']}, PlaneStride "
                                  f"{want['PlaneStride']}), so it would read other values: refused (docs/ane-backend.md)",
                                  layout)
            sizes[name] = e["BatchStride"]
    kernel.sizes = sizes
    return None


class ANERequest(Request):
    def __init__(self, kernel, request, wrapped, inputs, outputs):
        self.kernel, self.request, self.wrapped = kernel, request, wrapped
        self.inputs, self.outputs = inputs, outputs        # name -> Surface, kept alive with the request

    def free(self):
        for o in self.wrapped + [self.request]:
            o.release()


def in_memory_model(text, weights):
    """The _ANEInMemoryModel for MIL text and {path: blob} (retained), through its descriptor (§1.4).
    NSData copies the text and the blobs: the descriptor keeps them past this call (§1.14)."""
    with objc.autorelease_pool():
        # "offset" first, then "data", as the reference's literal: the framework reads an entry by
        # position (its keys' and values' first object), so the order it was built in is kept (§1.4)
        entries = {objc.nsstring(path): objc.nsdictionary({objc.nsstring("offset"): objc.nsnumber(0),
                                                           objc.nsstring("data"): objc.nsdata(blob)})
                   for path, blob in weights.items()}
        desc = msg("+modelWithMILText:weights:optionsPlist:", objc.nsdata(text), objc.nsdictionary(entries), None)
        if not desc:
            raise DeviceError("_ANEInMemoryModelDescriptor modelWithMILText:weights:optionsPlist: returned nil")
        model = msg("+inMemoryModelWithDescriptor:", desc)
        if not model:
            raise DeviceError("_ANEInMemoryModel inMemoryModelWithDescriptor: returned nil")
        return objc.Object.retained(model)


def folder_of(model):
    """NSTemporaryDirectory()/<hexStringIdentifier>/, the folder the compiler reads (§1.5)."""
    with objc.autorelease_pool():
        return Path(objc.temporary_directory()) / objc.to_str(msg("hexStringIdentifier", to=model))


@contextlib.contextmanager
def folders_locked():
    """The lock of NSTemporaryDirectory()'s folders: programs alike get one folder whatever the process that
    compiles them (§1.5), so filling a folder and compiling from it, and unloading and removing one, happen
    one process at a time (MPI ranks on one Mac, two runs of one model)."""
    lock = Path(objc.temporary_directory()) / LOCK_FILE
    with files.exclusive(lock, busy=lambda: print(f"waiting for another process's ANE compile ({lock})",
                                                  file=sys.stderr, flush=True)):
        yield


def populate(folder, text, weights):
    """The compiler reads model.mil and weights/*.bin from this folder: made afresh, so that nothing of a killed
    process's, or of a program with these weight names and other data, is there (§1.5)."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "weights").mkdir(parents=True, exist_ok=True)
    (folder / "model.mil").write_bytes(text)
    for path, blob in weights.items():
        dest = folder / path[len(MODEL_PATH):]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(blob)


def compile_and_load(model):
    """compileWithQoS, then loadWithQoS, retried once "for ANE slot reclamation" as the reference does."""
    with objc.autorelease_pool():
        msg("compileWithQoS:options:error:", QOS, no_options(), to=model)
        try:
            msg("loadWithQoS:options:error:", QOS, no_options(), to=model)
        except ObjCError:
            time.sleep(0.1)
            msg("loadWithQoS:options:error:", QOS, no_options(), to=model)


class ANEDevice(Device):
    name, precision, notice = "ane", "fp16", None
    shares_cpu = False             # kernels run on the Neural Engine: the CPU is free meanwhile

    def __init__(self, precision="fp16", compile_budget=DEFAULT_COMPILE_BUDGET, dialect=None):
        if precision != "fp16":
            raise DeviceError("the ANE computes in fp16; --precision fp32 is a simulator mode")
        open_path()
        no_options()
        self.chip = chip()
        self.dialect, self.dialect_why = dialect_for(self.chip, dialect)
        own = limits.chip_of(self.chip)       # a dialect chosen that it does not read: its newest chip's rows
        self.catalogue_chip = own if own and limits.CHIPS[own][1] == self.dialect else None
        self.compile_budget, self.compiles = compile_budget, 0
        self.unchecked = False          # whether a kernel's layout went unchecked (said once)

    def compile(self, mil_text, weights=None, name=None):
        check_compile_budget(self)
        text = mil_text.encode() if isinstance(mil_text, str) else bytes(mil_text)
        program = parse(text)                     # refuse bad MIL before the compiler sees it,
        limits.enforce(program, self.catalogue_chip or limits.NEWEST[program.dialect.name])   # and what it refuses
        weights = weights or {}
        for path in weights:
            if not path.startswith(MODEL_PATH):
                raise DeviceError(f"weights key {path!r} must start with {MODEL_PATH}")
        model = in_memory_model(text, weights)
        folder = folder_of(model)
        try:
            with folders_locked():
                try:
                    populate(folder, text, weights)
                    # a compile that never returns is then attributable
                    print(f"compiling {name or 'a program'} on the ANE ({folder.name[:12]})", file=sys.stderr,
                          flush=True)
                    self.compiles += 1            # the leak is in the compiler: every attempt counts
                    compile_and_load(model)
                except BaseException:
                    if os.environ.get(KEEP_FAILED) != "1":
                        shutil.rmtree(folder, ignore_errors=True)
                    raise
        except (ObjCError, OSError) as e:
            model.release()
            kept = f"; its folder is kept: {folder} (model.mil, weights/)" if os.environ.get(KEEP_FAILED) == "1" else ""
            raise DeviceError(self.compile_failed(program, e) + kept) from None
        f = program.main
        kernel = ANEKernel(model, folder, {v.name: v.type for v in f.inputs}, {v.name: v.type for v in f.outputs},
                           name or "a program")
        try:
            why = check_layout(kernel)
        except DeviceError:
            kernel.free()
            raise
        if why and not self.unchecked:
            print(f"note: the ANE's I/O layout of {kernel.name} cannot be read ({why}): tensors are written packed, "
                  "unchecked (docs/ane-backend.md)", file=sys.stderr, flush=True)
        self.unchecked = self.unchecked or bool(why)
        return kernel

    def compile_failed(self, program, e):
        """What the framework said, with the dialect tried and why, and how to choose the other (§1.13)."""
        written = program.dialect.name
        if isinstance(e, OSError):
            return f"ANE compile failed: {e}"
        if written != self.dialect:
            return (f"ANE compile failed: {e}; the program is written in {written}, this chip reads {self.dialect} "
                    f"({self.dialect_why})")
        other = next(d for d in DIALECTS if d != written)
        return (f"ANE compile failed with the {written} dialect ({self.dialect_why}): {e}; if this chip reads "
                f"{other}, choose it with --dialect {other} (train, bench, doctor) or {DIALECT_VARIABLE}={other}")

    def surface(self, shape, dtype="fp16", alloc=0):
        if dtype != "fp16":
            raise DeviceError("ANE surfaces hold fp16 tensors (fp32 I/O needs a cast, which M1/M2 lack)")
        shape = tuple(int(d) for d in shape)
        s = iosurface.IOSurface(allocation(shape, 2, alloc))
        return Surface(s.array(np.float16, shape), release=s.release, handle=s, alloc=s.nbytes, lock=s.locked)

    def request(self, kernel, inputs, outputs):
        if kernel.model is None:
            raise DeviceError("the kernel was freed")
        for declared, given, what in ((kernel.inputs, inputs, "input"), (kernel.outputs, outputs, "output")):
            if set(given) != set(declared):
                raise DeviceError(f"request binds {what}s {sorted(given)}, the kernel has {sorted(declared)}")
            for name, s in given.items():
                if s.handle is None:
                    raise DeviceError(f"{what} '{name}' is not an IOSurface of this device")
                s.view(declared[name].shape)          # raises if too small or freed
                if s.alloc < kernel.sizes.get(name, 0):
                    raise LayoutError(f"kernel {kernel.name} {what} '{name}': the engine touches {kernel.sizes[name]} "
                                      f"bytes of its surface (BatchStride), the surface has {s.alloc}: make it as large "
                                      "(surfaces(device, types, kernel.sizes))", kernel.layout)
            check_uniform(given, what)
        wrap = lambda s: objc.Object.retained(msg("+objectWithIOSurface:", s.handle.ref))
        with objc.autorelease_pool():
            ins = [wrap(inputs[n]) for n in sorted(inputs)]           # alphabetical binding (§1.9)
            outs = [wrap(outputs[n]) for n in sorted(outputs)]
            if not all(ins + outs):
                raise DeviceError("_ANEIOSurfaceObject objectWithIOSurface: returned nil")
            indices = lambda objs: objc.nsarray([objc.nsnumber(i) for i in range(len(objs))])
            req = msg("+" + REQUEST, objc.nsarray(ins), indices(ins), objc.nsarray(outs), indices(outs), None, None,
                      objc.nsnumber(0))
            if not req:
                raise DeviceError("_ANERequest requestWithInputs:... returned nil")
            return ANERequest(kernel, objc.Object.retained(req), ins + outs, dict(inputs), dict(outputs))

    def eval(self, request):
        """Evaluate; the CPU's writes and reads happened, and will happen, under the surfaces' locks (§1.15)."""
        if request.kernel.model is None:
            raise DeviceError("the kernel was freed")
        with objc.autorelease_pool():
            try:
                msg("evaluateWithQoS:options:request:error:", QOS, no_options(), request.request,
                    to=request.kernel.model)
            except ObjCError as e:
                raise DeviceError(f"ANE evaluation failed: {e}") from None
