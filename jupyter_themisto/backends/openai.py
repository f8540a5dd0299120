"""The `openai` backend: any OpenAI-compatible server (OpenAI, vLLM, Ollama, llama.cpp server…)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, SecretStr

from ..context import PredictionContext
from ._http import HTTPPredictor, HTTPSettings, parse_json
from ._text import FenceStripper, closing_chunk, output_chunks, whole_statements
from .base import BackendError, NextCellChunk, NoPrediction, OutputChunk, Task
from .prompts import render_prompt

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_MODEL = "gpt-4o-mini"


class OpenAISettings(HTTPSettings):
    base_url: str | None = Field(
        None, description=f"the server's URL; else `$OPENAI_BASE_URL`, else `{DEFAULT_BASE_URL}`"
    )
    api_key: SecretStr | None = Field(
        None,
        description="else `$OPENAI_API_KEY` (a local server may need none); never logged,"
        " returned or sent to the browser",
    )
    model: str = Field(DEFAULT_MODEL, description="the model to ask")
    api: Literal["chat", "completions"] = Field(
        "chat",
        description="`chat` (chat completions) or `completions` (raw completions: suits base"
        " models)",
    )


class OpenAIPredictor(HTTPPredictor):
    """Chat completions (`api: "chat"`, default) or completions (`api: "completions"`), streamed
    (settings: `OpenAISettings`)."""

    name = "openai"
    description = "Any OpenAI-compatible chat/completions server (OpenAI, vLLM, Ollama, llama.cpp)"
    default_base_url = DEFAULT_BASE_URL
    api_key_env = "OPENAI_API_KEY"
    base_url_env = "OPENAI_BASE_URL"
    default_model = DEFAULT_MODEL
    settings_model = OpenAISettings
    settings: OpenAISettings

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        self.api = self.settings.api

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _needs_key(self) -> bool:
        return self.base_url.startswith("https://api.openai.com")

    async def health(self) -> dict[str, Any]:
        if self._needs_key() and not self._api_key:
            return {"ok": False, "detail": "no API key: set OPENAI_API_KEY or the api_key setting"}
        return {"ok": True, "detail": f"{self.api} API, model {self.model} at {self.base_url}"}

    def _payload(self, ctx: PredictionContext, task: Task, n: int) -> tuple[str, dict[str, Any]]:
        instructions, prompt = render_prompt(ctx, task)
        payload: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.settings.max_tokens,
            "temperature": self.settings.temperature,
        }
        if n > 1:
            payload["n"] = n
            # n samples at temperature 0 would all be the same suggestion.
            payload["temperature"] = max(self.settings.temperature, 0.7)
        if self.api == "chat":
            payload["messages"] = [
                {"role": "system", "content": instructions},
                {"role": "user", "content": prompt},
            ]
            return "/chat/completions", payload
        payload["prompt"] = f"# {instructions}\n{prompt}"
        payload["stop"] = ["\n# In[", "\n# Out:"]
        return "/completions", payload

    async def _stream(
        self, ctx: PredictionContext, task: Task, n: int
    ) -> AsyncIterator[tuple[int, str | None, str | None]]:
        """(choice index, text delta or None, the finish reason once that choice finished)."""
        if self._needs_key():
            self.require_key()
        path, payload = self._payload(ctx, task, n)
        finished = False
        async for _event, data in self.stream_events(path, payload):
            if data.strip() == "[DONE]":
                finished = True
                break
            obj = parse_json(data, "a streamed chunk")
            if isinstance(obj, dict) and obj.get("error"):
                err = obj["error"]
                msg = err.get("message") if isinstance(err, dict) else str(err)
                raise BackendError(self.scrub(f"openai: the model server reported: {msg}"))
            for choice in (obj.get("choices") or []) if isinstance(obj, dict) else []:
                index = int(choice.get("index") or 0)
                if self.api == "chat":
                    text = (choice.get("delta") or {}).get("content")
                else:
                    text = choice.get("text")
                if text or choice.get("finish_reason"):
                    yield index, text or None, choice.get("finish_reason")
        if not finished:
            raise BackendError(
                f"openai: the stream from {self.base_url} ended before [DONE] (cut off)"
            )

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        strippers: dict[int, FenceStripper] = {}
        shown: dict[int, str] = {}
        done: set[int] = set()
        async for index, text, finish in self._stream(ctx, "next-cell", max(1, n)):
            if index in done:
                continue
            s = strippers.setdefault(index, FenceStripper())
            out = s.feed(text) if text else ""
            if out:
                shown[index] = shown.get(index, "") + out
                yield NextCellChunk(index=index, text=out)
            if finish:
                # Cut at max_tokens: ended at its last whole statement.
                whole = shown.get(index, "") + s.finish()
                final = whole_statements(whole) if finish == "length" else whole
                yield closing_chunk(index, shown.get(index, ""), final)
                done.add(index)
        for index, s in strippers.items():
            if index not in done:
                yield NextCellChunk(index=index, text=s.finish(), done=True)
        if not strippers:
            raise NoPrediction("the model returned no suggestion")

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        texts = self._stream(ctx, "output", 1)
        async for chunk in output_chunks(t async for i, t, _ in texts if i == 0 and t is not None):
            yield chunk
