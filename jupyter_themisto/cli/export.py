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
from pathlib import Path
from typing import Any

from .. import redaction
from ..console import CliError
from ..dump import DEFAULT_SHARD_ROWS, FORMATS, SNAPSHOT_MODES, export_dump
from ._common import open_store
from .listing import resolve_trajectory


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
    p.add_argument(
        "--allow-unfollowed-secrets",
        action="store_true",
        help="export even when values the kernels recorded as secret cannot be followed (the"
        " store's key file missing, damaged or replaced); refused otherwise",
    )
    p.add_argument(
        "--notebook-root",
        metavar="DIR",
        default=None,
        help="the Jupyter server's root folder: notebooks a server recorded are named relative"
        " to it (read from DIR for the dump's notebook_cells; without it they are left out,"
        " with a warning)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export in DIR (refused if DIR holds anything else, such as"
        " evaluate's results: nothing of yours is deleted)",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise CliError(f"unknown format {args.format!r}: expected one of {', '.join(FORMATS)}")
    if args.snapshots not in SNAPSHOT_MODES:
        raise CliError(
            f"unknown --snapshots {args.snapshots!r}: expected one of {', '.join(SNAPSHOT_MODES)}"
        )
    if args.shard_rows < 1:
        raise CliError(f"--shard-rows must be at least 1 (got {args.shard_rows})")
    if args.secret_pattern is not None:
        try:
            redaction.compile_pattern(args.secret_pattern)
        except ValueError as e:
            raise CliError(str(e)) from e
    notebook_root = None
    if args.notebook_root is not None:
        notebook_root = Path(args.notebook_root).expanduser().resolve()
        if not notebook_root.is_dir():
            raise CliError(f"--notebook-root {args.notebook_root}: no such folder")
    store = open_store(args)
    key = redaction.load_key(store.path, create=False)
    problem = redaction.key_problem(store.path, key, store.secret_digests())
    if problem is not None and not args.allow_unfollowed_secrets:
        # A value printed in one notebook and bound to a secret name in another is scrubbed
        # from the first only by its hash: without the key it would be exported as printed.
        raise CliError(
            f"not exported: the trajectory store {store.path}: {problem}. A value one notebook"
            " printed before another bound it to a secret name would be exported as printed."
            " Put the key back beside the store, or pass --allow-unfollowed-secrets"
        )
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
        notebook_root=notebook_root,
    )
    print(
        f"exported {summary['counts']['executions']} executions of "
        f"{summary['counts']['trajectories']} trajectories "
        f"({summary['counts']['next_cell']} next-cell and {summary['counts']['output']} output "
        f"instances) to {args.out}"
    )
    return 0
