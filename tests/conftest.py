"""Fixtures shared by several test modules."""

import os

import pytest

from anectypes.corpus import builtin_dataset


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory):
    """A private built-in corpus cache for one module: XDG_CACHE_HOME points at it while the module runs,
    so this process and every subprocess it starts (the dashboard, its trainers, the CLIs) share it."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    builtin_dataset()
    yield cache
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old
