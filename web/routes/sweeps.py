"""/api/sweeps: a grid of runs started (or queued) at once."""

from typing import Annotated

import anyio
from fastapi import APIRouter, Depends

from ..deps import StoreDep, sweep_specs
from ..schemas import POSTED, SweepOut, errors

router = APIRouter(prefix="/sweeps", tags=["runs"])


@router.post("", response_model=SweepOut, status_code=201,
             summary="Start (or queue) a grid of runs: every combination of the values given for lr, seed, accum "
                     "and warmup", responses=errors((409, "no fresh run folder could be made"), *POSTED))
async def start_sweep(store: StoreDep, sweep: Annotated[tuple, Depends(sweep_specs)]):
    return await anyio.to_thread.run_sync(store.sweep, *sweep)
