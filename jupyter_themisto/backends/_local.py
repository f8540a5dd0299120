"""Shared plumbing of the in-process model backends (llamacpp, seq2seq).

A model is loaded once per process and shared by every backend instance that names the same
files; it generates as many answers at a time as it has slots (one for seq2seq; others wait
their turn in their own thread); generation runs in a worker thread whose text is streamed to
the event loop; closing the stream (the client went away, a newer request superseded it) stops
the generation at the next token. Every answer is bounded: cut at the cell boundary, at most
`max_lines` lines, stopped when it repeats itself, and ended after `suggestion_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from pydantic import Field

from ..context import PredictionContext
from ._text import (
    AnswerBounds,
    FenceStripper,
    StopScanner,
    chat_prose,
    closing_chunk,
    degenerate_reason,
    hold_back,
    whole_statements,
)
from .base import NextCellChunk, NoPrediction, OutputChunk, Predictor
from .prompts import (
    NOT_FIRST,
    Example,
    FimTokens,
    Prompt,
    PromptSettings,
    RepoTokens,
    next_cell_prompt,
    output_prompt,
)
from .ranking import Candidate, normalized, rank, with_each_source
from .retrieval import RetrievalPredictor, RetrievalSettings
from .settings import BackendSettings

#: Notebooks whose answer written ahead is kept (the most recently written).
AHEAD_KEPT = 64


@dataclass
class Deadline:
    """When an answer's time is up (`time.monotonic()`); a suggestion that follows an answer
    being written ahead moves it later (`LocalModelPredictor._follow`)."""

    at: float

    def left(self) -> float:
        return self.at - time.monotonic()


@dataclass(eq=False)
class Writing:
    """A first suggestion being written ahead (`answer_ahead`): for the notebook's cell
    `previous`, from the prompt `prompt`; its chunks so far, for a suggestion asked for that
    very prompt to follow (`followers`: those following it now, which nothing else stops)."""

    previous: str
    prompt: str
    deadline: Deadline
    chunks: list[NextCellChunk] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    over: bool = False
    #: why it wrote nothing worth showing
    failure: str | None = None
    followers: int = 0

    def add(self, chunk: NextCellChunk) -> None:
        self.chunks.append(chunk)
        self.changed.set()

    def end(self) -> None:
        self.over = True
        self.changed.set()


@dataclass(frozen=True)
class Completion:
    """One answer to generate: the prompt, where it ends, how long and how random."""

    prompt: str
    stops: list[str] = field(default_factory=list)
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    #: text after the insertion point: the model fills in the middle with `fim`'s tokens
    suffix: str | None = None
    fim: FimTokens | None = None
    #: seconds the generation may take (the engine stops it; 0: no bound)
    time_limit: float = 0.0
    #: the engine's slot to run in (see `SharedModel.slot_for`; -1: whichever is free)
    slot: int = -1
    #: strings the answer never spells (`Prompt.banned`)
    banned: tuple[str, ...] = ()
    #: strings the answer's first token may not be (`prompts.NOT_FIRST`)
    banned_first: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        prompt: Prompt,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        time_limit: float = 0.0,
        slot: int = -1,
    ) -> Completion:
        """The Completion of `prompt`: a fill-in-the-middle prompt keeps its two sides apart
        (an engine that must shorten the prompt cuts the prefix's beginning, never the FIM
        tokens around it)."""
        if prompt.suffix is not None and prompt.fim is not None:
            return cls(
                prompt.prefix,
                prompt.stops,
                max_tokens,
                temperature,
                seed,
                suffix=prompt.suffix,
                fim=prompt.fim,
                time_limit=time_limit,
                slot=slot,
                banned=prompt.banned,
            )
        return cls(
            prompt.text,
            prompt.stops,
            max_tokens,
            temperature,
            seed,
            time_limit=time_limit,
            slot=slot,
            banned=prompt.banned,
        )


class SharedModel:
    """A loaded model and the semaphore that lets `slots` generations run on it at once."""

    def __init__(
        self,
        model: Any,
        load_seconds: float,
        slots: int = 1,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.load_seconds = load_seconds
        self.slots = slots
        #: what the backend learnt about the model as it loaded it (e.g. its FIM tokens)
        self.details: dict[str, Any] = details if details is not None else {}
        #: held by each running generation; `with model.lock` waits for a free slot
        self.lock = threading.BoundedSemaphore(slots)
        #: the cancel flags of the generations running now (set all of them to stop them)
        self.running: set[threading.Event] = set()
        #: the prompts evaluated last (newest last): what an engine's prompt cache may hold
        self.recent: deque[str] = deque(maxlen=8)
        #: the engine slot of each notebook that has one (least recently used first)
        self._slot_of: OrderedDict[str, int] = OrderedDict()
        self._slot_lock = threading.Lock()

    def remember(self, prompt: str) -> None:
        self.recent.append(prompt)

    def slot_for(self, notebook: str) -> int:
        """The engine slot a notebook's prompts go to: the same one while the notebook keeps
        it, so that the slot's cache holds the notebook's previous prompt. A notebook new to
        the model takes a slot no notebook has, else the one used least recently. -1 (any
        slot) for a request of no notebook, or a model of one slot."""
        if not notebook or self.slots < 2:
            return -1
        with self._slot_lock:
            if notebook in self._slot_of:
                self._slot_of.move_to_end(notebook)
                return self._slot_of[notebook]
            taken = set(self._slot_of.values())
            free = [s for s in range(self.slots) if s not in taken]
            slot = free[0] if free else self._slot_of.popitem(last=False)[1]
            self._slot_of[notebook] = slot
            return slot

    def holds(self, prompt: str, shifted: bool = False) -> bool:
        """Whether a recent prompt shares at least half of `prompt`'s beginning (so that the
        engine's cache spares evaluating most of it). `shifted`: the engine also moves runs of
        a cached prompt into place, so a recent prompt that holds the first half further on
        counts too (a long notebook's window that dropped its oldest cells)."""
        half = prompt[: (len(prompt) + 1) // 2]
        return any(
            len(os.path.commonprefix([prompt, r])) * 2 >= len(prompt) or (shifted and half in r)
            for r in self.recent
        )


_models: dict[Hashable, SharedModel] = {}
_models_lock = threading.Lock()


def shared_model(
    key: Hashable,
    load: Callable[[], Any],
    slots: int = 1,
    details: dict[str, Any] | None = None,
) -> SharedModel:
    """The model for `key`, loaded by `load()` the first time any backend asks for it; `load`
    may fill `details` (kept as the SharedModel's)."""
    with _models_lock:
        found = _models.get(key)
        if found is None:
            if not _models:
                atexit.register(_close_models)
            start = time.perf_counter()
            found = SharedModel(load(), time.perf_counter() - start, slots, details)
            _models[key] = found
        return found


def _close(shared: SharedModel) -> None:
    # Generations still running are stopped first and waited for: a worker thread that calls
    # back into Python while the interpreter shuts down would abort the process.
    for flag in list(shared.running):
        flag.set()
    held = [shared.lock.acquire(timeout=30) for _ in range(shared.slots)]
    close = getattr(shared.model, "close", None)
    if callable(close):
        close()
    shared.model = None
    for got in held:
        if got:
            shared.lock.release()


def _close_models() -> None:
    # Free native models while the interpreter is whole (llama.cpp's finalizers fail later).
    with _models_lock:
        for shared in _models.values():
            _close(shared)
        _models.clear()


def close_model(key: Hashable) -> None:
    """Stop and free the model for `key`, if loaded (the next backend to ask loads it again)."""
    with _models_lock:
        shared = _models.pop(key, None)
        if shared is not None:
            _close(shared)


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
    """Run `produce(cancelled)` in a worker thread holding a slot of the model; yield its pieces.

    Closing this iterator sets `cancelled`: `produce` must check it between tokens. A request
    cancelled while it still waits for a slot never starts generating.
    """

    def run(cancelled: threading.Event, emit: Callable[[str], None]) -> None:
        for piece in produce(cancelled):
            if cancelled.is_set():
                break
            emit(piece)

    async for piece in push_from_thread(model, run):
        yield piece


async def push_from_thread(
    model: SharedModel, run: Callable[[threading.Event, Callable[[str], None]], None]
) -> AsyncGenerator[str, None]:
    """Like stream_from_thread, for engines that hand text to a callback: `run(cancelled, emit)`
    calls `emit(piece)` for each piece and returns when the answer is complete or `cancelled`
    is set."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def put(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone: nobody is listening any more
            cancelled.set()

    def emit(piece: str) -> None:
        if not cancelled.is_set():
            put("text", piece)

    def work() -> None:
        try:
            with model.lock:
                if cancelled.is_set():
                    return
                model.running.add(cancelled)
                try:
                    run(cancelled, emit)
                finally:
                    model.running.discard(cancelled)
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


class LocalModelSettings(PromptSettings):
    """Settings of every backend that runs a model in this process (and the `prompt_*` ones)."""

    max_tokens: int = Field(128, ge=1, description="tokens of a next-cell suggestion")
    output_max_tokens: int = Field(128, ge=1, description="tokens of an output prediction")
    max_lines: int = Field(30, ge=1, description="lines of one answer")
    suggestion_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds one answer may take from being asked for (what came by then is kept)",
    )
    output_timeout: float = Field(
        15.0,
        gt=0,
        description="seconds an output prediction may take (it streams into the predicted-output"
        " area, which has a Cancel button; what came by then is kept)",
    )
    temperature: float = Field(
        0.0, ge=0, description="of the first suggestion and of output predictions (0: greedy)"
    )
    sample_temperature: float = Field(
        0.8, ge=0, description="the 2nd… suggestions of a ranked list are sampled at this"
    )
    seed: int = Field(0, description="sampling seed")
    answer_ahead: bool = Field(
        True,
        description="a warm-up the plugin sends while a cell is typed (and after a run no"
        " suggestion was asked for) also writes the suggestion for that prompt, in the"
        " background; once the cell has run, it is on screen at once: the suggestion itself"
        " when the run added nothing the prompt shows (followed as it is written when it is not"
        " done yet, its time then the suggestion's own), else the early answer while the model"
        " answers the prompt with the run's error or outputs (stopped the moment anything else"
        " asks the model, typing on included; not the warm-up as that cell starts running; see"
        " README)",
    )
    retrieval: RetrievalSettings | None = Field(
        None,
        description="settings of the `retrieval` backend whose cells join a ranked list of"
        " n > 1 suggestions",
    )


class LocalModelPredictor(Predictor):
    """Base of backends that run a model in this process (settings: `LocalModelSettings`).

    Subclasses implement `shared()` (the SharedModel, loaded on first use) and `produce()`
    (the text pieces of one Completion), or `run()` for engines that hand text to a callback,
    and may name the model's fill-in-the-middle tokens (`fim_tokens()`). Prompts come from
    `prompts.next_cell_prompt` / `prompts.output_prompt` (a percent-format script for the next
    cell, a console session for an output); both end at the next cell boundary.
    """

    settings_model: ClassVar[type[BackendSettings] | None] = LocalModelSettings
    settings: LocalModelSettings

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        self.prompt_options = self.settings.prompt_options()
        self._retrieval: RetrievalPredictor | None = None
        #: answers ended by suggestion_timeout (for health details and tests)
        self.timed_out = 0
        #: warm-ups running, by notebook (kernel id, else path), and the one to run next
        self._warming: dict[str, asyncio.Future[None]] = {}
        self._next_warm: dict[str, PredictionContext] = {}
        #: warm-ups started after a cold answer, by notebook (kept until done)
        self._background: dict[str, asyncio.Future[None]] = {}
        #: answers written ahead (`answer_ahead`), by notebook: (the cell they follow, their
        #: prompt, the answer, greedy or sampled; the `AHEAD_KEPT` newest), and the ones being
        #: written
        self._ahead: OrderedDict[str, tuple[str, str, str, str]] = OrderedDict()
        self._writing_ahead: dict[str, asyncio.Future[None]] = {}
        self._writing: dict[str, Writing] = {}
        #: predictions begun (a warm-up during which one began writes no answer ahead)
        self._predictions = 0

    def shared(self) -> SharedModel:
        raise NotImplementedError

    def produce(
        self, model: SharedModel, job: Completion, cancelled: threading.Event
    ) -> Iterator[str]:
        """The text pieces of `job`, as the model generates them; stops once `cancelled`."""
        raise NotImplementedError

    def run(
        self,
        model: SharedModel,
        job: Completion,
        cancelled: threading.Event,
        emit: Callable[[str], None],
    ) -> bool:
        """Generate `job`, handing each piece to `emit`; return when done or `cancelled`, True
        when the answer ended at its token or time limit (False when that is not known)."""
        for piece in self.produce(model, job, cancelled):
            if cancelled.is_set():
                break
            emit(piece)
        return False

    def preload(self) -> None:
        """Load the model in a background thread now (the server calls this at start when this
        is its default backend), and index the history whose continuations come first; a
        failure is logged and said again by the first request."""

        def load() -> None:
            try:
                self.shared()
            except Exception as e:
                self.env.log.warning("themisto: %s: preloading the model failed: %s", self.name, e)
            retrieval = self._retrieval_backend()
            if retrieval.settings.continuation_cells:
                try:
                    retrieval.index()
                except Exception as e:
                    self.env.log.warning(
                        "themisto: %s: indexing the history failed: %s", self.name, e
                    )

        threading.Thread(target=load, name=f"themisto-load-{self.name}", daemon=True).start()

    def fim_tokens(self, model: SharedModel) -> FimTokens | None:
        """The model's fill-in-the-middle tokens, if it has them (then cells below are used)."""
        return None

    def _fim(self, model: SharedModel) -> FimTokens | None:
        # Asked only when the prompt would use them (the cells below are off by default).
        return self.fim_tokens(model) if self.prompt_options.below else None

    def prompt_chars(self) -> int | None:
        """The most characters of a next-cell prompt (None: the engine takes any length)."""
        return None

    def output_prompt_tokens(self) -> int | None:
        """The most tokens of an output prompt, about (None: the engine takes any length)."""
        return None

    def repo_tokens(self, model: SharedModel) -> RepoTokens | None:
        """The model's repository-level tokens, if it has them (then examples from other
        notebooks go before the script as files of the repository)."""
        return None

    def prompt_limit(self) -> tuple[int, int] | None:
        """What the engine keeps of a prompt: (characters, tokens); None: all of it."""
        return None

    def next_cell_prompt(
        self, ctx: PredictionContext, model: SharedModel, examples: list[Example] | None = None
    ) -> Prompt:
        """The next-cell prompt of `ctx` for this model (within `prompt_chars`), with
        `examples` from other notebooks where the model reads them (`repo_tokens`)."""
        return next_cell_prompt(
            ctx,
            self.prompt_options,
            self._fim(model),
            self.prompt_chars(),
            examples,
            self.repo_tokens(model),
            self.prompt_limit(),
        )

    async def _prompt_with_examples(self, ctx: PredictionContext, model: SharedModel) -> Prompt:
        """`next_cell_prompt` with the examples the `retrieval` backend finds in the recorded
        history (`prompt_examples`), for models that read them."""
        options = self.prompt_options
        examples: list[Example] = []
        if options.examples and not options.below and self.repo_tokens(model) is not None:
            try:
                examples = await self._retrieval_backend().examples(ctx, options.examples)
            except Exception as e:
                self.env.log.warning("themisto: %s: reading the history failed: %s", self.name, e)
        return self.next_cell_prompt(ctx, model, examples)

    def cold_prompt(
        self, ctx: PredictionContext, model: SharedModel, prompt: Prompt
    ) -> Prompt | None:
        """A shorter prompt to answer with when the engine's cache holds nothing of `prompt`
        (evaluating all of it would take seconds); None: answer with `prompt`. Engines that
        keep a prompt cache override this; the whole prompt is evaluated after the answer."""
        return None

    def slot(self, ctx: PredictionContext, model: SharedModel) -> int:
        """The engine slot for `ctx`'s next-cell prompts and their warm-ups (-1: any free
        slot). Engines whose cache needs a notebook's prompts in one slot override this."""
        return -1

    async def idle(self) -> None:
        """Wait for the warm-ups started after cold answers (benchmarks, tests)."""
        while self._background:
            await asyncio.gather(*self._background.values(), return_exceptions=True)

    def _warm_later(self, ctx: PredictionContext, model: SharedModel, prompt: Prompt) -> None:
        # Remembered now: a request asked before the warm-up starts finds it coming (and waits
        # for it in `_settle`) instead of answering cold again.
        model.remember(prompt.prefix)
        key = notebook_key(ctx)
        _keep(self._background, key, asyncio.ensure_future(self.warm(ctx)))

    async def _model(self) -> SharedModel:
        # Loading takes long enough (a model file, weights) to keep it off the event loop.
        return await asyncio.to_thread(self.shared)

    async def _complete(
        self,
        job: Completion,
        status: dict[str, bool] | None = None,
        *,
        code: bool = True,
        until: Deadline | None = None,
    ) -> AsyncIterator[str]:
        """Streamed text of one answer: cut at the cell boundary, at most `max_lines` lines, and
        ended `job.time_limit` (else `suggestion_timeout`) seconds after it was asked for
        (waiting for a free slot included; loading the model not), or at `until`, which may
        move while it is written. A `code` answer also loses its code fences and is stopped
        when it repeats itself (an output may repeat lines and hold fences). An answer ended by
        its time sets `status["timed_out"]`; one that a limit ended (time, tokens, lines, a
        loop) sets `status["cut"]`: it may end mid-statement."""
        model = await self._model()
        job = replace(job, time_limit=job.time_limit or self.settings.suggestion_timeout)
        model.remember(job.prompt)
        scanner = StopScanner(job.stops)
        fences = FenceStripper() if code else None
        bounds = AnswerBounds(max_lines=self.settings.max_lines, max_repeats=2 if code else 0)

        def run(cancelled: threading.Event, emit: Callable[[str], None]) -> None:
            if self.run(model, job, cancelled, emit) and status is not None:
                status["cut"] = True

        pieces = push_from_thread(model, run)
        until = until or Deadline(time.monotonic() + job.time_limit)
        # (a piece awaited as a task of its own: waiting for it past a time that was then moved
        # later must not cancel it)
        waiting: asyncio.Future[str] | None = None
        try:
            while True:
                waiting = waiting or asyncio.ensure_future(pieces.__anext__())
                await asyncio.wait([waiting], timeout=max(0.0, until.left()))
                if not waiting.done():
                    if until.left() > 0:
                        continue  # (its time was moved later meanwhile)
                    self.env.log.info("%s: answer ended at its time limit", self.name)
                    self.timed_out += 1
                    if status is not None:
                        status["timed_out"] = status["cut"] = True
                    return
                try:
                    piece = waiting.result()
                except StopAsyncIteration:
                    break
                waiting = None
                text = scanner.feed(piece)
                text = bounds.feed(fences.feed(text) if fences else text)
                if text:
                    yield text
                if scanner.stopped or bounds.stopped:
                    break
        finally:
            if waiting is not None and not waiting.done():
                waiting.cancel()  # (the engine stops at its next token)
                await asyncio.wait([waiting])
            await pieces.aclose()
        if not bounds.stopped:
            rest = scanner.finish()
            if fences:
                rest = fences.feed(rest) + fences.finish()
            rest = bounds.feed(rest) + bounds.finish()
            if rest:
                yield rest
        if bounds.stopped and status is not None:
            status["cut"] = True

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        """The suggestion on screen first (index 0), streamed; then the ranked alternatives.

        When the newest cells ran in the same order before (recorded history, a corpus: the
        `retrieval` settings' `continuation_cells`), the cell that followed them there is the
        first suggestion, at once, and the model is not asked for it. A suggestion that is not
        worth showing (only comments or blank lines, the cell just run again, nothing) is
        dropped without ever being shown: the greedy answer is held back while it may still
        turn out so, and samples stand in for it, two at most, all within
        `suggestion_timeout`, each streamed as soon as it cannot turn out so either. For more
        than one suggestion, sampled answers (one per further place, each with its own time)
        and cells retrieved from the recorded history (the `retrieval` backend, settings
        under `retrieval`) join it and are ranked together
        (`ranking.rank`: deduplicated, degenerate ones dropped, scored by consensus); index 0
        keeps its place (it is on screen already) and gets its score. A machine too busy to
        answer within the time gets no further attempts.
        """
        # The suggestion being written ahead for this cell (`answer_ahead`) is kept while this
        # finds out whether it is the one asked for: the same prompt (then it is followed).
        writing = self._being_written(ctx) if n <= 1 else None
        if writing is not None:
            writing.followers += 1
        try:
            self._predicting()
            model = await self._model()
            prompt = await self._prompt_with_examples(ctx, model)
            followed = await self._continuation(ctx)
            given = Candidate(followed, "history") if followed is not None else None
            given = given or self._written_for(ctx, prompt)
            if writing is not None and (given is not None or writing.prompt != prompt.text):
                writing.followers -= 1
                writing = None
                self.stop_ahead()
            if writing is not None:
                async for chunk in self._follow(writing):
                    yield chunk
                return
            # (with either the model answers no first suggestion, cold or not)
            short = None if given is not None else self.cold_prompt(ctx, model, prompt)
            if short is None:
                async for chunk in self._next_cell(ctx, model, prompt, n, given):
                    yield chunk
                return
            newest = max((c.order_index or 0 for c in ctx.cells), default=0)
            self.env.log.info(
                "%s: cold prompt (%s after %s): answered from its newest cells",
                self.name,
                ctx.trajectory_id or ctx.notebook_path,
                newest,
            )
            try:
                async for chunk in self._next_cell(ctx, model, short, n, None):
                    yield chunk
            finally:
                # The next suggestion of this notebook then finds the whole prompt evaluated.
                self._warm_later(ctx, model, prompt)
        finally:
            if writing is not None:
                writing.followers -= 1

    async def _follow(self, writing: Writing) -> AsyncIterator[NextCellChunk]:
        """The suggestion being written ahead for the very prompt asked (the cell typed is the
        cell that ran, and its run added nothing the prompt shows): what it wrote so far at
        once, then the rest as it comes, its time moved to this suggestion's own
        (`suggestion_timeout` from now). It was written as this suggestion would have been
        (`_next_cell`), with a head start."""
        writing.deadline.at = max(
            writing.deadline.at, time.monotonic() + self.settings.suggestion_timeout
        )
        sent = 0
        while True:
            new = writing.chunks[sent:]
            if new:
                sent += len(new)
                for chunk in new:
                    yield chunk
                continue
            if writing.over:
                break
            writing.changed.clear()
            await writing.changed.wait()
        if not writing.chunks:
            raise NoPrediction(
                writing.failure or f"the {self.name} model suggested nothing worth showing"
            )
        if not writing.chunks[-1].done:  # (its writing was stopped: what came is kept)
            yield NextCellChunk(index=0, text="", done=True)

    async def _next_cell(
        self,
        ctx: PredictionContext,
        model: SharedModel,
        prompt: Prompt,
        n: int,
        given: Candidate | None,
        deadline: Deadline | None = None,
    ) -> AsyncIterator[NextCellChunk]:
        """The suggestions for `prompt`; the first one's time ends at `deadline` (an answer
        written ahead: it may move later), else `suggestion_timeout` from now."""
        previous = ctx.previous_code()
        slot = self.slot(ctx, model)
        wanted = max(1, n)
        dropped: list[str] = []
        # The first suggestion has suggestion_timeout in all, stand-ins for a dropped greedy
        # answer included; each further one has its own.
        first_deadline = deadline or Deadline(time.monotonic() + self.settings.suggestion_timeout)
        # (the engine's own bound, with room for a deadline moved later)
        room = self.settings.suggestion_timeout if deadline is not None else 0.0
        first: Candidate | None = None
        busy = False
        if given is not None and given.source == "history":
            # These cells ran in this order before: what followed them there is shown at once
            # (the model evaluates the prompt meanwhile, for this notebook's next suggestion).
            first = given
            if wanted == 1:
                self._warm_later(ctx, model, prompt)
            yield NextCellChunk(index=0, text=given.text, done=True, metadata={"source": "history"})
        elif given is not None:
            # The model's answer to this very prompt, written ahead: not written again.
            first = given
            yield NextCellChunk(index=0, text=given.text, done=True)
        else:
            await self._settle(ctx)
        for attempt in range(0 if first is not None else 3):
            limit = first_deadline.left()
            if limit <= 0.05:
                dropped.append(f"no answer within {self.settings.suggestion_timeout:g} s")
                break
            job = self._first_attempt(prompt, attempt, limit + room, slot)
            status: dict[str, bool] = {}
            text, sent = "", 0
            async for piece in self._complete(job, status, until=first_deadline):
                text += piece
                # A stand-in streams as the greedy answer would: on screen is what came first.
                # Blank lines and spaces wait for what follows them: an answer never ends in
                # them (Tab would put them into the cell).
                end = len(text.rstrip())
                if end > sent and not hold_back(text, previous):
                    yield NextCellChunk(index=0, text=text[sent:end])
                    sent = end
            shown = text[:sent]
            text = whole_statements(text) if status.get("cut") else text.rstrip()
            why = degenerate_reason(text, previous)
            if why is None and not sent and status.get("cut") and hold_back(text, previous):
                # Its limit ended it while it was still the previous cell's beginning (held
                # back all along): most likely that cell again, cut.
                why = "the previous cell's beginning again (cut by its limit)"
            if status.get("timed_out") and not text.strip():
                why = (
                    f"no answer within {self.settings.suggestion_timeout:g} s (suggestion_timeout)"
                )
            if why is None or sent:  # (one streamed already cannot turn out degenerate)
                first = Candidate(text, "greedy" if attempt == 0 else "sampled")
                yield closing_chunk(0, shown, text)
                busy = bool(status.get("timed_out"))
                break
            dropped.append(why)
            if status.get("timed_out"):
                busy = True
                break
        if first is not None and wanted == 1:
            return
        candidates = [first] if first is not None else []
        for attempt in range(3, 3 + (0 if busy else wanted - 1)):
            job = Completion.of(
                prompt,
                self.settings.max_tokens,
                self.settings.sample_temperature,
                self.settings.seed + attempt,
                slot=slot,
            )
            status = {}
            text = "".join([piece async for piece in self._complete(job, status)])
            text = whole_statements(text) if status.get("cut") else text.rstrip()
            candidates.append(Candidate(text, "sampled"))
            if status.get("timed_out"):
                break  # the machine is too busy for more
        candidates += await self._retrieved(ctx, wanted)
        ranked = rank(candidates, previous)
        start = 0
        if first is not None:
            key = normalized(first.text)
            top = next((c for c in ranked if normalized(c.text) == key), None)
            yield NextCellChunk(index=0, text="", score=top.score if top else 0.0)
            ranked = [c for c in ranked if c is not top]
            start = 1
        for i, c in enumerate(with_each_source(ranked, wanted - start)):
            yield NextCellChunk(
                index=start + i,
                text=c.text,
                done=True,
                score=c.score,
                metadata={"source": c.source},
            )
        if first is None and not ranked:
            reasons = ", ".join(sorted(set(dropped))) or "nothing"
            raise NoPrediction(f"the {self.name} model suggested nothing worth showing ({reasons})")

    def _retrieval_backend(self) -> RetrievalPredictor:
        """The `retrieval` backend over the same history: the host's own (a server's, whose
        index it then shares with the early answer) unless settings are given under
        `retrieval`."""
        if self._retrieval is None:
            given = self.settings.retrieval
            if given is None and self.env.lookup is not None:
                host = self.env.lookup("retrieval")
                if isinstance(host, RetrievalPredictor):
                    self._retrieval = host
                    return host
            own = given.model_dump(exclude_unset=True) if given is not None else {}
            self._retrieval = RetrievalPredictor(own, self.env)
        return self._retrieval

    async def _continuation(self, ctx: PredictionContext) -> str | None:
        """What followed the newest cells where they ran in the same order before
        (`RetrievalPredictor.continuation`), or None; a history that cannot be read leaves the
        suggestion to the model."""
        try:
            return await self._retrieval_backend().continuation(ctx)
        except Exception as e:
            self.env.log.warning("themisto: %s: reading the history failed: %s", self.name, e)
            return None

    async def _retrieved(self, ctx: PredictionContext, n: int) -> list[Candidate]:
        """Cells the `retrieval` backend finds in the recorded history, as candidates."""
        try:
            found = [c async for c in self._retrieval_backend().predict_next_cell(ctx, n=n)]
        except NoPrediction:
            return []
        return [Candidate(c.text, "retrieved") for c in found]

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        if not (ctx.target_source or "").strip():
            raise NoPrediction("there is no cell source to predict the output of")
        self._predicting()
        job = Completion.of(
            output_prompt(ctx, self.output_prompt_tokens()),
            self.settings.output_max_tokens,
            self.settings.temperature,
            self.settings.seed,
            self.settings.output_timeout,
        )
        start = time.monotonic()
        shown = ""
        async for text in self._complete(job, code=False):
            shown += text
            yield OutputChunk(text=text)
        left = self.settings.output_timeout - (time.monotonic() - start)
        if not shown.strip() and left > 0:
            # Greedy, the model went straight on to the next `>>> `. Asked again, its answer may
            # not begin so; shown once whole, unless it is chat about the code (on 300 corpus
            # outputs: 22 of 32 empty answers filled, +1.8 chrF; see README).
            again = replace(job, banned_first=NOT_FIRST, time_limit=left)
            text = "".join([t async for t in self._complete(again, code=False)])
            if text.strip() and not chat_prose(text):
                yield OutputChunk(text=text)
                return
        if not shown:
            raise NoPrediction(f"the {self.name} model predicts no output for this cell")

    async def warm(self, ctx: PredictionContext, *, ahead: bool = False) -> None:
        """Make the next prediction for `ctx` fast: load the model, and let engines that keep
        a prompt cache evaluate the prompt now (see `prefill`). A prediction for the same
        notebook asked meanwhile waits for this to finish and starts from its cache. Warm-ups
        of one notebook asked while one runs (cells run in a row) are folded: only the newest
        runs next. With `ahead` (and `answer_ahead`), the suggestion for the newest prompt is
        then written in the background (see `answer_ahead`)."""
        key = notebook_key(ctx)
        being_written = self._being_written(ctx)
        if being_written is not None:
            model = await self._model()
            if (await self._prompt_with_examples(ctx, model)).text == being_written.prompt:
                return  # (evaluated, and its suggestion is being written: as the cell runs)
        self.stop_ahead()  # (answers for older prompts: the model is wanted)
        predictions = self._predictions
        running = self._warming.get(key)
        if running is not None and not running.done():
            self._next_warm[key] = ctx
            return
        model = await self._model()
        next_ctx: PredictionContext | None = ctx
        while next_ctx is not None:
            ctx = next_ctx
            prompt = await self._prompt_with_examples(next_ctx, model)
            job = Completion.of(prompt, max_tokens=1, slot=self.slot(next_ctx, model))
            model.remember(job.prompt)
            task = asyncio.ensure_future(asyncio.to_thread(self.prefill, model, job))
            self._warming[key] = task
            try:
                await asyncio.shield(task)
            finally:
                if self._warming.get(key) is task:
                    del self._warming[key]
            next_ctx = self._next_warm.pop(key, None)
        previous = ctx.previous_code()
        if (
            ahead
            and self.settings.answer_ahead
            and previous is not None
            and self._ahead.get(key, ("", ""))[1] != prompt.text
            and self._predictions == predictions  # (else a prediction is waiting for the model)
        ):
            self._ahead.pop(key, None)  # (written for an earlier state of the notebook)
            writing = asyncio.ensure_future(self._write_ahead(key, previous, prompt, ctx))
            _keep(self._writing_ahead, key, writing)

    def _first_attempt(self, prompt: Prompt, attempt: int, limit: float, slot: int) -> Completion:
        """Try `attempt` (0, 1, 2) at the first suggestion: the greedy answer, then samples
        standing in for it when it is not worth showing."""
        return Completion.of(
            prompt,
            self.settings.max_tokens,
            self.settings.temperature if attempt == 0 else self.settings.sample_temperature,
            self.settings.seed + attempt,
            time_limit=limit,
            slot=slot,
        )

    async def _write_ahead(
        self, key: str, previous: str, prompt: Prompt, ctx: PredictionContext
    ) -> None:
        """Write the first suggestion for `prompt` (the notebook's cells up to `previous`) as a
        suggestion asked for it would be (`_next_cell`: the greedy answer, else a sample
        standing in for it, within `suggestion_timeout`) and keep it for `answer_ahead`. A
        suggestion asked for this prompt meanwhile follows it (`_follow`); anything else asked
        of the model stops it (`stop_ahead`)."""
        writing = Writing(
            previous, prompt.text, Deadline(time.monotonic() + self.settings.suggestion_timeout)
        )
        self._writing[key] = writing
        text, source = "", "greedy"
        try:
            model = await self._model()
            async for chunk in self._next_cell(ctx, model, prompt, 1, None, writing.deadline):
                text = chunk.text if chunk.replace else text + chunk.text
                source = (chunk.metadata or {}).get("source", source)
                writing.add(chunk)
        except Exception as e:  # noqa: BLE001 - the prediction asked later says what fails
            writing.failure = str(e)
            self.env.log.debug("%s: no answer ahead: %s", self.name, e)
            return
        finally:
            writing.end()
            if self._writing.get(key) is writing:
                del self._writing[key]
        if text.strip():
            self._ahead[key] = (previous, prompt.text, text, source)
            self._ahead.move_to_end(key)
            while len(self._ahead) > AHEAD_KEPT:  # (notebooks closed long ago)
                self._ahead.popitem(last=False)

    def _being_written(self, ctx: PredictionContext) -> Writing | None:
        """The suggestion still being written ahead for `ctx`'s notebook since the cell `ctx`
        last ran (its prompt may have more: the caller compares), if there is one."""
        writing = self._writing.get(notebook_key(ctx))
        if writing is None or writing.over or writing.previous != ctx.previous_code():
            return None
        return writing

    def answer_ahead(self, ctx: PredictionContext) -> str | None:
        """The suggestion written ahead for `ctx`'s notebook, if it was written after the cell
        `ctx` last ran (its prompt had that cell, not its outputs), else None."""
        kept = self._ahead.get(notebook_key(ctx))
        if kept is None or kept[0] != ctx.previous_code():
            return None
        return kept[2]

    def _written_for(self, ctx: PredictionContext, prompt: Prompt) -> Candidate | None:
        """The first suggestion written ahead for `prompt` itself, if it was (`answer_ahead`:
        the cell typed is the cell that ran, and its run added nothing the prompt shows)."""
        written = self.answer_ahead(ctx)
        kept = self._ahead.get(notebook_key(ctx))
        if written is None or kept is None or kept[1] != prompt.text:
            return None
        return Candidate(written, kept[3])

    def _predicting(self) -> None:
        """A prediction starts: answers being written ahead stop, and a warm-up begun before
        writes none."""
        self._predictions += 1
        self.stop_ahead()

    def stop_ahead(self) -> None:
        """Stop writing answers ahead (but one a suggestion follows): the model is wanted."""
        for key, task in list(self._writing_ahead.items()):
            writing = self._writing.get(key)
            if writing is None or not writing.followers:
                task.cancel()

    async def _settle(self, ctx: PredictionContext) -> None:
        """Wait (within the suggestion's time) for a warm-up of this notebook still running:
        starting beside it would evaluate the same prompt twice, on the same cores."""
        key = notebook_key(ctx)
        task = self._warming.get(key) or self._background.get(key)
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.settings.suggestion_timeout / 2)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - only a head start
                pass

    def prefill(self, model: SharedModel, job: Completion) -> None:
        """Evaluate `job.prompt` into the engine's prompt cache, if it has one."""


def _keep(tasks: dict[str, asyncio.Future[None]], key: str, task: asyncio.Future[None]) -> None:
    """Keep `task` in `tasks` under `key` until it is done (unless a newer one took its place)."""
    tasks[key] = task
    task.add_done_callback(lambda done: tasks.pop(key) if tasks.get(key) is done else None)


def notebook_key(ctx: PredictionContext) -> str:
    return ctx.kernel_id or ctx.notebook_path or ctx.trajectory_id or ""
