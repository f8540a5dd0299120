"""Auto-record: every Python kernel the server starts records from its first request.

For an ipykernel kernelspec (its argv runs `ipykernel_launcher` / `ipykernel`), the server adds
`--ext=jupyter_themisto` to the kernel's command line when it launches it, so the recorder is
loaded by the kernel's own start-up, before the kernel reads its first request: cells a
browser sends the instant a kernel starts or restarts ("Restart Kernel and Run All") are
recorded like any other. The arguments are kept by jupyter_client for restarts.

The kernel's environment carries the rest:

- `THEMISTO_STORE`: the server's store (set in the server's environment by the extension);
- `THEMISTO_SERVER_ROOT`: the server's root directory, so that the kernel records its notebook
  by the API path the browser and the REST API use (it learns the notebook's OS path from
  `JPY_SESSION_NAME`, which jupyter_server sets and keeps current across renames);
- `THEMISTO_RECORD=0` for a notebook whose metadata says `"themisto": {"record": false}`: the
  extension is loaded but records nothing and opens no store. The switch is read again before
  every restart (through jupyter_client's public `update_env`).

Other Python kernelspecs (not ipykernel) cannot take the argument; for them the server still
sends one silent `%load_ext jupyter_themisto` once the kernel is ready (cells sent before it
are not recorded).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from jupyter_core.utils import ensure_async

from ..kernel_client import RECORDER, ExpressionFailed, expression_value, silent_execute

KERNEL_ACTIONS_SCHEMA = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"
LOAD_CODE = "%load_ext jupyter_themisto"
# Evaluated after LOAD_CODE: the id of the trajectory the recorder has begun.
TRAJECTORY_EXPRESSION = f"{RECORDER}.trajectory_id"
EXT_ARGUMENT = "--ext=jupyter_themisto"
RECORD_ENV = "THEMISTO_RECORD"
ROOT_ENV = "THEMISTO_SERVER_ROOT"
SESSION_ENV = "JPY_SESSION_NAME"

LOADED_AT_START = "loaded at start"
OPTED_OUT = "opted out"
# A notebook read while a save writes it is half written: read it again, up to about a second.
OPT_OUT_READS = 10
OPT_OUT_READ_PAUSE = 0.1


def runs_ipykernel(argv: list[str]) -> bool:
    """True for a kernelspec command line that starts ipykernel (it takes `--ext`)."""
    return any("ipykernel" in os.path.basename(str(a)) for a in argv)


class AutoRecorder:
    """Makes the kernels the server launches record (unless their notebook opts out)."""

    def __init__(
        self,
        serverapp: Any,
        *,
        log: logging.Logger,
        ready_timeout: float = 60.0,
        manager: Any = None,
    ) -> None:
        self.serverapp = serverapp
        # The extension's ThemistoManager: its store and store threads.
        self.manager = manager
        self.log = log
        self.ready_timeout = ready_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        self._patched: list[tuple[Any, str]] = []
        # Kernels launched with the extension (their restarts keep the argument).
        self._launched: set[str] = set()
        #: kernel id -> outcome ("loaded at start", "opted out", "not python", "loaded",
        #: "failed: …"), for tests and logs
        self.outcomes: dict[str, str] = {}

    # -- wiring ------------------------------------------------------------------------------

    def attach(self) -> None:
        km = self.serverapp.kernel_manager
        start, restart = km.start_kernel, km.restart_kernel
        recorder = self

        async def start_kernel(*args: Any, **kwargs: Any) -> Any:
            outcome = await recorder.prepare_start(kwargs)
            kernel_id = await ensure_async(start(*args, **kwargs))
            if outcome is not None:
                recorder._launched.add(kernel_id)
                recorder.outcomes[kernel_id] = outcome
            return kernel_id

        async def restart_kernel(kernel_id: str, *args: Any, **kwargs: Any) -> Any:
            outcome = await recorder.prepare_restart(kernel_id)
            result = await ensure_async(restart(kernel_id, *args, **kwargs))
            if outcome is not None:
                recorder.outcomes[kernel_id] = outcome
            return result

        # Instance attributes: the kernels handler and the session manager call these.
        km.start_kernel = start_kernel
        km.restart_kernel = restart_kernel
        self._patched = [(km, "start_kernel"), (km, "restart_kernel")]
        self.serverapp.event_logger.add_listener(
            schema_id=KERNEL_ACTIONS_SCHEMA, listener=self._on_event
        )

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for obj, name in self._patched:
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._patched = []

    async def wait(self) -> None:
        """Until every pending late load has finished (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- launch arguments --------------------------------------------------------------------

    def _spec(self, kernel_name: str | None) -> Any:
        km = self.serverapp.kernel_manager
        name = kernel_name or getattr(km, "default_kernel_name", None)
        try:
            return km.kernel_spec_manager.get_kernel_spec(name)
        except Exception:
            return None

    def api_path(self, os_path: str | None) -> str | None:
        """The API path (relative to the server root, '/'-separated) of a notebook's OS path."""
        if not os_path:
            return None
        root = os.path.abspath(self.serverapp.root_dir)
        full = os.path.abspath(os_path)
        try:
            rel = os.path.relpath(full, root)
        except ValueError:
            return None
        if rel.startswith(os.pardir):
            return None
        return rel.replace(os.sep, "/")

    async def prepare_start(self, kwargs: dict[str, Any]) -> str | None:
        """Add the recorder to a kernel's launch arguments and environment.

        Returns the outcome to note once the kernel id is known, or None when the kernel is
        left to the late load (a Python kernel that is not ipykernel) or not recorded at all.
        """
        spec = self._spec(kwargs.get("kernel_name"))
        language = (getattr(spec, "language", "") or "").lower()
        if language != "python" or not runs_ipykernel(list(getattr(spec, "argv", []) or [])):
            return None
        env = dict(kwargs.get("env") or os.environ)
        path = self.api_path(env.get(SESSION_ENV))
        opted_out = await self.opted_out(path)
        env[RECORD_ENV] = "0" if opted_out else "1"
        env[ROOT_ENV] = os.path.abspath(self.serverapp.root_dir)
        kwargs["env"] = env
        extra = list(kwargs.get("extra_arguments") or [])
        if EXT_ARGUMENT not in extra:
            extra.append(EXT_ARGUMENT)
        kwargs["extra_arguments"] = extra
        if opted_out:
            self.log.info("themisto: not recording %s (notebook metadata opts out)", path)
            return OPTED_OUT
        return LOADED_AT_START

    async def prepare_restart(self, kernel_id: str) -> str | None:
        """Read the notebook's switch again: a restart is a new start."""
        km = self.serverapp.kernel_manager
        try:
            kernel = km.get_kernel(kernel_id)
        except Exception:
            return None
        if kernel_id not in self._launched:
            return None  # not started with the extension: the late load follows the event
        path = await self._notebook_path(kernel_id, attempts=1)
        opted_out = await self.opted_out(path)
        try:
            kernel.update_env(env={RECORD_ENV: "0" if opted_out else "1"})
        except Exception as e:
            self.log.warning("themisto: cannot update kernel %s's environment: %s", kernel_id, e)
        return OPTED_OUT if opted_out else LOADED_AT_START

    # -- the notebook's switch ---------------------------------------------------------------

    async def _notebook_path(self, kernel_id: str, attempts: int = 20) -> str | None:
        sm = getattr(self.serverapp, "session_manager", None)
        if sm is None:
            return None
        # The session row is saved just after its kernel starts; give it a moment.
        for attempt in range(attempts):
            try:
                for s in await ensure_async(sm.list_sessions()):
                    if (s.get("kernel") or {}).get("id") == kernel_id:
                        return s.get("path")
            except Exception:
                return None
            if attempt + 1 < attempts:
                await asyncio.sleep(0.1)
        return None

    async def opted_out(self, path: str | None) -> bool:
        """True when the notebook's metadata says `"themisto": {"record": false}`.

        The notebook is read as a text file, not as a notebook: jupyter_server's notebook read
        (2.21), landing while a save writes the file, finds it unreadable, moves it aside and
        puts the save's backup in its place; when the save ends between those two moves, the
        notebook is gone (and a kernel can start or restart while an autosave writes). A read
        that finds the file half written reads again."""
        if not path or not path.endswith(".ipynb"):
            return False
        notebook: Any = None
        for attempt in range(OPT_OUT_READS):
            try:
                model = await ensure_async(
                    self.serverapp.contents_manager.get(
                        path, content=True, type="file", format="text"
                    )
                )
                notebook = await asyncio.to_thread(json.loads, model.get("content") or "")
                break
            except ValueError:
                if attempt + 1 < OPT_OUT_READS:
                    await asyncio.sleep(OPT_OUT_READ_PAUSE)
            except Exception:
                return False
        meta = notebook.get("metadata") if isinstance(notebook, dict) else None
        setting = meta.get("themisto") if isinstance(meta, dict) else None
        return isinstance(setting, dict) and setting.get("record") is False

    # -- the late load (Python kernels that are not ipykernel) -------------------------------

    async def _on_event(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if data.get("status") != "success" or data.get("action") not in ("start", "restart"):
            return
        kernel_id = data.get("kernel_id")
        if not kernel_id:
            return
        try:
            spec = self.serverapp.kernel_manager.get_kernel(kernel_id).kernel_spec
        except Exception:
            spec = None
        if runs_ipykernel(list(getattr(spec, "argv", []) or [])):
            return  # launched with the extension (prepare_start)
        task = asyncio.ensure_future(self.enable(kernel_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _use_api_path(self, trajectory_id: str | None, path: str | None) -> None:
        """A late-loaded kernel knows its notebook only as an OS path (JPY_SESSION_NAME): name
        its trajectory by the API path once the kernel's writer thread has written it. The
        store calls run in the manager's store threads (SQLite blocks; the event loop goes on)."""
        manager = self.manager
        if not path or not trajectory_id or manager is None:
            return
        deadline = time.monotonic() + self.ready_timeout
        while (
            t := await manager.in_store_thread(manager.store.get_trajectory, trajectory_id)
        ) is None:
            if time.monotonic() > deadline:
                self.log.warning("themisto: trajectory %s was never written", trajectory_id)
                return
            await asyncio.sleep(0.05)
        if t.get("notebook_path") != path:
            await manager.in_store_thread(
                manager.store.update_trajectory, trajectory_id, notebook_path=path
            )

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
            return OPTED_OUT
        client = kernel.client()
        client.start_channels()
        try:
            await ensure_async(client.wait_for_ready(timeout=self.ready_timeout))
            content = await silent_execute(
                client,
                LOAD_CODE,
                timeout=self.ready_timeout,
                what="loading the recorder",
                allow_stdin=False,
                user_expressions={"trajectory": TRAJECTORY_EXPRESSION},
            )
            if content.get("status") != "ok":
                raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")
        finally:
            client.stop_channels()
        try:
            trajectory_id = expression_value(content, "trajectory")
        except ExpressionFailed:
            trajectory_id = None
        await self._use_api_path(trajectory_id, path)
        self.log.info("themisto: recording kernel %s (%s), loaded late", kernel_id, path)
        return "loaded"
