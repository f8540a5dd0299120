"""Helpers tests share: SSE parsing, polling, a server config, running a cell, the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import nbformat
import psutil
import pytest
from tornado.httpclient import HTTPClientError

T = TypeVar("T")


def server_config(**themisto: Any) -> dict[str, Any]:
    """A jp_server_config with the extension enabled; `themisto` overrides its traitlets
    (auto-record is off unless a test turns it on; so is the early answer, which depends on
    time: test_server_early.py and the browser tests have it)."""
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_themisto": True}},
        "ThemistoExtensionApp": {"auto_record": False, "early_answer_ms": 0.0, **themisto},
    }


def parse_sse(text: str) -> list[tuple[str | None, Any]]:
    """A server-sent-event body as (event name, decoded data) pairs, in order."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
        events.append((name, data))
    return events


async def wait_for(predicate: Callable[[], T], timeout: float = 60.0) -> T:
    """The first truthy value of `predicate()`, polled every 0.1 s for up to `timeout`."""
    for _ in range(int(timeout / 0.1)):
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("timed out waiting")


def running(process: psutil.Process) -> bool:
    """Whether `process` still runs: not a zombie, and not gone since it was listed."""
    try:
        return process.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def gone(pid: int) -> bool:
    """Whether process `pid` exited (reaped, or a zombie its parent has yet to reap)."""
    try:
        return not running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return True


def engine_runs(backend: Any) -> list[Any]:
    """A list that gets each job a local model backend's engine is asked to answer from now on."""
    runs: list[Any] = []
    real = backend.run

    def counted(model: Any, job: Any, *rest: Any) -> Any:
        runs.append(job)
        return real(model, job, *rest)

    backend.run = counted
    return runs


async def post(jp_fetch: Any, task: str, body: Any, **kw: Any) -> Any:
    """POST `body` (as JSON) to /themisto/predict/<task>; the response."""
    return await jp_fetch("themisto", "predict", task, method="POST", body=json.dumps(body), **kw)


async def open_next_cell_stream(
    body: dict[str, Any], port: int, base_url: str, auth_header: dict[str, str]
) -> tuple[bytes, asyncio.StreamWriter]:
    """POST a next-cell request on a raw socket (closing it really drops the connection
    mid-stream) and read until the first `chunk` event: (what came, the socket's writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        f"POST {base_url}themisto/predict/next-cell HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: {auth_header['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    received = b""
    while b"event: chunk" not in received:
        more = await asyncio.wait_for(reader.read(4096), timeout=30)
        assert more, received
        received += more
    return received, writer


async def error_of(coro: Awaitable[Any]) -> tuple[int, str]:
    """The status and message of a request that must fail."""
    with pytest.raises(HTTPClientError) as info:
        await coro
    e = info.value
    return e.code, json.loads(e.response.body)["message"]


def write_notebook(root: Path, name: str, metadata: dict[str, Any] | None = None) -> None:
    """A notebook of one code cell at root/name, with `metadata`."""
    nb = nbformat.v4.new_notebook()
    nb.metadata.update(metadata or {})
    nb.cells.append(nbformat.v4.new_code_cell("x = 41 + 1"))
    nbformat.write(nb, str(root / name))


async def start_session(jp_fetch: Any, path: str) -> str:
    """A notebook session for `path` through /api/sessions; its kernel id."""
    body = {"path": path, "type": "notebook", "name": path, "kernel": {"name": "python3"}}
    r = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    return json.loads(r.body)["kernel"]["id"]


async def body_of(coro: Awaitable[Any]) -> bytes:
    """The response body, whether the status is a success or an error."""
    try:
        return (await coro).body
    except HTTPClientError as e:
        return e.response.body


async def run_cell(jp_serverapp: Any, kernel_id: str, code: str, **kw: Any) -> dict[str, Any]:
    """Run a cell as the person would, through a client of its own; the reply content."""
    kc = jp_serverapp.kernel_manager.get_kernel(kernel_id).client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        reply = await kc.execute(code, reply=True, timeout=60, **kw)
        assert reply["content"]["status"] == "ok"
        return reply["content"]
    finally:
        kc.stop_channels()


def execute_content(code: str) -> dict[str, Any]:
    """An execute_request's content as JupyterLab sends it for a cell."""
    return {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": False,
    }


def _cli_command(args: tuple[str, ...], store: Path | None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `python -m jupyter_themisto.cli ARGS`: on `store`
    if given, never on the environment's."""
    cmd = [sys.executable, "-m", "jupyter_themisto.cli"]
    if store is not None:
        cmd += ["--store", str(store)]
    env = {k: v for k, v in os.environ.items() if k != "THEMISTO_STORE"}
    return cmd + list(args), env


def cli(
    *args: str,
    store: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    **kw: Any,
) -> subprocess.CompletedProcess[str]:
    """`python -m jupyter_themisto.cli ARGS`, run to its end, with `env` added to its
    environment."""
    cmd, base = _cli_command(args, store)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})}, **kw
    )


def cli_process(
    *args: str, store: Path | None = None, env: dict[str, str] | None = None, **kw: Any
) -> subprocess.Popen[str]:
    """`python -m jupyter_themisto.cli ARGS` started (to be signalled or killed), with `env`
    added to its environment and its stdout and stderr piped."""
    cmd, base = _cli_command(args, store)
    return subprocess.Popen(
        cmd,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )
