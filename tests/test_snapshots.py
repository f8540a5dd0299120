"""Namespace snapshots taken by the recorder in a real kernel (fork mode, and inline)."""

from __future__ import annotations

import os
import pickle
import signal
import sqlite3
import time
import types

import numpy as np
import pytest
import zstandard

from jupyter_themisto.store import TrajectoryStore

from .recorder_kernel import RecordingKernel, kernel_fixture

SECRET = "hunter2-" + "s3cr3t-" + "v4lue"


# Cells here come faster than a loaded machine may finish snapshots: no skipping.
# What the fork child does: no snapshot taken by the kernel itself (see test_small_...).
kernel = kernel_fixture(
    "snapshots",
    "--ThemistoRecorder.max_snapshot_children=16",
    "--ThemistoRecorder.small_snapshot_seconds=0",
)


def test_summaries_of_common_values(kernel):
    done = kernel.run(
        "import numpy as np, pandas as pd\n"
        "items = [1, 2, 3]\n"
        "config = {'lr': 0.1, 'epochs': 3}\n"
        "arr = np.arange(12, dtype='float32').reshape(3, 4)\n"
        "df = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y'], 'c': [0.5, 1.5]})\n"
        "def helper(x):\n    return x + 1\n"
    )
    v = kernel.variables(done.msg_id)
    # What %who shows: no modules (np, pd), no IPython names (In, Out, _), no recorder objects.
    assert set(v) == {"items", "config", "arr", "df", "helper"}
    assert v["items"]["type"] == "list" and v["items"]["summary"]["len"] == 3
    assert v["items"]["summary"]["repr"] == "[1, 2, 3]"
    assert v["config"]["summary"]["len"] == 2
    assert v["arr"]["type"] == "numpy.ndarray"
    assert v["arr"]["summary"]["shape"] == [3, 4] and v["arr"]["summary"]["dtype"] == "float32"
    assert v["df"]["type"] == "pandas.DataFrame"
    assert v["df"]["summary"]["columns"] == ["a", "b", "c"]
    assert v["df"]["summary"]["dtypes"]["a"] == "int64"
    assert v["df"]["summary"]["dtypes"]["c"] == "float64"
    assert v["df"]["summary"]["shape"] == [2, 3]
    # The blobs hold the values themselves.
    with kernel.store() as store:
        assert pickle.loads(store.get_blob(v["items"]["blob_hash"])) == [1, 2, 3]
        arr = pickle.loads(store.get_blob(v["arr"]["blob_hash"]))
        assert np.array_equal(arr, np.arange(12, dtype="float32").reshape(3, 4))
        assert store.get_snapshot(kernel.execution(done.msg_id)["id"])["mode"] == "fork"


def test_unchanged_variables_cost_no_new_blob(kernel):
    first = kernel.run("big = np.random.default_rng(0).random((500, 400))\nnames = ['a'] * 1000")
    v1 = kernel.variables(first.msg_id)
    with kernel.store() as store:
        blobs_before = store.blob_stats()["count"]
    steps = []
    for i in range(3):
        steps.append(kernel.run(f"counter = {i}"))
        kernel.wait_snapshot(steps[-1].msg_id)
    for step in steps:
        v = kernel.variables(step.msg_id)
        for name in ("big", "names", "items", "arr", "df"):
            assert v[name]["blob_hash"] == v1[name]["blob_hash"]
            assert v[name]["changed"] is False
        assert v["big"]["fingerprint"] == v1["big"]["fingerprint"] is not None
    # The array's fingerprint hashes its buffer (not its pickle): the unchanged array was
    # recognised without being serialized again.
    assert not v1["big"]["fingerprint"].startswith("pickle:")
    with kernel.store() as store:
        # Only the new small `counter` values were stored.
        assert store.blob_stats()["count"] - blobs_before <= 3
    changed = kernel.run("big[0, 0] = -1.0")
    v = kernel.variables(changed.msg_id)
    assert v["big"]["changed"] is True
    assert v["big"]["blob_hash"] != v1["big"]["blob_hash"]
    assert v["big"]["fingerprint"] != v1["big"]["fingerprint"]
    assert v["names"]["changed"] is False


def test_unpicklables_become_stubs_and_files_are_untouched(kernel, tmp_path):
    target = tmp_path / "user-file.txt"
    done = kernel.run(
        "import socket, threading\n"
        f"fh = open({str(target)!r}, 'w')\n"
        "fh.write('abc')  # buffered, not flushed\n"
        "sock = socket.socket()\n"
        "lock = threading.Lock()\n"
        "gen = (i for i in range(3))\n"
        "bag = [1, fh]\n"
        "fn = lambda x: x * 2\n"
    )
    v = kernel.variables(done.msg_id)
    assert "file object" in v["fh"]["stub_reason"] and v["fh"]["blob_hash"] is None
    assert "file object" in v["bag"]["stub_reason"]
    assert v["sock"]["stub_reason"] == "socket"
    assert v["lock"]["stub_reason"] == "lock"
    assert v["gen"]["stub_reason"] == "generator"
    assert v["gen"]["summary"]["repr"].startswith("<generator object")
    # pickle refuses a lambda; dill takes it.
    assert v["fn"]["blob_hash"] and v["fn"]["summary"]["codec"] == "dill"
    assert kernel.wait_snapshot(done.msg_id)["snapshot_status"] == "partial"
    kernel.run("fh.close(); sock.close()")
    # The snapshot child never flushed the person's buffer: written once, by the person.
    assert target.read_text() == "abc"


def test_secrets_are_redacted_everywhere(kernel):
    parts = SECRET.split("-")
    done = kernel.run(
        f"api_token = '-'.join({parts!r})\n"
        "settings = {'db': {'password': api_token}}\n"
        "print('token is', api_token)\n"
        "api_token"
    )
    v = kernel.variables(done.msg_id)
    assert v["api_token"]["stub_reason"].startswith("redacted")
    assert v["api_token"]["summary"] == {"redacted": True}
    assert v["api_token"]["blob_hash"] is None and v["api_token"]["fingerprint"] is None
    assert v["settings"]["stub_reason"].startswith("redacted") and not v["settings"]["blob_hash"]
    row = kernel.execution(done.msg_id)
    assert "<redacted>" in row["outputs"][0]["text"]
    literal = kernel.run(f"GITHUB_TOKEN = {SECRET!r}")
    assert kernel.execution(literal.msg_id)["source"] == "GITHUB_TOKEN = '<redacted>'"
    kernel.wait_snapshot(literal.msg_id)
    # Nowhere in the database's bytes, nor in any (decompressed) blob.
    raw = b"".join(
        p.read_bytes()
        for p in kernel.store_path.parent.iterdir()
        if p.name.startswith(kernel.store_path.name)
    )
    assert SECRET.encode() not in raw
    conn = sqlite3.connect(kernel.store_path)
    try:
        for codec, data in conn.execute("SELECT codec, data FROM blobs"):
            blob = zstandard.ZstdDecompressor().decompress(data) if codec == "zstd" else data
            assert SECRET.encode() not in blob
    finally:
        conn.close()


def test_matplotlib_objects_are_summarized(kernel):
    done = kernel.run(
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nfig, axes = plt.subplots(1, 2)"
    )
    v = kernel.variables(done.msg_id)
    assert v["fig"]["stub_reason"].startswith("matplotlib object")
    assert v["axes"]["stub_reason"].startswith("matplotlib object")
    again = kernel.variables(kernel.run("counter = 99").msg_id)
    assert again["fig"]["changed"] is False


def test_size_bound_and_inline_mode(kernel):
    kernel.run("%config ThemistoRecorder.max_variable_bytes = 1_000_000")
    kernel.run("%config ThemistoRecorder.snapshot_mode = 'inline'")
    done = kernel.run(
        "import numpy as np\nhuge = np.zeros(2_000_000)\nhuge_list = list(range(300_000))"
    )
    # Inline: the snapshot is written in the kernel itself, right after the reply.
    row = kernel.execution(done.msg_id)
    assert row["snapshot_status"] in ("ok", "partial")
    with kernel.store() as store:
        assert store.get_snapshot(row["id"])["mode"] == "inline"
        v = {x["name"]: x for x in store.get_variables(row["id"])}
    assert v["huge"]["stub_reason"].startswith("too large") and v["huge"]["blob_hash"] is None
    assert v["huge"]["summary"]["shape"] == [2_000_000]
    assert v["huge_list"]["stub_reason"].startswith("too large")
    kernel.run("%config ThemistoRecorder.snapshot_mode = 'off'")
    off = kernel.run("after_off = 1")
    assert kernel.execution(off.msg_id)["snapshot_status"] == "off"
    kernel.run("%config ThemistoRecorder.snapshot_mode = 'fork'")


def test_a_variable_too_slow_to_serialize_is_summarized(kernel):
    kernel.run("%config ThemistoRecorder.max_variable_seconds = 0.5")
    try:
        done = kernel.run(
            "import time\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            "        time.sleep(5)\n"
            "        return (Slow, ())\n"
            "slow = Slow()\n"
            "quick = 7"
        )
        kernel.wait_snapshot(done.msg_id)
    finally:
        kernel.run("%config ThemistoRecorder.max_variable_seconds = 5.0")
    row = kernel.execution(done.msg_id)
    v = kernel.variables(done.msg_id)
    assert v["slow"]["stub_reason"].startswith("too slow") and v["slow"]["blob_hash"] is None
    assert v["slow"]["summary"]["repr"].startswith("<__main__.Slow object")
    assert v["quick"]["blob_hash"] is not None  # the others are stored as usual
    assert row["snapshot_status"] == "partial"


def test_child_bound_skips_then_waits_when_configured(tmp_path):
    # Each execution snapshots right after its reply (no coalescing of back-to-back cells).
    k = RecordingKernel(
        tmp_path / "bound.sqlite",
        ["--ThemistoRecorder.max_snapshot_children=1", "--ThemistoRecorder.snapshot_delay=0"],
    )
    # The first child serializes until the test lets it (a loaded machine may take longer than
    # any fixed time between two replies), then 1.5 s more.
    go = tmp_path / "go"
    try:
        slow = k.run(
            "import os, time\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            "        end = time.monotonic() + 120\n"
            f"        while not os.path.exists({str(go)!r}) and time.monotonic() < end:\n"
            "            time.sleep(0.01)\n"
            "        time.sleep(1.5)\n"
            "        return (Slow, ())\n"
            "s = Slow()"
        )
        quick = k.run("a = 1")
        row = k.wait_snapshot(quick.msg_id)
        go.touch()
        assert row["snapshot_status"] == "skipped"
        with k.store() as store:
            assert "max_snapshot_children=1" in store.get_snapshot(row["id"])["detail"]
        assert k.wait_snapshot(slow.msg_id)["snapshot_status"] == "ok"
        k.run("%config ThemistoRecorder.snapshot_slot_wait = 60")
        k.run("s2 = Slow()")
        waited = [k.run(f"b = {i}") for i in range(2)]
        for done in waited:
            assert k.wait_snapshot(done.msg_id)["snapshot_status"] == "ok"
    finally:
        go.touch()
        k.shutdown()


def _recorder_value(k, expr):
    """Evaluate an expression about the kernel's recorder (`_r`)."""
    return k.value(
        "(_r := __import__('jupyter_themisto.kernel', fromlist=['x']).get_recorder())" + expr
    )


def test_cells_sent_at_once_share_one_snapshot(kernel):
    # The kernel waits 50 ms after a reply before it snapshots; a loaded machine can take
    # longer than that between two queued requests (in the client, or in the kernel before it
    # reads the next one): given longer, a snapshot still due always gives way to the next cell.
    kernel.run("%config ThemistoRecorder.snapshot_delay = 30.0")
    try:
        kernel.run("ready = 1")
        kernel.settle()
        # As "Run All" does: every request is queued before the first reply.
        ids = [kernel.send(f"batch_{i} = {i}") for i in range(6)]
        for msg_id in ids:
            kernel.collect(msg_id)
        rows = [kernel.wait_snapshot(msg_id) for msg_id in ids]
    finally:
        kernel.run("%config ThemistoRecorder.snapshot_delay = 0.05")
    statuses = [r["snapshot_status"] for r in rows]
    # The last one is snapshotted; the others (all but perhaps the first, if its reply found
    # the kernel idle) gave way to it.
    assert statuses[-1] in ("ok", "partial"), statuses
    assert statuses[1:-1].count("coalesced") == 4, statuses
    with kernel.store() as store:
        names = {v["name"] for v in store.get_variables(rows[-1]["id"])}
    assert {f"batch_{i}" for i in range(6)} <= names


def test_a_cell_that_only_reads_takes_no_fork(kernel):
    first = kernel.run("seen = [1, 2, 3]\nlabel = 'x'")
    kernel.wait_snapshot(first.msg_id)
    forks = _recorder_value(kernel, ".snapshots.counts.get('fork', 0)")
    rows = [
        kernel.wait_snapshot(kernel.run(code).msg_id)
        for code in ("print(len(seen), label.upper())", "seen")
    ]
    assert [r["snapshot_status"] for r in rows] == ["unchanged", "unchanged"]
    assert _recorder_value(kernel, ".snapshots.counts.get('fork', 0)") == forks
    with kernel.store() as store:
        snap = store.get_snapshot(rows[1]["id"])
        assert snap["same_as"] == kernel.execution(first.msg_id)["id"]
        v = {x["name"]: x for x in store.get_variables(rows[1]["id"])}
    # The variables are those of the execution it is the same as, unchanged.
    assert v["seen"]["summary"]["repr"] == "[1, 2, 3]" and v["seen"]["changed"] is False
    # A change in place (no new binding) is seen, and snapshotted.
    changed = kernel.run("seen.append(4)")
    row = kernel.wait_snapshot(changed.msg_id)
    assert row["snapshot_status"] in ("ok", "partial")
    v = kernel.variables(changed.msg_id)
    assert v["seen"]["summary"]["repr"] == "[1, 2, 3, 4]" and v["seen"]["changed"] is True


def test_a_killed_snapshot_child_marks_its_snapshot_failed(tmp_path):
    k = RecordingKernel(tmp_path / "killed.sqlite", ["--ThemistoRecorder.max_variable_seconds=120"])
    try:
        done = k.run(
            "import time\n"
            "class Sleepy:\n"
            "    def __reduce__(self):\n"
            "        time.sleep(60)\n"
            "        return (Sleepy, ())\n"
            "sleepy = Sleepy()"
        )
        k.settle()  # the snapshot child is running now
        (pid,) = _recorder_value(k, ".snapshots.children and list(_r.snapshots.children)")
        assert k.execution(done.msg_id)["snapshot_status"] == "pending"
        os.kill(pid, signal.SIGKILL)
        row = k.wait_snapshot(done.msg_id, timeout=30)
        assert row["snapshot_status"] == "failed"
        with k.store() as store:
            assert "SIGKILL" in store.get_snapshot(row["id"])["detail"]
        assert _recorder_value(k, ".snapshots.running()") == 0
    finally:
        k.shutdown()


def test_an_expensive_variable_is_not_retried_until_it_changes(tmp_path):
    calls = tmp_path / "reduce-calls.txt"
    k = RecordingKernel(
        tmp_path / "expensive.sqlite",
        ["--ThemistoRecorder.max_variable_seconds=0.5", "--ThemistoRecorder.snapshot_delay=0"],
    )
    try:
        first = k.run(
            "import time\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            f"        open({str(calls)!r}, 'a').write('x')\n"
            "        time.sleep(3)\n"
            "        return (Slow, ())\n"
            "slow = Slow()"
        )
        v = k.variables(first.msg_id)
        assert v["slow"]["stub_reason"].startswith("too slow")
        steps = [k.run(f"step = {i}") for i in range(3)]
        for step in steps:
            v = k.variables(step.msg_id)
            assert v["slow"]["stub_reason"].startswith("too slow")
            assert v["slow"]["changed"] is False
        # Serialized once, not once per snapshot.
        assert calls.read_text() == "x"
        # Changed (a new attribute): tried again.
        again = k.run("slow.extra = 1")
        assert k.variables(again.msg_id)["slow"]["stub_reason"].startswith("too slow")
        assert calls.read_text() == "xx"
    finally:
        k.shutdown()


@pytest.mark.parametrize(
    ("code", "changes"),
    [
        ("print(len(items), df.head())", False),
        ("df.describe()\nplt.show()", False),
        ("x", False),
        ("items.append(1)", True),
        ("df['a'] = 1", True),
        ("df.obj = 2", True),
        ("arr += 1", True),
        ("del items[0]", True),
        ("df.dropna(inplace=True)", True),
        ("model.fit(X)", True),
        ("sorted(items, key=helper)", True),
        ("list(map(lambda v: v, items))", True),
        ("helper()", True),
        ("get_ipython().run_line_magic('who', '')", True),
        ("def f(:", True),
        # Library functions and classes given fresh values reach nothing of the person's.
        ("v = array([1, 2, 3])\nnp.arange(n, 10)\ndiag(np.zeros(3) + 1)", False),
        ("np.linalg.norm(np.ones(3)), sin(np.pi), np.float64(2.5)", False),
        ("concatenate((arr, arr))", True),
        ("np.random.shuffle(items)", True),
        ("np.copyto(arr, 1)", True),
        ("np.apply_along_axis(helper, 0, np.ones(3))", True),
        ("arr.fill(0)", True),
        ("exec('items.append(1)')", True),
        ("setattr(df, 'a', 1)", True),
        ("getattr(np, 'seterr')(all='ignore')", True),
        ("sorted([3, 1])", False),
        # A module's attribute may hold an object of the person's too.
        ("np.random.shuffle(mod.data)", True),
        ("np.sqrt(np.pi) + np.linalg.norm(mod.scale * np.ones(2))", False),
    ],
)
def test_which_cells_may_change_the_namespace(code, changes):
    from jupyter_themisto.kernel.changes import may_change

    def helper():
        return None

    helper.__module__ = "__main__"
    ns = {
        "items": [1],
        "df": object(),
        "helper": helper,
        "len": len,
        "np": np,
        "array": np.array,
        "diag": np.diag,
        "sin": np.sin,
        "concatenate": np.concatenate,
        "arr": np.zeros(3),
        "n": 3,
        "mod": types.ModuleType("mod"),
    }
    ns["mod"].data, ns["mod"].scale = ns["items"], 2.0  # type: ignore[attr-defined]
    assert may_change(code, ns) is changes


_SLEEPY = (
    "import time\n"
    "class Sleepy:\n"
    "    def __reduce__(self):\n"
    "        time.sleep(60)\n"
    "        return (Sleepy, ())\n"
    "sleepy = Sleepy()"
)


def _pending_row(store_path, msg_id, timeout=60.0):
    """The execution row of `msg_id` (read without asking the kernel anything)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = sqlite3.connect(store_path)
        conn.row_factory = sqlite3.Row
        try:
            row = conn.execute("SELECT * FROM executions WHERE msg_id = ?", (msg_id,)).fetchone()
        except sqlite3.OperationalError:
            row = None
        finally:
            conn.close()
        if row is not None:
            return dict(row)
        time.sleep(0.05)
    raise AssertionError(f"no row for {msg_id}")


def _wait_for(predicate, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.1)


def _kill_kernel(k):
    os.kill(k.km.provisioner.pid, signal.SIGKILL)
    _wait_for(lambda: not k.km.is_alive())


def test_a_kernel_killed_before_its_snapshot_leaves_no_pending_for_ever(tmp_path):
    """Killed (SIGKILL) in the moment between a reply and its snapshot: the next kernel on the
    store marks that snapshot failed, naming the kernel."""
    store_path = tmp_path / "dead-kernel.sqlite"
    # No snapshot for 600 s, even if the kernel took over snapshot_max_deferral to start.
    first = RecordingKernel(
        store_path,
        ["--ThemistoRecorder.snapshot_delay=600", "--ThemistoRecorder.snapshot_max_deferral=600"],
    )
    try:
        done = first.send("x = 41 + 1")
        row = _pending_row(store_path, done)
        assert row["snapshot_status"] == "pending"
        assert row["snapshot_owner"].startswith("kernel|")
        kernel_pid = first.km.provisioner.pid
        assert f"|{kernel_pid}|" in row["snapshot_owner"]
        _kill_kernel(first)
    finally:
        first.shutdown()
    assert _pending_row(store_path, done)["snapshot_status"] == "pending"
    second = RecordingKernel(store_path)  # its recorder sweeps the store as it opens it
    try:
        _wait_for(lambda: _pending_row(store_path, done)["snapshot_status"] == "failed")
        with second.store() as store:
            detail = store.get_snapshot(_pending_row(store_path, done)["id"])["detail"]
        assert f"the kernel (pid {kernel_pid}) ended" in detail
    finally:
        second.shutdown()


def test_a_kernel_dying_with_its_snapshot_child_leaves_no_pending_for_ever(tmp_path):
    """Kernel and snapshot child both killed: the next kernel's sweep marks the snapshot
    failed. A child that outlives its kernel is left to finish; killed later, the sweep of
    a reader (the server's, here the store's own) marks its snapshot failed too."""
    store_path = tmp_path / "dead-pair.sqlite"
    args = ["--ThemistoRecorder.max_variable_seconds=120", "--ThemistoRecorder.snapshot_delay=0"]
    first = RecordingKernel(store_path, args)
    children = []
    try:
        both = first.send(_SLEEPY)
        _wait_for(
            lambda: (_pending_row(store_path, both)["snapshot_owner"] or "").startswith("snapshot|")
        )
        children.append(int(_pending_row(store_path, both)["snapshot_owner"].split("|")[3]))
        alone = first.send("other = Sleepy()")
        _wait_for(
            lambda: (_pending_row(store_path, alone)["snapshot_owner"] or "").startswith(
                "snapshot|"
            )
        )
        children.append(int(_pending_row(store_path, alone)["snapshot_owner"].split("|")[3]))
        # The kernel first, then its child: killed the other way round, the kernel could reap
        # the child and note "killed by SIGKILL" itself before it died (seen once in CI).
        _kill_kernel(first)
        os.kill(children[0], signal.SIGKILL)  # dies with its kernel
    finally:
        first.shutdown()
    second = RecordingKernel(store_path)
    try:
        _wait_for(lambda: _pending_row(store_path, both)["snapshot_status"] == "failed")
        # The sweep has run: the child still serializing keeps its snapshot pending.
        assert _pending_row(store_path, alone)["snapshot_status"] == "pending"
        with second.store() as store:
            detail = store.get_snapshot(_pending_row(store_path, both)["id"])["detail"]
        assert f"the snapshot process (pid {children[0]}) ended" in detail
        os.kill(children[1], signal.SIGKILL)
        _wait_for(lambda: not os.path.exists(f"/proc/{children[1]}") or _zombie(children[1]))
        with TrajectoryStore(store_path) as store:
            assert store.sweep_pending_snapshots() == 1
        assert _pending_row(store_path, alone)["snapshot_status"] == "failed"
    finally:
        second.shutdown()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _small_snapshot_kernel(path) -> RecordingKernel:
    """A recording kernel that snapshots at once, with a generous budget for the snapshots it
    takes itself: a loaded machine must not send small values to a child."""
    return RecordingKernel(
        path,
        ["--ThemistoRecorder.snapshot_delay=0", "--ThemistoRecorder.small_snapshot_seconds=5"],
    )


def _run_and_settle(k: RecordingKernel, code: str) -> None:
    """Run `code`, then wait for the trajectory and its snapshot to be written (while the
    trajectory is being created, or a child runs, a snapshot is forked)."""
    k.run(code)
    k.settle()
    _wait_for(lambda: _recorder_value(k, ".snapshots.running()") == 0)


def test_small_snapshots_are_taken_by_the_kernel_without_running_its_code(tmp_path):
    """A snapshot of small values is taken by the kernel itself (no fork); an unchanged
    variable reuses its row, an in-place change is seen; anything that would run the person's
    code to serialize it (a __reduce__ of theirs), or is large, goes to a child as before; a
    file object is never flushed."""
    marker = tmp_path / "reduced-by.txt"
    target = tmp_path / "user-file.txt"
    k = _small_snapshot_kernel(tmp_path / "small.sqlite")
    try:
        kernel_pid = _recorder_value(k, ".pid")
        _run_and_settle(k, "import numpy as np, pandas as pd")
        small = _recorder_value(k, ".snapshots.counts.get('small', 0)")
        first = k.run(
            "import numpy as np, pandas as pd\n"
            "items = [1, 2, {'k': (3, 4.5)}]\n"
            "arr = np.arange(6)\n"
            "df = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\n"
            "def helper(x):\n    return x + 1\n"
            "class Plain:\n    pass\n"
            "p = Plain(); p.size = 3\n"
            f"fh = open({str(target)!r}, 'w'); fh.write('abc')\n"
            "bag = [1, fh]"
        )
        row = k.wait_snapshot(first.msg_id)
        with k.store() as store:
            assert store.get_snapshot(row["id"])["mode"] == "inline"
        v = k.variables(first.msg_id)
        assert v["items"]["summary"]["repr"] == "[1, 2, {'k': (3, 4.5)}]"
        assert v["df"]["summary"]["columns"] == ["a", "b"] and v["arr"]["blob_hash"]
        assert v["helper"]["blob_hash"] and v["p"]["blob_hash"]
        assert "file object" in v["fh"]["stub_reason"] and "file object" in v["bag"]["stub_reason"]
        assert target.read_text() == ""  # the person's buffer was not flushed

        second = k.run("n = 7")
        v2 = k.variables(second.msg_id)
        assert v2["n"]["changed"] is True and v2["items"]["changed"] is False
        assert v2["items"]["blob_hash"] == v["items"]["blob_hash"]
        third = k.run("items.append(5)")
        v3 = k.variables(third.msg_id)
        assert v3["items"]["changed"] is True and v3["items"]["summary"]["repr"].endswith("5]")
        forks = _recorder_value(k, ".snapshots.counts.get('fork', 0)")
        assert _recorder_value(k, ".snapshots.counts['small']") == small + 3

        # The person's own __reduce__ runs in a child, never in the kernel: alone (a class not
        # in the snapshot: `_` names are not), or in a frame's attrs.
        tagged = k.run(
            "import os\n"
            "class _Custom:\n"
            "    def __reduce__(self):\n"
            f"        open({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
            "        return (_Custom, ())\n"
            "tagged = pd.DataFrame({'a': [1]})\n"
            "tagged.attrs['by'] = _Custom()"
        )
        assert k.variables(tagged.msg_id)["tagged"]["blob_hash"]
        custom = k.run("c = _Custom()")
        assert k.variables(custom.msg_id)["c"]["blob_hash"]
        pids = set(map(int, marker.read_text().split()))
        assert len(pids) >= 1 and kernel_pid not in pids
        # A closure is pickled by value, with what it holds (here 16 MB).
        closure = k.run("del c, tagged\ng = (lambda a: lambda: a)(np.zeros(2_000_000))")
        k.wait_snapshot(closure.msg_id)
        large = k.run("big = np.zeros(2_000_000)")
        k.wait_snapshot(large.msg_id)
        assert _recorder_value(k, ".snapshots.counts.get('fork', 0)") == forks + 4
        k.run("fh.close()")
        assert target.read_text() == "abc"
    finally:
        k.shutdown()


def test_a_reducer_registered_with_copyreg_never_runs_in_the_kernel(tmp_path):
    """`copyreg.pickle(P, red)` makes every pickler call `red` for P's instances: neither a P
    nor a list holding one is pickled by the kernel itself (a child does it), while values
    that the standard library's own reducers pickle (complex, re.Pattern) still are."""
    marker = tmp_path / "reduced-by.txt"
    k = _small_snapshot_kernel(tmp_path / "copyreg.sqlite")
    try:
        kernel_pid = _recorder_value(k, ".pid")
        _run_and_settle(k, "import copyreg, os, re")
        k.run(
            "calls = []\n"
            "class P:\n"
            "    pass\n"
            "def red(o):\n"
            "    calls.append(os.getpid())\n"
            f"    open({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
            "    print('REDUCER RAN')\n"
            "    return (P, ())\n"
            "copyreg.pickle(P, red)"
        )
        _wait_for(lambda: _recorder_value(k, ".snapshots.running()") == 0)
        forks = _recorder_value(k, ".snapshots.counts.get('fork', 0)")
        small = _recorder_value(k, ".snapshots.counts.get('small', 0)")
        plain = k.run("z = 3 + 4j\npat = re.compile('a+')")
        alone = k.run("p = P()")
        held = k.run("q = [P(), 1]")
        v = k.variables(held.msg_id)
        assert k.variables(alone.msg_id)["p"]["blob_hash"] and v["q"]["blob_hash"]
        with k.store() as store:
            assert store.get_snapshot(k.execution(plain.msg_id)["id"])["mode"] == "inline"
        assert v["z"]["summary"]["repr"] == "(3+4j)" and v["pat"]["blob_hash"]
        assert k.value("calls") == []
        pids = set(map(int, marker.read_text().split()))
        assert pids and kernel_pid not in pids
        assert all(
            "REDUCER RAN" not in str(k.execution(e.msg_id)["outputs"]) for e in (alone, held)
        )
        assert _recorder_value(k, ".snapshots.counts.get('small', 0)") == small + 1
        assert _recorder_value(k, ".snapshots.counts.get('fork', 0)") == forks + 2
    finally:
        k.shutdown()


def test_the_kept_answer_about_copyreg_changes_with_the_table():
    """`_reducers_of_theirs` keeps its answer while copyreg's table holds the same entries: a
    reducer registered, replaced or removed since is seen at the next call."""
    import copyreg

    from jupyter_themisto.kernel.pickling import _reducers_of_theirs

    class Q:
        pass

    before = _reducers_of_theirs()
    assert _reducers_of_theirs() == before  # (the kept answer)
    copyreg.pickle(Q, lambda o: (Q, ()))
    try:
        assert _reducers_of_theirs()
        copyreg.dispatch_table[Q] = lambda o: (Q, ())  # replaced under the same key
        assert _reducers_of_theirs()
    finally:
        del copyreg.dispatch_table[Q]
    assert _reducers_of_theirs() == before
    # A library's own reducer for a library's type does not count (NumPy's for its ufuncs).
    numpy_reducers = [t for t in copyreg.dispatch_table if t.__module__.startswith("numpy")]
    assert numpy_reducers and before is False


def test_an_inline_snapshot_waits_for_another_process_writing(tmp_path):
    """Kernels recording side by side (`jupyter themisto record`, inline snapshots): a write
    lock held by another process while a snapshot is being written is waited for; the snapshot
    is written, not failed with 'database is locked'."""
    store_path = tmp_path / "shared.sqlite"
    flag = tmp_path / "locked.flag"
    k = RecordingKernel(
        store_path,
        ["--ThemistoRecorder.snapshot_mode=inline", "--ThemistoRecorder.max_variable_seconds=60"],
    )
    try:
        k.run("import subprocess, sys, time, os")
        # Another process takes the write lock for 2 s while the snapshot serializes `held`
        # (whose pickling waits until the lock is held): the snapshot's writes come after.
        locker = (
            "import sqlite3, sys, time, pathlib\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE')\n"
            "pathlib.Path(sys.argv[2]).touch()\n"
            "time.sleep(2)\n"
            "c.execute('ROLLBACK')\n"
        )
        done = k.run(
            "class _WaitsForTheLock:\n"
            "    def __reduce__(self):\n"
            "        end = time.monotonic() + 50\n"
            f"        while not os.path.exists({str(flag)!r}) and time.monotonic() < end:\n"
            "            time.sleep(0.01)\n"
            "        return (int, ())\n"
            f"p = subprocess.Popen([sys.executable, '-c', {locker!r}, {str(store_path)!r}, "
            f"{str(flag)!r}])\n"
            "held = _WaitsForTheLock()"
        )
        row = k.wait_snapshot(done.msg_id)
        assert flag.exists()
        assert row["snapshot_status"] in ("ok", "partial"), row
        assert k.variables(done.msg_id)["held"]["blob_hash"]
        k.run("p.wait()")
    finally:
        k.shutdown()


BASE_EXCEPTIONS = (
    "class Raising:\n"
    "    def __init__(self, error): self.error = error\n"
    "    def __reduce__(self):\n"
    "        open({calls!r}, 'a').write(type(self.error).__name__[0])\n"
    "        raise self.error\n"
    "    def __repr__(self):\n"
    "        raise self.error\n"
    "exits = Raising(SystemExit(0))\n"
    "interrupts = Raising(KeyboardInterrupt('from __reduce__'))\n"
    "closes = Raising(GeneratorExit())\n"
    "x = 1"
)


@pytest.mark.parametrize("mode", ["fork", "inline"])
def test_a_variable_whose_pickling_raises_a_base_exception_is_a_stub(tmp_path, mode):
    calls = tmp_path / "reduce-calls.txt"
    k = RecordingKernel(
        tmp_path / f"{mode}.sqlite",
        [f"--ThemistoRecorder.snapshot_mode={mode}", "--ThemistoRecorder.snapshot_delay=0"],
    )
    try:
        first = k.run(BASE_EXCEPTIONS.format(calls=str(calls)))
        v = k.variables(first.msg_id)
        row = k.wait_snapshot(first.msg_id)
        # The namespace is recorded; each of the three is a stub saying why.
        assert row["snapshot_status"] == "partial"
        assert v["exits"]["stub_reason"] == "unpicklable: SystemExit: 0"
        assert v["interrupts"]["stub_reason"] == "unpicklable: KeyboardInterrupt: from __reduce__"
        assert v["closes"]["stub_reason"] == "unpicklable: GeneratorExit: "
        for name, error in [
            ("exits", "SystemExit"),
            ("interrupts", "KeyboardInterrupt"),
            ("closes", "GeneratorExit"),
        ]:
            assert v[name]["blob_hash"] is None
            assert v[name]["summary"]["repr"] == f"<repr failed: {error}>"  # its __repr__
        assert v["x"]["blob_hash"] is not None
        with k.store() as store:
            assert store.get_snapshot(row["id"])["mode"] == mode
        assert sorted(calls.read_text()) == ["G", "K", "S"]
        # The next cells' snapshots too, the stubs remembered (not tried again).
        for code in ("y = 2", "x = 3"):
            step = k.run(code)
            v = k.variables(step.msg_id)
            assert k.wait_snapshot(step.msg_id)["snapshot_status"] == "partial"
            assert v["exits"]["stub_reason"] == "unpicklable: SystemExit: 0"
            assert v["exits"]["changed"] is False and v["interrupts"]["changed"] is False
        assert v["x"]["blob_hash"] is not None and v["y"]["blob_hash"] is not None
        assert sorted(calls.read_text()) == ["G", "K", "S"]
        # The kernel goes on as before: no exit, no interrupt.
        assert k.run("print(x + y)").outputs == [("stream", {"name": "stdout", "text": "5\n"})]
    finally:
        k.shutdown()


@pytest.mark.parametrize("mode", ["fork", "inline"])
def test_a_size_or_hash_of_the_persons_that_raises_a_base_exception_fails_no_snapshot(
    tmp_path, mode
):
    """The cheap looks a snapshot takes before pickling — a value's size (its `__sizeof__`), a
    frame's hash of its objects (their `__hash__`) — meet a SystemExit of the person's like any
    error: that look tells nothing, the rest of the namespace is recorded."""
    k = RecordingKernel(
        tmp_path / f"{mode}.sqlite",
        [f"--ThemistoRecorder.snapshot_mode={mode}", "--ThemistoRecorder.snapshot_delay=0"],
    )
    try:
        done = k.run(
            "import pandas as pd\n"
            "class Sized:\n"
            "    def __sizeof__(self): raise SystemExit(4)\n"
            "class Hashed:\n"
            "    def __hash__(self): raise SystemExit(5)\n"
            "sized = Sized()\n"
            "frame = pd.DataFrame({'o': [Hashed(), Hashed()]})\n"
            "x = 1"
        )
        row = k.wait_snapshot(done.msg_id)
        assert row["snapshot_status"] in ("ok", "partial"), row
        v = k.variables(done.msg_id)
        assert v["x"]["blob_hash"] is not None
        assert {"sized", "frame"} <= set(v)
        assert k.run("print(x)").outputs == [("stream", {"name": "stdout", "text": "1\n"})]
    finally:
        k.shutdown()


def test_pressing_interrupt_during_an_inline_snapshot_still_stops_it(tmp_path):
    """A real interrupt is not taken for one raised by a variable's own code: the snapshot it
    lands in stops and is marked failed, as before; the kernel and the recorder go on."""
    started = tmp_path / "reduce-started.txt"
    k = RecordingKernel(
        tmp_path / "interrupted.sqlite",
        [
            "--ThemistoRecorder.snapshot_mode=inline",
            # The snapshot is taken before the reply, while ipykernel handles the request:
            # SIGINT raises KeyboardInterrupt there (after the reply it is ignored).
            "--ThemistoRecorder.defer_writes=False",
            "--ThemistoRecorder.max_variable_seconds=120",
        ],
    )
    try:
        msg_id = k.send(
            "import time\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            f"        open({str(started)!r}, 'w').close()\n"
            "        time.sleep(60)\n"
            "        return (Slow, ())\n"
            "slow = Slow()"
        )
        _wait_for(started.exists)
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        done = k.collect(msg_id)
        assert time.monotonic() - t0 < 30  # not the 60 s sleep: the snapshot stopped
        assert done.reply["status"] == "ok"  # the cell itself had finished
        row = k.wait_snapshot(msg_id)
        assert row["status"] == "ok"
        assert row["snapshot_status"] == "failed"
        with k.store() as store:
            assert store.get_snapshot(row["id"])["detail"].startswith("KeyboardInterrupt")
        after = k.run("del slow\nz = 1")
        assert k.variables(after.msg_id)["z"]["blob_hash"] is not None
    finally:
        k.shutdown()
