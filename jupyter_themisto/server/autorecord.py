"""Auto-record: every Python kernel the server starts loads the recorder, kernelspecs untouched.

The server listens to its own kernel-action events (jupyter_server's event bus): when a kernel
starts or restarts, it waits for the kernel to be ready and sends one silent execute request,
`%load_ext jupyter_themisto` (silent, store_history=False: nothing is shown, nothing counts as
an execution, the recorder's own hooks do not fire for it). The kernel finds the store through
THEMISTO_STORE, which the extension puts in the server's environment, and the notebook path
through JPY_SESSION_NAME, which jupyter_server sets for kernels of a session (the server then
rewrites it to the notebook's API path, as the browser knows it).

A notebook opts out with `"themisto": {"record": false}` in its metadata.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jupyter_core.utils import ensure_async

KERNEL_ACTIONS_SCHEMA = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"
LOAD_CODE = "%load_ext jupyter_themisto"


class AutoRecorder:
    """Sends the silent `%load_ext` to each started Python kernel (unless opted out)."""

    def __init__(
        self,
        serverapp: Any,
        *,
        log: logging.Logger,
        ready_timeout: float = 60.0,
        store: Any = None,
    ) -> None:
        self.serverapp = serverapp
        self.store = store
        self.log = log
        self.ready_timeout = ready_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        #: kernel id -> outcome ("loaded", "opted out", "not python", "failed: …"), for tests
        self.outcomes: dict[str, str] = {}

    def attach(self) -> None:
        self.serverapp.event_logger.add_listener(
            schema_id=KERNEL_ACTIONS_SCHEMA, listener=self._on_event
        )

    async def _on_event(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if data.get("status") != "success" or data.get("action") not in ("start", "restart"):
            return
        kernel_id = data.get("kernel_id")
        if not kernel_id:
            return
        task = asyncio.ensure_future(self.enable(kernel_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until every pending enable has finished (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def _notebook_path(self, kernel_id: str) -> str | None:
        sm = getattr(self.serverapp, "session_manager", None)
        if sm is None:
            return None
        # The session row is saved just after its kernel starts; give it a moment.
        for _ in range(20):
            try:
                for s in await ensure_async(sm.list_sessions()):
                    if (s.get("kernel") or {}).get("id") == kernel_id:
                        return s.get("path")
            except Exception:
                return None
            await asyncio.sleep(0.1)
        return None

    async def opted_out(self, path: str | None) -> bool:
        """True when the notebook's metadata says `"themisto": {"record": false}`."""
        if not path or not path.endswith(".ipynb"):
            return False
        try:
            model = await ensure_async(
                self.serverapp.contents_manager.get(path, content=True, type="notebook")
            )
        except Exception:
            return False
        meta = (model.get("content") or {}).get("metadata") or {}
        setting = meta.get("themisto") if isinstance(meta, dict) else None
        return isinstance(setting, dict) and setting.get("record") is False

    def _use_api_path(self, kernel_id: str, path: str | None) -> None:
        # The kernel knows its notebook only as an OS path (JPY_SESSION_NAME); the browser
        # and the REST API name it by its path under the server root.
        if not path or self.store is None:
            return
        t = self.store.latest_trajectory_for_kernel(kernel_id)
        if t is not None and t.get("notebook_path") != path:
            self.store.update_trajectory(t["id"], notebook_path=path)

    async def enable(self, kernel_id: str) -> str:
        try:
            outcome = await self._enable(kernel_id)
        except Exception as e:
            outcome = f"failed: {type(e).__name__}: {e}"
            self.log.warning("themisto: cannot start recording in kernel %s: %s", kernel_id, e)
        self.outcomes[kernel_id] = outcome
        return outcome

    async def _enable(self, kernel_id: str) -> str:
        km = self.serverapp.kernel_manager
        kernel = km.get_kernel(kernel_id)
        spec = getattr(kernel, "kernel_spec", None)
        language = (getattr(spec, "language", "") or "").lower()
        if language != "python":
            return "not python"
        path = await self._notebook_path(kernel_id)
        if await self.opted_out(path):
            self.log.info("themisto: not recording %s (notebook metadata opts out)", path)
            return "opted out"
        client = kernel.client()
        client.start_channels()
        try:
            await ensure_async(client.wait_for_ready(timeout=self.ready_timeout))
            msg_id = client.execute(LOAD_CODE, silent=True, store_history=False, allow_stdin=False)
            while True:
                reply = await ensure_async(client.get_shell_msg(timeout=self.ready_timeout))
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    break
            content = reply.get("content", {})
            if content.get("status") != "ok":
                raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")
        finally:
            client.stop_channels()
        self._use_api_path(kernel_id, path)
        self.log.info("themisto: recording kernel %s (%s)", kernel_id, path or "no notebook")
        return "loaded"
