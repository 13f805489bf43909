"""The FastAPI dependencies the routes declare: the run store, a run looked up by its id, the token check
(`guarded`: what every route may answer), and the run specs a start or a sweep request asks for."""

from __future__ import annotations

import itertools
from typing import Annotated, Optional

from fastapi import Depends, HTTPException, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from anectypes.runs import RunError, RunSpec

from .api_errors import Invalid, NotFound
from .files import Run
from .schemas import StartRun, SweepIn, errors
from .store import RunStore


def get_store(request: Request) -> RunStore:
    return request.app.state.store


StoreDep = Annotated[RunStore, Depends(get_store)]


def get_run(run_id: Annotated[str, Path(description="run id")], store: StoreDep) -> Run:
    return store.files.run(run_id)


RunDep = Annotated[Run, Depends(get_run)]


# --- the token ------------------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="the dashboard token (--token), when one is set")


async def require_auth(request: Request, _: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)]):
    """SecurityMiddleware checks the token; this repeats it for the routes and documents it in OpenAPI."""
    if request.app.state.token and not request.scope.get("anectypes.authorized"):
        raise HTTPException(401, "missing or wrong token", headers={"WWW-Authenticate": "Bearer"})


def guarded(token):
    """Router options for what every route may answer: 403 (Host) and, with a token, 401, which is then
    also declared as HTTP bearer security. Without a token OpenAPI declares no security."""
    if not token:
        return {"responses": errors(403)}
    return {"responses": errors(401, 403), "dependencies": [Depends(require_auth)]}


# --- run specs ------------------------------------------------------------------------------------

def spec_of(fields, store) -> RunSpec:
    """A run spec from request fields, as the dashboard starts it (Supervisor.admit); what only the
    spec itself refuses is a 422 like the model's."""
    try:
        spec = RunSpec(**fields)
    except RunError as e:
        raise Invalid(str(e)) from None
    return store.processes.admit(spec)


def spec_fields(body, store):
    """The run-spec fields of a start request: init_from_run becomes init_from, the run's checkpoint
    (best, else latest; confined to the run), and the model the run's; init_from_folder becomes init_from,
    a Hugging Face folder inside the data folder."""
    fields = body.model_dump(exclude_none=True, exclude={"grid"})
    source, folder = fields.pop("init_from_run", None), fields.pop("init_from_folder", None)
    if source is not None and folder is not None:
        raise Invalid("give a run or a folder to fine-tune from, not both", "init_from_folder")
    if folder is not None:                       # the model is the folder's (the form's preset is not asked)
        fields.pop("model", None)
        fields["init_from"] = str(store.processes.model_folder(folder))
    if source is not None:
        try:
            with store.files.locked(source) as run:
                try:
                    checkpoint = run.checkpoint()
                except NotFound:
                    raise Invalid("the run has no checkpoint yet", "init_from_run") from None
        except NotFound:
            raise Invalid("no such run", "init_from_run") from None
        fields.update(init_from=str(checkpoint),
                      model=(run.config().get("spec") or {}).get("model", fields.get("model")))
    return fields


def start_spec(body: StartRun, store: StoreDep) -> RunSpec:
    return spec_of(spec_fields(body, store), store)


MAX_SWEEP = 64


def sweep_specs(body: SweepIn, store: StoreDep):
    """The specs of a sweep's grid (every combination) and their labels ("lr=0.001 seed=2")."""
    base = spec_fields(body, store)
    combos = [dict(zip(body.grid, values)) for values in itertools.product(*body.grid.values())]
    if len(combos) > MAX_SWEEP:
        raise Invalid(f"a sweep has at most {MAX_SWEEP} runs, not {len(combos)}", "grid")
    return [spec_of({**base, **c}, store) for c in combos], [" ".join(f"{k}={v}" for k, v in c.items()) for c in combos]
