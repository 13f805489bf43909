"""/api/runs: the run list, starting a run, and everything under a run (its detail, meta, stop and resume,
metrics, events, logs, samples, generation, checkpoints, export, its trainer's CPU and memory)."""

from __future__ import annotations

import shutil
from typing import Annotated, Optional

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.sse import EventSourceResponse
from starlette.background import BackgroundTask

from anectypes.runs import RunSpec

from ..deps import RunDep, StoreDep, start_spec
from ..events import event_stream
from ..exports import export_run
from ..schemas import (POSTED, Checkpoints, ExportIn, GenerateIn, GenerateOut, Lines, Metrics, RunDetail, RunId,
                       RunList, RunMeta, RunMetaIn, Samples, StateOut, System, errors)

router = APIRouter(prefix="/runs", tags=["runs"])


@router.get("", response_model=RunList, summary="All runs, newest first (not the archived ones unless asked)")
async def list_runs(store: StoreDep,
                    archived: Annotated[bool, Query(description="also the archived runs")] = False):
    return {"runs": await anyio.to_thread.run_sync(store.list_runs, archived)}


@router.post("", response_model=RunId, status_code=201,
             summary="Start a run, or queue it while --max-running runs are running (it starts when a slot frees)",
             responses=errors((409, "no fresh run folder could be made"), *POSTED))
async def start_run(spec: Annotated[RunSpec, Depends(start_spec)], store: StoreDep):
    return {"id": store.processes.start(spec)}


@router.get("/{run_id}", response_model=RunDetail, summary="A run's status, config and summary",
            responses=errors(404))
async def run_detail(run: RunDep, store: StoreDep):
    return await anyio.to_thread.run_sync(store.detail, run)


@router.patch("/{run_id}", response_model=RunMeta, summary="Name, tag, note or archive a run (meta.json in its folder)",
              responses=errors(404, *POSTED))
async def patch_run(run: RunDep, store: StoreDep, body: RunMetaIn):
    return await anyio.to_thread.run_sync(store.set_meta, run, body.model_dump(exclude_none=True))


@router.delete("/{run_id}", status_code=204, response_class=Response, summary="Delete a run's folder",
               responses={204: {"description": "deleted"}, **errors(404, (409, "the run is running"), *POSTED)})
async def delete_run(run: RunDep, store: StoreDep):
    await anyio.to_thread.run_sync(store.delete, run)
    return Response(status_code=204)


@router.post("/{run_id}/stop", response_model=StateOut, status_code=202,
             summary="SIGTERM the run (checkpoint and exit); SIGKILL after a grace period; a queued run is cancelled",
             responses=errors(404, (409, "the run is not running"), *POSTED))
async def stop_run(run: RunDep, store: StoreDep):
    store.stop(run)
    return {"state": "stopping"}


@router.post("/{run_id}/resume", response_model=RunId, status_code=202,
             summary="Continue from checkpoints/latest.ckpt in a new process; a cancelled run is queued again",
             responses=errors(404, (409, "running already, or no checkpoint"), *POSTED))
async def resume_run(run: RunDep, store: StoreDep):
    return {"id": store.resume(run)}


@router.get("/{run_id}/metrics", response_model=Metrics,
            summary="Per-micro-step metrics, columnar, down-sampled keeping each bucket's extremes",
            responses=errors(404))
async def run_metrics(run: RunDep, store: StoreDep,
                      since_step: Annotated[int, Query(description="only steps after this one")] = -1,
                      max_points: Annotated[int, Query(ge=1, le=1_000_000)] = 2000,
                      from_step: Annotated[Optional[int], Query(description="only steps from this one on "
                                                                "(a zoomed range)")] = None,
                      to_step: Annotated[Optional[int], Query(description="only steps up to this one")] = None):
    return await anyio.to_thread.run_sync(store.files.metrics, run, since_step, max_points, from_step, to_step)


@router.get("/{run_id}/metrics.csv", response_class=Response, summary="Every metric row as CSV (not down-sampled)",
            responses={200: {"description": "step and the metric keys, blank where absent",
                             "content": {"text/csv": {"schema": {"type": "string"}}}}, **errors(404)})
async def run_metrics_csv(run: RunDep, store: StoreDep):
    text = await anyio.to_thread.run_sync(store.files.metrics_csv, run)
    return Response(text, media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="{run.id}-metrics.csv"'})


@router.get("/{run_id}/events", response_class=EventSourceResponse,
            summary="Server-sent events: metrics, log, sample, status, done", responses=errors(404))
async def run_events(request: Request, run: RunDep, store: StoreDep,
                     last_event_id: Annotated[Optional[str], Header(alias="Last-Event-ID")] = None,
                     since_step: Annotated[Optional[int], Query(description="replay metrics after this step "
                                                                "(Last-Event-ID wins)")] = None):
    cursor = since_step
    if last_event_id is not None:
        try:
            cursor = int(last_event_id.strip())
        except ValueError:
            pass
    async for event in event_stream(store, run, cursor, request.is_disconnected):
        yield event


@router.get("/{run_id}/logs", response_model=Lines, summary="The tail of the trainer's stdout.log",
            responses=errors(404))
async def run_logs(run: RunDep, tail: Annotated[int, Query(ge=0, le=100_000)] = 200):
    return {"lines": await anyio.to_thread.run_sync(run.logs, tail)}


@router.get("/{run_id}/samples", response_model=Samples, summary="Samples written during training",
            responses=errors(404))
async def run_samples(run: RunDep):
    return {"samples": await anyio.to_thread.run_sync(run.samples)}


@router.post("/{run_id}/generate", response_model=GenerateOut, summary="Sample from the latest checkpoint",
             responses=errors(404, (409, "no checkpoint yet, or the prompt does not fit the model"), 429,
                              *POSTED))
async def run_generate(run: RunDep, store: StoreDep, body: Optional[GenerateIn] = None):
    return await store.generator.generate(run, body or GenerateIn())


@router.post("/{run_id}/generate/stream", response_class=StreamingResponse,
             summary="Sample from the latest checkpoint, streamed as server-sent events: token {text} as each piece "
                     "of text is produced, then done {step, n_generated, tokens_per_s} (or error {detail})",
             responses={200: {"description": "the events", "content": {"text/event-stream": {"itemSchema": {
                 "type": "object", "required": ["event", "data"],
                 "properties": {"event": {"enum": ["token", "done", "error"]},
                                "data": {"type": "string", "description": "one line of JSON"}}}}}},
                        **errors(404, (409, "no checkpoint yet, or the prompt does not fit the model"), 429, *POSTED)})
async def run_generate_stream(run: RunDep, store: StoreDep, body: Optional[GenerateIn] = None):
    return EventSourceResponse(await store.generator.stream(run, body or GenerateIn()))


@router.get("/{run_id}/checkpoints", response_model=Checkpoints, summary="Checkpoint files with sha256",
            responses=errors(404))
async def run_checkpoints(run: RunDep, store: StoreDep):
    return {"checkpoints": await anyio.to_thread.run_sync(store.files.checkpoints, run)}


@router.get("/{run_id}/checkpoints/{name}", response_class=FileResponse,
            summary="Download a checkpoint (Range requests give 206)",
            responses={200: {"content": {"application/octet-stream": {}}},
                       206: {"description": "the requested byte range(s)",
                             "content": {"application/octet-stream": {}, "multipart/byteranges": {}}},
                       400: {"description": "a malformed Range header", "content": {"text/plain": {}}},
                       416: {"description": "a Range beyond the end of the file", "content": {"text/plain": {}}},
                       **errors((404, "no such run or checkpoint"))})
async def run_checkpoint_file(name: str, run: RunDep, store: StoreDep):
    path = run.checkpoint_path(name)
    step = (await anyio.to_thread.run_sync(store.files.checkpoint_state, path))["step"]
    # saved as RUN-best-step400.ckpt: downloads of several runs' best.ckpt do not overwrite each other
    saved = f"{run.id}-{path.stem}" + (f"-step{step}" if step is not None else "") + path.suffix
    return FileResponse(path, media_type="application/octet-stream", filename=saved)


@router.post("/{run_id}/export", response_class=FileResponse,
             summary="The best (else latest) or the latest checkpoint for llama2.c's run.c, Hugging Face or llama.cpp: "
                     "a zip of the llama2c or hf folder, or the .gguf file",
             responses={200: {"description": "the download", "content": {"application/zip": {},
                                                                         "application/octet-stream": {}}},
                        **errors(404, (409, "no checkpoint yet, or the model cannot be written in this format"),
                                 *POSTED)})
async def run_export(run: RunDep, body: ExportIn):
    path, name, tmp = await anyio.to_thread.run_sync(export_run, run, body)
    return FileResponse(path, filename=name, background=BackgroundTask(shutil.rmtree, tmp, ignore_errors=True),
                        media_type="application/zip" if name.endswith(".zip") else "application/octet-stream")


@router.get("/{run_id}/system", response_model=System, summary="The trainer process's CPU % and RSS",
            responses=errors(404))
async def run_system(run: RunDep, store: StoreDep):
    return await store.processes.system(run)
