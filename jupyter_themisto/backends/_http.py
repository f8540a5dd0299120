"""Shared plumbing of the HTTP model backends: bounded SSE reading, retries, errors."""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import re
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
from pydantic import Field, SecretStr

from .base import BackendError, BackendTimeout, BackendUnavailable, Predictor
from .settings import BackendSettings

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


# What one answer may hold before reading stops (backend settings of the same names). A
# streamed answer of a few hundred tokens is tens of kilobytes; these leave ample room while
# keeping a faulty or hostile server from growing the Jupyter server without end.
MAX_LINE_BYTES = 256 * 1024
MAX_EVENT_BYTES = 1024 * 1024
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
# Most of an error body (or of an answer that is not an event stream) that is read.
MAX_ERROR_BODY_BYTES = 64 * 1024

_EOL = re.compile(rb"\r\n|\r|\n")


class StreamTooLarge(BackendError):
    """The model server's answer passed a size bound; reading stopped."""


async def decoded_chunks(resp: httpx.Response, max_bytes: int) -> AsyncIterator[bytes]:
    """The body's bytes, decompressed by at most `max_bytes` per step (no decompression bomb).

    Reads the raw stream: httpx's own decoders inflate a whole network chunk at once.
    """
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        async for chunk in resp.aiter_raw():
            yield chunk
        return
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise BackendError(
            f"the model server compressed its answer with {encoding!r}, which is not supported"
            " (the request asked for none)"
        )
    inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by the header
    step = max(1, max_bytes)
    async for chunk in resp.aiter_raw():
        data = chunk
        while data:
            try:
                out = inflate.decompress(data, step)
            except zlib.error as e:
                raise BackendError(f"the model server sent a corrupt {encoding} body: {e}") from e
            if out:
                yield out
            data = inflate.unconsumed_tail


async def read_at_most(resp: httpx.Response, limit: int = MAX_ERROR_BODY_BYTES) -> bytes:
    """Up to `limit` bytes of the body (the rest is not read; the connection is dropped)."""
    parts = bytearray()
    async for chunk in decoded_chunks(resp, limit):
        parts += chunk[: limit - len(parts)]
        if len(parts) >= limit:
            break
    return bytes(parts)


async def bounded_lines(
    chunks: AsyncIterator[bytes], *, max_line: int, max_total: int, who: str
) -> AsyncIterator[str]:
    """Lines (CR, LF or CRLF ended) of a byte stream, refusing a line over `max_line` bytes or
    a stream over `max_total` bytes (StreamTooLarge) before holding more than that."""
    line = bytearray()
    total = 0
    skip_lf = False  # a CR ended the last chunk: an LF opening the next belongs to it
    async for chunk in chunks:
        total += len(chunk)
        if total > max_total:
            raise StreamTooLarge(
                f"{who}: the answer passed {max_total} bytes; stopped reading"
                " (backend setting max_response_bytes)"
            )
        start = 1 if skip_lf and chunk[:1] == b"\n" else 0
        skip_lf = False
        for m in _EOL.finditer(chunk, start):
            line += chunk[start : m.start()]
            if len(line) > max_line:
                break
            yield line.decode("utf-8", "replace")
            line.clear()
            start = m.end()
            skip_lf = m.group() == b"\r" and start == len(chunk)
        else:
            line += chunk[start:]
        if len(line) > max_line:
            raise StreamTooLarge(
                f"{who}: the model server sent a line of more than {max_line} bytes without a"
                " line break; stopped reading (backend setting max_line_bytes)"
            )
    if line:
        yield line.decode("utf-8", "replace")


async def iter_sse(
    lines: AsyncIterator[str], *, max_event: int | None = None, who: str = "the model server"
) -> AsyncIterator[tuple[str | None, str]]:
    """(event, data) pairs of a text/event-stream, per the WHATWG rules that matter here.

    An event whose data passes `max_event` characters is refused (StreamTooLarge).
    """
    event: str | None = None
    data: list[str] = []
    size = 0
    async for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data, size = None, [], 0
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            size += len(value) + 1
            if max_event is not None and size > max_event:
                raise StreamTooLarge(
                    f"{who}: the model server sent an event of more than {max_event} bytes;"
                    " stopped reading (backend setting max_event_bytes)"
                )
            data.append(value)
    if data:
        yield event, "\n".join(data)


def parse_json(data: str, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise BackendError(f"the model server sent malformed JSON in {what}: {e}") from e


class HTTPSettings(BackendSettings):
    """Settings of the HTTP model backends (`openai`, `anthropic`)."""

    base_url: str | None = Field(
        None, description="the model server's URL (else the backend's environment variable)"
    )
    api_key: SecretStr | None = Field(
        None,
        description="the API key (else the backend's environment variable; best left there);"
        " never logged, returned or sent to the browser",
    )
    model: str = Field("", description="the model to ask")
    timeout: float = Field(30.0, gt=0, description="seconds to wait for a byte of the answer")
    connect_timeout: float = Field(5.0, gt=0, description="seconds to wait for the connection")
    max_retries: int = Field(
        2,
        ge=0,
        description="retries on 408/409/429/5xx and connection failures, before the first byte"
        " of an answer only",
    )
    backoff: float = Field(
        0.5,
        ge=0,
        description="seconds before the first retry, doubled each retry (a"
        " `Retry-After` of the server is honoured)",
    )
    max_backoff: float = Field(
        20.0, ge=0, description="longest wait honoured: a longer `Retry-After` fails at once"
    )
    max_tokens: int = Field(256, ge=1, description="tokens of one answer")
    temperature: float = Field(
        0.2, ge=0, description="sampling temperature (a ranked list of n > 1 asks at least 0.7)"
    )
    max_line_bytes: int = Field(
        MAX_LINE_BYTES,
        gt=0,
        description="longest line of the answer: past it reading stops with an error",
    )
    max_event_bytes: int = Field(
        MAX_EVENT_BYTES,
        gt=0,
        description="biggest server-sent event of the answer: past it reading stops",
    )
    max_response_bytes: int = Field(
        MAX_RESPONSE_BYTES,
        gt=0,
        description="most bytes of one answer (after decompression): past it reading stops",
    )


class HTTPPredictor(Predictor):
    """Base of backends that talk to a model server over HTTP with httpx (settings:
    `HTTPSettings`)."""

    settings_model: ClassVar[type[BackendSettings] | None] = HTTPSettings
    settings: HTTPSettings
    default_base_url = ""
    api_key_env = ""
    base_url_env = ""
    default_model = ""

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        import os

        s = self.settings
        self.base_url = str(
            s.base_url or os.environ.get(self.base_url_env) or self.default_base_url
        ).rstrip("/")
        # Kept on the instance only; never logged, never part of an error or health detail.
        given = s.api_key.get_secret_value() if s.api_key is not None else ""
        self._api_key = given or os.environ.get(self.api_key_env) or ""
        self.model = s.model or self.default_model
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
                timeout=httpx.Timeout(self.settings.timeout, connect=self.settings.connect_timeout),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def headers(self) -> dict[str, str]:
        return {}

    def _request_headers(self) -> dict[str, str]:
        # No compression: a compressed answer can inflate far past its size on the wire.
        return {"Accept-Encoding": "identity", **self.headers()}

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
        problem = self.env.unfollowed() if self.env.unfollowed is not None else None
        if problem:
            raise BackendUnavailable(
                f"{self.name}: nothing was sent to {self.base_url}: {problem}; put the key back,"
                " or set c.ThemistoExtensionApp.allow_unfollowed_secrets = True to send anyway"
            )
        attempt = 0
        while True:
            delay: float | None = None
            try:
                async with self.client().stream(
                    "POST", url, json=payload, headers=self._request_headers()
                ) as resp:
                    if resp.status_code >= 400:
                        body = await read_at_most(resp)
                        if (
                            resp.status_code in RETRY_STATUSES
                            and attempt < self.settings.max_retries
                        ):
                            wait = retry_after_seconds(resp.headers)
                            if wait is None:
                                wait = (
                                    self.settings.backoff * (2**attempt) * (1 + random.random() / 4)
                                )
                            if wait <= self.settings.max_backoff:
                                delay = wait
                        if delay is None:
                            status = resp.status_code
                            raise BackendError(self.error_message(status, body))
                    else:
                        ctype = resp.headers.get("content-type", "")
                        if "text/event-stream" not in ctype:
                            body = await read_at_most(resp)
                            raise BackendError(
                                self.scrub(
                                    f"{self.name}: {url} answered {ctype or 'no content type'}"
                                    f" instead of an event stream: {body[:200]!r}"
                                )
                            )
                        lines = bounded_lines(
                            decoded_chunks(resp, self.settings.max_line_bytes),
                            max_line=self.settings.max_line_bytes,
                            max_total=self.settings.max_response_bytes,
                            who=self.name,
                        )
                        events = iter_sse(
                            lines, max_event=self.settings.max_event_bytes, who=self.name
                        )
                        async for event in events:
                            yield event
                        return
            except httpx.TimeoutException as e:
                limit = self.settings.timeout
                raise BackendTimeout(
                    f"{self.name}: no answer from {self.base_url} within {limit:g} s"
                    f" ({type(e).__name__}); raise the backend's timeout or check the server"
                ) from None
            except httpx.ConnectError as e:
                if attempt < self.settings.max_retries:
                    delay = self.settings.backoff * (2**attempt)
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
                self.settings.max_retries,
            )
            await asyncio.sleep(delay or 0)

    def require_key(self) -> None:
        if not self._api_key:
            raise BackendUnavailable(
                f"{self.name}: no API key; set {self.api_key_env} in the server's environment or"
                f" c.ThemistoExtensionApp.backend_settings = {{'{self.name}': {{'api_key': …}}}}"
            )
