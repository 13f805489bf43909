"""Text from a run's latest checkpoint: the model loaded on the simulator (fp32), one generation at a
time, at most four waiting."""

from __future__ import annotations

import asyncio
import secrets

import anyio

from anectypes.checkpoint import load_checkpoint
from anectypes.corpus import builtin_dataset
from anectypes.data import active_vocab, load_tokens
from anectypes.device import open_device
from anectypes.errors import AnectypesError
from anectypes.generate import generate
from anectypes.model.config import ModelConfig
from anectypes.model.transformer import Transformer
from anectypes.runs import CHECKPOINTS, LATEST
from anectypes.tokenizer import Tokenizer

from .errors import Conflict, TooManyRequests

MAX_WAITING = 4
NO_CHECKPOINT = "the run has no checkpoint yet (checkpoints/latest.ckpt)"


class Generator:
    def __init__(self):
        self._lock = None              # an asyncio.Lock, made in the server's event loop
        self._waiting = 0
        self._model = None             # (key, model, tokenizer, step)

    async def generate(self, run, prompt="", temperature=0.8, top_k=50, max_tokens=64, seed=None):
        """{"text", "step"}: `prompt` continued by the run's latest checkpoint."""
        if not run.rd.file(f"{CHECKPOINTS}/{LATEST}"):
            raise Conflict(NO_CHECKPOINT)
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._waiting >= MAX_WAITING:
            raise TooManyRequests("too many generation requests waiting; try again shortly")
        self._waiting += 1
        try:
            async with self._lock:
                seed = secrets.randbits(32) if seed is None else seed
                return await anyio.to_thread.run_sync(self._generate, run, prompt, temperature, top_k, max_tokens, seed)
        finally:
            self._waiting -= 1

    def _generate(self, run, prompt, temperature, top_k, max_tokens, seed):
        try:
            model, tokenizer, step = self._load_model(run)
            if prompt and max(tokenizer.encode(prompt)) >= model.cfg.vocab:
                raise Conflict("the prompt has tokens outside the model's vocabulary")
            text = generate(model, tokenizer, prompt, n_new=max_tokens, temperature=temperature, top_k=top_k,
                            seed=seed)
        except AnectypesError as e:
            raise Conflict(f"cannot generate: {e}") from None
        return {"text": text, "step": step}

    def _load_model(self, run):
        """The run's latest checkpoint as a simulator model (fp32), kept until another one is asked for."""
        path = run.rd.file(f"{CHECKPOINTS}/{LATEST}")
        if path is None:
            raise Conflict(NO_CHECKPOINT)
        st = path.stat()
        key = (run.id, st.st_size, st.st_mtime_ns)
        if self._model and self._model[0] == key:
            return self._model[1:]
        ckpt = load_checkpoint(path)
        spec = run.config().get("spec") or {}
        if spec.get("data"):
            tokens = load_tokens(spec["data"])
            tokenizer = Tokenizer.load(spec["tokenizer"]) if spec.get("tokenizer") else builtin_dataset()[0]
        else:
            tokenizer, tokens = builtin_dataset()
        cfg = ModelConfig(**ckpt.config).validate()
        model = Transformer(cfg, open_device("sim", precision="fp32"), ckpt.params, active_vocab(tokens))
        self.close()
        self._model = (key, model, tokenizer, int(ckpt.state.get("step", 0)))
        return self._model[1:]

    def close(self):
        if self._model:
            self._model[1].close()
            self._model = None
