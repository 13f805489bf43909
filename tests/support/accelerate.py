"""The stand-in Accelerate library (accelerate_standin.c: Apple's prototypes, real arithmetic), built by the tests
with gcc; ANECTYPES_ACCELERATE (and ANECTYPES_BLAS, for its CBLAS) pointed at it runs anectypes' Accelerate paths
on Linux."""

import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("accelerate_standin.c")


def build(directory, legacy_only=False, source=SOURCE):
    """The stand-in compiled into `directory`: its path. legacy_only: without the $NEWLAPACK CBLAS and the BLAS
    threading API (Accelerate before macOS 13.3 and 15). No contraction into fused multiply-adds, so its float
    arithmetic is numpy's, operation by operation."""
    out = Path(directory) / ("accelerate_legacy.so" if legacy_only else "accelerate.so")
    r = subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Werror",
                        *(["-DLEGACY_ONLY"] if legacy_only else []), "-o", str(out), str(source), "-lm"],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"gcc failed to build the Accelerate stand-in:\n{r.stderr}")
    return out
