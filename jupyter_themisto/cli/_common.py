"""Helpers shared by the subcommands: opening the store, tables, one-line text."""

from __future__ import annotations

import argparse
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..console import CliError
from ..store import SCHEMA_VERSION, StoreError, TrajectoryStore, resolve_store_path


def store_path(args: argparse.Namespace) -> Path:
    # (absolute: `record` hands it to kernels that run in the notebooks' own folders)
    return resolve_store_path(args.store or None)


def open_store(args: argparse.Namespace, *, readonly: bool = True) -> TrajectoryStore:
    """The store named by --store / THEMISTO_STORE; a missing one is an error when reading.

    A store recorded by an older jupyter-themisto is migrated to this version's schema first
    (as the server or a recording kernel opening it would: migrations only add), else reading
    it would find columns missing.
    """
    path = store_path(args)
    if readonly and not path.exists():
        raise CliError(f"no trajectory store at {path} (record something first, or pass --store)")
    try:
        store = TrajectoryStore(path, readonly=readonly)
        version = store.schema_version()
        if readonly and version < SCHEMA_VERSION:
            store.close()
            _migrate(path, version)
            store = TrajectoryStore(path, readonly=True)
        return store
    except (StoreError, RuntimeError) as e:
        raise CliError(str(e)) from e
    except sqlite3.Error as e:
        raise CliError(f"cannot read the trajectory store {path}: {e}") from e


def _migrate(path: Path, version: int) -> None:
    try:
        TrajectoryStore(path).close()
    except (StoreError, RuntimeError, sqlite3.Error) as e:
        raise CliError(
            f"the trajectory store {path} has schema version {version}, older than this "
            f"jupyter-themisto's ({SCHEMA_VERSION}), and could not be migrated ({e}): run the "
            "command again once the store can be written"
        ) from e


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table with aligned columns."""
    cells = [[("" if v is None else str(v)) for v in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, v in enumerate(r):
            widths[i] = max(widths[i], len(v))
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line.rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(out)


def one_line(text: str, limit: int = 60) -> str:
    """Text squeezed onto one line, cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
