"""Ghost-text latency in a real browser: from a new empty cell becoming active to its ghost text.

For each backend (`--backends`, default: retrieval, then llamacpp with the embedded code
model), starts a `jupyter lab` with the extension and that default backend, opens a new
notebook in Debian's chromium through Playwright, and runs cells one by one with Shift+Enter.
After each run past the first, the new empty cell becomes active and its ghost text appears; an
in-page MutationObserver timestamps both. The figure includes waiting for the cell just run to
be answered and recorded (the request names the execution it follows; the server answers once
that is recorded). Target: <= 300 ms.

The cells are those of real notebooks written by others (`--corpus N`, default 4: the first
`--cells` code cells of N benchmark corpus notebooks from N repositories, `corpus.spread`; each
new notebook sits in its folder of a copy of its repository, so the cells read their data
files). The store starts empty, as a new user's does, unless `--store PATH` names a recorded
corpus store (`corpus.py record`): its trajectories of the other corpus notebooks are the
history. `--synthetic` runs short made-up cells instead (`x1 = 1 * 2`, …; a quick check
whose figures count for nothing) with one earlier trajectory of the same cells with other
names and numbers (`--history same`: the very same cells, which the history's continuation
answers at once, without the model). With a model backend, a ghost text may first be the early
answer (the retrieval backend's cell, sent when the model's first text is slower than
`early_answer_ms`), then the model's suggestion: the script prints when the first ghost text
appeared, when the text that stayed began, and where the time went (medians): the cell run
answered, the next-cell request sent after it, that request's first bytes, the ghost text on
screen.

Each cell is inserted at once and run at once, unless `--pause S` gives the seconds a person
pauses between writing a cell and running it: the plugin then reads the typed cell ahead
(`warmWhileTyping`, at 1 s of no typing), as it does for a person. `--pause 0,4` measures both,
one lab after the other, for each backend.

    .venv/bin/python benchmarks/ghost_text_latency.py [--corpus 4 | --synthetic] [--cells 12]
        [--store PATH] [--backends retrieval,llamacpp] [--history other|same]
        [--early-answer-ms MS] [--pause 0[,S...]]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from percentiles import percentile  # noqa: E402
from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402

from jupyter_themisto.cli.evaluate import add_option_flag, parse_options  # noqa: E402
from jupyter_themisto.store import TrajectoryStore  # noqa: E402
from tests.ui.lab import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    GHOST_TIMING_JS,
    JupyterLab,
    check_installed_build,
)


@dataclass
class Session:
    """Cells to run, one by one, in a new notebook in `folder` (relative to the lab's root)."""

    name: str
    folder: str
    cells: list[str]
    path: str = ""  # the notebook's resolved path, for a corpus notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus", type=int, default=4, metavar="N", help="N corpus notebooks (default 4)"
    )
    parser.add_argument("--synthetic", action="store_true", help="made-up cells instead")
    parser.add_argument("--cells", type=int, default=12, help="cells to run (default 12)")
    parser.add_argument("--store", type=Path, help="a recorded corpus store: the history")
    parser.add_argument("--backends", default="retrieval,llamacpp")
    parser.add_argument("--history", choices=("other", "same"), default="other")
    parser.add_argument(
        "--early-answer-ms", type=float, default=None, help="the server's early_answer_ms"
    )
    parser.add_argument(
        "--pause",
        default="0",
        help="seconds between writing a cell and running it, comma-separated: each is measured"
        " (default 0)",
    )
    add_option_flag(parser, "-o prompt_outputs=last")
    args = parser.parse_args()
    pauses = [float(p) for p in args.pause.split(",")]
    settings = parse_options(args.option)
    check_installed_build(ROOT)
    repos: list[Path] = []
    if args.synthetic:
        cells = session(args.cells, "x", 2, "+")
        earlier = cells if args.history == "same" else session(args.cells, "y", 3, "-")
        sessions = [Session("synthetic", "", cells)]

        def history(store: TrajectoryStore) -> None:
            tid = store.create_trajectory(notebook_path="earlier.ipynb")
            for source in earlier:
                store.add_execution(tid, {"source": source, "status": "ok", "outputs": []})

    else:
        sessions, repos = corpus_sessions(args.corpus, args.cells)
        measured = {s.path for s in sessions}

        def history(store: TrajectoryStore) -> None:
            if args.store is not None:
                copied = copy_history(args.store, store, measured)
                print(f"history: {copied} executions of other corpus notebooks")

    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print("notebooks:", ", ".join(s.name for s in sessions))
    for backend in args.backends.split(","):
        for pause in pauses:
            measure(backend, sessions, history, repos, args.early_answer_ms, settings, pause)


def corpus_sessions(n: int, cells: int) -> tuple[list[Session], list[Path]]:
    """The first `cells` code cells of `n` benchmark corpus notebooks from `n` repositories
    (`corpus.spread`), each to run in its folder; and those repositories' copies."""
    import corpus

    dest = corpus.default_dest()
    sessions, repos = [], []
    for path in corpus.spread(n, min_cells=cells):
        key = corpus.notebook_key(path)
        repos.append(corpus.repo_dir(dest, corpus.repo_of(key)))
        folder = path.parent.resolve().relative_to(dest.resolve())
        sessions.append(
            Session(key, str(folder), corpus.code_cells(path)[:cells], str(path.resolve()))
        )
    return sessions, repos


def copy_history(source: Path, store: TrajectoryStore, leave_out: set[str]) -> int:
    """Copy the trajectories of a recorded store (sources, statuses, outputs) into `store`,
    but those of the notebooks in `leave_out` (resolved paths); returns the executions."""
    src = TrajectoryStore(source, readonly=True)  # (a missing file: a clear StoreError)
    copied = 0
    try:
        for t in src.list_trajectories():
            path = t.get("notebook_path") or ""
            if str(Path(path).resolve()) in leave_out:
                continue
            tid = store.create_trajectory(notebook_path=path)
            for e in src.list_executions(t["id"]):
                record = {"source": e["source"], "status": e["status"], "outputs": e["outputs"]}
                store.add_execution(tid, record)
                copied += 1
    finally:
        src.close()
    return copied


def session(n: int, name: str, factor: int, op: str) -> list[str]:
    cells = [
        f"{name}{i} = {i} * {factor}" if i % 2 else f"print({name}{i - 1} {op} {i})"
        for i in range(1, n)
    ]
    return ["import math", *cells]


#: Every distinct ghost text of the active cell, with its time (performance.now()).
GHOST_TEXTS_JS = """() => {
  const seen = (window.__themistoGhostTexts = []);
  new MutationObserver(() => {
    const ghost = document.querySelector('.jp-Cell.jp-mod-active .jp-GhostText');
    const text = ghost ? ghost.textContent : '';
    if (text && (!seen.length || seen[seen.length - 1][1] !== text)) {
      seen.push([performance.now(), text]);
    }
  }).observe(document.body, { subtree: true, childList: true, characterData: true });
}"""


#: When the cell run answers (its prompt shows its execution count), and when each next-cell
#: request (not a warm-up) is sent and its answer's first bytes come (fetch resolves).
PHASES_JS = """() => {
  const log = (window.__themistoPhases = []);
  if (!window.__themistoFetchTimed) {
    window.__themistoFetchTimed = true;
    const fetch = window.fetch;
    window.fetch = async function (input, init) {
      const url = typeof input === 'string' ? input : input.url;
      const body = init && typeof init.body === 'string' ? init.body : '';
      const asked = url.includes('/themisto/predict/next-cell') && !body.includes('"warm":true');
      if (asked) window.__themistoPhases.push(['sent', performance.now()]);
      const response = await fetch.apply(this, arguments);
      if (asked) window.__themistoPhases.push(['answered', performance.now()]);
      return response;
    };
  }
  const cells = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell');
  const prompt = cells[cells.length - 1].querySelector('.jp-InputPrompt');
  new MutationObserver((_, observer) => {
    if (/\\[\\d+\\]/.test(prompt.textContent)) {
      log.push(['ran', performance.now()]);
      observer.disconnect();
    }
  }).observe(prompt, { subtree: true, childList: true, characterData: true });
}"""


def phases(log: list[list], active: float, ghost: float) -> dict[str, float] | None:
    """The steps from the new cell to its ghost text (ms): the run answered, the request sent
    after it, its first bytes, the ghost text on screen."""
    ran = next((t for name, t in log if name == "ran"), None)
    if ran is None:
        return None
    sent = next((t for name, t in log if name == "sent" and t >= ran), None)
    answered = next((t for name, t in log if name == "answered" and sent and t >= sent), None)
    if sent is None or answered is None:
        return None
    return {
        "cell ran": ran - active,
        "request sent": sent - ran,
        "first bytes": answered - sent,
        "ghost text shown": ghost - answered,
    }


def stayed_since(texts: list[list]) -> float:
    """When the ghost text that stayed (the last) began: the first of the run of texts that
    each begin the last one (a replaced early answer does not)."""
    last = texts[-1][1]
    since = texts[-1][0]
    for t, text in reversed(texts):
        if not last.startswith(text):
            break
        since = t
    return since


def measure(
    backend: str,
    sessions: list[Session],
    history: Callable[[TrajectoryStore], None],
    repos: list[Path],
    early_answer_ms: float | None,
    settings: dict[str, Any],
    pause: float,
) -> None:
    extra = []
    if early_answer_ms is not None:
        extra.append(f"--ThemistoExtensionApp.early_answer_ms={early_answer_ms}")
    latencies: list[float] = []
    stayed: list[float] = []  # when the ghost text that stayed began
    replaced = 0  # new cells whose first ghost text (an early answer) was replaced
    shown: list[tuple[str, str]] = []  # (cell run, ghost text that stayed)
    steps: list[dict[str, float] | None] = []  # where each new cell's time went
    misses = 0
    with browser_lab(backend, settings, repos, history, extra) as (lab, store, page):
        for n, run in enumerate(sessions):
            name = f"{run.folder}/bench-{n}.ipynb" if run.folder else f"bench-{n}.ipynb"
            open_new_notebook(page, lab, store, name, f"bench{n}")
            for i, source in enumerate(run.cells):
                active = page.locator(".jp-Cell.jp-mod-active")
                active.locator(".cm-content").click()
                page.keyboard.press("Escape")  # dismiss ghost text before typing
                active.locator(".cm-content").click()
                # (inserted as a paste is: typed, the editor would indent each line)
                page.keyboard.insert_text(source)
                if pause:
                    page.wait_for_timeout(pause * 1000)
                if i > 0:
                    page.evaluate(GHOST_TIMING_JS)
                    page.evaluate(PHASES_JS)
                    page.evaluate(GHOST_TEXTS_JS)
                page.keyboard.press("Shift+Enter")
                prompt = page.locator(".jp-Cell").nth(i).locator(".jp-InputPrompt")
                expect(prompt).to_have_text(re.compile(r"\[\d+\]"), timeout=180_000)
                if i == 0:
                    continue
                try:
                    page.wait_for_function(
                        "() => window.__themistoTiming && window.__themistoTiming.ghostAt",
                        timeout=5000,
                    )
                except Exception:
                    misses += 1
                    continue
                t = page.evaluate("() => window.__themistoTiming")
                latencies.append(t["ghostAt"] - t["activeAt"])
                log = page.evaluate("() => window.__themistoPhases")
                steps.append(phases(log, t["activeAt"], t["ghostAt"]))
                page.wait_for_timeout(6000)  # the whole suggestion (5 s at most)
                ghost = page.locator(".jp-Cell.jp-mod-active .jp-GhostText")
                shown.append((source, ghost.first.inner_text() if ghost.count() else ""))
                seen = page.evaluate("() => window.__themistoGhostTexts")
                if seen:
                    stayed.append(stayed_since(seen) - t["activeAt"])
                    replaced += stayed[-1] > seen[0][0] - t["activeAt"]
    label = f"{backend}, {pause:g} s pause before each run" if pause else backend
    print(f"[{label}] ghost text over {len(latencies)} new cells ({misses} without ghost text):")
    if latencies:
        print(
            f"  median {statistics.median(latencies):.0f} ms,"
            f" p90 {percentile(latencies, 0.9):.0f} ms, "
            f"min {min(latencies):.0f} ms, max {max(latencies):.0f} ms (target <= 300 ms)"
        )
    if stayed:
        print(
            f"  the text that stayed began: median {statistics.median(stayed):.0f} ms, p90"
            f" {percentile(stayed, 0.9):.0f} ms; an early answer shown first and replaced in"
            f" {replaced} of"
            f" {len(stayed)}"
        )
    timed = [each for each in steps if each is not None]
    if timed:
        spent = ", ".join(
            f"{name} {statistics.median(each[name] for each in timed):.0f} ms" for name in timed[0]
        )
        print(f"  where the time went, medians over {len(timed)} cells: {spent}")
    for source, text in shown[:3]:
        print(f"  after {source!r}: {text!r}")


@contextmanager
def browser_lab(
    backend: str,
    settings: dict[str, Any],
    repos: list[Path],
    history: Callable[[TrajectoryStore], None] | None = None,
    extra_argv: list[str] | None = None,
) -> Iterator[tuple[JupyterLab, TrajectoryStore, Page]]:
    """A `jupyter lab` whose default backend is `backend` (with `settings`), copies of `repos`
    in its root and a store `history` fills, and a chromium page."""
    argv = [f"--ThemistoExtensionApp.default_backend={backend}", *(extra_argv or [])]
    if settings:
        argv.append(f"--ThemistoExtensionApp.backend_settings={json.dumps({backend: settings})}")
    with tempfile.TemporaryDirectory() as tmp:
        lab = JupyterLab(Path(tmp), argv)
        lab.store_path.parent.mkdir(parents=True)
        for repo in repos:
            # (a copy: the cells may write files next to their data)
            shutil.copytree(repo, lab.root / repo.name, symlinks=True, dirs_exist_ok=True)
        store = TrajectoryStore(lab.store_path)
        if history is not None:
            history(store)
        lab.start()
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(60_000)
                yield lab, store, page
                browser.close()
        finally:
            lab.stop()


def open_new_notebook(
    page: Page, lab: JupyterLab, store: TrajectoryStore, name: str, workspace: str
) -> None:
    """A new notebook `name` open in the page, its kernel idle and recorded."""
    lab.new_notebook(quote(name))
    page.goto(lab.lab_url(quote(name), workspace))
    expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_have_count(
        1, timeout=60_000
    )
    wait_for_recorder(lab, store, name)


def wait_for_recorder(lab: JupyterLab, store: TrajectoryStore, notebook: str) -> None:
    """Until the notebook's kernel has a trajectory (the recorder is on), 60 s at most."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kid = lab.kernel_id(notebook)
        if kid and store.list_trajectories(kernel_id=kid, limit=1):
            return
        time.sleep(0.2)


if __name__ == "__main__":
    main()
