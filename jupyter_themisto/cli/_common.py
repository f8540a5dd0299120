"""Helpers shared by the subcommands: errors, opening the store, atomic writes, tables."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..store import StoreError, TrajectoryStore, default_store_path


class CliError(Exception):
    """Bad input or a failure the person can act on: one line on stderr, non-zero exit."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def store_path(args: argparse.Namespace) -> Path:
    return Path(args.store).expanduser() if args.store else default_store_path()


def open_store(args: argparse.Namespace, *, readonly: bool = True) -> TrajectoryStore:
    """The store named by --store / THEMISTO_STORE; a missing one is an error when reading."""
    path = store_path(args)
    if readonly and not path.exists():
        raise CliError(f"no trajectory store at {path} (record something first, or pass --store)")
    try:
        return TrajectoryStore(path, readonly=readonly)
    except (StoreError, RuntimeError) as e:
        raise CliError(str(e)) from e


def progress(total: int | None, desc: str, unit: str = "it", disable: bool = False) -> Any:
    """A tqdm bar on stderr (`disable` hides it)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable, leave=False)


def current_umask() -> int:
    """The process's umask (read without changing it where Linux says it; else set and reset)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[Any]:
    """Write `path` via a temporary file in the same folder, renamed on success only.

    The file gets the mode a plain `open()` would give it (0666 minus the umask): mkstemp's
    private 0600 would otherwise survive the rename.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    with atomic_file(path) as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")


@contextmanager
def atomic_dir(target: Path, *, force: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name beside `target`, renamed into place on success.

    An existing non-empty `target` is an error unless `force`, which replaces it only once the
    new folder is complete. The folder gets the mode `mkdir` would give it (0777 minus the
    umask), not mkdtemp's private 0700.
    """
    if target.exists() and not target.is_dir():
        raise CliError(f"{target} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise CliError(f"{target} already exists and is not empty (pass --force to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def notebook_cell_id(cell: Any, position: int) -> str:
    """A cell's nbformat id, or for a notebook older than nbformat 4.5 (no ids) one made from
    its position, the same for `record` (which sends it with each execution) and `export`
    (which matches the notebook's cells to the executions by it)."""
    return str(cell.get("id") or f"position-{position}")
