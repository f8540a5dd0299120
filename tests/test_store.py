"""The trajectory store on its own: schema, order, blobs, snapshots, concurrent readers."""

from __future__ import annotations

import multiprocessing
import sqlite3

import pytest

from jupyter_themisto.store import SCHEMA_VERSION, StoreError, TrajectoryStore, blob_hash


def test_new_store_is_migrated_and_in_wal_mode(store_path):
    store = TrajectoryStore(store_path)
    conn = sqlite3.connect(store_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


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
