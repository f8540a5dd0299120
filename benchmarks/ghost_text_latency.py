"""Ghost-text latency in a real browser: from a new empty cell becoming active to its ghost text.

For each backend (`--backends`, default: retrieval, then llamacpp with the embedded code
model), starts a `jupyter lab` with the extension and that default backend (a fresh store
seeded with one earlier trajectory of `--cells` cells), opens a notebook in Debian's chromium
through Playwright, and runs the same cells one by one with Shift+Enter. After each run past
the first, the new empty cell becomes active and its ghost text appears; an in-page
MutationObserver timestamps both. The figure includes waiting for the cell just run to be
answered and recorded (the request names the execution it follows; the server answers once
that is recorded). Target: <= 300 ms.

    .venv/bin/python benchmarks/ghost_text_latency.py [--cells 12] [--backends retrieval,llamacpp]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from jupyter_themisto.store import TrajectoryStore  # noqa: E402
from tests.ui.lab import CHROMIUM, CHROMIUM_ARGS, JupyterLab, check_installed_build  # noqa: E402

OBSERVER = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  const before = nb.querySelectorAll('.jp-Cell').length;
  const t = (window.__t = {});
  const obs = new MutationObserver(() => {
    const all = nb.querySelectorAll('.jp-Cell');
    const active = nb.querySelector('.jp-Cell.jp-mod-active');
    if (!t.activeAt && all.length > before && active === all[all.length - 1]) {
      t.activeAt = performance.now();
    }
    if (t.activeAt && !t.ghostAt && active && active.querySelector('.jp-GhostText')) {
      t.ghostAt = performance.now();
      obs.disconnect();
    }
  });
  obs.observe(nb, { subtree: true, childList: true, attributes: true, attributeFilter: ['class'] });
}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=12, help="cells to run (default 12)")
    parser.add_argument("--backends", default="retrieval,llamacpp")
    args = parser.parse_args()
    cells = [f"x{i} = {i} * 2" if i % 2 else f"print(x{i - 1} + {i})" for i in range(1, args.cells)]
    cells.insert(0, "import math")
    check_installed_build(ROOT)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    for backend in args.backends.split(","):
        measure(backend, cells)


def measure(backend: str, cells: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lab = JupyterLab(Path(tmp), [f"--ThemistoExtensionApp.default_backend={backend}"])
        lab.store_path.parent.mkdir(parents=True)
        store = TrajectoryStore(lab.store_path)
        tid = store.create_trajectory(notebook_path="earlier.ipynb")
        for source in cells:
            store.add_execution(tid, {"source": source, "status": "ok", "outputs": []})
        lab.start()
        latencies: list[float] = []
        texts: list[str] = []
        misses = 0
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(60_000)
                lab.new_notebook("bench.ipynb")
                page.goto(lab.lab_url("bench.ipynb", "bench"))
                expect(
                    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                ).to_have_count(1)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    kid = lab.kernel_id("bench.ipynb")
                    if kid and any(
                        t["kernel_id"] == kid for t in store.list_trajectories(limit=10)
                    ):
                        break
                    time.sleep(0.2)
                for i, source in enumerate(cells):
                    active = page.locator(".jp-Cell.jp-mod-active")
                    active.locator(".cm-content").click()
                    page.keyboard.press("Escape")  # dismiss ghost text before typing
                    active.locator(".cm-content").click()
                    page.keyboard.type(source)
                    if i > 0:
                        page.evaluate(OBSERVER)
                    page.keyboard.press("Shift+Enter")
                    prompt = page.locator(".jp-Cell").nth(i).locator(".jp-InputPrompt")
                    expect(prompt).to_have_text(re.compile(r"\[\d+\]"))
                    if i == 0:
                        continue
                    try:
                        page.wait_for_function(
                            "() => window.__t && window.__t.ghostAt", timeout=5000
                        )
                    except Exception:
                        misses += 1
                        continue
                    t = page.evaluate("() => window.__t")
                    latencies.append(t["ghostAt"] - t["activeAt"])
                    page.wait_for_timeout(1500)  # let the suggestion stream in before the next
                    ghost = page.locator(".jp-Cell.jp-mod-active .jp-GhostText")
                    texts.append(ghost.first.inner_text() if ghost.count() else "")
                browser.close()
        finally:
            lab.stop()
    print(f"[{backend}] ghost text over {len(latencies)} new cells ({misses} without ghost text):")
    if latencies:
        qs = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else latencies * 9
        print(
            f"  median {statistics.median(latencies):.0f} ms, p90 {qs[-1]:.0f} ms, "
            f"min {min(latencies):.0f} ms, max {max(latencies):.0f} ms (target <= 300 ms)"
        )
    for source, text in list(zip(cells[1:], texts, strict=False))[:3]:
        print(f"  after {source!r}: {text!r}")


if __name__ == "__main__":
    main()
