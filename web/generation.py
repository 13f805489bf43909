"""Text from a run's latest checkpoint with the KV-cache decoder on the CPU (anectypes.generate), one
generation at a time, at most four waiting: whole (POST .../generate) or streamed token by token as
server-sent events (POST .../generate/stream): `token` {"text"} as each piece of text is produced
(the prompt's first), then `done` {"step", "n_generated", "tokens_per_s"}, or `error` {"detail"}."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import anyio

from anectypes.errors import AnectypesError
from anectypes import sources
from anectypes.generate.decoder import Decoder
from anectypes.generate.sampling import Sampler, TextStream, stream

from .api_errors import Conflict, NotFound, TooManyRequests

MAX_WAITING = 4
NO_CHECKPOINT = "the run has no {which} checkpoint yet (checkpoints/{which}.ckpt)"


def sse(event, data):
    """One server-sent event (data: one line of JSON)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class Generator:
    def __init__(self):
        self._lock = None              # an asyncio.Lock, made in the server's event loop
        self._waiting = 0
        self._model = None             # (key, decoder, tokenizer, step)

    async def generate(self, run, body):
        """{"text", "step"}: the request's prompt continued by the run's latest (or best) checkpoint."""
        prompt, pieces, step = await self._open(run, body)
        try:
            text = prompt + "".join(await anyio.to_thread.run_sync(list, pieces))
        finally:
            self._release()
        return {"text": text, "step": step}

    async def stream(self, run, body):
        """The generation's events (an async iterator of SSE text); refusals are raised before the first."""
        prompt, pieces, step = await self._open(run, body)

        async def events():
            try:
                yield sse("token", {"text": prompt})
                n, t0 = 0, time.perf_counter()
                while (piece := await anyio.to_thread.run_sync(next, pieces, None)) is not None:
                    n += 1
                    if piece:
                        yield sse("token", {"text": piece})
                rate = n / (time.perf_counter() - t0) if n else 0.0
                yield sse("done", {"step": step, "n_generated": n, "tokens_per_s": rate})
            except AnectypesError as e:
                yield sse("error", {"detail": f"cannot generate: {e}"})
            finally:
                self._release()
        return events()

    async def _open(self, run, body):
        """Wait for the model (TooManyRequests beyond MAX_WAITING), then (the prompt's text, an iterator
        of the text each new token adds, the checkpoint's step); the caller must _release() after."""
        checkpoint(run, body.checkpoint)
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._waiting >= MAX_WAITING:
            raise TooManyRequests("too many generation requests waiting; try again shortly")
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            return await anyio.to_thread.run_sync(self._start, run, body)
        except BaseException:
            self._release()
            raise

    def _release(self):
        self._lock.release()

    def _start(self, run, body):
        try:
            decoder, tokenizer, step = self._load_model(run, body.checkpoint)
            ids = tokenizer.encode(body.prompt, bos=True)
        except AnectypesError as e:
            raise Conflict(f"cannot generate: {e}") from None
        seq = decoder.cfg.seq
        if len(ids) >= seq:
            raise Conflict(f"the prompt is {len(ids)} tokens with BOS; the model's seq is {seq}")
        seed = secrets.randbits(32) if body.seed is None else body.seed
        sampler = Sampler(len(decoder.logits), body.temperature, body.top_p, body.top_k, seed)
        text = TextStream(tokenizer)
        prompt = "".join(map(text, ids))
        return prompt, map(text, stream(decoder, ids, min(seq, len(ids) + body.max_tokens - 1), sampler, tokenizer.stop)), step

    def _load_model(self, run, which):
        """The run's latest or best checkpoint as a decoder, kept until another one is asked for."""
        path = checkpoint(run, which)
        st = path.stat()
        key = (run.id, which, st.st_size, st.st_mtime_ns)
        if not (self._model and self._model[0] == key):
            self._model = None
            source = sources.resolve(path, text=True)
            self._model = (key, Decoder.of(source), source.tokenizer, source.step)
        return self._model[1:]

    def close(self):
        self._model = None


def checkpoint(run, which):
    """The run's "latest" or "best" checkpoint (confined to the run: Run.checkpoint); Conflict when it has none."""
    try:
        return run.checkpoint(which)
    except NotFound:
        raise Conflict(NO_CHECKPOINT.format(which=which)) from None
