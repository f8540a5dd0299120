"""Benchmark: output-prediction exact match of `preview` against a model and the baselines.

Runs each notebook cell by cell in a real recording kernel (working directory: the notebook's
folder, as the notebook expects). Before a cell runs, each backend predicts its output (preview
in the live kernel; the llamacpp model (SmolLM2), retrieval and the repeat-previous baseline
from the trajectory recorded so far); then the cell runs for real and the text outputs are
compared (exact match, and after masking 0x… addresses and /tmp paths). Only cells with text
output count; a missing prediction counts as a miss. Cells that write files or run `!` commands
are counted on their own too (issue 12: they get previews, in a private copy of the files).

The figures count on the benchmark corpus (`--corpus`: the notebooks of benchmarks/corpus.json,
materialized by benchmarks/corpus.py), real notebooks written by others; without it, the
notebooks given, or benchmarks/notebooks.

Run: .venv/bin/python benchmarks/preview_exact_match.py --corpus [--every K] [--limit N]
     [--backends preview,repeat-previous] [--timeout 5]
     .venv/bin/python benchmarks/preview_exact_match.py [notebooks...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.manager import AsyncKernelManager

from jupyter_themisto.backends.base import BackendEnv, BackendError, NoPrediction
from jupyter_themisto.backends.registry import create_backend
from jupyter_themisto.context import build_context, outputs_to_text
from jupyter_themisto.store import TrajectoryStore

HERE = Path(__file__).parent
BACKENDS = ("preview", "llamacpp", "retrieval", "repeat-previous")
# What differs between two honest runs: object addresses and temporary paths.
VOLATILE = re.compile(r"0x[0-9a-fA-F]+|/tmp/[^\s'\"]+")
# A cell with a side effect on files or a shell command (counted on their own).
SIDE_EFFECT = re.compile(
    r"^\s*[!%]|\.to_(csv|excel|json|parquet|pickle|html)\(|savefig\(|np\.save|savetxt\(|"
    r"open\([^)]*['\"][wa]b?\+?['\"]|\.write\(|os\.(remove|mkdir|makedirs|rename)|shutil\.",
    re.MULTILINE,
)


async def run_real(kc: Any, code: str, timeout: float) -> list[dict[str, Any]]:
    outputs: list[dict[str, Any]] = []

    def hook(msg: dict[str, Any]) -> None:
        kind = msg["msg_type"]
        if kind in ("stream", "execute_result", "display_data", "error"):
            outputs.append({"output_type": kind, **msg["content"]})

    await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return outputs


async def predict(backend: Any, ctx: Any) -> str | None:
    try:
        return "".join([c.text async for c in backend.predict_output(ctx)]) or None
    except (NoPrediction, BackendError):
        return None


class Counts:
    """Per backend and per group of cells: total, answered, exact, exact after masking."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[int]] = {}
        self.misses: list[tuple[str, str, str | None, str]] = []

    def add(self, group: str, backend: str, got: str | None, real: str) -> None:
        c = self.rows.setdefault((group, backend), [0, 0, 0, 0])
        c[0] += 1
        c[1] += got is not None
        c[2] += got == real
        c[3] += got is not None and VOLATILE.sub("~", got) == VOLATILE.sub("~", real)


async def notebook(path: Path, store_path: Path, counts: Counts, args: argparse.Namespace) -> None:
    env = dict(os.environ, THEMISTO_STORE=str(store_path), THEMISTO_NOTEBOOK_PATH=path.name)
    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel(env=env, cwd=str(path.parent), extra_arguments=["--ext=jupyter_themisto"])
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    store = TrajectoryStore(str(store_path))
    benv = BackendEnv(store=store, kernel_manager=km)
    settings = {"preview": {"timeout": args.timeout}}
    backends = {name: create_backend(name, settings.get(name, {}), benv) for name in args.backends}
    try:
        nb = nbformat.read(str(path), as_version=4)
        done = 0
        until = time.monotonic() + args.notebook_timeout
        for cell in nb.cells:
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            if time.monotonic() > until:
                print(f"  {path.name}: past {args.notebook_timeout:g} s; the rest is left out")
                return
            rows: list[dict[str, Any]] = []
            variables: list[dict[str, Any]] = []
            tid = None
            deadline = time.monotonic() + 30
            while done and time.monotonic() < deadline:  # the recorder writes after the reply
                found = store.list_trajectories(notebook_path=path.name, limit=1)
                if found:
                    tid = found[0]["id"]
                    rows = store.list_executions(tid)
                    if len(rows) >= done and rows[-1].get("snapshot_status") != "pending":
                        break
                await asyncio.sleep(0.05)
            if tid:
                variables = store.latest_variables(tid)
            ctx = build_context(
                rows, variables, target_source=cell.source, kernel_id="live", trajectory_id=tid
            )
            predictions = {name: await predict(b, ctx) for name, b in backends.items()}
            try:
                real = outputs_to_text(
                    await run_real(kc, cell.source, args.cell_timeout), limit=1 << 20
                )
            except TimeoutError:
                print(f"  {path.name}: a cell ran past {args.cell_timeout} s; next notebook")
                return
            done += 1
            if not real.strip():
                continue
            groups = ["all"] + (["side effects"] if SIDE_EFFECT.search(cell.source) else [])
            for name, got in predictions.items():
                for group in groups:
                    counts.add(group, name, got, real)
                if name == "preview" and got != real:
                    why = "" if got is not None else str(backends[name].last_reply or "")[:300]
                    counts.misses.append((path.name, cell.source[:200], got, real[:200] + why))
    finally:
        for b in backends.values():
            await b.aclose()
        store.close()
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--corpus", action="store_true", help="the notebooks of benchmarks/corpus.json")
    ap.add_argument("--every", type=int, default=1, help="every K-th notebook only")
    ap.add_argument("--limit", type=int, default=0, help="at most N notebooks")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    ap.add_argument("--timeout", type=float, default=5.0, help="the preview's timeout (s)")
    ap.add_argument("--cell-timeout", type=float, default=120.0, help="a real cell's limit (s)")
    ap.add_argument("--notebook-timeout", type=float, default=600.0, help="per notebook (s)")
    ap.add_argument("--misses", type=int, default=0, help="print the first N preview misses")
    args = ap.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    if args.corpus:
        sys.path.insert(0, str(HERE))
        try:
            import corpus  # benchmarks/corpus.py
        except ImportError:
            sys.exit("preview_exact_match: --corpus needs benchmarks/corpus.py")
        paths = corpus.notebooks()
    else:
        paths = [p.resolve() for p in args.notebooks] or sorted(
            (HERE / "notebooks").glob("*.ipynb")
        )
    paths = paths[:: args.every]
    if args.limit:
        paths = paths[: args.limit]
    counts = Counts()
    started = time.monotonic()
    finished = 0
    # (stopped early, by Ctrl+C or a SIGTERM, it prints what it has counted)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, path in enumerate(paths):
                print(f"[{i + 1}/{len(paths)}] {path}", flush=True)
                await notebook(path.resolve(), Path(tmp) / f"store{i}.sqlite", counts, args)
                finished += 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("stopped early")
    print(f"\n{finished} of {len(paths)} notebooks in {time.monotonic() - started:.0f} s")
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("| cells | backend | cells with text output | answered | exact match | exact, masked |")
    print("|---|---|---|---|---|---|")
    for (group, name), (total, answered, em, masked) in sorted(counts.rows.items()):
        print(
            f"| {group} | {name} | {total} | {answered / total:.1%} | {em / total:.1%} ({em}) "
            f"| {masked / total:.1%} ({masked}) |"
        )
    for nb, source, got, real in counts.misses[: args.misses]:
        print(f"\n--- {nb}\n{source}\n--- preview: {got!r}\n--- real: {real!r}")


if __name__ == "__main__":
    asyncio.run(main())
