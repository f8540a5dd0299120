"""REST and SSE handlers under /themisto: parse, authorize, call the manager, serialize."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web
from tornado.iostream import StreamClosedError

from ..backends import BackendError, Task, UnknownBackend
from .manager import Event, NotFound, ThemistoManager
from .models import NextCellRequest, OutputRequest, ValidationError, describe_validation_error

AUTH_RESOURCE = "themisto"
# SQLite's integers are signed 64-bit: a larger id, offset or limit is an input error.
MAX_SQL_INT = 2**63 - 1


def parse_int(name: str, raw: str, *, minimum: int = 0) -> int:
    """`raw` as an integer in [minimum, MAX_SQL_INT], else a 400 naming `name`."""
    shown = raw if len(raw) <= 40 else raw[:40] + "…"
    wanted = f"{name}: must be an integer from {minimum} to {MAX_SQL_INT}, got {shown!r}"
    try:
        value = int(raw)
    except ValueError:  # not a number, or more digits than Python converts
        raise web.HTTPError(400, wanted) from None
    if not minimum <= value <= MAX_SQL_INT:
        raise web.HTTPError(400, wanted)
    return value


@contextmanager
def not_found_as_404() -> Iterator[None]:
    """The manager's NotFound (an id naming nothing, an execution not recorded in time) as 404;
    an unknown backend too."""
    try:
        yield
    except (NotFound, UnknownBackend) as e:
        raise web.HTTPError(404, str(e)) from None


@contextmanager
def http_errors() -> Iterator[None]:
    """What may fail before a prediction's first byte, as a plain HTTP error: 404 for what is
    not there, the backend's own status (502/503/504) for its failures."""
    with not_found_as_404():
        try:
            yield
        except BackendError as e:
            raise web.HTTPError(e.status, str(e)) from None


class ThemistoHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def manager(self) -> ThemistoManager:
        return self.settings["themisto_manager"]

    def int_argument(self, name: str, default: int | None, *, minimum: int = 0) -> int | None:
        raw = self.get_query_argument(name, None)
        if raw is None or raw == "":
            return default
        return parse_int(name, raw, minimum=minimum)

    def write_json(self, obj: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj, default=str))


class TrajectoriesHandler(ThemistoHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        rows = await self.manager.list_trajectories(
            self.get_query_argument("notebook_path", None),
            self.int_argument("limit", None),
            self.int_argument("offset", 0) or 0,
            kernel_id=self.get_query_argument("kernel_id", None),
        )
        self.write_json({"trajectories": rows})


class TrajectoryHandler(ThemistoHandler):
    @web.authenticated
    @authorized
    async def get(self, trajectory_id: str) -> None:
        with not_found_as_404():
            self.write_json(await self.manager.get_trajectory(trajectory_id))


class ExecutionsHandler(ThemistoHandler):
    @web.authenticated
    @authorized
    async def get(self, trajectory_id: str) -> None:
        offset, limit = self.int_argument("offset", 0) or 0, self.int_argument("limit", None)
        with not_found_as_404():
            rows, total = await self.manager.list_executions(trajectory_id, offset, limit)
        self.write_json({"executions": rows, "total": total})


class VariablesHandler(ThemistoHandler):
    @web.authenticated
    @authorized
    async def get(self, execution_id: str) -> None:
        eid = parse_int("execution id", execution_id)
        with not_found_as_404():
            self.write_json({"variables": await self.manager.variables(eid)})


class VariableBlobHandler(ThemistoHandler):
    """A variable's serialized value: only on this explicit request, never in a listing."""

    @web.authenticated
    @authorized
    async def get(self, execution_id: str, name: str) -> None:
        eid = parse_int("execution id", execution_id)
        with not_found_as_404():
            data, codec = await self.manager.variable_blob(eid, name)
        self.set_header("X-Themisto-Codec", quote(codec))
        # Any name a kernel allows (non-ASCII, quotes) as an RFC 6266 header value.
        self.set_header(
            "Content-Disposition",
            f"attachment; filename*=UTF-8''{quote(name + '.pickle', safe='')}",
        )
        self.finish(data, set_content_type="application/octet-stream")


class BackendsHandler(ThemistoHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        backends = await self.manager.list_backends()
        self.write_json({"default": self.manager.default_backend, "backends": backends})


class PredictHandler(ThemistoHandler):
    """POST a prediction request; the answer streams as server-sent events."""

    task: Task = "next-cell"
    model: type[NextCellRequest] | type[OutputRequest] = NextCellRequest

    _work: asyncio.Task[None] | None = None
    _streaming = False

    def parse(self) -> NextCellRequest | OutputRequest:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError as e:
            raise web.HTTPError(400, f"body: not valid JSON: {e}") from None
        except RecursionError:
            raise web.HTTPError(400, "body: JSON nested too deeply") from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "body: must be a JSON object")
        try:
            return self.model.model_validate(body)
        except ValidationError as e:
            raise web.HTTPError(400, describe_validation_error(e)) from None

    @web.authenticated
    @authorized
    async def post(self) -> None:
        req = self.parse()
        if isinstance(req, NextCellRequest) and (req.warm or req.stop_ahead):
            with http_errors():
                await (self.manager.stop_ahead if req.stop_ahead else self.manager.warm)(req)
            self.set_status(204)
            self.finish()
            return
        self._work = asyncio.ensure_future(self._predict(req))
        try:
            await self._work
        except asyncio.CancelledError:
            # Superseded by a newer request of the same client, or the client went away.
            if self._client_gone():
                return
            if not self._streaming:
                raise web.HTTPError(409, "superseded by a newer request") from None
            try:
                self.finish(set_content_type="text/event-stream; charset=utf-8")
            except StreamClosedError:
                pass

    def _client_gone(self) -> bool:
        stream = getattr(self.request.connection, "stream", None)
        return stream is None or stream.closed()

    def on_connection_close(self) -> None:
        if self._work is not None and not self._work.done():
            self._work.cancel()

    async def _predict(self, req: NextCellRequest | OutputRequest) -> None:
        manager = self.manager
        key = manager.register(req, self.task)
        try:
            with http_errors():
                meta, events = await manager.open_stream(req, self.task)
            self._streaming = True
            self.set_header("Content-Type", "text/event-stream; charset=utf-8")
            self.set_header("Cache-Control", "no-cache")
            self.set_header("X-Accel-Buffering", "no")
            await self.send(meta)
            try:
                async for event in events:
                    await self.send(event)
            finally:
                await events.aclose()  # type: ignore[attr-defined]
            self.finish(set_content_type="text/event-stream; charset=utf-8")
        finally:
            manager.unregister(key)

    async def send(self, event: Event) -> None:
        if self._client_gone():
            raise asyncio.CancelledError()
        self.write(f"event: {event.name}\ndata: {json.dumps(event.data)}\n\n")
        # The bytes go to the socket now; not awaiting the write saves an event-loop round
        # trip per event. A client that went away is noticed by on_connection_close.
        self.flush().add_done_callback(_consume)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class NextCellHandler(PredictHandler):
    task = "next-cell"
    model = NextCellRequest


class OutputHandler(PredictHandler):
    task = "output"
    model = OutputRequest


_ID = r"([^/]+)"

default_handlers = [
    (r"/themisto/trajectories", TrajectoriesHandler),
    (rf"/themisto/trajectories/{_ID}", TrajectoryHandler),
    (rf"/themisto/trajectories/{_ID}/executions", ExecutionsHandler),
    (rf"/themisto/executions/{_ID}/variables", VariablesHandler),
    (rf"/themisto/executions/{_ID}/variables/{_ID}/blob", VariableBlobHandler),
    (r"/themisto/backends", BackendsHandler),
    (r"/themisto/predict/next-cell", NextCellHandler),
    (r"/themisto/predict/output", OutputHandler),
]
