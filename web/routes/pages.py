"""The two HTML pages: the run list (/) and one run (/runs/{run_id}); not in the OpenAPI document."""

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from anectypes import __version__

from ..deps import RunDep

router = APIRouter(include_in_schema=False)


def render(request, name, **context):
    try:
        return request.app.state.templates.TemplateResponse(request, name, {"version": __version__, **context})
    except Exception as e:                          # jinja2.TemplateNotFound while the pages are written
        if type(e).__name__ != "TemplateNotFound":
            raise
        return HTMLResponse(f"<!doctype html><title>anectypes</title><p>template {name} is missing</p>", 500)


@router.get("/", response_class=HTMLResponse)
async def index_page(request: Request):
    return render(request, "index.html")


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, run: RunDep):
    return render(request, "run.html", run_id=run.id)
