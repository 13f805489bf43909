#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (run as root), then run it.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k mil`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: GNU Objective-C runtime + GNUstep Foundation (the ANE backend's message sends run
# on them), the system OpenBLAS (the tests of ANECTYPES_BLAS load it) and chromium (the dashboard's
# browser tests drive it with Playwright; no browser download)
if ! ldconfig -p | grep -q libgnustep-base.so.1.28 || ! ldconfig -p | grep -q libopenblas.so.0 \
        || ! command -v chromium >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgnustep-base1.28 \
        libopenblas0-pthread
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium    # with its fonts (recommends)
fi
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
# PyTorch (CPU) for the benchmark's cross-check of the simulator against PyTorch's autograd
python3 -c 'import torch' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check 'torch==2.13.0'
exec python3 -m pytest "$@"
