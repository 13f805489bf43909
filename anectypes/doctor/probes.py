"""The doctor's probes, in the order the ladder runs them. Each runs alone in a fresh process (child.py) and
returns {"summary": one line, "facts": what it found, "diff": how far from the simulator, or None};
it raises Skip (with the reason) where it cannot apply, Fail (with what it found so far) where it failed.

On Linux the probes that need a Mac skip, and the programs run on the simulator; under the tests' stand-in
classes (tests/support/fake_ane.py) every probe runs against them as on a Mac.
"""

import ctypes
import ctypes.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from .. import __version__
from ..device import ane, open_device
from ..device.ane import CLASSES, METHODS, iosurface, objc
from ..device.protocol import DEFAULT_COMPILE_BUDGET, MIN_SURFACE_BYTES
from ..errors import AnectypesError, CompileBudgetExceeded, LayoutError
from ..host import accelerate, blas, fp16, processes
from ..mil import limits, parse
from ..model.config import load_config
from ..model.kernels import KERNELS
from .programs import build, difference, evaluate, random_inputs, timing, wrong

class Skip(Exception):
    """The probe does not apply here; the message says why."""


class Fail(Exception):
    """The probe failed; `facts` is what it found before."""

    def __init__(self, message, facts=None, diff=None):
        super().__init__(message)
        self.facts, self.diff = facts or {}, diff


def result(summary, facts, diff=None):
    return dict(summary=summary, facts=facts, diff=diff)


# ---------------------------------------------------------------- helpers

def sysctl(name, string=False):
    """macOS's sysctlbyname: an int (or a string), None when the name does not exist."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    size = ctypes.c_size_t(0)
    if libc.sysctlbyname(name.encode(), None, ctypes.byref(size), None, 0):
        return None
    buf = ctypes.create_string_buffer(size.value) if string else ctypes.c_int64(0)
    if libc.sysctlbyname(name.encode(), ctypes.byref(buf), ctypes.byref(size), None, 0):
        return None
    return buf.value.decode() if string else buf.value


def cpuinfo(field):
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == field), None)
    except OSError:
        return None


def ane_only():
    """Skip a probe of the ANE path where no Neural Engine can be: not a Mac (without the tests' stand-ins),
    an Intel Mac, or an x86_64 Python under Rosetta (the platform row fails for that one)."""
    ok, why = ane.available()
    if not ok and (sys.platform != "darwin" or ane.MACHINE != "arm64" or ane.rosetta()):
        raise Skip(("not a Mac: " if sys.platform != "darwin" else "") + why)


def target(**options):
    """The device the programs run on: the ANE where it can be used; elsewhere than a Mac, the simulator."""
    ok, why = ane.available()
    if ok:
        return open_device("ane", **options), None
    if sys.platform != "darwin":
        return open_device("sim", **options), why
    raise Skip(f"the ANE cannot be used here: {why} (see the device row)")


# aned's own copy of every compiled model, never purged (maderix/h3.c-ane README: "grew to 58GB in one day")
ANED_CACHE = "/Library/Caches/com.apple.aned"


def folder_size(path):
    """The bytes of the files under path, "not present" without it, or why it cannot be read."""
    if not os.path.exists(path):
        return "not present"
    total, errors = 0, []
    for root, _, names in os.walk(path, onerror=errors.append):
        total += sum(os.lstat(os.path.join(root, n)).st_size for n in names)
    return f"unreadable: {errors[0].strerror}" if errors else total


# ---------------------------------------------------------------- the probes

def platform_facts(options):
    darwin = sys.platform == "darwin"
    facts = dict(anectypes=__version__, os=platform.platform(), machine=platform.machine(),
                 python=f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
                 numpy=np.__version__, temporary_directory=tempfile.gettempdir(),
                 fp16_rounding="sse-modes" if fp16.FENV else "mask")
    if darwin:
        facts.update(macos=platform.mac_ver()[0], chip=sysctl("machdep.cpu.brand_string", string=True),
                     rosetta=ane.rosetta(), virtual_machine=sysctl("kern.hv_vmm_present") == 1)
    else:
        facts.update(chip=cpuinfo("model name"), virtual_machine="hypervisor" in (cpuinfo("flags") or "").split())
    try:
        facts["objc_runtime"] = objc.runtime().kind
        facts["ns_temporary_directory"] = objc.temporary_directory()    # where the ANE compiler reads
    except AnectypesError as e:
        facts["objc_runtime"] = f"unavailable: {e}"
    facts["aned_cache_bytes"] = folder_size(ANED_CACHE)
    folder = facts.get("ns_temporary_directory") or facts["temporary_directory"]
    facts["temporary_free_gib"] = round(shutil.disk_usage(folder).free / 2**30, 1)
    cache = facts["aned_cache_bytes"]
    cache = cache if isinstance(cache, str) else f"{cache / 2**20:,.1f} MiB"
    system = f"macOS {facts['macos']}" if darwin else platform.system() + " " + platform.release()
    where = "under Rosetta" if facts.get("rosetta") else "native"
    summary = (f"{system} {facts['machine']} {where}{', a VM' if facts['virtual_machine'] else ''}, {facts['chip']}; "
               f"Python {platform.python_version()}, numpy {np.__version__}; temp {folder}; aned cache {cache}")
    if facts.get("rosetta"):
        raise Fail("this Python is an x86_64 build running under Rosetta: the ANE needs an arm64 Python 3.10 or "
                   "newer (see the README's \"On a Mac\")", facts)
    return result(summary, facts)


def classes(options):
    ane_only()
    objc.runtime()
    if not all(objc.cls(c) for c in CLASSES):
        try:
            ctypes.CDLL(ane.FRAMEWORK, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise Fail(f"AppleNeuralEngine.framework cannot be loaded: {e}") from None
    names = sorted({klass for klass, _, _ in METHODS.values()})
    missing = [c for c in names if not objc.cls(c)]
    unanswered = [f"{klass} {s}" for s, (klass, _, _) in METHODS.items() if objc.cls(klass) and not ane.answers(s)]
    facts = dict(classes={c: c not in missing for c in names}, missing_selectors=unanswered)
    required = [c for c in missing if c in CLASSES] + [m for m in unanswered if m.split()[0] in CLASSES and
                                                       m.split()[1] not in ane.OPTIONAL]
    if required:
        raise Fail(f"missing from AppleNeuralEngine.framework: {', '.join(required)}", facts)
    optional = ", ".join(missing + unanswered)
    selectors = sum(klass in CLASSES for klass, _, _ in METHODS.values())
    return result(f"the {len(CLASSES)} classes and their {selectors} selectors are present"
                  + (f"; optional ones missing: {optional}" if optional else ""), facts)


def device_info(options):
    ane_only()
    ane.load()
    info = objc.cls("_ANEDeviceInfo")
    facts = {}
    with objc.autorelease_pool():
        for selector in ("hasANE", "isVirtualMachine"):
            facts[selector] = ane.msg("+" + selector) if ane.answers("+" + selector) else "not answered"
        facts["aneSubType"] = ane.chip()
        facts["aneArchitectureType"] = (objc.description(objc.send(info, "aneArchitectureType"))
                                        if objc.responds(info, "aneArchitectureType") else "not answered")
    facts["dialect"], facts["why"] = ane.dialect_for(facts["aneSubType"])
    try:
        facts["dialect"] = ane.ANEDevice().dialect
    except AnectypesError as e:
        raise Fail(str(e), facts) from None
    return result(f"aneSubType {facts['aneSubType']}, aneArchitectureType {facts['aneArchitectureType']}: "
                  f"dialect {facts['dialect']} ({facts['why']})", facts)


def surface(options):
    ane_only()
    lib = iosurface.library()
    s = iosurface.IOSurface(MIN_SURFACE_BYTES)
    try:
        pattern = (np.arange(s.nbytes) % 251).astype(np.uint8)
        addresses = [s.address]
        with s.locked(write=True):
            addresses.append(lib.base(s.ref))
            s.array(np.uint8, (s.nbytes,))[:] = pattern
        with s.locked(write=False):
            addresses.append(lib.base(s.ref))
            back = s.array(np.uint8, (s.nbytes,)).copy()
        facts = dict(asked_bytes=MIN_SURFACE_BYTES, alloc_size=lib.alloc_size(s.ref),
                     base_addresses=[hex(a) for a in addresses], stable=len(set(addresses)) == 1,
                     round_trip=bool(np.array_equal(back, pattern)))
    finally:
        s.release()
    if not (facts["stable"] and facts["round_trip"]):
        raise Fail("the base address moved between locks" if not facts["stable"] else
                   "the bytes written under the write lock did not read back under the read-only lock", facts)
    return result(f"{facts['alloc_size']} bytes for {MIN_SURFACE_BYTES} asked; base {addresses[0]:#x} stable across "
                  "3 locks; a pattern written reads back", facts)


def program(name):
    """The probe that compiles program `name` on the device, evaluates it on random inputs and compares it
    with the simulator."""
    def probe(options):
        dev, why = target()
        prog = build(name, load_config(options["model"]), dev.dialect)
        if dev.name == "ane":
            chip = dev.catalogue_chip or limits.NEWEST[dev.dialect]          # as the device's compile checks it
            refused = [f for f in limits.check(parse(prog.text), chip, requests=False) if f.level == "error"]
            if refused:
                raise Skip(f"the chip catalogue refuses it on {chip}: {refused[0]}")
        reps = options["reps"] if name in ("trivial", "control") else 0
        inputs = random_inputs(prog)
        facts = dict(device=dev.name, chip=dev.chip, dialect=dev.dialect,
                     inputs={n: list(shape) for n, shape in prog.inputs.items()})
        try:
            got, times, facts["live_io"] = evaluate(dev, prog, inputs, reps)
        except LayoutError as e:
            facts["live_io"] = e.layout
            if name != "odd":
                raise Fail(str(e), facts) from None
            # what this probe is for: anectypes's own widths are multiples of 32, where packed and padded agree
            return result(f"strided: the engine pads an odd width's rows, as it reports ({e})", facts)
        facts.update(timing(times))
        speed = f"; eval {facts['eval_ms_median']} ms median" if times else ""
        if why:
            if not all(np.isfinite(a).all() for a in got.values()):
                raise Fail("the simulator's result is not finite", facts)
            return result(f"on the simulator (no ANE here){speed}", facts)
        want, sim_times, _ = evaluate(open_device("sim"), prog, inputs, reps)
        facts["simulator"] = timing(sim_times)
        diff = difference(got, want)
        found = f"max |ANE - simulator| {diff['max_abs']:.3g} ({diff['relative']:.2%} of the largest output)"
        if name == "binding" and not wrong(difference({n: -a for n, a in got.items()}, want)):
            raise Fail(f"the result is a - b with its inputs swapped: the engine bound the inputs in their declared "
                       f"order (b, a), not alphabetically (a, b) as anectypes binds them; {found}", facts, diff)
        if wrong(diff):
            raise Fail(f"wrong result: {found}" + ("" if diff["same_finite"] else "; not finite where the "
                                                   "simulator's is, or the other way round")
                       + ("; the engine reads an odd width otherwise than packed, and does not say so"
                          if name == "odd" and not facts["live_io"] else ""), facts, diff)
        return result(("packed: an input 33 values wide reads as written; " if name == "odd" else "") + found + speed,
                      facts, diff)
    return probe


def budget(options):
    dev, why = target(compile_budget=2)
    prog = build("trivial", None, dev.dialect)
    counted = []
    for _ in range(2):
        dev.compile(prog.text).free()
        counted.append(dev.compiles)
    facts = dict(device=dev.name, counted=counted, default_budget=DEFAULT_COMPILE_BUDGET)
    try:
        dev.compile(prog.text).free()
    except CompileBudgetExceeded as e:
        facts["refused"] = str(e)
    else:
        raise Fail("a third compile passed a budget of 2", facts)
    return result(f"{dev.name}: compiles counted {counted} on a budget of 2, the third refused (by default "
                  f"{DEFAULT_COMPILE_BUDGET} per process; every probe runs in a new one)", facts)


def alive(options):
    pid = os.getpid()
    start = processes.process_start(pid)
    facts = dict(pid=pid, start=start, read_through="/proc" if processes.procfs() else "ps",
                 command_line=processes.command_line(pid))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    child_start = processes.process_start(child.pid)
    facts["other_process_alive"] = processes.alive(child.pid, child_start)
    child.stdin.close()
    child.wait()
    facts["other_process_after_exit"] = processes.alive(child.pid, child_start)
    if not processes.alive(pid, start):
        raise Fail(f"this process (pid {pid}) reads as dead through {facts['read_through']}", facts)
    if not facts["other_process_alive"] or facts["other_process_after_exit"]:
        raise Fail(f"another process read as {'dead' if not facts['other_process_alive'] else 'alive'} while it "
                   f"{'ran' if not facts['other_process_alive'] else 'had ended'}", facts)
    if not facts["command_line"]:
        raise Fail(f"this process's command line cannot be read through {facts['read_through']}", facts)
    return result(f"pid {pid} reads as alive through {facts['read_through']} (started {start}); an ended process "
                  "reads as dead; the command line reads", facts)


def median_ms(f, reps):
    """The median of `reps` timed calls of f, in ms, after one untimed call (which starts a BLAS's threads)."""
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)


def blas_speed(options):
    n, reps = 256, options["reps"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    out = np.empty((n, n), np.float32)
    error = float(np.abs(blas.sgemm(a, b) - a.astype(np.float64) @ b).max())
    facts = dict(blas.report(), max_abs_error=error, **{f"{k}_{n}_ms_median": median_ms(f, reps) for k, f in
                                                         (("sgemm", lambda: blas.sgemm(a, b, out)),
                                                          ("numpy", lambda: np.matmul(a, b)))})
    if error > 1e-3:
        raise Fail(f"{facts['sgemm']} is off by {error:.3g} from float64", facts)
    return result(f"{facts['library']} ({facts['core']}), {facts['sgemm']}, thread control: "
                  f"{facts['threading'] or 'none (--threads cannot limit it)'}; sgemm {n}³ "
                  f"{facts[f'sgemm_{n}_ms_median']} ms, numpy {facts[f'numpy_{n}_ms_median']} ms", facts)


def accelerate_paths(reps, n=1 << 20):
    """{use: [Accelerate's ms, numpy's ms]} of the uses on Accelerate's path here, on n floats."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(n, np.float32), np.empty(n, np.float32)
    half, square = np.empty(n, np.float16), x.reshape(1024, -1)
    pairs = {"fp16": (lambda: accelerate.convert(x, half), lambda: x.astype(np.float16)),
             "exp": (lambda: accelerate.exp(x, y), lambda: np.exp(x)),
             "transpose": (lambda: accelerate.transpose(square, y.reshape(square.shape[::-1])),
                           lambda: np.ascontiguousarray(square.T)),
             "norm": (lambda: accelerate.sum_squares(x), lambda: float(np.dot(x, x)))}
    return {use: [median_ms(f, reps) for f in fs] for use, fs in pairs.items() if accelerate.chosen(use)}


def accelerate_probe(options):
    r = accelerate.report()
    if r["error"]:
        raise Fail(r["error"], r)
    if r["library"] is None:
        raise Skip("not a Mac: Accelerate is macOS's" if sys.platform != "darwin" else
                   f"switched off ({accelerate.SWITCH}=0)")
    facts = dict(library=r["library"], paths=r["paths"], symbols=r["symbols"],
                 ms_accelerate_vs_numpy=accelerate_paths(options["reps"]))
    missing = [name for name, ok in r["symbols"].items() if not ok]
    return result(", ".join(f"{use}: {part}" for use, part in r["paths"].items())
                  + (f"; missing: {', '.join(missing)}" if missing else ""), facts)


PROBES = {"platform": platform_facts, "classes": classes, "device": device_info, "iosurface": surface,
          "trivial": program("trivial"), "control": program("control"), "binding": program("binding"),
          "odd": program("odd"), **{f"kernel {k}": program(f"kernel {k}") for k in KERNELS},
          "budget": budget, "alive": alive, "blas": blas_speed, "accelerate": accelerate_probe}
