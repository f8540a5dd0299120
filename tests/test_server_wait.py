"""A prediction that names the execution it follows, through a real server and real kernels.

The browser asks for the next cell as soon as the kernel answers a cell; the kernel's recorder
may write that cell's row a moment later (the store was busy). A request that carries
`after_execution_count` is answered once that execution is recorded (bounded by
`execution_wait`), so it follows the cell just run, not the one before.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from jupyter_themisto.server.autorecord import LOADED_AT_START, OPTED_OUT
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import (
    error_of,
    parse_sse,
    post,
    server_config,
    start_session,
    wait_for,
    write_notebook,
)

# An earlier session the retrieval backend learns from: after these three cells came the fourth.
HISTORY = [
    "import math",
    "values = [1, 2, 3, 4]",
    "total = sum(values)",
    "print(total / len(values))",
]


@pytest.fixture
def execution_wait():
    return 60.0


@pytest.fixture
def jp_server_config(store_path, execution_wait):
    return server_config(
        auto_record=True, default_backend="retrieval", execution_wait=execution_wait
    )


@pytest.fixture
def store(store_path):
    s = TrajectoryStore(store_path)
    tid = s.create_trajectory(notebook_path="earlier/analysis.ipynb", kernel_id="earlier")
    for source in HISTORY:
        s.add_execution(tid, {"source": source, "status": "ok"})
    yield s
    s.close()


@pytest.fixture
def kernel(jp_fetch, jp_serverapp, jp_root_dir, store):
    """Opens a recorded kernel of a notebook (its id, its client), ready, its trajectory
    started (`async with kernel() as (kernel_id, client)`)."""

    @asynccontextmanager
    async def open_kernel(
        name: str = "wait.ipynb", metadata: dict | None = None
    ) -> AsyncIterator[tuple[str, Any]]:
        app = jp_serverapp.web_app.settings["themisto_app"]
        write_notebook(jp_root_dir, name, metadata)
        kernel_id = await start_session(jp_fetch, name)
        kc = jp_serverapp.kernel_manager.get_kernel(kernel_id).client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)
            if app.auto_recorder.outcomes[kernel_id] == LOADED_AT_START:
                await wait_for(lambda: store.latest_trajectory_for_kernel(kernel_id))
            yield kernel_id, kc
        finally:
            kc.stop_channels()
            await jp_fetch("api", "kernels", kernel_id, method="DELETE")

    return open_kernel


async def run(kc, code: str) -> int:
    """Run `code` and return its execution count once the kernel has replied."""
    reply = await kc.execute(code, reply=True, timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply["content"]["execution_count"]


async def next_cell(jp_fetch, body: dict) -> list[tuple[str, dict]]:
    r = await post(jp_fetch, "next-cell", body, request_timeout=120)
    return parse_sse(r.body.decode())


def suggestion(events: list[tuple[str, dict]]) -> str:
    return next(d["text"] for name, d in events if name == "chunk")


class WriteLock:
    """Holds the store's write lock from another connection, as a busy writer would: the
    kernel's recorder then writes the cell's row only once it is released."""

    def __init__(self, path) -> None:
        self.conn = sqlite3.connect(str(path), isolation_level=None)

    def __enter__(self) -> WriteLock:
        self.conn.execute("BEGIN IMMEDIATE")
        return self

    def release(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.conn.close()


async def test_a_request_right_after_a_cell_gets_the_prediction_that_follows_it(
    jp_fetch, store, store_path, kernel
):
    async with kernel() as (kernel_id, kc):
        await run(kc, HISTORY[0])
        before = await run(kc, HISTORY[1])
        trajectory = store.latest_trajectory_for_kernel(kernel_id)
        # (Itself written a moment after its reply, at times.)
        await wait_for(lambda: store.last_execution_count(trajectory["id"]) == before)
        with WriteLock(store_path) as lock:
            count = await run(kc, HISTORY[2])
            # The kernel has answered; the cell is not recorded yet: the browser asks now.
            assert store.last_execution_count(trajectory["id"]) == before == count - 1
            # Without naming the execution, the answer follows the previous cell (a step behind).
            behind = await next_cell(jp_fetch, {"kernel_id": kernel_id, "n": 1})
            assert suggestion(behind) == HISTORY[2]
            body = {"kernel_id": kernel_id, "n": 1, "after_execution_count": count}
            waiting = asyncio.ensure_future(next_cell(jp_fetch, body))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # the row cannot be written while the lock is held
            lock.release()
            events = await waiting
        assert [name for name, _ in events] == ["meta", "chunk", "done"]
        assert suggestion(events) == HISTORY[3]
        assert store.last_execution_count(trajectory["id"]) == count


async def test_an_execution_recorded_already_is_not_waited_for(jp_fetch, store, kernel):
    async with kernel() as (kernel_id, kc):
        for source in HISTORY[:3]:
            count = await run(kc, source)
        trajectory = store.latest_trajectory_for_kernel(kernel_id)
        await wait_for(lambda: store.last_execution_count(trajectory["id"]) == count)
        # Asked again later (the panel's Suggest), or for an earlier execution: answered as is.
        for after in (count, 1):
            body = {"kernel_id": kernel_id, "n": 1, "after_execution_count": after}
            assert suggestion(await next_cell(jp_fetch, body)) == HISTORY[3]


@pytest.mark.parametrize("execution_wait", [0.5])
async def test_an_execution_that_never_comes_is_a_bounded_404(jp_fetch, store, kernel):
    async with kernel() as (kernel_id, kc):
        count = await run(kc, HISTORY[0])
        trajectory = store.latest_trajectory_for_kernel(kernel_id)
        await wait_for(lambda: store.last_execution_count(trajectory["id"]) == count)
        body = {"kernel_id": kernel_id, "after_execution_count": count + 4}
        for route, extra in [("next-cell", {}), ("output", {"source": "math.pi"})]:
            code, msg = await error_of(
                jp_fetch(
                    "themisto", "predict", route, method="POST", body=json.dumps({**body, **extra})
                )
            )
            assert code == 404
            missing = f"execution {count + 4} of kernel {kernel_id!r} was not recorded within 0.5 s"
            assert missing in msg
            assert f"the latest recorded is execution {count}" in msg
            assert "ThemistoExtensionApp.execution_wait" in msg and "%themisto on" in msg
        # The kernel goes on; a request that names a recorded execution is answered.
        body = {"kernel_id": kernel_id, "after_execution_count": count}
        events = await next_cell(jp_fetch, body)
        assert events[0][0] == "meta" and events[-1][0] == "done"


@pytest.mark.parametrize("execution_wait", [600.0])
async def test_a_paused_recorder_is_not_waited_for(jp_fetch, store, kernel):
    """`%themisto off` is noted in the store (and `on` after it): a request that follows an
    execution run while paused is answered at once (a wait of 600 s would outlast the request's
    own timeout) with a 404 that says so; recorded ones are answered as before."""

    async def refused(after: int) -> str:
        body = {"kernel_id": kernel_id, "n": 1, "after_execution_count": after}
        code, msg = await error_of(
            jp_fetch("themisto", "predict", "next-cell", method="POST", body=json.dumps(body))
        )
        assert code == 404, msg
        return msg

    async with kernel() as (kernel_id, kc):
        first = await run(kc, HISTORY[0])
        tid = store.latest_trajectory_for_kernel(kernel_id)["id"]
        await wait_for(lambda: store.last_execution_count(tid) == first)
        assert store.get_trajectory(tid)["paused_at"] is None
        # The cell that pauses is recorded (it began while recording): it is waited for.
        off = await run(kc, "%themisto off")
        events = await next_cell(
            jp_fetch, {"kernel_id": kernel_id, "n": 1, "after_execution_count": off}
        )
        assert events[0][0] == "meta" and events[-1][0] == "done"
        assert store.last_execution_count(tid) == off
        # Asked the moment the kernel answers, as the browser does.
        paused = await run(kc, HISTORY[1])
        msg = await refused(paused)
        assert f"recording is paused in kernel {kernel_id!r}" in msg and "%themisto on" in msg
        assert f"execution {paused} is not recorded" in msg
        assert f"the latest recorded is execution {off}" in msg
        noted = store.get_trajectory(tid)
        assert noted["paused_at"] is not None and noted["paused_after"] == off

        on = await run(kc, "%themisto on")
        for after in (on, paused):
            msg = await refused(after)
            assert (
                f"execution {after} of kernel {kernel_id!r} ran while recording was paused" in msg
            )
        trajectory = store.get_trajectory(tid)
        assert trajectory["paused_at"] is None and trajectory["paused_after"] is None
        assert trajectory["unrecorded_through"] == on
        # Recording again: the next execution is waited for and answered.
        again = await run(kc, HISTORY[2])
        events = await next_cell(
            jp_fetch, {"kernel_id": kernel_id, "n": 1, "after_execution_count": again}
        )
        assert suggestion(events) == HISTORY[3]
        assert store.last_execution_count(tid) == again
        recorded = [e["source"] for e in store.list_executions(tid)]
        assert recorded == [HISTORY[0], "%themisto off", HISTORY[2]]


@pytest.mark.parametrize("execution_wait", [600.0])
async def test_a_kernel_that_does_not_record_is_not_waited_for(
    jp_fetch, jp_serverapp, store, kernel
):
    """Its notebook opts out: nothing of it is recorded, so nothing is waited for (a wait of
    600 s would outlast the request's own timeout); the cells the browser sent answer."""
    app = jp_serverapp.web_app.settings["themisto_app"]
    async with kernel("private.ipynb", {"themisto": {"record": False}}) as (kernel_id, kc):
        assert app.auto_recorder.outcomes[kernel_id] == OPTED_OUT
        for source in HISTORY[:3]:
            count = await run(kc, source)
        assert store.latest_trajectory_for_kernel(kernel_id) is None
        cells = [{"cell_type": "code", "source": s} for s in HISTORY[:3]]
        body = {"kernel_id": kernel_id, "n": 1, "after_execution_count": count, "cells": cells}
        assert suggestion(await next_cell(jp_fetch, body)) == HISTORY[3]


async def test_the_panel_asks_for_the_kernels_trajectory(jp_fetch, store, kernel):
    """`GET /themisto/trajectories?kernel_id=` gives the live kernel's trajectory, newest first,
    whatever path it recorded (the panel shows it rather than guessing by path)."""
    async with kernel() as (kernel_id, kc):
        await run(kc, HISTORY[0])
        params = {"kernel_id": kernel_id, "limit": 1}
        r = await jp_fetch("themisto", "trajectories", params=params)
        [found] = json.loads(r.body)["trajectories"]
        assert found["kernel_id"] == kernel_id and found["notebook_path"] == "wait.ipynb"
        r = await jp_fetch("themisto", "trajectories", params={"kernel_id": "no-such-kernel"})
        assert json.loads(r.body)["trajectories"] == []


async def test_a_slow_store_delays_its_request_only(jp_fetch, jp_serverapp, store):
    """Store calls run in the manager's store threads: while one is stuck in the store (here a
    store whose listing waits, as one on a slow or busy disk does), the server answers others."""
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    entered, released = threading.Event(), threading.Event()
    listing = manager.store.list_trajectories

    def slow_listing(**kwargs: Any) -> list[dict[str, Any]]:
        entered.set()
        released.wait(120)  # on the event loop this would hold the whole server
        return listing(**kwargs)

    manager.store.list_trajectories = slow_listing
    try:
        slow = asyncio.ensure_future(jp_fetch("themisto", "trajectories"))
        await wait_for(entered.is_set)  # the request is stuck in the store now
        status = await jp_fetch("api", "status")
        assert json.loads(status.body)["kernels"] == 0
        trajectory = await jp_fetch("themisto", "trajectories", "no-such-id", raise_error=False)
        assert trajectory.code == 404
        assert not slow.done()
        released.set()
        listed = json.loads((await slow).body)["trajectories"]
        assert [t["kernel_id"] for t in listed] == ["earlier"]
    finally:
        released.set()
        del manager.store.list_trajectories
