"""The early answer: a recorded cell shown while a model's first suggestion is slow to come.

A model backend's first suggestion can take seconds (a local model loading or reading a cold
prompt, an answer held back, a remote API's round trip). When nothing of it has come within
`ThemistoExtensionApp.early_answer_ms`, the server sends the cell the `retrieval` backend
ranks first (found in milliseconds) as the first suggestion, not done; the model's first text
for that suggestion then replaces it (a chunk with `replace`), since the models' answers score
better than retrieval's on the benchmark corpus; when the model has nothing, it stays.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..backends import NextCellChunk, NoPrediction

_END = object()


async def with_early_answer(
    chunks: AsyncGenerator[NextCellChunk, None],
    early: Callable[[], Awaitable[str | None]],
    after: float,
) -> AsyncIterator[NextCellChunk]:
    """`chunks`, preceded by `early()`'s cell when no chunk has come within `after` seconds.

    `chunks` runs to its end in one task of its own (an HTTP backend's stream must be entered
    and left in one task), closed when this generator is.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for chunk in chunks:
                await queue.put(chunk)
        except Exception as e:  # handed on: raised where the chunks are read
            await queue.put(e)
        finally:
            await chunks.aclose()
        await queue.put(_END)

    task = asyncio.ensure_future(pump())
    shown: str | None = None  # the early answer on screen, until the model's replaces it
    try:
        try:
            item = await asyncio.wait_for(queue.get(), after)
        except asyncio.TimeoutError:
            shown = await early()
            if shown is not None and not queue.empty():
                shown = None  # (the model's text came meanwhile: no early answer to replace)
            if shown is not None:
                yield NextCellChunk(index=0, text=shown, metadata={"source": "retrieved"})
            item = await queue.get()
        while item is not _END:
            if isinstance(item, Exception):
                if shown is not None and isinstance(item, NoPrediction):
                    break  # the early answer stays
                raise item
            if shown is not None and item.index == 0 and (item.text or item.done):
                # (nothing, or the very same cell whole, closes it: it stays as it is)
                same = not item.text or item.done and item.text == shown
                item = replace(item, text="") if same else replace(item, replace=True)
                shown = None
            yield item
            item = await queue.get()
        if shown is not None:
            yield NextCellChunk(index=0, text="", done=True)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
