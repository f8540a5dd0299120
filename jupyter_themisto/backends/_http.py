"""Shared plumbing of the HTTP model backends: SSE, retries, errors."""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from .base import BackendError, BackendTimeout, BackendUnavailable, Predictor

# Statuses worth another attempt: rate limits and transient server trouble (529: Anthropic
# "overloaded").
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """The server's requested wait: `retry-after-ms`, `Retry-After` seconds or HTTP date."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def iter_sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, str]]:
    """(event, data) pairs of a text/event-stream, per the WHATWG rules that matter here."""
    event: str | None = None
    data: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:
        yield event, "\n".join(data)


def parse_json(data: str, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise BackendError(f"the model server sent malformed JSON in {what}: {e}") from e


class HTTPPredictor(Predictor):
    """Base of backends that talk to a model server over HTTP with httpx.

    Settings (all optional): base_url, api_key, model, timeout (seconds to wait for a byte),
    connect_timeout, max_retries, backoff (first retry delay, doubled each time),
    max_backoff (longest wait honoured; a longer Retry-After fails the request), max_tokens,
    temperature.
    """

    default_base_url = ""
    api_key_env = ""
    base_url_env = ""
    default_model = ""

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        import os

        c = self.config
        self.base_url = str(
            c.get("base_url") or os.environ.get(self.base_url_env) or self.default_base_url
        ).rstrip("/")
        # Kept on the instance only; never logged, never part of an error or health detail.
        self._api_key = c.get("api_key") or os.environ.get(self.api_key_env) or ""
        self.model = str(c.get("model") or self.default_model)
        self.timeout = float(c.get("timeout", 30.0))
        self.connect_timeout = float(c.get("connect_timeout", 5.0))
        self.max_retries = int(c.get("max_retries", 2))
        self.backoff = float(c.get("backoff", 0.5))
        self.max_backoff = float(c.get("max_backoff", 20.0))
        self.max_tokens = int(c.get("max_tokens", 256))
        self.temperature = float(c.get("temperature", 0.2))
        self._client: httpx.AsyncClient | None = None

    # -- helpers -----------------------------------------------------------------------------

    def scrub(self, text: str) -> str:
        """`text` without the API key (some servers echo part of a rejected key)."""
        if self._api_key and len(self._api_key) >= 4:
            text = text.replace(self._api_key, "***")
        return text

    def client(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def headers(self) -> dict[str, str]:
        return {}

    def error_message(self, status: int, body: bytes) -> str:
        """What the server said about a failed request, for a person to act on."""
        detail = ""
        try:
            obj = json.loads(body)
            err = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(err, dict):
                detail = str(err.get("message") or err.get("type") or "")
            elif isinstance(err, str):
                detail = err
            elif isinstance(obj, dict) and obj.get("message"):
                detail = str(obj["message"])
        except ValueError:
            detail = body[:200].decode("utf-8", "replace")
        hint = {
            401: "the API key was refused; check the key setting or environment variable",
            403: "the API key may not use this model",
            404: "check base_url and model",
            429: "rate limited by the model server",
        }.get(status, "the model server failed")
        return self.scrub(f"{self.name}: HTTP {status} from {self.base_url}: {hint}: {detail}")

    async def stream_events(
        self, path: str, payload: dict[str, Any]
    ) -> AsyncIterator[tuple[str | None, str]]:
        """POST `payload` and yield the SSE events of the answer, retrying before the first.

        Retries 429/5xx (honouring Retry-After up to max_backoff) and connection failures,
        never once a byte of the answer has been passed on.
        """
        url = self.base_url + path
        attempt = 0
        while True:
            delay: float | None = None
            try:
                async with self.client().stream(
                    "POST", url, json=payload, headers=self.headers()
                ) as resp:
                    if resp.status_code >= 400:
                        body = await resp.aread()
                        if resp.status_code in RETRY_STATUSES and attempt < self.max_retries:
                            wait = retry_after_seconds(resp.headers)
                            if wait is None:
                                wait = self.backoff * (2**attempt) * (1 + random.random() / 4)
                            if wait <= self.max_backoff:
                                delay = wait
                        if delay is None:
                            status = resp.status_code
                            raise BackendError(self.error_message(status, body))
                    else:
                        ctype = resp.headers.get("content-type", "")
                        if "text/event-stream" not in ctype:
                            body = await resp.aread()
                            raise BackendError(
                                self.scrub(
                                    f"{self.name}: {url} answered {ctype or 'no content type'}"
                                    f" instead of an event stream: {body[:200]!r}"
                                )
                            )
                        async for event in iter_sse(resp.aiter_lines()):
                            yield event
                        return
            except httpx.TimeoutException as e:
                raise BackendTimeout(
                    f"{self.name}: no answer from {self.base_url} within {self.timeout:g} s"
                    f" ({type(e).__name__}); raise the backend's timeout or check the server"
                ) from None
            except httpx.ConnectError as e:
                if attempt < self.max_retries:
                    delay = self.backoff * (2**attempt)
                else:
                    raise BackendError(
                        self.scrub(f"{self.name}: cannot connect to {self.base_url}: {e}")
                    ) from None
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                raise BackendError(
                    self.scrub(f"{self.name}: the stream from {self.base_url} broke off: {e}")
                ) from None
            except httpx.HTTPError as e:
                raise BackendError(
                    self.scrub(f"{self.name}: request to {self.base_url} failed: {e}")
                ) from None
            attempt += 1
            self.env.log.info(
                "themisto: %s: retrying in %.2f s (attempt %d of %d)",
                self.name,
                delay,
                attempt,
                self.max_retries,
            )
            await asyncio.sleep(delay or 0)

    def require_key(self) -> None:
        if not self._api_key:
            raise BackendUnavailable(
                f"{self.name}: no API key; set {self.api_key_env} in the server's environment or"
                f" c.ThemistoExtensionApp.backend_settings = {{'{self.name}': {{'api_key': …}}}}"
            )
