"""This machine's memory: what every "cannot fit" check (models, MIL tensors, benchmarks) compares with."""

import os


def physical_memory():
    """This machine's memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
