"""tools/venv.sh against stand-in interpreters on PATH: a python3 (and a .venv) that answer its version question
as Python 3.9 would, or as an x86_64 build on a Mac (a stand-in uname), and a good one that logs what it is asked."""

import shutil
import subprocess
from pathlib import Path

import pytest

VENV_SH = Path(__file__).parents[1] / "tools" / "venv.sh"
# a python3: answers -c (the version question, or ensurepip's import) with VERSION; `-m venv DIR` makes DIR a .venv
# whose python is a good stand-in; anything else (pip) is logged and succeeds
STAND_IN = """#!/bin/sh
echo "$0 $*" >> "{log}"
case "$1" in
    -c) echo "{version}" ;;
    -m) [ "$2" = venv ] && mkdir -p "$3/bin" && cp "{good}" "$3/bin/python" ;;
esac
exit 0
"""


def stand_in(path, version, log, good=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STAND_IN.format(version=version, log=log, good=good))
    path.chmod(0o755)
    return path


@pytest.fixture
def checkout(tmp_path):
    """A checkout holding tools/venv.sh, a bin/ for PATH with the good stand-in at good/python3, and the log."""
    (tmp_path / "co" / "tools").mkdir(parents=True)
    shutil.copy(VENV_SH, tmp_path / "co" / "tools")
    log = tmp_path / "log"
    stand_in(tmp_path / "good" / "python3", "3 12 arm64", log)
    return tmp_path


def run(tmp, python3_version, system="Linux"):
    stand_in(tmp / "bin" / "python3", python3_version, tmp / "log", good=tmp / "good" / "python3")
    (tmp / "bin" / "uname").write_text(f"#!/bin/sh\necho {system}\n")
    (tmp / "bin" / "uname").chmod(0o755)
    path = f"{tmp / 'bin'}:/usr/bin:/bin"
    return subprocess.run(["bash", str(tmp / "co" / "tools" / "venv.sh")], capture_output=True, text=True,
                          env={"PATH": path}, timeout=60)


@pytest.mark.parametrize("version, system, why", [
    ("3 9 arm64", "Linux", "python3 on PATH is Python 3.9 (anectypes needs 3.10 or newer)"),
    ("3 9 arm64", "Darwin", "python3 on PATH is Python 3.9 (anectypes needs 3.10 or newer)"),
    ("3 12 x86_64", "Darwin", "python3 on PATH is an x86_64 build (the Neural Engine needs an arm64 Python)")])
def test_an_unfit_python3_is_refused_naming_the_fix(checkout, version, system, why):
    r = run(checkout, version, system)
    assert r.returncode == 1 and r.stderr.startswith(f"error: {why}: install Python 3.12") and \
        r.stderr.count("\n") == 1, r.stderr
    assert not (checkout / "co" / ".venv").exists()


def test_a_venv_of_python_3_9_is_recreated_with_the_python3_on_path(checkout):
    venv_python = stand_in(checkout / "co" / ".venv" / "bin" / "python", "3 9 arm64", checkout / "log")
    r = run(checkout, "3 12 arm64")
    assert r.returncode == 0, r.stderr
    assert "recreating .venv: its python is Python 3.9" in r.stderr
    log = (checkout / "log").read_text()
    assert f"{checkout / 'bin' / 'python3'} -m venv .venv" in log and "3 12 arm64" in venv_python.read_text()
    assert log.splitlines()[-1] == ".venv/bin/python -m pip install --quiet --disable-pip-version-check -e ."


def test_a_fit_venv_is_kept(checkout):
    good = stand_in(checkout / "co" / ".venv" / "bin" / "python", "3 11 arm64", checkout / "log")
    r = run(checkout, "3 9 arm64", "Darwin")          # python3 on PATH is not asked to make one
    assert r.returncode == 0 and "recreating" not in r.stderr, r.stderr
    assert "-m venv" not in (checkout / "log").read_text() and good.exists()
