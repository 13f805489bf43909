"""The real ANE device (anectypes/device/ane/) through real message sends, against fake private classes.

The GNU Objective-C runtime + GNUstep Foundation run every send; tests/support/fake_ane.py defines the private classes,
checks each argument against docs/ane-reference.md §1.2 and runs the MIL with the simulator's fp16 interpreter on the
fake IOSurfaces' host memory. CI installs libgnustep-base1.28: there a missing runtime FAILS; elsewhere it skips.

Each test gets the fakes from conftest.py's `fake_ane` fixture and gives them back: the classes stay registered (a
class cannot be unregistered), but IOSurface is the system's again, so `available()` is False after the test and
the modules that run later, in any order, see no ANE.
"""

import gc
import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from ctypes import c_bool, c_uint, c_void_p
from pathlib import Path

import numpy as np
import pytest
from support.fake_ane import FAKE, REQUEST, layout as fake_layout
from support.hf_folders import lora_llama_folder

from anectypes.doctor import probes
from anectypes.device import ane, open_device
from anectypes.device.protocol import surfaces
from anectypes.device.ane import ANEDevice, iosurface, objc
from anectypes.errors import DeviceError, MILError, ObjCError
from anectypes.mil import Builder
from anectypes.mil.__main__ import main as mil_main
from anectypes.model.config import PRESETS, ModelConfig
from anectypes.model.kernels import KERNELS, dynamic_matmul_kernel
from anectypes.train import main as train_main
from anectypes.train.command import parse_args
from anectypes.train.trainer import resume_argv

GQA = ModelConfig(dim=32, hidden=48, heads=4, kv_heads=2, head_dim=8, layers=1, seq=16, vocab=64).validate()
COMPILE, LOAD, EVALUATE = "compileWithQoS:options:error:", "loadWithQoS:options:error:", \
    "evaluateWithQoS:options:request:error:"
SEQUENCE = ["modelWithMILText:weights:optionsPlist:", "inMemoryModelWithDescriptor:", "hexStringIdentifier",
            COMPILE, LOAD, "modelAttributes", "objectWithIOSurface:", "objectWithIOSurface:", REQUEST, EVALUATE,
            "unloadWithQoS:error:"]


@pytest.fixture(scope="module", autouse=True)
def remove_folders():
    yield
    for identifier in FAKE.identifiers:         # what runs that never free their kernels (train, mil run) left
        shutil.rmtree(tmp() / identifier, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean(fake_ane):
    yield
    assert FAKE.violations == []


def tmp():
    return Path(objc.temporary_directory())


def census():
    """What must come back to baseline: fake instances, Object references, surfaces, temp folders."""
    gc.collect()
    return dict(fake_instances=sum(FAKE.live().values()), objc_objects=objc.live_objects(),
                surfaces=len(FAKE.surfaces), folders=sorted(i for i in FAKE.identifiers if (tmp() / i).exists()))


def run(dev, text, weights, inputs):
    """Compile, bind, evaluate once, free everything; returns copies of the outputs."""
    k = dev.compile(text, weights)
    ins = surfaces(dev, k.inputs, k.sizes)
    for n, s in ins.items():
        s.write(inputs[n])
    outs = surfaces(dev, k.outputs, k.sizes)
    req = dev.request(k, ins, outs)
    dev.eval(req)
    result = {n: s.read() for n, s in outs.items()}
    free(k, req, ins, outs)
    return result


def free(kernel, request, *surfaces):
    if hasattr(request, "free"):              # ANE requests hold retained objects; the simulator's hold nothing
        request.free()
    kernel.free()
    for group in surfaces:
        for s in group.values():
            s.free()


def assert_bit_identical(got, want):
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype == np.float16
        assert np.array_equal(got[n].view(np.uint16), want[n].view(np.uint16)), n


def scale_kernel():
    """y = x * w, w from BLOBFILE: one weight file, so the weights dictionary and weights/ are exercised."""
    return scale_kernel_in("ios18")


def scale_kernel_in(dialect, w=np.linspace(-2, 2, 32)):
    b = Builder(dialect)
    x = b.input("x", [1, 4, 1, 8])
    b.output(b.mul(x=x, y=b.weight(w.reshape(1, 4, 1, 8), "w.bin"), name="y"))
    return b.text(), b.weights()


X = {"x": np.arange(32, dtype=np.float16).reshape(1, 4, 1, 8) / 8}


@pytest.mark.parametrize("name", list(KERNELS))
def test_training_kernel_matches_the_simulator_bit_for_bit(name):
    dev = ANEDevice()
    kernel = KERNELS[name](GQA, dev.dialect)
    rng = np.random.default_rng(sorted(KERNELS).index(name))
    inputs = {n: (rng.standard_normal(shape) * 0.5).astype(np.float16) for n, shape in kernel.in_shapes.items()}
    before = census()
    FAKE.log.clear()
    got = run(dev, kernel.text, kernel.weights, inputs)
    wraps = ["objectWithIOSurface:"] * (len(inputs) + 1)                  # each input and the output
    assert FAKE.log == [*SEQUENCE[:6], *wraps, *SEQUENCE[8:]]
    assert FAKE.mil_texts == [kernel.text.encode()]
    assert_bit_identical(got, run(open_device("sim", precision="fp16"), kernel.text, kernel.weights, inputs))
    assert census() == before


def test_writes_lock_for_writing_reads_lock_read_only_and_eval_leaves_the_locks_alone():
    """As both references do (§1.15): the copy in or out happens inside the lock."""
    dev = ANEDevice()
    k = dev.compile(*scale_kernel())
    xs, ys = dev.surface([1, 4, 1, 8]), dev.surface([1, 4, 1, 8])
    req = dev.request(k, {"x": xs}, {"y": ys})
    x, y = xs.handle.ref, ys.handle.ref
    FAKE.surface_log.clear()
    xs.write(X["x"])
    assert FAKE.surface_log == [("IOSurfaceLock", x, 0), ("IOSurfaceUnlock", x, 0)]
    FAKE.surface_log.clear()
    dev.eval(req)
    assert FAKE.surface_log == []
    got = ys.read()
    assert FAKE.surface_log == [("IOSurfaceLock", y, 1), ("IOSurfaceUnlock", y, 1)]
    assert_bit_identical({"y": got}, run(open_device("sim"), *scale_kernel(), X))
    free(k, req, {"x": xs, "y": ys})


def protected(body, tmp_path):
    """Run `body` in a child process under the fake ANE with FAKE.protect: the CPU may touch a surface's memory
    only between IOSurfaceLock and IOSurfaceUnlock (read-only under a read-only lock), or it faults."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import numpy as np
        from support.fake_ane import installed
        from anectypes.device.ane import ANEDevice
        with installed() as fake:
            fake.protect = True
        """) + textwrap.indent(textwrap.dedent(body) + "\nassert fake.violations == [], fake.violations\n", " " * 4)
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


def test_every_cpu_access_to_a_surface_is_between_a_lock_and_its_unlock(tmp_path):
    """Training (staging weights, writing the embedding and gradients, reading every kernel's outputs),
    every probe of the doctor and the MIL CLI's run, with each surface inaccessible outside its locks."""
    r = protected("""
        from anectypes.train import main
        from anectypes.doctor.probes import PROBES, Skip
        assert main(["--scratch", "--steps", "4", "--accum", "2", "--sample-every", "2", "--backend", "ane",
                     "--run-dir", "run"]) == 0
        for name, probe in PROBES.items():
            try:
                probe(dict(model="tiny", reps=2))
            except Skip:
                assert name == "accelerate"
        from importlib.resources import files
        from anectypes.mil.__main__ import main as mil
        assert mil(["run", str(files("anectypes.mil") / "examples" / "dynamic_matmul.mil"), "--random",
                    "--out", "out", "--backend", "ane"]) == 0
        """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest.ckpt").exists() and (tmp_path / "out" / "mm_y.npy").exists()


@pytest.mark.parametrize("access, faults", [
    ("with s.writing() as a:\n    a[0, 1, 0, 2] = 1.5\nassert s.read()[0, 1, 0, 2] == 1.5", False),
    ("s.array[0, 1, 0, 2] = 1.5", True),                        # no lock
    ("with s.reading() as a:\n    a[0, 1, 0, 2] = 1.5", True),  # a write under the read-only lock
    ("print(float(s.array[0, 1, 0, 2]))", True)])               # a read without a lock
def test_the_protected_fake_catches_an_access_outside_the_locks(tmp_path, access, faults):
    r = protected("s = ANEDevice().surface([1, 4, 1, 8])\n" + access, tmp_path)
    assert (r.returncode, "Segmentation fault" in r.stderr) == ((-signal.SIGSEGV, True) if faults else (0, False)), \
        r.stderr[-3000:]


def test_a_view_outlives_free_and_releases_the_surface_when_it_dies():
    dev = ANEDevice()
    s = dev.surface([1, 4, 1, 8])
    s.write(X["x"])
    ref = s.handle.ref
    view = s.view([1, 4, 1, 8])               # the zero-copy array, kept past free()
    s.free()
    assert FAKE.surfaces[ref].refs == 1       # the view's own CFRetain
    assert np.array_equal(view, X["x"])       # the memory is still the surface's, not released (poisoned: NaN)
    del view
    gc.collect()
    assert ref not in FAKE.surfaces


def metrics(run):
    """A run's training rows (loss, grad_norm) and validation rows (val_loss)."""
    return [(r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in map(json.loads, (run / "metrics.jsonl").open())]


# "strided": the engine pads rows to 64 bytes and each tensor to 64 KiB, and reads and writes them so (issue 44 §1)
@pytest.mark.parametrize("source, layout", [("scratch", "packed"), ("lora", "packed"), ("scratch", "strided"),
                                            ("lora", "strided")])
def test_training_through_the_ane_is_bit_identical_to_the_simulator(tmp_path, source, layout):
    """From scratch, and LoRA on every projection of a Hugging Face folder (the adapters staged into fp16 surface
    memory in chunks, kernels.KernelBuilder.low_rank); on a packed engine and on a strided one, where every width,
    a multiple of 32 fp16 values, lays out as packed, and every surface is made as large as its BatchStride."""
    start = (["--scratch"] if source == "scratch" else
             ["--init-from", str(lora_llama_folder(tmp_path / "hf")), "--lora", "4", "--lora-targets", "q,k,v,o,gate,up,down",
              "--lr", "0.01"])
    common = [*start, "--steps", "6", "--accum", "2", "--sample-every", "0", "--log-every", "1000"]
    FAKE.layout = layout
    ANEDevice()                 # its one options dictionary for the process, made before the census
    before = census()
    assert train_main([*common, "--run-dir", str(tmp_path / "ane"), "--backend", "ane"]) == 0
    assert FAKE.log.count(COMPILE) == len(KERNELS) and FAKE.log.count(EVALUATE) > 6 * len(KERNELS)
    assert FAKE.log.count("unloadWithQoS:error:") == len(KERNELS)    # the trainer frees what it compiled
    assert census() == before                                        # objects, surfaces, temp folders
    assert train_main([*common, "--run-dir", str(tmp_path / "sim"), "--backend", "sim", "--precision", "fp16"]) == 0
    assert sum(r[0] is not None for r in metrics(tmp_path / "ane")) == 6
    assert metrics(tmp_path / "ane") == metrics(tmp_path / "sim")
    assert json.loads((tmp_path / "ane" / "config.json").read_text())["device"] == "ane"


def test_a_packed_writer_against_a_layout_it_cannot_honour_fails_with_one_line_naming_the_kernel_and_input(
        tmp_path, capsys):
    """An engine whose planes are a row longer than the tensor's rows reads channel c at c·(RowStride + 64): the
    trainer's first kernel is refused at its first input, said in one line, and nothing it compiled is left."""
    FAKE.layout = "planes"
    ANEDevice()                 # its one options dictionary for the process, made before the census
    before = census()
    assert train_main(["--scratch", "--steps", "2", "--run-dir", str(tmp_path / "run"), "--backend", "ane"]) == 1
    name = next(iter(KERNELS))
    kernel = KERNELS[name](PRESETS["tiny"], "ios18")
    first, shape = next(iter(kernel.in_shapes.items()))
    at = fake_layout(shape)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: kernel {name} input '{first}' {list(shape)}: the engine lays it out "
                      + ", ".join(f"{k} {at[k]}" for k in ane.LAYOUT) + f"; anectypes writes it packed (RowStride "
                      f"{2 * shape[3]}, PlaneStride {2 * shape[3]}), so it would read other values: refused "
                      "(docs/ane-backend.md)"]
    assert FAKE.log.count(LOAD) == FAKE.log.count("unloadWithQoS:error:") == 1 and census() == before


def test_a_surface_smaller_than_the_engines_batch_stride_is_refused_and_surfaces_are_made_as_large():
    FAKE.layout = "strided"
    dev = ANEDevice()
    text = dynamic_matmul_kernel(32, 32, 32, dev.dialect).text()
    k = dev.compile(text)
    assert k.sizes == {"x": 65536, "mm_y": 65536}       # 32 x 64 and 32 x 32 fp16 values, in 64 KiB
    small = {"x": dev.surface(k.inputs["x"].shape)}
    outs = surfaces(dev, k.outputs, k.sizes)
    with pytest.raises(DeviceError, match=r"^kernel a program input 'x': the engine touches 65536 bytes of its "
                                          r"surface \(BatchStride\), the surface has 49152: make it as large"):
        dev.request(k, small, outs)
    free(k, None, small, outs)
    x = {"x": (np.random.default_rng(2).standard_normal((1, 32, 1, 64)) * 0.5).astype(np.float16)}
    assert_bit_identical(run(dev, text, {}, x), run(open_device("sim"), text, {}, x))


@pytest.mark.parametrize("layout, why", [
    ("absent", "_ANEInMemoryModel does not answer modelAttributes"),
    ("keyless", "NetworkStatusList is absent"),
    ("malformed", "LiveInputList[0].Width is not an NSNumber")])
def test_an_engine_that_does_not_say_its_layout_is_written_packed_and_said_once(capsys, layout, why):
    FAKE.layout = layout
    dev = ANEDevice()
    for _ in range(2):
        assert_bit_identical(run(dev, *scale_kernel(), X), run(open_device("sim"), *scale_kernel(), X))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: the ANE's I/O layout of a program cannot be read ({why}): tensors are written packed, "
                     "unchecked (docs/ane-backend.md)"]
    assert ("modelAttributes" in FAKE.log) == (layout != "absent")


def test_a_seq_not_a_multiple_of_32_is_refused_on_the_ane(tmp_path, capsys):
    assert train_main(["--scratch", "--seq", "48", "--steps", "2", "--run-dir", str(tmp_path / "run"),
                       "--backend", "ane"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: seq 48: on the ANE the sequence length must be a multiple of 32 (its rows are padded otherwise, "
        "docs/ane-backend.md); choose 32 or 64")
    assert COMPILE not in FAKE.log


def test_mil_cli_runs_on_the_ane(tmp_path, capsys):
    # inputs declared out of alphabetical order: the device must bind them by name order (§1.9)
    b = Builder()
    zeta, alpha = b.input("zeta", [1, 4, 1, 8]), b.input("alpha", [1, 4, 1, 8])
    w = b.weight(np.linspace(-1, 3, 32).reshape(1, 4, 1, 8), "w.bin")
    b.output(b.add(x=b.mul(x=zeta, y=w, name="zw"), y=alpha, name="sum"), b.sub(x=zeta, y=alpha, name="diff"))
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "w.bin").write_bytes(b.weights()["@model_path/weights/w.bin"])
    (tmp_path / "k.mil").write_text(b.text())
    rng = np.random.default_rng(5)
    args = []
    for name in ("zeta", "alpha"):
        np.save(tmp_path / f"{name}.npy", rng.standard_normal((1, 4, 1, 8)).astype(np.float16))
        args += ["--input", f"{name}={tmp_path / f'{name}.npy'}"]
    assert mil_main(["run", str(tmp_path / "k.mil"), *args, "--out", str(tmp_path / "ane"), "--backend", "ane"]) == 0
    assert "(ane, fp16)" in capsys.readouterr().out
    assert FAKE.log == ["hasANE", "isVirtualMachine", "aneSubType", *SEQUENCE[:6], *["objectWithIOSurface:"] * 4,
                        REQUEST, EVALUATE, "unloadWithQoS:error:"]
    assert mil_main(["run", str(tmp_path / "k.mil"), *args, "--out", str(tmp_path / "sim"), "--backend", "sim"]) == 0
    load = lambda run: {n: np.load(tmp_path / run / f"{n}.npy") for n in ("sum", "diff")}
    assert_bit_identical(load("ane"), load("sim"))


# ---------------------------------------------------------------- failures: the documented error, nothing leaked

@pytest.mark.parametrize("subtype, tried, why, other", [
    ("h16", "ios18", "aneSubType 'h16' is family h16, m4", "ios16"),
    ("h13g", "ios16", "aneSubType 'h13g' is family h13, m1", "ios18")])
def test_compile_failure_says_the_framework_message_the_dialect_tried_and_how_to_choose_the_other(subtype, tried,
                                                                                                  why, other):
    FAKE.subtype = subtype
    dev, before = ANEDevice(), census()
    FAKE.fail_compile = "ANECCompile() FAILED: fake compiler says no"
    b = Builder(dev.dialect)
    b.output(b.mul(x=b.input("x", [1, 4, 1, 8]), y=2.0, name="y"))
    with pytest.raises(DeviceError) as e:
        dev.compile(b.text())
    assert str(e.value) == (f"ANE compile failed with the {tried} dialect ({why}): compileWithQoS:options:error: "
                            "failed: ANECCompile() FAILED: fake compiler says no (domain com.apple.appleneuralengine, "
                            "code -3, userInfo {NSLocalizedDescriptionKey = \"ANECCompile() FAILED: fake compiler says "
                            "no\"; }); if this chip reads "
                            f"{other}, choose it with --dialect {other} (train, bench, doctor) or ANECTYPES_DIALECT={other}")
    assert LOAD not in FAKE.log and not (tmp() / FAKE.folders[-1]).exists()
    assert census() == before


def test_compile_failure_raises_with_the_frameworks_whole_nserror():
    """Its localized description, domain, code and userInfo, where the cause is (issue 34 §2), on one line."""
    dev, before = ANEDevice(), census()
    text, weights = scale_kernel()
    FAKE.refuse.add(text.encode())
    with pytest.raises(DeviceError) as e:
        dev.compile(text, weights)
    assert re.fullmatch(r'ANE compile failed with the ios18 dialect \([^)]*\): compileWithQoS:options:error: failed: '
                        r'ANECCompile\(\) FAILED \(domain com\.apple\.appleneuralengine, code -3, userInfo \{.*'
                        r'NSUnderlyingError = "fake compiler: this program is refused on purpose"; \}\); if this chip '
                        r'reads ios16, choose it with .*', str(e.value))
    assert LOAD not in FAKE.log and not (tmp() / FAKE.folders[-1]).exists()
    assert census() == before


def test_a_failed_compile_keeps_its_folder_when_asked(monkeypatch):
    monkeypatch.setenv(ane.KEEP_FAILED, "1")
    dev, before = ANEDevice(), census()
    text, weights = scale_kernel()
    FAKE.fail_compile = "ANECCompile() FAILED"
    with pytest.raises(DeviceError, match=r"; its folder is kept: (\S+) \(model\.mil, weights/\)$") as e:
        dev.compile(text, weights)
    folder = tmp() / FAKE.folders[-1]
    assert str(e.value).endswith(f"kept: {folder} (model.mil, weights/)")
    assert (folder / "model.mil").read_text() == text and (folder / "weights" / "w.bin").read_bytes() == weights[
        "@model_path/weights/w.bin"]
    shutil.rmtree(folder)
    assert census() == before


def test_load_failing_once_is_retried():
    dev, before = ANEDevice(), census()
    FAKE.fail_load = 1
    want = run(open_device("sim"), *scale_kernel(), X)
    assert_bit_identical(run(dev, *scale_kernel(), X), want)
    assert FAKE.log.count(LOAD) == 2 and FAKE.fail_load == 0
    assert census() == before


def test_load_failing_always_raises():
    dev, before = ANEDevice(), census()
    FAKE.fail_load = 10**6
    with pytest.raises(DeviceError, match=r"^ANE compile failed with the ios18 dialect \(.*\): "
                                          r"loadWithQoS:options:error: failed: fake load failure"):
        dev.compile(*scale_kernel())
    assert FAKE.log.count(LOAD) == 2 and not (tmp() / FAKE.folders[-1]).exists()
    assert census() == before


def test_evaluate_failure_raises_and_frees_cleanly():
    dev, before = ANEDevice(), census()
    k = dev.compile(*scale_kernel())
    xs, ys = dev.surface([1, 4, 1, 8]), dev.surface([1, 4, 1, 8])
    req = dev.request(k, {"x": xs}, {"y": ys})
    FAKE.fail_evaluate = "ANEProgramProcessRequestDirect() Failed with status=0x1d : Program Inference error"
    with pytest.raises(DeviceError, match=r"^ANE evaluation failed: evaluateWithQoS:options:request:error: failed: "
                                          r"ANEProgramProcessRequestDirect\(\) Failed with status=0x1d"):
        dev.eval(req)
    assert all(FAKE.surfaces[s.handle.ref].lock is None for s in (xs, ys))
    free(k, req, {"x": xs, "y": ys})
    assert census() == before


def test_missing_class_is_named(monkeypatch):
    # registered classes cannot be removed: ask for one that was never defined, with a "framework" that loads
    monkeypatch.setattr(ane, "CLASSES", ane.CLASSES + ("_ANEAbsentForTest",))
    monkeypatch.setattr(ane, "FRAMEWORK", objc.runtime().paths[0])
    before = census()
    with pytest.raises(DeviceError, match="class _ANEAbsentForTest not found"):
        ANEDevice()
    ok, why = ane.available()
    assert not ok and "_ANEAbsentForTest" in why
    dev = open_device("auto")
    assert dev.name == "sim" and "_ANEAbsentForTest" in dev.notice
    assert census() == before


def test_missing_selector_is_named_instead_of_aborting(monkeypatch):
    # sending a selector the class lacks would end the process (§A2): load() must refuse first
    signature = ("_ANEInMemoryModel", c_bool, (c_uint, ane.ERROR))
    monkeypatch.setitem(ane.METHODS, "evaluateRealTimeWithQoS:error:", signature)
    with pytest.raises(DeviceError, match="_ANEInMemoryModel lacks the selector evaluateRealTimeWithQoS:error:"):
        ANEDevice()


def test_the_fakes_refuse_what_the_contract_forbids():
    text, weights = scale_kernel()
    send = lambda receiver, selector, *args: objc.send(objc.cls(receiver), selector, *args,
                                                       argtypes=(c_void_p,) * len(args))
    with objc.autorelease_pool():
        mil = objc.nsdata(text.encode())
        assert send("_ANEInMemoryModelDescriptor", "modelWithMILText:weights:optionsPlist:",
                    objc.nsstring(text), objc.nsdictionary({}), None) is None
        assert send("_ANEInMemoryModelDescriptor", "modelWithMILText:weights:optionsPlist:", mil, None, None) is None
        desc = send("_ANEInMemoryModelDescriptor", "modelWithMILText:weights:optionsPlist:", mil, objc.nsdictionary({}),
                    None)
        model = send("_ANEInMemoryModel", "inMemoryModelWithDescriptor:", desc)
        with pytest.raises(ObjCError, match="QoS must be 21"):
            objc.send_checked(model, COMPILE, 0, objc.nsdictionary({}), argtypes=(c_uint, c_void_p))
        width_only = objc.nsdictionary({objc.nsstring("IOSurfaceWidth"): objc.nsnumber(8)})
        assert iosurface.library().create(width_only) is None
        surface = iosurface.IOSurface(16)
        obj = send("_ANEIOSurfaceObject", "objectWithIOSurface:", surface.ref)
        arrays = [objc.nsarray([obj]), objc.nsarray([objc.nsnumber(0)])] * 2
        assert send("_ANERequest", REQUEST, *arrays, None, None, None) is None      # procedureIndex nil, not @0
        surface.release()
    assert [v.split(":")[0] for v in FAKE.violations] == ["modelWithMILText", "modelWithMILText", "compileWithQoS",
                                                          "IOSurfaceCreate", "requestWithInputs"]
    assert "MIL text must be NSData" in FAKE.violations[0] and "procedureIndex" in FAKE.violations[-1]
    assert "must be the exported kIOSurface* constants" in FAKE.violations[3]    # a key made from the name's text
    FAKE.violations.clear()


def test_mixed_input_allocation_sizes_are_refused_before_the_engine_sees_them(monkeypatch):
    """The backend refuses what the engine would fail with 0x1d (§1.9); the fake engine refuses it too."""
    from support.programs import two_input_kernel
    dev = ANEDevice()
    k = dev.compile(two_input_kernel())
    plain = {n: dev.surface(t.shape) for n, t in k.inputs.items()}
    outs = surfaces(dev, k.outputs)
    with pytest.raises(DeviceError, match="equal allocation sizes"):
        dev.request(k, plain, outs)
    monkeypatch.setattr(ane, "check_uniform", lambda surfaces, what: None)
    req = dev.request(k, plain, outs)
    with pytest.raises(DeviceError, match="ANE evaluation failed.*mixed allocation sizes"):
        dev.eval(req)
    assert len(FAKE.violations) == 1 and "status=0x1d" in FAKE.violations[0]
    FAKE.violations.clear()
    free(k, req, plain, outs)
    rng = np.random.default_rng(5)
    values = {n: rng.standard_normal(t.shape).astype(np.float16) for n, t in k.inputs.items()}
    got = run(dev, two_input_kernel(), {}, values)                    # run() makes the surfaces alike
    assert np.array_equal(got["y"], np.concatenate([values["a"], values["b"]], axis=3))


def test_each_weights_entry_is_built_offset_then_data(monkeypatch):
    """The framework reads an entry by position (its keys' and values' first object, §1.4): it must be built in the
    reference's literal order, `@{@"offset": @0, @"data": blob}`, which dictionaryWithObjects:forKeys:count: gets."""
    built, nsdictionary = [], objc.nsdictionary

    def spy(mapping):
        built.append([objc.to_str(k) for k in mapping])
        return nsdictionary(mapping)

    monkeypatch.setattr(objc, "nsdictionary", spy)
    kernel = ANEDevice().compile(*scale_kernel())
    kernel.free()
    assert [keys for keys in built if "data" in keys] == [["offset", "data"]]       # one weight file
    assert [keys for keys in built if any(k.startswith("@model_path/") for k in keys)] == \
        [["@model_path/weights/w.bin"]]                                                # the weights: path -> entry


def test_kernels_sharing_a_folder_survive_each_others_free():
    """Identical MIL and weight names give one hexStringIdentifier, so one folder (§1.5); the fake's unload deletes
    it, as the framework is said to: a loaded kernel evaluates without it."""
    dev, before = ANEDevice(), census()
    text, weights = scale_kernel()
    first, second = dev.compile(text, weights), dev.compile(text, weights)
    assert first.folder == second.folder and first.folder.is_dir()
    first.free()
    xs, ys = dev.surface([1, 4, 1, 8]), dev.surface([1, 4, 1, 8])
    xs.write(X["x"])
    req = dev.request(second, {"x": xs}, {"y": ys})
    dev.eval(req)
    assert_bit_identical({"y": ys.read()}, run(open_device("sim"), text, weights, X))
    free(second, req, {"x": xs, "y": ys})
    assert census() == before


def test_two_processes_compiling_one_program_never_see_each_others_files(tmp_path):
    """MPI ranks on one Mac, or two runs of one model: one program, one folder (§1.5), here with other weights of
    the same name. B compiles while A is inside its compile: each must compile from the files it wrote (not the
    other's, nor none), compute with its own weights, and the folder is gone once both are done."""
    script = [sys.executable, str(Path(__file__).parent / "support" / "compile_race.py")]
    b = subprocess.Popen([*script, "B", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    a = subprocess.Popen([*script, "A", str(tmp_path), str(b.pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    (a_out, a_err), (b_out, b_err) = a.communicate(timeout=300), b.communicate(timeout=300)
    assert (a.returncode, b.returncode) == (0, 0), a_err[-3000:] + b_err[-3000:]
    assert "waiting for another process's ANE compile" in b_err           # B came while A compiled
    folder = Path(a_out.strip())
    assert folder == Path(b_out.strip()) and folder.parent == tmp() and not folder.exists()


# ---------------------------------------------------------------- what the host and the framework report (§1.16)

@pytest.mark.parametrize("switch, reason", [
    ("has_ane", r"the framework reports no Neural Engine on this Mac \(\+\[_ANEDeviceInfo hasANE\] is NO\)"),
    ("virtual_machine", r"macOS runs in a virtual machine, where the ANE cannot evaluate")])
def test_a_mac_without_a_usable_engine_falls_back_with_the_reason(switch, reason):
    setattr(FAKE, switch, not getattr(FAKE, switch))
    ok, why = ane.available()
    assert not ok and re.search(reason, why)
    dev = open_device("auto")
    assert dev.name == "sim" and re.search(reason, dev.notice)
    with pytest.raises(DeviceError, match=reason):
        ANEDevice()
    assert not {"modelWithMILText:weights:optionsPlist:", "aneSubType"} & set(FAKE.log)


@pytest.mark.parametrize("translated, reason", [
    (False, r"^the ANE needs macOS on Apple Silicon \(arm64\); this is \w+ x86_64$"),
    (True, r"^this Python is an x86_64 build running under Rosetta: the ANE needs an arm64 Python")])
def test_an_x86_64_process_falls_back_before_asking_the_framework(monkeypatch, translated, reason):
    monkeypatch.setattr(ane, "MACHINE", "x86_64")
    monkeypatch.setattr(ane, "rosetta", lambda: translated)
    FAKE.log.clear()
    ok, why = ane.available()
    assert not ok and re.search(reason, why)
    assert open_device("auto").notice == f"backend auto: using the simulator ({why})"
    assert FAKE.log == []


def test_the_doctors_platform_row_fails_on_a_mac_when_python_runs_under_rosetta(monkeypatch):
    monkeypatch.setattr(ane, "rosetta", lambda: False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(probes, "sysctl", lambda name, string=False: "Apple M4" if string else 0)
    facts = probes.platform_facts({})["facts"]               # the fixture's process: arm64, not translated
    assert (facts["rosetta"], facts["chip"], facts["virtual_machine"]) == (False, "Apple M4", False)
    monkeypatch.setattr(ane, "rosetta", lambda: True)
    with pytest.raises(probes.Fail, match=r"x86_64 build running under Rosetta: the ANE needs an arm64 Python") as e:
        probes.platform_facts({})
    assert e.value.facts["rosetta"] is True


# ---------------------------------------------------------------- ownership

@pytest.mark.slow
def test_a_thousand_cycles_leak_nothing():
    dev = ANEDevice(compile_budget=10**6)
    text, weights = scale_kernel()
    want = run(open_device("sim"), text, weights, X)
    for _ in range(20):                                   # warm-up: caches of selectors, prototypes, classes
        run(dev, text, weights, X)
    before, entries = census(), len(list(tmp().iterdir()))
    for _ in range(1000):
        assert_bit_identical(run(dev, text, weights, X), want)
    assert census() == before and len(list(tmp().iterdir())) == entries
    assert dev.compiles == 1020 and FAKE.log.count("unloadWithQoS:error:") == 1020


# ---------------------------------------------------------------- chip, dialect, auto, doctor

# the names probes print: suffixed (h15g, h16g; "M4, H16G" in R:README.md), M5 Max's h17 (PR#50), a newer one
@pytest.mark.parametrize("subtype, dialect, header", [("h13", "ios16", b"program(1.0)"),
                                                      ("h13g", "ios16", b"program(1.0)"),
                                                      ("H14G", "ios16", b"program(1.0)"),
                                                      ("h15g", "ios18", b"program(1.3)"),
                                                      ("h16", "ios18", b"program(1.3)"),
                                                      ("H16G", "ios18", b"program(1.3)"),
                                                      ("h17", "ios18", b"program(1.3)"),
                                                      ("h18", "ios18", b"program(1.3)")])
def test_ane_sub_type_selects_the_dialect_by_family(subtype, dialect, header):
    FAKE.subtype = subtype
    dev = ANEDevice()
    assert (dev.chip, dev.dialect) == (subtype, dialect)
    text = dynamic_matmul_kernel(32, 32, 32, dev.dialect).text()      # inner dimension 32: M1 computes it
    x = {"x": (np.random.default_rng(1).standard_normal((1, 32, 1, 64)) * 0.5).astype(np.float16)}
    assert_bit_identical(run(dev, text, {}, x), run(open_device("sim"), text, {}, x))
    assert FAKE.mil_texts[0].startswith(header)


def test_an_ane_sub_type_of_another_class_is_read_by_its_description(tmp_path):
    """A build whose +aneSubType is not an NSString: UTF8String would be an unrecognized selector (an abort)."""
    r = protected("fake.subtype = 16\nassert ANEDevice().chip == '16'", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("subtype", ["h13", "h13g"])
def test_the_chip_catalogue_refuses_before_the_framework_sees_the_program(subtype):
    """On an M1 (aneSubType h13, or h13g) a matmul whose inner dimension is not a multiple of 32 returns zeros
    (§3.10): the device refuses it at compile, as the simulator does for --chip m1."""
    FAKE.subtype = subtype
    dev, before = ANEDevice(), census()
    FAKE.log.clear()
    with pytest.raises(MILError, match=r"inner dimension 16 is not a multiple of 32.* on m1 \[matmul-inner-32"):
        dev.compile(dynamic_matmul_kernel(16, 16, 16, dev.dialect).text())
    assert FAKE.log == [] and dev.compiles == 0 and census() == before


@pytest.mark.parametrize("subtype, override, variable, dialect, why", [
    ("h13g", None, None, "ios16", "aneSubType 'h13g' is family h13, m1"),
    ("H14G", None, None, "ios16", "aneSubType 'H14G' is family h14, m2"),
    ("h16g", None, None, "ios18", "aneSubType 'h16g' is family h16, m4"),
    ("h17", None, None, "ios18", "aneSubType 'h17' is family h17, m5"),
    ("h21", None, None, "ios18", "aneSubType 'h21' is family h21, newer than any known chip"),
    ("ane2", None, None, "ios18", "aneSubType 'ane2' is of no known family"),
    (None, None, None, "ios18", "the framework names no chip"),
    ("h16", None, "ios16", "ios16", "chosen by ANECTYPES_DIALECT"),
    ("h13", "ios18", "ios16", "ios18", "chosen by --dialect"),          # the flag over the variable
    ("h13", None, "", "ios16", "aneSubType 'h13' is family h13, m1")])  # an empty variable is none
def test_the_dialect_is_the_override_else_the_variable_else_the_chip_family(monkeypatch, subtype, override,
                                                                            variable, dialect, why):
    monkeypatch.delenv("ANECTYPES_DIALECT", raising=False)
    if variable is not None:
        monkeypatch.setenv("ANECTYPES_DIALECT", variable)
    assert ane.dialect_for(subtype, override) == (dialect, why)


@pytest.mark.parametrize("override, variable, error", [
    ("ios17", None, "--dialect 'ios17': the MIL dialects are ios16, ios18"),
    (None, "iOS16", "ANECTYPES_DIALECT 'iOS16': the MIL dialects are ios16, ios18")])
def test_an_unknown_dialect_is_refused_naming_where_it_came_from(monkeypatch, override, variable, error):
    if variable:
        monkeypatch.setenv("ANECTYPES_DIALECT", variable)
    with pytest.raises(DeviceError, match=f"^{re.escape(error)}$"):
        ANEDevice(dialect=override)


def test_an_overridden_dialect_compiles_the_training_kernels_in_it_with_its_chips_limits(monkeypatch, tmp_path):
    """An M4 (h16) told ios16, by the variable or by train --dialect: every kernel is written in ios16 and
    checked against the newest chip that reads it (m2), not refused as 'm4 reads ios18'."""
    monkeypatch.setenv("ANECTYPES_DIALECT", "ios16")
    dev = ANEDevice()
    assert (dev.dialect, dev.dialect_why) == ("ios16", "chosen by ANECTYPES_DIALECT")
    assert_bit_identical(run(dev, *scale_kernel_in("ios16"), X), run(open_device("sim"), *scale_kernel_in("ios16"), X))
    monkeypatch.delenv("ANECTYPES_DIALECT")
    FAKE.mil_texts.clear()
    assert train_main(["--scratch", "--steps", "2", "--accum", "1", "--sample-every", "0", "--run-dir",
                       str(tmp_path / "run"), "--backend", "ane", "--dialect", "ios16"]) == 0
    assert len(FAKE.mil_texts) == len(KERNELS) and all(t.startswith(b"program(1.0)") for t in FAKE.mil_texts)


def test_a_restart_keeps_the_dialect_flag(tmp_path):
    args, _ = parse_args(["--scratch", "--dialect", "ios16", "--chip", "m2"])
    argv = resume_argv(args, tmp_path)
    assert argv[argv.index("--dialect") + 1] == "ios16" and argv[argv.index("--chip") + 1] == "m2"


def test_each_compile_names_its_kernel_before_the_compiler_runs_and_the_simulator_prints_none(capsys, tmp_path):
    """A compile that never returns is attributable: the line naming it is on stderr when compileWithQoS runs."""
    seen = []
    FAKE.before_compile = lambda folder: seen.append(capsys.readouterr().err)
    common = ["--scratch", "--steps", "2", "--accum", "1", "--sample-every", "0"]
    assert train_main([*common, "--run-dir", str(tmp_path / "ane"), "--backend", "ane"]) == 0
    assert [re.findall(r"^compiling (\w+) on the ANE \([0-9a-f]{12}\)$", err, re.M) for err in seen] == \
        [[name] for name in KERNELS]
    capsys.readouterr()
    assert train_main([*common, "--run-dir", str(tmp_path / "sim"), "--backend", "sim"]) == 0
    assert "compiling" not in capsys.readouterr().err


def test_auto_picks_the_ane():
    dev = open_device("auto")
    assert isinstance(dev, ANEDevice) and dev.notice is None
    fp32 = open_device("auto", precision="fp32")
    assert fp32.name == "sim" and "fp32" in fp32.notice
    with pytest.raises(DeviceError, match=r"backend auto uses this Mac's ANE \(h16\): choose backend sim"):
        open_device("auto", chip="m4")                      # a chip's limits are the simulator's
