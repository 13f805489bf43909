#!/usr/bin/env bash
# Make the checkout's virtual environment .venv with the python3 on PATH (Debian's own refuses
# `pip install` outside one, PEP 668) and install anectypes into it, editable. Arguments go to pip
# instead of `.`, e.g. `bash tools/venv.sh '.[test]' -c tools/test-constraints.txt`.
set -euo pipefail
cd "$(dirname "$0")/.."
# why an interpreter cannot serve (anectypes needs 3.10+, pyproject.toml; the ANE an arm64 process), or nothing
unfit() {
    local v
    v=$("$1" -c 'import platform, sys; print(*sys.version_info[:2], platform.machine())' 2>/dev/null) || { echo "does not run"; return; }
    set -- $v
    if [ "$1" -lt 3 ] || { [ "$1" = 3 ] && [ "$2" -lt 10 ]; }; then
        echo "is Python $1.$2 (anectypes needs 3.10 or newer)"
    elif [ "$(uname -s)" = Darwin ] && [ "$3" != arm64 ]; then
        echo "is an $3 build (the Neural Engine needs an arm64 Python)"
    fi
}
if [ -e .venv ] && why=$(unfit .venv/bin/python) && [ -n "$why" ]; then
    echo "recreating .venv: its python $why" >&2      # e.g. made by the Command Line Tools' 3.9
    rm -rf .venv
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    why=$(unfit python3)
    if [ -n "$why" ]; then
        echo "error: python3 on PATH $why: install Python 3.12 (python.org or Homebrew; on a Mac an arm64 one), put it first on PATH and rerun tools/venv.sh" >&2
        exit 1
    fi
    # Debian ships venv's ensurepip apart, in python3-venv
    if ! python3 -c 'import ensurepip' 2>/dev/null; then
        if [ "$(id -u)" != 0 ]; then
            echo "error: python3 cannot make a virtual environment without ensurepip: sudo apt-get install python3-venv" >&2
            exit 1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    python3 -m venv .venv
fi
echo "installing anectypes into .venv (pip install -e ${*:-.})" >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e "${@:-.}"
