"""The benchmark dump: its format (`schema`), writing one from a store (`writer`, used by
`jupyter themisto export`) and reading one back (`reader`, used by `jupyter themisto evaluate`
and the benchmarks).

A dump someone can fix (a missing folder, a bad manifest, a missing file) is reported as a
CliError (jupyter_themisto.console), as the atomic writes (jupyter_themisto.files) report theirs.
"""

from __future__ import annotations

from .reader import DumpContexts, read_manifest, read_table, train_store
from .schema import (
    DEFAULT_SHARD_ROWS,
    DUMP_VERSION,
    EXECUTION_FIELDS,
    FORMATS,
    NOTEBOOK_CELL_FIELDS,
    SNAPSHOT_MODES,
    TASK_FIELDS,
    TASK_TABLES,
    TRAJECTORY_FIELDS,
)
from .writer import export_dump

__all__ = [
    "DEFAULT_SHARD_ROWS",
    "DUMP_VERSION",
    "EXECUTION_FIELDS",
    "FORMATS",
    "NOTEBOOK_CELL_FIELDS",
    "SNAPSHOT_MODES",
    "TASK_FIELDS",
    "TASK_TABLES",
    "TRAJECTORY_FIELDS",
    "DumpContexts",
    "export_dump",
    "read_manifest",
    "read_table",
    "train_store",
]
