"""Benchmark: latency of an output preview of `df.head()` with a large DataFrame in the kernel.

Target (issue 7): the preview returns within 100 ms plus the cell's own time. Starts a real
kernel, fills it with a DataFrame of about --mb megabytes, and compares
  - the cell's own time (df.head() run for real, timed inside the kernel),
  - a silent no-op request (the messaging floor),
  - the preview through the backend (PreviewPredictor.run_preview: fork, lockdown, run,
    JSON back, reply), with the kernel's own fork time and in-kernel total.

Run: .venv/bin/python benchmarks/preview_latency.py [--mb 500] [--repeat 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from jupyter_client.manager import AsyncKernelManager

from jupyter_themisto.backends.base import BackendEnv
from jupyter_themisto.backends.preview import PreviewPredictor


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=500, help="DataFrame size in MB")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    try:
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
        df_mb = float(size["content"]["user_expressions"]["m"]["data"]["text/plain"])

        cell_ms = []
        for _ in range(args.repeat):
            r = await kc.execute(
                "",
                reply=True,
                timeout=60,
                user_expressions={
                    "t": "(lambda t0: (df.head(), float((time.perf_counter() - t0) * 1000))[1])"
                    "(time.perf_counter())"
                },
            )
            cell_ms.append(float(r["content"]["user_expressions"]["t"]["data"]["text/plain"]))

        noop_ms = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            await kc.execute("", reply=True, timeout=60, silent=True)
            noop_ms.append((time.perf_counter() - t0) * 1000)

        backend = PreviewPredictor({}, BackendEnv(kernel_manager=km))
        total_ms, fork_ms, kernel_ms = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = await backend.run_preview("unused-id", "df.head()")
            total_ms.append((time.perf_counter() - t0) * 1000)
            assert out["stopped"] == [] and out["outputs"], out
            fork_ms.append(out["fork_ms"])
            kernel_ms.append(out["elapsed_ms"])
        await backend.aclose()
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)

    def row(name: str, values: list[float]) -> str:
        return (
            f"| {name} | {statistics.median(values):.1f} | {pct(values, 0.9):.1f} "
            f"| {max(values):.1f} |"
        )

    print(f"DataFrame in the kernel: {df_mb:.0f} MB; {args.repeat} runs each")
    print("| what | median ms | p90 ms | max ms |")
    print("|---|---|---|---|")
    print(row("df.head() run for real (cell's own time, in the kernel)", cell_ms))
    print(row("silent no-op request (messaging floor)", noop_ms))
    print(row("preview: fork() in the kernel", fork_ms))
    print(row("preview: in the kernel (fork..reply ready)", kernel_ms))
    print(row("preview: backend round trip", total_ms))
    overhead = statistics.median(total_ms) - statistics.median(cell_ms)
    print(f"median overhead beyond the cell's own time: {overhead:.1f} ms (target < 100 ms)")


if __name__ == "__main__":
    asyncio.run(main())
