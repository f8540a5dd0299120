"""The `preview` output backend: runs the cell in a sandboxed fork of the live kernel.

It asks the person's kernel (only when idle) for `jupyter_themisto.kernel.preview.run_preview`
through a silent execute_request's user_expressions: silent, so nothing is recorded, counted
or shown; the reply carries the child's outputs as JSON. When the preview was stopped (the
cell would write a file, open a connection, start a process, run too long...) the prediction
falls back to the backend named by the `fallback` setting, or says why there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
from jupyter_client.session import Session
from pydantic import Field, ValidationError, field_validator, model_validator

from ..context import PredictionContext, outputs_to_text
from .base import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    NoPrediction,
    OutputChunk,
    Predictor,
)
from .settings import BackendSettings, problems

# How long a cancelled preview is told to stop before it is left to its kernel (seconds).
_CANCEL_SECONDS = 10.0


def _process(kernel: Any) -> Any:
    """The kernel's local process (a Popen), or None when its provisioner has none to show
    (a remote or gateway kernel)."""
    return getattr(getattr(kernel, "provisioner", None), "process", None)


class PreviewSettings(BackendSettings):
    timeout: float = Field(
        50.0,
        gt=0,
        description="seconds the preview may take (wall clock): as long as a long cell runs, but"
        " below the server's prediction_timeout (60 s); a preview is cancelled as soon as its"
        " request is (the cell runs, the client goes away or asks for another prediction)",
    )
    memory_mb: int = Field(
        1024, gt=0, description="memory the preview may take beyond the kernel's, in MB"
    )
    cpu_seconds: int = Field(
        60,
        gt=0,
        description="CPU seconds the preview may use (at least `timeout`: a long cell runs)",
    )
    busy_wait: float = Field(
        1.0,
        ge=0,
        description='seconds to wait for a busy kernel to become idle before answering "kernel'
        ' busy"',
    )
    fallback: str | None = Field(
        None, description="the backend that answers when a preview is stopped (by name)"
    )
    fallback_config: dict[str, Any] | None = Field(
        None,
        description="the fallback's own settings (default: the server's settings and instance"
        " of that backend)",
    )

    @field_validator("fallback")
    @classmethod
    def _not_itself(cls, value: str | None) -> str | None:
        if value == "preview":
            raise ValueError("the fallback backend cannot be preview itself")
        return value or None

    @model_validator(mode="after")
    def _fallback_config_fits(self) -> PreviewSettings:
        # Checked now by the fallback's own model, not when a preview is first stopped.
        if self.fallback and self.fallback_config is not None:
            from .registry import UnknownBackend, load_backend_class

            try:
                model = load_backend_class(self.fallback).settings_model
            except (UnknownBackend, BackendUnavailable):
                return self  # said when the fallback is needed
            if model is not None:
                try:
                    model.model_validate(self.fallback_config)
                except ValidationError as e:
                    raise ValueError(f"fallback_config: {problems(model, e)}") from None
        return self


class PreviewPredictor(Predictor):
    """Previews the cell in a fork of the live kernel (settings: `PreviewSettings`)."""

    name = "preview"
    description = (
        "Runs the cell in an isolated copy-on-write fork of the live kernel (private copy of "
        "the files, no network, nothing shared with the kernel) and shows what it printed."
    )
    tasks = ("output",)
    # The cell runs in the person's kernel as written; the fallback gets the scrubbed context.
    sees_secrets = True
    settings_model = PreviewSettings
    settings: PreviewSettings

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None):
        super().__init__(config, env)
        self._fallback: Predictor | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        # Kernels whose preview is being cancelled (its request went): the kernel is busy with
        # it for a moment more, which a request that superseded it waits out.
        self._ending: set[str] = set()
        #: what the last preview reported (for the host's logs and for tests)
        self.last_reply: dict[str, Any] | None = None
        #: how many previews were cancelled in the kernel (their request was)
        self.cancelled = 0

    # -- kernel access -----------------------------------------------------------------------

    def _kernel(self, kernel_id: str) -> Any:
        km = self.env.kernel_manager
        if km is None:
            raise BackendUnavailable("the preview backend needs a live kernel (no kernel manager)")
        if hasattr(km, "get_kernel"):  # a MappingKernelManager / MultiKernelManager
            try:
                return km.get_kernel(kernel_id)
            except KeyError:
                raise NoPrediction(f"no running kernel {kernel_id!r}") from None
        return km  # a single KernelManager

    @staticmethod
    def _roundtrip(
        info: dict[str, Any],
        content: dict[str, Any],
        timeout: float,
        abandon: threading.Event | None = None,
    ) -> dict:
        """Send one execute_request on a socket of its own and wait for its reply (in a worker
        thread: a plain zmq socket, not the server's asyncio ones, whose un-awaited sends can
        stall); `abandon` set: stop waiting (the request was cancelled and its kernel will not
        answer: restarted or gone)."""
        session = Session(
            key=info["key"], signature_scheme=info["signature_scheme"], username="themisto"
        )
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(f"{info['transport']}://{info['ip']}:{info['shell_port']}")
            msg = session.msg("execute_request", content)
            session.send(sock, msg)
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if abandon is not None and abandon.is_set():
                    raise BackendTimeout("the preview request was abandoned")
                if remaining <= 0:
                    raise BackendTimeout("the kernel did not answer the preview request")
                if not sock.poll(int(min(remaining, 0.5) * 1000)):
                    continue
                _, parts = session.feed_identities(sock.recv_multipart())
                reply = session.deserialize(parts)
                if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    return reply
        finally:
            sock.close()

    @staticmethod
    def _cancel(token: str) -> bool:
        """Tell the kernel's running preview `token` to stop (kernel/preview.py's
        `cancel_preview`: a datagram to an abstract unix socket, which reaches kernels on this
        machine, in the server's network namespace; a remote kernel's preview runs to its
        timeout)."""
        from ..kernel.preview import cancel_preview

        return cancel_preview(token)

    async def _idle_state(self, kernel: Any, wait: float | None = None) -> str:
        """The kernel's execution state, given `busy_wait` (or `wait`) seconds to become idle.
        The server learns the state from the kernel's status messages, which arrive after the
        replies they follow: right after a preview (or a cell) has answered, the state still
        says "busy" for a moment although the kernel is idle."""
        deadline = time.monotonic() + (self.settings.busy_wait if wait is None else wait)
        while True:
            state = getattr(kernel, "execution_state", "idle")
            if state == "idle" or time.monotonic() >= deadline:
                return str(state)
            await asyncio.sleep(0.01)

    @staticmethod
    async def _reply(kernel: Any, work: asyncio.Future[dict]) -> dict:
        """The kernel's reply that `work` waits for; NoPrediction as soon as the kernel's
        process ends or is replaced first (a restart, a shutdown): that kernel will never
        answer, and waiting the preview's whole bound would hold its lock as long."""
        process = _process(kernel)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(work), 0.25)
            except asyncio.TimeoutError:
                if process is not None and (
                    _process(kernel) is not process or process.returncode is not None
                ):
                    raise NoPrediction(
                        "preview cancelled: the kernel restarted or shut down"
                    ) from None

    async def run_preview(self, kernel_id: str, source: str) -> dict[str, Any]:
        """The kernel's preview reply for `source` (see kernel/preview.py for its fields)."""
        kernel = self._kernel(kernel_id)
        state = await self._idle_state(kernel)
        # A preview of ours being cancelled (superseded by this one) keeps the kernel busy
        # until it has answered, within the cancel's own bound (below): waited for, however
        # long a loaded machine takes, rather than refused after busy_wait.
        ending = kernel_id in self._ending
        if state != "idle" and not ending:
            # Never queue behind the person's running cell.
            raise NoPrediction(_not_idle(state))
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        try:
            wait = _CANCEL_SECONDS + 5 if ending else max(self.settings.busy_wait, 0.1)
            await asyncio.wait_for(lock.acquire(), wait)
        except asyncio.TimeoutError:
            raise NoPrediction("kernel busy: another preview is running") from None
        try:
            if ending and (state := await self._idle_state(kernel, _CANCEL_SECONDS)) != "idle":
                raise NoPrediction(_not_idle(state))
            token = secrets.token_hex(16)
            expr = (
                "__import__('jupyter_themisto.kernel.preview', fromlist=['run_preview'])"
                f".run_preview({source!r}, timeout={self.settings.timeout!r}, "
                f"memory_mb={self.settings.memory_mb!r}, "
                f"cpu_seconds={self.settings.cpu_seconds!r}, cancel={token!r})"
            )
            content = {
                "code": "",
                "silent": True,
                "store_history": False,
                "user_expressions": {"preview": expr},
                "allow_stdin": False,
                "stop_on_error": False,
            }
            # The child is killed after `timeout`; the rest is fork, JSON and messaging.
            abandon = threading.Event()
            work = asyncio.ensure_future(
                asyncio.to_thread(
                    self._roundtrip,
                    kernel.get_connection_info(),
                    content,
                    self.settings.timeout + 30,
                    abandon,
                )
            )
            try:
                msg = await self._reply(kernel, work)
            except NoPrediction:
                abandon.set()  # (that kernel will never answer)
                raise
            except asyncio.CancelledError:
                # The request was cancelled: so is the preview in the kernel, which then
                # answers at once; the lock is held until it has (the kernel is idle again).
                # (Sent again until then: the kernel may not have started the preview yet. Still
                # nothing listening after a second: the kernel restarted or went away.)
                self._ending.add(kernel_id)
                began = time.monotonic()
                while not work.done() and time.monotonic() < began + _CANCEL_SECONDS:
                    if not self._cancel(token) and time.monotonic() > began + 1:
                        break
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(asyncio.shield(work), 0.1)
                abandon.set()
                self.cancelled += 1
                raise
        finally:
            self._ending.discard(kernel_id)
            lock.release()
        content = msg["content"]
        if content.get("status") != "ok":
            raise BackendError(f"the kernel refused the preview: {content.get('evalue', '')}")
        result = content.get("user_expressions", {}).get("preview", {})
        if result.get("status") != "ok":
            if result.get("ename") == "KeyboardInterrupt":
                # (the preview ended with the kernel's interrupt: nothing is left running)
                raise NoPrediction("preview cancelled: the kernel was interrupted")
            detail = f"{result.get('ename', 'Error')}: {result.get('evalue', '')}"
            if result.get("ename") in ("ModuleNotFoundError", "ImportError"):
                raise BackendUnavailable(
                    f"jupyter_themisto is not importable in the kernel: {detail}"
                )
            raise BackendError(f"preview failed in the kernel: {detail}")
        reply = result.get("data", {}).get("application/json")
        if not isinstance(reply, dict):
            raise BackendError("the kernel's preview reply is not JSON")
        self.last_reply = reply
        return reply

    # -- prediction --------------------------------------------------------------------------

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        if not ctx.target_source or not ctx.target_source.strip():
            raise NoPrediction("no cell source to preview")
        if not ctx.kernel_id:
            raise NoPrediction("no live kernel to preview in")
        reply = await self.run_preview(ctx.kernel_id, ctx.target_source)
        stopped = reply.get("stopped") or []
        if reply.get("status") == "cancelled":
            raise NoPrediction("preview cancelled")
        meta = {"preview": {k: reply.get(k) for k in ("stopped", "sandbox", "status")}}
        if "cpu_bound" in reply:
            meta["preview"]["cpu_bound"] = reply["cpu_bound"]
        if reply.get("status") != "ok" or stopped:
            from ..kernel.preview import WAITS_FOR_INPUT

            why = (
                "; ".join(f"preview stopped: the cell would {s}" for s in stopped)
                or f"preview {reply.get('status')}: {reply.get('detail', '')}"
            )
            code, details = None, {}
            cpu = reply.get("cpu_bound")
            if WAITS_FOR_INPUT in stopped:
                why = "this cell waits for input; no preview"
                code = "waits_for_input"
            elif isinstance(cpu, int) and len(stopped) == 1:
                # (not the cell's fault: a long computation outlasts the preview's bound)
                unit = "second" if cpu == 1 else "seconds"
                why = (
                    f"the preview used its {cpu} CPU {unit} and was stopped; the real cell may "
                    "take long"
                )
                code, details = "preview_cpu_bound", {"seconds": cpu}
            # (not `why`: the reasons quote what the cell chose, which the person sees; a log
            # line of the server's must be neither forged by a cell nor hold its values)
            told = code or f"{len(stopped) or 'no'} reason(s), told in the answer"
            self.env.log.info("themisto: a preview stopped: %s", told)
            fallback = self._fallback_backend()
            if fallback is None:
                raise NoPrediction(f"{why} (no fallback backend configured)", code, details)
            meta["preview"]["fallback"] = fallback.name
            scrubbed = reply.get("scrubbed_source")
            if isinstance(scrubbed, str):
                # (the kernel knows its secrets before their hashes reach the store)
                ctx = dataclasses.replace(ctx, target_source=scrubbed)
            passed_on = self.env.scrub(ctx) if self.env.scrub is not None else ctx
            async for chunk in fallback.predict_output(passed_on):
                chunk.metadata = {**meta, **chunk.metadata}
                yield chunk
            return
        text = outputs_to_text(reply.get("outputs", []), limit=1 << 20)
        if not text:
            raise NoPrediction("the cell shows no text output")
        meta["outputs"] = reply.get("outputs", [])
        yield OutputChunk(text=text, metadata=meta)

    def _fallback_backend(self) -> Predictor | None:
        if self.settings.fallback is None:
            return None
        if self._fallback is None:
            from .registry import create_backend

            own = self.settings.fallback_config
            if own is None and self.env.lookup is not None:
                # The host's instance: its settings, its loaded model (closed by the host).
                return self.env.lookup(self.settings.fallback)
            self._fallback = create_backend(self.settings.fallback, own, self.env)
        return self._fallback

    async def health(self) -> dict[str, Any]:
        if self.env.kernel_manager is None:
            return {"ok": False, "detail": "needs a live kernel (no kernel manager)"}
        # What this machine offers (the kernel's machine is usually the same one).
        from ..kernel import sandbox

        abi = sandbox.landlock_abi()
        layers = [f"Landlock ABI {abi}" if abi else "Landlock unavailable"]
        layers.append("seccomp" if sandbox.pyseccomp is not None else "seccomp unavailable")
        return {"ok": True, "detail": "ready: isolated fork of the kernel; " + ", ".join(layers)}

    async def aclose(self) -> None:
        if self._fallback is not None:
            await self._fallback.aclose()


def _not_idle(state: str) -> str:
    """Why a kernel that is not idle gets no preview, in the words of its state."""
    if state == "busy":
        return "kernel busy: no preview while a cell runs"
    if state in ("starting", "restarting", "autorestarting"):
        return "kernel busy: no preview while the kernel starts"
    return f"kernel busy ({state}): no preview until it is idle"
