"""Prediction quality of backends, with and without runtime information, in the trajectory
and the live setting; prints the table and the issue's figures.

The whole research pipeline through the real CLI: `jupyter themisto record` re-executes the
notebooks into a store — by default the benchmark corpus (benchmarks/corpus.json, real public
notebooks written by others, recorded by benchmarks/corpus.py), or the notebooks named, or a
store recorded before (--store); `export` writes one dump of them all; `evaluate
--leave-one-out` runs every backend on every task, with and without the runtime summary, in
each setting — `trajectory` (the executions before the target only) and `live` (also what the
browser sends: the notebook's markdown above the target and the cells below it) — where a
backend that learns from history (retrieval, ret-train, the retrieved stand-ins of a local
model) may use every other notebook, never the evaluated one. Each notebook's instances run in
the order they were executed (a local model's prompt cache serves them), one at a time. The
table covers exact match, ROUGE-L, chrF, BLEU and API precision/recall; below it, the issue's
next-cell figures with paired bootstrap intervals (the same instances), the machine's load and
how many answers the backend's time limit ended.

    .venv/bin/python benchmarks/model_quality.py [--backends repeat-previous,llamacpp]
        [--tasks next-cell] [--settings trajectory,live] [--limit 1200]
        [-o llamacpp:n_threads=1] [--store trajectories.sqlite] [--out DIR] [notebooks...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from jupyter_themisto.metrics import paired_difference  # noqa: E402

CLI = [sys.executable, "-m", "jupyter_themisto.cli"]


def run(*args: str) -> str:
    """Run a CLI command; a failure is reported and the benchmark goes on (evaluate exits 1
    when some examples failed: a rerun retries only those)."""
    start = time.perf_counter()
    done = subprocess.run([*CLI, *args], stdout=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    print(f"   {' '.join(args[:8])} … ({took:.1f} s, exit {done.returncode})", file=sys.stderr)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args[:3])} failed (exit {done.returncode})")
    return done.stdout


def chrf_by_id(results: Path, name: str) -> dict[str, float]:
    path = results / f"{name}.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: 100 * r["scores"]["chrf"] for r in rows if "scores" in r}


def compare(results: Path, base: str, other: str) -> str:
    """`other` - `base` in chrF on the instances both scored, with its interval."""
    a, b = chrf_by_id(results, base), chrf_by_id(results, other)
    ids = sorted(set(a) & set(b))
    if not ids:
        return "n/a"
    d = paired_difference([a[i] for i in ids], [b[i] for i in ids])
    return (
        f"{d['mean']:+.1f} chrF [95 % CI {d['low']:+.1f}, {d['high']:+.1f}]"
        f" on {len(ids)} paired instances"
    )


def figures(summary: dict, model: str, results: Path) -> list[str]:
    """The issue's figures for next-cell: `model` against repeat-previous, runtime on/off."""
    runs = {
        (s["backend"], s["with_runtime"], s.get("setting", "trajectory")): (name, s)
        for name, s in summary["runs"].items()
        if s["task"] == "next-cell"
    }
    lines = []
    for setting in ("trajectory", "live"):
        base = runs.get(("repeat-previous", False, setting)) or runs.get(
            ("repeat-previous", True, setting)
        )
        for with_runtime in (True, False):
            found = runs.get((model, with_runtime, setting))
            if not found:
                continue
            name, s = found
            m = s["metrics"]
            label = "with" if with_runtime else "without"
            line = (
                f"next cell, {setting} setting, {model} {label} runtime: n {s['n']},"
                f" chrF {100 * m['chrf']:.1f}, EM {100 * m['exact_match']:.1f} %,"
                f" {s.get('n_no_prediction', 0)} without a suggestion,"
                f" {s.get('n_timed_out', 0)} ended by the time limit,"
                f" mean {s.get('mean_latency') or 0:.2f} s"
            )
            lines.append(line)
            if base:
                lines.append(f"    over repeat-previous: {compare(results, base[0], name)}")
        with_rt, without = runs.get((model, True, setting)), runs.get((model, False, setting))
        if with_rt and without:
            lines.append(
                f"    {setting}: with runtime over without: "
                + compare(results, without[0], with_rt[0])
            )
    return lines


def unknown_names(dump: Path, results: Path, name: str) -> str | None:
    """How many of a with-runtime next-cell run's whole answers read names the live kernel lacks
    (backends/checks.py: NameError, a list's missing attribute, a DataFrame's missing column
    when run), and their chrF beside the others': the room a runtime check has to help."""
    from jupyter_themisto.backends.checks import unknown_references
    from jupyter_themisto.dump import DumpContexts, read_manifest, read_table

    path = results / f"{name}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    # (an answer the time limit cut mid-statement reads names it never got to bind)
    rows = [r for r in rows if "scores" in r and r["prediction"].strip() and not r.get("timed_out")]
    if not rows:
        return None
    manifest = read_manifest(dump)
    contexts = DumpContexts(read_table(dump, manifest, "executions"), 3000)
    instances = {i["id"]: i for i in read_table(dump, manifest, "next_cell")}
    flagged, clean = [], []
    for r in rows:
        found = unknown_references(r["prediction"], contexts.build(instances[r["id"]], True))
        if found is not None:
            (flagged if found else clean).append(100 * r["scores"]["chrf"])

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return (
        f"    answers reading names the kernel lacks: {len(flagged)} of {len(rows)}"
        f" (chrF {mean(flagged):.1f}; the {len(clean)} that read none: {mean(clean):.1f};"
        f" {len(rows) - len(flagged) - len(clean)} could not be told)"
    )


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return (
        f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min), {os.cpu_count()} cores"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: the benchmark corpus")
    p.add_argument("--backends", default="repeat-previous,retrieval,llamacpp")
    p.add_argument("--tasks", default="next-cell,output")
    p.add_argument("--settings", default="trajectory,live")
    p.add_argument(
        "--runtime",
        default="with,without",
        help="with,without (both, the default), with or without",
    )
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="BACKEND:KEY=VALUE",
        help="a backend setting for evaluate, e.g. llamacpp:n_threads=1",
    )
    p.add_argument("--store", type=Path, default=None, help="use this recorded store as it is")
    p.add_argument("--min-context", type=int, default=1)
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="the first N instances of each task (whole notebooks in trajectory-id order,"
        " i.e. a fixed pseudo-random choice of notebooks)",
    )
    p.add_argument("--out", type=Path, default=None, help="keep the store, dumps and results here")
    args = p.parse_args()
    options: dict[str, list[str]] = {}
    for item in args.option:
        backend, sep, setting = item.partition(":")
        if not sep:
            p.error(f"-o wants BACKEND:KEY=VALUE, not {item!r}")
        options.setdefault(backend, []).extend(["-o", setting])
    print(f"start: {load()}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        out = args.out or Path(d)
        out.mkdir(parents=True, exist_ok=True)
        store_file = args.store or out / "trajectories.sqlite"
        store = ["--store", str(store_file)]
        dump = out / "dump"
        sys.path.insert(0, str(HERE))
        import corpus  # benchmarks/corpus.py: materializes and records the corpus

        if args.store is None and not dump.exists():
            if args.notebooks:
                run(*store, "record", "--allow-errors", *map(str, args.notebooks))
            else:
                corpus.ensure_recorded(store_file)
        if not dump.exists():
            # A corpus store recorded from an older manifest: only the notebooks listed now.
            chosen = None if args.notebooks else corpus.listed_trajectories(store_file)
            only = ["--trajectory", *chosen] if chosen else []
            run(*store, "export", "--out", str(dump), *only)
        results = out / "results"
        limit = ["--limit", str(args.limit)] if args.limit else []
        runtimes = [r.strip() for r in args.runtime.split(",")]
        for task in args.tasks.split(","):
            for backend in args.backends.split(","):
                for setting in args.settings.split(","):
                    for runtime in runtimes:
                        run(
                            "evaluate",
                            str(dump),
                            "--leave-one-out",
                            "--out",
                            str(results),
                            "--backend",
                            backend,
                            "--task",
                            task,
                            "--setting",
                            setting,
                            "--min-context",
                            str(args.min_context),
                            "--concurrency",
                            "1",
                            f"--{runtime}-runtime",
                            *limit,
                            *options.get(backend, []),
                        )
        print((results / "results.md").read_text())
        summary = json.loads((results / "summary.json").read_text())
        for backend in args.backends.split(","):
            if backend != "repeat-previous":
                for line in figures(summary, backend, results):
                    print(line)
                for name, s in summary["runs"].items():
                    if s["backend"] == backend and s["with_runtime"] and s["task"] == "next-cell":
                        line = unknown_names(dump, results, name)
                        if line:
                            print(f"{name}:\n{line}")
        print(f"end: {load()}")


if __name__ == "__main__":
    main()
