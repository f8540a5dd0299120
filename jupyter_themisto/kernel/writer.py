"""RecordWriter: the recorder's writes, in order, without ever making a cell wait on the store.

The recorder hands over each finished execution (and each snapshot note it decides) just after
the kernel's reply. When nothing is waiting before it, the write happens right there, on the
kernel's thread, with a connection that never waits for a lock (a few tenths of a millisecond:
outputs turned into bounded nbformat dicts, small images stored as blobs, the row); a write
that fails or would wait, or an execution with large outputs (over 100 kB), goes to a
background thread, and so does everything after it until that thread has caught up. (A
thread for every write would cost more: while it holds the GIL, the next cell's own I/O waits
for it.) Both use one connection each, kept for the kernel's life
(snapshot children open their own).

An execution that cannot be written — the disk is full, the file read-only or broken, the
database locked past `locked_retry_seconds` — is kept in memory (at most `max_lost`, without
its outputs) and written as an execution with status `lost`, its `detail` saying why, at its
own place in the order, as soon as the store takes writes again (tried before every later
write and every `retry_seconds` while idle). A job submitted with `retried=True` (the keyed
hashes of secrets the kernel learnt, snapshots and their statuses) is kept and tried again the
same way when the store stays locked, in order, before those rows and anything after it (so
whoever reads a row knows the secrets before it, and a snapshot noted the same as an earlier one
finds that one written). What the kept jobs hold is bounded (`max_kept_bytes`, 64 MB): past it
the oldest ones give their place to what they name as their stand-in (a snapshot's: a `failed`
note saying why), or are dropped and counted.
A trajectory that could not be created as the kernel started (the store could not be opened,
or was locked past `locked_retry_seconds`) is retried the same way, so it exists before the
person's first cell runs.

A store whose file was deleted or replaced under it is reopened (a new file) with this
kernel's trajectories created again, so that what runs after is recorded there (the
execution that found it out as a `lost` row; so is one whose write waited for the lock while
the file was deleted, and went into it). A store whose WAL file alone was removed first
has what this process committed checkpointed into the database, through the descriptors its
connection still holds, and nothing is lost.

`fork_lock` is held around every call the thread makes into SQLite (opening and closing the
store too): the kernel takes it to fork, so that no child inherits SQLite's internal mutexes, or
a lock on the file, half-held by the thread (SQLite keeps the locks a process holds per file in
memory shared by its connections: a child that inherited "write lock held" could never write).
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .. import _clock as time

# How long one attempt may wait for a lock held by another writer (a snapshot child), and how
# long a locked store is retried before an execution counts as lost.
_BUSY_TIMEOUT = 0.05
_MAX_SOURCE_KEPT = 100_000
_MAX_KEPT_BYTES = 64 * 1024 * 1024
_MAX_KEPT_JOBS = 100_000


class _Stop:
    pass


class Unwritable(Exception):
    """The store took no writes (the message says why)."""


class _Replaced(sqlite3.DatabaseError):
    """The store's file is no longer the database the connection opened."""


_REPLACED = "file is not a database: the store's file was replaced or overwritten"


class _Salvaged(Exception):
    def __str__(self) -> str:
        return "what this kernel wrote to it was saved into the store; recording goes on"


@dataclass
class _Kept:
    """A `retried` job the store took no write for: `size` bytes it holds (its data), and a
    small job to keep in its place when the kept ones outgrow their bound (or None)."""

    job: Callable[[Any], Any]
    size: int = 0
    instead: Callable[[Any], Any] | None = None


class RecordWriter:
    """A daemon thread that owns the recorder's writes (see module doc)."""

    def __init__(
        self,
        open_store: Callable[[float], Any],
        *,
        report: Callable[[str, BaseException], None],
        locked_retry_seconds: float = 10.0,
        retry_seconds: float = 5.0,
        max_lost: int = 10_000,
        max_kept_bytes: int = _MAX_KEPT_BYTES,
        on_open: Callable[[Any], None] | None = None,
    ) -> None:
        self._open_store = open_store
        # Called on this thread with the store once it is opened (the recorder's sweep).
        self._on_open = on_open
        self._report = report
        self.locked_retry_seconds = locked_retry_seconds
        self.retry_seconds = retry_seconds
        self.store: Any = None
        self.fork_lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue()
        # Executions not written yet, in order: (trajectory_id, order_index, record, reason).
        self.lost: deque[tuple[str, int, dict[str, Any], str]] = deque(maxlen=max_lost)
        self.lost_dropped = 0
        # Jobs submitted with retried=True that found the store locked: tried again, in order,
        # holding at most max_kept_bytes (see _keep).
        self._retried: deque[_Kept] = deque()
        self._kept_bytes = 0
        self.max_kept_bytes = max_kept_bytes
        #: kept jobs given up (the bound): replaced by their stand-in, or dropped without one
        self.kept_replaced = 0
        self.kept_dropped = 0
        # Trajectories to create before anything of theirs is written (their fields are read
        # on this thread: package versions and host facts take a moment).
        self._trajectories: dict[str, Callable[[], dict[str, Any]]] = {}
        # The fields of the trajectories created: created again in a store that replaced theirs.
        self._created: dict[str, dict[str, Any]] = {}
        self.written = 0
        self.failures = 0
        self.last_error: str | None = None
        # Seconds spent per execution (outputs, blobs, the row), for benchmarks.
        self.write_seconds: deque[float] = deque(maxlen=100_000)
        self._idle = threading.Event()
        self._idle.set()
        # Items handed over and not done yet: idle is set only when this is back to 0 (a bare
        # queue.empty() check on the thread could set it just as the kernel queued another).
        self._unfinished = 0
        self._count_lock = threading.Lock()
        self._direct_threads: set[int] = set()
        self._owner = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="themisto-writer", daemon=True)
        self._thread.start()

    # -- the kernel's side -------------------------------------------------------------------

    def _direct(self) -> Any:
        """The store, when a write may happen on the calling thread now: nothing is queued
        before it and the store is open (else None)."""
        if (
            self.store is None
            # Only the kernel's own thread (the one that forks) writes directly: another
            # thread inside SQLite at a fork would leave the child SQLite's mutexes held.
            or threading.get_ident() != self._owner
            or not self._idle.is_set()
            or not self._queue.empty()
            or self.lost
            or self._retried
            or self._trajectories
            or not self.store.intact()  # the thread finds out why, and keeps what it cannot write
        ):
            return None
        if threading.get_ident() not in self._direct_threads:
            try:
                self.store.set_busy_timeout(0)  # never wait on this thread: hand over instead
            except Exception:
                return None
            self._direct_threads.add(threading.get_ident())
        return self.store

    def submit(
        self,
        job: Callable[[Any], Any],
        *,
        retried: bool = False,
        size: int = 0,
        instead: Callable[[Any], Any] | None = None,
    ) -> None:
        """Run `job(store)` after everything submitted before it (here if nothing waits).
        `retried`: a job that finds the store locked past `locked_retry_seconds` is kept and
        tried again while idle, like a lost execution (else it is reported and dropped);
        `size`: about how many bytes it holds; `instead`: a small job kept in its place if the
        kept jobs outgrow `max_kept_bytes` (see `_keep`)."""
        store = self._direct()
        if store is not None:
            try:
                job(store)
                return
            except Exception:
                pass  # the thread tries again (jobs are idempotent)
        if retried:
            self._enqueue(("retried", _Kept(job, size, instead)))
        else:
            self._enqueue(("call", job))

    def create_trajectory(self, trajectory_id: str, fields: Callable[[], dict[str, Any]]) -> None:
        self._trajectories[trajectory_id] = fields
        self._enqueue(("trajectory", None))

    def add_execution(
        self,
        trajectory_id: str,
        order_index: int,
        prepare: Callable[[Callable[[bytes], str]], dict[str, Any]],
        *,
        fallback: dict[str, Any],
        direct: bool = True,
    ) -> None:
        """Write an execution; `prepare(put_blob)` builds its record (outputs, blobs).
        `fallback` is what a `lost` row keeps if the write fails. `direct=False`: on the
        thread even if nothing waits (large outputs: decoding, hashing and compressing them
        would hold up a cell queued behind; the thread does most of it without the GIL)."""
        store = self._direct() if direct else None
        if store is not None:
            started = time.perf_counter()
            try:
                record = prepare(store.put_blob)
                store.add_execution(trajectory_id, record, order_index=order_index)
                self.written += 1
                self.write_seconds.append(time.perf_counter() - started)
                return
            except Exception:
                pass  # locked, full, broken...: the thread retries, or keeps it as lost
        self._enqueue(("execution", (trajectory_id, order_index, prepare, fallback)))

    def _enqueue(self, item: tuple[str, Any]) -> None:
        with self._count_lock:
            self._unfinished += 1
            self._idle.clear()
        self._queue.put(item)

    def wait_idle(self, timeout: float) -> bool:
        """Until everything handed over so far is written (or kept as lost)."""
        if threading.current_thread() is self._thread:
            return True
        return self._idle.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(("stop", _Stop()))
        self._thread.join(timeout)

    def waiting(self) -> int:
        """How many kept writes wait for the store (see `submit`'s `retried`)."""
        return len(self._retried)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                waiting = self.lost or self._trajectories or self._retried
                item = self._queue.get(timeout=self.retry_seconds if waiting else None)
            except queue.Empty:
                self._retry_lost()  # (creates the trajectories still to create first)
                continue
            kind, payload = item
            if kind == "stop":
                self._retry_lost()
                return
            try:
                if kind == "trajectory":
                    self._store()
                elif kind == "execution":
                    self._execution(*payload)
                elif kind == "retried":
                    self._call(payload.job, kept=payload)
                else:
                    self._call(payload, kept=None)
            except BaseException as e:  # noqa: B036 - the thread must go on
                self.failures += 1
                self._report("a recorder write failed", e)
            finally:
                with self._count_lock:
                    self._unfinished -= 1
                    if self._unfinished == 0:
                        self._idle.set()

    def _call(self, job: Callable[[Any], Any], *, kept: _Kept | None) -> None:
        """Run a submitted job; `kept`: it is kept if the store takes no write (retried)."""
        store = self._unchanged_store()
        if kept is None:
            if store is not None:
                self._locked(partial(job, store))
            return
        if store is not None and (self.lost or self._retried):
            self._retry_lost()  # (what was handed over before it, first)
        if store is None or self.lost or self._retried:
            self._keep(kept)  # (the store still takes no writes: no second wait for it)
            return
        try:
            self._locked(partial(job, store))
        except sqlite3.OperationalError as e:
            if not is_locked(e):
                raise
            self.last_error = f"a write waited past the lock: {describe(e)}"
            self._keep(kept)

    def _keep(self, kept: _Kept) -> None:
        """Keep a job to try again. Past `max_kept_bytes`, the oldest jobs holding data give
        their place to their stand-in (or are dropped); past _MAX_KEPT_JOBS, the oldest go."""
        self._retried.append(kept)
        self._kept_bytes += kept.size
        given_up = 0
        i = 0
        while self._kept_bytes > self.max_kept_bytes and i < len(self._retried):
            old = self._retried[i]
            if old.size:
                self._kept_bytes -= old.size
                given_up += 1
                if old.instead is not None:
                    self._retried[i] = _Kept(old.instead)
                    self.kept_replaced += 1
                else:
                    del self._retried[i]
                    self.kept_dropped += 1
                    continue
            i += 1
        while len(self._retried) > _MAX_KEPT_JOBS:
            self._kept_bytes -= self._retried.popleft().size
            given_up += 1
            self.kept_dropped += 1
        if given_up:
            self._report(
                "writes kept for a locked store were given up",
                Unwritable(
                    f"{given_up} of them, the oldest (more than {self.max_kept_bytes:,} bytes"
                    f" or {_MAX_KEPT_JOBS:,} writes waiting); a snapshot given up is noted"
                    " `failed`"
                ),
            )

    def _store(self) -> Any:
        """The open store with every pending trajectory created, or None."""
        if self.store is None:
            try:
                # Under fork_lock like every SQLite call of this thread: opening writes (the
                # schema, WAL mode), and a child forked meanwhile would inherit that lock as
                # held by its own process (SQLite's per-inode state) and never get it itself.
                with self.fork_lock:
                    self.store = self._open_store(_BUSY_TIMEOUT)
            except BaseException as e:  # noqa: B036
                self.last_error = f"cannot open the trajectory store: {describe(e)}"
                return None
            on_open, self._on_open = self._on_open, None
            if on_open is not None:
                try:
                    self._locked(partial(on_open, self.store))
                except BaseException as e:  # noqa: B036
                    self._report("a recorder write failed", e)
        for tid, make_fields in list(self._trajectories.items()):
            try:
                fields = make_fields()
                self._locked(partial(self.store.create_trajectory, trajectory_id=tid, **fields))
            except sqlite3.IntegrityError:
                pass  # already there (a retry after a commit whose answer was lost)
            except BaseException as e:  # noqa: B036
                self.last_error = f"cannot create the trajectory: {describe(e)}"
                return None
            del self._trajectories[tid]
            self._created[tid] = fields
        return self.store

    def _unchanged_store(self) -> Any:
        """The open store (see `_store`) or None; raises _Replaced if its file was deleted or
        replaced (closed then: the next write opens the file anew). A removed WAL costs
        nothing: what it held is checkpointed into the database, and the store reopened."""
        store = self._store()
        if store is None or store.intact():
            return store
        salvaged = self._locked(store.salvage_wal)
        self._reopen()
        if not salvaged:
            raise _Replaced(_REPLACED)
        self._report("the store's WAL file was removed", _Salvaged())
        return self._store()

    def _locked(self, call: Callable[[], Any]) -> Any:
        """Run a store call under fork_lock; a locked database is retried for a while."""
        deadline = time.monotonic() + self.locked_retry_seconds
        pause = 0.005
        while True:
            try:
                with self.fork_lock:
                    return call()
            except sqlite3.OperationalError as e:
                if not is_locked(e) or time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _execution(
        self,
        trajectory_id: str,
        order_index: int,
        prepare: Callable[[Callable[[bytes], str]], dict[str, Any]],
        fallback: dict[str, Any],
    ) -> None:
        started = time.perf_counter()
        try:
            store = self._unchanged_store()
        except _Replaced as e:
            # (this one is lost, written so in the new file; the next ones are recorded there)
            self._lose(trajectory_id, order_index, fallback, e)
            self.write_seconds.append(time.perf_counter() - started)
            return
        if store is not None and (self.lost or self._retried):
            self._retry_lost()
        if store is None or self.lost:
            reason = self.last_error or "the store is not writable"
            self.failures += 1
            self._report("recording the execution failed", Unwritable(reason))
            self._keep_lost(trajectory_id, order_index, fallback, reason)
            return
        try:
            record = prepare(lambda data: self._locked(partial(store.put_blob, data)))
        except BaseException as e:  # noqa: B036 - the row is written without its outputs
            self._report("preparing the execution's outputs failed", e)
            record = dict(fallback)
            record["detail"] = f"outputs not recorded: {describe(e)}"
        try:
            self._locked(
                partial(store.add_execution, trajectory_id, record, order_index=order_index)
            )
            # A file deleted or replaced while the lock was waited for took the row into a
            # file nobody will read: it counts as lost (a `lost` row in the new file).
            self._unchanged_store()
            self.written += 1
        except sqlite3.IntegrityError as e:
            if self._locked(partial(store.execution_id, trajectory_id, order_index)) is None:
                self._lose(trajectory_id, order_index, fallback, e)
        except BaseException as e:  # noqa: B036
            self._lose(trajectory_id, order_index, fallback, e)
        self.write_seconds.append(time.perf_counter() - started)

    def _lose(
        self, trajectory_id: str, order_index: int, fallback: dict[str, Any], error: BaseException
    ) -> None:
        self.failures += 1
        self.last_error = f"the execution could not be written: {describe(error)}"
        self._report("recording the execution failed", error)
        self._keep_lost(trajectory_id, order_index, fallback, self.last_error)
        if _is_broken(error):
            self._reopen()

    def _keep_lost(
        self, trajectory_id: str, order_index: int, fallback: dict[str, Any], reason: str
    ) -> None:
        record = {k: v for k, v in fallback.items() if k != "outputs"}
        source = record.get("source") or ""
        if len(source) > _MAX_SOURCE_KEPT:
            record["source"] = source[:_MAX_SOURCE_KEPT]
        if len(self.lost) == self.lost.maxlen:
            self.lost_dropped += 1
        self.lost.append((trajectory_id, order_index, record, reason))

    def _retry_lost(self) -> None:
        """Run the jobs kept to try again (secrets' hashes: before any row that may print
        them), then write the lost executions as `lost` rows, oldest first, while the store
        takes them."""
        store = self._store()
        while store is not None and self._retried:
            try:
                self._locked(partial(self._retried[0].job, store))
            except Exception as e:
                if is_locked(e):
                    return
                self._report("a recorder write failed", e)
            self._kept_bytes -= self._retried.popleft().size
        while store is not None and self.lost:
            trajectory_id, order_index, record, reason = self.lost[0]
            row = dict(record)
            row.update(
                status="lost", outputs=[], snapshot_status="none", detail=reason or "not written"
            )
            try:
                self._locked(
                    partial(store.add_execution, trajectory_id, row, order_index=order_index)
                )
            except sqlite3.IntegrityError as e:
                known = trajectory_id in self._created
                written = partial(store.execution_id, trajectory_id, order_index)
                if known and self._locked(written) is None:
                    # Not a place taken (the execution written after all): its trajectory is
                    # missing from the file. Created again before the next try.
                    self.last_error = f"the execution could not be written: {describe(e)}"
                    self._trajectories[trajectory_id] = partial(
                        dict, self._created.pop(trajectory_id)
                    )
                    return
                # (else that place is taken: the execution was written after all)
            except BaseException as e:  # noqa: B036
                self.last_error = f"the execution could not be written: {describe(e)}"
                if _is_broken(e):
                    self._reopen()
                return
            self.lost.popleft()

    def _reopen(self) -> None:
        """Close the store; the next write opens the file anew and creates this kernel's
        trajectories in it (already there, if the file is the same one: nothing happens)."""
        store, self.store = self.store, None
        # (the kernel thread sets its busy timeout again on the new store's connection)
        self._direct_threads.clear()
        for tid, fields in self._created.items():
            self._trajectories.setdefault(tid, partial(dict, fields))
        self._created.clear()
        try:
            if store is not None:
                with self.fork_lock:
                    store.close()
        except Exception:
            pass


def describe(error: BaseException) -> str:
    """`Type: message` of an error, for a log line or a row's detail."""
    return f"{type(error).__name__}: {str(error)[:300]}"


def is_locked(error: BaseException) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


def _is_broken(error: BaseException) -> bool:
    """Errors after which the connection is not worth keeping (the file changed under it)."""
    text = str(error).lower()
    return any(w in text for w in ("malformed", "not a database", "disk i/o", "readonly"))
