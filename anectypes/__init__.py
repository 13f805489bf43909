"""anectypes: train transformer language models on the Apple Neural Engine from pure Python.

Every ANE kernel is MIL text (`anectypes.mil`); a device (`anectypes.device`) runs it, either the
real engine through ctypes or the numpy simulator that executes exactly the same text.
"""

__version__ = "0.1.0"
