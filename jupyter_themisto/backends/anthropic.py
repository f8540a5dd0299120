"""The `anthropic` backend: the Anthropic Messages API, streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field, SecretStr

from ..context import PredictionContext
from ._http import HTTPPredictor, HTTPSettings, parse_json
from ._text import closing_chunk, output_chunks, unfenced, whole_statements
from .base import BackendError, NextCellChunk, NoPrediction, OutputChunk, Task
from .prompts import render_prompt

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_MODEL = "claude-3-5-haiku-latest"


class AnthropicSettings(HTTPSettings):
    base_url: str | None = Field(
        None, description=f"else `$ANTHROPIC_BASE_URL`, else `{DEFAULT_BASE_URL}`"
    )
    api_key: SecretStr | None = Field(
        None,
        description="else `$ANTHROPIC_API_KEY`; never logged, returned or sent to the browser",
    )
    model: str = Field(DEFAULT_MODEL, description="the model to ask")


class AnthropicPredictor(HTTPPredictor):
    """Messages API with `stream: true` (settings: `AnthropicSettings`). The API returns one
    answer per request, so a next-cell request yields one suggestion whatever `n` asks."""

    name = "anthropic"
    description = "Anthropic Messages API (Claude), streamed"
    default_base_url = DEFAULT_BASE_URL
    api_key_env = "ANTHROPIC_API_KEY"
    base_url_env = "ANTHROPIC_BASE_URL"
    default_model = DEFAULT_MODEL
    settings_model = AnthropicSettings
    settings: AnthropicSettings

    def headers(self) -> dict[str, str]:
        return {"x-api-key": self._api_key, "anthropic-version": ANTHROPIC_VERSION}

    async def health(self) -> dict[str, Any]:
        if not self._api_key:
            return {
                "ok": False,
                "detail": "no API key: set ANTHROPIC_API_KEY or the api_key setting",
            }
        return {"ok": True, "detail": f"model {self.model} at {self.base_url}"}

    async def _stream(
        self, ctx: PredictionContext, task: Task, ended: dict[str, str] | None = None
    ) -> AsyncIterator[str]:
        """The answer's text as it streams; `ended` gets the `stop_reason`."""
        self.require_key()
        instructions, prompt = render_prompt(ctx, task)
        payload = {
            "model": self.model,
            "max_tokens": self.settings.max_tokens,
            "temperature": self.settings.temperature,
            "system": instructions,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
        }
        stopped = False
        async for event, data in self.stream_events("/v1/messages", payload):
            obj = parse_json(data, f"a {event or 'streamed'} event")
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == "error" or event == "error":
                err = obj.get("error") or {}
                raise BackendError(
                    self.scrub(
                        f"anthropic: the API reported {err.get('type', 'an error')}:"
                        f" {err.get('message', '')}"
                    )
                )
            if kind == "content_block_delta":
                delta = obj.get("delta") or {}
                if delta.get("type") == "text_delta" and delta.get("text"):
                    yield delta["text"]
            elif kind == "message_delta" and ended is not None:
                reason = (obj.get("delta") or {}).get("stop_reason")
                if reason:
                    ended["stop_reason"] = reason
            elif kind == "message_stop":
                stopped = True
                break
        if not stopped:
            raise BackendError(
                f"anthropic: the stream from {self.base_url} ended before message_stop (cut off)"
            )

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        ended: dict[str, str] = {}
        shown = ""
        async for out, last in unfenced(self._stream(ctx, "next-cell", ended)):
            if not last:
                shown += out
                yield NextCellChunk(index=0, text=out)
                continue
            whole = shown + out
            if not whole.strip():
                raise NoPrediction("the model returned no suggestion")
            # Cut at max_tokens: ended at its last whole statement.
            cut = ended.get("stop_reason") == "max_tokens"
            yield closing_chunk(0, shown, whole_statements(whole) if cut else whole)

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        async for chunk in output_chunks(self._stream(ctx, "output")):
            yield chunk
