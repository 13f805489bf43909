"""Processes: whether one is alive (and the same one: pid + start time), its command line and the files it
holds open, and its CPU time and memory, on Linux (/proc) and macOS (ps, lsof); and this process's CPU and
memory use."""

import os
import subprocess
import sys
import time

PROC = "/proc"          # Linux's process table; where it does not exist (macOS), ps and lsof answer


def procfs():
    return os.path.isdir(f"{PROC}/self")


def ps(pid, *fields):
    """`ps -o FIELD= ... -p PID`'s answer (the whole line, stripped), "" when there is no such process.
    Run in the C locale and UTC: BSD ps formats lstart by both and TIME with the locale's decimal point
    (ps(1)), so two processes with different LANG/TZ would otherwise disagree about one process."""
    options = [a for field in fields for a in ("-o", f"{field}=")]
    try:
        return subprocess.run(["ps", "-ww", *options, "-p", str(int(pid))], capture_output=True, text=True,
                              timeout=5, env=dict(os.environ, LC_ALL="C", TZ="UTC")).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _stat(pid):
    """The fields of /proc/<pid>/stat after the command name (fields 3...), or None."""
    try:
        with open(f"{PROC}/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid):
    """An opaque token of when process pid started (pid + start tell a process from a later one that
    reuses its pid), or None when there is no such process."""
    if not procfs():
        stat, _, start = ps(pid, "stat", "lstart").partition(" ")
        return None if stat.startswith("Z") else start.strip() or None      # a zombie has ended
    rest = _stat(pid)
    return None if rest is None or rest[0] in ("Z", "X") else rest[19]     # field 22: start time in ticks


def seconds(text):
    """ps's TIME, [[DD-]HH:]MM:SS (Linux) or M:SS.ss (macOS), in seconds; None for anything else."""
    days, _, clock = text.rpartition("-")
    try:
        return int(days or 0) * 86400 + sum(float(part) * 60**i for i, part in enumerate(reversed(clock.split(":"))))
    except ValueError:
        return None


def cpu_ticks(pid):
    """Process pid's CPU time (user + system: /proc's fields 14 and 15, else ps's TIME) in clock ticks, or None."""
    if not procfs():
        s = seconds(ps(pid, "time"))
        return None if s is None else round(s * os.sysconf("SC_CLK_TCK"))
    rest = _stat(pid)
    try:
        return int(rest[11]) + int(rest[12])
    except (TypeError, IndexError, ValueError):
        return None


def rss_mb(pid):
    """Process pid's resident memory in MiB (/proc's VmRSS, else ps's RSS), or None."""
    if not procfs():
        kib = ps(pid, "rss")
        return int(kib) / 1024.0 if kib.isdigit() else None
    try:
        with open(f"{PROC}/{int(pid)}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def alive(pid, proc_start):
    """Whether the process that recorded (pid, proc_start) is still running."""
    return isinstance(pid, int) and pid > 0 and proc_start is not None and process_start(pid) == proc_start


def command_line(pid):
    """The words of process pid's command line ([] when it cannot be read); without /proc, ps's line
    split at spaces (a path with a space is then several words)."""
    if not procfs():
        return ps(pid, "args").split()
    try:
        with open(f"{PROC}/{int(pid)}/cmdline", "rb") as f:
            return [os.fsdecode(a) for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def open_paths(pid):
    """The paths of the files and folders process pid holds open ([] when they cannot be read)."""
    if not procfs():
        try:
            out = subprocess.run(["lsof", "-p", str(int(pid)), "-Fn"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [line[1:] for line in out.splitlines() if line.startswith("n/")]
    fds = f"{PROC}/{int(pid)}/fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return []
    paths = []
    for name in names:
        try:
            paths.append(os.readlink(f"{fds}/{name}"))
        except OSError:
            continue
    return paths


class ProcessUsage:
    """This process's CPU % (all threads, since the previous sample) and resident memory, for the
    metrics rows: {"cpu_pct", "rss_mb"}. RSS is /proc's current value, else (macOS) the peak."""

    def __init__(self):
        self.last = (time.process_time(), time.perf_counter())

    def sample(self):
        cpu, now = time.process_time(), time.perf_counter()
        pct = 100.0 * (cpu - self.last[0]) / max(now - self.last[1], 1e-9)
        self.last = (cpu, now)
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"cpu_pct": round(pct, 1), "rss_mb": round(rss / 2**20, 1)}
