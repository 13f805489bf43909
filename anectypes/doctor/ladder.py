"""The ladder: every probe in a process of its own, one row each, in order. A probe that crashes (a signal
inside an Objective-C call) or hangs is a FAIL row that names the signal and where faulthandler saw it die;
the probes after it still run."""

import json
import signal
import subprocess
import sys
import sysconfig
import time

from .probes import PROBES

STDLIB = sysconfig.get_paths()["stdlib"]
TAIL = 40                  # lines of a dead probe's stderr kept in its row: faulthandler's traceback is last


def innermost(stderr):
    """faulthandler's innermost frame outside Python's own library ('File "...", line N in f'), or None."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if "most recent call first" in line]
    frames = [line.strip() for line in lines[starts[-1] + 1:] if line.strip().startswith("File ")] if starts else []
    return next((f for f in frames if not f.startswith(f'File "{STDLIB}')), frames[0] if frames else None)


def died(code, stderr, hung_after):
    if hung_after:
        what = f"no answer after {hung_after} s: stopped with SIGABRT"
    elif code < 0:
        what = f"the probe's process died of {signal.Signals(-code).name} ({signal.strsignal(-code)})"
    else:
        what = f"the probe's process exited with status {code} without a result"
    frame = innermost(stderr)
    summary = what + (f" in {frame}" if frame else "")
    tail = "\n".join(stderr.rstrip().splitlines()[-TAIL:])
    return dict(status="FAIL", summary=summary, error=f"{summary}\n{tail}".rstrip(), facts={}, diff=None)


def run(name, options, timeout):
    """One probe's row: its child's answer, or why the child gave none."""
    t0 = time.perf_counter()
    command = [sys.executable, "-X", "faulthandler", "-m", "anectypes.doctor.child", name, json.dumps(options)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        hung_after = None
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung_after = timeout
            child.send_signal(signal.SIGABRT)          # faulthandler prints where it hangs, then it dies
            try:
                out, err = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
    row = dict(probe=name, seconds=round(time.perf_counter() - t0, 3))
    if child.returncode == 0 and not hung_after:
        try:
            return {**row, **json.loads(out)}
        except ValueError:
            err += f"\n(its stdout was not a row: {out[-500:]!r})"
    return {**row, **died(child.returncode, err, hung_after)}


def ladder(options, timeout, each=None):
    """Every probe's row, in order; `each(row)` is called as each one ends."""
    rows = []
    for name in PROBES:
        rows.append(run(name, options, timeout))
        if each:
            each(rows[-1])
    return rows
