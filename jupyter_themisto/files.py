"""Files and folders written whole or not at all: built under a temporary name, renamed on success.

They get the modes a plain `open()` / `mkdir` would give them (the umask's), not the private
ones of mkstemp / mkdtemp.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .console import CliError


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
    new folder is complete; a symbolic link is an error (name what it points to). The folder
    gets the mode `mkdir` would give it (0777 minus the umask), not mkdtemp's private 0700.
    """
    if target.is_symlink():
        # (renamed into place, the new folder would replace the link, not what it points to)
        raise CliError(
            f"{target} is a symbolic link (to {os.readlink(target)}): name the folder itself"
        )
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
