#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (run as root), then run it.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k mil`.
set -euo pipefail
cd "$(dirname "$0")/.."
# GNU Objective-C runtime + GNUstep Foundation: the ANE backend's message sends are tested on them
if ! ldconfig -p | grep -q libgnustep-base.so.1.28; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgnustep-base1.28
fi
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
exec python3 -m pytest "$@"
