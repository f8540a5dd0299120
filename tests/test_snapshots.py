"""Namespace snapshots taken by the recorder in a real kernel (fork mode, and inline)."""

from __future__ import annotations

import os
import pickle
import signal
import sqlite3

import numpy as np
import pytest
import zstandard

from .recorder_kernel import RecordingKernel, kernel_fixture

SECRET = "hunter2-" + "s3cr3t-" + "v4lue"


# Cells here come faster than a loaded machine may finish snapshots: no skipping.
kernel = kernel_fixture("snapshots", "--ThemistoRecorder.max_snapshot_children=16")


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
    try:
        slow = k.run(
            "import time\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            "        time.sleep(1.5)\n"
            "        return (Slow, ())\n"
            "s = Slow()"
        )
        quick = k.run("a = 1")
        row = k.wait_snapshot(quick.msg_id)
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
        k.shutdown()


def _recorder_value(k, expr):
    """Evaluate an expression about the kernel's recorder (a silent request)."""
    code = "(_r := __import__('jupyter_themisto.kernel', fromlist=['x']).get_recorder())"
    msg_id = k.kc.execute("", silent=True, store_history=False, user_expressions={"v": code + expr})
    while True:
        reply = k.kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            value = reply["content"]["user_expressions"]["v"]
            assert value["status"] == "ok", value
            return eval(value["data"]["text/plain"])  # noqa: S307 - our own expression's repr


def test_cells_sent_at_once_share_one_snapshot(kernel):
    kernel.run("ready = 1")
    kernel.settle()
    # As "Run All" does: every request is queued before the first reply.
    ids = [kernel.send(f"batch_{i} = {i}") for i in range(6)]
    for msg_id in ids:
        kernel.collect(msg_id)
    rows = [kernel.wait_snapshot(msg_id) for msg_id in ids]
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
    ],
)
def test_which_cells_may_change_the_namespace(code, changes):
    from jupyter_themisto.kernel.changes import may_change

    def helper():
        return None

    helper.__module__ = "__main__"
    ns = {"items": [1], "df": object(), "helper": helper, "len": len}
    assert may_change(code, ns) is changes
