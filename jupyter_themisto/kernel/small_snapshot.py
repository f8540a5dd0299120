"""Snapshots the kernel takes itself, without a fork, when what may have changed is small.

When every variable that may have changed since the last snapshot is small and serializing it
runs none of the person's code (pickling.small_value), the kernel takes the snapshot itself
within `small_snapshot_seconds` (its blobs and rows handed to the writer thread) instead of
forking; past that time it gives up and the manager forks.
"""

from __future__ import annotations

import sqlite3
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import _clock as time
from ..references import inspectable, library_class, library_reference
from .pickling import NotInKernel, TooSlow, small_value, time_limit
from .snapshot_writer import snapshot_status
from .variables import remembered

if TYPE_CHECKING:
    from .snapshot_manager import SnapshotManager

# About what one variable's record holds (name, type, summary), to bound what waits for a store.
_RECORD_BYTES = 512
#: A snapshot's note when the writer gave its variables up (RecordWriter._keep).
GIVEN_UP = (
    "its variables were not written: the store stayed locked while more writes waited for it"
    " than the kernel keeps"
)


class SmallSnapshots:
    """The manager's in-kernel snapshots, and what it keeps of the last one it took."""

    def __init__(self, manager: SnapshotManager) -> None:
        self.manager = manager
        # The variable records of the last snapshot taken by the kernel itself, by execution.
        self.kept: tuple[int | None, dict[str, dict[str, Any]]] = (None, {})
        #: seconds the kernel spent per snapshot it took itself (small_snapshot_seconds)
        self.seconds: deque[float] = deque(maxlen=100_000)

    def take(
        self, order: int, variables: list[tuple[str, Any]], same: set[str], generation: int
    ) -> bool:
        """Take the snapshot in the kernel when what changed since the last one is small (see
        small_snapshot_seconds); False (nothing written) when it is not, when the store is
        busy, or when it takes too long. `same`: the names known unchanged since then."""
        m = self.manager
        r = m.recorder
        budget = r.small_snapshot_seconds
        started = time.perf_counter()
        # The earlier snapshot's rows, which an unchanged variable reuses, must be written (one
        # a child still writes: give up), and the execution's row too (the writer idle).
        if r.writer is None:
            return False
        r.writer.wait_idle(budget)
        store = r.writer._direct()
        tid = r.trajectory_id
        if store is None or tid is None:
            return False
        recheck = generation != m.secrets_generation
        try:
            execution_id = store.execution_id(tid, order)
            previous: dict[str, dict[str, Any]] = {}
            if m.base_order is not None:
                kept_order, kept = self.kept
                if kept_order == m.base_order:
                    previous = kept  # taken here last time: no need to read it back
                else:
                    rows = store.snapshot_variables(tid, m.base_order)
                    if rows is None:
                        return False  # the last one was not written (failed): a full one is due
                    previous = {v["name"]: v for v in rows}
        except sqlite3.Error:
            return False  # locked by another process (this connection never waits): a child
        if execution_id is None:
            return False
        reuse = {n for n in same if n in previous}
        # Library objects still bound to the same name as last time (`from sympy import *`: 900
        # of them): their records again, without a look at each (references.py).
        for name, value in variables:
            prev = previous.get(name)
            if name not in reuse and prev is not None and not recheck:
                ref = (prev.get("summary") or {}).get("ref")
                if ref is not None and prev["summary"] == library_reference(value):
                    reuse.add(name)
        if not all(
            small_value(v)
            or (
                inspectable(v)
                and (remembered(v, previous.get(n), recheck) or library_class(type(v)))
            )
            for n, v in variables
            if n not in reuse
        ):
            return False
        from ..store import blob_hash

        blobs: dict[str, bytes] = {}

        def collect(data: bytes) -> str:
            digest = blob_hash(data)
            blobs[digest] = bytes(data)
            return digest

        # Instances of a library's classes (a sympy matrix, a fitted estimator) are serialized
        # strictly: anything of the person's in them (but plain instances), more than 4 MB, or
        # past the budget (SIGALRM) leaves them to a child.
        writer = m.snapshot_writer(store, put_blob=collect, strict=True)
        records = []
        try:
            with time_limit(max(budget - (time.perf_counter() - started), 1e-4)):
                for name, value in variables:
                    if name in reuse:
                        records.append({**previous[name], "changed": False})
                    else:
                        records.append(writer.record(name, value, previous.get(name)))
                    if time.perf_counter() - started > budget:
                        raise TooSlow()
        except TooSlow:
            m.count("small_over_budget")
            return False
        except NotInKernel:
            m.count("small_gave_way")
            return False
        status = snapshot_status(records)
        duration = time.perf_counter() - started

        def unwritten(store: Any) -> int | None:
            """The execution's id if its snapshot is still to write. (Looked up again: a job
            kept while the store was locked may run in a file that replaced it, where that id
            is another execution's, and this one's row is not.)"""
            found = store.execution_id(tid, order)
            return found if found is not None and store.get_snapshot(found) is None else None

        def job(store: Any) -> None:
            # Idempotent: the writer thread runs it again if it failed here (kept while the
            # store is locked). The next one reuses these records only once they are written.
            for digest, data in blobs.items():
                store.put_blob(data, digest)
            found = unwritten(store)
            if found is not None:
                store.write_snapshot(
                    found, records, status=status, mode="inline", duration=duration
                )
                self.kept = (order, {rec["name"]: rec for rec in records})

        def instead(store: Any) -> None:
            found = unwritten(store)
            if found is not None:
                store.write_snapshot(found, [], status="failed", detail=GIVEN_UP)

        size = sum(len(data) for data in blobs.values()) + _RECORD_BYTES * len(records)
        r.writer.submit(job, retried=True, size=size, instead=instead)
        m.count("small")
        self.seconds.append(time.perf_counter() - started)
        return True
