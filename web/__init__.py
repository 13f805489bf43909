"""The anectypes dashboard (FastAPI + jinja2 + a vendored chart library), installed as `anectypes.web`."""
