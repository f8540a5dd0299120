"""The 0.5B model's file as shipped (mostly Q5_0) against its Q8_0 rewrite (the one loaded): prompt
evaluation and generation speed, and the first token after a cached prefix; prints the ratios.

Each file is run in a process of its own (an engine's idle threads would slow the next one),
the files alternated, `--runs` times each; each run evaluates a 421-token prompt (this
project's own source, nothing cached) and generates 32 tokens greedily, `--reps` times, then
asks for the same prompt plus ~55 tokens (the prefix cached) and times the first chunk. The
shipped file is joined from the installed slices into a temporary folder. `--file NAME=PATH`
(repeatable) runs other files beside them, e.g. a requantization made with llama.cpp's
`llama-quantize`; each is compared with the rewrite.

    .venv/bin/python benchmarks/model_file_speed.py [--runs 3] [--reps 4] [--threads 2]
        [--file q4_0=/tmp/q05-Q4_0.gguf]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from jupyter_themisto.backends import model_files  # noqa: E402

TEXT = (HERE.parent / "jupyter_themisto" / "backends" / "prompts.py").read_text()


def first_chunk_ms(server: object, body: dict) -> float:
    """Milliseconds until the streamed answer's first text."""
    start, seen = time.perf_counter(), []

    def on_chunk(chunk: dict) -> bool:
        if not seen and (chunk.get("choices") or [{}])[0].get("text"):
            seen.append(time.perf_counter() - start)
        return False

    server.handle_completions(body, on_chunk)  # type: ignore[attr-defined]
    return seen[0] * 1000 if seen else float("nan")


def one_run(path: str, reps: int, threads: int) -> dict[str, float]:
    """In this process: median prompt tokens/s, generation tokens/s, first chunk (ms)."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = path
    params.n_ctx, params.n_parallel = 2048, 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    params.n_batch = params.n_ubatch = 128  # the backend's default
    server = xllamacpp.Server(params)
    prompt_speed, gen_speed, first = [], [], []
    for rep in range(reps):
        prefix = f"# {rep}\n" + TEXT[:1800]
        body = {"prompt": prefix, "max_tokens": 32, "temperature": 0, "cache_prompt": True}
        timings = server.handle_completions(body)["timings"]
        prompt_speed.append(timings["prompt_per_second"])
        gen_speed.append(timings["predicted_per_second"])
        body = dict(body, prompt=prefix + TEXT[1800:2000], max_tokens=8, stream=True)
        first.append(first_chunk_ms(server, body))
    return {
        "prompt": statistics.median(prompt_speed),
        "generation": statistics.median(gen_speed),
        "first_chunk_ms": statistics.median(first),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another GGUF file to run beside them (repeatable)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one file, one run
    args = parser.parse_args()
    extra: dict[str, Path] = {}
    for item in args.file:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).expanduser().is_file():
            parser.error(f"--file wants NAME=PATH of an existing file, not {item!r}")
        extra[name] = Path(path).expanduser()
    if args.one:
        print(json.dumps(one_run(args.one, args.reps, args.threads)))
        return 0
    spec = model_files.QWEN_CODER_05B
    rewritten = model_files.ensure_model(spec)
    with tempfile.TemporaryDirectory() as tmp:
        shipped = model_files.assemble(dataclasses.replace(spec, rewrite=None), Path(tmp))
        files = {"shipped (Q5_0)": shipped, "rewritten (Q8_0)": rewritten, **extra}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in files}
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
        for run in range(args.runs):
            for name, path in files.items():
                out = subprocess.run(
                    [sys.executable, __file__, "--one", str(path), "--reps", str(args.reps)]
                    + ["--threads", str(args.threads)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = results[name][-1]
                print(
                    f"run {run + 1} {name:17s} prompt {r['prompt']:6.1f} tokens/s, generation"
                    f" {r['generation']:5.1f} tokens/s, first chunk {r['first_chunk_ms']:5.0f} ms",
                    flush=True,
                )
    print(f"medians over {args.runs} runs (load average {os.getloadavg()[0]:.2f} at the end):")
    med = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in results.items()
    }
    a, b = med["shipped (Q5_0)"], med["rewritten (Q8_0)"]
    for key, unit in (("prompt", "tokens/s"), ("generation", "tokens/s"), ("first_chunk_ms", "ms")):
        print(
            f"  {key:15s} shipped {a[key]:7.1f} {unit}, rewritten {b[key]:7.1f} {unit}:"
            f" ratio {b[key] / a[key]:.2f}"
        )
        for name in extra:
            c = med[name][key]
            print(f"  {'':15s} {name} {c:7.1f} {unit}: ratio to the rewrite {c / b[key]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
