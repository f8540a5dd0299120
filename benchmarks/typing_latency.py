"""Typing latency in a real browser while the model reads and writes ahead.

The plugin reads a cell ahead at each pause in its typing (`warmWhileTyping`), and a local
model then writes the suggestion for the cell after it (`answer_ahead`). On a 2-core machine
that work shares the cores with the browser the person is typing into. This script types real
cells key by key, as a person does, and measures each key's latency in the page: from the key
event to the next frame after the editor showed the character.

For each case (`--cases`, default: `retrieval` — no model —, `llamacpp` with
`answer_ahead` false, `llamacpp` as shipped) it starts a `jupyter lab` with the extension and
that default backend, opens a new notebook in Debian's chromium through Playwright for each of
`--corpus N` benchmark corpus notebooks (`corpus.spread`, written by others), runs its first
cell, then types each of the next `--cells` cells: up to `--lines` lines of it, `--key-ms`
apart, with a `--pause-s` pause after each line (the plugin's warm-up comes after 1 s of no
typing). Before each run the cell's text is replaced by the cell as written in the notebook
(typed, the editor indents lines itself), and the cell runs. Printed per case: the keys'
latency, median, p90, p99 and max, and how many keys took over 50 and 100 ms.

    .venv/bin/python benchmarks/typing_latency.py [--corpus 3] [--cells 5] [--lines 2]
        [--key-ms 150] [--pause-s 1.5] [--cases retrieval,llamacpp:answer_ahead=false,llamacpp]
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
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ghost_text_latency import Session, corpus_sessions, wait_for_recorder  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from jupyter_themisto.store import TrajectoryStore  # noqa: E402
from tests.ui.lab import CHROMIUM, CHROMIUM_ARGS, JupyterLab, check_installed_build  # noqa: E402

#: Each key's latency (ms): from its keydown event to the first frame after the active editor
#: changed. `window.__themistoKeys` collects them.
KEY_LATENCY_JS = """() => {
  if (window.__themistoKeys) return;
  const keys = (window.__themistoKeys = []);
  let pending = null;
  document.addEventListener('keydown', e => { pending = e.timeStamp; }, true);
  new MutationObserver(() => {
    if (pending === null) return;
    const since = pending;
    pending = null;
    requestAnimationFrame(t => keys.push(t - since));
  }).observe(document.body, { subtree: true, childList: true, characterData: true });
}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=int, default=3, metavar="N", help="N corpus notebooks")
    parser.add_argument("--cells", type=int, default=5, help="cells typed per notebook")
    parser.add_argument("--lines", type=int, default=2, help="lines typed of each cell")
    parser.add_argument("--key-ms", type=float, default=150, help="time between keys")
    parser.add_argument("--pause-s", type=float, default=1.5, help="pause after each line")
    parser.add_argument(
        "--cases",
        default="retrieval,llamacpp:answer_ahead=false,llamacpp",
        help="backend[:setting=value[;…]] cases, comma-separated",
    )
    args = parser.parse_args()
    check_installed_build(ROOT)
    sessions, repos = corpus_sessions(args.corpus, args.cells + 1)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print("notebooks:", ", ".join(s.name for s in sessions))
    for case in args.cases.split(","):
        backend, _, options = case.partition(":")
        settings: dict[str, Any] = {}
        for option in filter(None, options.split(";")):
            key, _, value = option.partition("=")
            settings[key] = json.loads(value)
        keys = measure(backend, settings, sessions, repos, args)
        report(case, keys)


def measure(
    backend: str,
    settings: dict[str, Any],
    sessions: list[Session],
    repos: list[Path],
    args: argparse.Namespace,
) -> list[float]:
    argv = [f"--ThemistoExtensionApp.default_backend={backend}"]
    if settings:
        argv.append(f"--ThemistoExtensionApp.backend_settings={json.dumps({backend: settings})}")
    keys: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        lab = JupyterLab(Path(tmp), argv)
        lab.store_path.parent.mkdir(parents=True)
        for repo in repos:
            shutil.copytree(repo, lab.root / repo.name, symlinks=True, dirs_exist_ok=True)
        store = TrajectoryStore(lab.store_path)
        lab.start()
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(60_000)
                for n, run in enumerate(sessions):
                    name = f"{run.folder}/typing-{n}.ipynb"
                    lab.new_notebook(quote(name))
                    page.goto(lab.lab_url(quote(name), f"typing{n}"))
                    expect(
                        page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                    ).to_have_count(1, timeout=60_000)
                    wait_for_recorder(lab, store, name)
                    for i, source in enumerate(run.cells):
                        editor = page.locator(".jp-Cell.jp-mod-active .cm-content")
                        editor.click()
                        page.keyboard.press("Escape")  # (a ghost text, if any)
                        editor.click()
                        if i > 0:
                            keys += type_cell(page, source, args)
                            page.keyboard.press("Control+a")
                        page.keyboard.insert_text(source)
                        page.keyboard.press("Shift+Enter")
                        prompt = page.locator(".jp-Cell").nth(i).locator(".jp-InputPrompt")
                        expect(prompt).to_have_text(re.compile(r"\[\d+\]"), timeout=180_000)
                browser.close()
        finally:
            lab.stop()
    return keys


def type_cell(page: Any, source: str, args: argparse.Namespace) -> list[float]:
    """Type the cell's first `args.lines` lines key by key; the keys' latencies (ms)."""
    page.evaluate(KEY_LATENCY_JS)
    page.evaluate("() => { window.__themistoKeys.length = 0; }")
    lines = [line.strip() for line in source.splitlines() if line.strip()][: args.lines]
    for j, line in enumerate(lines):
        if j:
            page.keyboard.press("Enter")
        for char in line:
            page.keyboard.type(char)
            page.wait_for_timeout(args.key_ms)
        page.wait_for_timeout(args.pause_s * 1000)
    return list(page.evaluate("() => window.__themistoKeys"))


def report(case: str, keys: list[float]) -> None:
    if len(keys) < 2:
        print(f"[{case}] {len(keys)} keys measured")
        return
    qs = statistics.quantiles(keys, n=100, method="inclusive")
    slow = sum(k > 50 for k in keys), sum(k > 100 for k in keys)
    print(
        f"[{case}] {len(keys)} keys: median {statistics.median(keys):.1f} ms, p90 {qs[89]:.1f},"
        f" p99 {qs[98]:.1f}, max {max(keys):.1f}; over 50 ms {slow[0]}, over 100 ms {slow[1]}"
    )


if __name__ == "__main__":
    main()
