"""`jupyter themisto export --out DIR`: the benchmark dump of recorded trajectories.

Writes one row per execution with everything recorded, the trajectories, and task instances
in the Themisto framing (next-cell and output), as JSON Lines or Parquet shards, with a dataset
card (DIR/README.md), a JSON schema (DIR/schema.json) and a manifest (DIR/dump.json). The
secrets policy (jupyter_themisto.redaction) is applied again: literals bound to secret names,
credential-shaped strings and the values the kernels recorded as secret (by keyed hash) are
scrubbed from sources and outputs, and secret variables (or variables holding a secret value)
lose their values, so a dump is safe to share even from a store recorded with a looser policy.
The folder is built under a temporary name and renamed when complete; its files and folders
get the modes the umask gives.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import redaction
from .._version import __version__
from ..context import outputs_to_text
from ._common import CliError, atomic_dir, notebook_cell_id, open_store, progress, write_json
from .listing import resolve_trajectory

DUMP_VERSION = 1
FORMATS = ("jsonl", "parquet")
SNAPSHOT_MODES = ("none", "summary", "full")
DEFAULT_SHARD_ROWS = 20_000
BLOB_KEY = "themisto_blob"

# (name, JSON schema type, Arrow type name, description): one table drives the Parquet schema,
# the JSON schema and the dataset card, so they cannot disagree.
_VARIABLE_FIELDS: list[tuple[str, Any, str, str]] = [
    ("name", "string", "string", "variable name in the kernel's namespace"),
    ("type", "string", "string", "type name (builtins bare, others module-qualified)"),
    ("size", ["integer", "null"], "int64", "bytes serialized (or estimated); null if unknown"),
    ("summary", "string", "string", "JSON object: len / shape / dtype / columns / short repr"),
    ("blob_hash", ["string", "null"], "string", "sha256 of the serialized value (blobs/<hash>)"),
    ("fingerprint", ["string", "null"], "string", "cheap change detector used by the recorder"),
    ("stub_reason", ["string", "null"], "string", "why the value was not serialized, if so"),
    ("changed", "boolean", "bool", "the value differs from the previous snapshot's"),
]

EXECUTION_FIELDS: list[tuple[str, Any, str, str]] = [
    ("trajectory_id", "string", "string", "the trajectory (one kernel session) it belongs to"),
    ("notebook_path", ["string", "null"], "string", "notebook the trajectory was recorded in"),
    ("execution_id", "integer", "int64", "the execution's id in the store it was exported from"),
    ("order_index", "integer", "int64", "position in the trajectory: the order the cells ran"),
    ("cell_id", ["string", "null"], "string", "nbformat cell id of the executed cell"),
    ("msg_id", ["string", "null"], "string", "the kernel execute_request's msg_id"),
    ("execution_count", ["integer", "null"], "int64", "the kernel's In[n] number"),
    ("source", "string", "string", "the code that ran (secret literals redacted)"),
    ("output_text", "string", "string", "what a person reads: streams, text/plain, errors"),
    (
        "outputs",
        "string",
        "string",
        "JSON list of nbformat output dicts (MIME bundles); large binary values are "
        '{"themisto_blob": <sha256>, "bytes": n, "encoding": "base64"} references',
    ),
    (
        "output_blobs",
        {"type": "array", "items": {"type": "string"}},
        "list<string>",
        "hashes of the blobs the outputs reference (written to blobs/ with --snapshots full)",
    ),
    ("status", "string", "string", "ok | error | interrupted | lost"),
    (
        "detail",
        ["string", "null"],
        "string",
        "why a 'lost' execution could not be recorded when it ran (it has no outputs)",
    ),
    ("started_at", ["number", "null"], "float64", "Unix time the cell started"),
    ("wall_time", ["number", "null"], "float64", "seconds of wall-clock time"),
    ("cpu_time", ["number", "null"], "float64", "seconds of kernel CPU time"),
    ("memory_before", ["integer", "null"], "int64", "kernel RSS bytes before the cell"),
    ("memory_after", ["integer", "null"], "int64", "kernel RSS bytes after the cell"),
    ("memory_peak", ["integer", "null"], "int64", "peak kernel RSS bytes during the cell"),
    (
        "snapshot_status",
        "string",
        "string",
        "ok | partial | unchanged (variables: those of an earlier snapshot) | coalesced (none: a "
        "later cell's snapshot holds the state) | skipped | failed | off | none | pending",
    ),
    ("snapshot_mode", ["string", "null"], "string", "fork | inline (null without a snapshot)"),
    ("snapshot_duration", ["number", "null"], "float64", "seconds spent serializing"),
    ("snapshot_detail", ["string", "null"], "string", "why a snapshot was skipped or failed"),
    (
        "variables",
        {"type": "array", "items": {"type": "object"}},
        "variables",
        "the namespace after the cell, one record per variable (empty with --snapshots none)",
    ),
]

TRAJECTORY_FIELDS: list[tuple[str, Any, str, str]] = [
    ("trajectory_id", "string", "string", "trajectory id"),
    ("notebook_path", ["string", "null"], "string", "notebook path"),
    ("kernel_id", ["string", "null"], "string", "Jupyter kernel id"),
    ("session_id", ["string", "null"], "string", "kernel session id"),
    ("started_at", "number", "float64", "Unix time the trajectory started"),
    ("python_version", ["string", "null"], "string", "the kernel's Python version"),
    ("packages", "string", "string", "JSON object: package name -> version"),
    ("host", "string", "string", "JSON object: hostname, platform, cpus, memory"),
    ("n_executions", "integer", "int64", "executions in the trajectory"),
]

NOTEBOOK_CELL_FIELDS: list[tuple[str, Any, str, str]] = [
    ("trajectory_id", "string", "string", "the trajectory whose notebook holds the cell"),
    ("position", "integer", "int64", "the cell's place in the notebook (0: the first)"),
    ("cell_id", ["string", "null"], "string", "nbformat cell id (executions name it as cell_id)"),
    ("cell_type", "string", "string", "code | markdown | raw"),
    ("source", "string", "string", "the cell's text as the notebook file holds it"),
]

TASK_FIELDS: list[tuple[str, Any, str, str]] = [
    ("id", "string", "string", "instance id: <task>/<trajectory_id>/<order_index>"),
    ("task", "string", "string", "next-cell | output"),
    ("trajectory_id", "string", "string", "the trajectory"),
    (
        "order_index",
        "integer",
        "int64",
        "the target execution; its context is every execution of the trajectory with a "
        "smaller order_index, in order (variables: the latest of those with a snapshot)",
    ),
    ("n_context", "integer", "int64", "number of prior executions (the context's length)"),
    ("cell_id", ["string", "null"], "string", "cell id of the target execution"),
    ("source", "string", "string", "output task: the cell whose output is predicted"),
    ("target", "string", "string", "the reference: next cell's source / the cell's output text"),
]


def _arrow_type(name: str) -> Any:
    import pyarrow as pa

    if name == "variables":
        return pa.list_(pa.struct([pa.field(n, _arrow_type(t)) for n, _, t, _ in _VARIABLE_FIELDS]))
    if name == "list<string>":
        return pa.list_(pa.string())
    return {
        "string": pa.string(),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
    }[name]


def arrow_schema(fields: list[tuple[str, Any, str, str]]) -> Any:
    import pyarrow as pa

    return pa.schema([pa.field(n, _arrow_type(t)) for n, _, t, _ in fields])


def json_schema(fields: list[tuple[str, Any, str, str]], title: str) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for name, jtype, _, desc in fields:
        if name == "variables":
            props[name] = {
                "type": "array",
                "description": desc,
                "items": json_schema(_VARIABLE_FIELDS, "variable"),
            }
        elif isinstance(jtype, dict):
            props[name] = {**jtype, "description": desc}
        else:
            props[name] = {"type": jtype, "description": desc}
    return {
        "title": title,
        "type": "object",
        "properties": props,
        "required": [n for n, *_ in fields],
    }


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a benchmark dump (executions, task instances, dataset card, schema)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to create")
    p.add_argument(
        "--trajectory", nargs="+", metavar="ID", default=None, help="only these (default: all)"
    )
    p.add_argument("--format", default="jsonl", help="jsonl (default) or parquet")
    p.add_argument(
        "--snapshots",
        default="summary",
        help="none: no variables; summary (default): variable summaries and blob hashes; "
        "full: also the blobs themselves under DIR/blobs/",
    )
    p.add_argument(
        "--shard-rows",
        type=int,
        default=DEFAULT_SHARD_ROWS,
        metavar="N",
        help=f"Parquet: rows per shard (default {DEFAULT_SHARD_ROWS})",
    )
    p.add_argument("--secret-pattern", default=None, help="override the secrets policy's regex")
    p.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    p.set_defaults(func=cmd_export)


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


def notebook_cell_rows(trajectory: dict[str, Any], pattern: str | None) -> list[dict[str, Any]]:
    """The cells of a trajectory's notebook file (what the browser has beside the executions),
    redacted; none when the file is gone or unreadable (the live setting then lacks them)."""
    import nbformat

    path = trajectory.get("notebook_path")
    if not path or not Path(path).is_file():
        return []
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001 - any unreadable notebook just has no cells to offer
        return []
    rows = []
    for position, cell in enumerate(nb.cells):
        source = cell.get("source") or ""
        source = "".join(source) if isinstance(source, list) else str(source)
        rows.append(
            {
                "trajectory_id": trajectory["id"],
                "position": position,
                "cell_id": notebook_cell_id(cell, position),
                "cell_type": str(cell.get("cell_type") or "code"),
                "source": redaction.redact_source(source, pattern),
            }
        )
    return rows


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
            self._jsonl.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            return
        self.buffer.append(row)
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


def cmd_export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise CliError(f"unknown format {args.format!r}: expected one of {', '.join(FORMATS)}")
    if args.snapshots not in SNAPSHOT_MODES:
        raise CliError(
            f"unknown --snapshots {args.snapshots!r}: expected one of {', '.join(SNAPSHOT_MODES)}"
        )
    if args.secret_pattern is not None:
        try:
            redaction.compile_pattern(args.secret_pattern)
        except ValueError as e:
            raise CliError(str(e)) from e
    store = open_store(args)
    if args.trajectory:
        trajectories = [resolve_trajectory(store, t) for t in args.trajectory]
    else:
        trajectories = list(reversed(store.list_trajectories()))  # oldest first
    total = sum(t["n_executions"] for t in trajectories)
    if total == 0:
        raise CliError(f"nothing to export: no recorded executions in {store.path}")
    summary = export_dump(
        store,
        trajectories,
        Path(args.out).expanduser(),
        fmt=args.format,
        snapshots=args.snapshots,
        shard_rows=args.shard_rows,
        pattern=args.secret_pattern,
        force=args.force,
    )
    print(
        f"exported {summary['counts']['executions']} executions of "
        f"{summary['counts']['trajectories']} trajectories "
        f"({summary['counts']['next_cell']} next-cell and {summary['counts']['output']} output "
        f"instances) to {args.out}"
    )
    return 0


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
) -> dict[str, Any]:
    """Write the dump folder; returns its manifest."""
    total = sum(t["n_executions"] for t in trajectories)
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
                for r in notebook_cell_rows(t, pattern):
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


def _field_table(fields: list[tuple[str, Any, str, str]]) -> str:
    lines = ["| field | type | description |", "|---|---|---|"]
    for name, _, arrow, desc in fields:
        lines.append(f"| `{name}` | {arrow.replace('<', '&lt;').replace('>', '&gt;')} | {desc} |")
    return "\n".join(lines)


def dataset_card(manifest: dict[str, Any]) -> str:
    """DIR/README.md: what the dump holds and how to load it."""
    fmt = manifest["format"]
    c = manifest["counts"]
    if fmt == "parquet":
        pattern = "{name}-*.parquet"
        load = (
            "```python\nimport pandas as pd\n"
            "from glob import glob\n"
            'shards = sorted(glob(f"{DIR}/executions-*.parquet"))\n'
            "executions = pd.concat(pd.read_parquet(p) for p in shards)\n\n"
            "from datasets import load_dataset\n"
            'ds = load_dataset("parquet", data_files={"test": f"{DIR}/next_cell-*.parquet"})\n```'
        )
    else:
        pattern = "{name}.jsonl"
        load = (
            "```python\nimport pandas as pd\n"
            'executions = pd.read_json(f"{DIR}/executions.jsonl", lines=True)\n\n'
            "from datasets import load_dataset\n"
            'ds = load_dataset("json", data_files={"test": f"{DIR}/next_cell.jsonl"})\n```'
        )
    return f"""# jupyter-themisto benchmark dump

Development trajectories of Jupyter notebooks: every cell execution in the order it ran, with
its outputs, time, memory and a summary of the kernel's namespace after it, plus task
instances in the framing of the Themisto benchmark (Grotov & Titov, 2025, "Themisto:
Jupyter-Based Runtime Benchmark"): **next-cell** prediction and **output** prediction.

Generated by {manifest["generator"]}; dump version {manifest["dump_version"]}; format `{fmt}`;
snapshots `{manifest["snapshots"]}`.

| table | rows | files |
|---|---|---|
| executions | {c["executions"]} | `{pattern.format(name="executions")}` |
| trajectories | {c["trajectories"]} | `{pattern.format(name="trajectories")}` |
| next_cell | {c["next_cell"]} | `{pattern.format(name="next_cell")}` |
| output | {c["output"]} | `{pattern.format(name="output")}` |
| notebook_cells | {c.get("notebook_cells", 0)} | `{pattern.format(name="notebook_cells")}` |

Blobs written: {c["blobs"]} (missing from the store: {c["missing_blobs"]}).

## Loading

{load}

`schema.json` holds a JSON schema of every table; `dump.json` the counts and the file list.

## Tasks

- **next-cell**: given every execution of the trajectory before `order_index` (in order; with
  runtime information, the variables of the latest of them that has a snapshot), predict the
  source of the execution at `order_index` (`target`). Instances start at the second
  execution; blank sources are left out.
- **output**: given the same context and the cell's `source`, predict its text output
  (`target`: streams, `text/plain` results and `Ename: evalue` lines of errors, as in
  `output_text`). Executions without text output are left out, as in Themisto.

The **live setting** (`evaluate --setting live`) adds what the browser sends at the moment
of the prediction, from `notebook_cells` (the notebook file's cells, as the trajectory's
executions name them by `cell_id`): the markdown cells above the target cell and the cells
below it. Trajectories whose notebook file was gone at export time have no such rows.

`jupyter themisto evaluate DIR --backend NAME --task next-cell|output` scores a backend on
them (exact match after whitespace normalization, ROUGE-L, chrF, BLEU, and for next-cell
JuICe's API-call precision/recall).

## Field names

The Themisto paper describes its data (cell source, output, execution time, memory,
serialized state per step) but its released files' column names were not available to this
generator; the names below are this project's store's (`trajectory_id`, `order_index`,
`source`, `outputs`, `wall_time`, `memory_*`), stable across dump versions.

## executions

{_field_table(EXECUTION_FIELDS)}

Each element of `variables`:

{_field_table(_VARIABLE_FIELDS)}

## trajectories

{_field_table(TRAJECTORY_FIELDS)}

## next_cell and output

{_field_table(TASK_FIELDS)}

## notebook_cells

{_field_table(NOTEBOOK_CELL_FIELDS)}

## Secrets

Exported with the secrets pattern `{manifest["secret_pattern"]}` (case-insensitive, matched
anywhere in a name): string literals bound to a matching name (`API_KEY = "…"`,
`{{"password": "…"}}`, `os.environ["TOKEN"] = "…"`) and credential-shaped strings (`sk-…`,
`ghp_…`, `AKIA…`, JWTs, PEM private keys, …) are replaced by `<redacted>` in sources and
outputs, and so is every value the recording kernels knew to be secret (bound to a matching
variable, dict key or environment variable). Matching variables, and variables whose value
holds a secret, keep only their name and type (no size, summary, blob or fingerprint). Check a
dump before publishing it all the same: a secret the kernel never saw bound to a secret name
(read from a file and printed, say) is in its output.

## Blobs

With `--snapshots full`, `blobs/<sha256>` holds the bytes a `blob_hash` or an output's
`themisto_blob` reference names: for variables, a pickle (protocol 5; `summary.codec` says
`pickle` or `dill`) — load only dumps you trust; for outputs, the decoded binary MIME value
(e.g. a PNG).
"""
