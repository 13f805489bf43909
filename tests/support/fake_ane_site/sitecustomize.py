"""Puts tests/support/fake_ane.py's stand-in classes into every Python process started with this folder on
PYTHONPATH and ANECTYPES_FAKE_ANE set. The doctor runs each probe in a process of its own; this is how those
processes see the fakes while the package knows nothing of them. ANECTYPES_FAKE_ANE is JSON for fake_ane.arm()
("{}": the fakes without faults)."""

import json
import os
import sys
from pathlib import Path

if "ANECTYPES_FAKE_ANE" in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # tests/, which holds `support`
    from support.fake_ane import arm
    arm(json.loads(os.environ["ANECTYPES_FAKE_ANE"]))
