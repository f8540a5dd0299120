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

from ..context import PredictionContext
from ._text import FenceStripper, StopScanner
from .base import NextCellChunk, NoPrediction, OutputChunk, Predictor
from .prompts import FimTokens, Prompt, PromptOptions, next_cell_prompt, output_prompt
from .ranking import Candidate, normalized, rank, with_each_source


@dataclass(frozen=True)
class Completion:
    """One answer to generate: the prompt, where it ends, how long and how random."""

    prompt: str
    stops: list[str] = field(default_factory=list)
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    #: the prompt holds a model's special tokens (fill-in-the-middle) to be read as such
    special: bool = False

    @classmethod
    def of(cls, prompt: Prompt, max_tokens: int, temperature: float, seed: int) -> Completion:
        return cls(prompt.text, prompt.stops, max_tokens, temperature, seed, prompt.special)


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
    (the text pieces of one Completion), and may name the model's fill-in-the-middle tokens
    (`fim_tokens()`). Prompts come from `prompts.next_cell_prompt` / `prompts.output_prompt`
    (a percent-format script for the next cell, a console session for an output); both end at
    the next cell boundary.

    Settings: max_tokens (next cell, default 128), output_max_tokens (default 128),
    temperature (default 0: greedy; later suggestions of a ranked list are sampled at
    sample_temperature, default 0.8), seed (default 0), and the prompt_* settings of
    `prompts.PromptOptions`.
    """

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        c = self.config
        self.max_tokens = int(c.get("max_tokens", 128))
        self.output_max_tokens = int(c.get("output_max_tokens", 128))
        self.temperature = float(c.get("temperature", 0.0))
        self.sample_temperature = float(c.get("sample_temperature", 0.8))
        self.seed = int(c.get("seed", 0))
        self.prompt_options = PromptOptions.from_settings(c)
        self._retrieval: Predictor | None = None
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

    def fim_tokens(self, model: SharedModel) -> FimTokens | None:
        """The model's fill-in-the-middle tokens, if it has them (then cells below are used)."""
        return None

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
        """The greedy answer first, streamed; then the ranked alternatives, whole.

        For more than one suggestion, sampled answers and cells retrieved from the recorded
        history (the `retrieval` backend, settings under `retrieval`) join the greedy one and
        are ranked together (`ranking.rank`: deduplicated, degenerate ones dropped, scored by
        consensus); the greedy answer keeps index 0 (it is on screen already) and gets its
        score. A small model's greedy answer is sometimes empty: then the best alternative
        takes index 0.
        """
        model = await self._model()
        prompt = next_cell_prompt(ctx, self.prompt_options, self.fim_tokens(model))
        wanted = max(1, n)
        greedy, sent = "", 0
        job = Completion.of(prompt, self.max_tokens, self.temperature, self.seed)
        async for piece in self._complete(job):
            greedy += piece
            if greedy.strip():
                yield NextCellChunk(index=0, text=greedy[sent:])
                sent = len(greedy)
        shown = bool(greedy.strip())
        if shown:
            yield NextCellChunk(index=0, text=greedy[sent:], done=True)
            if wanted == 1:
                return
        candidates = [Candidate(greedy, "greedy")] if shown else []
        # Samples: one per further place (one more when the greedy answer failed); retrieved
        # cells come free and compete for the same places.
        for attempt in range(1, wanted + (0 if shown else 1)):
            job = Completion.of(
                prompt, self.max_tokens, self.sample_temperature, self.seed + attempt
            )
            text = "".join([piece async for piece in self._complete(job)])
            candidates.append(Candidate(text, "sampled"))
        candidates += await self._retrieved(ctx, wanted)
        previous = next((c.source for c in reversed(ctx.cells) if c.cell_type == "code"), None)
        ranked = rank(candidates, previous)
        if shown:
            top = next((c for c in ranked if normalized(c.text) == normalized(greedy)), None)
            yield NextCellChunk(index=0, text="", score=top.score if top else 0.0)
            ranked = [c for c in ranked if c is not top]
        start = 1 if shown else 0
        ranked = with_each_source(ranked, wanted - start)
        for i, c in enumerate(ranked):
            meta = {"source": c.source}
            yield NextCellChunk(
                index=start + i, text=c.text, done=True, score=c.score, metadata=meta
            )
        if not shown and not ranked:
            raise NoPrediction(f"the {self.name} model suggested only empty cells")

    async def _retrieved(self, ctx: PredictionContext, n: int) -> list[Candidate]:
        """Cells the `retrieval` backend finds in the recorded history, as candidates."""
        if self._retrieval is None:
            from .retrieval import RetrievalPredictor

            self._retrieval = RetrievalPredictor(self.config.get("retrieval") or {}, self.env)
        try:
            found = [c async for c in self._retrieval.predict_next_cell(ctx, n=n)]
        except NoPrediction:
            return []
        return [Candidate(c.text, "retrieved") for c in found]

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        if not (ctx.target_source or "").strip():
            raise NoPrediction("there is no cell source to predict the output of")
        job = Completion.of(output_prompt(ctx), self.output_max_tokens, self.temperature, self.seed)
        got = False
        async for text in self._complete(job):
            got = True
            yield OutputChunk(text=text)
        if not got:
            raise NoPrediction(f"the {self.name} model predicts no output for this cell")
