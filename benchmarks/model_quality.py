"""Prediction quality of backends, with and without runtime information; prints the table.

The whole research pipeline through the real CLI: `jupyter themisto record` re-executes the
notebooks (default: benchmarks/notebooks/*.ipynb) into a fresh store, `export` writes the
dump, and `evaluate` runs every backend on both tasks, with and without the runtime summary.
Each evaluation is leave-one-notebook-out where a backend learns from history: the retrieval
backend sees only the notebook's own earlier cells (no --train), as a person's first session
would give it. Prints `results.md` (exact match, ROUGE-L, chrF, BLEU, API precision/recall).

    .venv/bin/python benchmarks/model_quality.py [--backends retrieval,llamacpp]
        [--out DIR] [notebooks...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "jupyter_themisto.cli"]


def run(*args: str) -> None:
    start = time.perf_counter()
    subprocess.run([*CLI, *args], check=True)
    print(f"   ({time.perf_counter() - start:.1f} s)", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--backends", default="retrieval,llamacpp")
    p.add_argument("--tasks", default="next-cell,output")
    p.add_argument("--out", type=Path, default=None, help="keep the store, dump and results here")
    args = p.parse_args()
    notebooks = args.notebooks or sorted((HERE / "notebooks").glob("*.ipynb"))
    with tempfile.TemporaryDirectory() as d:
        out = args.out or Path(d)
        out.mkdir(parents=True, exist_ok=True)
        store, dump = out / "trajectories.sqlite", out / "dump"
        if not dump.exists():
            run("--store", str(store), "record", *map(str, notebooks))
            run("--store", str(store), "export", "--out", str(dump))
        for task in args.tasks.split(","):
            for backend in args.backends.split(","):
                for runtime in ("--with-runtime", "--without-runtime"):
                    print(f"== {task} {backend} {runtime}", file=sys.stderr)
                    run("evaluate", str(dump), "--backend", backend, "--task", task, runtime)
        print((dump / "evaluation" / "results.md").read_text())


if __name__ == "__main__":
    main()
