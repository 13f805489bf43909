"""/api/health and /api/presets: what the dashboard is and what a run may be."""

from fastapi import APIRouter

from anectypes import __version__
from anectypes.device import BACKENDS
from anectypes.model.config import PRESETS
from anectypes.runs import METRIC_KEYS, PRECISIONS, RunSpec, spec_defaults

from ..deps import StoreDep
from ..schemas import Health, Presets

router = APIRouter(tags=["meta"])


@router.get("/health", response_model=Health, summary="Liveness and version")
async def health():
    return {"status": "ok", "version": __version__}


@router.get("/presets", response_model=Presets,
            summary="Model presets, backends, precisions, defaults and the folder data files come from")
async def presets(store: StoreDep):
    return {"presets": dict(PRESETS), "backends": list(BACKENDS), "precisions": list(PRECISIONS),
            "defaults": spec_defaults(), "schedules": {p: RunSpec(model=p).resolved().schedule() for p in PRESETS},
            "metric_keys": list(METRIC_KEYS), "data_dir": str(store.processes.data_dir)}
