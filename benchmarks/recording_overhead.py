"""Recording overhead: latency added per cell and bytes stored, vs naive dill dumps and Kishu.

Runs every notebook in benchmarks/notebooks/ (or those given) cell by cell through the Jupyter
protocol in fresh kernels, once per mode:

- off:    a plain kernel (the baseline);
- naive:  a plain kernel, untimed: after each cell a silent request measures the bytes of a
          naive per-step full-namespace dill dump (every %who variable, uncompressed);
- on:     `--ext=jupyter_themisto` with the default fork snapshots;
- kishu:  Kishu (`pip install -e ".[bench]"`), enabled with `init_kishu()` before the first cell.

and prints, per notebook and overall: the added latency per cell (client-observed
send -> execute_reply, median and p95 of on - off for the same cell; the minimum over
`--repeat` runs per cell), the recorder's own time in the kernel (hooks the cell waits for,
and the work deferred past the reply: store write and fork), bytes stored per execution,
and the naive dump bytes. Cells are sent back to back (as "run all" does) unless `--think`
gives a pause between a reply and the next cell (as a person typing would leave).
Figures only; nothing is asserted.

    .venv/bin/python benchmarks/recording_overhead.py [--repeat 2] [--think 0.5]
        [--modes off,on,kishu] [notebooks/*.ipynb ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.manager import KernelManager

HERE = Path(__file__).parent
NAIVE_DUMP = r"""
import dill as __d
class __Count:
    n = 0
    def write(self, b):
        self.n += len(b)
        return len(b)
def __themisto_naive():
    from types import ModuleType
    ip = get_ipython()
    hidden = ip.user_ns_hidden
    total = 0
    for k, v in list(ip.user_ns.items()):
        if k.startswith('_') or hidden.get(k, object()) is v or isinstance(v, ModuleType):
            continue
        c = __Count()
        try:
            __d.dump(v, c)
        except Exception:
            continue
        total += c.n
    return total
"""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Kernel:
    def __init__(self, env: dict[str, str], extra: list[str], cwd: str) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, extra_arguments=extra, cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def execute(self, code: str, *, silent: bool = False, expr: str | None = None) -> dict:
        """Run a cell; returns reply content, seconds from send to reply, and errors seen."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(
            code,
            silent=silent,
            store_history=not silent,
            user_expressions={"r": expr} if expr else None,
            allow_stdin=False,
        )
        while True:
            reply = self.kc.get_shell_msg(timeout=1800)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        elapsed = time.perf_counter() - t0
        # Drain iopub up to this request's idle so the next timing starts clean.
        errors = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=600)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "error":
                errors.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stderr":
                errors.append(msg["content"]["text"][:200])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        return {"reply": reply["content"], "seconds": elapsed, "errors": errors}

    def value(self, expr: str) -> Any:
        out = self.execute("", silent=True, expr=expr)
        data = out["reply"]["user_expressions"]["r"]
        if data.get("status") != "ok":
            raise RuntimeError(f"{expr}: {data}")
        return eval(data["data"]["text/plain"])  # noqa: S307 - our own expression's repr

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_notebook(nb_path: Path, mode: str, workdir: Path, think: float = 0.0) -> dict[str, Any]:
    nb = nbformat.read(nb_path, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    run_dir = workdir / f"{nb_path.stem}-{mode}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    local_nb = run_dir / nb_path.name
    shutil.copy(nb_path, local_nb)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    store = run_dir / "trajectories.sqlite"
    env["THEMISTO_STORE"] = str(store)
    env["THEMISTO_NOTEBOOK_PATH"] = str(local_nb)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    extra: list[str] = []
    if mode == "on":
        extra = ["--ext=jupyter_themisto"]
    if mode == "kishu":
        env["KISHU_PATH_ROOT"] = str(run_dir)
        env["TEST_NOTEBOOK_PATH"] = str(local_nb)
        env["ENV_KISHU_TEST_MODE"] = "true"  # no frontend here: skip its notebook saving
    kernel = Kernel(env, extra, str(run_dir))
    result: dict[str, Any] = {"seconds": [], "errors": [], "naive": []}
    try:
        if mode == "kishu":
            setup = kernel.execute(f"from kishu import init_kishu\ninit_kishu({str(local_nb)!r})")
            if setup["errors"] or setup["reply"]["status"] != "ok":
                result["setup_error"] = setup["errors"] or setup["reply"]
        if mode == "naive":
            kernel.execute(NAIVE_DUMP, silent=True)
        for source in cells:
            if think:
                time.sleep(think)
            out = kernel.execute(source)
            result["seconds"].append(out["seconds"])
            result["errors"].append(out["errors"])
            if mode == "naive":
                result["naive"].append(kernel.value("__themisto_naive()"))
        if mode == "on":
            # Let the last snapshot children finish before measuring the store.
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                n = kernel.value(
                    "__import__('jupyter_themisto.kernel', fromlist=['x'])"
                    ".get_recorder().snapshots.reap() or "
                    "__import__('jupyter_themisto.kernel', fromlist=['x'])"
                    ".get_recorder().snapshots.running()"
                )
                if n == 0:
                    break
                time.sleep(0.2)
            result["hook_seconds"] = kernel.value(
                "list(__import__('jupyter_themisto.kernel', fromlist=['x'])"
                ".get_recorder().hook_seconds)"
            )
            result["deferred_seconds"] = kernel.value(
                "list(__import__('jupyter_themisto.kernel', fromlist=['x'])"
                ".get_recorder().deferred_seconds)"
            )
    finally:
        kernel.shutdown()
    if mode == "on":
        conn = sqlite3.connect(store)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        result["n_executions"] = conn.execute("SELECT count(*) FROM executions").fetchone()[0]
        result["snapshot_statuses"] = dict(
            conn.execute("SELECT snapshot_status, count(*) FROM executions GROUP BY 1").fetchall()
        )
        result["snapshot_child_seconds"] = [
            r[0] for r in conn.execute("SELECT duration FROM snapshots WHERE duration IS NOT NULL")
        ]
        conn.close()
        result["stored_bytes"] = dir_bytes(store)
    if mode == "kishu":
        kishu_files = [p for p in run_dir.rglob("*") if p.is_file() and "kishu" in str(p).lower()]
        result["stored_bytes"] = sum(p.stat().st_size for p in kishu_files)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def fmt_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"median {statistics.median(values) * 1000:8.1f} ms   "
        f"p95 {percentile(values, 0.95) * 1000:8.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--modes", default="off,on,kishu")
    parser.add_argument(
        "--think", type=float, default=0.0, help="seconds between a reply and the next cell"
    )
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args()
    notebooks = args.notebooks or sorted((HERE / "notebooks").glob("*.ipynb"))
    modes = args.modes.split(",")
    if "off" not in modes:
        parser.error("the 'off' mode is the baseline and must be included")
    workdir = Path(tempfile.mkdtemp(prefix="themisto-bench-"))
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for nb in notebooks:
            raw[nb.name] = {m: [] for m in modes}
            raw[nb.name]["naive"] = [run_notebook(nb, "naive", workdir)]
            for _ in range(args.repeat):
                for mode in modes:
                    t0 = time.perf_counter()
                    raw[nb.name][mode].append(run_notebook(nb, mode, workdir, args.think))
                    print(
                        f"  ran {nb.name:28s} {mode:6s} in {time.perf_counter() - t0:6.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1, default=str))
    print(f"\n(think time between cells: {args.think:g} s; repeats: {args.repeat})")
    report(raw, modes)


def per_cell_min(runs: list[dict[str, Any]]) -> list[float]:
    return [min(r["seconds"][i] for r in runs) for i in range(len(runs[0]["seconds"]))]


def report(raw: dict[str, dict[str, list[dict[str, Any]]]], modes: list[str]) -> None:
    print("\n== Recording overhead (per code cell; added = mode - off for the same cell) ==")
    totals: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
    hooks: list[float] = []
    deferred: list[float] = []
    stored = {m: 0 for m in modes}
    n_exec = 0
    naive_total = 0
    for name, by_mode in raw.items():
        base = per_cell_min(by_mode["off"])
        naive = by_mode["naive"][0]["naive"]
        naive_total += sum(naive)
        print(f"\n{name}: {len(base)} cells, baseline total {sum(base):.2f} s")
        for mode in modes:
            if mode == "off":
                continue
            runs = by_mode[mode]
            added = [t - b for t, b in zip(per_cell_min(runs), base, strict=True)]
            totals[mode] += added
            errors = sum(1 for e in runs[0]["errors"] if e)
            line = f"  {mode:6s} added latency {fmt_ms(added)}   total +{sum(added):7.2f} s"
            if errors:
                line += f"   ({errors} cells showed errors/stderr)"
            if runs[0].get("setup_error"):
                line += f"   init cell said: {str(runs[0]['setup_error'])[:200]}"
            print(line)
            if mode == "on":
                hooks += runs[0]["hook_seconds"]
                n_exec += runs[0]["n_executions"]
                deferred += runs[0]["deferred_seconds"]
                print(f"         in-kernel hook time  {fmt_ms(runs[0]['hook_seconds'])}")
                print(f"         deferred past reply  {fmt_ms(runs[0]['deferred_seconds'])}")
                child = runs[0]["snapshot_child_seconds"]
                print(
                    f"         snapshot child time  {fmt_ms(child)}   statuses "
                    f"{runs[0]['snapshot_statuses']}"
                )
            if "stored_bytes" in runs[0]:
                stored[mode] += runs[0]["stored_bytes"]
                print(
                    f"         stored {runs[0]['stored_bytes'] / 1e6:9.2f} MB "
                    f"({runs[0]['stored_bytes'] / max(1, len(base)) / 1e3:9.1f} kB per execution)"
                )
        print(f"  naive per-step dill dumps: {sum(naive) / 1e6:9.2f} MB")
    print("\n== Overall ==")
    for mode, added in totals.items():
        print(f"  {mode:6s} added latency per cell: {fmt_ms(added)}")
    if hooks:
        print(f"  on     in-kernel hook time:    {fmt_ms(hooks)}")
        print(f"  on     deferred past the reply: {fmt_ms(deferred)}")
    for mode in totals:
        if stored.get(mode):
            ratio = naive_total / stored[mode] if stored[mode] else float("inf")
            print(
                f"  {mode:6s} stored {stored[mode] / 1e6:9.2f} MB; naive dill dumps "
                f"{naive_total / 1e6:9.2f} MB; naive/stored = {ratio:.1f}x"
            )
    if n_exec:
        print(f"  on     bytes stored per execution: {stored['on'] / n_exec / 1e3:.1f} kB")
    print("  targets: median added <= 5 ms, p95 <= 20 ms; storage <= 1/10 of naive dumps")


if __name__ == "__main__":
    main()
