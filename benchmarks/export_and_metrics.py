"""Benchmark: exporting 1,500 executions with snapshots, and scoring 1,500 prediction pairs.

Targets (issue 4): export of 1,500 executions with snapshots <= 10 s; all metrics over 1,500
pairs <= 3 s (model time excluded). The store is synthetic but shaped like the Themisto data
(four trajectories of 375 executions; each with a short cell, a text output and a snapshot of
~15 variables, a few of which change per step, with blobs of 1-64 KB). The pairs are the
dump's own instances with the previous cell / previous output as the prediction (the
repeat-previous baseline), so their lengths are realistic.

    .venv/bin/python benchmarks/export_and_metrics.py [--executions 1500]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_themisto import metrics as M  # noqa: E402
from jupyter_themisto.dump import TASK_TABLES, export_dump, read_manifest, read_table  # noqa: E402
from jupyter_themisto.store import TrajectoryStore  # noqa: E402

CELLS = [
    "df = pd.read_csv('data/train.csv')\ndf.head()",
    "df.describe()",
    "df['price'].hist(bins=50)",
    "X = df.drop(columns=['price'])\ny = df['price']",
    "from sklearn.model_selection import train_test_split\n"
    "X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2)",
    "model = RandomForestRegressor(n_estimators=100)\nmodel.fit(X_train, y_train)",
    "pred = model.predict(X_test)\nprint(mean_absolute_error(y_test, pred))",
    "for col in df.columns:\n    print(col, df[col].isna().sum())",
    "df.groupby('region')['price'].mean().sort_values()",
    "len(df)",
]


def build_store(path: Path, n: int, per_trajectory: int, rng: random.Random) -> TrajectoryStore:
    store = TrajectoryStore(path)
    names = [f"var_{i}" for i in range(15)]
    values = {name: os.urandom(rng.randint(1024, 64 * 1024)) for name in names}
    hashes = {name: store.put_blob(data) for name, data in values.items()}
    done = 0
    while done < n:
        tid = store.create_trajectory(notebook_path=f"nb_{done // per_trajectory}.ipynb")
        for k in range(min(per_trajectory, n - done)):
            src = rng.choice(CELLS) + ("" if k % 3 else f"\n# step {k}")
            text = "".join(f"{rng.random():.6f} {rng.choice(names)}\n" for _ in range(8))
            eid = store.add_execution(
                tid,
                {
                    "source": src,
                    "status": "ok",
                    "outputs": [{"output_type": "stream", "name": "stdout", "text": text}],
                    "execution_count": k + 1,
                    "started_at": time.time(),
                    "wall_time": rng.random(),
                    "cpu_time": rng.random(),
                    "memory_before": 100 << 20,
                    "memory_after": 101 << 20,
                    "memory_peak": 120 << 20,
                },
            )
            changed = set(rng.sample(names, 3))
            for name in changed:
                hashes[name] = store.put_blob(os.urandom(rng.randint(1024, 64 * 1024)))
            variables = [
                {
                    "name": name,
                    "type": "pandas.core.frame.DataFrame" if i % 3 == 0 else "list",
                    "size": 4096,
                    "summary": {"shape": [1000, 12], "columns": [f"c{j}" for j in range(12)]}
                    if i % 3 == 0
                    else {"len": 10, "repr": "[1, 2, 3, ...]"},
                    "blob_hash": hashes[name],
                    "changed": name in changed,
                }
                for i, name in enumerate(names)
            ]
            store.write_snapshot(eid, variables, mode="inline", duration=0.01)
            done += 1
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executions", type=int, default=1500)
    ap.add_argument("--per-trajectory", type=int, default=375)
    args = ap.parse_args()
    rng = random.Random(4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        store = build_store(root / "s.sqlite", args.executions, args.per_trajectory, rng)
        stats = store.blob_stats()
        print(
            f"store: {args.executions} executions, {stats['count']} blobs "
            f"({stats['size'] / 2**20:.1f} MB) built in {time.perf_counter() - t0:.1f} s"
        )
        trajectories = list(reversed(store.list_trajectories()))
        for fmt, snapshots in [
            ("jsonl", "summary"),
            ("jsonl", "full"),
            ("parquet", "summary"),
            ("parquet", "full"),
        ]:
            out = root / f"dump-{fmt}-{snapshots}"
            t0, c0 = time.perf_counter(), time.process_time()
            manifest = export_dump(store, trajectories, out, fmt=fmt, snapshots=snapshots)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            print(
                f"export {fmt:7s} --snapshots {snapshots:7s}: {dt:6.2f} s ({cpu:.2f} s CPU) for "
                f"{manifest['counts']['executions']} executions "
                f"({manifest['counts']['blobs']} blobs, {size / 2**20:.1f} MB)  "
                f"[target <= 10 s: {'ok' if dt <= 10 else 'MISSED'}]"
            )

        dump = root / "dump-jsonl-summary"
        manifest = read_manifest(dump)
        rows = read_table(dump, manifest, "executions")
        by_key = {(r["trajectory_id"], r["order_index"]): r for r in rows}
        pairs = {"next-cell": [], "output": []}
        for task, table in TASK_TABLES.items():
            for inst in read_table(dump, manifest, table):
                prev = by_key.get((inst["trajectory_id"], inst["order_index"] - 1))
                pred = (
                    ""
                    if prev is None
                    else (prev["source"] if task == "next-cell" else prev["output_text"])
                )
                pairs[task].append((pred, inst["target"]))
        for task, items in pairs.items():
            items = (items * (1500 // max(1, len(items)) + 1))[:1500]
            M.score("warm", "up", task)
            t0, c0 = time.perf_counter(), time.process_time()
            scores = [M.score(p, r, task) for p, r in items]
            means = M.mean_scores(scores)
            M.corpus_scores([p for p, _ in items], [r for _, r in items])
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            avg_len = sum(len(r) for _, r in items) / len(items)
            shown = " ".join(f"{k}={v:.3f}" for k, v in means.items() if v is not None)
            print(
                f"metrics {task:9s}: {dt:5.2f} s ({cpu:.2f} s CPU) for {len(items)} pairs "
                f"(mean reference {avg_len:.0f} chars; {shown})  "
                f"[target <= 3 s: {'ok' if dt <= 3 else 'MISSED'}]"
            )


if __name__ == "__main__":
    main()
