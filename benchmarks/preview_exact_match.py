"""Benchmark: output-prediction exact match of `preview` against a model and the baselines.

Runs each notebook cell by cell in a real recording kernel (working directory: the notebook's
folder, as the notebook expects). Before a cell runs, each backend predicts its output (preview
in the live kernel; the llamacpp model (SmolLM2), retrieval and the repeat-previous baseline
from the trajectory recorded so far); then the cell runs for real and the text outputs are
compared as the notebook shows them (clear_output applied): exactly, and "masked" — after
masking what two honest runs of the same cell never share: 0x… object addresses, /tmp paths and
durations (`Wall time: 1.2 ms`, `%timeit`'s figures, `total time=0.1s`, `0.087 seconds`). Only
cells with text output count; a missing prediction counts as a miss. Cells that write files or
run `!` commands are counted on their own too (issue 12: they get previews, in a private copy of
the files).

For the preview it also says why each miss missed: no answer because the preview's timeout
stopped it (split by whether the real cell itself ran longer than the timeout, which no preview
can answer within it, or not: the preview's own cost or the machine's load), because something
else stopped it (what), or an answer equal after masking, or different. The machine's load
average is printed (the timeout is wall clock: a loaded machine stretches slow cells past it).

The figures count on the benchmark corpus (`--corpus`: the notebooks of benchmarks/corpus.json,
materialized by benchmarks/corpus.py), real notebooks written by others; without it, the
notebooks given, or benchmarks/notebooks.

Run: nice .venv/bin/python benchmarks/preview_exact_match.py --corpus [--every K] [--limit N]
     [--only SUBSTRING] [--backends preview,repeat-previous] [--timeout 50] [--misses N]
     .venv/bin/python benchmarks/preview_exact_match.py [notebooks...]
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
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
from jupyter_themisto.backends.preview import PreviewSettings
from jupyter_themisto.backends.registry import create_backend
from jupyter_themisto.context import build_context, outputs_to_text
from jupyter_themisto.store import TrajectoryStore

HERE = Path(__file__).parent
BACKENDS = ("preview", "llamacpp", "retrieval", "repeat-previous")
# What differs between two honest runs: object addresses, temporary paths, durations.
VOLATILE = re.compile(
    r"0x[0-9a-fA-F]+|/tmp/[^\s'\"]+"
    r"|\d[\d.,]*\s*(?:ns|us|µs|μs|ms|s|secs?|seconds?|min|minutes?)\b"
    r"(?: ± [\d.,]+\s*(?:ns|us|µs|μs|ms|s))?"
    r"|\d[\d,]* loops? each|\d+ runs?,"
)
# A cell with a side effect on files or a shell command (counted on their own).
SIDE_EFFECT = re.compile(
    r"^\s*[!%]|\.to_(csv|excel|json|parquet|pickle|html)\(|savefig\(|np\.save|savetxt\(|"
    r"open\([^)]*['\"][wa]b?\+?['\"]|\.write\(|os\.(remove|mkdir|makedirs|rename)|shutil\.",
    re.MULTILINE,
)


async def run_real(kc: Any, code: str, timeout: float) -> tuple[list[dict[str, Any]], float]:
    """The cell's outputs as the notebook keeps them (clear_output applied), and its wall time
    (request to reply, seconds)."""
    outputs: list[dict[str, Any]] = []
    clear_waiting = False

    def hook(msg: dict[str, Any]) -> None:
        nonlocal clear_waiting
        kind = msg["msg_type"]
        if kind == "clear_output":
            if msg["content"].get("wait"):
                clear_waiting = True
            else:
                outputs.clear()
        elif kind in ("stream", "execute_result", "display_data", "error"):
            if clear_waiting:
                outputs.clear()
                clear_waiting = False
            outputs.append({"output_type": kind, **msg["content"]})

    started = time.monotonic()
    await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return outputs, time.monotonic() - started


async def predict(backend: Any, ctx: Any) -> str | None:
    try:
        return "".join([c.text async for c in backend.predict_output(ctx)]) or None
    except (NoPrediction, BackendError):
        return None


def masked(text: str) -> str:
    return VOLATILE.sub("~", text)


class Counts:
    """Per backend and per group of cells: total, answered, exact, exact after masking; why
    the preview missed; the machine's load along the way."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[int]] = {}
        self.misses: list[tuple[str, str, str | None, str, str]] = []
        self.why: dict[str, int] = {}
        self.loads: list[float] = []

    def add(self, group: str, backend: str, got: str | None, real: str) -> None:
        c = self.rows.setdefault((group, backend), [0, 0, 0, 0])
        c[0] += 1
        c[1] += got is not None
        c[2] += got == real
        c[3] += got is not None and masked(got) == masked(real)

    def miss(self, why: str) -> None:
        self.why[why] = self.why.get(why, 0) + 1


def why_missed(
    got: str | None, real: str, reply: dict[str, Any] | None, real_s: float, timeout: float
) -> str:
    """Why the preview's answer is not the real output, in one of a few words."""
    if got is not None:
        if masked(got) == masked(real):
            return "answered, equal after masking (addresses, temporary paths, durations)"
        return "answered, different"
    reply = reply or {}
    stopped = " ".join(reply.get("stopped") or [])
    if "run longer than" in stopped:
        if real_s >= timeout:
            return f"no answer: timeout; the real cell too ran {timeout:g} s or longer"
        return f"no answer: timeout; the real cell ran less than {timeout:g} s"
    if stopped:
        return f"no answer: stopped ({stopped[:60]})"
    if reply.get("status") not in (None, "ok"):
        return f"no answer: {reply.get('status')} ({str(reply.get('detail', ''))[:60]})"
    return "no answer: the preview shows no text output"


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
            predictions = {}
            for name, b in backends.items():
                if name == "preview":
                    b.last_reply = None
                predictions[name] = await predict(b, ctx)
            try:
                outputs, real_s = await run_real(kc, cell.source, args.cell_timeout)
            except TimeoutError:
                print(f"  {path.name}: a cell ran past {args.cell_timeout} s; next notebook")
                return
            real = outputs_to_text(outputs, limit=1 << 20)
            done += 1
            if not real.strip():
                continue
            groups = ["all"] + (["side effects"] if SIDE_EFFECT.search(cell.source) else [])
            for name, got in predictions.items():
                for group in groups:
                    counts.add(group, name, got, real)
                if name == "preview" and got != real:
                    reply = backends[name].last_reply
                    why = why_missed(got, real, reply, real_s, args.timeout)
                    counts.miss(why)
                    counts.misses.append((path.name, cell.source[:300], got, real, why))
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
    ap.add_argument("--only", default="", help="only notebooks whose path holds this")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    ap.add_argument(
        "--timeout",
        type=float,
        default=PreviewSettings.model_fields["timeout"].default,
        help="the preview's timeout (s; default: the backend's)",
    )
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
    if args.only:
        paths = [p for p in paths if args.only in str(p)]
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
                counts.loads.append(os.getloadavg()[0])
                print(f"[{i + 1}/{len(paths)}] {path} (load {counts.loads[-1]:.2f})", flush=True)
                await notebook(path.resolve(), Path(tmp) / f"store{i}.sqlite", counts, args)
                finished += 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("stopped early")
    counts.loads.append(os.getloadavg()[0])
    print(f"\n{finished} of {len(paths)} notebooks in {time.monotonic() - started:.0f} s")
    loads = sorted(counts.loads)
    print(
        f"load average (1 min) at each notebook's start: median {loads[len(loads) // 2]:.2f}, "
        f"max {loads[-1]:.2f} on {os.cpu_count()} cores; preview timeout {args.timeout:g} s"
    )
    print("| cells | backend | cells with text output | answered | exact match | exact, masked |")
    print("|---|---|---|---|---|---|")
    for (group, name), (total, answered, em, masked_em) in sorted(counts.rows.items()):
        print(
            f"| {group} | {name} | {total} | {answered / total:.1%} | {em / total:.1%} ({em}) "
            f"| {masked_em / total:.1%} ({masked_em}) |"
        )
    total = counts.rows.get(("all", "preview"), [0])[0]
    if total:
        print("\npreview misses by cause:")
        print("| cause | cells | share of all cells |")
        print("|---|---|---|")
        for why, n in sorted(counts.why.items(), key=lambda kv: -kv[1]):
            print(f"| {why} | {n} | {n / total:.1%} |")
    for nb, source, got, real, why in counts.misses[: args.misses]:
        print(f"\n--- {nb}: {why}\n{source}")
        if got is None:
            print(f"--- real: {real[:300]!r}")
            continue
        diff = difflib.unified_diff(
            real.splitlines(), got.splitlines(), "real", "preview", n=1, lineterm=""
        )
        print("\n".join(list(diff)[:30]))


if __name__ == "__main__":
    asyncio.run(main())
