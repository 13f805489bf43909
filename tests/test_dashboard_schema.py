"""The dashboard's OpenAPI document is true: schemathesis (property-based, from /openapi.json) against the real
`python -m anectypes.dashboard` on a free 127.0.0.1 port.

Every operation gets generated requests, valid and invalid; every response must be documented (status
code, content type, headers, body schema), none may be a server error, invalid requests must be refused,
and no declared authentication may be ignored. The runs folder holds one short finished run (a real
trainer, four steps) and half the generated path parameters name it and its checkpoint, so the run
routes answer with data, not only 404 (a DELETE that removed it puts it back). The dashboard runs with
`--max-running 0`: a start or a sweep it accepts is queued and a resume answers 409, so it launches
nothing and no trainer outlives the test (checked at the end).

Budget: MAX_EXAMPLES generated cases per operation plus schemathesis' examples and coverage cases
(about 750 requests, 15-30 s here); every request times out after 10 s.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis.checks import (content_type_conformance, ignored_auth, negative_data_rejection,
                                 not_a_server_error, response_headers_conformance, response_schema_conformance,
                                 status_code_conformance)

from support.dashboard_server import ROOT, Dashboard

pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth]
MAX_EXAMPLES = 25
RUN_ID = "20260101-000000-tiny-test"
KNOWN = {"run_id": RUN_ID, "name": "latest.ckpt"}          # path parameters that exist
counts = {}                                                 # operation -> status -> cases


def cheap_dashboard(runs_dir, log_name, **kw):
    """The dashboard with --max-running 0: it never launches a trainer."""
    return Dashboard(runs_dir, runs_dir.parent / log_name, args=["--max-running", "0"], **kw).start()


def trainers(runs_dir):
    """The pids of `anectypes.train` processes working under runs_dir."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"anectypes.train" in argv and any(str(runs_dir).encode() in a for a in argv):
            out.append(int(proc.name))
    return out


@pytest.fixture(scope="module")
def runs_dir(builtin_cache, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(runs / RUN_ID),
                    "--steps", "4", "--accum", "2", "--save-every", "1", "--sample-every", "2", "--backend", "sim",
                    "--precision", "fp32"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    shutil.copytree(runs / RUN_ID, runs.parent / "pristine")                # DELETE removes it: put it back
    yield runs
    assert not trainers(runs), "a trainer outlived the test"


@pytest.fixture(scope="module")
def dash(runs_dir):
    d = cheap_dashboard(runs_dir, "dashboard.log")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def api_schema(dash):
    schema = schemathesis.openapi.from_url(dash.base + "/openapi.json")
    schema.config.update(base_url=dash.base)

    @schema.hook
    def before_generate_path_parameters(context, strategy):
        return st.one_of(strategy, strategy.map(lambda p: p and {k: KNOWN.get(k, v) for k, v in p.items()}))

    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_openapi_conformance(case, runs_dir):
    response = case.call(timeout=10)
    if case.method == "DELETE" and response.status_code == 204:     # the known run again, for the next cases
        shutil.copytree(runs_dir.parent / "pristine", runs_dir / RUN_ID, dirs_exist_ok=True)
    by_status = counts.setdefault(case.operation.label, {})
    by_status[response.status_code] = by_status.get(response.status_code, 0) + 1
    case.validate_response(response, checks=CHECKS)


def test_cases_ran():
    print(f"\nschemathesis: {sum(sum(c.values()) for c in counts.values())} cases")
    for label, by_status in counts.items():
        print(f"  {label}: {dict(sorted(by_status.items()))}")
    assert len(counts) >= 15 and all({200, 201, 204, 409} & set(c) for c in counts.values()), counts


def operations(doc):
    return [op for path in doc["paths"].values() for op in path.values()]


def test_security_declared_only_with_a_token(dash, runs_dir):
    doc = httpx.get(dash.base + "/openapi.json").json()
    assert "securitySchemes" not in doc.get("components", {})
    assert not [op["operationId"] for op in operations(doc) if "security" in op or "401" in op["responses"]]

    with_token = cheap_dashboard(runs_dir, "dashboard-token.log", token="s3cret")
    try:
        doc = with_token.client().get("/openapi.json").json()
    finally:
        with_token.stop()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for op in operations(doc):
        assert op["security"] == [{"HTTPBearer": []}] and "401" in op["responses"], op["operationId"]
