"""The `openai` backend: any OpenAI-compatible server (OpenAI, vLLM, Ollama, llama.cpp server…)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ..context import PredictionContext
from ._http import HTTPPredictor, parse_json
from ._text import FenceStripper
from .base import BackendError, NextCellChunk, NoPrediction, OutputChunk
from .prompts import render_prompt

DEFAULT_BASE_URL = "https://api.openai.com/v1"


class OpenAIPredictor(HTTPPredictor):
    """Chat completions (`api: "chat"`, default) or completions (`api: "completions"`), streamed.

    Settings: base_url (else $OPENAI_BASE_URL, else OpenAI), api_key (else $OPENAI_API_KEY; a
    local server may need none), model, api, max_tokens, temperature, timeout,
    connect_timeout, max_retries, backoff, max_backoff.
    """

    name = "openai"
    description = "Any OpenAI-compatible chat/completions server (OpenAI, vLLM, Ollama, llama.cpp)"
    default_base_url = DEFAULT_BASE_URL
    api_key_env = "OPENAI_API_KEY"
    base_url_env = "OPENAI_BASE_URL"
    default_model = "gpt-4o-mini"

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        self.api = str(self.config.get("api", "chat"))
        if self.api not in ("chat", "completions"):
            raise ValueError(
                f"openai backend: api must be 'chat' or 'completions', not {self.api!r}"
            )

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _needs_key(self) -> bool:
        return self.base_url.startswith("https://api.openai.com")

    async def health(self) -> dict[str, Any]:
        if self._needs_key() and not self._api_key:
            return {"ok": False, "detail": "no API key: set OPENAI_API_KEY or the api_key setting"}
        return {"ok": True, "detail": f"{self.api} API, model {self.model} at {self.base_url}"}

    def _payload(self, ctx: PredictionContext, task: str, n: int) -> tuple[str, dict[str, Any]]:
        instructions, prompt = render_prompt(ctx, task)
        payload: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if n > 1:
            payload["n"] = n
            # n samples at temperature 0 would all be the same suggestion.
            payload["temperature"] = max(self.temperature, 0.7)
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
        self, ctx: PredictionContext, task: str, n: int
    ) -> AsyncIterator[tuple[int, str | None]]:
        """(choice index, text delta or None when that choice finished)."""
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
                if text:
                    yield index, text
                if choice.get("finish_reason"):
                    yield index, None
        if not finished:
            raise BackendError(
                f"openai: the stream from {self.base_url} ended before [DONE] (cut off)"
            )

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        strippers: dict[int, FenceStripper] = {}
        done: set[int] = set()
        async for index, text in self._stream(ctx, "next-cell", max(1, n)):
            if index in done:
                continue
            s = strippers.setdefault(index, FenceStripper())
            if text is None:
                yield NextCellChunk(index=index, text=s.finish(), done=True)
                done.add(index)
            else:
                out = s.feed(text)
                if out:
                    yield NextCellChunk(index=index, text=out)
        for index, s in strippers.items():
            if index not in done:
                yield NextCellChunk(index=index, text=s.finish(), done=True)
        if not strippers:
            raise NoPrediction("the model returned no suggestion")

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        s = FenceStripper()
        got = False
        async for index, text in self._stream(ctx, "output", 1):
            if index != 0:
                continue
            out = s.finish() if text is None else s.feed(text)
            if out:
                got = True
                yield OutputChunk(text=out)
        rest = s.finish()
        if rest:
            got = True
            yield OutputChunk(text=rest)
        if not got:
            raise NoPrediction("the model returned no output prediction")
