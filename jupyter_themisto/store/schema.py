"""The trajectory log's SQLite schema and its ordered migrations."""

from __future__ import annotations

import hashlib
import json
import sqlite3

# Each entry moves the schema from version i to i + 1. Append; never edit a released step.
MIGRATIONS: list[str] = [
    # 0 -> 1: the first schema.
    """
    CREATE TABLE trajectories (
        id              TEXT PRIMARY KEY,
        notebook_path   TEXT,
        kernel_id       TEXT,
        session_id      TEXT,
        started_at      REAL NOT NULL,
        python_version  TEXT,
        packages        TEXT NOT NULL DEFAULT '{}',   -- JSON: {name: version}
        host            TEXT NOT NULL DEFAULT '{}'    -- JSON: hostname, platform, cpus, memory
    );
    CREATE INDEX trajectories_by_path ON trajectories (notebook_path, started_at);

    CREATE TABLE executions (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        trajectory_id    TEXT NOT NULL REFERENCES trajectories (id),
        order_index      INTEGER NOT NULL,            -- the order the person ran cells
        cell_id          TEXT,
        msg_id           TEXT,                        -- the execute_request's msg_id
        execution_count  INTEGER,
        source           TEXT NOT NULL,
        outputs          TEXT NOT NULL DEFAULT '[]',  -- JSON: nbformat output dicts
        status           TEXT NOT NULL,               -- ok | error | interrupted
        started_at       REAL,
        wall_time        REAL,                        -- seconds
        cpu_time         REAL,                        -- seconds
        memory_before    INTEGER,                     -- bytes (RSS)
        memory_after     INTEGER,
        memory_peak      INTEGER,
        snapshot_id      INTEGER,
        snapshot_status  TEXT NOT NULL DEFAULT 'none',
        UNIQUE (trajectory_id, order_index)
    );

    CREATE TABLE snapshots (
        id            INTEGER PRIMARY KEY AUTOINCREMENT,
        execution_id  INTEGER NOT NULL UNIQUE REFERENCES executions (id),
        status        TEXT NOT NULL,                  -- ok | partial | skipped | failed
        mode          TEXT,                           -- fork | inline
        created_at    REAL NOT NULL,
        duration      REAL,                           -- seconds spent serializing
        detail        TEXT                            -- why skipped/failed, if so
    );

    CREATE TABLE variables (
        snapshot_id  INTEGER NOT NULL REFERENCES snapshots (id),
        name         TEXT NOT NULL,
        type         TEXT NOT NULL,                   -- module-qualified type name
        size         INTEGER,                         -- bytes serialized, or estimated
        summary      TEXT NOT NULL DEFAULT '{}',      -- JSON: len/shape/dtype/columns/repr
        blob_hash    TEXT REFERENCES blobs (hash),    -- NULL for stubs
        fingerprint  TEXT,                            -- cheap change detector, if any
        stub_reason  TEXT,                            -- why no blob: unpicklable, too large...
        changed      INTEGER NOT NULL DEFAULT 1,      -- differs from the previous snapshot
        PRIMARY KEY (snapshot_id, name)
    );

    CREATE TABLE blobs (
        hash         TEXT PRIMARY KEY,                -- sha256 of the uncompressed bytes
        size         INTEGER NOT NULL,                -- uncompressed bytes
        stored_size  INTEGER NOT NULL,
        codec        TEXT NOT NULL,                   -- zstd | raw
        data         BLOB NOT NULL
    );
    """,
    # 1 -> 2: executions may be 'lost' (written after the fact, `detail` says why); snapshots
    # may be 'unchanged' (the namespace of execution `same_as`, no variable rows of their own)
    # or 'coalesced' (not taken: a later execution's snapshot was taken instead).
    """
    ALTER TABLE executions ADD COLUMN detail TEXT;
    ALTER TABLE snapshots ADD COLUMN same_as INTEGER REFERENCES executions (id);
    """,
    # 2 -> 3: keyed hashes of secret values (jupyter_themisto.redaction), never the values.
    """
    CREATE TABLE secret_digests (
        digest      TEXT PRIMARY KEY,                 -- HMAC-SHA256 (128 bits) under <store>.key
        length      INTEGER NOT NULL,                 -- characters of the value
        spaced      INTEGER NOT NULL,                 -- the value holds whitespace
        created_at  REAL NOT NULL
    );
    """,
    # 3 -> 4: while a snapshot is pending, the process that will resolve it (the kernel, then
    # its snapshot child: store/processes.py), so that one left pending by a process that died
    # can be told apart and marked failed.
    """
    ALTER TABLE executions ADD COLUMN snapshot_owner TEXT;
    CREATE INDEX executions_pending ON executions (trajectory_id)
        WHERE snapshot_status = 'pending';
    """,
    # 4 -> 5: storage. A variable's record (name, type, size, summary, blob, fingerprint, stub
    # reason) is stored once however many snapshots hold it unchanged: snapshots list their
    # records (`snapshot_variables`), and `variables` becomes a view with the columns the table
    # had. `executions.outputs` over a few hundred bytes is a zstd frame of the JSON text (a
    # BLOB value; smaller ones stay TEXT): code older than this schema cannot read it.
    """
    CREATE TABLE variable_records (
        id           INTEGER PRIMARY KEY,
        digest       BLOB NOT NULL UNIQUE,            -- record_digest() of the columns below
        name         TEXT NOT NULL,
        type         TEXT NOT NULL,
        size         INTEGER,
        summary      TEXT NOT NULL DEFAULT '{}',
        blob_hash    TEXT REFERENCES blobs (hash),
        fingerprint  TEXT,
        stub_reason  TEXT
    );
    CREATE TABLE snapshot_variables (
        snapshot_id  INTEGER NOT NULL REFERENCES snapshots (id),
        record_id    INTEGER NOT NULL REFERENCES variable_records (id),
        changed      INTEGER NOT NULL DEFAULT 1,
        PRIMARY KEY (snapshot_id, record_id)
    ) WITHOUT ROWID;
    INSERT OR IGNORE INTO variable_records
        (digest, name, type, size, summary, blob_hash, fingerprint, stub_reason)
        SELECT record_digest(name, type, size, summary, blob_hash, fingerprint, stub_reason),
            name, type, size, summary, blob_hash, fingerprint, stub_reason
        FROM variables ORDER BY snapshot_id, name;
    INSERT INTO snapshot_variables (snapshot_id, record_id, changed)
        SELECT v.snapshot_id, r.id, v.changed FROM variables v JOIN variable_records r
        ON r.digest = record_digest(
            v.name, v.type, v.size, v.summary, v.blob_hash, v.fingerprint, v.stub_reason);
    DROP TABLE variables;
    CREATE VIEW variables AS
        SELECT sv.snapshot_id, r.name, r.type, r.size, r.summary, r.blob_hash, r.fingerprint,
            r.stub_reason, sv.changed
        FROM snapshot_variables sv JOIN variable_records r ON r.id = sv.record_id;
    """,
    # 5 -> 6: the recorder notes a pause (`%themisto off`: since when, and the execution count
    # of the cell that paused: it is recorded, those after it are not) and the end of one (the
    # count of the cell that resumed: it and those before it that are missing ran unrecorded),
    # so that the server need not wait for executions that never come.
    """
    ALTER TABLE trajectories ADD COLUMN paused_at REAL;
    ALTER TABLE trajectories ADD COLUMN paused_after INTEGER;
    ALTER TABLE trajectories ADD COLUMN unrecorded_through INTEGER;
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)


def record_digest(
    name: str,
    type_: str,
    size: int | None,
    summary: str,
    blob_hash: str | None,
    fingerprint: str | None,
    stub_reason: str | None,
) -> bytes:
    """The key under which a variable record is stored once (128 bits of BLAKE2b over its
    columns as stored: the summary is its JSON text)."""
    text = json.dumps([name, type_, size, summary, blob_hash, fingerprint, stub_reason])
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to SCHEMA_VERSION; returns the version it started at.

    The connection must be in autocommit mode (isolation_level=None). The write lock is taken
    before the version is read, so two processes opening a new store at once migrate it once.
    """
    conn.create_function("record_digest", 7, record_digest, deterministic=True)
    conn.execute("BEGIN IMMEDIATE")
    try:
        start = conn.execute("PRAGMA user_version").fetchone()[0]
        if start > SCHEMA_VERSION:
            raise RuntimeError(
                f"the trajectory store has schema version {start}, newer than this "
                f"jupyter-themisto understands ({SCHEMA_VERSION}): upgrade jupyter-themisto"
            )
        for version in range(start, SCHEMA_VERSION):
            for statement in MIGRATIONS[version].split(";\n"):
                if statement.strip():
                    conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return start
