"""The dashboard's FastAPI application: REST API, server-sent events, pages and security.

    app = create_app("runs", token=None, host="127.0.0.1", port=8000, max_running=1)

Routes (the contract): /api/health, /api/presets, /api/runs (list, start), /api/runs/{id} and its
stop, resume, metrics, events (SSE), logs, samples, generate, checkpoints, checkpoints/{name} and
system; pages / and /runs/{id}; static files under /static. /openapi.json is kept, /docs and /redoc
are off (they load a CDN).

Security for a localhost tool (see SecurityMiddleware): Host allow-list (403, against DNS
rebinding), same-origin Origin on state-changing requests (403, against CSRF), JSON-only bodies
(415) of at most 64 KiB (413), an optional bearer token (401) that a browser sets once through
`/?token=...` (HttpOnly SameSite=Strict cookie), and nosniff / frame / CSP / referrer headers.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import re
from dataclasses import fields as dataclass_fields
from http.cookies import SimpleCookie
from pathlib import Path as FsPath
from typing import Any, Literal, Optional
from urllib.parse import parse_qs

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from anectypes import __version__
from anectypes.device import BACKENDS
from anectypes.model.config import PRESETS, ModelConfig
from anectypes.runs import METRIC_KEYS, PRECISIONS, RunSpec, spec_defaults
from anectypes.runs import RunError as SpecError

from .runs import Run, RunError, RunStore

WEB_DIR = FsPath(__file__).resolve().parent
MAX_BODY = 64 * 1024
CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'self'; "
       "frame-ancestors 'none'; form-action 'self'")
SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                    (b"content-security-policy", CSP.encode()), (b"referrer-policy", b"no-referrer")]
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")


# --- request and response models ------------------------------------------------------------------

class Health(BaseModel):
    status: Literal["ok"]
    version: str


class Presets(BaseModel):
    presets: dict[str, ModelConfig]          # the model config dataclass itself: one field list
    backends: list[str]
    precisions: list[str]
    defaults: dict[str, Any] = Field(description="every run-spec field's default (null: the preset's schedule)")
    schedules: dict[str, dict[str, float]] = Field(description="each preset's steps, lr, accum and warmup")
    metric_keys: list[str] = Field(description="the metrics a run records per step")


class RunRow(BaseModel):
    id: str
    state: str
    step: Optional[int] = None
    steps: Optional[int] = None
    model_name: Optional[str] = None
    created: Optional[float] = Field(None, description="Unix seconds")
    updated: Optional[float] = Field(None, description="Unix seconds")
    last_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    pid: Optional[int] = Field(None, description="the trainer's pid while it runs")
    error: Optional[str] = Field(None, description="why a failed run failed (last log lines)")


class RunList(BaseModel):
    runs: list[RunRow]


def _blank_is_none(v):
    return None if isinstance(v, str) and not v.strip() else v


def _existing_file(v):
    if v is None:
        return v
    if "\0" in v or v.startswith("-"):
        raise ValueError("not a usable file path")
    p = FsPath(v).expanduser()
    try:
        p = p.resolve()
        ok = p.is_file()
    except (OSError, RuntimeError):
        ok = False
    if not ok:
        raise ValueError("no such file")
    return str(p)


def _start_field(f):
    """A StartRun field from a RunSpec field: its type, bounds and help; omitted means the spec's default."""
    md = f.metadata
    kind = Literal[tuple(PRESETS)] if f.name == "model" else (  # type: ignore[valid-type]
        Literal[md["choices"]] if "choices" in md else {"int": int, "float": float, "bool": bool}.get(md["kind"], str))
    bounds = {k: md[k] for k in ("ge", "gt", "le") if k in md}
    if kind is float:
        bounds["allow_inf_nan"] = False
    if md["kind"] == "path":
        bounds["max_length"] = 4096
    return Optional[kind], Field(None, description=md["help"], **bounds)


# a new run: the run spec's fields (not init_from), each optional: omitted or blank takes the spec's default
StartRun = create_model(
    "StartRun", __config__=ConfigDict(extra="forbid"), __doc__="A new training run; omitted fields take the "
    "run spec's defaults (GET /api/presets), the schedule the preset's.",
    __validators__={"blank_is_default": field_validator("*", mode="before")(_blank_is_none),
                    "existing_file": field_validator("data", "tokenizer")(_existing_file)},
    **{f.name: _start_field(f) for f in dataclass_fields(RunSpec) if f.name != "init_from"})


class RunId(BaseModel):
    id: str


class Summary(BaseModel):
    last_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    steps_done: int = 0
    tokens_per_s: Optional[float] = None
    ms_step: Optional[float] = None


class RunDetail(BaseModel):
    id: str
    state: str
    status: dict[str, Any]
    config: dict[str, Any]
    summary: Summary


class StateOut(BaseModel):
    state: str


# columnar metrics (null where absent), down-sampled by stride, the last point always kept
Metrics = create_model("Metrics", __doc__="Columnar metrics (null where absent; val_loss only at validation "
                       "steps), down-sampled by stride, the last point always kept.", step=(list[int], ...),
                       **{k: (list[Optional[float]], ...) for k in METRIC_KEYS})


class Lines(BaseModel):
    lines: list[str]


class Sample(BaseModel):
    step: int
    text: str


class Samples(BaseModel):
    samples: list[Sample]


class GenerateIn(BaseModel):
    prompt: str = Field("", max_length=1000)
    temperature: float = Field(0.8, ge=0, le=2, allow_inf_nan=False)
    top_k: int = Field(50, ge=0, le=1000, description="0: no top-k cut")
    max_tokens: int = Field(64, ge=1, le=256)
    seed: Optional[int] = Field(None, ge=0, le=2**32 - 1, description="default: random")


class GenerateOut(BaseModel):
    text: str
    step: int


class CheckpointInfo(BaseModel):
    name: str
    bytes: int
    sha256: str
    modified: float = Field(description="Unix seconds")


class Checkpoints(BaseModel):
    checkpoints: list[CheckpointInfo]


class System(BaseModel):
    pid: Optional[int] = None
    alive: bool
    cpu_percent: Optional[float] = None
    rss_mb: Optional[float] = None


# --- dependencies ----------------------------------------------------------------------------------

def get_store(request: Request) -> RunStore:
    return request.app.state.store


def get_run(run_id: str = Path(description="run id"), store: RunStore = Depends(get_store)) -> Run:
    try:
        return store.run(run_id)
    except RunError as e:
        raise HTTPException(e.status, e.detail) from None


_bearer = HTTPBearer(auto_error=False, description="the dashboard token (--token), when one is set")


async def require_auth(request: Request, _: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)):
    """The middleware checks the token; this repeats it for the routes and documents it in OpenAPI."""
    if request.app.state.token and not request.scope.get("anectypes.authorized"):
        raise HTTPException(401, "missing or wrong token", headers={"WWW-Authenticate": "Bearer"})


ERRORS = {400: "a body that is not UTF-8 JSON, or a malformed Content-Length",
          401: "missing or wrong token", 403: "a foreign Host header, or a cross-site Origin on a POST",
          404: "no such run", 413: f"a body over {MAX_BODY} bytes", 415: "a body that is not application/json",
          429: "too many generation requests waiting"}
POSTED = (400, 413, 415)                            # what SecurityMiddleware answers to any POST


ERROR_BODY = {"application/json": {"schema": {"title": "Error", "type": "object", "required": ["detail"],
                                               "properties": {"detail": {"type": "string"}}}}}


def errors(*codes):
    """OpenAPI responses for error statuses, JSON {"detail": ...} bodies (also on routes of other media
    types, so no `model`): a code, or (code, description)."""
    pairs = [c if isinstance(c, tuple) else (c, ERRORS[c]) for c in codes]
    return {code: {"description": text, "content": ERROR_BODY} for code, text in pairs}


def guarded(token):
    """Router options for what every route may answer: 403 (Host) and, with a token, 401, which is then
    also declared as HTTP bearer security. Without a token OpenAPI declares no security."""
    if not token:
        return {"responses": errors(403)}
    return {"responses": errors(401, 403), "dependencies": [Depends(require_auth)]}


def call(fn, *args):
    """Run a store operation, turning RunError into an HTTP error."""
    try:
        return fn(*args)
    except RunError as e:
        raise HTTPException(e.status, e.detail) from None


# --- routers ------------------------------------------------------------------------------------------

meta = APIRouter(tags=["meta"])


@meta.get("/health", response_model=Health, summary="Liveness and version")
async def health():
    return {"status": "ok", "version": __version__}


@meta.get("/presets", response_model=Presets, summary="Model presets, backends and precisions")
async def presets():
    return {"presets": dict(PRESETS), "backends": list(BACKENDS), "precisions": list(PRECISIONS),
            "defaults": spec_defaults(), "schedules": {p: RunSpec(model=p).resolved().schedule() for p in PRESETS},
            "metric_keys": list(METRIC_KEYS)}


runs = APIRouter(prefix="/runs", tags=["runs"])


@runs.get("", response_model=RunList, summary="All runs, newest first")
async def list_runs(store: RunStore = Depends(get_store)):
    return {"runs": await anyio.to_thread.run_sync(store.list_runs)}


@runs.post("", response_model=RunId, status_code=201, summary="Start a run (409 while one is running)",
           responses=errors((409, "a run is already running"), *POSTED))
async def start_run(body: StartRun, store: RunStore = Depends(get_store)):
    try:
        spec = RunSpec(**body.model_dump(exclude_none=True))
    except SpecError as e:
        raise HTTPException(422, [{"loc": ["body"], "msg": str(e), "type": "value_error"}]) from None
    return {"id": call(store.start, spec)}


@runs.get("/{run_id}", response_model=RunDetail, summary="A run's status, config and summary",
          responses=errors(404))
async def run_detail(run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    return await anyio.to_thread.run_sync(store.detail, run)


@runs.post("/{run_id}/stop", response_model=StateOut, status_code=202,
           summary="SIGTERM the run (checkpoint and exit); SIGKILL after a grace period",
           responses=errors(404, (409, "the run is not running"), *POSTED))
async def stop_run(run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    try:
        await store.stop(run)
    except RunError as e:
        raise HTTPException(e.status, e.detail) from None
    return {"state": "stopping"}


@runs.post("/{run_id}/resume", response_model=RunId, status_code=202,
           summary="Continue from checkpoints/latest.ckpt in a new process",
           responses=errors(404, (409, "running already, or no checkpoint"), *POSTED))
async def resume_run(run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    return {"id": call(store.resume, run)}


@runs.get("/{run_id}/metrics", response_model=Metrics, summary="Per-micro-step metrics, columnar",
          responses=errors(404))
async def run_metrics(run: Run = Depends(get_run), store: RunStore = Depends(get_store),
                      since_step: int = Query(-1, description="only steps after this one"),
                      max_points: int = Query(2000, ge=1, le=1_000_000)):
    return await anyio.to_thread.run_sync(store.metrics, run, since_step, max_points)


@runs.get("/{run_id}/events", response_class=EventSourceResponse,
          summary="Server-sent events: metrics, log, sample, status, done", responses=errors(404))
async def run_events(request: Request, run: Run = Depends(get_run), store: RunStore = Depends(get_store),
                     last_event_id: Optional[str] = Header(None, alias="Last-Event-ID"),
                     since_step: Optional[int] = Query(None, description="replay metrics after this step "
                                                       "(Last-Event-ID wins)")):
    cursor = since_step
    if last_event_id is not None:
        try:
            cursor = int(last_event_id.strip())
        except ValueError:
            pass
    async for event in store.events(run, cursor, request.is_disconnected):
        yield event


@runs.get("/{run_id}/logs", response_model=Lines, summary="The tail of the trainer's stdout.log",
          responses=errors(404))
async def run_logs(run: Run = Depends(get_run), store: RunStore = Depends(get_store),
                   tail: int = Query(200, ge=0, le=100_000)):
    return {"lines": await anyio.to_thread.run_sync(store.logs, run, tail)}


@runs.get("/{run_id}/samples", response_model=Samples, summary="Samples written during training",
          responses=errors(404))
async def run_samples(run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    return {"samples": await anyio.to_thread.run_sync(store.samples, run)}


@runs.post("/{run_id}/generate", response_model=GenerateOut,
           summary="Sample from the latest checkpoint (simulator, fp32)",
           responses=errors(404, (409, "no checkpoint yet, or the prompt does not fit the model"), 429,
                            *POSTED))
async def run_generate(body: Optional[GenerateIn] = None, run: Run = Depends(get_run),
                       store: RunStore = Depends(get_store)):
    body = body or GenerateIn()
    try:
        return await store.generate(run, body.prompt, body.temperature, body.top_k, body.max_tokens, body.seed)
    except RunError as e:
        raise HTTPException(e.status, e.detail) from None


@runs.get("/{run_id}/checkpoints", response_model=Checkpoints, summary="Checkpoint files with sha256",
          responses=errors(404))
async def run_checkpoints(run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    return {"checkpoints": await anyio.to_thread.run_sync(store.checkpoints, run)}


@runs.get("/{run_id}/checkpoints/{name}", response_class=FileResponse,
          summary="Download a checkpoint (Range requests give 206)",
          responses={200: {"content": {"application/octet-stream": {}}},
                     206: {"description": "the requested byte range(s)",
                           "content": {"application/octet-stream": {}, "multipart/byteranges": {}}},
                     400: {"description": "a malformed Range header", "content": {"text/plain": {}}},
                     416: {"description": "a Range beyond the end of the file", "content": {"text/plain": {}}},
                     **errors((404, "no such run or checkpoint"))})
async def run_checkpoint_file(name: str, run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    path = call(store.checkpoint_path, run, name)
    return FileResponse(path, media_type="application/octet-stream", filename=name)


@runs.get("/{run_id}/system", response_model=System, summary="The trainer process's CPU % and RSS",
          responses=errors(404))
async def run_system(run: Run = Depends(get_run), store: RunStore = Depends(get_store)):
    return await store.system(run)


pages = APIRouter(include_in_schema=False)


def render(request, name, **context):
    try:
        return request.app.state.templates.TemplateResponse(request, name, {"version": __version__, **context})
    except Exception as e:                          # jinja2.TemplateNotFound while the pages are written
        if type(e).__name__ != "TemplateNotFound":
            raise
        return HTMLResponse(f"<!doctype html><title>anectypes</title><p>template {name} is missing</p>", 500)


@pages.get("/", response_class=HTMLResponse)
async def index_page(request: Request):
    return render(request, "index.html")


@pages.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, run: Run = Depends(get_run)):
    return render(request, "run.html", run_id=run.id)


# --- security ---------------------------------------------------------------------------------------------

def is_loopback(host):
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_only(value):
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '[::1]', lower-case."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[:end + 1] if end > 0 else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class SecurityMiddleware:
    """Host (403), token (401), Origin (403), JSON-only (415) and size (413) checks; security headers."""

    def __init__(self, app, *, host, token, cookie_name, max_body=MAX_BODY):
        self.app, self.token, self.cookie_name, self.max_body = app, token, cookie_name, max_body
        bound = host.strip().lower()
        if ":" in bound and not bound.startswith("["):
            bound = f"[{bound}]"
        self.any_host = bound in ("0.0.0.0", "[::]", "")           # wildcard bind: the token guards it
        self.allowed_hosts = {"127.0.0.1", "localhost", "[::1]", bound}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        extra_headers = list(SECURITY_HEADERS)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + extra_headers)
            await send(message)

        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        method = scope["method"].upper()

        async def refuse(status, detail, **hdrs):
            await JSONResponse({"detail": detail}, status, headers=hdrs)(scope, receive, send_with_headers)

        host_header = headers.get("host", "")
        if not host_header or not (self.any_host or _host_only(host_header) in self.allowed_hosts):
            return await refuse(403, "host not allowed")
        if self.token:
            ok, from_query = self._authorized(headers, scope, method)
            if not ok:
                return await refuse(401, "missing or wrong token", **{"WWW-Authenticate": "Bearer"})
            scope = dict(scope)
            scope["anectypes.authorized"] = True
            if from_query:
                extra_headers.append((b"set-cookie", f"{self.cookie_name}={self.token}; HttpOnly; "
                                                     "SameSite=Strict; Path=/".encode()))
        if method in SAFE_METHODS:
            return await self.app(scope, receive, send_with_headers)
        origin = headers.get("origin")
        if origin is not None:
            own = host_header.strip().lower()
            if origin.strip().lower() not in (f"http://{own}", f"https://{own}"):
                return await refuse(403, "cross-origin request refused")
        ctype = headers.get("content-type")
        if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
            return await refuse(415, "request bodies must be application/json")
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return await refuse(400, "bad content-length")
        if length > self.max_body:
            return await refuse(413, f"request body over {self.max_body} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return                                              # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await refuse(413, f"request body over {self.max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and ctype is None:
            return await refuse(415, "request bodies must be application/json")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send_with_headers)

    def _authorized(self, headers, scope, method):
        """(authorized, through ?token=): Bearer header, the cookie, or ?token= on a GET."""
        want = self.token.encode()
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), want):
            return True, False
        cookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(headers.get("cookie", ""))
        if self.cookie_name in cookie and hmac.compare_digest(cookie[self.cookie_name].value.encode(), want):
            return True, False
        if method in ("GET", "HEAD"):
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
            if given and hmac.compare_digest(given[-1].encode(), want):
                return True, True
        return False, False


# --- the app ------------------------------------------------------------------------------------------------

def create_app(runs_dir, token=None, host="127.0.0.1", port=8000, max_running=1) -> FastAPI:
    """The dashboard for the runs under runs_dir; `token` (if set) is required on every request."""
    if token is not None and (not token or not TOKEN_RE.match(token)):
        raise ValueError("the token may only use letters, digits and ._~+/=-")
    store = RunStore(runs_dir, max_running=max_running)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.reaper)
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

    @app.exception_handler(RunError)
    async def run_error(request, exc):
        return JSONResponse({"detail": exc.detail}, exc.status)

    api = APIRouter(prefix="/api", **guarded(token))
    api.include_router(meta)
    api.include_router(runs)
    app.include_router(api)
    app.include_router(pages, **guarded(token))
    app.mount("/static", StaticFiles(directory=str(WEB_DIR / "static"), check_dir=False), name="static")
    app.add_middleware(SecurityMiddleware, host=host, token=token, cookie_name=f"anectypes_token_{int(port)}")
    return app
