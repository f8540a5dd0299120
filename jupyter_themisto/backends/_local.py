"""Shared plumbing of the in-process model backends (llamacpp, seq2seq).

A model is loaded once per process and shared by every backend instance that names the same
files; it generates one answer at a time (others wait their turn in their own thread);
generation runs in a worker thread whose text is streamed to the event loop; closing the stream
(the client went away, a newer request superseded it) stops the generation at the next token.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..context import PredictionContext, completion_prompt
from ._text import FenceStripper, StopScanner
from .base import NextCellChunk, NoPrediction, OutputChunk, Predictor


@dataclass(frozen=True)
class Completion:
    """One answer to generate: the prompt, where it ends, how long and how random."""

    prompt: str
    stops: list[str] = field(default_factory=list)
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0


class SharedModel:
    """A loaded model and the lock that lets one generation run on it at a time."""

    def __init__(self, model: Any, load_seconds: float) -> None:
        self.model = model
        self.load_seconds = load_seconds
        self.lock = threading.Lock()


_models: dict[Hashable, SharedModel] = {}
_models_lock = threading.Lock()


def shared_model(key: Hashable, load: Callable[[], Any]) -> SharedModel:
    """The model for `key`, loaded by `load()` the first time any backend asks for it."""
    with _models_lock:
        found = _models.get(key)
        if found is None:
            if not _models:
                atexit.register(_close_models)
            start = time.perf_counter()
            found = SharedModel(load(), time.perf_counter() - start)
            _models[key] = found
        return found


def _close_models() -> None:
    # Free native models while the interpreter is whole (llama.cpp's finalizers fail later).
    with _models_lock:
        for shared in _models.values():
            close = getattr(shared.model, "close", None)
            if callable(close):
                close()
        _models.clear()


def loaded_model(key: Hashable) -> SharedModel | None:
    """The model for `key` if some backend of this process loaded it already."""
    with _models_lock:
        return _models.get(key)


def loaded_models() -> list[Hashable]:
    """Keys of the models loaded in this process (for health details and tests)."""
    with _models_lock:
        return list(_models)


async def stream_from_thread(
    model: SharedModel, produce: Callable[[threading.Event], Iterator[str]]
) -> AsyncGenerator[str, None]:
    """Run `produce(cancelled)` in a worker thread holding `model.lock`; yield its pieces.

    Closing this iterator sets `cancelled`: `produce` must check it between tokens. A request
    cancelled while it still waits for the lock never starts generating.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def put(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone: nobody is listening any more
            cancelled.set()

    def work() -> None:
        try:
            with model.lock:
                if cancelled.is_set():
                    return
                for piece in produce(cancelled):
                    if cancelled.is_set():
                        break
                    put("text", piece)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
            put("error", e)
        finally:
            put("end", None)

    worker = threading.Thread(target=work, name="themisto-generate", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "text":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        cancelled.set()


def default_threads() -> int:
    """Threads for CPU inference: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class LocalModelPredictor(Predictor):
    """Base of backends that run a model in this process.

    Subclasses implement `shared()` (the SharedModel, loaded on first use) and `produce()`
    (the text pieces of one Completion). Prompts come from `context.completion_prompt`, one
    shape per task (a percent-format script for the next cell, a console session for an
    output); both end at the next cell boundary.

    Settings: max_tokens (next cell, default 128), output_max_tokens (default 128),
    temperature (default 0: greedy; later suggestions of a ranked list are sampled at
    sample_temperature, default 0.8), seed (default 0).
    """

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        c = self.config
        self.max_tokens = int(c.get("max_tokens", 128))
        self.output_max_tokens = int(c.get("output_max_tokens", 128))
        self.temperature = float(c.get("temperature", 0.0))
        self.sample_temperature = float(c.get("sample_temperature", 0.8))
        self.seed = int(c.get("seed", 0))
        for key in ("max_tokens", "output_max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{self.name} backend: {key} must be at least 1")

    def shared(self) -> SharedModel:
        raise NotImplementedError

    def produce(
        self, model: SharedModel, job: Completion, cancelled: threading.Event
    ) -> Iterator[str]:
        """The text pieces of `job`, as the model generates them; stops once `cancelled`."""
        raise NotImplementedError

    async def _model(self) -> SharedModel:
        # Loading takes long enough (a model file, weights) to keep it off the event loop.
        return await asyncio.to_thread(self.shared)

    async def _complete(self, job: Completion) -> AsyncIterator[str]:
        """Streamed text of one answer, cut at the cell boundary, code fences removed."""
        model = await self._model()
        scanner = StopScanner(job.stops)
        fences = FenceStripper()

        def produce(cancelled: threading.Event) -> Iterator[str]:
            return self.produce(model, job, cancelled)

        pieces = stream_from_thread(model, produce)
        try:
            async for piece in pieces:
                text = fences.feed(scanner.feed(piece))
                if text:
                    yield text
                if scanner.stopped:
                    break
        finally:
            await pieces.aclose()
        rest = fences.feed(scanner.finish()) + fences.finish()
        if rest:
            yield rest

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        """The greedy answer first, streamed; then sampled ones, whole and distinct.

        A small model's greedy answer is sometimes an empty cell (it opens the next cell at
        once): sampling then stands in for it, with two attempts to spare.
        """
        prompt, stops = completion_prompt(ctx, "next-cell")
        wanted = max(1, n)
        seen: set[str] = set()
        for attempt in range(wanted + 2):
            if len(seen) >= wanted:
                break
            temperature = self.temperature if attempt == 0 else self.sample_temperature
            text, sent = "", 0
            job = Completion(prompt, stops, self.max_tokens, temperature, self.seed + attempt)
            async for piece in self._complete(job):
                text += piece
                if attempt == 0 and text.strip():
                    yield NextCellChunk(index=0, text=text[sent:])
                    sent = len(text)
            key = text.strip()
            if key and key not in seen:
                seen.add(key)
                yield NextCellChunk(index=len(seen) - 1, text=text[sent:], done=True)
        if not seen:
            raise NoPrediction(f"the {self.name} model suggested only empty cells")

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        if not (ctx.target_source or "").strip():
            raise NoPrediction("there is no cell source to predict the output of")
        prompt, stops = completion_prompt(ctx, "output")
        got = False
        job = Completion(prompt, stops, self.output_max_tokens, self.temperature, self.seed)
        async for text in self._complete(job):
            got = True
            yield OutputChunk(text=text)
        if not got:
            raise NoPrediction(f"the {self.name} model predicts no output for this cell")
