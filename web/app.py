"""The dashboard's FastAPI application.

    app = create_app("runs", token=None, host="127.0.0.1", port=8000, max_running=1, data_dir="data")

routes/ has the routes (the contract), one module per resource, deps.py the dependencies they declare,
schemas.py their models, security.py the checks every request passes, store.py the RunStore they work on;
an ApiError (api_errors.py) becomes its HTTP status here, in one exception handler. /openapi.json is kept,
/docs and /redoc are off (they load a CDN).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
from fastapi import APIRouter, FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from anectypes import __version__

from .api_errors import ApiError
from .deps import guarded
from .files import json_safe
from .routes import meta, pages, runs, sweeps
from .security import TOKEN_RE, SecurityMiddleware
from .store import RunStore

WEB_DIR = Path(__file__).resolve().parent


def create_app(runs_dir, token=None, host="127.0.0.1", port=8000, max_running=1, data_dir="data") -> FastAPI:
    """The dashboard for the runs under runs_dir, whose data files come from data_dir; `token` (if set)
    is required on every request."""
    if token is not None and (not token or not TOKEN_RE.match(token)):
        raise ValueError("the token may only use letters, digits and ._~+/=-")
    store = RunStore(runs_dir, data_dir, max_running=max_running)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.processes.reaper)
            try:
                yield
            finally:
                await store.shutdown()
                tg.cancel_scope.cancel()

    app = FastAPI(title="anectypes dashboard", version=__version__, docs_url=None, redoc_url=None,
                  lifespan=lifespan,
                  description="Start, watch, stop and resume anectypes training runs; download checkpoints.")
    app.state.store, app.state.token = store, token
    app.state.templates = Jinja2Templates(directory=str(WEB_DIR / "templates"))

    @app.exception_handler(ApiError)
    async def api_error(request, exc):
        return JSONResponse({"detail": exc.detail}, exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc):
        # FastAPI's own answer, with the refused values made JSON (a NaN, 1e999 or a lone surrogate is not)
        return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))}, 422)

    api = APIRouter(prefix="/api", **guarded(token))
    api.include_router(meta.router)
    api.include_router(runs.router)
    api.include_router(sweeps.router)
    app.include_router(api)
    app.include_router(pages.router, **guarded(token))
    app.mount("/static", StaticFiles(directory=str(WEB_DIR / "static"), check_dir=False), name="static")
    app.add_middleware(SecurityMiddleware, host=host, token=token, cookie_name=f"anectypes_token_{int(port)}")
    return app
