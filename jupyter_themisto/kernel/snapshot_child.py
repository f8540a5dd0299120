"""The forked snapshot child: what it does before it serializes, and how the kernel reads its end.

Fork mode (default on Linux/macOS): the kernel (SnapshotManager) takes the writer's fork lock
(its background thread is then outside SQLite), calls `gc.freeze()` (the kernel's collections
then do not touch the child's copy-on-write pages) and forks; its own store connection stays
open (the child never touches it). The child ignores SIGINT, leaves the kernel's process group
(ipykernel terminates that group's processes at shutdown; a snapshot should outlive the kernel
by the moment it needs), bounds its own CPU time (`max_snapshot_seconds`), lowers its priority
(nice 19), points fds 1 and 2 at /dev/null (ipykernel forwards a forked child's output into the
person's cell), disables gc (a collected file object would flush), opens its own connection,
waits for the execution's row if the writer has not written it yet, serializes and writes (again
in the file now at the path if the store's file was deleted or replaced meanwhile), and leaves
with `os._exit`. A thread per child (waiting on a pidfd) reaps it and marks its snapshot
`failed` with the reason if it died without writing one; gc is unfrozen once none is left.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .. import _clock as time
from .snapshot_writer import SnapshotWriter
from .variables import user_variables

# Exit codes of the snapshot child.
CHILD_OK = 0
CHILD_FAILED = 3
CHILD_NO_ROW = 4  # the execution was never written (lost): nothing to attach a snapshot to
CHILD_UNWRITTEN = 5  # neither the snapshot nor a `failed` note of its own could be written
_CHILD_NICE = 19


class SnapshotChild:
    """One running snapshot child, as the kernel knows it."""

    __slots__ = ("pid", "order_index", "started", "killed")

    def __init__(self, pid: int, order_index: int) -> None:
        self.pid = pid
        self.order_index = order_index
        self.started = time.monotonic()
        self.killed = False


def run_child(recorder: Any, order: int, writer_for: Callable[[Any], SnapshotWriter]) -> NoReturn:
    """The child's whole life after the fork: snapshot execution `order`, then `os._exit`."""
    code = CHILD_UNWRITTEN  # until something is written
    try:
        gc.disable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Out of the kernel's process group: ipykernel terminates its group's children at
        # shutdown and jupyter_client signals the group; the snapshot must outlive both.
        # An orphan still stops on its own: a CPU-time limit bounds it.
        try:
            os.setpgid(0, 0)
            import resource

            limit = max(1, int(recorder.max_snapshot_seconds))
            resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
        except (OSError, ValueError, ImportError):
            pass
        # The kernel comes first: the child takes leftover CPU (renice at kernel exit).
        try:
            os.nice(_CHILD_NICE)
        except OSError:
            pass
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sink = open(os.devnull, "w")  # noqa: SIM115 - lives until os._exit
        sys.stdout = sys.stderr = sink
        variables = list(user_variables(recorder.shell))
        # Its own connection; nothing of the kernel's (the writer thread's) is touched.
        store = None
        for _ in range(3):
            store, execution_id = wait_for_row(
                store, recorder.store_file, recorder.trajectory_id, order
            )
            if execution_id is None:
                code = CHILD_NO_ROW
                break
            code = _write(store, execution_id, variables, writer_for)
            if store.intact():
                break
            # The file was deleted or replaced while it was written: again, in the file now
            # at the path, which the kernel's writer writes to.
    finally:
        os._exit(code)


def _write(
    store: Any,
    execution_id: int,
    variables: list[tuple[str, Any]],
    writer_for: Callable[[Any], SnapshotWriter],
) -> int:
    """Write the snapshot (or a `failed` one saying why it could not be taken): the exit code."""
    from ..store.processes import process_identity

    writer: SnapshotWriter | None = None
    try:
        # This process resolves the snapshot now: if it dies (with its kernel or not), a sweep
        # finds it gone and marks the snapshot failed.
        store.set_snapshot_owner(execution_id, process_identity("snapshot"))
        writer = writer_for(store)
        writer.write(execution_id, variables, mode="fork")
        return CHILD_OK
    except BaseException as e:  # noqa: B036
        # The error's message only once scrubbed: it may quote a secret value the kernel knows.
        detail = type(e).__name__
        if writer is not None:
            try:
                message = f"{detail}: {str(e)[:500]}"
                detail = writer.secrets.scrub(message) if writer.secrets is not None else message
            except BaseException:  # noqa: B036 - the error's name then
                pass
        try:
            store.write_snapshot(
                execution_id,
                [],
                status="failed",
                mode="fork",
                detail=detail,
                replace_failed=True,
            )
            return CHILD_FAILED
        except BaseException:  # noqa: B036
            return CHILD_UNWRITTEN  # the kernel notes it, through its writer


def wait_for_row(
    store: Any, path: Any, trajectory_id: str | None, order: int
) -> tuple[Any, int | None]:
    """The store and the execution's id once the kernel's writer has written it (the child may
    be first); `store` None: the file at `path` is not open yet. A store file deleted or
    replaced meanwhile is followed: the writer writes the row into the new file at the same
    path. The child never makes that file itself (the writer does, with its schema): a file
    made here could take up the old file's WAL, about to be deleted, and the writer's rows
    would never show in it."""
    from ..store import TrajectoryStore
    from ..store.trajectory_store import is_sqlite_file

    if trajectory_id is None:
        return store, None
    deadline = time.monotonic() + 120.0
    pause = 0.005
    opened = time.monotonic()
    while True:
        # Opened again when its file was replaced (once the writer has made the new one), and
        # every 2 s anyway: a connection opened while the file was being made, or its WAL
        # replaced, may not see what the writer writes, and look intact. (The header is not
        # read from the file this process holds open: closing that read would drop its locks.)
        replaced = store is None or not store.intact()
        if (replaced and is_sqlite_file(path)) or (not replaced and time.monotonic() - opened > 2):
            try:
                fresh = TrajectoryStore(path, migrate=False)
            except Exception:
                pass  # (being made: the next look)
            else:
                if store is not None:
                    store.close()
                store, opened = fresh, time.monotonic()
        found = None
        if store is not None:
            try:
                found = store.execution_id(trajectory_id, order)
            except Exception:
                pass  # (a file still being made, a lock: the next look)
        if found is not None or time.monotonic() > deadline:
            return store, found
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def wait_child(child: SnapshotChild, limit: float) -> int | None:
    """The child's wait status once it ends (SIGKILL past `limit` seconds), None if someone
    else reaped it."""
    deadline = child.started + limit
    pidfd = None
    try:
        pidfd = os.pidfd_open(child.pid) if hasattr(os, "pidfd_open") else None
    except OSError:
        pidfd = None
    try:
        while True:
            try:
                done, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0 and not child.killed:
                child.killed = True
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except OSError:
                    pass
                left = 5.0
            wait = min(max(left, 0.01), 1.0)
            if pidfd is not None:
                import select

                select.select([pidfd], [], [], wait)
            else:
                time.sleep(min(wait, 0.05))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def failure_reason(child: SnapshotChild, status: int | None, limit: float) -> str | None:
    """Why the child ended without writing its snapshot, or None if it wrote one (or its own
    `failed` one)."""
    if child.killed:
        return f"snapshot killed after {limit:g}s"
    if status is None:
        return "the snapshot process was reaped by someone else (status unknown)"
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the snapshot process was killed by {name}"
    if code == CHILD_UNWRITTEN:
        return "the snapshot process could not write to the store (locked or unwritable)"
    if code not in (CHILD_OK, CHILD_FAILED, CHILD_NO_ROW):
        return f"the snapshot process exited with status {code}"
    return None
