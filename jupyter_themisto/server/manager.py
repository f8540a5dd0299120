"""ThemistoManager: the server's logic (store queries, backends, prediction streams), no HTTP."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..backends import (
    BackendEnv,
    BackendError,
    BackendTimeout,
    NoPrediction,
    Predictor,
    Task,
    UnknownBackend,
    available_backends,
    check_backend_settings,
    create_backend,
    load_backend_class,
    settings_schema,
)
from ..backends._text import degenerate_reason
from ..context import (
    DEFAULT_MAX_OUTPUT_CHARS,
    DEFAULT_TOKEN_BUDGET,
    ContextCell,
    PredictionContext,
    build_context,
    runtime_lag,
)
from ..redaction import StoreRedactor, redact_variable
from ..references import reference_pickle
from ..store import TrajectoryStore
from .early import with_early_answer
from .models import NextCellRequest, OutputRequest

T = TypeVar("T")

#: threads that run the store's (blocking SQLite) calls; each keeps its own connection
STORE_THREADS = 4
#: how often a request waiting for an execution to be recorded looks at the store again
EXECUTION_POLL = 0.02


class NotFound(LookupError):
    """An id in the request names nothing: served as 404."""


class NotRecorded(NotFound):
    """The execution a request follows is not recorded (within `execution_wait`, or never:
    recording is paused): 404."""


@dataclass
class Event:
    """One server-sent event of a prediction stream."""

    name: str
    data: dict[str, Any]


class ThemistoManager:
    """Everything the handlers need, testable without a server."""

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        default_backend: str = "retrieval",
        backend_settings: dict[str, dict[str, Any]] | None = None,
        kernel_manager: Any = None,
        log: logging.Logger | None = None,
        prediction_timeout: float = 60.0,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_page: int = 1000,
        snapshot_wait: float = 2.0,
        execution_wait: float = 5.0,
        early_answer: float = 0.05,
        allow_unfollowed_secrets: bool = False,
    ) -> None:
        self.store = store
        self.default_backend = default_backend
        self.backend_settings = dict(backend_settings or {})
        self.kernel_manager = kernel_manager
        self.log = log or logging.getLogger("jupyter_themisto")
        self.prediction_timeout = prediction_timeout
        self.token_budget = token_budget
        self.max_output_chars = max_output_chars
        self.max_page = max_page
        self.snapshot_wait = snapshot_wait
        self.execution_wait = execution_wait
        self.early_answer = early_answer
        self.allow_unfollowed_secrets = allow_unfollowed_secrets
        # SQLite calls block: they run here, off the event loop, so that a slow or locked store
        # delays the request that reads it and never the rest of the server.
        self._store_threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="themisto-store")
        self._backends: dict[str, Predictor] = {}
        # The secrets policy for everything that leaves the store (answers and contexts).
        self.redactor = StoreRedactor(store, warn=lambda why: self.log.warning("themisto: %s", why))
        self._active: dict[tuple[str, ...], asyncio.Task[Any]] = {}
        #: how many prediction streams ended by cancellation (disconnect or supersede)
        self.cancelled = 0
        self.superseded = 0

    # -- store queries (each runs in the store threads: see `in_store_thread`) ---------------

    async def in_store_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in one of the manager's store threads (jupyter_server's habit
        for blocking calls): the event loop goes on serving while SQLite works or waits."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._store_threads, functools.partial(fn, *args, **kwargs)
        )

    async def list_trajectories(
        self,
        notebook_path: str | None,
        limit: int | None,
        offset: int,
        kernel_id: str | None = None,
    ) -> list[dict[str, Any]]:
        limit = self.max_page if limit is None else min(limit, self.max_page)
        return await self.in_store_thread(
            self.store.list_trajectories,
            notebook_path=notebook_path,
            kernel_id=kernel_id,
            limit=limit,
            offset=offset,
        )

    async def get_trajectory(self, trajectory_id: str) -> dict[str, Any]:
        return await self.in_store_thread(self._trajectory, trajectory_id)

    def _trajectory(self, trajectory_id: str) -> dict[str, Any]:
        t = self.store.get_trajectory(trajectory_id)
        if t is None:
            raise NotFound(f"no trajectory {trajectory_id!r}")
        return t

    async def list_executions(
        self, trajectory_id: str, offset: int, limit: int | None
    ) -> tuple[list[dict[str, Any]], int]:
        limit = self.max_page if limit is None else min(limit, self.max_page)
        return await self.in_store_thread(self._executions, trajectory_id, offset, limit)

    def _executions(
        self, trajectory_id: str, offset: int, limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        t = self._trajectory(trajectory_id)
        rows = self.store.list_executions(t["id"], offset=offset, limit=limit)
        self.redactor.refresh()
        return [self.redactor.scrub_execution(r) for r in rows], t["n_executions"]

    async def variables(self, execution_id: int) -> list[dict[str, Any]]:
        return await self.in_store_thread(self._variables, execution_id)

    def _variables(self, execution_id: int) -> list[dict[str, Any]]:
        if self.store.get_execution(execution_id) is None:
            raise NotFound(f"no execution {execution_id}")
        out = []
        self.redactor.refresh()
        for v in self.store.get_variables(execution_id):
            # Redacted again here: a store written under a narrower policy must not leak.
            v = self.redactor.scrub_variable(v)
            out.append(
                {
                    "name": v["name"],
                    "type": v["type"],
                    "size": v.get("size"),
                    "summary": v.get("summary") or {},
                    "changed": v.get("changed", True),
                    "stub_reason": v.get("stub_reason"),
                }
            )
        return out

    async def variable_blob(self, execution_id: int, name: str) -> tuple[bytes, str]:
        """A variable's serialized value (pickle/dill bytes) and its codec, on explicit request.

        Secret-named variables have none, whatever an older store may hold.
        """
        return await self.in_store_thread(self._variable_blob, execution_id, name)

    def _variable_blob(self, execution_id: int, name: str) -> tuple[bytes, str]:
        if self.store.get_execution(execution_id) is None:
            raise NotFound(f"no execution {execution_id}")
        for v in self.store.get_variables(execution_id):
            if v["name"] != name:
                continue
            self.redactor.refresh()
            v = self.redactor.scrub_variable(v)
            ref = (v.get("summary") or {}).get("ref")
            if not v.get("blob_hash") and ref and not v.get("stub_reason"):
                # A library's function or class: pickle bytes that import it again, refusing
                # another version or another object under that name (references.py).
                return reference_pickle(v["summary"]), "reference"
            if not v.get("blob_hash"):
                reason = v.get("stub_reason") or "not serialized"
                raise NotFound(f"variable {name!r} has no stored value ({reason})")
            codec = str((v.get("summary") or {}).get("codec") or "pickle")
            data = self.store.get_blob(v["blob_hash"])
            if self.redactor.blob_holds_secret(data):
                raise NotFound(f"variable {name!r} has no stored value (redacted: holds a secret)")
            return data, codec
        raise NotFound(f"no variable {name!r} in the snapshot of execution {execution_id}")

    # -- backends ----------------------------------------------------------------------------

    def backend(self, name: str | None) -> Predictor:
        """The (cached) backend instance; UnknownBackend / BackendUnavailable otherwise."""
        name = name or self.default_backend
        if name not in self._backends:
            env = BackendEnv(
                store=self.store,
                kernel_manager=self.kernel_manager,
                log=self.log,
                scrub=self.redactor.scrub_context,
                lookup=self.backend,
                unfollowed=self.unfollowed_secrets,
            )
            self._backends[name] = create_backend(name, self.backend_settings.get(name), env)
        return self._backends[name]

    def unfollowed_secrets(self) -> str | None:
        """Why values the store knows to be secret cannot be followed into a context now (as of
        the redactor's last refresh, which each context's scrub does), unless allowed anyway:
        backends that send contexts over the network refuse meanwhile (BackendEnv.unfollowed)."""
        problem = self.redactor.problem
        if problem is None or self.allow_unfollowed_secrets:
            return None
        return f"the trajectory store {self.store.path}: {problem}"

    def check_settings(self) -> list[str]:
        """What is wrong with `backend_settings` (said in the log as the server starts; a
        backend whose settings are refused answers each request with the same message)."""
        return check_backend_settings(self.backend_settings)

    async def list_backends(self) -> list[dict[str, Any]]:
        out = []
        installed = available_backends()
        for name in sorted(installed):
            entry: dict[str, Any] = {"name": name, "description": "", "tasks": []}
            try:
                # The settings' JSON schema, from the class: served even when the backend
                # cannot be made (e.g. with refused settings, which the schema helps to fix).
                entry["settings_schema"] = settings_schema(load_backend_class(name, installed))
                b = self.backend(name)
                entry["description"] = b.description
                entry["tasks"] = list(b.tasks)
                try:
                    health = await asyncio.wait_for(b.health(), timeout=5)
                except asyncio.TimeoutError:
                    health = {"ok": False, "detail": "health check timed out"}
                entry["health"] = {"ok": bool(health.get("ok")), "detail": health.get("detail", "")}
            except Exception as e:  # a broken third-party backend must not hide the others
                entry["health"] = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
            out.append(entry)
        return out

    def preload_default(self) -> None:
        """Start loading the default backend's model in the background, if it runs one in this
        process, so that the first suggestion does not wait for it."""
        try:
            backend = self.backend(None)
        except Exception as e:  # the first request will say what is wrong
            self.log.warning("themisto: default backend %s: %s", self.default_backend, e)
            return
        preload = getattr(backend, "preload", None)
        if callable(preload):
            preload()

    async def close(self) -> None:
        for task in list(self._active.values()):
            task.cancel()
        for b in self._backends.values():
            try:
                await b.aclose()
            except Exception as e:
                self.log.warning("themisto: closing backend %s failed: %s", b.name, e)
        self._backends.clear()
        # A call still in SQLite finishes on its own; nothing new starts.
        self._store_threads.shutdown(wait=False, cancel_futures=True)

    # -- prediction --------------------------------------------------------------------------

    def resolve(self, req: NextCellRequest | OutputRequest) -> dict[str, Any]:
        """The trajectory a request is about: trajectory_id, else the kernel's latest one,
        else the notebook's latest one. (Blocking: called in a store thread.)"""
        if req.trajectory_id:
            return self._trajectory(req.trajectory_id)
        if req.kernel_id:
            t = self.store.latest_trajectory_for_kernel(req.kernel_id)
            if t is None:
                raise NotFound(
                    f"no trajectory recorded for kernel {req.kernel_id!r} (is recording on for"
                    " this notebook?)"
                )
            return t
        found = self.store.list_trajectories(notebook_path=req.notebook_path, limit=1)
        if not found:
            raise NotFound(f"no trajectory recorded for notebook {req.notebook_path!r}")
        return found[0]

    def _resolve_after(
        self, req: NextCellRequest | OutputRequest
    ) -> tuple[dict[str, Any], int | None]:
        """`resolve`, and the newest execution count recorded in it if the request waits for
        one; the trajectory read again once that count is there (so its length includes it)."""
        trajectory = self.resolve(req)
        wanted = req.after_execution_count
        if wanted is None:
            return trajectory, None
        last = self.store.last_execution_count(trajectory["id"])
        if last is not None and last >= wanted:
            trajectory = self.store.get_trajectory(trajectory["id"]) or trajectory
        return trajectory, last

    async def trajectory_for(
        self, req: NextCellRequest | OutputRequest, task: Task
    ) -> dict[str, Any] | None:
        """The request's trajectory (see `resolve`) once it holds the execution the request
        follows (`after_execution_count`: the recorder writes it as the cell ends, at times a
        moment after the browser hears the kernel's reply), waiting up to `execution_wait`
        seconds for it; then NotRecorded. None when nothing is recorded (the kernel does not
        record) but the cells the browser sent still say what comes next (next cell only)."""
        deadline = time.monotonic() + self.execution_wait
        while True:
            try:
                trajectory, last = await self.in_store_thread(self._resolve_after, req)
            except NotFound:
                if task != "next-cell" or not _sent_code(req):
                    raise
                return None
            wanted = req.after_execution_count
            if wanted is None or (last is not None and last >= wanted):
                return trajectory
            of = (
                f"kernel {req.kernel_id!r}" if req.kernel_id else f"trajectory {trajectory['id']!r}"
            )
            latest = "nothing" if last is None else f"execution {last}"
            # The recorder's own notes (`%themisto off`/`on`): what will never come is not
            # waited for.
            after = trajectory.get("paused_after")
            if trajectory.get("paused_at") is not None and (after is None or wanted > after):
                raise NotRecorded(
                    f"recording is paused in {of} (%themisto off; %themisto on resumes it): "
                    f"execution {wanted} is not recorded (the latest recorded is {latest})"
                )
            through = trajectory.get("unrecorded_through")
            if through is not None and wanted <= through:
                raise NotRecorded(
                    f"execution {wanted} of {of} ran while recording was paused and is not "
                    f"recorded (the latest recorded is {latest})"
                )
            if time.monotonic() >= deadline:
                raise NotRecorded(
                    f"execution {wanted} of {of} was not recorded within {self.execution_wait:g} s"
                    f" (the latest recorded is {latest}; ThemistoExtensionApp.execution_wait):"
                    " is recording paused (%themisto on resumes it)?"
                )
            await asyncio.sleep(EXECUTION_POLL)

    def browser_context(self, req: NextCellRequest | OutputRequest) -> PredictionContext:
        """A context from the cells the browser sent, for a notebook nothing is recorded of yet
        (recording off, or a new user's first cells): its code cells as if run in order."""
        cells = [c.model_dump() for c in req.cells or []]
        code = [c for c in cells if c["cell_type"] == "code" and c["source"].strip()]
        rows = [
            {
                "source": c["source"],
                "order_index": i,
                "cell_id": c.get("id"),
                "status": "ok",
                "outputs": [],
            }
            for i, c in enumerate(code)
        ]
        below = req.cells_below
        return build_context(
            rows,
            [],
            with_runtime=False,
            target_source=getattr(req, "source", None),
            notebook_cells=cells,
            cells_below=[c.model_dump() for c in below] if below else None,
            token_budget=self.token_budget,
            max_output_chars=self.max_output_chars,
            notebook_path=req.notebook_path,
            kernel_id=req.kernel_id,
        )

    def context(
        self, req: NextCellRequest | OutputRequest, trajectory: dict[str, Any]
    ) -> PredictionContext:
        tid = trajectory["id"]
        n = trajectory.get("n_executions") or 0
        variables: list[dict[str, Any]] = []
        changes: dict[str, int] = {}
        if req.with_runtime:
            variables = [redact_variable(v) for v in self.store.latest_variables(tid)]
            changes = self.store.variable_changes(tid)
        cells = [c.model_dump() for c in req.cells] if req.cells else None
        below = [c.model_dump() for c in req.cells_below] if req.cells_below else None
        # Only the tail fits in the budget: read a little, and more only while all of it fits,
        # so that a request costs the same however long the trajectory is.
        tail = 48
        while True:
            rows = self.store.list_executions(tid, offset=max(0, n - tail))
            ctx = build_context(
                rows,
                variables,
                with_runtime=req.with_runtime,
                target_source=getattr(req, "source", None),
                notebook_cells=cells,
                cells_below=below,
                variable_changes=changes,
                token_budget=self.token_budget,
                max_output_chars=self.max_output_chars,
                notebook_path=req.notebook_path or trajectory.get("notebook_path"),
                trajectory_id=tid,
                kernel_id=req.kernel_id or trajectory.get("kernel_id"),
            )
            used = sum(1 for c in ctx.cells if c.cell_type == "code")
            if tail >= n or used < len(rows):
                break
            tail *= 4
        if req.with_runtime:
            # No snapshot in the tail: the summary (if any) is older than all of it.
            ctx.runtime_lag = runtime_lag(rows)
        return ctx

    async def wait_for_snapshot(self, trajectory: dict[str, Any]) -> None:
        """Give the latest execution's snapshot (written by a child process just after the
        cell) up to `snapshot_wait` seconds, so that a prediction sees the current state."""
        n = trajectory.get("n_executions") or 0
        deadline = time.monotonic() + self.snapshot_wait
        swept = False
        while n and time.monotonic() < deadline:
            last = await self.in_store_thread(
                self.store.list_executions, trajectory["id"], offset=n - 1, limit=1
            )
            if not last or last[0].get("snapshot_status") != "pending":
                return
            if not swept:
                # Left pending by a kernel or snapshot process that died, it would stay so:
                # marked failed instead of waited for (store/processes.py).
                swept = True
                try:
                    if self.store.sweep_pending_snapshots(trajectory["id"]):
                        continue
                except Exception as e:
                    self.log.warning("themisto: sweeping pending snapshots failed: %s", e)
            await asyncio.sleep(0.05)

    def _prediction_context(
        self,
        req: NextCellRequest | OutputRequest,
        trajectory: dict[str, Any] | None,
        scrub: bool,
    ) -> PredictionContext:
        """The context of a request (its trajectory's, else the browser's cells), scrubbed
        unless the backend may see secrets. (Blocking: called in a store thread.)"""
        ctx = self.browser_context(req) if trajectory is None else self.context(req, trajectory)
        # The one door to every backend: nothing secret passes it (values, literals, keys),
        # except into the person's own kernel (the preview runs the cell as it really reads).
        return self.redactor.scrub_context(ctx) if scrub else ctx

    def _supersede_key(self, req: NextCellRequest | OutputRequest, task: Task) -> tuple[str, ...]:
        target = req.kernel_id or req.notebook_path or req.trajectory_id or ""
        return (req.client_id or "", target, task)

    def register(self, req: NextCellRequest | OutputRequest, task: Task) -> tuple[str, ...] | None:
        """Make the current asyncio task the live request of its client; cancel an older one."""
        if not req.client_id:
            return None
        key = self._supersede_key(req, task)
        current = asyncio.current_task()
        older = self._active.get(key)
        if older is not None and older is not current and not older.done():
            self.superseded += 1
            older.cancel()
        if current is not None:
            self._active[key] = current
        return key

    def unregister(self, key: tuple[str, ...] | None) -> None:
        if key is not None and self._active.get(key) is asyncio.current_task():
            del self._active[key]

    async def warm(self, req: NextCellRequest) -> None:
        """Let the backend prepare the next-cell prediction for `req` (evaluate its prompt into
        the model's cache) without answering it; backends with nothing to prepare do nothing."""
        name = req.backend or self.default_backend
        backend = self.backend(name)
        warm = getattr(backend, "warm", None)
        if not callable(warm):
            return
        try:
            trajectory = await self.trajectory_for(req, "next-cell")
        except NotRecorded:
            raise
        except NotFound:
            return  # nothing to prepare from
        ctx = await self.in_store_thread(self._warm_context, req, trajectory)
        try:
            await asyncio.wait_for(warm(ctx, ahead=req.ahead), self.prediction_timeout)
        except asyncio.TimeoutError:
            self.log.info(
                "themisto: warming %s took longer than %g s", name, self.prediction_timeout
            )

    async def stop_ahead(self, req: NextCellRequest) -> None:
        """Stop what the backend is writing ahead (`answer_ahead`); backends that write
        nothing ahead do nothing."""
        stop = getattr(self.backend(req.backend or self.default_backend), "stop_ahead", None)
        if callable(stop):
            stop()

    def _warm_context(
        self, req: NextCellRequest, trajectory: dict[str, Any] | None
    ) -> PredictionContext:
        ctx = self._prediction_context(req, trajectory, scrub=False)
        # Asked as a cell starts running: it is not recorded yet, but its source is known (the
        # last code cell the browser sent), and it is what the next prompt goes on from.
        sent = [c.source for c in req.cells or [] if c.cell_type == "code" and c.source.strip()]
        recorded = [c.source for c in ctx.cells if c.cell_type == "code"]
        if sent and (not recorded or recorded[-1] != sent[-1]):
            # Numbered as its execution will be, so that the prompt's window starts where the
            # prediction's will.
            last = max((c.order_index for c in ctx.cells if c.order_index is not None), default=-1)
            ctx.cells.append(ContextCell(source=sent[-1], order_index=last + 1))
        # Scrubbed as at the door of open_stream: the backend's cache then holds the very
        # prompt the prediction will send, and never a secret.
        return self.redactor.scrub_context(ctx)

    async def open_stream(
        self, req: NextCellRequest | OutputRequest, task: Task
    ) -> tuple[Event, AsyncIterator[Event]]:
        """Validate and start a prediction; returns the meta event and the rest of the stream.

        Raises NotFound, UnknownBackend, BackendError (incl. BackendTimeout/Unavailable) when
        the failure comes before the first chunk, so that it can be a plain HTTP error.
        """
        trajectory = await self.trajectory_for(req, task)
        name = req.backend or self.default_backend
        backend = self.backend(name)
        if task not in backend.tasks:
            raise NotFound(f"the {name} backend does not serve {task} predictions")
        if trajectory is not None and req.with_runtime and task == "output":
            await self.wait_for_snapshot(trajectory)
        ctx = await self.in_store_thread(
            self._prediction_context, req, trajectory, not backend.sees_secrets
        )
        started = time.perf_counter()
        deadline = started + self.prediction_timeout
        agen: Any  # an async generator of NextCellChunk or OutputChunk
        if isinstance(req, NextCellRequest):
            agen = backend.predict_next_cell(ctx, n=req.n)
            if self.early_answer > 0 and name != "retrieval":
                ahead = getattr(backend, "answer_ahead", None)
                written = ahead(ctx) if callable(ahead) else None
                # (an answer written ahead is the model's own: shown at once, not after a wait)
                after = 0.0 if written else self.early_answer
                agen = with_early_answer(
                    agen, functools.partial(self._early_answer, written, ctx), after
                )
        else:
            agen = backend.predict_output(ctx)
        meta = Event("meta", {"backend": name})
        first: Event | None = None
        try:
            first = await self._next(agen, deadline, task)
        except NoPrediction as e:
            first = Event("no_prediction", e.event_data())
        except asyncio.CancelledError:
            self.cancelled += 1
            await agen.aclose()
            raise
        except BaseException:
            await agen.aclose()
            raise
        return meta, self._rest(agen, first, deadline, task, name, started)

    async def _early_answer(
        self, written: str | None, ctx: PredictionContext
    ) -> tuple[str, str] | None:
        """The early answer and where it is from: `written`, the model's own suggestion
        written ahead for the cell just run (`answer_ahead`, before its outputs existed), else
        the first cell the `retrieval` backend suggests that is worth showing (not the cell
        just run again, not only comments); or None."""
        if written:
            return written, "ahead"
        previous = ctx.previous_code()
        try:
            found = [c.text async for c in self.backend("retrieval").predict_next_cell(ctx, n=3)]
        except Exception as e:  # noqa: BLE001 - the model answers all the same
            self.log.debug("themisto: no early answer: %s", e)
            return None
        text = next((t for t in found if t and degenerate_reason(t, previous) is None), None)
        return (text, "retrieved") if text is not None else None

    async def _next(self, agen: Any, deadline: float, task: Task) -> Event | None:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise BackendTimeout(f"the prediction took longer than {self.prediction_timeout:g} s")
        # The deadline cancels this very task rather than wrapping the step in wait_for: a
        # backend's HTTP stream must be entered and left in one task (anyio cancel scopes).
        current = asyncio.current_task()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            if current is not None:
                current.cancel()

        handle = asyncio.get_running_loop().call_later(remaining, expire)
        try:
            chunk = await agen.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if not expired:
                raise
            if current is not None and hasattr(current, "uncancel"):
                current.uncancel()
            raise BackendTimeout(
                f"the prediction took longer than {self.prediction_timeout:g} s"
                " (ThemistoExtensionApp.prediction_timeout)"
            ) from None
        finally:
            handle.cancel()
        if task == "next-cell":
            data: dict[str, Any] = {"index": chunk.index, "text": chunk.text, "done": chunk.done}
            if chunk.score is not None:
                data["score"] = chunk.score
            if chunk.replace:
                data["replace"] = True
            return Event("chunk", data)
        data = {"text": chunk.text}
        if chunk.metadata:
            # e.g. what a preview was stopped by, its sandbox, the backend that stood in
            data["metadata"] = chunk.metadata
        return Event("chunk", data)

    async def _rest(
        self,
        agen: Any,
        first: Event | None,
        deadline: float,
        task: Task,
        name: str,
        started: float,
    ) -> AsyncIterator[Event]:
        try:
            event = first
            while event is not None:
                yield event
                if event.name == "no_prediction":
                    break
                try:
                    event = await self._next(agen, deadline, task)
                except NoPrediction as e:
                    event = Event("no_prediction", e.event_data())
                except BackendError as e:
                    yield Event("error", {"status": e.status, "message": str(e)})
                    break
                except Exception as e:
                    self.log.exception("themisto: backend %s failed", name)
                    yield Event("error", {"status": 502, "message": f"{name}: {e}"})
                    break
            yield Event(
                "done",
                {"backend": name, "elapsed_ms": round((time.perf_counter() - started) * 1000, 2)},
            )
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            await agen.aclose()


def _sent_code(req: NextCellRequest | OutputRequest) -> bool:
    """Whether the browser sent any code cell with text (a context even with nothing recorded)."""
    return any(c.cell_type == "code" and c.source.strip() for c in req.cells or [])


__all__ = [
    "BackendError",
    "Event",
    "NotFound",
    "NotRecorded",
    "ThemistoManager",
    "UnknownBackend",
]
