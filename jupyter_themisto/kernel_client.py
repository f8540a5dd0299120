"""A silent execute sent to a kernel through its jupyter_client client, and the wait for its reply.

The server (loading the recorder into a kernel it could not launch with it) and
`jupyter themisto record` (loading, configuring and asking the recorder) both talk to a kernel
this way. Silent: the kernel fires no run_cell hooks and keeps no history, so nothing of it is
recorded. (The preview backend sends its request on a socket of its own: backends/preview.py.)
"""

from __future__ import annotations

import queue
import time
from typing import Any

from jupyter_core.utils import ensure_async


class KernelNoReply(RuntimeError):
    """The kernel died, or did not answer within the time given."""


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
