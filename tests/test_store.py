"""The trajectory store on its own: schema, order, blobs, snapshots, concurrent readers."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import multiprocessing
import os
import sqlite3

import pytest

from jupyter_themisto.store import SCHEMA_VERSION, StoreError, TrajectoryStore, blob_hash


def test_new_store_is_migrated_and_in_wal_mode(store_path):
    store = TrajectoryStore(store_path)
    conn = sqlite3.connect(store_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA page_size").fetchone()[0] == 1024
    conn.close()
    # A large write grows the WAL; once checkpointed it shrinks back to its limit (1 MiB).
    store.put_blob(os.urandom(3 << 20))
    wal = store_path.with_name(store_path.name + "-wal")
    assert wal.stat().st_size > 3 << 20
    store._conn().execute("PRAGMA wal_checkpoint(PASSIVE)")
    store.create_trajectory()  # the next write starts the WAL over, and truncates it
    assert wal.stat().st_size <= (1 << 20) + 64 * 1024
    store.close()


def test_a_new_store_is_private_and_an_existing_one_keeps_its_mode(tmp_path):
    old_umask = os.umask(0o022)  # the usual one: files readable by everyone
    try:
        path = tmp_path / "new" / "t.sqlite"
        store = TrajectoryStore(path)
        store.create_trajectory()
        files = [path, path.with_name("t.sqlite-wal"), path.with_name("t.sqlite-shm")]
        assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {
            f.name: "0o600" for f in files
        }
        store.close()
        # Deleted: the file made again is private too.
        for f in files:
            f.unlink(missing_ok=True)
        again = TrajectoryStore(path)
        again.create_trajectory()
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        again.close()
        shared = tmp_path / "shared.sqlite"
        TrajectoryStore(shared).close()
        shared.chmod(0o640)  # shared with a group on purpose
        store = TrajectoryStore(shared)
        store.create_trajectory()
        assert oct(shared.stat().st_mode & 0o777) == "0o640"
        assert len(store.list_trajectories()) == 1
        store.close()
    finally:
        os.umask(old_umask)


def test_a_following_store_serves_the_file_that_replaced_its_own(tmp_path):
    """The server's store (`follow`) reads the new file once the old one was deleted (`rm` to
    start afresh); a store
    that does not follow goes on reading the deleted one (a kernel's writer, which notices
    it itself)."""
    path = tmp_path / "t.sqlite"
    old = TrajectoryStore(path)
    before = old.create_trajectory(notebook_path="before.ipynb")
    server = TrajectoryStore(path, follow=True)
    stale = TrajectoryStore(path)
    assert [t["id"] for t in server.list_trajectories()] == [before]
    old.close()
    for f in tmp_path.glob("t.sqlite*"):
        f.unlink()
    # Deleted and nothing there yet: the server's store makes the file, with its schema.
    assert server.list_trajectories() == []
    assert server.schema_version() == SCHEMA_VERSION and server.intact()
    after = TrajectoryStore(path).create_trajectory(notebook_path="after.ipynb")
    assert [t["id"] for t in server.list_trajectories()] == [after]
    assert [t["id"] for t in stale.list_trajectories()] == [before]  # the deleted file
    # From another thread too (a connection per thread), after a second deletion.
    for f in tmp_path.glob("t.sqlite*"):
        f.unlink()
    again = TrajectoryStore(path).create_trajectory(notebook_path="again.ipynb")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ids = pool.submit(lambda: [t["id"] for t in server.list_trajectories()]).result()
    assert ids == [again] and [t["id"] for t in server.list_trajectories()] == [again]
    server.close()
    stale.close()


def test_store_newer_than_code_is_refused(store_path):
    TrajectoryStore(store_path).close()
    conn = sqlite3.connect(store_path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this"):
        TrajectoryStore(store_path)


def test_executions_keep_the_order_they_ran(store_path):
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(notebook_path="nb.ipynb")
    for i, src in enumerate(["a = 1", "b = 2", "a + b"]):
        store.add_execution(tid, {"source": src, "status": "ok", "execution_count": i + 1})
    rows = store.list_executions(tid)
    assert [r["order_index"] for r in rows] == [0, 1, 2]
    assert [r["source"] for r in rows] == ["a = 1", "b = 2", "a + b"]
    assert [r["source"] for r in store.list_executions(tid, offset=1, limit=1)] == ["b = 2"]
    assert store.get_trajectory(tid)["n_executions"] == 3


def test_bad_execution_records_are_refused_and_write_nothing(store_path):
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory()
    with pytest.raises(ValueError, match="status"):
        store.add_execution(tid, {"source": "x", "status": "weird"})
    with pytest.raises(ValueError, match="unknown execution fields"):
        store.add_execution(tid, {"source": "x", "status": "ok", "colour": "red"})
    assert store.count_executions(tid) == 0


def test_blobs_are_stored_once_and_compressed(store_path):
    store = TrajectoryStore(store_path)
    data = b"0123456789" * 10_000
    h1 = store.put_blob(data)
    h2 = store.put_blob(data)
    assert h1 == h2 == blob_hash(data)
    stats = store.blob_stats()
    assert stats["count"] == 1
    assert stats["stored_size"] < len(data) // 10
    assert store.get_blob(h1) == data
    assert store.get_blob(store.put_blob(b"tiny")) == b"tiny"


def test_readonly_store_refuses_writes_and_missing_files(store_path, tmp_path):
    TrajectoryStore(store_path).close()
    ro = TrajectoryStore(store_path, readonly=True)
    with pytest.raises(StoreError, match="read-only"):
        ro.create_trajectory()
    with pytest.raises(StoreError, match="no trajectory store"):
        TrajectoryStore(tmp_path / "absent.sqlite", readonly=True)


def _write_many(path: str, tid: str, n: int) -> None:
    store = TrajectoryStore(path)
    for i in range(n):
        store.add_execution(tid, {"source": f"x = {i}", "status": "ok"})


def test_another_process_reads_while_one_writes(store_path):
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory()
    writer = multiprocessing.get_context("spawn").Process(
        target=_write_many, args=(str(store_path), tid, 300)
    )
    writer.start()
    reader = TrajectoryStore(store_path, readonly=True)
    seen = []
    while writer.is_alive() or not seen or seen[-1] < 300:
        rows = reader.list_executions(tid)
        # Every read sees a gap-free prefix of the writer's executions.
        assert [r["order_index"] for r in rows] == list(range(len(rows)))
        seen.append(len(rows))
        if not writer.is_alive() and seen[-1] == 300:
            break
    writer.join()
    assert writer.exitcode == 0
    assert seen[-1] == 300


def test_pending_snapshots_of_dead_owners_are_swept_and_others_kept(store_path):
    """A pending snapshot names the process that will resolve it; once that process is gone
    (here: real processes, killed), a sweep marks it failed with the reason. A live owner, an
    owner on another host and an unnamed owner (older stores) are left alone."""
    import signal
    import subprocess
    import sys

    from jupyter_themisto.store.processes import process_identity, process_state

    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(notebook_path="n.ipynb")
    doomed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_owner = process_identity("snapshot", doomed.pid)
        live_owner = process_identity("kernel", living.pid)
        assert dead_owner and live_owner and process_state(live_owner) == "alive"
        host, boot, start = dead_owner.split("|")[1], dead_owner.split("|")[2], "1"
        owners = {
            0: dead_owner,
            1: live_owner,
            2: f"kernel|another-host|{boot}|{living.pid}|{start}",
            3: None,
            # The live process's pid under another start time: a reused pid, not the owner.
            4: f"kernel|{host}|{boot}|{living.pid}|{start}",
        }
        ids = {}
        for order, owner in owners.items():
            record = {"source": f"x = {order}", "status": "ok", "snapshot_status": "pending"}
            if owner:
                record["snapshot_owner"] = owner
            ids[order] = store.add_execution(tid, record, order_index=order)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        assert process_state(dead_owner) == "gone"

        assert store.sweep_pending_snapshots(tid) == 2
        status = {o: store.get_execution(i)["snapshot_status"] for o, i in ids.items()}
        assert status == {0: "failed", 1: "pending", 2: "pending", 3: "pending", 4: "failed"}
        detail = store.get_snapshot(ids[0])["detail"]
        assert f"the snapshot process (pid {doomed.pid}) ended" in detail
        assert "the kernel" in store.get_snapshot(ids[4])["detail"]
        assert "snapshot_owner" not in store.get_execution(ids[1])  # bookkeeping, not served
        assert store.sweep_pending_snapshots() == 0  # nothing more to do

        # A snapshot child swept by mistake (in the moment before it named itself the owner)
        # still gets its snapshot in; no other writer replaces a snapshot already there.
        var = {"name": "x", "type": "int"}
        store.write_snapshot(ids[0], [var], mode="fork", replace_failed=True)
        assert store.get_execution(ids[0])["snapshot_status"] == "ok"
        with pytest.raises(sqlite3.IntegrityError):
            store.write_snapshot(ids[4], [], status="ok", mode="inline")

        # The living owner ends: the next sweep marks its snapshot too.
        living.send_signal(signal.SIGKILL)
        living.wait()
        assert store.sweep_pending_snapshots(tid) == 1
        assert store.get_execution(ids[1])["snapshot_status"] == "failed"
        assert store.get_execution(ids[2])["snapshot_status"] == "pending"
    finally:
        for p in (doomed, living):
            p.kill()
            p.wait()
        store.close()


DF_BLOB = blob_hash(b"the frame")


def _snapshot(i: int) -> list[dict]:
    """A namespace where `i` changes every time and the rest stays the same."""
    return [
        {"name": "df", "type": "pandas.DataFrame", "size": 4096, "summary": {"shape": [3, 2]},
         "blob_hash": DF_BLOB, "fingerprint": "fp-df", "changed": i == 0},
        {"name": "i", "type": "int", "size": 5, "summary": {"repr": str(i)}, "changed": True},
        {"name": "s", "type": "socket.socket", "summary": {"repr": "<socket>"},
         "stub_reason": "unpicklable: socket", "changed": i == 0},
    ]  # fmt: skip


def test_an_unchanged_variable_is_stored_once_however_many_snapshots_hold_it(store):
    tid = store.create_trajectory()
    assert store.put_blob(b"the frame") == DF_BLOB
    ids = []
    for i in range(40):
        ids.append(store.add_execution(tid, {"source": f"i = {i}", "status": "ok"}))
        store.write_snapshot(ids[-1], _snapshot(i), mode="inline")
    conn = store._conn()
    # df and s once, i once per value: not 3 rows per snapshot.
    assert conn.execute("SELECT count(*) FROM variable_records").fetchone()[0] == 2 + 40
    assert conn.execute("SELECT count(*) FROM snapshot_variables").fetchone()[0] == 3 * 40
    for i, eid in enumerate(ids):
        got = store.get_variables(eid)
        want = sorted(_snapshot(i), key=lambda v: v["name"])
        assert [{k: v[k] for k in w} for v, w in zip(got, want, strict=True)] == want
        assert {v["snapshot_id"] for v in got} == {store.get_execution(eid)["snapshot_id"]}
    assert store.variable_changes(tid) == {"df": 0, "i": 39, "s": 0}
    assert store.latest_variables(tid)[1]["summary"] == {"repr": "39"}
    # One name twice in a snapshot is refused and writes nothing.
    extra = store.add_execution(tid, {"source": "x", "status": "ok"})
    with pytest.raises(ValueError, match="twice"):
        store.write_snapshot(extra, _snapshot(1) + [{"name": "i", "type": "float"}])
    assert store.get_snapshot(extra) is None
    assert store.get_execution(extra)["snapshot_status"] == "none"


def test_outputs_come_back_exactly_and_long_ones_are_stored_compressed(store):
    from jupyter_themisto import redaction
    from jupyter_themisto.dump.writer import execution_rows
    from jupyter_themisto.kernel.outputs import resolve_blob_refs

    png = bytes(range(256)) * 40
    digest = store.put_blob(png)
    long_text = "".join(f'line {n}: ünïcødé 🐍 \\ " \t\n' for n in range(500))
    cases = [
        [],
        [{"output_type": "stream", "name": "stdout", "text": "short\n"}],
        [{"output_type": "stream", "name": "stdout", "text": long_text}],
        [
            {"output_type": "execute_result", "execution_count": 3, "metadata": {},
             "data": {"text/plain": "x" * 300, "application/json": {"k": [1, 2.5, None]}}},
            {"output_type": "display_data", "metadata": {"image/png": {"width": 40}},
             "data": {"image/png": {"themisto_blob": digest, "bytes": len(png),
                                    "encoding": "base64"}, "text/plain": "<Figure>"}},
            {"output_type": "error", "ename": "E", "evalue": "v", "traceback": ["t"] * 100},
        ],
    ]  # fmt: skip
    tid = store.create_trajectory()
    ids = [
        store.add_execution(tid, {"source": f"cell({n})\n" * 50, "status": "ok", "outputs": o})
        for n, o in enumerate(cases)
    ]
    stored = dict(store._conn().execute("SELECT id, typeof(outputs) FROM executions"))
    assert [stored[i] for i in ids] == ["text", "text", "blob", "blob"]
    (packed,) = store._conn().execute("SELECT outputs FROM executions WHERE id = ?", ids[2:3])
    assert len(packed[0]) < len(json.dumps(cases[2])) / 5
    for eid, outputs, row in zip(ids, cases, store.list_executions(tid), strict=True):
        assert row["outputs"] == outputs == store.get_execution(eid)["outputs"]
    # The export gives what was recorded, byte for byte: the JSON text, and the image's
    # base64 as the kernel sent it.
    trajectory = store.get_trajectory(tid)
    rows = list(execution_rows(store, trajectory, "none", None, redaction.StoreRedactor(store)))
    for row, outputs in zip(rows, cases, strict=True):
        assert row["outputs"] == json.dumps(outputs, ensure_ascii=False)
        assert row["source"].startswith("cell(")
    image = resolve_blob_refs(json.loads(rows[3]["outputs"])[1], store.get_blob)
    assert image["data"]["image/png"] == base64.b64encode(png).decode("ascii")


SCHEMA_4_ROWS = """
INSERT INTO trajectories (id, notebook_path, started_at) VALUES ('t4', 'old.ipynb', 1.0);
INSERT INTO executions (id, trajectory_id, order_index, source, outputs, status, snapshot_id,
    snapshot_status) VALUES
    (1, 't4', 0, 'a = 1', '[{"output_type": "stream", "name": "stdout", "text": "1\\n"}]',
     'ok', 1, 'ok'),
    (2, 't4', 1, 'b = 2', '[]', 'ok', 2, 'ok'),
    (3, 't4', 2, 'a', '[]', 'ok', 3, 'unchanged');
INSERT INTO snapshots (id, execution_id, status, mode, created_at) VALUES
    (1, 1, 'ok', 'fork', 1.0), (2, 2, 'ok', 'fork', 2.0);
INSERT INTO snapshots (id, execution_id, status, mode, created_at, same_as) VALUES
    (3, 3, 'unchanged', NULL, 3.0, 2);
INSERT INTO blobs (hash, size, stored_size, codec, data) VALUES ('h1', 3, 3, 'raw', x'010203');
INSERT INTO variables (snapshot_id, name, type, size, summary, blob_hash, fingerprint,
    stub_reason, changed) VALUES
    (1, 'a', 'int', 3, '{"repr": "1"}', 'h1', 'f1', NULL, 1),
    (2, 'a', 'int', 3, '{"repr": "1"}', 'h1', 'f1', NULL, 0),
    (2, 'b', 'int', 3, '{"repr": "2"}', NULL, NULL, 'too large', 1);
"""


def test_a_store_of_schema_4_opens_migrates_and_reads_the_same(store_path):
    from jupyter_themisto.store.schema import MIGRATIONS

    store_path.parent.mkdir(parents=True)
    conn = sqlite3.connect(store_path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for step in MIGRATIONS[:4]:
        conn.executescript(step)
    conn.executescript(SCHEMA_4_ROWS)
    conn.execute("PRAGMA user_version = 4")
    conn.close()

    def read(store):
        return (
            store.list_executions("t4"),
            [store.get_variables(e) for e in (1, 2, 3)],
            store.variable_changes("t4"),
            store.latest_variables("t4"),
            store.snapshot_variables("t4", 2),
        )

    # Read-only (a server that does not migrate) reads the old layout...
    with TrajectoryStore(store_path, readonly=True) as old:
        before = read(old)
    assert before[0][0]["outputs"][0]["text"] == "1\n"
    assert [v["name"] for v in before[1][2]] == ["a", "b"]
    # ... and a writer migrates it, keeping every row.
    with TrajectoryStore(store_path) as store:
        assert read(store) == before
        conn = store._conn()
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 4096  # its own, kept
        assert conn.execute("SELECT count(*) FROM variable_records").fetchone()[0] == 2
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        # New snapshots share the migrated records.
        eid = store.add_execution("t4", {"source": "c = 3", "status": "ok"})
        store.write_snapshot(eid, [dict(v, changed=False) for v in before[1][0]])
        assert conn.execute("SELECT count(*) FROM variable_records").fetchone()[0] == 2
        assert store.get_variables(eid) == [dict(before[1][0][0], snapshot_id=4, changed=False)]


def test_pauses_and_resumes_are_noted_on_the_trajectory(store):
    tid = store.create_trajectory()
    fresh = store.get_trajectory(tid)
    assert (fresh["paused_at"], fresh["paused_after"], fresh["unrecorded_through"]) == (None,) * 3
    store.note_recording(tid, paused=True, execution_count=4)
    store.note_recording(tid, paused=True, execution_count=6)  # paused already: the first stays
    t = store.get_trajectory(tid)
    assert t["paused_at"] is not None and t["paused_after"] == 4
    store.note_recording(tid, paused=False, execution_count=9)
    store.note_recording(tid, paused=False, execution_count=7)  # never moves back
    t = store.get_trajectory(tid)
    assert (t["paused_at"], t["paused_after"], t["unrecorded_through"]) == (None, None, 9)
    store.note_recording(tid, paused=True, execution_count=None)  # a count unknown
    t = store.get_trajectory(tid)
    assert t["paused_at"] is not None and t["paused_after"] is None
    assert t["unrecorded_through"] == 9


def test_a_store_file_replaced_or_overwritten_is_not_intact_and_checking_keeps_locks(tmp_path):
    """intact() tells a store's file overwritten, replaced or deleted under an open store; and
    checking it keeps the store working beside other processes (it never closes a descriptor
    of the file: that would drop SQLite's POSIX locks, whose loss lost a kernel's rows here)."""
    import subprocess
    import sys

    path = tmp_path / "s.sqlite"
    store = TrajectoryStore(path)
    tid = store.create_trajectory()
    for _ in range(3):
        assert store.intact()
    visit = "import sqlite3, sys\nsqlite3.connect(sys.argv[1]).execute('SELECT 1').fetchall()\n"
    subprocess.run([sys.executable, "-c", visit, str(path)], check=True, timeout=60)
    store.add_execution(tid, {"source": "after the visit", "status": "ok"})
    count = (
        "import sqlite3, sys\n"
        "print(sqlite3.connect(sys.argv[1]).execute('SELECT count(*) FROM executions')"
        ".fetchone()[0])\n"
    )
    seen = subprocess.run(
        [sys.executable, "-c", count, str(path)], capture_output=True, text=True, timeout=60
    ).stdout
    assert seen.strip() == "1", seen
    # Replaced by another database (same name, another file).
    other = tmp_path / "other.sqlite"
    TrajectoryStore(other).close()
    os.replace(other, path)
    assert not store.intact()
    # Overwritten in place / deleted.
    second = TrajectoryStore(tmp_path / "t.sqlite")
    assert second.intact()
    with open(tmp_path / "t.sqlite", "r+b") as f:
        f.write(b"not a database!!")
    assert not second.intact()
    third = TrajectoryStore(tmp_path / "u.sqlite")
    (tmp_path / "u.sqlite").unlink()
    assert not third.intact()
