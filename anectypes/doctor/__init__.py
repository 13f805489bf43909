"""python -m anectypes.doctor: a ladder of probes, each in its own process, that pinpoints what fails on this machine.

From the platform up: the private classes, the device's answers, an IOSurface, a trivial program, the reference's
own kernel, the input binding, each of the ten training kernels of a model (each against the simulator), the
compile budget, process liveness, the BLAS and Accelerate. One row each: OK, FAIL (with the full error) or SKIP
(with the reason). `--report` prints it as Markdown for a bug report, `--json` as JSON (tools/doctor_schema.json).
"""

from .command import main

__all__ = ["main"]
