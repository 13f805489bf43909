"""Server-sent events of one run: metrics batches, new log lines, samples, status changes, done.

Each metrics message carries the step of its last row as its id, so a reconnecting browser's
Last-Event-ID resumes after it.
"""

from __future__ import annotations

import asyncio
import bisect
import json

import anyio
from fastapi.sse import ServerSentEvent

from anectypes.runs import METRIC_KEYS, SAMPLES, TERMINAL_STATES

from .files import JsonlTail, parse_sample

POLL_S = 0.2                  # file polling interval (≤ 5 messages/s)
MAX_ROWS = 5000               # metric rows per message (a long replay is spread over several)
MAX_LOG_LINES = 500


def from_step(rows, step):
    """The rows (in step order, as the metrics cache keeps them) from `step` on."""
    return rows[bisect.bisect_left(rows, step, key=lambda r: r[0]):]


async def event_stream(store, run, last_event_id=None, is_disconnected=None):
    """The messages for `run` of a RunStore, after step `last_event_id` (default: from now on), until the
    run has ended and everything is sent, the client is gone or the server is closing."""
    cache = store.files.metrics_cache(run)
    cache_rows = await anyio.to_thread.run_sync(cache.refresh)
    if last_event_id is not None:
        cursor = last_event_id
    else:
        cursor = cache_rows[-1][0] if cache_rows else -1
    logs = JsonlTail(run.rd, run.log_name, lambda b: b.decode("utf-8", "replace"), offset=-1)
    samples = JsonlTail(run.rd, SAMPLES, parse_sample, offset=-1)
    logs.read_new()
    samples.read_new()
    last_status, first = None, True
    rows = from_step(cache_rows, cursor)
    last_row = rows[0] if rows and rows[0][0] == cursor else None
    while True:
        status = store.processes.status(run)
        terminal = not status["alive"] and status["state"] in TERMINAL_STATES
        # rows after the cursor, and the cursor's own row again once a validation loss joined it
        rows = from_step(await anyio.to_thread.run_sync(cache.refresh), cursor)
        if rows and rows[0] == last_row:
            rows = rows[1:]
        if rows:
            rows = rows[:MAX_ROWS]
            cursor, last_row = rows[-1][0], rows[-1]
            yield ServerSentEvent(event="metrics", id=str(cursor),
                                  data={"rows": [dict(zip(("step", *METRIC_KEYS), r)) for r in rows]})
        _, lines = logs.read_new()
        if lines:
            yield ServerSentEvent(event="log", data={"lines": lines[-MAX_LOG_LINES:]})
        _, new_samples = samples.read_new()
        for s in new_samples:
            yield ServerSentEvent(event="sample", data=s)
        key = json.dumps(status, sort_keys=True)
        if key != last_status:
            last_status = key
            yield ServerSentEvent(event="status", data=status, id=str(cursor), retry=2000 if first else None)
            first = False
        more = bool(cache.rows) and cache.rows[-1][0] > cursor
        if terminal and not more:
            yield ServerSentEvent(event="done", data={"state": status["state"]}, id=str(cursor))
            return
        if store.closing or (is_disconnected is not None and await is_disconnected()):
            return
        if not more:
            await asyncio.sleep(POLL_S)
