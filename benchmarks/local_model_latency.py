"""Local model latency: the embedded code model through the llamacpp backend; prints figures.

Targets (issue 11), on 2 cores: first chunk <= 300 ms when the notebook's prompt prefix is
cached, <= 1.5 s cold; no suggestion over 5 s.

1. Through LlamaCppPredictor, no server (the default model, Qwen2.5-Coder-0.5B-Instruct), on
   real notebooks written by others (`--corpus N`, default 6: benchmark corpus notebooks from
   N repositories, `corpus.spread`; `--own` takes the four small synthetic notebooks of
   benchmarks/notebooks instead, a quick check whose figures count for nothing), their code
   cells replayed as sessions: after each cell, the next-cell suggestion for the cells so
   far, as the plugin asks for it.
   - *session*: the prefix up to the new cell is cached (the previous request's prompt);
   - *warmed*: the backend evaluated the prompt when the execution was recorded (`warm`);
   - *cold*: nothing of the prompt is cached (a first line unique to the request);
   first chunk and whole suggestion (n=1, greedy), and how many answers reached the limit;
   how many requests got an answer per case, and the first chunk of those alone (a request
   whose answer was dropped counts its whole time as its first chunk: a quick "nothing"
   would otherwise look fast).
   Also: load time and generation speed. The cases run with the defaults (each prompt cut to
   its budget anew); `--compare` runs them again with `stable_prompt_start` (`--cold-tokens
   N`: and again with `cold_prompt_tokens` N too), `--reuse N` with `cache_reuse_tokens` N,
   in one process on one loaded model, with the ratios to the defaults; `--long N` adds N
   long corpus notebooks (over the prompt budget), whose prompts the cut moves with every
   cell. Cold requests never reuse runs of tokens (a notebook new to the engine has none).
   The variants share the engine and its cache: a long notebook's later prompts are the same
   text in each, so a variant may find the one before it evaluated them; compare
   `cache_reuse_tokens` on long notebooks with `benchmarks/cache_reuse.py` (a process each).
2. Through a real `jupyter server` with the extension and no backend configured (the default
   is the local model): the RSS of the server and of its engine process, the first request
   against the later ones over HTTP.

    .venv/bin/python benchmarks/local_model_latency.py [--corpus N | --own] [--cells 12] \
        [-o model=qwen2.5-coder-1.5b] [--no-server]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from next_cell_latency import free_port, start_server, wait_until_up  # noqa: E402
from percentiles import percentile  # noqa: E402

from jupyter_themisto.backends import NoPrediction  # noqa: E402
from jupyter_themisto.backends._local import Completion  # noqa: E402
from jupyter_themisto.backends.base import BackendEnv  # noqa: E402
from jupyter_themisto.backends.llamacpp import LlamaCppPredictor  # noqa: E402
from jupyter_themisto.cli.evaluate import add_option_flag, parse_options  # noqa: E402
from jupyter_themisto.context import ContextCell, PredictionContext  # noqa: E402
from jupyter_themisto.store import TrajectoryStore  # noqa: E402

NOTEBOOKS = sorted((HERE / "notebooks").glob("*.ipynb"))


def notebook_cells(path: Path, n: int) -> list[str]:
    import corpus

    return corpus.code_cells(path)[:n]


def context(sources: list[str], first_line: str | None = None) -> PredictionContext:
    """Cells run in order, as the server's context has them (order_index places the prompt's
    window); `first_line` comes first (within the window while there are at most 18 cells)."""
    cells = [
        ContextCell(source=s, execution_count=i + 1, order_index=i + 1)
        for i, s in enumerate(sources)
    ]
    if first_line:
        cells.insert(0, ContextCell(source=first_line, execution_count=0, order_index=0))
    return PredictionContext(cells=cells, with_runtime=False)


MISSES: list[str] = []


def notebook_name(path: Path) -> str:
    """'owner/name:path' for a corpus notebook, the file name for the synthetic ones."""
    import corpus

    try:
        return corpus.notebook_key(path)
    except ValueError:
        return path.name


def long_notebooks(n: int, cells: int) -> list[Path]:
    """The first `n` corpus notebooks (manifest order) whose first `cells` code cells are over
    the default prompt budget (about 3,000 characters)."""
    import corpus

    found = []
    for path in corpus.notebooks():
        sources = notebook_cells(path, cells)
        if len(sources) >= cells and sum(len(s) + 7 for s in sources) > 4500:
            found.append(path)
        if len(found) >= n:
            break
    return found


#: When the engine's first text of the current request came (None: not yet), and the
#: seconds from the request to it, per request: the first chunk minus this is the time a
#: suggestion was held back (it could still turn out to be only comments, or the previous cell).
ENGINE_FIRST: list[float | None] = [None]
ENGINE_WAITS: list[float] = []


def watch_engine(backend: LlamaCppPredictor) -> None:
    """Note in ENGINE_FIRST when `backend`'s engine first answers a request with text."""
    complete = backend._complete

    async def noted(*args: Any, **kwargs: Any) -> Any:
        async for piece in complete(*args, **kwargs):
            if ENGINE_FIRST[0] is None and piece:
                ENGINE_FIRST[0] = time.perf_counter()
            yield piece

    backend._complete = noted  # type: ignore[method-assign]


async def timed(backend: LlamaCppPredictor, ctx: PredictionContext) -> tuple[float, float, str]:
    """First chunk and whole answer in seconds, and its text; no answer (the time limit) counts
    as its whole time for both, and is listed in MISSES. The engine's first text (with
    `watch_engine`) goes to ENGINE_WAITS."""
    ENGINE_FIRST[0] = None
    start = time.perf_counter()
    first = None
    text = ""
    try:
        async for chunk in backend.predict_next_cell(ctx, n=1):
            if first is None and chunk.text:
                first = time.perf_counter() - start
            text += chunk.text
    except NoPrediction as e:
        MISSES.append(str(e))
    total = time.perf_counter() - start
    if ENGINE_FIRST[0] is not None:
        ENGINE_WAITS.append(ENGINE_FIRST[0] - start)
    # A cold answer warms the whole prompt after it: done before the next request, as a
    # person reads a suggestion before running the next cell.
    await backend.idle()
    return (first if first is not None else total), total, text


def ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"median {statistics.median(values) * 1000:5.0f} ms,"
        f" p90 {percentile(values, 0.9) * 1000:5.0f} ms,"
        f" max {max(values) * 1000:5.0f} ms"
    )


async def in_process(
    notebooks: list[Path],
    n_cells: int,
    long: list[Path],
    compare: bool,
    cold_tokens: int,
    reuse: int,
    settings: dict[str, Any],
) -> None:
    # before: the defaults (each prompt cut to its budget anew); stable: stable_prompt_start;
    # cold: cold_prompt_tokens too; reuse: cache_reuse_tokens
    variants = [("before", LlamaCppPredictor(dict(settings)))]
    if compare:
        variants.append(("stable", LlamaCppPredictor({**settings, "stable_prompt_start": True})))
        if cold_tokens:
            cold = {**settings, "stable_prompt_start": True, "cold_prompt_tokens": cold_tokens}
            variants.append(("cold", LlamaCppPredictor(cold)))
    if reuse:
        variants.append(("reuse", LlamaCppPredictor({**settings, "cache_reuse_tokens": reuse})))
    backend = variants[0][1]
    start = time.perf_counter()
    model = await asyncio.to_thread(backend.shared)
    slots = backend.settings.parallel
    print(f"model: {backend.model_path().name}; {backend.n_threads} threads, {slots} slots")
    print(f"load: {(time.perf_counter() - start) * 1000:.0f} ms (once per process)")
    results = {}
    for label, variant in variants:
        variant.env = BackendEnv(log=logging.getLogger("bench"))
        s = variant.settings
        print(
            f"-- {label}: {s.stable_prompt_start=} {s.cold_prompt_tokens=} {s.cache_reuse_tokens=}"
        )
        results[label] = await cases(variant, notebooks, n_cells, long)
    for label in [v for v, _ in variants[1:]]:
        print(f"-- {label} / before (same process, same model, same cases)")
        for case in results[label]:
            a, b = results["before"][case], results[label][case]
            if a and b:
                med = statistics.median(b) / statistics.median(a)
                ratio = percentile(b, 0.9) / percentile(a, 0.9)
                print(f"{case:28s} median x{med:.2f}, p90 x{ratio:.2f}")
    await generation_speed(backend, model, notebooks[0])


async def cases(
    backend: LlamaCppPredictor, notebooks: list[Path], n_cells: int, long: list[Path]
) -> dict[str, list[float]]:
    limit = backend.settings.suggestion_timeout
    # Cold requests reuse nothing: their prompts differ from the session's only in the first
    # line, which cache_reuse_tokens would skip (a notebook seen for the first time has no
    # runs of tokens in the engine to reuse).
    settings = backend.settings.model_dump(exclude_unset=True)
    cold_backend = LlamaCppPredictor({**settings, "cache_reuse_tokens": 0}, backend.env)
    watch_engine(backend)
    watch_engine(cold_backend)
    session_first, session_total, warm_first, cold_first, cold_total = [], [], [], [], []
    session_engine, cold_engine = [], []
    # Whether each request got an answer (a suggestion shown, not dropped): a request that
    # ends with none counts its whole time as its first chunk, and a quick "nothing" would
    # look fast.
    session_got: list[bool] = []
    cold_got: list[bool] = []
    warm_got: list[bool] = []
    for path in notebooks:
        cells = notebook_cells(path, n_cells)
        # (a first line of this run's own: no earlier run's prompt is in the engine's cache)
        run = f"# {uuid.uuid4()}"
        await timed(backend, context(cells[:2], run))
        for k in range(3, len(cells) + 1):
            # The person ran cell k: the prompt up to it is the previous one plus that cell.
            before = len(ENGINE_WAITS)
            first, total, said = await timed(backend, context(cells[:k], run))
            session_got.append(bool(said.strip()))
            session_first.append(first)
            session_total.append(total)
            session_engine += ENGINE_WAITS[before:]
            # Cold: a first line no earlier prompt had.
            before = len(ENGINE_WAITS)
            first, total, said = await timed(cold_backend, context(cells[:k], f"# {uuid.uuid4()}"))
            cold_got.append(bool(said.strip()))
            cold_first.append(first)
            cold_total.append(total)
            cold_engine += ENGINE_WAITS[before:]
        # Again, each prompt evaluated ahead (as when the execution is recorded), then asked.
        mark = f"# {uuid.uuid4()}"
        for k in range(3, len(cells) + 1):
            await backend.warm(context(cells[:k], mark))
            first, _, said = await timed(backend, context(cells[:k], mark))
            warm_got.append(bool(said.strip()))
            warm_first.append(first)
    _, _, example = await timed(backend, context(notebook_cells(notebooks[0], 6)))
    print(f"example suggestion after 6 cells of {notebook_name(notebooks[0])}: {example!r}")
    n = len(session_first)
    print(f"{n} suggestions per case over {len(notebooks)} notebooks (up to {n_cells} cells each)")
    print(f"first chunk, prefix cached (one new cell): {ms(session_first)}  (target <= 300 ms)")
    print(f"first chunk, prompt warmed ahead:          {ms(warm_first)}")
    print(f"first chunk, cold (nothing cached):        {ms(cold_first)}  (target <= 1500 ms)")
    print(f"  the engine's first text, prefix cached:  {ms(session_engine)}")
    print(f"  the engine's first text, cold:           {ms(cold_engine)}")
    print(f"whole suggestion, prefix cached:           {ms(session_total)}")
    print(f"whole suggestion, cold:                    {ms(cold_total)}")

    def answered(firsts: list[float], got: list[bool]) -> str:
        shown = [f for f, g in zip(firsts, got, strict=True) if g]
        return f"{sum(got)} of {len(got)}, first chunk {ms(shown)}"

    print(f"answered, prefix cached: {answered(session_first, session_got)}")
    print(f"answered, warmed ahead:  {answered(warm_first, warm_got)}")
    print(f"answered, cold:          {answered(cold_first, cold_got)}")
    everything = session_total + cold_total
    long_first: list[float] = []
    for path in long:
        # A long notebook run cell by cell, each prompt's prefix cached by the one before:
        # over the budget, the prompt's beginning has to move now and then.
        cells = notebook_cells(path, 40)
        mark = f"# {uuid.uuid4()}"
        await timed(backend, context(cells[:9], mark))
        for k in range(10, len(cells) + 1):
            first, total, _ = await timed(backend, context(cells[:k], mark))
            long_first.append(first)
            everything.append(total)
    if long:
        print(
            f"first chunk, long notebooks ({len(long)}, cells 10-40, prefix cached):"
            f" {ms(long_first)}"
        )
    over = sum(1 for t in everything if t > limit + 0.05)
    print(
        f"suggestions over {limit:g} s: {over} of {len(everything)} (max {max(everything):.2f} s)"
    )
    return {
        "first chunk, prefix cached": session_first,
        "first chunk, warmed": warm_first,
        "first chunk, cold": cold_first,
        "whole suggestion, cached": session_total,
        "first chunk, long notebooks": long_first,
    }


async def generation_speed(backend: LlamaCppPredictor, model: Any, notebook: Path) -> None:
    cells = notebook_cells(notebook, 12)
    prompt = "".join(f"# %%\n{s}\n\n" for s in cells) + "# %%\nfor i in range(100):\n"
    body = backend.request(Completion(prompt, [], 64, time_limit=30), stream=False)
    body["ignore_eos"] = True
    runs = []
    for _ in range(3):
        with model.lock:
            answer = await asyncio.to_thread(model.model.handle_completions, body)
        runs.append(answer["timings"]["predicted_per_second"])
    print(f"generation: {statistics.median(runs):.0f} tokens/s (64 tokens, prompt cached)")


async def through_server(notebook: Path, repeat: int) -> None:
    cells = notebook_cells(notebook, 12)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        store_path = tmp / "trajectories.sqlite"
        store = TrajectoryStore(store_path)
        tid = store.create_trajectory(notebook_path="bench.ipynb", kernel_id="bench")
        for i, source in enumerate(cells[:6]):
            store.add_execution(tid, {"source": source, "status": "ok", "execution_count": i + 1})
        port = free_port()
        proc = start_server(tmp, store_path, port, default_backend="")
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(
                timeout=120, headers={"Authorization": "token bench"}
            ) as client:
                r = await wait_until_up(client, base, tmp / "server.log")
                print(f"server default backend: {r.json()['default']}")
                server = psutil.Process(proc.pid)
                url = f"{base}/themisto/predict/next-cell"
                firsts, totals, empty = [], [], 0
                for i in range(6, min(len(cells), 6 + repeat)):
                    start = time.perf_counter()
                    first = None
                    async with client.stream("POST", url, json={"trajectory_id": tid, "n": 1}) as r:
                        async for line in r.aiter_lines():
                            if first is None and line == "event: chunk":
                                first = time.perf_counter() - start
                    totals.append(time.perf_counter() - start)
                    firsts.append(first if first is not None else totals[-1])
                    empty += first is None
                    store.add_execution(tid, {"source": cells[i], "status": "ok"})
                rss = server.memory_info().rss
                engine_rss = sum(c.memory_info().rss for c in server.children(recursive=True))
                health = (await client.get(f"{base}/themisto/backends")).json()
                detail = next(b for b in health["backends"] if b["name"] == "llamacpp")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            store.close()
    print(f"first request after start (model preloaded at start): {firsts[0] * 1000:.0f} ms")
    print(f"requests answered without a suggestion (time limit): {empty} of {len(firsts)}")
    print(f"next {len(firsts) - 1} requests over HTTP, first chunk: {ms(firsts[1:])}")
    print(f"next {len(firsts) - 1} requests over HTTP, whole answer: {ms(totals[1:])}")
    print(
        f"server RSS with the model loaded: {rss / 2**20:.0f} MB,"
        f" its engine's {engine_rss / 2**20:.0f} MB"
    )
    print(f"health: {detail['health']['detail']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--corpus", type=int, default=6, metavar="N", help="N corpus notebooks (default 6)"
    )
    p.add_argument("--own", action="store_true", help="the synthetic notebooks instead")
    p.add_argument("--cells", type=int, default=12, help="code cells per notebook (default 12)")
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--compare", action="store_true", help="also the backend as it was before")
    p.add_argument("--long", type=int, default=0, metavar="N", help="N long corpus notebooks")
    p.add_argument("--no-server", action="store_true", help="skip the jupyter server part")
    p.add_argument(
        "--cold-tokens", type=int, default=0, metavar="N", help="also with cold_prompt_tokens N"
    )
    p.add_argument(
        "--reuse", type=int, default=0, metavar="N", help="also with cache_reuse_tokens N"
    )
    add_option_flag(p, "-o model=qwen2.5-coder-1.5b (the in-process cases)")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print("== through the backend (no server)")
    long = long_notebooks(args.long, 40) if args.long else []
    if args.own:
        notebooks = NOTEBOOKS
    else:
        import corpus

        notebooks = corpus.spread(args.corpus, min_cells=args.cells)
    print("notebooks:", ", ".join(notebook_name(p) for p in notebooks))
    asyncio.run(
        in_process(
            notebooks,
            args.cells,
            long,
            args.compare,
            args.cold_tokens,
            args.reuse,
            parse_options(args.option),
        )
    )
    if args.no_server:
        return
    print("== through a jupyter server")
    asyncio.run(through_server(notebooks[0], args.repeat))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
