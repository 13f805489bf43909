"""`python -m anectypes.doctor`, run as a user runs it: on Linux the ladder runs against the simulator; under the
stand-in ANE classes (tests/support/fake_ane.py, which each probe's process gets through
tests/support/fake_ane_site/sitecustomize.py) it runs as on a Mac, and a refused kernel, a crash inside a send and
a wrong input binding each show as exactly one FAIL row while the later probes still run."""

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jsonschema import Draft202012Validator
from markdown_it import MarkdownIt
from support.fake_ane import layout as fake_layout

from anectypes.device.ane import KEEP_FAILED, LAYOUT, LOCK_FILE
from anectypes.doctor.command import markdown
from anectypes.doctor.probes import PROBES
from anectypes.model.config import PRESETS
from anectypes.model.kernels import KERNELS

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "tools" / "doctor_schema.json").read_text())
SITE = ROOT / "tests" / "support" / "fake_ane_site"
NOT_A_MAC = f"not a Mac: the ANE needs macOS on Apple Silicon (arm64); this is Linux {platform.machine()}"
PROGRAMS = ["trivial", "control", "binding", "odd", *(f"kernel {k}" for k in KERNELS)]


def doctor(temp, *args, fake=None, keep=False):
    """The command in a fresh process whose NSTemporaryDirectory() (GNUstep reads TEMP) is `temp`; `fake`: the
    stand-in classes in every probe's process, with these faults."""
    env = dict(os.environ, TEMP=str(temp))
    env.pop(KEEP_FAILED, None)
    if fake is not None:
        env["ANECTYPES_FAKE_ANE"] = json.dumps(fake)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    if keep:
        env[KEEP_FAILED] = "1"
    r = subprocess.run([sys.executable, "-m", "anectypes.doctor", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800, env=env)
    assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr
    return r


def ladder(temp, *args, **kwargs):
    """--json's document, checked against the schema, its own counts and the exit status."""
    r = doctor(temp, "--json", "--reps", "2", *args, **kwargs)
    doc = json.loads(r.stdout)
    Draft202012Validator(SCHEMA).validate(doc)
    statuses = [row["status"] for row in doc["rows"]]
    assert doc["counts"] == {s: statuses.count(s) for s in ("OK", "FAIL", "SKIP")}
    assert [row["probe"] for row in doc["rows"]] == list(PROBES)         # every probe, in order, the later ones too
    assert r.returncode == (1 if "FAIL" in statuses else 0)
    return doc


def rows(doc):
    return {row["probe"]: row for row in doc["rows"]}


def failed(doc):
    return [row["probe"] for row in doc["rows"] if row["status"] == "FAIL"]


@pytest.fixture
def gnu_runtime(objc_runtime):
    """GNUstep's runtime, which the stand-in classes are written for (it FAILS in CI when missing)."""
    if objc_runtime.kind != "gnu":
        pytest.skip("the stand-in classes are for the GNU runtime (Linux); macOS has the real framework")


def test_the_schema_names_every_probe():
    assert SCHEMA["$defs"]["row"]["properties"]["probe"]["enum"] == list(PROBES)


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux ladder; on a Mac the ANE probes run")
def test_on_linux_the_ladder_runs_on_the_simulator_and_the_mac_probes_say_why_they_skip(objc_runtime, tmp_path):
    doc = ladder(tmp_path)
    by = rows(doc)
    assert failed(doc) == []
    assert {n for n, r in by.items() if r["status"] == "SKIP"} == {"classes", "device", "iosurface", "accelerate"}
    assert [by[n]["summary"] for n in ("classes", "device", "iosurface")] == [NOT_A_MAC] * 3
    assert by["accelerate"]["summary"] == "not a Mac: Accelerate is macOS's"
    facts = by["platform"]["facts"]
    assert (facts["machine"], facts["numpy"]) == (platform.machine(), np.__version__)
    assert facts["python"].split()[1] == platform.python_version()
    assert facts["ns_temporary_directory"] == str(tmp_path)
    for name in PROGRAMS:
        assert by[name]["facts"]["device"] == "sim" and by[name]["diff"] is None, name
        assert by[name]["summary"].startswith("on the simulator (no ANE here)"), name
    assert by["kernel sdpaFwd"]["facts"]["inputs"] == {"x": [1, 64, 1, 256], "prev": [1, 721, 1, 64]}   # tiny's
    budget = by["budget"]["facts"]
    assert budget["counted"] == [1, 2] and "compile budget of 2 spent" in budget["refused"]
    assert by["alive"]["facts"]["other_process_alive"] and not by["alive"]["facts"]["other_process_after_exit"]
    assert "anectypes.doctor.child" in by["alive"]["facts"]["command_line"]


def test_under_the_stand_in_classes_every_probe_passes_and_the_report_is_markdown(gnu_runtime, tmp_path):
    r = doctor(tmp_path, "--report", "--reps", "2", "--model", "stories15m", fake={"model": "stories15m"})
    # every compile's folder removed; the lock that serializes them across processes stays
    assert r.returncode == 0 and [p.name for p in tmp_path.iterdir()] in ([], [LOCK_FILE])
    tokens = MarkdownIt("commonmark").enable("table").parse(r.stdout)
    heading = next(i for i, t in enumerate(tokens) if t.type == "heading_open")
    assert tokens[heading].tag == "h3" and tokens[heading + 1].content == "anectypes doctor: 0 FAIL, 21 OK, 1 SKIP"
    types = [t.type for t in tokens]
    opens, closes = [i for i, t in enumerate(types) if t == "tbody_open"], [i for i, t in enumerate(types) if t == "tbody_close"]
    cells = [t.content for t in tokens[opens[0]:closes[0]] if t.type == "inline"]
    table = [cells[i:i + 4] for i in range(0, len(cells), 4)]
    lists = [t.content for t in tokens[opens[1]:closes[1]] if t.type == "inline"]     # the live I/O lists' table
    lists = [lists[i:i + 10] for i in range(0, len(lists), 10)]
    assert [row[:2] for row in table] == [[n, "SKIP" if n == "accelerate" else "OK"] for n in PROBES]
    fences = [t for t in tokens if t.type == "fence"]
    assert [f.info for f in fences] == ["json"]                         # no failure blocks, the ladder as JSON
    doc = json.loads(fences[0].content)
    Draft202012Validator(SCHEMA).validate(doc)
    by = rows(doc)
    assert table[list(PROBES).index("binding")][3] == by["binding"]["summary"]
    assert by["device"]["facts"]["aneSubType"] == "h16" and by["device"]["facts"]["dialect"] == "ios18"
    assert by["iosurface"]["facts"]["stable"] and by["iosurface"]["facts"]["round_trip"]
    for name in PROGRAMS:                    # the stand-ins run the simulator's plan: no difference at all
        assert by[name]["facts"]["device"] == "ane" and by[name]["diff"] == dict(max_abs=0.0, relative=0.0,
                                                                                  same_finite=True), name
    assert by["odd"]["summary"].startswith("packed: an input 33 values wide reads as written; max |ANE - simulator| 0")
    assert by["odd"]["facts"]["live_io"] == {"inputs": [dict(Symbol="x", **fake_layout([1, 64, 1, 33]))],
                                             "outputs": [dict(Symbol="y@output", **fake_layout([1, 64, 1, 33]))]}
    assert lists == [[name, what, e["Symbol"], *(str(e[k]) for k in LAYOUT)] for name in PROGRAMS
                     for what in ("inputs", "outputs") for e in by[name]["facts"]["live_io"][what]]
    d = PRESETS["stories15m"].dim
    assert by["kernel woFwd"]["facts"]["inputs"]["x"] == [1, d, 1, d]
    assert by["control"]["facts"]["inputs"] == {"x": [1, 768, 1, 1024]} and by["control"]["facts"]["eval_ms_median"] > 0


@pytest.mark.parametrize("layout, failures, summary", [
    ("strided", [], r"^strided: the engine pads an odd width's rows, as it reports \(kernel a program input 'x' "
                    r"\[1, 64, 1, 33\]: the engine lays it out Width 33, Height 1, Channels 64, RowStride 128, "
                    r"PlaneStride 128, BatchStride 65536, Interleave 1; anectypes writes it packed \(RowStride 66, "),
    ("silent", ["odd"], r"wrong result: .*; the engine reads an odd width otherwise than packed, and does not say so$")])
def test_the_odd_width_probe_tells_a_strided_engine_from_a_packed_one(gnu_runtime, tmp_path, layout, failures,
                                                                      summary):
    """An engine that pads rows to 64 bytes: said by its live I/O lists, or only by the numbers it reads; the
    training kernels' widths, multiples of 32, pass on both."""
    doc = ladder(tmp_path, fake={"layout": layout})
    assert failed(doc) == failures
    assert re.search(summary, rows(doc)["odd"]["summary"]), rows(doc)["odd"]["summary"]
    assert (rows(doc)["odd"]["facts"]["live_io"] is None) == (layout == "silent")


def kept_folder(error):
    found = re.search(r"its folder is kept: (\S+) \(model\.mil, weights/\)", error)
    return found and Path(found.group(1))


def test_a_refused_kernel_is_one_fail_row_with_the_full_nserror_and_its_kept_folder(gnu_runtime, tmp_path):
    doc = ladder(tmp_path, fake={"refuse": "kernel woFwd"}, keep=True)
    assert failed(doc) == ["kernel woFwd"]
    row = rows(doc)["kernel woFwd"]
    assert re.match(r"DeviceError: ANE compile failed with the ios18 dialect \(aneSubType 'h16' is family h16, m4\): "
                    r"compileWithQoS:options:error: failed: ANECCompile\(\) FAILED \(domain "
                    r"com\.apple\.appleneuralengine, code -3, userInfo", row["error"])
    assert "fake compiler: this program is refused on purpose" in row["error"]     # only the userInfo holds it
    folder = kept_folder(row["error"])
    assert folder.parent == tmp_path and (folder / "weights").is_dir()
    assert (folder / "model.mil").read_text() == KERNELS["woFwd"](PRESETS["tiny"], "ios18").text
    tokens = MarkdownIt("commonmark").parse(markdown(doc))              # the report shows the whole error
    block = next(i for i, t in enumerate(tokens) if t.type == "heading_open" and t.tag == "h4")
    assert tokens[block + 1].content == "FAIL: kernel woFwd"
    assert next(t for t in tokens[block:] if t.type == "fence").content == row["error"] + "\n"
    assert all(rows(doc)[n]["status"] == "OK" for n in PROGRAMS if n != "kernel woFwd")


def test_a_crash_inside_a_send_is_one_fail_row_naming_the_probe_and_the_signal(gnu_runtime, tmp_path):
    r = doctor(tmp_path, "--reps", "2", fake={"crash": "kernel sdpaBwd2"})
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    rows_ = [line for line in lines if not line.startswith(" ")]
    assert [line.split()[0] if not line.startswith("kernel ") else " ".join(line.split()[:2])
            for line in rows_[:-1]] == list(PROBES)
    assert [line for line in rows_ if " FAIL " in line] == [next(line for line in rows_ if "kernel sdpaBwd2" in line)]
    crash = next(line for line in rows_ if "kernel sdpaBwd2" in line)
    assert re.search(r"FAIL .* the probe's process died of SIGSEGV \(Segmentation fault\) in "
                     r"File \".*fake_ane\.py\", line \d+ in evaluate$", crash)
    detail = lines[lines.index(crash) + 1:lines.index(rows_[rows_.index(crash) + 1])]
    assert "    Fatal Python error: Segmentation fault" in detail
    assert any(re.search(r"device/ane/__init__\.py\", line \d+ in eval$", line) for line in detail)
    assert rows_[-1] == "22 probes: 20 OK, 1 FAIL, 1 SKIP; --report prints all of it for a bug report"


def test_inputs_bound_in_declared_order_are_one_fail_row_at_the_binding_probe(gnu_runtime, tmp_path):
    doc = ladder(tmp_path, fake={"declared_order": "binding"})
    assert failed(doc) == ["binding"]
    row = rows(doc)["binding"]
    assert "bound the inputs in their declared order (b, a), not alphabetically (a, b)" in row["error"]
    assert row["diff"]["relative"] == pytest.approx(2.0, rel=0.05)         # b − a against a − b


@pytest.mark.slow
def test_a_probe_that_hangs_is_stopped_and_is_one_fail_row_saying_where(gnu_runtime, tmp_path):
    """A minute is far more than any probe here takes, however loaded the machine: only the hung one reaches it."""
    doc = ladder(tmp_path, "--timeout", "60", fake={"hang": "kernel qBwd"})
    assert failed(doc) == ["kernel qBwd"]
    row = rows(doc)["kernel qBwd"]
    assert re.match(r'no answer after 60 s: stopped with SIGABRT in File ".*fake_ane\.py", line \d+ in compile_model$',
                    row["summary"])
    assert "Fatal Python error: Aborted" in row["error"]


def test_the_platform_row_reports_aneds_cache_size(monkeypatch, tmp_path):
    """aned's model cache: the bytes of its files where it is readable, "not present" where it is not (Linux)."""
    from anectypes.doctor import probes
    monkeypatch.setattr(probes, "ANED_CACHE", str(tmp_path / "aned"))
    assert probes.platform_facts({})["facts"]["aned_cache_bytes"] == "not present"
    (tmp_path / "aned" / "model").mkdir(parents=True)
    (tmp_path / "aned" / "model" / "data").write_bytes(b"x" * 3000)
    (tmp_path / "aned" / "index").write_bytes(b"y" * 5)
    row = probes.platform_facts({})
    assert row["facts"]["aned_cache_bytes"] == 3005 and row["summary"].endswith("; aned cache 0.0 MiB")
