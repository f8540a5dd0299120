"""Benchmark: output-prediction exact match of `preview` against a model and the baselines.

Runs each notebook of benchmarks/notebooks cell by cell in a real recording kernel. Before a
cell runs, each backend predicts its output (preview in the live kernel; the llamacpp model
(SmolLM2), retrieval and the repeat-previous baseline from the trajectory recorded so far);
then the cell runs for real and the text outputs are compared (exact match, and after masking
0x… addresses and /tmp paths). Only cells with text output count; a missing prediction counts
as a miss.

Run: .venv/bin/python benchmarks/preview_exact_match.py [notebooks...]
"""

from __future__ import annotations

import asyncio
import os
import re
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


async def run_real(kc: Any, code: str) -> list[dict[str, Any]]:
    outputs: list[dict[str, Any]] = []

    def hook(msg: dict[str, Any]) -> None:
        kind = msg["msg_type"]
        if kind in ("stream", "execute_result", "display_data", "error"):
            outputs.append({"output_type": kind, **msg["content"]})

    await kc.execute_interactive(code, timeout=600, output_hook=hook)
    return outputs


async def predict(backend: Any, ctx: Any) -> str | None:
    try:
        return "".join([c.text async for c in backend.predict_output(ctx)]) or None
    except (NoPrediction, BackendError):
        return None


async def notebook(path: Path, store_path: Path, counts: dict[str, list[int]]) -> None:
    env = dict(os.environ, THEMISTO_STORE=str(store_path), THEMISTO_NOTEBOOK_PATH=path.name)
    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel(env=env, cwd=str(path.parent), extra_arguments=["--ext=jupyter_themisto"])
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    store = TrajectoryStore(str(store_path))
    benv = BackendEnv(store=store, kernel_manager=km)
    backends = {name: create_backend(name, {}, benv) for name in BACKENDS}
    try:
        nb = nbformat.read(str(path), as_version=4)
        done = 0
        for cell in nb.cells:
            if cell.cell_type != "code" or not cell.source.strip():
                continue
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
            real = outputs_to_text(await run_real(kc, cell.source), limit=1 << 20)
            done += 1
            if not real.strip():
                continue
            for name, got in predictions.items():
                c = counts.setdefault(name, [0, 0, 0, 0])
                c[0] += 1
                c[1] += got is not None
                c[2] += got == real
                c[3] += got is not None and VOLATILE.sub("~", got) == VOLATILE.sub("~", real)
    finally:
        for b in backends.values():
            await b.aclose()
        store.close()
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


async def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((HERE / "notebooks").glob("*.ipynb"))
    counts: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(paths):
            await notebook(path.resolve(), Path(tmp) / f"store{i}.sqlite", counts)
    n = next(iter(counts.values()))[0] if counts else 0
    print(f"{len(paths)} notebooks, {n} cells with text output")
    print("| backend | answered | exact match | exact match, addresses and temp paths masked |")
    print("|---|---|---|---|")
    for name in BACKENDS:
        total, answered, em, masked = counts.get(name, [0, 0, 0, 0])
        total = total or 1
        print(
            f"| {name} | {answered / total:.1%} | {em / total:.1%} ({em}) "
            f"| {masked / total:.1%} ({masked}) |"
        )


if __name__ == "__main__":
    asyncio.run(main())
