"""Benchmark: latency of an output preview of `df.head()` with a large DataFrame in the kernel.

Targets: issue 7, the preview returns within 100 ms plus the cell's own time; issue 12, a
trivial cell's preview within 50 ms p50 end to end with the isolation of issue 12. Starts a
real kernel, fills it with a DataFrame of about --mb megabytes, and compares
  - the cell's own time (df.head() run for real, timed inside the kernel),
  - a silent no-op request (the messaging floor),
  - the preview through the backend (PreviewPredictor.run_preview: fork, isolation, run,
    JSON back, reply), with the kernel's fork time, the child's isolation time and the
    in-kernel total.
The preview's own steps are printed too, from the reply's timing: the fork and the start of
the preview's first process, its isolation, running the cell, and the reply's way back into the
kernel; what remains of the round trip is messaging (the request, the kernel's reply, the
server's side). With --recorder the kernels load the extension (the recorder), as a person's
kernel does. With --baseline DIR (a copy of another version's `jupyter_themisto` package, e.g.
from `git archive main jupyter_themisto | tar -x -C DIR`), a second kernel imports the package
from DIR and the two are measured in turns, under the same load: the ratio is the figure to trust
on a busy machine.

Run: .venv/bin/python benchmarks/preview_latency.py [--mb 500] [--repeat 15] [--cell 'df.head()']
     [--baseline DIR] [--recorder]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

from jupyter_client.manager import AsyncKernelManager
from percentiles import percentile

from jupyter_themisto.backends.base import BackendEnv
from jupyter_themisto.backends.preview import PreviewPredictor


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=500, help="DataFrame size in MB")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--cell", default="df.head()", help="the previewed cell")
    ap.add_argument("--baseline", help="a folder holding another version's jupyter_themisto")
    ap.add_argument("--recorder", action="store_true", help="kernels load the recorder")
    args = ap.parse_args()
    args.store_dir = tempfile.mkdtemp(prefix="preview-latency-")

    versions: dict[str, str | None] = {"this version": None}
    if args.baseline:
        versions["baseline"] = os.path.abspath(args.baseline)
    kernels = {name: await start(args, path) for name, path in versions.items()}
    try:
        for _ in range(args.repeat):  # in turns: both see the same load
            for k in kernels.values():
                await k.measure(args.cell)
    finally:
        for k in kernels.values():
            await k.close()
    for name, k in kernels.items():
        k.report(name, args)
    if args.baseline:
        this = statistics.median(kernels["this version"].total_ms)
        base = statistics.median(kernels["baseline"].total_ms)
        print(
            f"median round trip, this version / baseline: {this / base:.2f} "
            f"({this:.1f} ms / {base:.1f} ms)"
        )
    print(f"load average while measuring: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


class Measured:
    """One kernel with the DataFrame, and what was measured in it."""

    def __init__(self, km: AsyncKernelManager, kc: Any, backend: PreviewPredictor) -> None:
        self.km, self.kc, self.backend = km, kc, backend
        self.cell_ms: list[float] = []
        self.noop_ms: list[float] = []
        self.total_ms: list[float] = []
        self.fork_ms: list[float] = []
        self.setup_ms: list[float] = []
        self.kernel_ms: list[float] = []
        self.steps: dict[str, list[float]] = {}
        self.paths: set[str] = set()
        self.df_mb = 0.0

    async def measure(self, cell: str) -> None:
        r = await self.kc.execute(
            "",
            reply=True,
            timeout=60,
            user_expressions={
                "t": f"(lambda t0: ({cell}, float((time.perf_counter() - t0) * 1000))[1])"
                "(time.perf_counter())"
            },
        )
        self.cell_ms.append(float(r["content"]["user_expressions"]["t"]["data"]["text/plain"]))
        t0 = time.perf_counter()
        await self.kc.execute("", reply=True, timeout=60, silent=True)
        self.noop_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        out = await self.backend.run_preview("unused-id", cell)
        self.total_ms.append((time.perf_counter() - t0) * 1000)
        assert out.get("stopped") == [] and out["outputs"], out
        self.fork_ms.append(out["fork_ms"])
        self.setup_ms.append(out.get("setup_ms", 0.0))
        self.kernel_ms.append(out["elapsed_ms"])
        for step, ms in out.get("timing_ms", {}).items():
            self.steps.setdefault(step, []).append(ms)
        self.paths.add(out.get("path", "?"))

    def report(self, name: str, args: Any) -> None:
        def row(what: str, values: list[float]) -> str:
            return (
                f"| {what} | {statistics.median(values):.1f} | {percentile(values, 0.9):.1f} "
                f"| {max(values):.1f} |"
            )

        print(
            f"\n{name}: DataFrame in the kernel: {self.df_mb:.0f} MB; {args.repeat} runs each"
            + (f"; preview made by: {', '.join(sorted(self.paths))}" if self.steps else "")
        )
        print("| what | median ms | p90 ms | max ms |")
        print("|---|---|---|---|")
        print(row(f"`{args.cell}` run for real (cell's own time, in the kernel)", self.cell_ms))
        print(row("silent no-op request (messaging floor)", self.noop_ms))
        print(row("preview: fork() in the kernel", self.fork_ms))
        print(row("preview: isolation in the child (namespaces, root, layers)", self.setup_ms))
        described = {
            "monitor": "step: fork of the monitor, until it runs",
            "first process": "step: fork of the preview's first process, until it runs",
            "isolated": "step: isolation (mount and user namespaces, root, layers)",
            "ran": "step: the cell run, outputs captured",
            "reply": "step: reply sent, read and parsed in the kernel, namespace ended",
        }
        for step, what in described.items():
            if step in self.steps:
                print(row(what, self.steps[step]))
        print(row("preview: in the kernel (fork..reply ready)", self.kernel_ms))
        print(row("preview: backend round trip (end to end)", self.total_ms))
        rest = [t - k for t, k in zip(self.total_ms, self.kernel_ms, strict=True)]
        print(row("preview: messaging (end to end minus in the kernel)", rest))
        overhead = statistics.median(self.total_ms) - statistics.median(self.cell_ms)
        print(f"median overhead beyond the cell's own time: {overhead:.1f} ms")

    async def close(self) -> None:
        await self.backend.aclose()
        self.kc.stop_channels()
        await self.km.shutdown_kernel(now=True)


async def start(args: Any, package: str | None) -> Measured:
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = package + os.pathsep + env.get("PYTHONPATH", "")
    extra = []
    if args.recorder:
        env["THEMISTO_STORE"] = os.path.join(args.store_dir, f"{package is not None}.sqlite")
        extra = ["--ext=jupyter_themisto"]
    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel(env=env, extra_arguments=extra)
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    m = Measured(km, kc, PreviewPredictor({}, BackendEnv(kernel_manager=km)))
    rows = args.mb * 2**20 // (8 * 8)
    setup = (
        "import numpy as np, pandas as pd, time\n"
        f"df = pd.DataFrame(np.random.default_rng(0).normal(size=({rows}, 8)),"
        " columns=list('abcdefgh'))\n"
    )
    reply = await kc.execute(setup, reply=True, timeout=600)
    assert reply["content"]["status"] == "ok", reply["content"]
    size = await kc.execute(
        "",
        reply=True,
        timeout=60,
        user_expressions={"m": "float(df.memory_usage().sum() / 2**20)"},
    )
    m.df_mb = float(size["content"]["user_expressions"]["m"]["data"]["text/plain"])
    return m


if __name__ == "__main__":
    asyncio.run(main())
