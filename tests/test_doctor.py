"""`python -m anectypes.doctor` on a machine without an ANE says so and checks the simulator."""

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def doctor(*args):
    r = subprocess.run([sys.executable, "-m", "anectypes.doctor", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def test_doctor_reports_why_the_simulator_is_used():
    out = doctor("--reps", "5")
    assert f"the ANE needs macOS on Apple Silicon (arm64); this is Linux {platform.machine()}" in out
    assert "the simulator will be used" in out and "warning:" not in out
    assert "_ANEInMemoryModel: missing" in out


def test_doctor_json():
    r = json.loads(doctor("--json", "--reps", "5"))
    assert r["ane"]["available"] is False and r["objc_runtime"] in ("gnu", "apple")
    assert r["simulator"]["eval_ms_median"] > 0
    x86_linux = sys.platform == "linux" and platform.machine() == "x86_64"
    assert r["fp16_rounding"] == ("sse-modes" if x86_linux else "mask")
    assert set(r["classes"]) == {"_ANEInMemoryModelDescriptor", "_ANEInMemoryModel", "_ANERequest",
                                 "_ANEIOSurfaceObject"}
