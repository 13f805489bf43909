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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) every test must run: a skip is a failure there."""
    report = (yield).get_result()
    if os.environ.get("CI") == "true" and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome, report.longrepr = "failed", f"skipped in CI, where every test must run: {reason}"
