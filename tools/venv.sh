#!/usr/bin/env bash
# Make the checkout's virtual environment .venv with the python3 on PATH (Debian's own refuses
# `pip install` outside one, PEP 668) and install anectypes into it, editable. Arguments go to pip
# instead of `.`, e.g. `bash tools/venv.sh '.[test]' -c tools/test-constraints.txt`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
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
