"""A real ipykernel with the recorder loaded, driven through the Jupyter protocol (test helper).

Holds no tests itself: the recorder's test modules import it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from jupyter_themisto.store import TrajectoryStore

from .helpers import execute_content

NOTEBOOK = "analysis/notebook.ipynb"
SETTLE = (
    "__import__('jupyter_themisto.kernel', fromlist=['get_recorder']).get_recorder().settle(60)"
)


@dataclass
class Executed:
    msg_id: str
    reply: dict[str, Any]
    outputs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [c for t, c in self.outputs if t == kind]


class RecordingKernel:
    """A kernel started with `--ext=jupyter_themisto`, writing to its own store file."""

    def __init__(
        self, store_path: Path, extra_arguments: list[str] | None = None, **launch: Any
    ) -> None:
        self.store_path = store_path
        env = dict(os.environ)
        env["THEMISTO_STORE"] = str(store_path)
        env["THEMISTO_NOTEBOOK_PATH"] = NOTEBOOK
        env.pop("JPY_SESSION_NAME", None)
        # ipykernel turns off its fd-level output capture under pytest; a real kernel has it.
        env.pop("PYTEST_CURRENT_TEST", None)
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(
            env=env,
            extra_arguments=["--ext=jupyter_themisto", *(extra_arguments or [])],
            **launch,  # (e.g. stderr: the kernel's log)
        )
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=90)

    def send(self, code: str, cell_id: str | None = None) -> str:
        msg = self.kc.session.msg("execute_request", execute_content(code))
        if cell_id is not None:
            msg["metadata"]["cellId"] = cell_id
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def collect(self, msg_id: str, timeout: float = 90) -> Executed:
        outputs: list[tuple[str, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "status" and msg["content"]["execution_state"] == "idle":
                break
            if kind in ("stream", "display_data", "update_display_data", "execute_result", "error"):
                outputs.append((kind, msg["content"]))
        while True:
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return Executed(msg_id, reply["content"], outputs)

    def run(self, code: str, cell_id: str | None = None, timeout: float = 90) -> Executed:
        return self.collect(self.send(code, cell_id), timeout)

    def store(self) -> TrajectoryStore:
        return TrajectoryStore(self.store_path, readonly=True)

    def settle(self) -> None:
        """Wait until the recorder has written what it deferred past the last reply.

        The recorder hands each execution to its writer thread just after the kernel replies
        and snapshots a moment later; a silent request (which the recorder does not record)
        takes a snapshot still due first, and `settle()` waits for the writer.
        """
        msg_id = self.kc.execute(SETTLE, silent=True, store_history=False)
        while self.kc.get_shell_msg(timeout=60)["parent_header"].get("msg_id") != msg_id:
            pass

    def value(self, expr: str) -> Any:
        """The value of an expression of ours in the kernel (a silent request; its repr
        evaluated here)."""
        msg_id = self.kc.execute("", silent=True, store_history=False, user_expressions={"v": expr})
        while True:
            reply = self.kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                value = reply["content"]["user_expressions"]["v"]
                assert value["status"] == "ok", value
                return eval(value["data"]["text/plain"])  # noqa: S307 - our own expression's repr

    def execution(self, msg_id: str) -> dict[str, Any]:
        self.settle()
        with self.store() as store:
            row = store._conn().execute("SELECT id FROM executions WHERE msg_id = ?", (msg_id,))
            found = row.fetchone()
            assert found is not None, f"no execution recorded for {msg_id}"
            return store.get_execution(found["id"])  # type: ignore[return-value]

    def executions(self) -> list[dict[str, Any]]:
        self.settle()
        with self.store() as store:
            trajectories = store.list_trajectories()
            assert len(trajectories) == 1, trajectories
            return store.list_executions(trajectories[0]["id"])

    def wait_snapshot(self, msg_id: str, timeout: float = 90) -> dict[str, Any]:
        """The execution once its snapshot is no longer pending."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.execution(msg_id)
            if row["snapshot_status"] != "pending":
                return row
            if time.monotonic() > deadline:
                raise AssertionError(f"snapshot of {msg_id} still pending after {timeout}s")
            time.sleep(0.1)

    def variables(self, msg_id: str) -> dict[str, dict[str, Any]]:
        row = self.wait_snapshot(msg_id)
        with self.store() as store:
            return {v["name"]: v for v in store.get_variables(row["id"])}

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)


def kernel_fixture(folder: str, *arguments: str, setup: str | None = None) -> Any:
    """A module-scoped fixture: a RecordingKernel started with `arguments` (after running
    `setup`, if given) on a store in its own temporary `folder`, shut down after the module."""

    @pytest.fixture(scope="module")
    def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingKernel]:
        k = RecordingKernel(tmp_path_factory.mktemp(folder) / "trajectories.sqlite", [*arguments])
        try:
            if setup is not None:
                k.run(setup)
            yield k
        finally:
            k.shutdown()

    return kernel
