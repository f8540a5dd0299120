"""Prediction quality of backends, with and without runtime information, in the trajectory
and the live setting; prints the table and the issue's figures.

The whole research pipeline through the real CLI: `jupyter themisto record` re-executes the
notebooks into a store — by default the benchmark corpus (benchmarks/corpus.json, real public
notebooks written by others, recorded by benchmarks/corpus.py), or the notebooks named, or a
store recorded before (--store); `export` writes one dump per notebook and, beside it, one of
all the other notebooks; `evaluate` runs every backend on every task, with and without the
runtime summary, in each setting — `trajectory` (the executions before the target only) and
`live` (also what the browser sends: the notebook's markdown above the target and the cells
below it) — leave-one-notebook-out: a backend that learns from history (retrieval, ret-train,
the retrieved candidates of a local model) may use the other notebooks (`--train`), never the
evaluated one. The runs of all notebooks go to one results folder, so the table (exact match,
ROUGE-L, chrF, BLEU, API precision/recall) covers them all.

    .venv/bin/python benchmarks/model_quality.py [--backends repeat-previous,llamacpp]
        [--tasks next-cell] [--settings trajectory,live] [-o llamacpp:model_path=qwen.gguf]
        [--store trajectories.sqlite] [--out DIR] [notebooks...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "jupyter_themisto.cli"]


def run(*args: str) -> str:
    start = time.perf_counter()
    out = subprocess.run([*CLI, *args], check=True, stdout=subprocess.PIPE, text=True).stdout
    print(f"   {' '.join(args[:6])} … ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return out


def figures(summary: dict, model: str) -> list[str]:
    """The issue's figures for next-cell: `model` against repeat-previous, runtime on/off."""
    runs = {
        (s["backend"], s["with_runtime"], s.get("setting", "trajectory")): s["metrics"]
        for s in summary["runs"].values()
        if s["task"] == "next-cell"
    }
    lines = []
    for setting in ("trajectory", "live"):
        base = runs.get(("repeat-previous", False, setting)) or runs.get(
            ("repeat-previous", True, setting)
        )
        with_rt = runs.get((model, True, setting))
        without = runs.get((model, False, setting))
        if not with_rt:
            continue
        chrf, em = 100 * with_rt["chrf"], 100 * with_rt["exact_match"]
        line = f"next cell, {setting} setting, {model} with runtime: chrF {chrf:.1f}, EM {em:.1f} %"
        if base:
            line += f"; {chrf - 100 * base['chrf']:+.1f} chrF over repeat-previous"
        if without:
            line += f"; {chrf - 100 * without['chrf']:+.1f} chrF over without runtime"
        lines.append(line)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: the benchmark corpus")
    p.add_argument("--backends", default="repeat-previous,retrieval,llamacpp")
    p.add_argument("--tasks", default="next-cell,output")
    p.add_argument("--settings", default="trajectory,live")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="BACKEND:KEY=VALUE",
        help="a backend setting for evaluate, e.g. llamacpp:model_path=~/qwen.gguf",
    )
    p.add_argument("--store", type=Path, default=None, help="use this recorded store as it is")
    p.add_argument("--min-context", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="keep the store, dumps and results here")
    args = p.parse_args()
    options: dict[str, list[str]] = {}
    for item in args.option:
        backend, sep, setting = item.partition(":")
        if not sep:
            p.error(f"-o wants BACKEND:KEY=VALUE, not {item!r}")
        options.setdefault(backend, []).extend(["-o", setting])
    with tempfile.TemporaryDirectory() as d:
        out = args.out or Path(d)
        out.mkdir(parents=True, exist_ok=True)
        store_file = args.store or out / "trajectories.sqlite"
        store = ["--store", str(store_file)]
        if args.store is None and not (out / "dumps").exists():
            if args.notebooks:
                run(*store, "record", "--allow-errors", *map(str, args.notebooks))
            else:
                sys.path.insert(0, str(HERE))
                import corpus  # benchmarks/corpus.py: materializes and records the corpus

                corpus.ensure_recorded(store_file)
        ids = [t["id"] for t in json.loads(run(*store, "list", "--json"))]
        for tid in ids:
            for name, chosen in ((tid, [tid]), (f"rest-{tid}", [i for i in ids if i != tid])):
                if not (out / "dumps" / name).exists():
                    run(
                        *store,
                        "export",
                        "--out",
                        str(out / "dumps" / name),
                        "--trajectory",
                        *chosen,
                    )
        results = out / "results"
        for task in args.tasks.split(","):
            for backend in args.backends.split(","):
                for setting in args.settings.split(","):
                    for runtime in ("--with-runtime", "--without-runtime"):
                        for tid in ids:
                            run(
                                "evaluate",
                                str(out / "dumps" / tid),
                                "--train",
                                str(out / "dumps" / f"rest-{tid}"),
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
                                runtime,
                                *options.get(backend, []),
                            )
        print((results / "results.md").read_text())
        summary = json.loads((results / "summary.json").read_text())
        for backend in args.backends.split(","):
            if backend != "repeat-previous":
                for line in figures(summary, backend):
                    print(line)


if __name__ == "__main__":
    main()
