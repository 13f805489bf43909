"""The JSON report (schema version 1, tools/bench_schema.json) and what it says about the machine it ran on."""

import platform
import subprocess
import sys

import numpy as np

from .. import __version__
from ..host import accelerate
from ..host.system import physical_memory

SCHEMA_VERSION = 1
NOTE_SIM = "simulator figures"
NOTE_ANE = "ANE figures"
NOTE_CPU = "CPU figures"
SIM_HEADER = "SIMULATOR figures (numpy + CPU BLAS on this machine), not ANE figures"


def cpu_model():
    """The CPU's marketing name: /proc/cpuinfo on Linux, sysctl on macOS."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("model name", "hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def memory_gb():
    memory = physical_memory()
    return round(memory / 2**30, 1) if memory else None


def blas_info(report):
    """The BLAS part of accelerate.report(): its file, kernel, sgemm symbol, thread control and threads."""
    return dict(core=f"unavailable: {report['error']}", threads=None) if "error" in report else report


def accelerate_info(used=()):
    """(the BLAS block, the Accelerate block: the library loaded, the path each use takes, the uses that ran
    through Accelerate here or in the benchmark's processes, `used`)."""
    r = accelerate.report()
    return blas_info(r["blas"]), dict(library=r["library"], error=r["error"], paths=r["paths"],
                                      used=sorted({*r["used"], *used}))


def system_info(backend, precision, chip=None, used=()):
    """The report's system block; `chip` is the ANE's aneSubType when the ANE ran, else the CPU's name; `used`:
    the Accelerate uses the benchmark's other processes ran."""
    blas, accel = accelerate_info(used)
    info = dict(machine=platform.machine(), os=f"{platform.system()} {platform.release()}",
                chip=chip or cpu_model(), memory_gb=memory_gb(), backend=backend, precision=precision,
                anectypes_version=__version__, blas=blas, accelerate=accel, python=platform.python_version(),
                numpy=np.__version__)
    if sys.platform == "darwin":
        info["macos_version"] = platform.mac_ver()[0]
    return info


def note_for(backend):
    return {"ane": NOTE_ANE, "cpu": NOTE_CPU}.get(backend, NOTE_SIM)


def report(backend, precision, chip, benchmarks, summary, used=()):
    return dict(schema_version=SCHEMA_VERSION, system=system_info(backend, precision, chip, used),
                benchmarks=benchmarks, summary=summary)


def header(backend, chip):
    """A table's first line: whose figures these are."""
    if backend == "cpu":
        return "CPU figures (the decoder runs on the CPU: numpy and the BLAS)"
    return SIM_HEADER if backend != "ane" else f"ANE figures (chip {chip or 'unknown'})"
