"""The benchmark dump's format: its tables and their fields, as a Parquet (Arrow) schema, a JSON
schema and the dataset card (DIR/README.md) that documents them.

A dump is a folder: one table per file (`<name>.jsonl`) or per set of shards
(`<name>-NNNNN.parquet`), `dump.json` (the manifest: version, counts, files), `schema.json`,
`README.md` and, with `--snapshots full`, `blobs/<sha256>`. `writer` writes one, `reader` reads
one back.
"""

from __future__ import annotations

from typing import Any

DUMP_VERSION = 1
FORMATS = ("jsonl", "parquet")
SNAPSHOT_MODES = ("none", "summary", "full")
DEFAULT_SHARD_ROWS = 20_000
BLOB_KEY = "themisto_blob"
#: the table of each task's instances
TASK_TABLES = {"next-cell": "next_cell", "output": "output"}

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
below it. Trajectories whose notebook file was gone at export time have no such rows (nor do
those a Jupyter server recorded, by a path relative to its root, when exported without
`--notebook-root`).

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


def notebook_cell_id(cell: Any, position: int) -> str:
    """A cell's nbformat id, or for a notebook older than nbformat 4.5 (no ids) one made from
    its position, the same for `record` (which sends it with each execution) and `export`
    (which matches the notebook's cells to the executions by it)."""
    return str(cell.get("id") or f"position-{position}")
