"""When, whether and how each execution's namespace snapshot is taken (SnapshotManager).

The snapshot of an execution is due once the row is handed to the writer, and taken after
`snapshot_delay` seconds of idleness; a cell that starts first takes its place (the earlier
execution is `coalesced`, noted in batches), except that one is taken right after the reply
when the last is older than `snapshot_max_deferral`. A silent request (no cell hooks) takes a
due snapshot before it runs. Before forking, the kernel compares the namespace's bindings with
those of the last snapshot and parses the cells run since (kernel/changes.py): when nothing can
have changed, the execution is `unchanged` (`same_as` the execution whose snapshot holds the
namespace) and no child is made. When every variable that may have changed is small, the
kernel takes the snapshot itself (small_snapshot.py); else it forks a child (snapshot_child.py)
that serializes and writes while the kernel goes on; `inline` mode writes it in the kernel.

Snapshot status: `ok` (every variable serialized, unchanged or redacted), `partial` (some are
stubs or summaries), `unchanged`, `coalesced`, `skipped` (fork mode, `max_snapshot_children`
children still running after waiting `snapshot_slot_wait` seconds (default 0): this execution
is not snapshotted, `detail` says so — skipping rather than queueing, because a queued
snapshot would capture a later namespace than the execution it belongs to), `failed` (the
child died, was killed or ran past `max_snapshot_seconds`; `detail` says which).
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import _clock as time
from .prefault import prefault
from .small_snapshot import SmallSnapshots
from .snapshot_child import SnapshotChild, failure_reason, run_child, wait_child
from .snapshot_writer import SnapshotWriter
from .variables import user_variables


class SnapshotManager:
    """Decides, per execution, to snapshot (fork / inline), to note `unchanged`, to coalesce
    into a later snapshot, or to skip; watches the snapshot children (see the module doc)."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.children: dict[int, SnapshotChild] = {}
        self._children_lock = threading.Lock()
        self._frozen = False
        # Set at interpreter exit: no fork then, the snapshot is taken inline.
        self.exiting = False
        # The execution whose snapshot is due (its order index), and the timer that takes it.
        self.due: int | None = None
        self._timer: Any = None
        # The namespace at the last snapshot: which execution holds it, its bindings, and the
        # sources of the cells run since (to tell whether they may have changed anything).
        self.base_order: int | None = None
        self.base_bindings: dict[str, int] | None = None
        self.sources_since: list[str] = []
        self._coalesced: list[int] = []
        # Counted from the start: the first cells of a "Run All" coalesce like the others.
        self.last_taken = time.monotonic()
        #: how many executions went which way (`%themisto status`, benchmarks)
        self.counts: dict[str, int] = {}
        #: seconds the kernel spent per fork (gc.freeze + fork + bookkeeping)
        self.fork_seconds: deque[float] = deque(maxlen=100_000)
        #: the snapshots the kernel takes itself (small_snapshot_seconds)
        self.small = SmallSnapshots(self)
        # The recorder's KernelSecrets generation the last snapshot was taken with.
        self.secrets_generation = 0

    def will_snapshot(self) -> bool:
        return self.recorder.snapshot_mode != "off"

    def running(self) -> int:
        return len(self.children)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # -- the recorder's events ---------------------------------------------------------------

    def execution_done(self, order_index: int, source: str, wall: float) -> None:
        """An execution was handed to the writer: its snapshot is due now or a moment later."""
        r = self.recorder
        if r.snapshot_mode == "off":
            self.base_bindings = None  # the namespace is no longer followed
            return
        self.sources_since.append(source)
        if self.due is not None:
            self.coalesce()
        self.due = order_index
        now = time.monotonic()
        loop = getattr(getattr(r.shell, "kernel", None), "io_loop", None)
        if (
            r.snapshot_mode == "inline"
            or self.exiting
            or loop is None
            or r.snapshot_delay <= 0
            or now - self.last_taken >= r.snapshot_max_deferral
        ):
            self.take_due()
            return
        self._timer = loop.call_later(r.snapshot_delay, self.take_due)

    def cell_starting(self) -> None:
        """A cell is about to run: a snapshot still due gives way to this cell's."""
        self.unfreeze_if_idle()
        if self.due is not None:
            self.coalesce()

    def silent_request(self) -> None:
        """A silent execute is about to run (it fires no cell hooks): take a due snapshot now,
        while the namespace is still the execution's."""
        if self.due is not None:
            self.take_due()

    def coalesce(self) -> None:
        order, self.due = self.due, None
        self._cancel_timer()
        if order is None:
            return
        self.count("coalesced")
        # Noted in batches (one statement at the next snapshot), not one write per cell.
        self._coalesced.append(order)
        if len(self._coalesced) >= 64:
            self.flush_coalesced()

    def flush_coalesced(self) -> None:
        orders, self._coalesced = self._coalesced, []
        r = self.recorder
        tid = r.trajectory_id
        if not orders or tid is None or r.writer is None:
            return
        r.writer.submit(
            lambda store: store.mark_pending_snapshots(tid, orders, "coalesced"), retried=True
        )

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            loop: Any = getattr(getattr(self.recorder.shell, "kernel", None), "io_loop", None)
            try:
                loop.remove_timeout(timer)
            except Exception:
                pass

    # -- taking it ---------------------------------------------------------------------------

    def take_due(self) -> None:
        order, self.due = self.due, None
        self._cancel_timer()
        if order is None or os.getpid() != self.recorder.pid:
            return
        try:
            self._take(order)
        except BaseException as e:  # noqa: B036 - a recorder must never break the kernel
            self.recorder._report("taking the snapshot failed", e)
            self._write_status(order, "failed", self.recorder.describe(e))

    def _take(self, order: int) -> None:
        r = self.recorder
        self.flush_coalesced()
        variables = list(user_variables(r.shell))
        current = {name: id(value) for name, value in variables}
        generation = self._secrets_generation()
        inline = r.snapshot_mode == "inline" or self.exiting or not hasattr(os, "fork")
        # (With a child still running too: a base snapshot it has not written yet makes the
        # small one give up, see SmallSnapshots.take.)
        try_small = not inline and r.small_snapshot_seconds > 0
        # Names bound to the same objects as at the last snapshot, no cell run since able to
        # change an object in place: those variables are as the last snapshot holds them.
        same: set[str] = set()
        if (
            self.base_bindings is not None
            and generation == self.secrets_generation
            and (current == self.base_bindings or try_small)
            and not self._may_have_changed_in_place()
        ):
            same = {n for n, i in current.items() if self.base_bindings.get(n) == i}
            if current == self.base_bindings:
                base = self.base_order
                self.sources_since = []
                self.count("unchanged")
                self._write_status(
                    order, "unchanged", f"no variable changed since execution {base}", same_as=base
                )
                return
        if inline:
            ok = self._inline(order, variables)
        else:
            ok = (try_small and self.small.take(order, variables, same, generation)) or self._fork(
                order
            )
        if ok:
            self.base_order = order
            self.base_bindings = current
            self.sources_since = []
            self.last_taken = time.monotonic()
            self.secrets_generation = generation

    def _secrets_generation(self) -> int:
        secrets = getattr(self.recorder, "secrets", None)
        return secrets.generation if secrets is not None else 0

    def _inline(self, order: int, variables: list[tuple[str, Any]]) -> bool:
        r = self.recorder
        writer = r.writer
        writer.wait_idle(30.0)  # the execution's row first
        store = writer.store
        execution_id = store.execution_id(r.trajectory_id, order) if store is not None else None
        if execution_id is None:
            return False  # not written (lost): nothing to attach a snapshot to
        self.count("inline")
        # The person waits for an inline snapshot anyway: a write of another process (a kernel
        # recording beside this one) is waited for, as the writer thread would, not a failure.
        store.set_busy_timeout(writer.locked_retry_seconds)
        try:
            self.snapshot_writer(store).write(execution_id, variables, mode="inline")
        finally:
            store.set_busy_timeout(0)  # this thread's writes never wait (RecordWriter._direct)
        return True

    def _may_have_changed_in_place(self) -> bool:
        """Could a cell run since the last snapshot have changed an object in place?"""
        from .changes import may_change

        r = self.recorder
        transform = getattr(r.shell, "transform_cell", None)
        ns = r.shell.user_ns
        return any(
            may_change(transform(src) if transform else src, ns) for src in self.sources_since
        )

    def _fork(self, order: int) -> bool:
        r = self.recorder
        writer = r.writer
        if len(self.children) >= max(1, r.max_snapshot_children) and r.snapshot_slot_wait > 0:
            self.wait(r.snapshot_slot_wait, below=max(1, r.max_snapshot_children))
        if len(self.children) >= max(1, r.max_snapshot_children):
            self.count("skipped")
            self._write_status(
                order,
                "skipped",
                f"{len(self.children)} snapshot children still running "
                f"(max_snapshot_children={r.max_snapshot_children})",
            )
            return False
        started = time.perf_counter()
        # The writer thread must not be inside SQLite when the child is made.
        if not writer.fork_lock.acquire(timeout=1.0):
            self.count("skipped")
            self._write_status(order, "skipped", "the store was busy (no fork within 1 s)")
            return False
        try:
            gc.freeze()
            self._frozen = True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                run_child(r, order, self.snapshot_writer)  # never returns
        finally:
            writer.fork_lock.release()
        # Both sides set the group (the classic race: a shutdown signalling the kernel's group
        # between fork and the child's own setpgid would otherwise reach the child).
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        child = SnapshotChild(pid, order)
        with self._children_lock:
            self.children[pid] = child
        threading.Thread(
            target=self._watch, args=(child,), name="themisto-snapshot-watch", daemon=True
        ).start()
        self.count("fork")
        self.fork_seconds.append(time.perf_counter() - started)
        return True

    def snapshot_writer(
        self, store: Any, put_blob: Callable[[bytes], str] | None = None, *, strict: bool = False
    ) -> SnapshotWriter:
        r = self.recorder
        return SnapshotWriter(
            store,
            r.trajectory_id,
            secret_pattern=r.secret_pattern,
            max_variable_bytes=r.max_variable_bytes,
            max_variable_seconds=r.max_variable_seconds,
            max_repr_chars=r.max_repr_chars,
            secrets=getattr(r, "secrets", None),
            recheck=self._secrets_generation() != self.secrets_generation,
            put_blob=put_blob,
            strict=strict,
        )

    def _write_status(
        self, order: int, status: str, detail: str, *, same_as: int | None = None
    ) -> None:
        """Note a snapshot without variables (through the writer, after the row)."""
        r = self.recorder
        tid = r.trajectory_id
        if tid is None or r.writer is None:
            return

        def job(store: Any) -> None:
            execution_id = store.execution_id(tid, order)
            if execution_id is None or store.get_snapshot(execution_id) is not None:
                return
            holder = store.execution_id(tid, same_as) if same_as is not None else None
            store.write_snapshot(
                execution_id,
                [],
                status=status,
                mode=r.snapshot_mode,
                detail=detail,
                same_as=holder,
            )

        r.writer.submit(job, retried=True)

    # -- watching the children ---------------------------------------------------------------

    def _watch(self, child: SnapshotChild) -> None:
        """Wait for one child (on its own thread); a child that died without writing its
        snapshot, or ran past max_snapshot_seconds, gets a `failed` snapshot with the reason."""
        limit = self.recorder.max_snapshot_seconds
        reason: str | None = None
        try:
            reason = failure_reason(child, wait_child(child, limit), limit)
        except BaseException as e:  # noqa: B036
            reason = f"watching the snapshot process failed: {type(e).__name__}: {e}"
        finally:
            with self._children_lock:
                self.children.pop(child.pid, None)
        if reason is not None:
            self._write_status(child.order_index, "failed", reason)
        if not self.children and not self.exiting and self.recorder.prefault_after_snapshot:
            # The last child gone: the pages it shared are the kernel's alone again; make them
            # writable now, not by faults in the next cells (prefault.py).
            try:
                if prefault(lambda: bool(self.children) or self.exiting):
                    self.count("prefaulted")
            except Exception as e:
                self.recorder._report("making pages writable after a snapshot failed", e)

    def reap(self) -> None:
        """Children are reaped by their watcher threads; this only gives gc back its
        collections once none is left (called from the kernel's thread)."""
        self.unfreeze_if_idle()

    def unfreeze_if_idle(self) -> None:
        if self._frozen and not self.children:
            gc.unfreeze()
            self._frozen = False

    def wait(self, seconds: float, below: int = 1, *, hurry: bool = False) -> None:
        """Until fewer than `below` children run, for at most `seconds`.

        `hurry` (at kernel exit) gives the children normal priority again where allowed.
        """
        if hurry:
            for pid in list(self.children):
                try:
                    os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0))
                except (OSError, AttributeError):
                    pass
        deadline = time.monotonic() + seconds
        while len(self.children) >= below and time.monotonic() < deadline:
            time.sleep(0.005)
        self.unfreeze_if_idle()

    def close(self) -> None:
        # Running children finish on their own; they hold nothing of the kernel's.
        self._cancel_timer()
        self.flush_coalesced()
        self.unfreeze_if_idle()
