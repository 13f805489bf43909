"""The dashboard's /openapi.json is byte for byte the checked-in one (tests/data/openapi.json, and
tests/data/openapi-token.json for a dashboard with --token), so that moving code around cannot change the API.

When the API changes on purpose, regenerate both files with `PYTHONPATH=. python3 tests/test_dashboard_openapi.py`
from the repository root and commit their diff with the change.
"""

import json
import tempfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from anectypes.web.app import create_app

DATA = Path(__file__).resolve().parent / "data"
TOKEN = "s3cret"
DOCUMENTS = {"openapi.json": None, "openapi-token.json": TOKEN}        # file -> the dashboard's token


def served(runs_dir, token):
    """The bytes GET /openapi.json answers."""
    client = TestClient(create_app(runs_dir, token=token), base_url="http://127.0.0.1")
    r = client.get("/openapi.json", headers={"Authorization": f"Bearer {token}"} if token else {})
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.parametrize("name, token", DOCUMENTS.items())
def test_openapi_is_the_checked_in_document(tmp_path, name, token):
    got, want = served(tmp_path, token), (DATA / name).read_text()
    assert json.loads(got) == json.loads(want)                        # the content (a readable diff)
    # and the bytes: the checked-in file in the served order and JSONResponse's compact form
    assert got == json.dumps(json.loads(want), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as runs_dir:
        for name, token in DOCUMENTS.items():
            doc = json.loads(served(runs_dir, token))
            (DATA / name).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
