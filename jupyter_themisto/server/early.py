"""The early answer: a suggestion shown while a model's first suggestion is slow to come.

A model backend's first suggestion can take seconds (a local model loading or reading a cold
prompt, an answer held back, a remote API's round trip). When nothing of it has come within
`ThemistoExtensionApp.early_answer_ms`, the server sends an early answer as the first
suggestion, not done: the suggestion the model wrote ahead for the cell just run (a local
model's `answer_ahead`, from the plugin's warm-up, before the run's outputs existed), else the
cell the `retrieval` backend ranks first (found in milliseconds). The model's text for that
suggestion then takes its place (a chunk with `replace`) once it departs from it: text that
only repeats the early answer's beginning changes nothing on screen. When the model has
nothing, the early answer stays.
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
    early: Callable[[], Awaitable[tuple[str, str] | None]],
    after: float,
) -> AsyncIterator[NextCellChunk]:
    """`chunks`, preceded by `early()`'s cell (text, source) when no chunk has come within
    `after` seconds.

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
    written = ""  # the model's suggestion 0 so far, while the early answer is on screen
    try:
        try:
            item = await asyncio.wait_for(queue.get(), after)
        except asyncio.TimeoutError:
            found = await early()
            if found is not None and queue.empty():
                # (else the model's text came meanwhile: no early answer to replace)
                shown = found[0]
                yield NextCellChunk(index=0, text=shown, metadata={"source": found[1]})
            item = await queue.get()
        while item is not _END:
            if isinstance(item, Exception):
                if shown is not None and isinstance(item, NoPrediction):
                    break  # the early answer stays
                raise item
            if shown is not None and item.index == 0 and (item.text or item.done):
                written = item.text if item.replace else written + item.text
                if shown.startswith(written) and not item.done:
                    item = await queue.get()  # (the early answer's beginning: nothing changes)
                    continue
                if not written:  # (the model's suggestion closed empty: the early one stays)
                    item = replace(item, text="", replace=False)
                elif written.startswith(shown):  # (the same cell, or the same and more)
                    item = replace(item, text=written[len(shown) :], replace=False)
                else:
                    item = replace(item, text=written, replace=True)
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
