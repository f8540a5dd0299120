"""Reading a benchmark dump back: its manifest and tables, the prediction context of a task
instance built from the execution rows (jupyter_themisto.context.build_context), and a store
holding a dump's trajectories (the history a backend may learn from).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..console import CliError
from ..context import build_context, runtime_lag
from .schema import EXECUTION_FIELDS, NOTEBOOK_CELL_FIELDS, TASK_FIELDS, TRAJECTORY_FIELDS


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


# The fields each table's readers (evaluate, DumpContexts, train_store, the benchmarks) rely on:
# a row lacking one, or holding null or another type there, is damage, said with its line.
# (Only these: a dump an older version wrote may lack fields added since, which nobody reads.)
_CHECKED = {
    "executions": (
        EXECUTION_FIELDS,
        ("trajectory_id", "order_index", "source", "output_text", "outputs", "status"),
    ),
    "trajectories": (TRAJECTORY_FIELDS, ("trajectory_id",)),
    "next_cell": (TASK_FIELDS, ("id", "task", "trajectory_id", "order_index", "n_context")),
    "output": (TASK_FIELDS, ("id", "task", "trajectory_id", "order_index", "n_context")),
    "notebook_cells": (NOTEBOOK_CELL_FIELDS, ("trajectory_id", "position", "cell_type", "source")),
}
_CHECKED_TASK_TEXT = ("source", "target")
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
}


def _expected(name: str) -> dict[str, str]:
    """{field: JSON type} of the fields checked in table `name`'s rows."""
    fields, checked = _CHECKED.get(name, ([], ()))
    types = {field: jtype for field, jtype, *_ in fields}
    out = {field: types[field] for field in checked}
    if name in ("next_cell", "output"):
        out.update({field: types[field] for field in _CHECKED_TASK_TEXT})
    return out


def _row_problem(row: Any, expected: dict[str, str]) -> str | None:
    """What is wrong with one row (None: nothing)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for field, jtype in expected.items():
        if field not in row:
            return f"no {field!r} field"
        value = row[field]
        if value is None:
            return f"{field!r} is null, not a {jtype}"
        if isinstance(value, bool) or not isinstance(value, _PYTHON_TYPES[jtype]):
            return f"{field!r} is a {type(value).__name__}, not a {jtype}"
    return None


def _lines(f: Any, path: Path) -> Iterator[tuple[int, str]]:
    """(number, line) of a text file, from 1; bytes that are not UTF-8 are a CliError."""
    n = 0
    try:
        for n, line in enumerate(f, 1):
            yield n, line
    except UnicodeDecodeError:
        raise CliError(f"the dump is damaged: {path}: not UTF-8 text (after line {n})") from None


def read_table(dump: Path, manifest: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """All rows of one table of a dump, as plain dicts.

    A damaged file is a CliError naming it and the line (row, in a Parquet shard): a line that
    is not JSON, a row lacking a field its readers need or holding null or another type there;
    and so is a table with fewer or more rows than dump.json counts (a file cut short would
    otherwise be scored as a smaller dump).
    """
    rows: list[dict[str, Any]] = []
    expected = _expected(name)
    files = manifest["files"].get(name, [])
    for file in files:
        path = dump / file
        if not path.is_file():
            raise CliError(f"the dump is incomplete: {path} is missing")
        if file.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(path).to_pylist()
            except Exception as e:  # pyarrow's errors for a file that is not Parquet vary
                raise CliError(f"the dump is damaged: {path}: {type(e).__name__}: {e}") from e
            for n, row in enumerate(table, 1):
                problem = _row_problem(row, expected)
                if problem:
                    raise CliError(f"the dump is damaged: {path} row {n}: {problem}")
                rows.append(row)
        else:
            with open(path, encoding="utf-8") as f:
                for n, line in _lines(f, path):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        said = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                        raise CliError(
                            f"the dump is damaged: {path} line {n}: not valid JSON ({said})"
                        ) from None
                    problem = _row_problem(row, expected)
                    if problem:
                        raise CliError(f"the dump is damaged: {path} line {n}: {problem}")
                    rows.append(row)
    counted = (manifest.get("counts") or {}).get(name)
    if files and isinstance(counted, int) and not isinstance(counted, bool):
        if len(rows) != counted:
            where = ", ".join(str(dump / f) for f in files)
            raise CliError(
                f"the dump is damaged: {where}: {len(rows)} {name} rows, dump.json counts "
                f"{counted} (cut short or changed since it was exported?)"
            )
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
