"""The silent execute the server and `jupyter themisto record` send a real kernel, and its ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from jupyter_client.manager import AsyncKernelManager

from jupyter_themisto.kernel_client import KernelNoReply, silent_execute


@asynccontextmanager
async def started_kernel() -> AsyncIterator[tuple[AsyncKernelManager, Any]]:
    """A real ipykernel and its async client, as the server and nbclient hold them."""
    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=90)
        yield km, kc
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


async def test_a_silent_execute_returns_its_reply_and_leaves_no_history():
    def value(content: dict[str, Any], name: str) -> str:
        return content["user_expressions"][name]["data"]["text/plain"]

    count = {"n": "get_ipython().execution_count"}
    async with started_kernel() as (_, kc):
        before = await silent_execute(kc, "", timeout=60, what="asking", user_expressions=count)
        ran = await silent_execute(
            kc, "x = 6 * 7", timeout=60, what="running", user_expressions=count
        )
        after = await silent_execute(kc, "", timeout=60, what="asking", user_expressions={"x": "x"})
        failed = await silent_execute(kc, "1 / 0", timeout=60, what="dividing")
    assert ran["status"] == "ok"
    assert value(ran, "n") == value(before, "n")  # silent: not counted (no history, no hooks)
    assert value(after, "x") == "42"  # although it ran
    assert (failed["status"], failed["ename"]) == ("error", "ZeroDivisionError")


async def test_a_kernel_that_does_not_answer_in_time():
    async with started_kernel() as (km, kc):
        # (Had it waited for the sleep, the reply would have come back "ok".)
        with pytest.raises(
            KernelNoReply, match=r"^sleeping: the kernel did not answer within 2 s$"
        ):
            await silent_execute(kc, "import time; time.sleep(60)", timeout=2, what="sleeping")
        await km.interrupt_kernel()


async def test_a_kernel_that_dies_is_reported_at_once():
    async with started_kernel() as (_, kc):
        # Noticed as a death, not as the end of the 600 s (past the tests' own 300 s limit).
        with pytest.raises(KernelNoReply, match=r"^exiting: the kernel died$"):
            await silent_execute(kc, "import os; os._exit(1)", timeout=600, what="exiting")
