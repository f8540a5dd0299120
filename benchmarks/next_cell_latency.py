"""Next-cell latency through a real Jupyter server with the retrieval backend; prints figures.

A 300-execution trajectory (plus 20 older trajectories of history) is written to a fresh
store; a `jupyter server` with the extension is started in a subprocess; then

1. sequential requests over HTTP (full SSE answer read): p50 / p95 / max;
2. the same predictions in-process (context building + backend, no HTTP): the server's
   overhead is the difference of the medians;
3. 50 concurrent requests: all must answer with the same suggestions as the direct call.

Usage: .venv/bin/python benchmarks/next_cell_latency.py [--requests 200] [--concurrency 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from percentiles import percentile

from jupyter_themisto.backends import BackendEnv
from jupyter_themisto.backends.retrieval import RetrievalPredictor
from jupyter_themisto.server.manager import ThemistoManager
from jupyter_themisto.server.models import NextCellRequest
from jupyter_themisto.store import TrajectoryStore

TEMPLATES = [
    "import pandas as pd\nimport numpy as np",
    "{v} = pd.read_csv('data/{v}.csv')",
    "{v}.head()",
    "{v}.describe()",
    "{v}.info()",
    "{v}.isna().sum()",
    "{v} = {v}.dropna()",
    "{v}['total'] = {v}['price'] * {v}['quantity']",
    "{v}.groupby('region')['total'].sum()",
    "{v}.groupby('region')['total'].sum().plot.bar()",
    "{v}_pivot = {v}.pivot_table(index='region', columns='month', values='total')",
    "{v}_pivot.head()",
    "from sklearn.model_selection import train_test_split",
    "X = {v}[['price', 'quantity']]\ny = {v}['total']",
    "X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2)",
    "from sklearn.linear_model import LinearRegression\nmodel = LinearRegression()",
    "model.fit(X_train, y_train)",
    "model.score(X_test, y_test)",
    "preds = model.predict(X_test)\npreds[:10]",
    "np.sqrt(((preds - y_test) ** 2).mean())",
]
NAMES = ["sales", "orders", "users", "events", "stock", "churn", "visits", "trips"]


def trajectory_sources(n: int, seed: int) -> list[str]:
    out = []
    for i in range(n):
        t = TEMPLATES[(i + seed) % len(TEMPLATES)]
        out.append(t.format(v=NAMES[(i // len(TEMPLATES) + seed) % len(NAMES)]))
    return out


def populate(store: TrajectoryStore) -> tuple[str, str]:
    for seed in range(20):
        tid = store.create_trajectory(notebook_path=f"old/{seed}.ipynb", kernel_id=f"old-{seed}")
        for src in trajectory_sources(50, seed):
            store.add_execution(tid, {"source": src, "status": "ok"})
    kernel_id = "bench-kernel"
    tid = store.create_trajectory(notebook_path="analysis.ipynb", kernel_id=kernel_id)
    last = 0
    for i, src in enumerate(trajectory_sources(300, 3)):
        last = store.add_execution(
            tid,
            {
                "source": src,
                "status": "ok",
                "execution_count": i + 1,
                "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": f"result {i}\n" * 20}
                ],
            },
        )
    store.write_snapshot(
        last,
        [
            {
                "name": n,
                "type": "pandas.DataFrame",
                "summary": {"shape": [1000, 4], "columns": ["region", "month", "price", "total"]},
            }
            for n in NAMES
        ]
        + [{"name": f"k{i}", "type": "int", "summary": {"repr": str(i)}} for i in range(30)],
    )
    return kernel_id, tid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    tmp: Path, store_path: Path, port: int, default_backend: str = "retrieval"
) -> subprocess.Popen:
    config = tmp / "config"
    config.mkdir()
    (config / "jupyter_server_config.json").write_text(
        json.dumps(
            {
                "ServerApp": {"jpserver_extensions": {"jupyter_themisto": True}},
                "ThemistoExtensionApp": {
                    "auto_record": False,
                    "default_backend": default_backend,
                },
            }
        )
    )
    env = dict(os.environ, THEMISTO_STORE=str(store_path), JUPYTER_CONFIG_DIR=str(config))
    root = tmp / "root"
    root.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "jupyter_server",
        f"--port={port}",
        "--ip=127.0.0.1",
        "--ServerApp.token=bench",
        "--no-browser",
        "--allow-root",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.log_level=WARN",
    ]
    # A file, not a pipe: a pipe nobody reads would block the server once it fills up.
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed with the temporary folder
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)


async def wait_until_up(client: httpx.AsyncClient, base: str, log: Path) -> httpx.Response:
    """GET /themisto/backends until the server answers it (30 s at most); its response."""
    for _ in range(300):
        try:
            r = await client.get(f"{base}/themisto/backends")
            if r.status_code == 200:
                return r
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"server did not start: {log.read_text(errors='replace')[-2000:]}")


def suggestions(sse: str) -> list[str]:
    texts: dict[int, str] = {}
    names = []
    for block in sse.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        names.append(lines["event"])
        if lines["event"] == "chunk":
            d = json.loads(lines["data"])
            texts[d["index"]] = texts.get(d["index"], "") + d["text"]
    if names[0] != "meta" or names[-1] != "done" or "error" in names:
        raise RuntimeError(f"unexpected event sequence {names}")
    return [texts[i] for i in sorted(texts)]


async def main(n_requests: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        store_path = tmp / "trajectories.sqlite"
        store = TrajectoryStore(store_path)
        kernel_id, tid = populate(store)
        port = free_port()
        proc = start_server(tmp, store_path, port)
        base = f"http://127.0.0.1:{port}"
        headers = {"Authorization": "token bench"}
        body = {"kernel_id": kernel_id, "n": 3}
        try:
            async with httpx.AsyncClient(timeout=60, headers=headers) as client:
                await wait_until_up(client, base, tmp / "server.log")
                url = f"{base}/themisto/predict/next-cell"
                first = await client.post(url, json=body)  # builds the index
                expected = suggestions(first.text)
                for _ in range(20):  # warm-up
                    await client.post(url, json=body)

                # In-process: what the server does for a request, minus HTTP.
                manager = ThemistoManager(store)
                backend = RetrievalPredictor({}, BackendEnv(store=store))
                req = NextCellRequest.model_validate(body)
                ctx = manager.context(req, manager.resolve(req))

                async def direct() -> list[str]:
                    c = manager.context(req, manager.resolve(req))
                    return [x.text async for x in backend.predict_next_cell(c, n=3)]

                assert await direct() == expected
                # Interleaved, so that the load of a shared machine weighs on all alike.
                server_ms, direct_ms, backend_ms, floor_ms = [], [], [], []
                for _ in range(n_requests):
                    t0 = time.perf_counter()
                    r = await client.post(url, json=body)
                    got = suggestions(r.text)
                    server_ms.append((time.perf_counter() - t0) * 1000)
                    assert got == expected, (got, expected)
                    t0 = time.perf_counter()
                    await direct()
                    direct_ms.append((time.perf_counter() - t0) * 1000)
                    t0 = time.perf_counter()
                    [x async for x in backend.predict_next_cell(ctx, n=3)]
                    backend_ms.append((time.perf_counter() - t0) * 1000)
                    # The floor: the cheapest authenticated request jupyter_server answers.
                    t0 = time.perf_counter()
                    await client.get(f"{base}/api/status")
                    floor_ms.append((time.perf_counter() - t0) * 1000)

                # The first request after a new execution: the retrieval index is out of date.
                rebuild_ms = []
                for i in range(20):
                    store.add_execution(tid, {"source": f"print({i})", "status": "ok"})
                    t0 = time.perf_counter()
                    r = await client.post(url, json=body)
                    suggestions(r.text)
                    rebuild_ms.append((time.perf_counter() - t0) * 1000)
                await client.post(url, json=body)
                await asyncio.sleep(1.0)  # let the background re-index finish
                expected = suggestions((await client.post(url, json=body)).text)

                t0 = time.perf_counter()
                answers = await asyncio.gather(
                    *[client.post(url, json=body) for _ in range(concurrency)]
                )
                wall = (time.perf_counter() - t0) * 1000
                ok = sum(
                    1 for a in answers if a.status_code == 200 and suggestions(a.text) == expected
                )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            store.close()

    p50, p95 = statistics.median(server_ms), percentile(server_ms, 0.95)
    d50 = statistics.median(direct_ms)
    print(f"trajectory: 300 executions (+ 20 x 50 of history); suggestions: {expected[:3]}")
    print(
        f"through the server ({n_requests} sequential): p50 {p50:.1f} ms, p95 {p95:.1f} ms,"
        f" max {max(server_ms):.1f} ms   (target p50 <= 30, p95 <= 60)"
    )
    print(
        f"in-process (context + backend): p50 {d50:.1f} ms; backend alone:"
        f" p50 {statistics.median(backend_ms):.1f} ms"
    )
    print(f"server overhead (p50 difference): {p50 - d50:.1f} ms   (target <= 5)")
    print(
        f"floor: GET /api/status through the same client p50 {statistics.median(floor_ms):.1f} ms"
        " (jupyter_server + HTTP, no themisto code)"
    )
    print(
        f"first request after a new execution (~1300 indexed cells; answered from the previous"
        f" index while it is rebuilt in the background):"
        f" p50 {statistics.median(rebuild_ms):.1f} ms"
    )
    print(
        f"{concurrency} concurrent requests: {ok}/{concurrency} answered correctly,"
        f" all done in {wall:.0f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency))
