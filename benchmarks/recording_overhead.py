"""Recording overhead: time added per cell, executions lost and bytes stored, beside Kishu.

Runs real notebooks cell by cell through the Jupyter protocol, each in a fresh kernel per mode,
the modes back to back on the same notebook:

- off:   a plain kernel (the baseline);
- on:    `--ext=jupyter_themisto`, the recorder with its defaults (fork snapshots);
- off2:  a second plain kernel: **the floor**. What it "adds" over `off` is what two plain runs
         of the same cells differ by on this machine at this moment (noise, caches, load); read
         the recorder's figures beside it: what `on` adds beyond the floor is the recorder's;
- kishu: Kishu (`pip install -e ".[bench]"`), enabled with `init_kishu()` before the first cell
         (that set-up cell is not timed); only with `--send sequential` (its storage does not
         depend on how cells are sent, and it is slow: about a second per cell).

and three ways of sending the cells (`--send`):

- all: every cell is sent at once, as JupyterLab's "Run All" does (the kernel queues them).
  A cell's time: from the previous reply (the first: from the sending) to its reply.
- sequential: back to back: the next cell is sent when the previous reply (and its idle
  status) has arrived, as Shift+Enter held down or nbclient. A cell's time: from its request
  to its reply.
- think: as sequential, after `--think` seconds (default 0.3) before each cell: a person
  reading the output. Every snapshot is then taken between cells.

Printed, per notebook and overall: the time added per cell (mode - off for the same cell:
median, p95) and to the whole run, for `on`, `kishu` and the floor `off2`; the recorder's own
time in the kernel by step (hooks the cell waits for; work after the reply: handing the
execution to the writer and forks taken at once; the fork itself; the writer's time per
execution); what happened to the snapshots (taken by fork, inline, unchanged, coalesced,
skipped); executions sent vs recorded vs lost; bytes stored, and their ratio to Kishu's on the
notebooks both ran (also without the empty store's schema pages: each notebook here has a
store of its own, a person's one store holds them all). Figures only; nothing is asserted. Each
notebook first runs once plain, unmeasured (its libraries and data files are then in the page
cache for every mode; `--no-warmup` skips it). With `--repeat N` each mode runs N times (order
reversed every other time) and each cell counts its fastest run.

    .venv/bin/python benchmarks/recording_overhead.py --quick           # < 15 min, quiet machine
    .venv/bin/python benchmarks/recording_overhead.py --corpus          # the whole corpus (hours)
    .venv/bin/python benchmarks/recording_overhead.py [NOTEBOOK ...]
        [--corpus [FILTER ...]] [--limit N] [--every K] [--start N] [--modes off,on,off2,kishu]
        [--kishu-limit N] [--send all,sequential,think] [--think 0.3] [--repeat 1]
        [--on-args "--ThemistoRecorder.snapshot_mode=off"] [--no-warmup] [--json out.json]
        [--report saved.json ...]

`--quick` is a fixed subset of the corpus (QUICK below: 13 notebooks, about 300 cells, plain
Python, NumPy, pandas, matplotlib, SymPy and scikit-learn), every mode and way of sending, Kishu
on its first three. Without notebooks it runs benchmarks/notebooks/*.ipynb; `--corpus` runs the
benchmark corpus (benchmarks/corpus.json, materialized by benchmarks/corpus.py), optionally only
notebooks whose key contains one of the FILTER words, every `--every`-th of them from the
`--start`-th, the first `--limit` of them; `--kishu-limit N` runs Kishu on the first N notebooks
only. Each notebook runs with its own folder as working directory (notebooks read files beside
them). Run it niced on a shared machine (`nice -n 10`); the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.manager import KernelManager
from percentiles import percentile

HERE = Path(__file__).parent
RECORDER = "__import__('jupyter_themisto.kernel', fromlist=['get_recorder']).get_recorder()"
CELL_TIMEOUT = 300.0
# --quick: corpus notebooks (keys of benchmarks/corpus.py) that together run about 40 s plain.
QUICK = (
    "Pierian-Data/Complete-Python-3-Bootcamp:00-Python Object and Data Structure Basics/"
    "02-Strings.ipynb",
    "CoreyMSchafer/code_snippets:Python/Pandas/02-DataFrames/Snippets.ipynb",
    "jdwittenauer/ipython-notebooks:notebooks/libraries/NumPy.ipynb",
    "Pierian-Data/Complete-Python-3-Bootcamp:10-Python Decorators/01-Decorators.ipynb",
    "jakevdp/WhirlwindTourOfPython:03-Semantics-Variables.ipynb",
    "CoreyMSchafer/code_snippets:Python/Pandas/04-Filtering/Snippets.ipynb",
    "matplotlib/AnatomyOfMatplotlib:AnatomyOfMatplotlib-Part2-Plotting_Methods_Overview.ipynb",
    "leosartaj/euroscipy-sympy-tutorial:notebooks/06-Matrices.ipynb",
    "jakevdp/WhirlwindTourOfPython:15-Preview-of-Data-Science-Tools.ipynb",
    "mGalarnyk/Python_Tutorials:Sklearn/CART/DecisionTreesClassification.ipynb",
    "amueller/scipy-2017-sklearn:notebooks/05.Supervised_Learning-Classification.ipynb",
    "jvns/pandas-cookbook:cookbook/Chapter 1 - Reading from a CSV.ipynb",
    "norvig/pytudes:ipynb/Bike-Stats.ipynb",
)
# Modes that run a plain kernel (the baseline and the floor).
PLAIN = ("off", "off2")


class Kernel:
    def __init__(self, env: dict[str, str], extra: list[str], cwd: str) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, extra_arguments=extra, cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def send(self, code: str, *, silent: bool = False, expr: str | None = None) -> str:
        return self.kc.execute(
            code,
            silent=silent,
            store_history=not silent,
            user_expressions={"r": expr} if expr else None,
            allow_stdin=False,
            stop_on_error=False,
        )

    def reply(self, msg_id: str, timeout: float = CELL_TIMEOUT) -> dict[str, Any]:
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def idle(self, msg_id: str, timeout: float = CELL_TIMEOUT) -> None:
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                return

    def value(self, expr: str, timeout: float = 600) -> Any:
        msg_id = self.send("", silent=True, expr=expr)
        data = self.reply(msg_id, timeout)["content"]["user_expressions"]["r"]
        if data.get("status") != "ok":
            raise RuntimeError(f"{expr}: {data}")
        return eval(data["data"]["text/plain"])  # noqa: S307 - our own expression's repr

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def run_cells(kernel: Kernel, cells: list[str], send: str, think: float) -> dict[str, Any]:
    """Per-cell seconds, msg ids and errors for one way of sending."""
    seconds: list[float] = []
    ids: list[str] = []
    errors = 0
    if send == "all":
        t0 = time.perf_counter()
        ids = [kernel.send(c) for c in cells]
        previous = t0
        for msg_id in ids:
            reply = kernel.reply(msg_id)
            now = time.perf_counter()
            seconds.append(now - previous)
            previous = now
            errors += reply["content"]["status"] != "ok"
        if ids:
            kernel.idle(ids[-1])
        return {"seconds": seconds, "ids": ids, "errors": errors, "total": previous - t0}
    total = 0.0
    for code in cells:
        if send == "think":
            time.sleep(think)
        t0 = time.perf_counter()
        msg_id = kernel.send(code)
        reply = kernel.reply(msg_id)
        elapsed = time.perf_counter() - t0
        kernel.idle(msg_id)
        seconds.append(elapsed)
        total += elapsed
        ids.append(msg_id)
        errors += reply["content"]["status"] != "ok"
    return {"seconds": seconds, "ids": ids, "errors": errors, "total": total}


def store_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def store_parts(path: Path) -> dict[str, int]:
    """Where a closed store's bytes are, by part, summing to its files' size (`store_bytes`).

    Files: the database, its WAL and shared-memory index (`-wal`, `-shm`: absent once the last
    connection closed cleanly), the secrets key (`.key`). Inside the database (SQLite's `dbstat`
    table, as `sqlite3_analyzer` reads it): the pages of each table and index, the free pages and
    the header page; `executions` split again into its sources and outputs (their share of the
    table's payload) and the blobs into those of variables and those of outputs (images)."""
    parts: dict[str, int] = {}
    for p in path.parent.glob(path.name + "*"):
        if p.is_file():
            suffix = p.name[len(path.name) :] or "db"
            parts[f"file {suffix}"] = p.stat().st_size
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        one = lambda sql: conn.execute(sql).fetchone()[0] or 0  # noqa: E731
        page = one("PRAGMA page_size")
        parts["db free pages"] = one("PRAGMA freelist_count") * page
        tables = {
            name: (pages, payload)
            for name, pages, payload in conn.execute(
                "SELECT name, sum(pgsize), sum(payload) FROM dbstat GROUP BY name"
            )
        }
        blob_tables = {"blobs"}
        for name, (pages, _) in tables.items():
            if name not in blob_tables and name != "executions":
                parts[f"db {name}"] = pages
        if "executions" in tables:
            pages, payload = tables["executions"]
            text = one("SELECT sum(length(CAST(source AS BLOB))) FROM executions")
            outs = one("SELECT sum(length(CAST(outputs AS BLOB))) FROM executions")
            share = lambda n: round(pages * n / payload) if payload else 0  # noqa: E731
            parts["db executions: sources"] = share(text)
            parts["db executions: outputs"] = share(outs)
            parts["db executions: other columns"] = pages - share(text) - share(outs)
        if "blobs" in tables:
            # Each row's share of the table: its data, its hash (the key, stored in the row and
            # again in the key's index) and a row's few bytes of header.
            pages, _ = tables["blobs"]
            var_sql = "(SELECT blob_hash FROM variables)"
            row = "length(data) + length(hash) + 16"
            var = one(f"SELECT sum({row}) FROM blobs WHERE hash IN {var_sql}")
            total = one(f"SELECT sum({row}) FROM blobs")
            share = round(pages * var / total) if total else 0
            parts["db blobs: variables"] = share
            parts["db blobs: outputs"] = pages - share
            index = "db sqlite_autoindex_blobs_1"
            if index in parts:
                n_var = one(f"SELECT count(*) FROM blobs WHERE hash IN {var_sql}")
                n_all = one("SELECT count(*) FROM blobs")
                ipages = parts.pop(index)
                ishare = round(ipages * n_var / n_all) if n_all else 0
                parts["db blobs' key index: variables"] = ishare
                parts["db blobs' key index: outputs"] = ipages - ishare
        accounted = sum(v for k, v in parts.items() if k.startswith("db "))
        parts["db header and pointer-map pages"] = parts.get("file db", 0) - accounted
    finally:
        conn.close()
    return parts


def storage_breakdown(parts: dict[str, int]) -> dict[str, int]:
    """Bytes of the namespace snapshots (their tables, indexes and the variables' blobs) apart
    from the executions' sources and outputs (with the images they reference), from
    `store_parts`."""
    snapshot_tables = ("variable", "snapshot")  # variables, variable_records, snapshot_...
    return {
        "snapshot_bytes": sum(
            v
            for k, v in parts.items()
            if k in ("db blobs: variables", "db blobs' key index: variables")
            or (k.startswith("db ") and any(t in k for t in snapshot_tables))
        ),
        "output_bytes": sum(
            parts.get(k, 0)
            for k in (
                "db executions: sources",
                "db executions: outputs",
                "db blobs: outputs",
                "db blobs' key index: outputs",
            )
        ),
    }


def kishu_parts(run_dir: Path, notebook_copy: Path) -> dict[str, int]:
    """Kishu's files under its root (KISHU_PATH_ROOT), by folder; not the notebook copy. And,
    as "db …" parts, what its databases hold: the variables' data (the tables `checkpoint` and
    `variable_snapshot`), the notebook's JSON that each commit keeps a copy of (`raw_nb` in
    `commit_entry`), the rest of the commit entries, and everything else."""
    import dill  # Kishu pickles its commit entries with dill

    parts: dict[str, int] = {}
    for p in run_dir.rglob("*"):
        if p.is_file() and p != notebook_copy:
            rel = p.relative_to(run_dir).parts
            key = "file " + rel[0] + (f"/…/*{p.suffix}" if len(rel) > 1 else "")
            parts[key] = parts.get(key, 0) + p.stat().st_size
    for db in run_dir.rglob("*.kishudb"):
        conn = sqlite3.connect(db)
        try:
            found = {
                "db variable data (checkpoint, variable_snapshot)": sum(
                    conn.execute(f"SELECT coalesce(sum(length(data)), 0) FROM {table}").fetchone()[
                        0
                    ]
                    for table in ("checkpoint", "variable_snapshot")
                )
            }
            notebook = entries = 0
            for (data,) in conn.execute("SELECT data FROM commit_entry"):
                entries += len(data)
                raw_nb = getattr(dill.loads(data), "raw_nb", None) or ""
                notebook += len(raw_nb.encode())
        finally:
            conn.close()
        found["db commit entries: the notebook's JSON at each commit"] = notebook
        found["db commit entries: the rest (cells, outputs, plans)"] = entries - notebook
        found["db other tables, indexes, free pages"] = db.stat().st_size - sum(found.values())
        for k, v in found.items():
            parts[k] = parts.get(k, 0) + v
    return parts


def empty_store_bytes() -> int:
    """The size of a trajectory store holding nothing yet (its schema's pages)."""
    from jupyter_themisto.store import TrajectoryStore

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "empty.sqlite"
        TrajectoryStore(path).close()
        return store_bytes(path)


def run_notebook(
    nb_path: Path, mode: str, send: str, think: float, workdir: Path, on_args: list[str]
) -> dict[str, Any]:
    nb = nbformat.read(nb_path, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    run_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=workdir))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    store = run_dir / "trajectories.sqlite"
    env["THEMISTO_STORE"] = str(store)
    env["THEMISTO_NOTEBOOK_PATH"] = str(nb_path)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    extra = ["--ext=jupyter_themisto", *on_args] if mode == "on" else []  # off, off2: plain
    kishu_nb = run_dir / nb_path.name
    if mode == "kishu":
        # Kishu keeps its checkpoints beside the notebook: a copy here, never in the checkout.
        shutil.copy(nb_path, kishu_nb)
        env["KISHU_PATH_ROOT"] = str(run_dir)
        env["TEST_NOTEBOOK_PATH"] = str(kishu_nb)
        env["ENV_KISHU_TEST_MODE"] = "true"  # no frontend here: skip its notebook saving
    kernel = Kernel(env, extra, str(nb_path.parent))
    result: dict[str, Any] = {"cells": len(cells)}
    try:
        if mode == "kishu":
            setup = kernel.send(f"from kishu import init_kishu\ninit_kishu({str(kishu_nb)!r})")
            content = kernel.reply(setup)["content"]
            kernel.idle(setup)
            if content["status"] != "ok":
                result["setup_error"] = f"{content.get('ename')}: {content.get('evalue')}"
        result.update(run_cells(kernel, cells, send, think))
        if mode == "on":
            kernel.value(f"{RECORDER}.settle(600)")
            deadline = time.monotonic() + 900
            while kernel.value(f"{RECORDER}.snapshots.running()") and time.monotonic() < deadline:
                time.sleep(0.2)
            result["timings"] = kernel.value(f"{RECORDER}.timings()")
            result["counts"] = kernel.value(f"{RECORDER}.snapshots.counts")
            result["recorder_errors"] = kernel.value(f"{RECORDER}.errors")
    finally:
        kernel.shutdown()
    if mode == "on":
        # As the killed kernel left them (a WAL not yet checkpointed, its -shm index): what the
        # next opening of the store checkpoints away.
        result["left_by_kernel"] = {
            p.name[len(store.name) :] or "db": p.stat().st_size
            for p in store.parent.glob(store.name + "*")
            if p.is_file()
        }
        conn = sqlite3.connect(store)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        recorded = {
            msg_id: status
            for msg_id, status in conn.execute("SELECT msg_id, status FROM executions")
        }
        result["recorded"] = sum(1 for i in result["ids"] if recorded.get(i) not in (None, "lost"))
        result["lost"] = len(result["ids"]) - result["recorded"]
        result["snapshot_statuses"] = dict(
            conn.execute("SELECT snapshot_status, count(*) FROM executions GROUP BY 1").fetchall()
        )
        conn.close()
        result["stored_bytes"] = store_bytes(store)
        result["parts"] = store_parts(store)
        result["breakdown"] = storage_breakdown(result["parts"])
    if mode == "kishu":
        result["parts"] = kishu_parts(run_dir, kishu_nb)
        result["stored_bytes"] = sum(
            v for k, v in result["parts"].items() if not k.startswith("db ")
        )
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def fmt_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"median {statistics.median(values) * 1000:7.2f} ms  "
        f"p95 {percentile(values, 0.95) * 1000:8.2f} ms"
    )


def select_notebooks(args: argparse.Namespace) -> list[Path]:
    if args.corpus is not None or args.quick:
        sys.path.insert(0, str(HERE))
        try:
            import corpus  # benchmarks/corpus.py
        except ImportError:
            sys.exit("benchmarks/corpus.py is not here (merge main once the corpus has landed)")
        by_key = {corpus.notebook_key(path): Path(path) for path in corpus.notebooks()}
        if args.quick:
            missing = [k for k in QUICK if k not in by_key]
            if missing:
                sys.exit(f"--quick: not in the corpus manifest any more: {missing}")
            return [by_key[k] for k in QUICK]
        found = [
            p for k, p in by_key.items() if not args.corpus or any(f in k for f in args.corpus)
        ]
        found = found[args.start :: args.every]
        return found[: args.limit] if args.limit else found
    paths = args.notebooks or sorted((HERE / "notebooks").glob("*.ipynb"))
    return paths[: args.limit] if args.limit else paths


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--corpus", nargs="*", metavar="FILTER", help="run the corpus")
    parser.add_argument(
        "--quick", action="store_true", help="a fixed corpus subset (< 15 min on a quiet machine)"
    )
    parser.add_argument("--limit", type=int, default=0, help="only the first N notebooks")
    parser.add_argument("--every", type=int, default=1, help="corpus: every K-th notebook")
    parser.add_argument("--start", type=int, default=0, help="corpus: from the N-th notebook")
    parser.add_argument("--modes", default="off,on,off2,kishu")
    parser.add_argument("--kishu-limit", type=int, default=0, help="Kishu on the first N only")
    parser.add_argument("--send", default="all,sequential,think")
    parser.add_argument("--think", type=float, default=0.3, help="seconds before each cell (think)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the unmeasured plain run of each notebook before its measured ones",
    )
    parser.add_argument(
        "--json", type=Path, help="write the raw figures here (after each notebook)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="only print the report of saved --json runs (merged)",
    )
    parser.add_argument(
        "--on-args",
        default="",
        metavar="ARGS",
        help="more kernel arguments for the recorded mode, e.g. "
        "'--ThemistoRecorder.snapshot_mode=off' (to tell its parts apart)",
    )
    args = parser.parse_args()
    on_args = args.on_args.split()
    if args.quick and not args.kishu_limit:
        args.kishu_limit = 3
    modes = args.modes.split(",")
    sends = args.send.split(",")
    if "off" not in modes:
        parser.error("the 'off' mode is the baseline and must be included")
    if not set(sends) <= {"all", "sequential", "think"}:
        parser.error("--send takes all, sequential and think")
    if args.report:
        saved: dict[str, Any] = {}
        for path in args.report:
            saved.update(json.loads(path.read_text()))
        for send in sends:
            report(saved, modes, send)
        return
    notebooks = select_notebooks(args)
    workdir = Path(tempfile.mkdtemp(prefix="themisto-bench-"))
    raw: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    started = time.time()
    load = os.getloadavg()
    try:
        for n, nb in enumerate(notebooks):
            raw[str(nb)] = {s: {} for s in sends}
            if args.warmup:
                # Unmeasured: the first run of a notebook reads its libraries and data from
                # disk, and would make whichever mode runs first look slower.
                try:
                    run_notebook(nb, "off", "all", 0.0, workdir, [])
                except Exception as e:
                    print(f"  {nb.name}: warm-up failed: {e!r}", file=sys.stderr)
            for send in sends:
                for rep in range(args.repeat):
                    # Alternate the order, so that neither mode always runs on a colder cache.
                    for mode in modes if rep % 2 == 0 else modes[::-1]:
                        if mode == "kishu" and (
                            send != "sequential" or (args.kishu_limit and n >= args.kishu_limit)
                        ):
                            continue
                        t0 = time.perf_counter()
                        try:
                            r = run_notebook(nb, mode, send, args.think, workdir, on_args)
                        except Exception as e:  # a notebook that hangs or kills its kernel
                            print(f"  {nb.name}: {mode}/{send} failed: {e!r}", file=sys.stderr)
                            raw[str(nb)][send].pop("off", None)
                            break
                        raw[str(nb)][send].setdefault(mode, []).append(r)
                        print(
                            f"  [{n + 1}/{len(notebooks)}] {nb.name:40.40s} {mode:5s} {send:10s}"
                            f" {time.perf_counter() - t0:6.1f} s",
                            file=sys.stderr,
                            flush=True,
                        )
            if args.json:
                args.json.write_text(json.dumps(raw, default=str))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n{len(notebooks)} notebooks; think {args.think:g} s; repeats {args.repeat}; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{(time.time() - started) / 60:.1f} min; nice {os.nice(0)}"
    )
    for send in sends:
        report(raw, modes, send)


def per_cell_min(runs: list[dict[str, Any]]) -> list[float]:
    return [min(r["seconds"][i] for r in runs) for i in range(len(runs[0]["seconds"]))]


def report(raw: dict[str, Any], modes: list[str], send: str) -> None:
    print(f"\n== send: {send} ==")
    added: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
    # (added by on, added by the floor, notebook, cell index): the recorder's largest.
    worst: list[tuple[float, float, str, int]] = []
    totals: dict[str, list[float]] = {m: [0.0, 0.0] for m in modes if m != "off"}
    timings: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    sent = recorded = lost = errors = 0
    stored = dict.fromkeys(
        ("on", "kishu", "on_with_kishu", "snapshots_with_kishu", "stores_with_kishu"), 0
    )
    parts = {"snapshot_bytes": 0, "output_bytes": 0}
    # Bytes by part (store_parts, kishu_parts) over the notebooks both ran; what the killed
    # kernels left on disk (WAL and -shm included) before the store was next opened.
    on_parts: dict[str, int] = {}
    kishu_parts_sum: dict[str, int] = {}
    left: dict[str, int] = {}
    for name, by_send in raw.items():
        by_mode = by_send.get(send, {})
        if "off" not in by_mode:
            continue
        base = per_cell_min(by_mode["off"])
        base_total = min(r["total"] for r in by_mode["off"])
        line = f"{Path(name).name[:40]:40s} {len(base):4d} cells  off {base_total:7.2f} s"
        for mode in added:
            runs = by_mode.get(mode)
            if not runs or len(runs[0]["seconds"]) != len(base):
                continue
            diffs = [t - b for t, b in zip(per_cell_min(runs), base, strict=True)]
            added[mode] += diffs
            floor_runs = by_mode.get("off2")
            if mode == "on" and floor_runs and len(floor_runs[0]["seconds"]) == len(base):
                floor = [t - b for t, b in zip(per_cell_min(floor_runs), base, strict=True)]
                worst += [
                    (d, f, Path(name).name, i)
                    for i, (d, f) in enumerate(zip(diffs, floor, strict=True))
                ]
            total = min(r["total"] for r in runs)
            totals[mode][0] += base_total
            totals[mode][1] += total
            line += (
                f" | {mode} +{statistics.median(diffs) * 1000:6.2f} ms med"
                f" {(total / base_total - 1) * 100 if base_total else 0:+6.1f} %"
            )
            if mode == "on":
                r = runs[0]
                for step, values in r["timings"].items():
                    timings.setdefault(step, []).extend(values)
                hooks, after = r["timings"]["hooks"], r["timings"]["after_reply"]
                if len(hooks) == len(after):
                    # What each execution took of the kernel's own time, in all: what a cell
                    # queued behind it ("Run All") waits, noise apart.
                    timings.setdefault("per cell", []).extend(
                        h + a for h, a in zip(hooks, after, strict=True)
                    )
                for k, v in r["counts"].items():
                    counts[k] = counts.get(k, 0) + v
                sent += len(r["ids"])
                recorded += r["recorded"]
                lost += r["lost"]
                errors += r["recorder_errors"]
                stored["on"] += r["stored_bytes"]
                for k in parts:
                    parts[k] += r.get("breakdown", {}).get(k, 0)
                if "kishu" in by_mode:
                    stored["on_with_kishu"] += r["stored_bytes"]
                    for k, v in r.get("parts", {}).items():
                        on_parts[k] = on_parts.get(k, 0) + v
                    for k, v in r.get("left_by_kernel", {}).items():
                        left[k] = left.get(k, 0) + v
                    stored["stores_with_kishu"] += 1
                    stored["snapshots_with_kishu"] += r.get("breakdown", {}).get(
                        "snapshot_bytes", 0
                    )
            if mode == "kishu":
                stored["kishu"] += runs[0]["stored_bytes"]
                for k, v in runs[0].get("parts", {}).items():
                    kishu_parts_sum[k] = kishu_parts_sum.get(k, 0) + v
                if runs[0].get("setup_error"):
                    line += f" (kishu init: {runs[0]['setup_error'][:60]})"
        print(line)
    print("\n-- overall (off2 is a second plain run: the floor, what noise alone adds) --")
    for mode, diffs in added.items():
        base_total, total = totals[mode]
        if not diffs:
            continue
        print(
            f"  {mode:5s} added per cell: {fmt_ms(diffs)}  over {len(diffs)} cells; "
            f"whole runs {base_total:.1f} s -> {total:.1f} s "
            f"({(total / base_total - 1) * 100 if base_total else 0:+.2f} %)"
        )
    for d, f, nb_name, i in sorted(worst, reverse=True)[:5]:
        print(
            f"  on    largest: +{d * 1000:7.1f} ms (floor {f * 1000:+7.1f} ms)  {nb_name} cell {i}"
        )
    for step, values in timings.items():
        print(f"  on    in kernel, {step:12s} {fmt_ms(values)}  (n={len(values)})")
    if counts:
        print(f"  on    snapshots: {dict(sorted(counts.items()))}")
    if sent:
        print(
            f"  on    executions: {sent} sent, {recorded} recorded, {lost} lost; "
            f"recorder errors {errors}"
        )
        print(
            f"  on    stored {stored['on'] / 1e6:.2f} MB ({stored['on'] / sent / 1e3:.1f} kB "
            "per execution)"
        )
    if stored["kishu"]:
        ratio = stored["kishu"] / max(1, stored["on_with_kishu"])
        snap_ratio = stored["kishu"] / max(1, stored["snapshots_with_kishu"])
        # Each notebook here has a store of its own; a person's one store holds every notebook,
        # so the empty schema's pages count once, not once per notebook.
        data = stored["on_with_kishu"] - stored["stores_with_kishu"] * empty_store_bytes()
        print(
            f"  kishu stored {stored['kishu'] / 1e6:.2f} MB (its folder) on the same "
            f"notebooks, where the recorder stored {stored['on_with_kishu'] / 1e6:.2f} MB in all "
            f"(Kishu/recorder = {ratio:.1f}x; {data / 1e6:.2f} MB beyond the empty store each "
            f"notebook's run starts with: {stored['kishu'] / max(1, data):.1f}x), "
            f"{stored['snapshots_with_kishu'] / 1e6:.2f} MB of it snapshots "
            f"(Kishu/snapshots = {snap_ratio:.1f}x)"
        )
        n = stored["stores_with_kishu"]
        one_store = stored["on_with_kishu"] - (n - 1) * empty_store_bytes() if n else 0
        print(
            f"  on    as one store (a person's: the {n} stores less {n - 1} empty schemas): "
            f"{one_store / 1e6:.3f} MB (Kishu/recorder = "
            f"{stored['kishu'] / max(1, one_store):.1f}x)"
        )
        kishu_vars = kishu_parts_sum.get("db variable data (checkpoint, variable_snapshot)", 0)
        kishu_nb = kishu_parts_sum.get("db commit entries: the notebook's JSON at each commit", 0)
        print(
            f"  variables' data alone: Kishu {kishu_vars / 1e6:.3f} MB, the recorder's snapshots "
            f"{stored['snapshots_with_kishu'] / 1e6:.3f} MB (Kishu/recorder = "
            f"{kishu_vars / max(1, stored['snapshots_with_kishu']):.1f}x); Kishu's copies of the "
            f"notebook's JSON, one per commit: {kishu_nb / 1e6:.3f} MB"
        )
    for title, table in (
        ("recorder (files after the store was next opened and closed)", on_parts),
        ("kishu (its folder, not the notebook)", kishu_parts_sum),
    ):
        if not table:
            continue
        total = sum(v for k, v in table.items() if not k.startswith("db ")) or 1
        print(f"  {title}, {total / 1e6:.3f} MB on the notebooks both ran:")
        for k, v in sorted(table.items(), key=lambda kv: -kv[1]):
            print(f"    {k:40s} {v / 1e3:10.1f} kB {v / total * 100:6.1f} %")
    if left:
        print(
            "  recorder files as the killed kernels left them: "
            + ", ".join(f"{k} {v / 1e3:.1f} kB" for k, v in sorted(left.items()))
        )
    print(
        "  targets: median added <= 2 ms, p95 <= 10 ms, whole run <= +5 % back to back; "
        "0 lost over >= 2,000 cells; storage <= 1/25 of Kishu's"
    )


if __name__ == "__main__":
    main()
