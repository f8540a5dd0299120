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
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ghost_text_latency import (  # noqa: E402
    Session,
    browser_lab,
    corpus_sessions,
    open_new_notebook,
)
from playwright.sync_api import expect  # noqa: E402

from tests.ui.lab import check_installed_build  # noqa: E402

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
) -> list[tuple[float, bool]]:
    keys: list[tuple[float, bool]] = []
    with browser_lab(backend, settings, repos) as (lab, store, page):
        for n, run in enumerate(sessions):
            open_new_notebook(page, lab, store, f"{run.folder}/typing-{n}.ipynb", f"typing{n}")
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
    return keys


def type_cell(page: Any, source: str, args: argparse.Namespace) -> list[tuple[float, bool]]:
    """Type the cell's first `args.lines` lines key by key: each key's latency (ms), and
    whether it came right after a pause (the first of a line after the first)."""
    page.evaluate(KEY_LATENCY_JS)
    page.evaluate("() => { window.__themistoKeys.length = 0; }")
    lines = [line.strip() for line in source.splitlines() if line.strip()][: args.lines]
    after_pause: list[bool] = []
    for j, line in enumerate(lines):
        if j:
            page.keyboard.press("Enter")
            after_pause.append(True)
        for char in line:
            page.keyboard.type(char)
            after_pause.append(False)
            page.wait_for_timeout(args.key_ms)
        page.wait_for_timeout(args.pause_s * 1000)
    latencies = page.evaluate("() => window.__themistoKeys")
    if len(latencies) != len(after_pause):  # (a key the editor did not show: no pairing)
        return [(k, False) for k in latencies]
    return list(zip(latencies, after_pause, strict=True))


def report(case: str, keys: list[tuple[float, bool]]) -> None:
    print(f"[{case}]")
    for label, which in (
        ("all keys", [k for k, _ in keys]),
        ("the first key after a pause", [k for k, first in keys if first]),
        ("the others", [k for k, first in keys if not first]),
    ):
        if len(which) < 2:
            print(f"  {label}: {len(which)} measured")
            continue
        qs = statistics.quantiles(which, n=100, method="inclusive")
        slow = sum(k > 50 for k in which), sum(k > 100 for k in which)
        print(
            f"  {label}, {len(which)}: median {statistics.median(which):.1f} ms,"
            f" p90 {qs[89]:.1f}, p99 {qs[98]:.1f}, max {max(which):.1f};"
            f" over 50 ms {slow[0]}, over 100 ms {slow[1]}"
        )


if __name__ == "__main__":
    main()
