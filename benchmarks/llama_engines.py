"""Two ways to run llama.cpp in process on the same GGUF model, side by side; prints figures.

- `xllamacpp` (prebuilt CPU wheels on the package index; what the `[llm]` extra installs):
  llama.cpp's own server engine, called in process;
- `llama-cpp-python` (compiled from source where it has no wheel: ~7-13 min on 2 cores;
  the `[bench]` extra installs it).

Each engine runs in its own child process, one after the other, on the same prompts (next-cell
prompts built from a benchmark notebook, as the llamacpp backend builds them):
load time; time to first token with a cold prompt (nothing cached); with the prompt's prefix
cached and one new cell appended (as when a person ran one more cell); with the whole prompt
cached; and generation speed over 64 tokens. Greedy; same threads for both; both engines'
OpenMP threads sleep while they wait (OMP_WAIT_POLICY=passive, as the llamacpp backend sets
it: spinning threads made generation ~10 times slower on busy cores), unless
`--omp-wait-policy active`.

    .venv/bin/python benchmarks/llama_engines.py [--model PATH] [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "notebooks" / "sales_analysis.ipynb"


def prompts() -> tuple[str, str]:
    """A next-cell prompt of the notebook's first cells, and the same with one more cell."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and c.source.strip()]

    def prompt(sources: list[str]) -> str:
        return "".join(f"# %%\n{s.rstrip()}\n\n" for s in sources) + "# %%\n"

    return prompt(cells[:11]), prompt(cells[:12])


def run_xllamacpp(model: str, threads: int, repeat: int) -> dict[str, object]:
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = model
    params.n_ctx = 4096
    params.n_parallel = 1
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.verbosity = -1
    params.warmup = True
    start = time.perf_counter()
    server = xlc.Server(params)
    load = time.perf_counter() - start

    def complete(prompt: str, max_tokens: int, cache: bool = True, ban_eos: bool = False):
        first: list[float] = []
        n = 0
        t0 = time.perf_counter()

        def on_chunk(chunk: dict) -> bool:
            nonlocal n
            if chunk["choices"][0].get("text"):
                n += 1
                if not first:
                    first.append(time.perf_counter() - t0)
            return False

        request = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "cache_prompt": cache,
        }
        if ban_eos:
            request["ignore_eos"] = True
        server.handle_completions(request, on_chunk)
        return (first[0] if first else float("nan")), time.perf_counter() - t0, n

    return measure(complete, load, repeat)


def run_llama_cpp_python(model: str, threads: int, repeat: int) -> dict[str, object]:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(
        model_path=model, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    load = time.perf_counter() - start

    def complete(prompt: str, max_tokens: int, cache: bool = True, ban_eos: bool = False):
        if not cache:
            llm.reset()
        t0 = time.perf_counter()
        first: list[float] = []
        n = 0
        kwargs = {"logit_bias": {llm.token_eos(): -1e9}} if ban_eos else {}
        for chunk in llm.create_completion(
            prompt, max_tokens=max_tokens, temperature=0.0, stream=True, **kwargs
        ):
            if chunk["choices"][0].get("text"):
                n += 1
                if not first:
                    first.append(time.perf_counter() - t0)
        return (first[0] if first else float("nan")), time.perf_counter() - t0, n

    return measure(complete, load, repeat)


def measure(complete, load: float, repeat: int) -> dict[str, object]:
    before, after = prompts()
    cold, new_cell, cached, speed = [], [], [], []
    for _ in range(repeat):
        cold.append(complete(after, 1, cache=False)[0])
        complete(before, 1)  # the prefix is now cached
        new_cell.append(complete(after, 1)[0])
        cached.append(complete(after, 1)[0])
        first, total, n = complete(after, 64, ban_eos=True)
        speed.append((n - 1) / (total - first))
    return {
        "load_s": load,
        "ttft_cold_ms": statistics.median(cold) * 1000,
        "ttft_new_cell_ms": statistics.median(new_cell) * 1000,
        "ttft_cached_ms": statistics.median(cached) * 1000,
        "tokens_per_s": statistics.median(speed),
    }


def child(engine: str, model: str, threads: int, repeat: int) -> None:
    run = {"xllamacpp": run_xllamacpp, "llama-cpp-python": run_llama_cpp_python}[engine]
    print(json.dumps(run(model, threads, repeat)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: the embedded code model)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default="xllamacpp,llama-cpp-python")
    p.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active"])
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    model = args.model
    if model is None:
        from jupyter_themisto.backends.model_files import ensure_model

        model = str(ensure_model())
    if args.child:
        child(args.child, model, args.threads, args.repeat)
        return
    before, after = prompts()
    print(f"model: {model}")
    print(f"prompt: {len(after)} characters; the new cell adds {len(after) - len(before)}")
    print(f"threads: {args.threads}, repeat: {args.repeat}, greedy, OpenMP {args.omp_wait_policy}")
    print(f"load average: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    env = dict(os.environ, OMP_WAIT_POLICY=args.omp_wait_policy)
    for engine in args.engines.split(","):
        done = subprocess.run(
            [sys.executable, __file__, "--child", engine, "--model", model]
            + ["--threads", str(args.threads), "--repeat", str(args.repeat)],
            capture_output=True,
            text=True,
            env=env,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{engine:17s} not measured: {tail}")
            continue
        r = json.loads(lines[-1])
        print(
            f"{engine:17s} load {r['load_s']:5.2f} s | first token: cold {r['ttft_cold_ms']:6.0f}"
            f" ms, one new cell {r['ttft_new_cell_ms']:5.0f} ms, cached {r['ttft_cached_ms']:5.0f}"
            f" ms | {r['tokens_per_s']:5.1f} tokens/s"
        )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
