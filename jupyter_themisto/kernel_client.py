"""Asking a kernel from outside (server, CLI): a silent execute, its reply, the recorder's values.

The server (loading the recorder into a kernel it could not launch with it) and
`jupyter themisto record` (loading, configuring and asking the recorder) both talk to a kernel
this way. Silent: the kernel fires no run_cell hooks and keeps no history, so nothing of it is
recorded. (The preview backend sends its request on a socket of its own: backends/preview.py.)
"""

from __future__ import annotations

import ast
import queue
import time
from typing import Any

from jupyter_core.utils import ensure_async

#: The kernel's recorder as an expression: for silent executes and user expressions, which bind
#: no name in the person's namespace (nothing of ours shows up in it or its snapshots).
RECORDER = "__import__('jupyter_themisto.kernel', fromlist=['get_recorder']).get_recorder()"


class KernelNoReply(RuntimeError):
    """The kernel died, or did not answer within the time given."""


class ExpressionFailed(RuntimeError):
    """A user expression raised in the kernel (the message: its error's name and value)."""


async def silent_execute(
    client: Any, code: str, *, timeout: float, what: str, **request: Any
) -> dict[str, Any]:
    """Send `code` as a silent execute_request and return its reply's content.

    `client` is a jupyter_client kernel client (blocking or async) with its channels started;
    `request` holds more fields of the request (`user_expressions`, `allow_stdin`). Raises
    KernelNoReply, its message starting with `what`, when the kernel dies or has not answered
    within `timeout` seconds.
    """
    msg_id = client.execute(code, silent=True, store_history=False, **request)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KernelNoReply(f"{what}: the kernel did not answer within {timeout:.0f} s")
        try:
            reply = await ensure_async(client.get_shell_msg(timeout=min(left, 5.0)))
        except queue.Empty:
            # Still working: a kernel that died is an error at once, else wait on.
            if not await ensure_async(client.is_alive()):
                raise KernelNoReply(f"{what}: the kernel died") from None
            continue
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            return dict(reply.get("content", {}))


def expression_value(content: dict[str, Any], name: str) -> Any:
    """The value of user expression `name` in an execute reply's content, read back from its
    repr (None when that is not a Python literal); ExpressionFailed when it raised."""
    value = content.get("user_expressions", {}).get(name, {})
    if value.get("status") != "ok":
        raise ExpressionFailed(f"{value.get('ename')}: {value.get('evalue')}")
    try:
        return ast.literal_eval(value.get("data", {}).get("text/plain", "None"))
    except (ValueError, SyntaxError):
        return None
