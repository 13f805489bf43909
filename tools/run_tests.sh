#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (run as root), then run it.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k mil`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
exec python3 -m pytest "$@"
