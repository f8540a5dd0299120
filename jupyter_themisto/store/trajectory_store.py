"""TrajectoryStore: the SQLite trajectory log shared by the kernel recorder, server and CLI."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zstandard

from .. import _clock as time
from . import processes
from .schema import migrate as migrate_schema
from .schema import record_digest

STORE_ENV = "THEMISTO_STORE"
#: the first 16 bytes of every SQLite database file
SQLITE_HEADER = b"SQLite format 3\x00"

# Blobs smaller than this are not worth a compression frame.
_COMPRESS_MIN = 64
# Outputs JSON shorter than this stays plain text (readable with the sqlite3 shell).
_COMPRESS_OUTPUTS_MIN = 256
# Pages of a new store. Most of what a store holds is small rows (executions, variable records)
# and blobs in overflow chains: with 4096-byte pages an empty table costs 4 kB, a cell's
# commit appends several 4 kB pages to the WAL, and a nearly empty store (one per notebook in a
# benchmark) is mostly unused page space.
_PAGE_SIZE = 1024
_WAL_LIMIT = 1 << 20
# Bound parameters per statement (SQLite's default limit is 999 before 3.32).
_SQL_VARIABLES = 500
_ZSTD_LEVEL = 3

_EXECUTION_FIELDS = (
    "cell_id",
    "msg_id",
    "execution_count",
    "source",
    "outputs",
    "status",
    "started_at",
    "wall_time",
    "cpu_time",
    "memory_before",
    "memory_after",
    "memory_peak",
    "snapshot_status",
    "snapshot_owner",
    "detail",
)
EXECUTION_STATUSES = ("ok", "error", "interrupted", "lost")
SNAPSHOT_STATUSES = ("ok", "partial", "skipped", "failed", "unchanged", "coalesced")
#: the snapshot statuses after which the kernel's namespace is known: written (`ok`, `partial`)
#: or the same as an earlier one (`unchanged`); after the others (and `pending`), the newest
#: variables are those of an older snapshot
NAMESPACE_STATUSES = ("ok", "partial", "unchanged")


class StoreError(Exception):
    """A problem with the trajectory store that a person can act on."""


def default_store_path() -> Path:
    """`THEMISTO_STORE` if set, else `<jupyter data dir>/themisto/trajectories.sqlite`."""
    env = os.environ.get(STORE_ENV)
    if env:
        return resolve_store_path(env)
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "themisto" / "trajectories.sqlite"


def _create_private(path: Path) -> None:
    """Create the store's file, empty, readable by its owner only, unless it exists: it holds
    every recorded source, output and variable. SQLite gives the `-wal` and `-shm` files it
    makes beside it the same mode; a store that exists keeps its own (e.g. one shared with a
    group on purpose)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as e:
        raise StoreError(f"cannot create the trajectory store {path}: {e}") from e


def resolve_store_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The store file `path` names (`~` expanded), else (None) the default one; absolute, so
    that a process that changes its working directory (a kernel's cell), or a kernel started
    in another folder that is handed it, keeps the same store."""
    if path is None:
        return Path(os.path.abspath(default_store_path()))
    return Path(os.path.abspath(Path(path).expanduser()))


def blob_hash(data: bytes | memoryview) -> str:
    """The content address of a blob: sha256 of its uncompressed bytes."""
    return hashlib.sha256(data).hexdigest()


def is_sqlite_file(path: str | os.PathLike[str]) -> bool:
    """A SQLite database is at `path` (its header written). Opens and closes the file: not
    for a file this process holds a SQLite connection to (closing drops its locks)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == SQLITE_HEADER
    except OSError:
        return False


class TrajectoryStore:
    """One trajectory log on disk.

    Safe to use from several processes at once (SQLite WAL: readers never block the writer)
    and from several threads of one process (one connection per thread). Every public write is
    its own transaction, so a process killed mid-way leaves all earlier writes intact.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        readonly: bool = False,
        timeout: float = 30.0,
        migrate: bool = True,
        follow: bool = False,
    ) -> None:
        self.path = resolve_store_path(path)
        self.readonly = readonly
        #: follow the path: a file deleted or replaced under the store is opened anew (and
        #: migrated) at the next query, instead of going on with the old one (the server's
        #: store; a recording kernel's writer keeps its own account of what was lost)
        self.follow = follow
        self._migrate = migrate
        self._follow_lock = threading.Lock()
        self._timeout = timeout
        self._local = threading.local()
        self._pid = os.getpid()
        if readonly:
            if not self.path.exists():
                raise StoreError(f"no trajectory store at {self.path}")
        else:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create the store's folder {self.path.parent}: {e}") from e
        conn = self._conn()
        if not readonly and migrate:
            migrate_schema(conn)
        self._inode = self._file_inode()
        self._wal_inode = self._file_inode(self._wal_path)  # (None: not in WAL mode)
        self._fd: int | None = None  # for intact(); never closed (see there)

    @property
    def _wal_path(self) -> Path:
        return self.path.with_name(self.path.name + "-wal")

    # -- connections -------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        # A forked child must never reuse its parent's connection: open a fresh one.
        if self._pid != os.getpid():
            self._local = threading.local()
            self._pid = os.getpid()
        conn = getattr(self._local, "conn", None)
        if conn is not None and self.follow and self._file_inode() != self._local.inode:
            conn.close()  # the file was deleted or replaced: the new one at the path
            conn = self._local.conn = None
        if conn is None:
            try:
                if self.readonly:
                    uri = f"{self.path.resolve().as_uri()}?mode=ro"
                    conn = sqlite3.connect(
                        uri, uri=True, timeout=self._timeout, isolation_level=None
                    )
                else:
                    _create_private(self.path)
                    conn = sqlite3.connect(
                        str(self.path), timeout=self._timeout, isolation_level=None
                    )
                    # A new database only (an existing one keeps its own); see _PAGE_SIZE.
                    conn.execute(f"PRAGMA page_size = {_PAGE_SIZE}")
                    conn.execute("PRAGMA journal_mode=WAL")
                    # Once checkpointed, the WAL shrinks back to this (else it stays as large
                    # as the largest it ever was: a big blob's write, on disk until the end).
                    conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT}")
                    conn.execute("PRAGMA synchronous=NORMAL")
                    # Zero what a write frees within a page (no extra I/O): text moved by a
                    # page split leaves no copy behind for a later secret scrub to miss.
                    conn.execute("PRAGMA secure_delete=FAST")
                conn.execute("PRAGMA foreign_keys=ON")
                conn.row_factory = sqlite3.Row
            except sqlite3.Error as e:
                raise StoreError(f"cannot open the trajectory store {self.path}: {e}") from e
            self._local.conn = conn
            if self.follow:
                self._local.inode = self._file_inode()
                if hasattr(self, "_inode") and self._local.inode != self._inode:
                    self._followed(conn)
        return conn

    def _followed(self, conn: sqlite3.Connection) -> None:
        """A new file at the path (see `follow`): given the schema, and checked from now on
        (by the first thread to find it; the others' connections open it as they come)."""
        if not self.readonly and self._migrate:
            try:
                migrate_schema(conn)
            except (sqlite3.Error, RuntimeError) as e:
                raise StoreError(f"cannot open the trajectory store {self.path}: {e}") from e
        with self._follow_lock:
            if self._inode == self._local.inode:
                return
            self._inode = self._local.inode
            self._wal_inode = self._file_inode(self._wal_path)
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)  # (the old file's: no lock of this process is left on it)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        if self.readonly:
            raise StoreError(f"the trajectory store {self.path} was opened read-only")
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @property
    def file_id(self) -> int | None:
        """Which file this store reads (its inode): another after a deleted file was followed."""
        return self._inode

    def _file_inode(self, path: Path | None = None) -> int | None:
        try:
            return os.stat(path or self.path).st_ino
        except OSError:
            return None

    def intact(self) -> bool:
        """The file is still the SQLite database this store opened: not deleted, replaced or
        overwritten under it (a connection's cached pages and WAL index would let writes
        "succeed" into such a file). One stat and a 16-byte read, through a descriptor kept
        open for the process's life: closing any descriptor of the file would drop SQLite's
        POSIX locks on it."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            head = os.pread(self._fd, 16, 0)
            same = os.fstat(self._fd).st_ino == os.stat(self.path).st_ino == self._inode
        except OSError:
            return False
        return head == SQLITE_HEADER and same and self._wal_intact()

    def _wal_intact(self) -> bool:
        """The WAL this store's connections write is still the file beside the database: a
        removed WAL keeps taking commits that no other connection sees, and that are gone
        when this process ends unless `salvage_wal` put them into the database first."""
        return self._wal_inode is None or self._file_inode(self._wal_path) == self._wal_inode

    def salvage_wal(self) -> bool:
        """When the database file is still the one opened but its WAL was removed (a cell's
        clean-up, a sync tool): checkpoint what this process committed into the database
        file, through the descriptors its connection still holds; True if that was done. The
        store is to be reopened after (a new connection starts a new WAL)."""
        if self.readonly or self._wal_intact() or self._file_inode() != self._inode:
            return False
        try:
            self._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error:
            return False
        return True

    def set_busy_timeout(self, seconds: float) -> None:
        """How long this thread's connection waits for another writer's lock (0: not at all)."""
        self._conn().execute(f"PRAGMA busy_timeout = {max(0, int(seconds * 1000))}")

    def schema_version(self) -> int:
        """The schema version of the file (SCHEMA_VERSION once migrated; a read-only store is
        not migrated)."""
        return int(self._conn().execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._pid == os.getpid():
            conn.close()
        self._local = threading.local()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- trajectories ------------------------------------------------------------------------

    def create_trajectory(
        self,
        *,
        notebook_path: str | None = None,
        kernel_id: str | None = None,
        session_id: str | None = None,
        python_version: str | None = None,
        packages: dict[str, str] | None = None,
        host: dict[str, Any] | None = None,
        started_at: float | None = None,
        trajectory_id: str | None = None,
    ) -> str:
        """Start a new trajectory and return its id."""
        tid = trajectory_id or uuid.uuid4().hex
        with self._write() as conn:
            conn.execute(
                "INSERT INTO trajectories (id, notebook_path, kernel_id, session_id, started_at,"
                " python_version, packages, host) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tid,
                    notebook_path,
                    kernel_id,
                    session_id,
                    started_at if started_at is not None else time.time(),
                    python_version,
                    json.dumps(packages or {}),
                    json.dumps(host or {}),
                ),
            )
        return tid

    def update_trajectory(self, trajectory_id: str, **fields: Any) -> None:
        """Fill in fields learnt after the start (e.g. the notebook path)."""
        allowed = {"notebook_path", "kernel_id", "session_id"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"cannot update trajectory fields {sorted(unknown)}")
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._write() as conn:
            conn.execute(
                f"UPDATE trajectories SET {sets} WHERE id = ?", (*fields.values(), trajectory_id)
            )

    def note_recording(
        self, trajectory_id: str, *, paused: bool, execution_count: int | None = None
    ) -> None:
        """The recorder paused or resumed recording a trajectory in the cell `execution_count`.
        Pausing sets `paused_at` (the time) and `paused_after` (that cell is recorded, later
        ones are not); resuming clears them and sets `unrecorded_through` (that cell and the
        ones before it that are not recorded never will be)."""
        with self._write() as conn:
            if paused:
                conn.execute(
                    "UPDATE trajectories SET paused_after = CASE WHEN paused_at IS NULL"
                    " THEN ? ELSE paused_after END, paused_at = coalesce(paused_at, ?)"
                    " WHERE id = ?",
                    (execution_count, time.time(), trajectory_id),
                )
            else:
                conn.execute(
                    "UPDATE trajectories SET paused_at = NULL, paused_after = NULL,"
                    " unrecorded_through = nullif(max(coalesce(unrecorded_through, -1),"
                    " coalesce(?, -1)), -1) WHERE id = ?",
                    (execution_count, trajectory_id),
                )

    def get_trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        row = (
            self._conn()
            .execute(_TRAJECTORY_SELECT + " WHERE t.id = ?", (trajectory_id,))
            .fetchone()
        )
        return _trajectory_dict(row) if row else None

    def list_trajectories(
        self,
        *,
        notebook_path: str | None = None,
        kernel_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        """Trajectories, newest first; optionally only those of one notebook and/or kernel."""
        sql = _TRAJECTORY_SELECT
        where: list[str] = []
        args: list[Any] = []
        if notebook_path is not None:
            where.append("t.notebook_path = ?")
            args.append(notebook_path)
        if kernel_id is not None:
            where.append("t.kernel_id = ?")
            args.append(kernel_id)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY t.started_at DESC, t.rowid DESC LIMIT ? OFFSET ?"
        args += [-1 if limit is None else limit, offset]
        return [_trajectory_dict(r) for r in self._conn().execute(sql, args)]

    def count_trajectories(self) -> int:
        return self._conn().execute("SELECT count(*) FROM trajectories").fetchone()[0]

    # -- executions --------------------------------------------------------------------------

    def add_execution(
        self, trajectory_id: str, record: dict[str, Any], *, order_index: int | None = None
    ) -> int:
        """Append one execution to a trajectory; returns the execution id.

        `record` holds the `executions` columns by name (`source` and `status` required;
        `outputs` a list of nbformat output dicts, stored as strict JSON: no NaN). The order
        index is the next in the trajectory unless the (only) writer of the trajectory gives
        it: the recorder numbers its executions itself, so that an execution written late
        (status `lost`) keeps its place.
        """
        unknown = set(record) - set(_EXECUTION_FIELDS)
        if unknown:
            raise ValueError(f"unknown execution fields {sorted(unknown)}")
        if record.get("status") not in EXECUTION_STATUSES:
            raise ValueError(f"execution status must be one of {EXECUTION_STATUSES}")
        if not isinstance(record.get("source"), str):
            raise ValueError("execution source must be a string")
        values = dict(record)
        values["outputs"] = _pack_outputs(values.get("outputs") or [])
        values.setdefault("snapshot_status", "none")
        cols = list(values)
        insert = (
            f"INSERT INTO executions (trajectory_id, order_index, {', '.join(cols)})"
            f" VALUES (?, ?, {', '.join('?' for _ in cols)})"
        )
        if order_index is not None:
            # One statement is its own transaction: no BEGIN/COMMIT round trips (the recorder
            # writes one of these after every cell).
            if self.readonly:
                raise StoreError(f"the trajectory store {self.path} was opened read-only")
            cur = self._conn().execute(insert, (trajectory_id, order_index, *values.values()))
            return int(cur.lastrowid)  # type: ignore[arg-type]
        with self._write() as conn:
            order = conn.execute(
                "SELECT coalesce(max(order_index) + 1, 0) FROM executions WHERE trajectory_id = ?",
                (trajectory_id,),
            ).fetchone()[0]
            cur = conn.execute(insert, (trajectory_id, order, *values.values()))
            return int(cur.lastrowid)  # type: ignore[arg-type]

    def execution_id(self, trajectory_id: str, order_index: int) -> int | None:
        """The id of a trajectory's execution at `order_index`, if written."""
        row = (
            self._conn()
            .execute(
                "SELECT id FROM executions WHERE trajectory_id = ? AND order_index = ?",
                (trajectory_id, order_index),
            )
            .fetchone()
        )
        return int(row[0]) if row else None

    def next_order_index(self, trajectory_id: str) -> int:
        row = (
            self._conn()
            .execute(
                "SELECT coalesce(max(order_index) + 1, 0) FROM executions WHERE trajectory_id = ?",
                (trajectory_id,),
            )
            .fetchone()
        )
        return int(row[0])

    def get_execution(self, execution_id: int) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT * FROM executions WHERE id = ?", (execution_id,))
        found = row.fetchone()
        return _execution_dict(found) if found else None

    def list_executions(
        self, trajectory_id: str, *, offset: int = 0, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """A trajectory's executions in the order they ran."""
        rows = self._conn().execute(
            "SELECT * FROM executions WHERE trajectory_id = ? ORDER BY order_index"
            " LIMIT ? OFFSET ?",
            (trajectory_id, -1 if limit is None else limit, offset),
        )
        return [_execution_dict(r) for r in rows]

    def last_execution_count(self, trajectory_id: str) -> int | None:
        """The execution count of a trajectory's newest execution that has one (None: none)."""
        row = (
            self._conn()
            .execute(
                "SELECT execution_count FROM executions WHERE trajectory_id = ?"
                " AND execution_count IS NOT NULL ORDER BY order_index DESC LIMIT 1",
                (trajectory_id,),
            )
            .fetchone()
        )
        return int(row[0]) if row else None

    def count_executions(self, trajectory_id: str | None = None) -> int:
        if trajectory_id is None:
            return self._conn().execute("SELECT count(*) FROM executions").fetchone()[0]
        return (
            self._conn()
            .execute("SELECT count(*) FROM executions WHERE trajectory_id = ?", (trajectory_id,))
            .fetchone()[0]
        )

    def mark_pending_snapshots(
        self, trajectory_id: str, order_indexes: Iterable[int], status: str
    ) -> int:
        """Set the snapshot status of those of the executions whose snapshot is still pending
        (e.g. 'coalesced'); returns how many changed."""
        if status not in SNAPSHOT_STATUSES:
            raise ValueError(f"snapshot status must be one of {SNAPSHOT_STATUSES}")
        orders = [int(o) for o in order_indexes]
        if not orders:
            return 0
        with self._write() as conn:
            marks = ",".join("?" * len(orders))
            cur = conn.execute(
                "UPDATE executions SET snapshot_status = ? WHERE trajectory_id = ?"
                f" AND snapshot_status = 'pending' AND order_index IN ({marks})",
                (status, trajectory_id, *orders),
            )
            return int(cur.rowcount)

    def set_snapshot_owner(self, execution_id: int, owner: str | None) -> None:
        """Name the process that will resolve the execution's snapshot (while it is pending)."""
        with self._write() as conn:
            conn.execute(
                "UPDATE executions SET snapshot_owner = ? WHERE id = ?"
                " AND snapshot_status = 'pending'",
                (owner, execution_id),
            )

    def sweep_pending_snapshots(self, trajectory_id: str | None = None) -> int:
        """Mark `failed`, with the reason, every pending snapshot (of one trajectory, or all)
        whose owner process is gone: it died (killed, out of memory, with its kernel) before it
        wrote it, and nobody else will. Owners on other hosts, or unnamed (stores written
        before schema 4), are left alone. Returns how many were marked."""
        sql = "SELECT id, snapshot_owner FROM executions WHERE snapshot_status = 'pending'"
        args: tuple[Any, ...] = ()
        if trajectory_id is not None:
            sql += " AND trajectory_id = ?"
            args = (trajectory_id,)
        rows = self._conn().execute(sql, args).fetchall()
        states: dict[str, str] = {}
        stale: list[tuple[int, str]] = []
        for execution_id, owner in rows:
            if not owner:
                continue
            if owner not in states:
                states[owner] = processes.process_state(owner)
            if states[owner] == processes.GONE:
                stale.append((execution_id, owner))
        if not stale:
            return 0
        marked = 0
        now = time.time()
        with self._write() as conn:
            for execution_id, owner in stale:
                # Still pending and owned by the same process (it may have been resolved since).
                still = conn.execute(
                    "SELECT 1 FROM executions WHERE id = ? AND snapshot_status = 'pending'"
                    " AND snapshot_owner = ?",
                    (execution_id, owner),
                ).fetchone()
                if still is None:
                    continue
                detail = (
                    f"{processes.describe(owner)} ended before the snapshot was written "
                    "(killed, out of memory, or gone with its kernel)"
                )
                cur = conn.execute(
                    "INSERT OR IGNORE INTO snapshots (execution_id, status, mode, created_at,"
                    " detail) VALUES (?, 'failed', NULL, ?, ?)",
                    (execution_id, now, detail),
                )
                sid = cur.lastrowid if cur.rowcount else None
                conn.execute(
                    "UPDATE executions SET snapshot_status = 'failed',"
                    " snapshot_id = coalesce(?, snapshot_id) WHERE id = ?",
                    (sid, execution_id),
                )
                marked += 1
        return marked

    # -- blobs -------------------------------------------------------------------------------

    def put_blob(self, data: bytes | memoryview, digest: str | None = None) -> str:
        """Store bytes once under their content hash (compressed); returns the hash."""
        digest = digest or blob_hash(data)
        if self.has_blob(digest):
            return digest
        stored, codec = _compress(data)
        with self._write() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO blobs (hash, size, stored_size, codec, data)"
                " VALUES (?, ?, ?, ?, ?)",
                (digest, len(data), len(stored), codec, stored),
            )
        return digest

    def has_blob(self, digest: str) -> bool:
        found = self._conn().execute("SELECT 1 FROM blobs WHERE hash = ?", (digest,)).fetchone()
        return found is not None

    def get_blob(self, digest: str) -> bytes:
        row = (
            self._conn()
            .execute("SELECT codec, data FROM blobs WHERE hash = ?", (digest,))
            .fetchone()
        )
        if row is None:
            raise KeyError(digest)
        return _decompress(row["data"], row["codec"])

    def blob_stats(self) -> dict[str, int]:
        row = (
            self._conn()
            .execute(
                "SELECT count(*) AS n, coalesce(sum(size), 0) AS size,"
                " coalesce(sum(stored_size), 0) AS stored FROM blobs"
            )
            .fetchone()
        )
        return {"count": row["n"], "size": row["size"], "stored_size": row["stored"]}

    # -- snapshots ---------------------------------------------------------------------------

    def write_snapshot(
        self,
        execution_id: int,
        variables: Iterable[dict[str, Any]],
        *,
        status: str = "ok",
        mode: str | None = None,
        duration: float | None = None,
        detail: str | None = None,
        same_as: int | None = None,
        replace_failed: bool = False,
    ) -> int:
        """Record a namespace snapshot for an execution; returns the snapshot id.

        Each variable dict has `name`, `type`, and optionally `size`, `summary` (dict),
        `blob_hash` (a blob already stored with put_blob), `fingerprint`, `stub_reason`,
        `changed`. The execution's snapshot_id and snapshot_status are set in the same
        transaction. An `unchanged` snapshot has no variables of its own: `same_as` is the
        execution whose snapshot holds the same namespace. `replace_failed` (the snapshot
        child's own write) replaces a `failed` note without variables, as a sweep may have
        written it in the moment between a fork and the child naming itself the owner.
        """
        if status not in SNAPSHOT_STATUSES:
            raise ValueError(f"snapshot status must be one of {SNAPSHOT_STATUSES}")
        with self._write() as conn:
            if replace_failed:
                conn.execute(
                    "DELETE FROM snapshots WHERE execution_id = ? AND status = 'failed' AND NOT"
                    " EXISTS (SELECT 1 FROM snapshot_variables v"
                    " WHERE v.snapshot_id = snapshots.id)",
                    (execution_id,),
                )
            cur = conn.execute(
                "INSERT INTO snapshots (execution_id, status, mode, created_at, duration, detail,"
                " same_as) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (execution_id, status, mode, time.time(), duration, detail, same_as),
            )
            sid = int(cur.lastrowid)  # type: ignore[arg-type]
            records: list[tuple[Any, ...]] = []
            changed: list[int] = []
            names: set[str] = set()
            for v in variables:
                if v["name"] in names:
                    raise ValueError(f"variable {v['name']!r} twice in one snapshot")
                names.add(v["name"])
                records.append(
                    (
                        v["name"],
                        v["type"],
                        v.get("size"),
                        json.dumps(v.get("summary") or {}, default=str),
                        v.get("blob_hash"),
                        v.get("fingerprint"),
                        v.get("stub_reason"),
                    )
                )
                changed.append(int(v.get("changed", True)))
            ids = _record_ids(conn, records)
            conn.executemany(
                "INSERT INTO snapshot_variables (snapshot_id, record_id, changed) VALUES (?, ?, ?)",
                [(sid, rid, c) for rid, c in zip(ids, changed, strict=True)],
            )
            conn.execute(
                "UPDATE executions SET snapshot_id = ?, snapshot_status = ?,"
                " snapshot_owner = NULL WHERE id = ?",
                (sid, status, execution_id),
            )
        return sid

    def get_snapshot(self, execution_id: int) -> dict[str, Any] | None:
        row = (
            self._conn()
            .execute("SELECT * FROM snapshots WHERE execution_id = ?", (execution_id,))
            .fetchone()
        )
        return dict(row) if row else None

    def _holder(self, execution_id: int) -> int:
        """The execution whose snapshot rows hold `execution_id`'s namespace."""
        seen = {execution_id}
        while True:
            row = (
                self._conn()
                .execute("SELECT same_as FROM snapshots WHERE execution_id = ?", (execution_id,))
                .fetchone()
            )
            if row is None or row["same_as"] is None or row["same_as"] in seen:
                return execution_id
            execution_id = row["same_as"]
            seen.add(execution_id)

    def get_variables(self, execution_id: int) -> list[dict[str, Any]]:
        """The variable summaries of an execution's snapshot (empty if it has none).

        An `unchanged` snapshot gives the variables of the snapshot it is the same as (each
        `changed = false`)."""
        holder = self._holder(execution_id)
        rows = self._conn().execute(
            "SELECT v.* FROM variables v JOIN snapshots s ON s.id = v.snapshot_id"
            " WHERE s.execution_id = ? ORDER BY v.name",
            (holder,),
        )
        found = [_variable_dict(r) for r in rows]
        if holder != execution_id:
            for v in found:
                v["changed"] = False
        return found

    def snapshot_variables(
        self, trajectory_id: str, order_index: int
    ) -> list[dict[str, Any]] | None:
        """The variables of the snapshot holding the namespace of the trajectory's execution
        at `order_index` (through `same_as`); None unless that snapshot is written and holds
        variables (`ok` or `partial`)."""
        execution_id = self.execution_id(trajectory_id, order_index)
        if execution_id is None:
            return None
        holder = self._holder(execution_id)
        row = (
            self._conn()
            .execute("SELECT status FROM snapshots WHERE execution_id = ?", (holder,))
            .fetchone()
        )
        if row is None or row["status"] not in ("ok", "partial"):
            return None
        return self.get_variables(holder)

    def latest_variables(self, trajectory_id: str) -> list[dict[str, Any]]:
        """The variables of the trajectory's most recent snapshot that was written (one that
        holds variables, directly or through `same_as`)."""
        rows = (
            self._conn()
            .execute(
                "SELECT e.id, s.status, s.same_as FROM executions e"
                " JOIN snapshots s ON s.execution_id = e.id"
                " WHERE e.trajectory_id = ?"
                f" AND s.status IN ({', '.join('?' * len(NAMESPACE_STATUSES))})"
                " ORDER BY e.order_index DESC LIMIT 50",
                (trajectory_id, *NAMESPACE_STATUSES),
            )
            .fetchall()
        )
        for row in rows:
            holder = self._holder(row["id"])
            status = (
                self._conn()
                .execute("SELECT status FROM snapshots WHERE execution_id = ?", (holder,))
                .fetchone()
            )
            if status is not None and status["status"] in ("ok", "partial"):
                return self.get_variables(holder)
        return []

    # -- secret digests (jupyter_themisto.redaction) ------------------------------------------

    def add_secret_digests(self, rows: Iterable[tuple[str, int, bool]]) -> int:
        """Record keyed hashes of secret values: (digest, length, holds whitespace) each."""
        rows = list(rows)
        if not rows:
            return 0
        now = time.time()
        with self._write() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO secret_digests (digest, length, spaced, created_at)"
                " VALUES (?, ?, ?, ?)",
                [(d, int(n), int(bool(sp)), now) for d, n, sp in rows],
            )
            return conn.total_changes - before

    def secret_digests(self) -> list[tuple[str, int, bool]]:
        rows = self._conn().execute("SELECT digest, length, spaced FROM secret_digests")
        return [(d, n, bool(sp)) for d, n, sp in rows]

    def secret_digest_count(self) -> int:
        return self._conn().execute("SELECT count(*) FROM secret_digests").fetchone()[0]

    @contextmanager
    def secure_rewrite(self) -> Iterator[_Rewrite]:
        """One transaction that replaces recorded content (a secret learnt late): replaced
        bytes are zeroed (secure_delete) and the WAL is checkpointed and truncated afterwards,
        so the old text is left neither in the database file nor in its log."""
        conn = self._conn()
        conn.execute("PRAGMA secure_delete = ON")
        try:
            with self._write() as conn:
                rewrite = _Rewrite(conn)
                yield rewrite
                rewrite.finish()
            if rewrite.changes:
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                except sqlite3.Error:
                    pass  # a busy reader: the next checkpoint overwrites the old pages
        finally:
            conn.execute("PRAGMA secure_delete = FAST")

    def latest_trajectory_for_kernel(self, kernel_id: str) -> dict[str, Any] | None:
        """The newest trajectory recorded by the kernel `kernel_id` (a restart starts another)."""
        row = (
            self._conn()
            .execute(
                _TRAJECTORY_SELECT
                + " WHERE t.kernel_id = ? ORDER BY t.started_at DESC, t.rowid DESC"
                " LIMIT 1",
                (kernel_id,),
            )
            .fetchone()
        )
        return _trajectory_dict(row) if row else None

    def variable_changes(self, trajectory_id: str) -> dict[str, int]:
        """For each variable name, the order index of the last execution that changed it."""
        rows = self._conn().execute(
            "SELECT v.name, max(e.order_index) FROM variables v"
            " JOIN snapshots s ON s.id = v.snapshot_id JOIN executions e ON e.id = s.execution_id"
            " WHERE e.trajectory_id = ? AND v.changed = 1 GROUP BY v.name",
            (trajectory_id,),
        )
        return {name: order for name, order in rows}


class _Rewrite:
    """The writes TrajectoryStore.secure_rewrite allows."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.changes = 0
        self._replaced: set[int] = set()

    def execution(self, execution_id: int, *, source: str, outputs: list[Any]) -> None:
        self.conn.execute(
            "UPDATE executions SET source = ?, outputs = ? WHERE id = ?",
            (source, _pack_outputs(outputs), execution_id),
        )
        self.changes += 1

    def variable(self, snapshot_id: int, name: str, reason: str) -> None:
        """Make a snapshot's variable a stub: no size, summary, blob or fingerprint. (Its old
        record goes once no snapshot holds it: `finish`.)"""
        row = self.conn.execute(
            "SELECT sv.record_id, r.type FROM snapshot_variables sv JOIN variable_records r"
            " ON r.id = sv.record_id WHERE sv.snapshot_id = ? AND r.name = ?",
            (snapshot_id, name),
        ).fetchone()
        if row is None:
            return
        old, type_ = row
        (stub,) = _record_ids(
            self.conn,
            [(name, type_, None, json.dumps({"redacted": True}), None, None, reason)],
        )
        self.conn.execute(
            "UPDATE snapshot_variables SET record_id = ? WHERE snapshot_id = ? AND record_id = ?",
            (stub, snapshot_id, old),
        )
        self._replaced.add(old)
        self.changes += 1

    def drop_blobs(self, digests: Iterable[str]) -> None:
        """Delete blobs no variable refers to any more."""
        self.finish()
        for digest in digests:
            self.conn.execute(
                "DELETE FROM blobs WHERE hash = ? AND NOT EXISTS"
                " (SELECT 1 FROM variable_records WHERE blob_hash = ?)",
                (digest, digest),
            )
            self.changes += 1

    def finish(self) -> None:
        """Delete the replaced variable records no snapshot holds any more (one pass)."""
        if not self._replaced:
            return
        old = sorted(self._replaced)
        self._replaced.clear()
        for start in range(0, len(old), _SQL_VARIABLES):
            chunk = old[start : start + _SQL_VARIABLES]
            self.conn.execute(
                f"DELETE FROM variable_records WHERE id IN ({','.join('?' * len(chunk))})"
                " AND id NOT IN (SELECT record_id FROM snapshot_variables)",
                chunk,
            )


_TRAJECTORY_SELECT = (
    "SELECT t.*, (SELECT count(*) FROM executions e WHERE e.trajectory_id = t.id)"
    " AS n_executions FROM trajectories t"
)


def _trajectory_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["packages"] = json.loads(d["packages"] or "{}")
    d["host"] = json.loads(d["host"] or "{}")
    return d


def _execution_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["outputs"] = _unpack_outputs(d["outputs"])
    d.pop("snapshot_owner", None)  # bookkeeping of the recorder (store/processes.py)
    return d


def _variable_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["summary"] = json.loads(d["summary"] or "{}")
    d["changed"] = bool(d["changed"])
    return d


def _record_ids(conn: sqlite3.Connection, records: list[tuple[Any, ...]]) -> list[int]:
    """The ids of variable records (name, type, size, summary JSON, blob hash, fingerprint,
    stub reason), each stored once: found by its digest, else inserted."""
    digests = [record_digest(*r) for r in records]
    known: dict[bytes, int] = {}
    unique = list(dict.fromkeys(digests))
    for start in range(0, len(unique), _SQL_VARIABLES):
        chunk = unique[start : start + _SQL_VARIABLES]
        known.update(
            conn.execute(
                f"SELECT digest, id FROM variable_records WHERE digest IN"
                f" ({','.join('?' * len(chunk))})",
                chunk,
            ).fetchall()
        )
    ids = []
    for digest, record in zip(digests, records, strict=True):
        if digest not in known:
            cur = conn.execute(
                "INSERT INTO variable_records (digest, name, type, size, summary, blob_hash,"
                " fingerprint, stub_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (digest, *record),
            )
            known[digest] = int(cur.lastrowid)  # type: ignore[arg-type]
        ids.append(known[digest])
    return ids


def _pack_outputs(outputs: list[Any]) -> str | bytes:
    """An execution's outputs as stored: strict JSON text (no NaN), as a zstd frame when the
    text is long enough for that to pay (a BLOB value; `_unpack_outputs` tells them apart)."""
    text = json.dumps(outputs, allow_nan=False)
    if len(text) < _COMPRESS_OUTPUTS_MIN:
        return text
    packed, codec = _compress(text.encode("utf-8", "surrogatepass"))
    return packed if codec == "zstd" else text


def _unpack_outputs(stored: str | bytes | None) -> list[Any]:
    if isinstance(stored, bytes):
        stored = _decompress(stored, "zstd").decode("utf-8", "surrogatepass")
    return json.loads(stored or "[]")


_compressor = threading.local()


def _compress(data: bytes | memoryview) -> tuple[bytes, str]:
    if len(data) < _COMPRESS_MIN:
        return bytes(data), "raw"
    cctx = getattr(_compressor, "cctx", None)
    if cctx is None:
        cctx = _compressor.cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    packed = cctx.compress(data)
    if len(packed) >= len(data):
        return bytes(data), "raw"
    return packed, "zstd"


def _decompress(data: bytes, codec: str) -> bytes:
    if codec == "raw":
        return bytes(data)
    if codec == "zstd":
        return zstandard.ZstdDecompressor().decompress(data)
    raise StoreError(f"unknown blob codec {codec!r}")
