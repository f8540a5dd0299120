"""Reading a benchmark dump back: its manifest and tables, the prediction context of a task
instance built from the execution rows (jupyter_themisto.context.build_context), and a store
holding a dump's trajectories (the history a backend may learn from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..console import CliError
from ..context import build_context, runtime_lag


def read_manifest(dump: Path) -> dict[str, Any]:
    """The manifest (dump.json) of a dump folder; a missing or invalid one is a CliError."""
    if not dump.is_dir():
        raise CliError(f"no such dump folder: {dump}")
    path = dump / "dump.json"
    if not path.is_file():
        raise CliError(f"{dump} is not a dump (no dump.json; write one with `export`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        manifest["files"]["executions"]
    except (ValueError, KeyError, TypeError) as e:
        raise CliError(f"{path} is not a valid dump manifest: {e}") from e
    return manifest


def read_table(dump: Path, manifest: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """All rows of one table of a dump, as plain dicts."""
    rows: list[dict[str, Any]] = []
    for file in manifest["files"].get(name, []):
        path = dump / file
        if not path.is_file():
            raise CliError(f"the dump is incomplete: {path} is missing")
        if file.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
        else:
            with open(path, encoding="utf-8") as f:
                rows.extend(json.loads(line) for line in f if line.strip())
    return rows


class DumpContexts:
    """Builds the prediction context of a task instance from the dump's execution rows."""

    def __init__(
        self,
        executions: list[dict[str, Any]],
        token_budget: int | None,
        notebook_cells: list[dict[str, Any]] | None = None,
    ) -> None:
        self.by_trajectory: dict[str, list[dict[str, Any]]] = {}
        for r in executions:
            self.by_trajectory.setdefault(r["trajectory_id"], []).append(r)
        for rows in self.by_trajectory.values():
            rows.sort(key=lambda r: r["order_index"])
        self.token_budget = token_budget
        #: live setting: each trajectory's notebook cells in notebook order (None: trajectory)
        self.notebooks: dict[str, list[dict[str, Any]]] | None = None
        if notebook_cells is not None:
            self.notebooks = {}
            for c in sorted(notebook_cells, key=lambda c: c["position"]):
                cell = {"id": c.get("cell_id"), "cell_type": c["cell_type"], "source": c["source"]}
                self.notebooks.setdefault(c["trajectory_id"], []).append(cell)

    def around(
        self, instance: dict[str, Any]
    ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
        """(cells above, cells below) the instance's cell in its notebook, as the browser sends
        them; (None, None) in the trajectory setting or when the cell is not in the notebook."""
        if self.notebooks is None:
            return None, None
        cells = self.notebooks.get(instance["trajectory_id"], [])
        cid = instance.get("cell_id")
        at = next((i for i, c in enumerate(cells) if cid and c["id"] == cid), None)
        if at is None:
            return None, None
        return cells[:at], cells[at + 1 :]

    def prior(self, instance: dict[str, Any]) -> list[dict[str, Any]]:
        rows = self.by_trajectory.get(instance["trajectory_id"], [])
        return [r for r in rows if r["order_index"] < instance["order_index"]]

    def build(self, instance: dict[str, Any], with_runtime: bool) -> Any:
        prior = self.prior(instance)
        executions = [
            {
                "source": r["source"],
                "outputs": json.loads(r["outputs"]) if isinstance(r["outputs"], str) else [],
                "status": r["status"],
                "execution_count": r.get("execution_count"),
                "order_index": r["order_index"],
                "cell_id": r.get("cell_id"),
            }
            for r in prior
        ]
        variables: list[dict[str, Any]] = []
        changes: dict[str, int] = {}
        if with_runtime:
            for r in prior:
                for v in r.get("variables") or []:
                    if v.get("changed"):
                        changes[v["name"]] = r["order_index"]
            for r in reversed(prior):
                if r.get("variables"):
                    variables = [
                        {
                            "name": v["name"],
                            "type": v["type"],
                            "summary": _json_obj(v.get("summary")),
                            "changed": v.get("changed"),
                        }
                        for v in r["variables"]
                    ]
                    break
        above, below = self.around(instance)
        ctx = build_context(
            executions,
            variables,
            with_runtime=with_runtime,
            notebook_cells=above,
            cells_below=below if instance["task"] == "next-cell" else None,
            target_source=instance.get("source") or None if instance["task"] == "output" else None,
            variable_changes=changes,
            token_budget=self.token_budget,
            trajectory_id=instance["trajectory_id"],
            notebook_path=prior[0].get("notebook_path") if prior else None,
        )
        if with_runtime:
            # As the server tells it: variables of a snapshot older than the newest cells.
            ctx.runtime_lag = runtime_lag(prior)
        return ctx


def _json_obj(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value or "{}")
    except (TypeError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def train_store(dump: Path, exclude: set[str], folder: Path) -> Any:
    """A temporary store holding a training dump's trajectories (minus `exclude`)."""
    from ..store import TrajectoryStore

    manifest = read_manifest(dump)
    store = TrajectoryStore(folder / "train.sqlite")
    trajectories = {t["trajectory_id"]: t for t in read_table(dump, manifest, "trajectories")}
    rows = sorted(
        read_table(dump, manifest, "executions"),
        key=lambda r: (r["trajectory_id"], r["order_index"]),
    )
    created: set[str] = set()
    for r in rows:
        tid = r["trajectory_id"]
        if tid in exclude:
            continue
        if tid not in created:
            t = trajectories.get(tid, {})
            store.create_trajectory(
                trajectory_id=tid,
                notebook_path=r.get("notebook_path"),
                started_at=t.get("started_at"),
            )
            created.add(tid)
        store.add_execution(
            tid,
            {
                "source": r["source"],
                "status": r["status"],
                "outputs": json.loads(r["outputs"]),
                "cell_id": r.get("cell_id"),
                "execution_count": r.get("execution_count"),
            },
        )
    return store
