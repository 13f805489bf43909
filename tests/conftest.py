"""Fixtures shared by several test modules."""

import os
import tempfile

import pytest
from support import real_model

from anectypes.data.corpus import builtin_dataset

# GNUstep's NSTemporaryDirectory() (where the ANE backend's compile folders go) is TEMP's GNUstepSecure<uid>: one
# private to this session and its subprocesses, so what a test counts there is its own, whatever else runs here
_TEMP = tempfile.TemporaryDirectory(prefix="anectypes-tests-")
os.environ["TEMP"] = _TEMP.name


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


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF (Q8_0/Q4_1) of tests/support/real_model.py: its path."""
    return real_model.gguf_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory):
    """The real model as a float32 Hugging Face folder (safetensors, config.json, tokenizer.json), exported once
    per session from smollm2_gguf by `python -m anectypes.export --format hf`: read it, do not change it."""
    return real_model.export_hf(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "hf")


GNUSTEP = "apt-get install -y --no-install-recommends libgnustep-base1.28"


@pytest.fixture(scope="session")
def objc_runtime():
    """The Objective-C runtime with Foundation (GNUstep's on Linux): missing, it FAILS in CI and skips elsewhere."""
    from anectypes.device.ane import objc
    if not objc.available():
        if os.environ.get("CI"):
            pytest.fail(f"Objective-C runtime/GNUstep Foundation not loadable; CI must run `{GNUSTEP}`", pytrace=False)
        pytest.skip(f"GNUstep Foundation not installed (`{GNUSTEP}`); skipped only outside CI, "
                    "where CI=1 makes it fail")
    return objc.runtime()


@pytest.fixture
def fake_ane(objc_runtime):
    """tests/support/fake_ane.py's private ANE classes and host-memory IOSurfaces for one test (FAKE, reset): whatever
    ran before, and nothing of them is used by the tests after it."""
    if objc_runtime.kind != "gnu":
        pytest.skip("the fake private classes are for the GNU runtime (Linux); macOS has the real framework")
    from support.fake_ane import installed
    with installed() as fake:
        yield fake


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) every test must run: a skip is a failure there."""
    report = (yield).get_result()
    if os.environ.get("CI") == "true" and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome, report.longrepr = "failed", f"skipped in CI, where every test must run: {reason}"
