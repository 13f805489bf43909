"""anectypes: train transformer language models on the Apple Neural Engine from pure Python.

Every ANE kernel is MIL text (`anectypes.mil`); a device (`anectypes.device`) runs it, either the
real engine through ctypes or the numpy simulator that executes exactly the same text.
"""

import sys

if sys.version_info < (3, 10):    # e.g. the Command Line Tools' python3 on a Mac: say so before any 3.10 syntax
    sys.exit(f"error: anectypes needs Python 3.10 or newer, this is {sys.version.split()[0]} "
             "(on a Mac: see the README's \"On a Mac\")")

__version__ = "0.1.0"
