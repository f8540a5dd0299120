"""Benchmark: what following secrets by value costs, on the recorded corpus of real notebooks.

On every recorded execution of the corpus (benchmarks/corpus.py), as the recorder and the
server do it:

- kernel side, per execution: scrubbing the source and each output's text, then the outputs
  as a whole (`KernelSecrets.scrub`, `scrub_output`, `scrub_json`), with nothing known secret
  and with 3 values learnt plus 30 keyed hashes from earlier sessions to follow; and learning
  the values under secret-named keys from each notebook's last namespace (its snapshot's
  variables, deserialized), the walk through nested dicts and lists of records;
- server side: one page of executions scrubbed (`StoreRedactor.scrub_execution`, the
  `/executions` route), and one prediction context per trajectory (`scrub_context`, the door
  to every backend), both with no hash recorded and with 30;
- export of the whole store (`export_dump`, summary snapshots): with the names-only policy
  that came before (`redact_export_row`), then following values without and with the hashes.

The corpus store is copied first: the hashes go to the copy only.

    .venv/bin/python benchmarks/redaction_cost.py [--store CORPUS.sqlite]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import secrets as random_secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from percentiles import percentile  # noqa: E402

from jupyter_themisto import redaction  # noqa: E402
from jupyter_themisto.context import outputs_to_text  # noqa: E402
from jupyter_themisto.dump import export_dump  # noqa: E402
from jupyter_themisto.redaction import KernelSecrets, StoreRedactor  # noqa: E402
from jupyter_themisto.server.manager import ThemistoManager  # noqa: E402
from jupyter_themisto.server.models import NextCellRequest  # noqa: E402
from jupyter_themisto.store import TrajectoryStore  # noqa: E402


def texts_of(outputs: list[dict]) -> list[str]:
    out = []
    for o in outputs:
        if o.get("output_type") == "stream":
            out.append(o.get("text", ""))
        for v in (o.get("data") or {}).values():
            if isinstance(v, str):
                out.append(v)
    return out


def kernel_side(executions: list[dict], secrets: KernelSecrets) -> list[float]:
    """Seconds per execution of the recorder's scrubbing."""
    per = []
    for e in executions:
        t0 = time.perf_counter()
        secrets.scrub(e["source"])
        for text in texts_of(e["outputs"]):
            secrets.scrub_output(text)
        secrets.scrub_json(e["outputs"])
        per.append(time.perf_counter() - t0)
    return per


def namespaces(store: TrajectoryStore, trajectories: list[dict]) -> list[dict]:
    """Each trajectory's last namespace, from its snapshot's serialized variables (those the
    store holds a value of; pickle, else dill)."""
    import pickle

    import dill

    found = []
    for t in trajectories:
        rows = store.list_executions(t["id"])
        variables = store.get_variables(rows[-1]["id"]) if rows else []
        ns = {}
        for v in variables:
            if not v["blob_hash"]:
                continue
            data = store.get_blob(v["blob_hash"])
            for loads in (pickle.loads, dill.loads):
                try:
                    ns[v["name"]] = loads(data)
                    break
                except Exception:
                    continue
        if ns:
            found.append(ns)
    return found


def walk_side(found: list[dict]) -> tuple[list[float], list[float]]:
    """Seconds of `KernelSecrets.observe` on each namespace after a cell (the values under
    secret-named keys, through nested dicts and lists of records): the first time, and again
    (the names and the environment seen already, as in the next cells)."""
    first, again = [], []
    for ns in found:
        secrets = KernelSecrets()
        t0 = time.perf_counter()
        secrets.observe(ns, "")
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        secrets.observe(ns, "")
        again.append(time.perf_counter() - t0)
    return first, again


def server_side(
    store: TrajectoryStore, trajectories: list[dict]
) -> tuple[list[float], list[float]]:
    """(seconds per /executions page of up to 1000 rows, seconds per scrubbed context)."""
    manager = ThemistoManager(store)
    pages, contexts = [], []
    for t in trajectories:
        rows = store.list_executions(t["id"], limit=1000)
        redactor = StoreRedactor(store)  # a fresh one: no cache from the previous trajectory
        redactor.refresh()
        t0 = time.perf_counter()
        for r in rows:
            redactor.scrub_execution(r)
        pages.append(time.perf_counter() - t0)
        ctx = manager.context(NextCellRequest(trajectory_id=t["id"]), t)
        manager.redactor = StoreRedactor(store)
        t0 = time.perf_counter()
        manager.redactor.scrub_context(ctx)
        contexts.append(time.perf_counter() - t0)
    return pages, contexts


def export_seconds(store: TrajectoryStore, trajectories: list[dict]) -> float:
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()):
        t0 = time.perf_counter()
        export_dump(store, trajectories, Path(tmp) / "dump", snapshots="summary")
        return time.perf_counter() - t0


class NamesOnly(StoreRedactor):
    """The export policy before values were followed: names and literals only."""

    def scrub_export_row(self, row):  # type: ignore[no-untyped-def]
        return redaction.redact_export_row(row, self.pattern)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="a recorded corpus store (default: record the corpus)")
    args = ap.parse_args()
    if args.store:
        source = Path(args.store)
    else:
        import corpus

        source = corpus.ensure_recorded(Path(tempfile.gettempdir()) / "themisto-corpus.sqlite")
    work = Path(tempfile.mkdtemp(prefix="themisto-redaction-"))
    try:
        path = work / "corpus.sqlite"
        with TrajectoryStore(source, readonly=True) as src:
            src._conn().execute("VACUUM INTO ?", (str(path),))
        store = TrajectoryStore(path)
        trajectories = store.list_trajectories()
        executions = [e for t in trajectories for e in store.list_executions(t["id"])]
        chars = sum(len(e["source"]) + len(outputs_to_text(e["outputs"])) for e in executions)
        print(
            f"corpus: {len(trajectories)} trajectories, {len(executions)} executions, "
            f"{chars / 1e6:.1f} M characters of source and output text"
        )

        print("\nkernel side, per execution (ms): median  p95  p99  total s")
        plain = kernel_side(executions, KernelSecrets())
        known = KernelSecrets()
        for _ in range(3):
            known.learn(random_secrets.token_urlsafe(24))
        other = KernelSecrets()
        for _ in range(30):
            other.learn(random_secrets.token_urlsafe(18))
        other.persist(store, None)
        known.load_digests(store)
        followed = kernel_side(executions, known)
        for label, per in (("nothing known", plain), ("3 values + 30 hashes", followed)):
            print(
                f"  {label:<24} {statistics.median(per) * 1e3:7.3f}"
                f" {percentile(per, 0.95) * 1e3:7.3f}"
                f" {percentile(per, 0.99) * 1e3:7.3f} {sum(per):7.2f}"
            )

        found = namespaces(store, trajectories)
        sizes = sorted(len(ns) for ns in found)
        first, again = walk_side(found)
        print(
            f"\nkernel side, learning from the namespace after a cell (ms), {len(found)} corpus"
            f" namespaces of {sizes[0]}-{sizes[-1]} variables (median {sizes[len(sizes) // 2]}):"
            " median  p95  max"
        )
        for label, per in (("first cell", first), ("next cells", again)):
            print(
                f"  {label:<24} {statistics.median(per) * 1e3:7.3f}"
                f" {percentile(per, 0.95) * 1e3:7.3f} {max(per) * 1e3:7.3f}"
            )

        print("\nserver side (ms): page of executions median / p95; context median / p95")
        results = {}
        real = redaction.StoreRedactor
        redaction.StoreRedactor = NamesOnly  # type: ignore[misc]
        try:
            results["names only (before)"] = export_seconds(store, trajectories)
        finally:
            redaction.StoreRedactor = real  # type: ignore[misc]
        for label, digests in (("no hash recorded", False), ("30 hashes recorded", True)):
            if not digests:
                with store._write() as conn:
                    saved = conn.execute("SELECT * FROM secret_digests").fetchall()
                    conn.execute("DELETE FROM secret_digests")
            else:
                with store._write() as conn:
                    conn.executemany(
                        "INSERT OR IGNORE INTO secret_digests VALUES (?, ?, ?, ?)",
                        [tuple(r) for r in saved],
                    )
            pages, contexts = server_side(store, trajectories)
            results[label] = export_seconds(store, trajectories)
            print(
                f"  {label:<24} {statistics.median(pages) * 1e3:7.2f}"
                f" {percentile(pages, 0.95) * 1e3:7.2f}"
                f"   {statistics.median(contexts) * 1e3:7.2f}"
                f" {percentile(contexts, 0.95) * 1e3:7.2f}"
            )
        print("\nexport of the whole store, summary snapshots (s):")
        for label, seconds in results.items():
            print(f"  {label:<24} {seconds:7.2f}")
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
