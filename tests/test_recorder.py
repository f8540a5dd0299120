"""The kernel recorder end to end: real ipykernel kernels, cells sent over the Jupyter protocol,
assertions on the trajectory store."""

from __future__ import annotations

import base64
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

from jupyter_themisto.kernel.outputs import (
    BLOB_KEY,
    OMITTED_MARKER,
    TRUNCATION_MARKER,
    resolve_blob_refs,
)
from jupyter_themisto.redaction import StoreRedactor
from jupyter_themisto.store import StoreError, TrajectoryStore

from .helpers import cli
from .recorder_kernel import NOTEBOOK, RecordingKernel, kernel_fixture

kernel = kernel_fixture("recorder", "--ThemistoRecorder.max_output_bytes=2000")


def test_trajectory_metadata(kernel):
    kernel.run("pass")
    # The writer thread creates the trajectory (package versions take a moment): let it.
    kernel.settle()
    with kernel.store() as store:
        (traj,) = store.list_trajectories()
    assert traj["notebook_path"] == NOTEBOOK
    assert traj["kernel_id"]
    assert traj["python_version"] == sys.version.split()[0]
    assert "ipykernel" in traj["packages"] and "numpy" in traj["packages"]
    assert traj["host"]["cpus"] >= 1


def test_order_cell_ids_and_output_kinds(kernel):
    before = len(kernel.executions())
    # Cells run in an order unlike the notebook's: c3, c1, c2, then c1 again.
    runs = [
        ("c3", "y = 40 + 2\ny"),
        ("c1", "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)"),
        ("c2", "raise ValueError('bad value')"),
        ("c1", "print('again')"),
    ]
    done = [kernel.run(code, cell_id) for cell_id, code in runs]
    rows = kernel.executions()[before:]
    assert [r["cell_id"] for r in rows] == ["c3", "c1", "c2", "c1"]
    assert [r["msg_id"] for r in rows] == [d.msg_id for d in done]
    assert [r["order_index"] for r in rows] == list(range(before, before + 4))
    counts = [r["execution_count"] for r in rows]
    assert counts == sorted(counts) and len(set(counts)) == 4

    result, streams, error, again = rows
    assert result["status"] == "ok"
    assert result["outputs"] == [
        {
            "output_type": "execute_result",
            "execution_count": result["execution_count"],
            "data": {"text/plain": "42"},
            "metadata": {},
        }
    ]
    assert streams["outputs"] == [
        {"output_type": "stream", "name": "stdout", "text": "to stdout\n"},
        {"output_type": "stream", "name": "stderr", "text": "to stderr\n"},
    ]
    assert error["status"] == "error"
    (err,) = error["outputs"]
    assert err["output_type"] == "error"
    assert err["ename"] == "ValueError" and err["evalue"] == "bad value"
    # The same traceback the person saw.
    assert err["traceback"] == done[2].of("error")[0]["traceback"]
    assert again["outputs"][0]["text"] == "again\n"
    assert [r["source"] for r in rows] == [code for _, code in runs]
    for row in rows:
        assert row["wall_time"] > 0 and row["cpu_time"] >= 0
        assert row["started_at"] > time.time() - 600
        assert row["memory_before"] > 10_000_000 and row["memory_after"] > 10_000_000
        assert row["memory_peak"] >= min(row["memory_before"], row["memory_after"])


def test_a_cell_that_runs_code_as_a_cell_is_one_execution(kernel):
    """`get_ipython().run_cell(...)` and `%rerun` run code as a cell inside a cell: the
    execution recorded is the outer cell, with all it showed, as the person saw it."""
    before = len(kernel.executions())
    outer = (
        "print('outer start')\n"
        "get_ipython().run_cell('inner = 5\\nprint(\"inner\")')\n"
        "print('outer end')"
    )
    done = [
        kernel.run(outer, "b"),
        kernel.run("print('cell c')", "c"),
        kernel.run("%rerun -l 1", "d"),
    ]
    rows = kernel.executions()[before:]
    assert [(r["cell_id"], r["source"]) for r in rows] == [
        ("b", outer),
        ("c", "print('cell c')"),
        ("d", "%rerun -l 1"),
    ]
    for row, d in zip(rows, done, strict=True):
        shown = "".join(c["text"] for c in d.of("stream"))
        assert "".join(o["text"] for o in row["outputs"]) == shown
        assert row["execution_count"] == d.reply["execution_count"]
    assert "outer start\ninner\nouter end" in rows[0]["outputs"][0]["text"]
    assert "=== Executing: ===" in rows[2]["outputs"][0]["text"]


def test_fd_level_output_and_per_cell_peak(kernel):
    done = kernel.run(
        "import os, time\nos.system('echo from a subprocess')\ntime.sleep(0.3)\n"
        "big = b'x' * 300_000_000\ndel big"
    )
    row = kernel.execution(done.msg_id)
    texts = "".join(o.get("text", "") for o in row["outputs"] if o["output_type"] == "stream")
    assert "from a subprocess" in texts
    # The 300 MB allocated and freed inside the cell shows in its peak, not in its after.
    assert row["memory_peak"] - row["memory_before"] > 250_000_000
    assert row["memory_peak"] - row["memory_after"] > 250_000_000


def test_matplotlib_png_goes_to_blob_store(kernel):
    done = kernel.run(
        "%matplotlib inline\nimport matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\nax.plot([1, 3, 2])\nplt.show()"
    )
    shown = done.of("display_data")
    assert shown and "image/png" in shown[0]["data"]
    row = kernel.execution(done.msg_id)
    (display,) = [o for o in row["outputs"] if o["output_type"] == "display_data"]
    ref = display["data"]["image/png"]
    assert set(ref) == {BLOB_KEY, "bytes", "encoding"}
    with kernel.store() as store:
        png = store.get_blob(ref[BLOB_KEY])
        assert png.startswith(b"\x89PNG") and len(png) == ref["bytes"]
        resolved = resolve_blob_refs(display, store.get_blob)
    assert resolved["data"]["image/png"].replace("\n", "") == shown[0]["data"]["image/png"].replace(
        "\n", ""
    )
    assert base64.b64decode(resolved["data"]["image/png"]) == png
    # No inline base64 in the stored row.
    assert len(json.dumps(row["outputs"])) < 2000


def test_long_output_is_truncated_visibly(kernel):
    done = kernel.run("print('x' * 10_000)")
    # The person still sees everything.
    assert sum(len(c["text"]) for c in done.of("stream")) == 10_001
    (out,) = kernel.execution(done.msg_id)["outputs"]
    assert out["text"].startswith("x" * 2000)
    assert TRUNCATION_MARKER.format(omitted=10_001 - 2000) in out["text"]


def test_invalid_settings_are_refused_and_recording_goes_on(kernel, tmp_path):
    recorder = "__import__('jupyter_themisto.kernel', fromlist=['get_recorder']).get_recorder()"
    pattern = kernel.value(f"{recorder}.secret_pattern")
    store_file = kernel.value(f"str({recorder}.store_file)")
    other = tmp_path / "other.sqlite"
    refused = [
        ("secret_pattern = '('", "invalid secret pattern '('"),
        ("max_output_bytes = 0", "max_output_bytes must be at least 1 (bytes), not 0"),
        ("max_output_bytes = -5", "max_output_bytes must be at least 1 (bytes), not -5"),
        ("max_execution_output_bytes = 0", "max_execution_output_bytes must be at least 1"),
        (f"store_path = {str(other)!r}", "store_path takes effect only when the kernel starts"),
    ]
    try:
        for setting, message in refused:
            done = kernel.run(f"%config ThemistoRecorder.{setting}")
            errors = "".join(o["text"] for o in done.of("stream") if o["name"] == "stderr")
            assert message in errors, (setting, errors)
        # The settings in use are kept.
        assert kernel.value(f"{recorder}.secret_pattern") == pattern
        assert kernel.value(f"{recorder}.max_output_bytes") == 2000
        assert kernel.value(f"{recorder}.max_execution_output_bytes") == 1048576
        assert kernel.value(f"{recorder}.store_path") == ""
        assert kernel.value(f"str({recorder}.store_file)") == store_file
        # ... and the recording goes on with them: the next cell is recorded, its secret
        # scrubbed and its long output cut at 2000 bytes, in the same store.
        after = kernel.run("api_key = 'BADPAT12345'\nprint('c2', api_key)\nprint('y' * 3000)")
        row = kernel.execution(after.msg_id)
        (out,) = row["outputs"]
        assert "BADPAT12345" not in out["text"] and "BADPAT12345" not in row["source"]
        head, marker = out["text"].split("\n[themisto: output truncated, ")
        assert len(head.encode()) == 2000 and marker.endswith(" bytes omitted]\n")
        assert not other.exists()
        # A valid setting is still taken.
        kernel.run("%config ThemistoRecorder.max_output_bytes = 1000")
        assert kernel.value(f"{recorder}.max_output_bytes") == 1000
    finally:
        kernel.run(
            f"%config ThemistoRecorder.secret_pattern = {pattern!r}\n"
            "%config ThemistoRecorder.max_output_bytes = 2000\n"
            "%config ThemistoRecorder.max_execution_output_bytes = 1048576\n"
            "%config ThemistoRecorder.store_path = ''"
        )


def test_display_bundles_whole_and_the_execution_bound(kernel):
    kernel.run("%config ThemistoRecorder.max_execution_output_bytes = 5000")
    try:
        done = kernel.run(
            "from IPython.display import HTML, display\n"
            "for i in range(5):\n"
            "    display(HTML(f'<b>{i}</b>' + 'h' * 1200))"
        )
    finally:
        kernel.run("%config ThemistoRecorder.max_execution_output_bytes = 1048576")
    seen = done.of("display_data")
    assert len(seen) == 5  # the person sees every display
    outputs = kernel.execution(done.msg_id)["outputs"]
    kept = [o for o in outputs if o["output_type"] == "display_data"]
    # Each kept display is its whole MIME bundle, as the person's frontend got it.
    assert [o["data"] for o in kept] == [m["data"] for m in seen[: len(kept)]]
    assert set(kept[0]["data"]) == {"text/html", "text/plain"}
    # The rest is over the execution's bound: omitted, and said so.
    assert 1 <= len(kept) < 5
    marker = OMITTED_MARKER.format(count=5 - len(kept), size=0).split("(")[0]
    assert outputs[-1]["output_type"] == "stream" and outputs[-1]["text"].startswith(marker)


def test_cpu_time_of_a_busy_cell(kernel):
    done = kernel.run("total = sum(i * i for i in range(3_000_000))")
    row = kernel.execution(done.msg_id)
    assert row["cpu_time"] > 0.05 and row["wall_time"] >= row["cpu_time"] * 0.5


def test_a_cell_patching_the_clock_does_not_change_the_recorded_times(kernel):
    # freezegun-style: the person's clock stops; the recorder's goes on.
    kernel.run("import time as _t\n_clocks = (_t.time, _t.perf_counter, _t.process_time)")
    before = time.time()
    normal = kernel.run("_t.sleep(0.2)")
    patched = kernel.run(
        "_t.time = _t.perf_counter = _t.process_time = lambda: 0.0\nfrozen = _t.time()"
    )
    try:
        frozen = kernel.run("_t.sleep(0.2)\nassert _t.time() == 0.0")
        assert frozen.reply["status"] == "ok"  # the patch holds for the person's code
        kernel.wait_snapshot(frozen.msg_id)  # taken (and its row written) while patched
    finally:
        kernel.run("_t.time, _t.perf_counter, _t.process_time = _clocks")
    after = time.time()
    assert patched.reply["status"] == "ok"
    rows = [kernel.wait_snapshot(d.msg_id) for d in (normal, patched, frozen)]
    for row in rows:
        assert before <= row["started_at"] <= after
    assert rows[0]["started_at"] <= rows[1]["started_at"] <= rows[2]["started_at"]
    # The wall time of the frozen cell is its sleep, as for the one before the patch.
    assert 0.2 <= rows[0]["wall_time"] < 60 and 0.2 <= rows[2]["wall_time"] < 60
    with kernel.store() as store:
        snapshot = store.get_snapshot(rows[2]["id"])
    assert snapshot is not None and before <= snapshot["created_at"] <= after


def test_interrupted_status(kernel):
    msg_id = kernel.send("import time\nprint('running', flush=True)\ntime.sleep(60)", "sleepy")
    # Wait until the cell's own code runs (its execute_input comes before the recorder's hooks:
    # an interrupt then could land before the cell started).
    deadline = time.monotonic() + 60
    while True:
        msg = kernel.kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            break
    time.sleep(0.5)  # what the wall time below must show
    kernel.km.interrupt_kernel()
    done = kernel.collect(msg_id)
    assert done.reply["status"] == "error"
    row = kernel.execution(msg_id)
    assert row["status"] == "interrupted"
    assert row["outputs"][-1]["ename"] == "KeyboardInterrupt"
    assert 0.3 < row["wall_time"] < 60
    # The kernel and the recorder go on.
    after = kernel.run("1 + 1")
    assert kernel.execution(after.msg_id)["status"] == "ok"


def test_load_twice_records_once_and_magic_pauses(kernel):
    kernel.run("%load_ext jupyter_themisto")
    kernel.run("%reload_ext jupyter_themisto")
    n = len(kernel.executions())
    kernel.run("z = 1")
    assert len(kernel.executions()) == n + 1
    status = kernel.run("%themisto status")
    assert "enabled: True" in status.of("stream")[0]["text"]
    kernel.run("%themisto off")
    n = len(kernel.executions())
    kernel.run("print('not recorded')")
    kernel.run("%themisto on")
    assert len(kernel.executions()) == n
    kernel.run("print('recorded')")
    assert kernel.executions()[-1]["source"] == "print('recorded')"


def test_reader_in_another_process_during_writes(kernel):
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from jupyter_themisto.store import StoreError, TrajectoryStore
                store = TrajectoryStore({str(kernel.store_path)!r}, readonly=True)
                seen, reads, end = [], 0, time.monotonic() + 120
                while time.monotonic() < end:
                    (t,) = store.list_trajectories()
                    rows = store.list_executions(t["id"], offset=0, limit=1000)
                    assert [r["order_index"] for r in rows] == list(range(len(rows)))
                    seen.append(len(rows))
                    reads += 1
                    if reads == 1:
                        print("ready", flush=True)  # (a read before any of the 25 cells)
                    if sys.stdin.closed or len(rows) >= int(sys.argv[1]):
                        break
                    time.sleep(0.005)
                print(reads, min(seen), max(seen))
                """
            ),
            str(len(kernel.executions()) + 25),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Cells only once the reader has read (its start-up may outlast 25 quick cells under load).
    assert reader.stdout.readline() == "ready\n"
    for i in range(25):
        kernel.run(f"v{i} = {i}\nprint(v{i})")
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    reads, low, high = map(int, out.split())
    assert reads >= 2 and high > low


def test_sigkill_mid_cell_leaves_store_intact(tmp_path):
    path = tmp_path / "killed.sqlite"
    k = RecordingKernel(path)
    try:
        for i in range(5):
            k.run(f"a{i} = list(range({i}))\nprint({i})")
        k.wait_snapshot(k.run("done = True").msg_id)
        k.send("import time\nwhile True: time.sleep(0.01)")
        time.sleep(1.0)
        os.kill(k.km.provisioner.pid, signal.SIGKILL)
        k.km.provisioner.process.wait(30)
    finally:
        k.kc.stop_channels()
        k.km.cleanup_resources()
    store = TrajectoryStore(path, readonly=True)
    assert store._conn().execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    (traj,) = store.list_trajectories()
    # Snapshot children outlive the kernel (own process group): let the last ones finish.
    deadline = time.monotonic() + 60
    while any(r["snapshot_status"] == "pending" for r in store.list_executions(traj["id"])):
        assert time.monotonic() < deadline, "snapshots still pending"
        time.sleep(0.1)
    rows = store.list_executions(traj["id"])
    assert len(rows) == 6
    assert [r["outputs"][0]["text"] for r in rows[:5]] == [f"{i}\n" for i in range(5)]
    # Cells sent back to back share snapshots (coalesced); none is torn.
    assert {r["snapshot_status"] for r in rows} <= {"ok", "partial", "skipped", "coalesced"}
    assert rows[-1]["snapshot_status"] in ("ok", "partial")


def test_unwritable_store_never_breaks_cells(tmp_path):
    path = tmp_path / "broken.sqlite"
    k = RecordingKernel(path)
    cells = [
        ("print('hello')", [("stream", {"name": "stdout", "text": "hello\n"})]),
        ("1 + 2", [("execute_result", {"text/plain": "3"})]),
        ("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))", None),
        ("raise KeyError('k')", None),
    ]
    try:
        healthy = [k.run(code) for code, _ in cells]
        k.wait_snapshot(healthy[-1].msg_id)
        # Break the store under the running kernel: garbage in the database and its log.
        for suffix in ("", "-wal"):
            target = path.with_name(path.name + suffix)
            if target.exists():
                with open(target, "r+b") as f:
                    f.write(b"not a database " * 4096)
        shm = path.with_name(path.name + "-shm")
        if shm.exists():
            shm.unlink()
        broken = [k.run(code) for code, _ in cells]
        for ok, bad in zip(healthy, broken, strict=True):
            assert _shown(bad) == _shown(ok)
            assert bad.reply["status"] == ok.reply["status"]
        assert broken[0].outputs == [("stream", {"name": "stdout", "text": "hello\n"})]
        # Nothing of the recorder's trouble reached the person.
        assert not any("themisto" in json.dumps(c) for b in broken for _, c in b.outputs)
        # The recorder did fail (and said so in the kernel's log, not in the cells), once its
        # writer has tried each of them.
        k.settle()
        status = k.run("%themisto status").of("stream")[0]["text"]
        assert int(status.split("errors: ")[1].split()[0]) >= len(cells)
        # Kept, to be written as 'lost' executions once the store takes writes again.
        assert int(status.split("lost_waiting: ")[1].split()[0]) >= len(cells)
        # The kernel is alive and its state intact.
        assert k.run("40 + 2").of("execute_result")[0]["data"]["text/plain"] == "42"
    finally:
        k.shutdown()
    with pytest.raises(sqlite3.DatabaseError):
        TrajectoryStore(path, readonly=True).list_trajectories()


def _kill(k: RecordingKernel) -> None:
    """End the kernel as a crash or the OOM killer would: no clean-up of its own."""
    try:
        os.kill(k.km.provisioner.pid, signal.SIGKILL)
        k.km.provisioner.process.wait(30)
    finally:
        k.kc.stop_channels()
        k.km.cleanup_resources()


def _sources(path) -> list[str]:
    store = TrajectoryStore(path, readonly=True)
    try:
        return [
            e["source"] for t in store.list_trajectories() for e in store.list_executions(t["id"])
        ]
    finally:
        store.close()


def test_a_removed_wal_loses_nothing(tmp_path):
    """A cell (or a sync tool) removes the store's WAL: what it held was seen by this kernel
    only and would go with it; the recorder puts it into the database and goes on."""
    path = tmp_path / "store.sqlite"
    k = RecordingKernel(path)
    before = [f"a{i} = {i}" for i in range(3)]
    remove = f"import os\nfor end in ('-wal', '-shm'): os.unlink({str(path)!r} + end)"
    after = [f"b{i} = {i}" for i in range(3)]
    try:
        for code in before:
            k.run(code)
        k.settle()
        k.run(remove)  # (the recorder may have opened a new WAL by the time the reply comes)
        for code in after:
            k.run(code)
        k.settle()
        # Another reader (the server, an export) sees every execution, those before included.
        assert _sources(path) == [*before, remove, *after]
        status = k.run("%themisto status").of("stream")[0]["text"]
        assert "lost_waiting: 0" in status and "WAL file was removed" in status
    finally:
        _kill(k)
    store = TrajectoryStore(path, readonly=True)
    assert store._conn().execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store.close()
    assert _sources(path)[:7] == [*before, remove, *after]


def test_cells_after_the_store_was_deleted_are_recorded_in_a_new_one(tmp_path):
    path = tmp_path / "store.sqlite"
    k = RecordingKernel(path)
    remove = f"import glob, os\nfor f in glob.glob({str(path)!r} + '*'): os.unlink(f)"
    try:
        k.run("a = 1")
        k.settle()
        k.run(remove)
        for i in range(3):
            k.run(f"b{i} = {i}")
        k.settle()
        status = k.run("%themisto status").of("stream")[0]["text"]
        assert "lost_waiting: 0" in status
        tid = status.split("trajectory_id: ")[1].split()[0]
        store = TrajectoryStore(path, readonly=True)
        (traj,) = store.list_trajectories()
        # The same trajectory, created again in the new file, holds every cell run after.
        assert traj["id"] == tid and traj["notebook_path"] == NOTEBOOK
        rows = store.list_executions(tid)
        assert [(r["source"], r["status"]) for r in rows if r["source"][0] == "b"] == [
            (f"b{i} = {i}", "ok") for i in range(3)
        ]
        # The cell that removed it: written in the new file too, as run or as lost.
        assert [r["status"] in ("ok", "lost") for r in rows if r["source"] == remove] == [True]
        assert [r["order_index"] for r in rows] == sorted({r["order_index"] for r in rows})
        store.close()
    finally:
        k.shutdown()


def test_a_store_deleted_while_a_write_waited_for_its_lock_loses_nothing_silently(tmp_path):
    """Another process holds the store's write lock; two cells run (their rows wait for the
    lock, their snapshot children for the rows); the store is deleted, then the lock freed.
    The first row, which the writer was retrying, went into the deleted file: it is a `lost`
    row in the new file (it vanished). The second row is written in the new file; its snapshot
    child, which had opened the deleted file, follows the path and writes the snapshot there
    (it waited 120 s for a row that never came to the deleted file, and the snapshot stayed
    `pending`)."""
    path = tmp_path / "store.sqlite"
    k = RecordingKernel(path)
    try:
        k.run("a = list(range(1000))")
        k.settle()
        kernel = psutil.Process(k.km.provisioner.pid)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        k.run("x = list(range(10))")
        deadline = time.monotonic() + 5
        while not kernel.children():  # its snapshot child waits for the row (in the file)
            assert time.monotonic() < deadline, "no snapshot child"
            time.sleep(0.05)
        y = k.run("y = list(range(20))").msg_id
        while len(kernel.children()) < 2:  # and the second's
            assert time.monotonic() < deadline + 5, "no second snapshot child"
            time.sleep(0.05)
        for f in tmp_path.glob("store.sqlite*"):
            f.unlink()
        holder.execute("ROLLBACK")
        holder.close()
        z = k.run("z = 3")
        assert z.reply["status"] == "ok"
        rows = {r["source"]: r for r in k.executions()}
        assert [(r["source"], r["status"]) for r in rows.values()] == [
            ("x = list(range(10))", "lost"),
            ("y = list(range(20))", "ok"),
            ("z = 3", "ok"),
        ]
        assert "replaced" in rows["x = list(range(10))"]["detail"]
        # Snapshots go on within seconds: y's taken (or merged into z's, which follows it).
        assert k.wait_snapshot(y, timeout=30)["snapshot_status"] in ("ok", "coalesced")
        assert k.wait_snapshot(z.msg_id, timeout=30)["snapshot_status"] == "ok"
        assert {"x", "y", "z"} <= set(k.variables(z.msg_id))
        # The child that had opened the deleted file followed the path and ended.
        deadline = time.monotonic() + 10
        while kernel.children():
            assert time.monotonic() < deadline, f"a snapshot child still waits: {kernel.children()}"
            time.sleep(0.1)
    finally:
        k.shutdown()


def test_a_secret_learnt_while_the_store_is_locked_reaches_the_store_once_it_is_free(tmp_path):
    """A cell binds a secret while another process holds the store's write lock, longer than
    the recorder waits: the value's keyed hash is written once the lock is freed, without a
    later cell, so the server scrubs it from what it sends a model. (It was dropped with a
    warning: a previewed `print(...)` of the value then reached the fallback model.)"""
    secret = "locked-planted-0021"
    path = tmp_path / "locked.sqlite"
    k = RecordingKernel(path, ["--ThemistoRecorder.store_busy_seconds=0.3"])
    try:
        k.run("a = 1")
        k.settle()
        holder = sqlite3.connect(path, timeout=0, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        k.run(f"api_key = {secret!r}")
        k.settle()  # the writer gave up on the lock (0.3 s)
        with TrajectoryStore(path, readonly=True) as store:
            assert store.secret_digest_count() == 0
        holder.execute("ROLLBACK")
        holder.close()
        deadline = time.monotonic() + 30  # (tried again every 5 s while idle)
        while True:
            with TrajectoryStore(path, readonly=True) as store:
                if store.secret_digest_count() or time.monotonic() > deadline:
                    redactor = StoreRedactor(store)
                    redactor.refresh()
                    scrubbed = redactor.scrub_text(f"print({secret!r})")
                    break
            time.sleep(0.2)
        assert secret not in scrubbed and scrubbed.startswith("print(")
        # The row waited too, and came back as a lost row in its place.
        assert [r["status"] for r in k.executions()] == ["ok", "lost"]
    finally:
        k.shutdown()


RECORDER = "__import__('jupyter_themisto.kernel', fromlist=['get_recorder']).get_recorder()"


@pytest.mark.parametrize("bound", ["64 MB", "1 byte"])
def test_a_snapshot_taken_while_the_store_is_locked_is_written_once_it_is_free(tmp_path, bound):
    """The execution's row is written, then another process holds the store's write lock past
    `store_busy_seconds` as the kernel snapshots the namespace itself: the snapshot waits in
    the kernel and is written once the lock is freed, without a later cell (it was dropped
    with a warning, its status `pending` for good, and the next snapshot reused its records).
    Past the bound on what waits, its variables are given up and it is noted `failed`; the
    next snapshot then holds every variable again."""
    path = tmp_path / "locked.sqlite"
    k = RecordingKernel(
        path,
        [
            "--ThemistoRecorder.store_busy_seconds=0.3",
            "--ThemistoRecorder.snapshot_delay=600",
            "--ThemistoRecorder.snapshot_max_deferral=600",
        ],
    )
    holder = None
    try:
        if bound == "1 byte":
            assert k.value(f"setattr({RECORDER}.writer, 'max_kept_bytes', 1)") is None
        k.run("a = 1")
        k.settle()
        done = k.run("b = [1, 2, 3]")
        deadline = time.monotonic() + 30
        while True:  # its row, written just after the reply (the snapshot is 600 s away)
            with TrajectoryStore(path, readonly=True) as store:
                row = store._conn().execute(
                    "SELECT snapshot_status FROM executions WHERE msg_id = ?", (done.msg_id,)
                )
                found = row.fetchone()
            if found is not None:
                break
            assert time.monotonic() < deadline, "the row was never written"
            time.sleep(0.05)
        assert found["snapshot_status"] == "pending"
        holder = sqlite3.connect(path, timeout=30, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        k.settle()  # the snapshot is taken now; the writer gives up on the lock after 0.3 s
        waiting = k.value(f"{RECORDER}.status()['writes_waiting']")
        given_up = k.value(f"{RECORDER}.status()['writes_given_up']")
        assert (waiting, given_up) == ((1, 0) if bound == "64 MB" else (1, 1))
        with TrajectoryStore(path, readonly=True) as store:
            (traj,) = store.list_trajectories()
            assert store.list_executions(traj["id"])[1]["snapshot_status"] == "pending"
        holder.execute("ROLLBACK")
        holder.close()
        holder = None
        deadline = time.monotonic() + 30  # (tried again every 5 s while idle)
        while k.value(f"{RECORDER}.status()['writes_waiting']"):
            assert time.monotonic() < deadline, "the snapshot still waits after the lock"
            time.sleep(0.2)
        rows = k.executions()
        assert [r["status"] for r in rows] == ["ok", "ok"]
        with TrajectoryStore(path, readonly=True) as store:
            snapshot = store.get_snapshot(rows[1]["id"])
            names = {v["name"] for v in store.get_variables(rows[1]["id"])}
        if bound == "64 MB":
            assert (rows[1]["snapshot_status"], snapshot["status"]) == ("ok", "ok")
            assert names == {"a", "b"}
        else:
            assert rows[1]["snapshot_status"] == "failed" and names == set()
            assert "stayed locked" in snapshot["detail"]
        # The next snapshot holds every variable (none reused from one never written).
        after = k.run("c = 3")
        assert set(k.variables(after.msg_id)) == {"a", "b", "c"}
        assert k.variables(after.msg_id)["b"]["summary"]["repr"] == "[1, 2, 3]"
    finally:
        if holder is not None:
            holder.close()
        k.shutdown()


def test_a_kernel_ending_with_writes_the_store_never_took_says_so(tmp_path):
    """Another process holds the store locked as the kernel shuts down: the executions kept
    for it end with the kernel, and its log says how many and why (it said nothing)."""
    path = tmp_path / "locked.sqlite"
    log = tmp_path / "kernel.log"
    with log.open("w") as stderr:
        k = RecordingKernel(path, ["--ThemistoRecorder.store_busy_seconds=0.3"], stderr=stderr)
        holder = None
        try:
            k.run("a = 1")
            k.settle()
            holder = sqlite3.connect(path, timeout=30, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            k.run("b = 2")
            k.run("c = 3")
            k.settle()
            k.kc.stop_channels()
            k.km.shutdown_wait_time = 60  # (not killed after 5 s on a loaded machine)
            k.km.shutdown_kernel(now=False)  # (atexit runs: a clean shutdown request)
        finally:
            if holder is not None:
                holder.close()
            if k.km.has_kernel:
                k.km.shutdown_kernel(now=True)
    said = [line for line in log.read_text().splitlines() if "never took" in line]
    assert len(said) == 1, log.read_text()[-2000:]
    assert "2 executions and " in said[0] and "database is locked" in said[0]


def test_a_relative_store_stays_where_it_was_when_a_cell_changes_directory(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    k = RecordingKernel(
        tmp_path / "work" / "store.sqlite", ["--ThemistoRecorder.store_path=store.sqlite"]
    )
    try:
        k.run("a = 1")
        k.run(f"import os\nos.chdir({str(tmp_path / 'elsewhere')!r})")
        k.run("b = 2")
        k.settle()
        assert _sources(tmp_path / "work" / "store.sqlite")[-2:] == [
            f"import os\nos.chdir({str(tmp_path / 'elsewhere')!r})",
            "b = 2",
        ]
        assert not list((tmp_path / "elsewhere").iterdir())
    finally:
        k.shutdown()


def _shown(done):
    """What the person saw, minus what differs between two runs of the same cell."""
    out = []
    for kind, content in done.outputs:
        content = dict(content)
        content.pop("execution_count", None)
        if kind == "error":
            content["traceback"] = [t.split("In[")[0] for t in content["traceback"]]
        out.append((kind, content))
    return out


def test_graceful_shutdown_right_after_a_cell_keeps_it(tmp_path):
    """`jupyter themisto record` shuts the kernel down right after the last reply."""
    path = tmp_path / "graceful.sqlite"
    k = RecordingKernel(path)
    try:
        k.run("import numpy as np")
        last = k.run("data = np.arange(1000)\nprint('last cell')")
    finally:
        k.kc.stop_channels()
        # Generous, so that a loaded machine does not make the manager SIGTERM the group.
        k.km.shutdown_wait_time = 30
        k.km.shutdown_kernel(now=False)
    with TrajectoryStore(path, readonly=True) as store:
        (traj,) = store.list_trajectories()
        rows = store.list_executions(traj["id"])
        assert rows[-1]["msg_id"] == last.msg_id
        assert rows[-1]["outputs"][0]["text"] == "last cell\n"
        # The snapshot child may outlive the kernel by a moment; it finishes on its own.
        deadline = time.monotonic() + 60
        while store.get_execution(rows[-1]["id"])["snapshot_status"] == "pending":
            assert time.monotonic() < deadline, "snapshot still pending"
            time.sleep(0.1)
        snap = store.get_snapshot(rows[-1]["id"])
        assert snap["status"] == "ok", snap["detail"]
        assert {v["name"] for v in store.get_variables(rows[-1]["id"])} == {"data"}


def test_store_that_cannot_be_opened_at_load(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    k = RecordingKernel(blocker / "trajectories.sqlite")
    try:
        done = k.run("print('still works')\n6 * 7")
        assert done.outputs == [
            ("stream", {"name": "stdout", "text": "still works\n"}),
            (
                "execute_result",
                {"data": {"text/plain": "42"}, "metadata": {}, "execution_count": 1},
            ),
        ]
        k.settle()  # the writer has tried (and failed) to record the cell
        status = k.run("%themisto status").of("stream")[0]["text"]
        assert "store: None" in status
        assert int(status.split("errors: ")[1].split()[0]) >= 1
        # The writer records each execution just after the reply: let it try (and fail) for
        # the status cell too before the folder can be made.
        k.settle()
        # The folder can be made now: the trajectory starts, with what ran before as 'lost'.
        blocker.unlink()
        after = k.run("x = 1")
        rows = k.executions()
    finally:
        k.shutdown()
    assert [r["msg_id"] for r in rows][0] == done.msg_id and rows[-1]["msg_id"] == after.msg_id
    assert [r["status"] for r in rows] == ["lost", "lost", "ok"]
    assert rows[0]["source"] == "print('still works')\n6 * 7"
    assert "cannot open the trajectory store" in rows[0]["detail"]


def test_a_trajectory_the_store_refused_at_start_is_created_without_waiting_for_a_cell(tmp_path):
    # The server (and the browser through it) learns that a kernel is recorded from its
    # trajectory. One the store refused as the kernel started is retried while idle, not only
    # when the person's first cell gives the writer something to write.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    k = RecordingKernel(blocker / "trajectories.sqlite")
    try:
        k.settle()  # the writer has tried (and failed) to create the trajectory
        assert not (blocker / "trajectories.sqlite").exists()
        blocker.unlink()
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while not found and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                with k.store() as store:
                    found = store.list_trajectories()
            except (StoreError, sqlite3.Error, OSError):
                pass  # not made yet, or being made
        rows = k.executions()  # (its settle runs no cell)
    finally:
        k.shutdown()
    assert [t["notebook_path"] for t in found] == [NOTEBOOK]
    assert rows == []


def test_executions_while_the_store_is_locked_come_back_as_lost_rows(tmp_path):
    path = tmp_path / "locked.sqlite"
    k = RecordingKernel(path, ["--ThemistoRecorder.store_busy_seconds=0.3"])
    try:
        before = k.run("a = 1")
        k.settle()
        # Another process holds the write lock (readers still read: WAL).
        blocker = sqlite3.connect(path, timeout=0, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        blocker.execute("CREATE TABLE squatter (x)")
        held = [k.run(f"print('held {i}')\nb{i} = {i}") for i in range(3)]
        # The person sees everything as usual.
        assert [h.of("stream")[0]["text"] for h in held] == [f"held {i}\n" for i in range(3)]
        # Each held write waits store_busy_seconds before it counts as lost: more, under load,
        # than the 2 s the status waits for the writer.
        k.settle()
        status = k.run("%themisto status").of("stream")[0]["text"]
        assert int(status.split("lost_waiting: ")[1].split()[0]) >= 3
        blocker.execute("ROLLBACK")
        blocker.close()
        # No new cell needed: the writer tries again while idle.
        deadline = time.monotonic() + 60
        while True:
            with TrajectoryStore(path, readonly=True) as store:
                (traj,) = store.list_trajectories()
                rows = store.list_executions(traj["id"])
            if len(rows) >= 5 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        after = k.run("c = 3")
        rows = k.executions()
    finally:
        k.shutdown()
    # Every execution has its row, in the order they ran; the held ones say what happened.
    assert [r["msg_id"] for r in rows] == [
        before.msg_id,
        *(h.msg_id for h in held),
        rows[4]["msg_id"],  # the %themisto status cell
        after.msg_id,
    ]
    assert [r["order_index"] for r in rows] == list(range(6))
    lost = rows[1:4]
    assert {r["status"] for r in lost} == {"lost"}
    assert all("locked" in r["detail"] for r in lost)
    assert [r["source"] for r in lost] == [f"print('held {i}')\nb{i} = {i}" for i in range(3)]
    assert all(r["outputs"] == [] and r["wall_time"] > 0 for r in lost)
    assert rows[0]["status"] == rows[-1]["status"] == "ok"
    # The export carries them.
    out = tmp_path / "dump"
    done = cli("export", "--out", str(out), store=path)
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in (out / "executions.jsonl").read_text().splitlines()]
    assert [e["status"] for e in exported][1:4] == ["lost"] * 3
    assert "locked" in exported[1]["detail"]


def test_the_writer_opens_and_closes_its_store_only_while_no_fork_can_happen(tmp_path):
    """Opening a store writes (schema, WAL mode) and closing one may checkpoint: a snapshot
    child forked meanwhile inherits SQLite's per-file lock state as its own, and never gets
    the write lock itself (its snapshot stayed `pending`). The writer does both under
    `fork_lock`, which the kernel takes to fork: here the file is deleted under it, so that
    it closes the store and opens a new one."""
    from jupyter_themisto.kernel.writer import RecordWriter

    held: list[tuple[str, bool]] = []
    path = tmp_path / "t.sqlite"
    writer: RecordWriter

    class Store(TrajectoryStore):
        def close(self) -> None:
            held.append(("close", writer.fork_lock.locked()))
            super().close()

    def open_store(timeout: float) -> TrajectoryStore:
        held.append(("open", writer.fork_lock.locked()))
        return Store(path, timeout=timeout)

    writer = RecordWriter(open_store, report=lambda what, e: None)
    fallback = {"source": "", "status": "ok"}

    def prepare(source):
        return lambda put_blob: {"source": source, "status": "ok", "outputs": []}

    try:
        writer.create_trajectory("t1", lambda: {})
        writer.add_execution("t1", 0, prepare("a = 1"), fallback=fallback, direct=False)
        assert writer.wait_idle(30)
        for f in tmp_path.glob("t.sqlite*"):
            f.unlink()
        writer.add_execution("t1", 1, prepare("b = 2"), fallback=fallback, direct=False)
        writer.add_execution("t1", 2, prepare("c = 3"), fallback=fallback, direct=False)
        assert writer.wait_idle(30)
    finally:
        writer.close()
    assert [what for what, _ in held] == ["open", "close", "open"]
    assert all(locked for _, locked in held), held
    with TrajectoryStore(path) as store:
        rows = store.list_executions("t1")
    assert [(r["source"], r["status"]) for r in rows] == [("", "lost"), ("c = 3", "ok")]


def test_large_outputs_are_written_off_the_kernel_thread(tmp_path):
    """An execution with large outputs is prepared (decoded, hashed, compressed) and written by
    the writer thread even when nothing waits; a small one right there, on the caller's."""
    import threading

    from jupyter_themisto.kernel.recorder import _large
    from jupyter_themisto.kernel.writer import RecordWriter

    big_png = base64.b64encode(b"\x89PNG" + os.urandom(120_000)).decode()
    assert _large([{"output_type": "display_data", "data": {"image/png": big_png}}])
    assert _large([{"output_type": "stream", "name": "stdout", "_parts": ["x" * 60_000] * 2}])
    assert not _large([{"output_type": "execute_result", "data": {"text/plain": "1"}}])

    errors = []
    writer = RecordWriter(
        lambda timeout: TrajectoryStore(tmp_path / "t.sqlite", timeout=timeout),
        report=lambda what, e: errors.append((what, e)),
    )
    try:
        writer.create_trajectory("t1", lambda: {})
        assert writer.wait_idle(30)
        threads = {}

        def prepare(order):
            def build(put_blob):
                threads[order] = threading.get_ident()
                return {"source": f"cell {order}", "status": "ok", "outputs": []}

            return build

        fallback = {"source": "", "status": "ok"}
        writer.add_execution("t1", 0, prepare(0), fallback=fallback)
        writer.add_execution("t1", 1, prepare(1), fallback=fallback, direct=False)
        assert writer.wait_idle(30)
        writer.add_execution("t1", 2, prepare(2), fallback=fallback)
        assert writer.wait_idle(30)
    finally:
        writer.close()
    me = threading.get_ident()
    assert threads[0] == me and threads[1] != me and threads[2] == me
    with TrajectoryStore(tmp_path / "t.sqlite") as store:
        rows = store.list_executions("t1")
    assert [r["source"] for r in rows] == ["cell 0", "cell 1", "cell 2"] and not errors


def test_a_job_kept_for_a_locked_store_runs_before_the_rows_after_it(tmp_path):
    """A `retried` job (the recorder's secrets' hashes) that found the store locked is kept, and
    runs again before the rows handed over after it: a server that sees a row knows the
    secrets learnt before it."""
    from jupyter_themisto.kernel.writer import RecordWriter

    path = tmp_path / "t.sqlite"
    errors: list[Any] = []
    writer = RecordWriter(
        lambda timeout: TrajectoryStore(path, timeout=timeout),
        report=lambda what, e: errors.append((what, e)),
        locked_retry_seconds=0.2,
        retry_seconds=0.2,
    )
    ran: list[Any] = []

    def job(store: Any) -> None:
        row = store.execution_id("t1", 0)
        store.add_secret_digests([("ab" * 16, 20, False)])
        ran.append(row)  # (once it wrote: the row there then, or None)

    holder = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        writer.create_trajectory("t1", lambda: {})
        assert writer.wait_idle(30)
        holder.execute("BEGIN IMMEDIATE")
        writer.submit(job, retried=True)
        row = {"source": "print(secret)", "status": "ok", "outputs": []}
        writer.add_execution("t1", 0, lambda put_blob: row, fallback=row)
        assert writer.wait_idle(30)
        assert ran == [] and len(writer.lost) == 1  # both waited past the lock
        holder.execute("ROLLBACK")
        deadline = time.monotonic() + 30
        while writer.lost or not ran:
            assert time.monotonic() < deadline, "nothing written after the lock was freed"
            time.sleep(0.05)
    finally:
        holder.close()
        writer.close()
    assert ran == [None]
    with TrajectoryStore(path, readonly=True) as store:
        assert [r["status"] for r in store.list_executions("t1")] == ["lost"]
        assert store.secret_digest_count() == 1


def test_jobs_kept_for_a_locked_store_run_in_order_within_their_bound(tmp_path):
    """Jobs kept for a locked store run in the order they were handed over, before a job
    handed over later; past `max_kept_bytes` the oldest job holding data gives its place to
    its stand-in, one without a stand-in is dropped, and jobs holding nothing stay."""
    from jupyter_themisto.kernel.writer import RecordWriter

    path = tmp_path / "t.sqlite"
    errors: list[Any] = []
    writer = RecordWriter(
        lambda timeout: TrajectoryStore(path, timeout=timeout),
        report=lambda what, e: errors.append(f"{what}: {e}"),
        locked_retry_seconds=0.2,
        retry_seconds=0.2,
        max_kept_bytes=250,
    )
    ran: list[str] = []

    def job(name: str) -> Any:
        def run(store: Any) -> None:
            store.note_recording("t1", paused=False)  # a write: it needs the lock
            ran.append(name)

        return run

    holder = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        writer.create_trajectory("t1", lambda: {})
        assert writer.wait_idle(30)
        holder.execute("BEGIN IMMEDIATE")
        writer.submit(job("big 1"), retried=True, size=100, instead=job("instead of big 1"))
        writer.submit(job("status 1"), retried=True)
        writer.submit(job("big 2"), retried=True, size=100)
        writer.submit(job("big 3"), retried=True, size=100, instead=job("instead of big 3"))
        writer.submit(job("big 4"), retried=True, size=100)
        assert writer.wait_idle(30)
        assert ran == [] and writer.waiting() == 4
        assert (writer.kept_replaced, writer.kept_dropped) == (1, 1)
        assert any("given up" in e and "250 bytes" in e for e in errors), errors
        holder.execute("ROLLBACK")
        writer.submit(job("after"), retried=True)
        deadline = time.monotonic() + 30
        while writer.waiting() or "after" not in ran:
            assert time.monotonic() < deadline, "nothing written after the lock was freed"
            time.sleep(0.05)
    finally:
        holder.close()
        writer.close()
    assert ran == ["instead of big 1", "status 1", "big 3", "big 4", "after"]


def test_wait_idle_returns_only_once_everything_handed_over_is_done(tmp_path):
    """`settle()` (and every test that reads the store after it) trusts wait_idle: it may not
    return while a job handed over is still queued, even one handed over just as the thread
    finished the one before and was marking itself idle (a moment a loaded machine may pick:
    here it is picked on purpose)."""
    import threading

    from jupyter_themisto.kernel.writer import RecordWriter

    writer = RecordWriter(
        lambda timeout: TrajectoryStore(tmp_path / "t.sqlite", timeout=timeout),
        report=lambda what, e: None,
    )
    marking_idle, handed_over, done = threading.Event(), threading.Event(), threading.Event()

    class Idle(threading.Event):
        def set(self) -> None:
            if threading.current_thread().name == "themisto-writer" and not marking_idle.is_set():
                marking_idle.set()
                handed_over.wait(2)  # (in vain if handing over waits for this thread)
            super().set()

    writer._idle = Idle()
    writer._idle.set()

    def slow_job(store) -> None:
        time.sleep(0.3)  # long enough for a wrong "idle" to be seen before it is done
        done.set()

    result: list[bool] = []

    def kernel_thread() -> None:
        # Not the writer's owner thread: each job goes through the queue.
        writer.submit(lambda store: None)
        assert marking_idle.wait(30)
        writer.submit(slow_job)
        handed_over.set()
        result.append(writer.wait_idle(30) and done.is_set())

    try:
        worker = threading.Thread(target=kernel_thread)
        worker.start()
        worker.join(60)
    finally:
        writer.close()
    assert result == [True]
