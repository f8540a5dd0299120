"""Next-cell prompt ablations: one local model, one fixed seeded subset, one row per variant.

Each variant is a set of backend settings (the `prompt_*` settings of
jupyter_themisto.backends.prompts.PromptOptions, or any other, e.g. `max_tokens`) and whether
the runtime summary is given. Every variant runs the same instances — a seeded sample spread
over the dump's notebooks, evaluated notebook by notebook in order so the model's prompt cache
is reused — through the real backend (greedy, one suggestion), and is scored as `evaluate`
scores (chrF, EM, ROUGE-L, API recall). The `repeat-previous` baseline runs on the same
instances. Answers go to --out (one JSONL per variant), so a rerun only computes what is new.

    .venv/bin/python benchmarks/prompt_ablation.py DUMP --model qwen.gguf [--n 200]
        [--setting trajectory|live] [--variant NAME:key=value,key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from model_quality import load  # (benchmarks/, beside this script)

from jupyter_themisto import metrics as M
from jupyter_themisto.backends import NoPrediction, create_backend
from jupyter_themisto.dump import DumpContexts, read_manifest, read_table
from jupyter_themisto.metrics import paired_difference

#: name -> (settings, with_runtime); the first is the reference the others change one thing of
_PLAIN = {
    "prompt_runtime": "none",
    "prompt_outputs": "none",
    "prompt_window_step": 10,
    "max_tokens": 64,
}
#: what README's table shows (the markdown and FIM variants need --setting live)
DEFAULT_VARIANTS = {
    "plain": (_PLAIN, False),
    "out-last": ({**_PLAIN, "prompt_outputs": "last"}, True),
    "out-error": ({**_PLAIN, "prompt_outputs": "error"}, True),
    "vars-header": ({**_PLAIN, "prompt_runtime": "header"}, True),
    "rt-both": ({**_PLAIN, "prompt_runtime": "header", "prompt_outputs": "last"}, True),
    "vars-end": ({**_PLAIN, "prompt_runtime": "end"}, True),
    "chatml": ({**_PLAIN, "prompt_template": "chatml"}, False),
    "md": ({**_PLAIN, "prompt_markdown": True}, False),
    "md-fim1": ({**_PLAIN, "prompt_below": True, "prompt_below_cells": 1}, False),
}


def parse_variant(text: str) -> tuple[str, dict[str, Any], bool]:
    """NAME:key=value,key=value[,runtime=false]"""
    name, _, rest = text.partition(":")
    settings: dict[str, Any] = {}
    with_runtime = True
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        if key == "runtime":
            with_runtime = bool(parsed)
        else:
            settings[key] = parsed
    return name, settings, with_runtime


def sample(
    instances: list[dict[str, Any]], n: int, seed: int, per_notebook: int
) -> list[dict[str, Any]]:
    """About `n` instances: notebooks drawn in a `seed`ed order, from each a stretch of at most
    `per_notebook` consecutive instances (from a seeded start), in notebook order. Consecutive
    cells share their prompt's beginning, so the model's prompt cache serves them."""
    rng = random.Random(seed)
    by_notebook: dict[str, list[dict[str, Any]]] = {}
    for i in sorted(instances, key=lambda i: (i["trajectory_id"], i["order_index"])):
        by_notebook.setdefault(i["trajectory_id"], []).append(i)
    order = sorted(by_notebook)
    rng.shuffle(order)
    chosen: list[dict[str, Any]] = []
    for tid in order:
        if len(chosen) >= n:
            break
        rows = by_notebook[tid]
        start = rng.randrange(max(1, len(rows) - per_notebook + 1))
        chosen += rows[start : start + min(per_notebook, n - len(chosen))]
    return chosen


async def run_variant(
    backend_name: str,
    settings: dict[str, Any],
    with_runtime: bool,
    instances: list[dict[str, Any]],
    contexts: DumpContexts,
    out: Path,
) -> list[dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done[row["id"]] = row
    backend = create_backend(backend_name, settings)
    rows = []
    with open(out, "a", encoding="utf-8") as f:
        for k, inst in enumerate(instances):
            if inst["id"] in done:
                rows.append(done[inst["id"]])
                continue
            ctx = contexts.build(inst, with_runtime)
            started = time.perf_counter()
            timed_out = getattr(backend, "timed_out", 0)
            text = ""
            try:
                async for chunk in backend.predict_next_cell(ctx, n=1):
                    if chunk.index == 0:
                        text = ("" if chunk.replace else text) + chunk.text
            except NoPrediction:
                pass
            row = {
                "id": inst["id"],
                "prediction": text,
                "reference": inst["target"],
                "latency": round(time.perf_counter() - started, 3),
                "scores": M.score(text, inst["target"], "next-cell"),
            }
            if getattr(backend, "timed_out", 0) > timed_out:
                row["timed_out"] = True  # an answer ended by suggestion_timeout
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
            print(f"\r  {out.stem}: {k + 1}/{len(instances)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    await backend.aclose()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    m = M.mean_scores(r["scores"] for r in rows)
    latencies = sorted(r["latency"] for r in rows)
    return {
        "chrF": 100 * (m.get("chrf") or 0.0),
        "EM": 100 * (m.get("exact_match") or 0.0),
        "ROUGE-L": 100 * (m.get("rouge_l") or 0.0),
        "API R": 100 * (m.get("api_recall") or 0.0),
        "median s": latencies[len(latencies) // 2] if latencies else 0.0,
        "timed out %": 100 * sum(1 for r in rows if r.get("timed_out")) / max(1, len(rows)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dump", type=Path)
    p.add_argument(
        "--model", default=None, help="a GGUF file (default: the llamacpp backend's own model)"
    )
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-notebook", type=int, default=20, help="consecutive instances each")
    p.add_argument("--setting", choices=("trajectory", "live"), default="trajectory")
    p.add_argument("--out", type=Path, default=Path("ablation"))
    p.add_argument("--n-ctx", type=int, default=None, help="default: the backend's")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="model threads (default: the usable cores; on a loaded machine 1 can be faster)",
    )
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,...")
    args = p.parse_args()
    manifest = read_manifest(args.dump)
    executions = read_table(args.dump, manifest, "executions")
    notebook_cells = (
        read_table(args.dump, manifest, "notebook_cells") if args.setting == "live" else None
    )
    contexts = DumpContexts(executions, 3000, notebook_cells)
    instances = sample(
        read_table(args.dump, manifest, "next_cell"), args.n, args.seed, args.per_notebook
    )
    variants = (
        {name: (s, r) for name, s, r in map(parse_variant, args.variant)}
        if args.variant
        else DEFAULT_VARIANTS
    )
    args.out.mkdir(parents=True, exist_ok=True)
    n_notebooks = len({i["trajectory_id"] for i in instances})
    print(f"{len(instances)} instances from {n_notebooks} notebooks, setting {args.setting}")
    print(f"start: {load()}")
    table = []
    base = asyncio.run(
        run_variant(
            "repeat-previous", {}, False, instances, contexts, args.out / "repeat-previous.jsonl"
        )
    )
    table.append(("repeat-previous", summary(base)))
    all_rows = {"repeat-previous": base}
    for name, (settings, with_runtime) in variants.items():
        settings = dict(settings)
        if args.model:
            settings["model_path"] = args.model
        if args.n_ctx:
            settings["n_ctx"] = args.n_ctx
        if args.threads:
            settings["n_threads"] = args.threads
        rows = asyncio.run(
            run_variant(
                "llamacpp",
                settings,
                with_runtime,
                instances,
                contexts,
                args.out / f"{args.setting}-{name}.jsonl",
            )
        )
        table.append((name, summary(rows)))
        all_rows[name] = rows
    print(f"end: {load()}")
    # Each variant against the first one (the reference), on the same instances.
    ref_name = next(iter(variants))
    ref = [100 * r["scores"]["chrf"] for r in all_rows[ref_name]]
    keys = list(table[0][1])
    print("| variant | " + " | ".join(keys) + f" | Δ chrF vs {ref_name} [95 % paired bootstrap] |")
    print("|---|" + "---|" * (len(keys) + 1))
    for name, s in table:
        chrf = [100 * r["scores"]["chrf"] for r in all_rows[name]]
        delta = "—"
        if name != ref_name:
            d = paired_difference(ref, chrf)
            delta = (
                f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"
                f" ({d['better']} better, {d['worse']} worse)"
            )
        print(f"| {name} | " + " | ".join(f"{s[k]:.1f}" for k in keys) + f" | {delta} |")


if __name__ == "__main__":
    main()
