"""Writing a benchmark dump from a trajectory store: the execution rows (redacted again by the
secrets policy, jupyter_themisto.redaction), the trajectories, the notebooks' cells and the task
instances, as JSON Lines or Parquet shards, with the manifest, the JSON schema and the dataset
card. The folder is built under a temporary name and renamed when complete; its files and
folders get the modes the umask gives.

Every string is written as valid UTF-8: a lone surrogate, which outputs in a store recorded
before the recorder replaced them may hold, is written as the frontend showed it, U+FFFD
(`kernel.outputs.as_sent`), rather than failing the export.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import redaction
from .._version import __version__
from ..console import CliError, progress
from ..context import outputs_problem, outputs_to_text
from ..files import atomic_dir, write_json
from ..kernel.outputs import as_sent
from .schema import (
    BLOB_KEY,
    DEFAULT_SHARD_ROWS,
    DUMP_VERSION,
    EXECUTION_FIELDS,
    NOTEBOOK_CELL_FIELDS,
    TASK_FIELDS,
    TRAJECTORY_FIELDS,
    arrow_schema,
    dataset_card,
    json_schema,
    notebook_cell_id,
)


def _encodable(value: Any) -> Any:
    """A row value (strings, nested lists and dicts) with every string `as_sent`."""
    if isinstance(value, str):
        return as_sent(value)
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    return value


def _warn(message: str) -> None:
    """A warning on stderr, on its own line below a progress bar."""
    from tqdm import tqdm

    tqdm.write(f"jupyter-themisto: warning: {message}", file=sys.stderr)


def _blob_refs(outputs: Iterable[dict[str, Any]]) -> list[str]:
    refs: list[str] = []
    for out in outputs:
        data = out.get("data")
        if isinstance(data, dict):
            for value in data.values():
                if isinstance(value, dict) and BLOB_KEY in value:
                    refs.append(str(value[BLOB_KEY]))
    return refs


def execution_rows(
    store: Any,
    trajectory: dict[str, Any],
    snapshots: str,
    pattern: str | None,
    redactor: redaction.StoreRedactor | None = None,
) -> Iterator[dict[str, Any]]:
    """Export rows of one trajectory, redacted (with --snapshots full, a variable whose
    serialized value holds a secret loses it too)."""
    if redactor is None:
        redactor = redaction.StoreRedactor(store, pattern)
        redactor.refresh()
    blob_checked: dict[str, bool] = {}

    def blob_holds_secret(digest: str) -> bool:
        if digest not in blob_checked:
            try:
                blob_checked[digest] = redactor.blob_holds_secret(store.get_blob(digest))
            except KeyError:
                blob_checked[digest] = False
        return blob_checked[digest]

    for e in store.list_executions(trajectory["id"]):
        problem = outputs_problem(e["outputs"])
        if problem is not None:
            _warn(
                f"execution {e['id']} (trajectory {trajectory['id']}, order {e['order_index']})"
                f" has damaged outputs in the store ({problem}): exported with none"
            )
            e["outputs"] = []
        snap = store.get_snapshot(e["id"]) if snapshots != "none" else None
        variables = store.get_variables(e["id"]) if snap else []
        row = {
            "trajectory_id": trajectory["id"],
            "notebook_path": trajectory.get("notebook_path"),
            "execution_id": e["id"],
            "order_index": e["order_index"],
            "cell_id": e.get("cell_id"),
            "msg_id": e.get("msg_id"),
            "execution_count": e.get("execution_count"),
            "source": e["source"],
            "output_text": "",  # from the scrubbed outputs, below
            "outputs": e["outputs"],
            "output_blobs": _blob_refs(e["outputs"]),
            "status": e["status"],
            "detail": e.get("detail"),
            "started_at": e.get("started_at"),
            "wall_time": e.get("wall_time"),
            "cpu_time": e.get("cpu_time"),
            "memory_before": e.get("memory_before"),
            "memory_after": e.get("memory_after"),
            "memory_peak": e.get("memory_peak"),
            "snapshot_status": e.get("snapshot_status") or "none",
            "snapshot_mode": snap.get("mode") if snap else None,
            "snapshot_duration": snap.get("duration") if snap else None,
            "snapshot_detail": snap.get("detail") if snap else None,
            "variables": [
                {
                    "name": v["name"],
                    "type": v["type"],
                    "size": v.get("size"),
                    "summary": v.get("summary") or {},
                    "blob_hash": v.get("blob_hash"),
                    "fingerprint": v.get("fingerprint"),
                    "stub_reason": v.get("stub_reason"),
                    "changed": bool(v.get("changed", True)),
                }
                for v in variables
            ],
        }
        row = redactor.scrub_export_row(row)
        row["output_text"] = outputs_to_text(row["outputs"], limit=1 << 40)
        row["outputs"] = json.dumps(row["outputs"], ensure_ascii=False)
        for i, v in enumerate(row["variables"]):
            if snapshots == "full" and v["blob_hash"] and blob_holds_secret(v["blob_hash"]):
                v = row["variables"][i] = redaction.stub_variable(v, redaction.SECRET_VALUE_REASON)
            v["summary"] = json.dumps(v["summary"], ensure_ascii=False, default=str)
        yield row


def notebook_file(trajectory: dict[str, Any], notebook_root: Path | None) -> Path | None:
    """The file of a trajectory's notebook: its recorded path, absolute as `record` records
    it, or relative to the Jupyter server's root as a server's kernel records it (resolved
    against `notebook_root`; never against the current directory, which would attach whatever
    notebook of that name lies there). None without a path, or a relative one and no root."""
    path = trajectory.get("notebook_path")
    if not path:
        return None
    file = Path(path)
    if file.is_absolute():
        return file
    return notebook_root / file if notebook_root is not None else None


def notebook_cell_rows(
    trajectory: dict[str, Any],
    redactor: redaction.StoreRedactor,
    notebook_root: Path | None = None,
    missing: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The cells of a trajectory's notebook file (what the browser has beside the executions),
    scrubbed as a prediction context is (the store's keyed hashes too: a value a kernel knew
    secret, written in a markdown cell); none when the file is gone or unreadable (the live
    setting then lacks them), which is then said in `missing` (one line per trajectory) when
    given."""
    import nbformat

    recorded = trajectory.get("notebook_path")
    if not recorded:
        return []  # (a console or script kernel: no notebook to offer)
    path = notebook_file(trajectory, notebook_root)
    if path is None:
        if missing is not None:
            missing.append(f"{trajectory['id']} ({recorded}: relative to the server's root)")
        return []
    if not path.is_file():
        if missing is not None:
            missing.append(f"{trajectory['id']} ({path}: not found)")
        return []
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook just has no cells to offer
        if missing is not None:
            missing.append(f"{trajectory['id']} ({path}: unreadable, {type(e).__name__})")
        return []
    sources = []
    for cell in nb.cells:
        source = cell.get("source") or ""
        sources.append("".join(source) if isinstance(source, list) else str(source))
    return [
        {
            "trajectory_id": trajectory["id"],
            "position": position,
            "cell_id": notebook_cell_id(cell, position),
            "cell_type": str(cell.get("cell_type") or "code"),
            "source": source,
        }
        for position, (cell, source) in enumerate(
            zip(nb.cells, redactor.scrub_texts(sources), strict=True)
        )
    ]


def _missing_notebooks(missing: list[str], notebook_root: Path | None) -> str:
    """The warning naming the trajectories whose notebook cells are not in the dump."""
    shown = "; ".join(missing[:5]) + (f"; and {len(missing) - 5} more" if len(missing) > 5 else "")
    hint = ""
    if notebook_root is None and any("relative to the server's root" in m for m in missing):
        hint = (
            " (a notebook recorded by a Jupyter server is named relative to the server's root:"
            " pass --notebook-root DIR, that root)"
        )
    some = f"{len(missing)} trajector{'y' if len(missing) == 1 else 'ies'}"
    return (
        f"no notebook_cells for {some}, the notebook not found (the live setting lacks those"
        f" cells): {shown}{hint}"
    )


def task_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(next-cell, output) instances of one trajectory's rows (in order).

    Next-cell: every execution after the first whose source is not blank; output: every
    execution with a non-empty text output (as the Themisto authors, empty targets are left
    out: they say nothing about a model).
    """
    next_cell: list[dict[str, Any]] = []
    output: list[dict[str, Any]] = []
    for k, r in enumerate(rows):
        base = {
            "trajectory_id": r["trajectory_id"],
            "order_index": r["order_index"],
            "n_context": k,
            "cell_id": r["cell_id"],
        }
        if k >= 1 and r["source"].strip():
            next_cell.append(
                {
                    "id": f"next-cell/{r['trajectory_id']}/{r['order_index']}",
                    "task": "next-cell",
                    **base,
                    "source": "",
                    "target": r["source"],
                }
            )
        if r["output_text"].strip() and r["source"].strip():
            output.append(
                {
                    "id": f"output/{r['trajectory_id']}/{r['order_index']}",
                    "task": "output",
                    **base,
                    "source": r["source"],
                    "target": r["output_text"],
                }
            )
    return next_cell, output


class _TableWriter:
    """Rows to DIR/<name>.jsonl, or to DIR/<name>-NNNNN.parquet shards of `shard_rows`."""

    def __init__(self, folder: Path, name: str, fmt: str, fields: list, shard_rows: int) -> None:
        self.folder, self.name, self.fmt, self.fields = folder, name, fmt, fields
        self.shard_rows = max(1, shard_rows)
        self.buffer: list[dict[str, Any]] = []
        self.files: list[str] = []
        self.count = 0
        self._jsonl = None
        if fmt == "jsonl":
            self.files.append(f"{name}.jsonl")
            self._jsonl = open(folder / f"{name}.jsonl", "w", encoding="utf-8")  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        self.count += 1
        if self._jsonl is not None:
            # ensure_ascii=False leaves a lone surrogate as it is, inside a JSON string:
            # replacing it there keeps the line valid JSON (and valid UTF-8).
            line = as_sent(json.dumps(row, ensure_ascii=False, default=str))
            self._jsonl.write(line + "\n")
            return
        self.buffer.append(_encodable(row))
        if len(self.buffer) >= self.shard_rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = f"{self.name}-{len(self.files):05d}.parquet"
        table = pa.Table.from_pylist(self.buffer, schema=arrow_schema(self.fields))
        pq.write_table(table, self.folder / name, compression="zstd")
        self.files.append(name)
        self.buffer = []

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        elif self.buffer or not self.files:
            self._flush()


def check_replaceable(out: Path) -> None:
    """Raise CliError unless `out` may be replaced by a new export (`--force`): it is absent,
    empty, or an earlier export holding nothing but what an export writes. A folder of the
    person's files, or an export beside which `evaluate` wrote its results, is never deleted."""
    if out.is_symlink() or not out.is_dir() or not any(out.iterdir()):
        return  # (atomic_dir says what is wrong with a link or a file)
    try:
        manifest = json.loads((out / "dump.json").read_text(encoding="utf-8"))
        written = {name for names in manifest["files"].values() for name in names}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CliError(
            f"{out} is not an earlier export (it has no readable dump.json): --force replaces"
            " only an earlier export; name a new or empty folder"
        ) from None
    written |= {"dump.json", "schema.json", "README.md", "blobs"}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in written)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise CliError(
            f"{out} holds what an export did not write ({shown}): --force replaces only an"
            " earlier export; move those, or name another folder"
        )


def export_dump(
    store: Any,
    trajectories: list[dict[str, Any]],
    out: Path,
    *,
    fmt: str = "jsonl",
    snapshots: str = "summary",
    shard_rows: int = DEFAULT_SHARD_ROWS,
    pattern: str | None = None,
    force: bool = False,
    notebook_root: Path | None = None,
) -> dict[str, Any]:
    """Write the dump folder; returns its manifest. A trajectory's notebook recorded by a path
    relative to the server's root is read from `notebook_root`; the trajectories whose notebook
    could not be read are named in one warning on stderr."""
    total = sum(t["n_executions"] for t in trajectories)
    if force:
        check_replaceable(out)
    redactor = redaction.StoreRedactor(store, pattern)
    redactor.refresh()
    with atomic_dir(out, force=force) as tmp:
        writers = {
            "executions": _TableWriter(tmp, "executions", fmt, EXECUTION_FIELDS, shard_rows),
            "trajectories": _TableWriter(tmp, "trajectories", fmt, TRAJECTORY_FIELDS, shard_rows),
            "next_cell": _TableWriter(tmp, "next_cell", fmt, TASK_FIELDS, shard_rows),
            "output": _TableWriter(tmp, "output", fmt, TASK_FIELDS, shard_rows),
            "notebook_cells": _TableWriter(
                tmp, "notebook_cells", fmt, NOTEBOOK_CELL_FIELDS, shard_rows
            ),
        }
        blobs: set[str] = set()
        no_notebook: list[str] = []
        bar = progress(total, "export", unit="exec")
        try:
            for t in trajectories:
                writers["trajectories"].write(
                    {
                        "trajectory_id": t["id"],
                        "notebook_path": t.get("notebook_path"),
                        "kernel_id": t.get("kernel_id"),
                        "session_id": t.get("session_id"),
                        "started_at": t["started_at"],
                        "python_version": t.get("python_version"),
                        "packages": json.dumps(t.get("packages") or {}),
                        "host": json.dumps(t.get("host") or {}),
                        "n_executions": t["n_executions"],
                    }
                )
                rows = []
                for row in execution_rows(store, t, snapshots, pattern, redactor):
                    writers["executions"].write(row)
                    rows.append(row)
                    if snapshots == "full":
                        blobs.update(row["output_blobs"])
                        blobs.update(v["blob_hash"] for v in row["variables"] if v["blob_hash"])
                    bar.update(1)
                for r in notebook_cell_rows(t, redactor, notebook_root, no_notebook):
                    writers["notebook_cells"].write(r)
                next_cell, output = task_rows(rows)
                for r in next_cell:
                    writers["next_cell"].write(r)
                for r in output:
                    writers["output"].write(r)
        finally:
            bar.close()
            for w in writers.values():
                w.close()
        if no_notebook:
            _warn(_missing_notebooks(no_notebook, notebook_root))
        missing = 0
        if blobs:
            folder = tmp / "blobs"
            folder.mkdir()
            for digest in sorted(blobs):
                try:
                    data = store.get_blob(digest)
                except KeyError:
                    missing += 1  # a snapshot child killed mid-write: the row says so too
                    continue
                (folder / digest).write_bytes(data)
        manifest = {
            "dump_version": DUMP_VERSION,
            "generator": f"jupyter-themisto {__version__}",
            "created_at": time.time(),
            "format": fmt,
            "snapshots": snapshots,
            "secret_pattern": pattern or redaction.DEFAULT_SECRET_PATTERN,
            "counts": {
                "trajectories": writers["trajectories"].count,
                "executions": writers["executions"].count,
                "next_cell": writers["next_cell"].count,
                "output": writers["output"].count,
                "notebook_cells": writers["notebook_cells"].count,
                "blobs": len(blobs) - missing,
                "missing_blobs": missing,
            },
            "files": {name: w.files for name, w in writers.items()},
        }
        write_json(tmp / "dump.json", manifest)
        write_json(
            tmp / "schema.json",
            {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "title": "jupyter-themisto benchmark dump",
                "dump_version": DUMP_VERSION,
                "tables": {
                    "executions": json_schema(EXECUTION_FIELDS, "execution"),
                    "trajectories": json_schema(TRAJECTORY_FIELDS, "trajectory"),
                    "next_cell": json_schema(TASK_FIELDS, "next-cell instance"),
                    "output": json_schema(TASK_FIELDS, "output instance"),
                    "notebook_cells": json_schema(NOTEBOOK_CELL_FIELDS, "notebook cell"),
                },
            },
        )
        (tmp / "README.md").write_text(dataset_card(manifest), encoding="utf-8")
    return manifest
