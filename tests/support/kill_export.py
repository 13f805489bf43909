"""python -m anectypes.export, SIGKILLed by itself once its temporary file or folder is written, before
it is renamed to --out (a test helper): it leaves what a killed export leaves.

    python tests/support/kill_export.py EXPORT_ARGS...
"""

import os
import signal
import sys

from anectypes.formats import export
from anectypes.export import main


def dying(write):
    def killed_after(model, tmp, dtype):
        write(model, tmp, dtype)
        os.kill(os.getpid(), signal.SIGKILL)
    return killed_after


export.WRITERS = {fmt: dying(write) for fmt, write in export.WRITERS.items()}
sys.exit(main(sys.argv[1:]))
