"""`jupyter themisto evaluate DUMP --backend NAME --task next-cell|output`: score a backend.

Runs the backend over the dump's task instances (the context of each is built from the dump's
execution rows with jupyter_themisto.context.build_context, with or without the runtime
summary; with --setting live also from the notebook's cells, as the browser sends them: the
markdown above the target cell and the cells below it) and scores every prediction
(jupyter_themisto.metrics). In --out DIR (default DUMP/evaluation) it writes, per run (task ×
backend × with/without runtime × setting):
`<task>__<backend>__<runtime>[__live][__warm[__aheadS]].jsonl`, one line per example, appended
and flushed as each one finishes, so an interrupted run resumes where it stopped (examples
already scored are skipped; failed ones are retried). After each
run it rewrites, from all the runs in DIR, `summary.json`, `results.md` (a Markdown table)
and `results.png` (each metric per run, with and without runtime side by side); a DIR that
holds files of those names and no run is refused, since they would be replaced. Runs of one
task and setting are also compared example by example (`compare_runs`): with runtime
information against without, each backend against the baselines, and a `--warm` run against
the same run unwarmed (an `--ahead` run against the same run only warmed), with a bootstrap
interval that says whether a difference is one; the comparisons with the run just made are
printed.

`--warm` (next cell) times each suggestion as the plugin's flow has it: the backend evaluates
the prompt ahead (`warm`, what the plugin asks for while the cell is typed and while it runs),
untimed, and the suggestion is asked for after that, within the backend's own time limit.
`--ahead S` adds the rest of that flow for a local model with `answer_ahead`: the warm-up also
writes the suggestion, and it is asked for S seconds later (the pause in the typing and the
cell's run, in the browser), following what was written by then, within its own time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

from .. import metrics as M
from ..backends import (
    BackendEnv,
    BackendError,
    BackendUnavailable,
    NoPrediction,
    UnknownBackend,
    create_backend,
)
from ..console import CliError, progress
from ..dump import TASK_TABLES, DumpContexts, read_manifest, read_table, train_store
from ..files import atomic_file, write_json
from ..store.processes import GONE, process_identity, process_state

TASKS = ("next-cell", "output")
_HISTORY_PREFIX = "themisto-train-"
SETTINGS = ("trajectory", "live")
_METRIC_LABELS = {
    "exact_match": "EM",
    "rouge_l": "ROUGE-L",
    "chrf": "chrF",
    "bleu": "BLEU",
    "api_precision": "API P",
    "api_recall": "API R",
}


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "evaluate",
        help="run a backend over a dump's task instances and score it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dump", metavar="DUMP", help="a folder written by `jupyter themisto export`")
    p.add_argument("--backend", required=True, help="backend name (an installed entry point)")
    p.add_argument("--task", required=True, help="next-cell or output")
    runtime = p.add_mutually_exclusive_group()
    runtime.add_argument(
        "--with-runtime",
        dest="with_runtime",
        action="store_true",
        default=True,
        help="give the backend the runtime summary (default)",
    )
    runtime.add_argument(
        "--without-runtime",
        dest="with_runtime",
        action="store_false",
        help="cells and outputs only, no variables",
    )
    p.add_argument(
        "--setting",
        choices=SETTINGS,
        default="trajectory",
        help="trajectory (default): the executions before the target only; live: also the "
        "notebook's cells as the browser sends them (markdown above, cells below; needs a dump "
        "with notebook_cells)",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N instances only")
    p.add_argument(
        "--warm",
        action="store_true",
        help="next cell: let the backend evaluate each prompt ahead, untimed, before the "
        "suggestion is asked for (the plugin warms it while the cell is typed and while it runs)",
    )
    p.add_argument(
        "--ahead",
        type=float,
        default=None,
        metavar="S",
        help="next cell, implies --warm: the warm-up also writes each suggestion ahead (a local"
        " model's answer_ahead) and it is asked for S seconds later, as the plugin asks once the"
        " cell typed has run (S: the pause before the run and the run)",
    )
    p.add_argument(
        "--min-context",
        type=int,
        default=0,
        metavar="N",
        help="only instances with at least N prior executions (Themisto used 5)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="predictions in flight at once (overlaps an HTTP backend's requests)",
    )
    p.add_argument("--out", metavar="DIR", default=None, help="default: DUMP/evaluation")
    add_option_flag(p, "-o base_url=http://127.0.0.1:8000/v1 -o model=qwen")
    p.add_argument(
        "--train",
        metavar="DUMP",
        default=None,
        help="a dump whose trajectories the backend may learn from (its history store: used by "
        "retrieval and ret-train); trajectories of the evaluated dump are never lent",
    )
    p.add_argument(
        "--leave-one-out",
        action="store_true",
        help="the evaluated dump is the history too: for each instance, the backend may learn "
        "from every other notebook of the dump, never its own (a new backend per notebook)",
    )
    p.add_argument(
        "--token-budget", type=int, default=3000, help="context budget in tokens (default 3000)"
    )
    p.set_defaults(func=cmd_evaluate)


# -- history without the evaluated notebook ---------------------------------------------------


class HeldOutStore:
    """A read-only view of a history store without one trajectory: what a backend that learns
    from history may see while that trajectory's instances are evaluated."""

    def __init__(self, store: Any, held_out: str) -> None:
        self._store = store
        self.held_out = held_out

    def list_trajectories(self, **kw: Any) -> list[dict[str, Any]]:
        return [t for t in self._store.list_trajectories(**kw) if t["id"] != self.held_out]

    def list_executions(self, trajectory_id: str, **kw: Any) -> list[dict[str, Any]]:
        return (
            []
            if trajectory_id == self.held_out
            else self._store.list_executions(trajectory_id, **kw)
        )

    def count_executions(self, trajectory_id: str | None = None) -> int:
        if trajectory_id == self.held_out:
            return 0
        n = self._store.count_executions(trajectory_id)
        return n - self._store.count_executions(self.held_out) if trajectory_id is None else n

    def get_trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        return None if trajectory_id == self.held_out else self._store.get_trajectory(trajectory_id)

    def latest_variables(self, trajectory_id: str) -> list[dict[str, Any]]:
        return [] if trajectory_id == self.held_out else self._store.latest_variables(trajectory_id)


# -- running ----------------------------------------------------------------------------------


def add_option_flag(p: argparse.ArgumentParser, example: str) -> None:
    """`-o KEY=VALUE`, repeatable: backend settings, read with `parse_options`."""
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend setting (repeatable; VALUE parsed as JSON when it is JSON), e.g. "
        + example,
    )


def parse_options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"a backend option must look like KEY=VALUE, not {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def run_name(
    task: str,
    backend: str,
    with_runtime: bool,
    setting: str = "trajectory",
    warm: bool = False,
    ahead: float | None = None,
) -> str:
    name = f"{task}__{backend}__{'with' if with_runtime else 'without'}-runtime"
    name = name if setting == "trajectory" else f"{name}__{setting}"
    name = f"{name}__warm" if warm or ahead is not None else name
    return name if ahead is None else f"{name}__ahead{ahead:g}"


def asked(run: dict[str, Any]) -> str:
    """How a run's suggestions were asked for, as its labels say it ("" when at once)."""
    ahead = run.get("ahead")
    if ahead is not None:
        return f", warmed, written ahead {ahead:g} s"
    return ", warmed" if run.get("warm") else ""


@contextlib.contextmanager
def _history_dir() -> Iterator[Path]:
    """A temporary folder for the history store (a copy of the dump's executions), removed at
    the end, on Ctrl-C and SIGTERM too; the ones left by runs killed outright (SIGKILL, the
    OOM killer) are removed first, when the process named in their `owner` file is gone
    (only real folders of this user: never what a link points to)."""
    for old in Path(tempfile.gettempdir()).glob(f"{_HISTORY_PREFIX}*"):
        try:
            found = old.lstat()
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
                continue
            owner = (old / "owner").read_text()
        except OSError:
            continue  # not readable, or still being made
        if process_state(owner) == GONE:
            shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=_HISTORY_PREFIX) as tmp:
        identity = process_identity("evaluate")
        if identity is not None:
            (Path(tmp) / "owner").write_text(identity)
        yield Path(tmp)


def _open_results(path: Path) -> dict[str, dict[str, Any]]:
    """Examples already in a run's JSONL (by id); a line cut by a kill is dropped."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        # The process was killed mid-line: cut back to the last complete line.
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    for line in data.decode("utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        done[row["id"]] = row
    return done


async def _predict(backend: Any, task: str, ctx: Any) -> str:
    parts: list[str] = []
    if task == "next-cell":
        async for chunk in backend.predict_next_cell(ctx, n=1):
            if chunk.index == 0:
                if chunk.replace:
                    parts.clear()  # (the suggestion so far gave way to this chunk's)
                parts.append(chunk.text)
    else:
        async for chunk in backend.predict_output(ctx):
            parts.append(chunk.text)
    return "".join(parts)


async def run_examples(
    batches: list[tuple[Callable[[], Any], list[dict[str, Any]]]],
    task: str,
    contexts: DumpContexts,
    with_runtime: bool,
    out_file: Path,
    concurrency: int,
    meta: dict[str, Any],
) -> int:
    """Predict and score the instances of each batch with its own backend (made when the batch
    starts, closed when it ends), appending one JSON line per example; returns errors."""
    errors = 0
    bar = progress(sum(len(rows) for _, rows in batches), meta["backend"], unit="ex")
    with open(out_file, "a", encoding="utf-8") as f:
        try:
            for make_backend, instances in batches:
                backend = make_backend()
                sem = asyncio.Semaphore(max(1, concurrency))

                async def one(inst: dict[str, Any], backend: Any = backend, sem: Any = sem) -> None:
                    nonlocal errors
                    async with sem:
                        ctx = contexts.build(inst, with_runtime)
                        if meta.get("warm") and callable(getattr(backend, "warm", None)):
                            # (untimed: done before it is asked)
                            if meta.get("ahead") is None:
                                await backend.warm(ctx)
                            else:
                                await backend.warm(ctx, ahead=True)
                                await asyncio.sleep(meta["ahead"])
                        started = time.perf_counter()
                        timed_out = getattr(backend, "timed_out", 0)
                        row: dict[str, Any] = {
                            "id": inst["id"],
                            **meta,
                            "trajectory_id": inst["trajectory_id"],
                            "order_index": inst["order_index"],
                            "reference": inst["target"],
                        }
                        try:
                            row["prediction"] = await _predict(backend, task, ctx)
                        except NoPrediction as e:
                            row["prediction"] = ""
                            row["no_prediction"] = str(e)
                        except BackendError as e:
                            row["prediction"] = ""
                            row["error"] = f"{type(e).__name__}: {e}"
                            errors += 1
                        row["latency"] = round(time.perf_counter() - started, 4)
                        if getattr(backend, "timed_out", 0) > timed_out:
                            # An answer ended by the backend's time limit (exact with
                            # --concurrency 1).
                            row["timed_out"] = True
                        if "error" not in row:
                            row["scores"] = M.score(row["prediction"], inst["target"], task)
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
                        f.flush()
                        bar.update(1)

                try:
                    await asyncio.gather(*(one(i) for i in instances))
                finally:
                    await backend.aclose()
        finally:
            bar.close()
    return errors


# -- reporting --------------------------------------------------------------------------------


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One run's counts and mean metrics, from its rows (one per example, the latest)."""
    if not rows:
        return None
    scored = [r for r in rows if "scores" in r]
    first = rows[0]
    out: dict[str, Any] = {
        "task": first.get("task"),
        "backend": first.get("backend"),
        "with_runtime": first.get("with_runtime"),
        "setting": first.get("setting", "trajectory"),
        "warm": bool(first.get("warm")),
        "ahead": first.get("ahead"),
        "dump": first.get("dump"),
        "n": len(rows),
        "n_scored": len(scored),
        "n_no_prediction": sum(1 for r in scored if "no_prediction" in r),
        "n_errors": len(rows) - len(scored),
        "n_timed_out": sum(1 for r in rows if r.get("timed_out")),
        "mean_latency": (sum(r.get("latency", 0.0) for r in scored) / len(scored))
        if scored
        else None,
        "metrics": M.mean_scores(r["scores"] for r in scored),
    }
    out["metrics"].update(
        M.corpus_scores([r["prediction"] for r in scored], [r["reference"] for r in scored])
    )
    return out


#: the files `write_reports` rewrites from all the runs of its folder
REPORTS = ("summary.json", "results.md", "results.png")


def check_results_dir(out_dir: Path) -> None:
    """Raise CliError when `out_dir` holds report files (`REPORTS`) and no run: files of the
    same names that no evaluation wrote, which the reports would replace; or when it is a file."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"{out_dir} exists and is not a folder (--out names the results folder)")
    if not out_dir.is_dir() or any(out_dir.glob("*__*__*.jsonl")):
        return
    mine = [name for name in REPORTS if (out_dir / name).exists()]
    if mine:
        raise CliError(
            f"{out_dir} holds {', '.join(mine)} and no evaluation run: the results would"
            " replace them; name another folder (--out)"
        )


def write_reports(out_dir: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    scores: dict[str, dict[str, dict[str, float]]] = {}
    for path in sorted(out_dir.glob("*__*__*.jsonl")):
        rows = _open_results(path)
        s = summarize_run(list(rows.values()))
        if s:
            runs[path.stem] = s
            scores[path.stem] = {k: r["scores"] for k, r in rows.items() if "scores" in r}
    comparisons = compare_runs(runs, scores)
    summary = {"generated_at": time.time(), "runs": runs, "comparisons": comparisons}
    summary_json, results_md, results_png = (out_dir / name for name in REPORTS)
    write_json(summary_json, summary)
    with atomic_file(results_md) as f:
        f.write(markdown_table(runs))
        if comparisons:
            f.write("\n" + comparison_table(comparisons))
    plot(runs, results_png)
    return summary


#: backends that stand for "no model": every other run is compared with each of them
BASELINES = ("repeat-previous", "ret-context", "ret-train")


def compare_runs(
    runs: dict[str, Any], scores: dict[str, dict[str, dict[str, float]]]
) -> list[dict[str, Any]]:
    """Paired comparisons of the runs of one task and setting, on the examples both scored:
    each backend with runtime information against the same backend without it, and each
    backend's run against each baseline's run (`BASELINES`). chrF and exact match, B − A."""
    pairs: list[tuple[str, str, str]] = []
    for b, rb in runs.items():
        for a, ra in runs.items():
            if a == b or (ra["task"], ra["setting"]) != (rb["task"], rb["setting"]):
                continue
            warm_a, warm_b = ra.get("warm", False), rb.get("warm", False)
            ahead_a, ahead_b = ra.get("ahead"), rb.get("ahead")
            if ra["backend"] == rb["backend"] and ra["with_runtime"] == rb["with_runtime"]:
                if warm_b and not warm_a:
                    pairs.append(("warm", a, b))
                elif warm_a and ahead_a is None and ahead_b is not None:
                    pairs.append(("ahead", a, b))
            elif ra["backend"] == rb["backend"] and rb["with_runtime"] and not ra["with_runtime"]:
                # (asked alike; baselines ignore how they are asked)
                if rb["backend"] not in BASELINES and (warm_a, ahead_a) == (warm_b, ahead_b):
                    pairs.append(("runtime", a, b))
            elif ra["backend"] in BASELINES and rb["backend"] not in BASELINES:
                # The baseline's run with the same runtime flag and --warm when there is one
                # (baselines ignore both); otherwise each of its runs.
                twin = run_name(
                    ra["task"], ra["backend"], rb["with_runtime"], ra["setting"], warm_b
                )
                if a == twin or twin not in runs:
                    pairs.append(("baseline", a, b))
    out = []
    for kind, a, b in pairs:
        ids = [i for i in scores[b] if i in scores[a]]
        if not ids:
            continue
        row: dict[str, Any] = {"kind": kind, "a": a, "b": b}
        row["a_label"], row["b_label"] = _label(runs[a]), _label(runs[b])
        row["task"], row["setting"] = runs[b]["task"], runs[b]["setting"]
        for metric in ("chrf", "exact_match"):
            row[metric] = M.paired_difference(
                [scores[a][i][metric] for i in ids], [scores[b][i][metric] for i in ids]
            )
        out.append(row)
    return out


def _label(run: dict[str, Any]) -> str:
    runtime = (
        ""
        if run["backend"] in BASELINES
        else (" with runtime" if run["with_runtime"] else " without runtime")
    )
    return f"{run['backend']}{runtime}{asked(run)}"


def comparison_table(comparisons: list[dict[str, Any]]) -> str:
    """The paired comparisons as Markdown: what each difference is, and whether it is one."""
    lines = [
        "Paired: B − A on the examples both runs scored; the interval is the 95 % bootstrap"
        " interval of the mean (2,000 resamples): one that holds 0 does not tell the runs apart.",
        "",
        "| task | setting | B | A | n | chrF B − A | 95 % interval | B better / worse | EM B − A |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        ch, em = c["chrf"], c["exact_match"]
        lines.append(
            f"| {c['task']} | {c['setting']} | {c['b_label']} | {c['a_label']} | {ch['n']}"
            f" | {ch['mean']:+.3f} | [{ch['low']:+.3f}, {ch['high']:+.3f}]"
            f" | {ch['better']} / {ch['worse']} | {em['mean']:+.3f} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.3f}"


def markdown_table(runs: dict[str, Any]) -> str:
    keys = list(_METRIC_LABELS)
    head = "| task | backend | runtime | setting | n | errors | " + " | ".join(
        _METRIC_LABELS[k] for k in keys
    )
    lines = [head + " |", "|" + "---|" * (6 + len(keys))]
    for s in runs.values():
        m = s["metrics"]
        cells = [
            s["task"],
            s["backend"],
            "with" if s["with_runtime"] else "without",
            s.get("setting", "trajectory") + asked(s),
            str(s["n"]),
            str(s["n_errors"]),
        ] + [_fmt(m.get(k)) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, Any], path: Path) -> None:
    """One panel per task: every metric, a bar per backend and runtime setting side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({s["task"] for s in runs.values()})
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(6.5 * max(1, len(tasks)), 4))
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    for ax, task in zip(axes, tasks, strict=False):
        mine = sorted(
            (s for s in runs.values() if s["task"] == task),
            key=lambda s: (s["backend"], s.get("setting", ""), not s["with_runtime"]),
        )
        keys = [k for k in _METRIC_LABELS if any(s["metrics"].get(k) is not None for s in mine)]
        width = 0.8 / max(1, len(mine))
        for j, s in enumerate(mine):
            xs = [i + (j - (len(mine) - 1) / 2) * width for i in range(len(keys))]
            ys = [s["metrics"].get(k) or 0.0 for k in keys]
            label = f"{s['backend']} ({'with' if s['with_runtime'] else 'without'} runtime"
            label += ", live" if s.get("setting") == "live" else ""
            label += asked(s) + ")"
            ax.bar(xs, ys, width, label=label, hatch="" if s["with_runtime"] else "//")
        ax.set_xticks(range(len(keys)), [_METRIC_LABELS[k] for k in keys])
        ax.set_ylim(0, 1)
        ax.set_title(task)
        ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.task not in TASKS:
        raise CliError(f"unknown task {args.task!r}: expected next-cell or output")
    if args.concurrency < 1:
        raise CliError("--concurrency must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be at least 1 (got {args.limit})")
    if (args.warm or args.ahead is not None) and args.task != "next-cell":
        raise CliError("--warm is for next-cell suggestions (output predictions are not warmed)")
    if args.ahead is not None and not 0 <= args.ahead < math.inf:
        raise CliError(f"--ahead must be 0 seconds or more (got {args.ahead:g})")
    warm = args.warm or args.ahead is not None
    dump = Path(args.dump).expanduser()
    manifest = read_manifest(dump)
    options = parse_options(args.option)
    executions = read_table(dump, manifest, "executions")
    instances = read_table(dump, manifest, TASK_TABLES[args.task])
    if not executions or not instances:
        raise CliError(f"the dump {dump} has no {args.task} instances to evaluate")
    instances = [i for i in instances if i["n_context"] >= args.min_context]
    notebook_cells = None
    if args.setting == "live":
        if "notebook_cells" not in manifest["files"]:
            raise CliError(
                f"the dump {dump} has no notebook_cells table (export it again with this "
                "version) for --setting live"
            )
        notebook_cells = read_table(dump, manifest, "notebook_cells")
    # Each notebook's instances in the order they ran (a model's prompt cache serves them).
    instances.sort(key=lambda i: (i["trajectory_id"], i["order_index"]))
    if args.limit is not None:
        instances = instances[: args.limit]
    if args.leave_one_out and args.train:
        raise CliError("--leave-one-out uses the evaluated dump as history: no --train with it")
    out_dir = Path(args.out).expanduser() if args.out else dump / "evaluation"
    check_results_dir(out_dir)
    with _history_dir() as tmp:
        store = None
        if args.train:
            exclude = {r["trajectory_id"] for r in executions}
            store = train_store(Path(args.train).expanduser(), exclude, tmp)
        elif args.leave_one_out:
            store = train_store(dump, set(), tmp)

        def make_backend(held_out: str | None = None) -> Any:
            history = store if held_out is None else HeldOutStore(store, held_out)
            try:
                # A HeldOutStore answers what backends read of a history store.
                env = BackendEnv(store=cast(Any, history))
                return create_backend(args.backend, options, env)
            except (UnknownBackend, BackendUnavailable) as e:
                raise CliError(str(e)) from e
            except (ValueError, TypeError) as e:
                raise CliError(f"cannot configure backend {args.backend!r}: {e}") from e

        backend = make_backend()
        if args.task not in getattr(backend, "tasks", TASKS):
            raise CliError(f"backend {args.backend!r} does not predict {args.task}")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"cannot make the results folder {out_dir}: {e.strerror}") from None
        name = run_name(args.task, args.backend, args.with_runtime, args.setting, warm, args.ahead)
        out_file = out_dir / f"{name}.jsonl"
        done = {k for k, r in _open_results(out_file).items() if "error" not in r}
        todo = [i for i in instances if i["id"] not in done]
        if len(todo) < len(instances):
            print(f"resuming {name}: {len(instances) - len(todo)} of {len(instances)} done")
        contexts = DumpContexts(executions, args.token_budget, notebook_cells)
        meta = {
            "task": args.task,
            "backend": args.backend,
            "with_runtime": args.with_runtime,
            "setting": args.setting,
            "dump": str(dump),
            **({"warm": True} if warm else {}),
            **({"ahead": args.ahead} if args.ahead is not None else {}),
        }
        batches: list[tuple[Callable[[], Any], list[dict[str, Any]]]] = []
        if args.leave_one_out:
            groups: dict[str, list[dict[str, Any]]] = {}
            for inst in todo:
                groups.setdefault(inst["trajectory_id"], []).append(inst)
            batches = [(partial(make_backend, tid), rows) for tid, rows in groups.items()]
            asyncio.run(backend.aclose())  # it only told which tasks the backend predicts
        else:
            batches = [(lambda: backend, todo)]
        errors = asyncio.run(
            run_examples(
                batches, args.task, contexts, args.with_runtime, out_file, args.concurrency, meta
            )
        )
    summary = write_reports(out_dir)
    s = summary["runs"].get(name, {})
    m = s.get("metrics", {})
    print(
        f"{name}: n={s.get('n')} "
        + " ".join(f"{_METRIC_LABELS[k]}={_fmt(m.get(k))}" for k in _METRIC_LABELS if k in m)
    )
    for c in summary["comparisons"]:
        if name in (c["a"], c["b"]):
            ch = c["chrf"]
            print(
                f"  {c['b_label']} − {c['a_label']}: chrF {ch['mean']:+.3f}"
                f" [{ch['low']:+.3f}, {ch['high']:+.3f}] on {ch['n']} paired examples"
                f" ({ch['better']} better, {ch['worse']} worse)"
            )
    print(f"results in {out_dir}")
    if errors:
        print(f"{errors} examples failed (rerun to retry them)", flush=True)
        return 1
    return 0
