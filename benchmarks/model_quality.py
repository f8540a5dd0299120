"""Prediction quality of backends, with and without runtime information; prints the table.

The whole research pipeline through the real CLI: `jupyter themisto record` re-executes the
notebooks (default: benchmarks/notebooks/*.ipynb) into a fresh store; `export` writes one
dump per notebook and, beside it, one of all the other notebooks; `evaluate` runs every
backend on both tasks, with and without the runtime summary, leave-one-notebook-out: a
backend that learns from history (retrieval) may use the other notebooks (`--train`), never
the evaluated one past the current cell. The runs of all notebooks go to one results folder,
so the table (exact match, ROUGE-L, chrF, BLEU, API precision/recall) covers them all.

    .venv/bin/python benchmarks/model_quality.py [--backends retrieval,llamacpp]
        [--out DIR] [notebooks...]
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
    print(f"   {' '.join(args[:4])} … ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--backends", default="retrieval,llamacpp")
    p.add_argument("--tasks", default="next-cell,output")
    p.add_argument("--out", type=Path, default=None, help="keep the store, dumps and results here")
    args = p.parse_args()
    notebooks = args.notebooks or sorted((HERE / "notebooks").glob("*.ipynb"))
    with tempfile.TemporaryDirectory() as d:
        out = args.out or Path(d)
        out.mkdir(parents=True, exist_ok=True)
        store = ["--store", str(out / "trajectories.sqlite")]
        if not (out / "dumps").exists():
            run(*store, "record", *map(str, notebooks))
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
                            runtime,
                        )
        print((results / "results.md").read_text())


if __name__ == "__main__":
    main()
