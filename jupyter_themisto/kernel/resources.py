"""Process resources around one cell: RSS before/after, per-cell peak RSS, and environment facts."""

from __future__ import annotations

import os
import platform
import re
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = "/proc/self/clear_refs"


def rss() -> int | None:
    """Resident set size of this process in bytes (cheap on Linux: one read of statm)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


class PeakTracker:
    """Peak RSS during a cell: reset VmHWM before it (Linux clear_refs), read it after.

    Where /proc/self/clear_refs cannot be written (some containers, macOS) the peak falls back
    to max(before, after), and `exact` says so.
    """

    def __init__(self) -> None:
        self.exact = os.path.exists(_CLEAR_REFS)

    def reset(self) -> None:
        if not self.exact:
            return
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            self.exact = False

    def peak(self, before: int | None, after: int | None) -> int | None:
        if self.exact:
            try:
                m = re.search(rb"VmHWM:\s+(\d+)\s+kB", _STATUS.read_bytes())
                if m:
                    return int(m.group(1)) * 1024
            except OSError:
                pass
        known = [v for v in (before, after) if v is not None]
        return max(known) if known else None


KEY_PACKAGES = (
    "ipykernel",
    "ipython",
    "jupyter_client",
    "jupyter-themisto",
    "numpy",
    "pandas",
    "scipy",
    "scikit-learn",
    "matplotlib",
    "torch",
    "tensorflow",
    "polars",
    "pyarrow",
    "dill",
)


def package_versions(names: tuple[str, ...] = KEY_PACKAGES) -> dict[str, str]:
    """Installed versions of the key packages that are present."""
    found: dict[str, str] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        except Exception:
            continue
    return found


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python_implementation": platform.python_implementation(),
        "pid": os.getpid(),
    }
    try:
        import psutil

        info["memory"] = int(psutil.virtual_memory().total)
    except Exception:
        pass
    return info


def python_version() -> str:
    return sys.version.split()[0]


def kernel_id_from_connection_file(path: str | None) -> str | None:
    """`kernel-<id>.json` (jupyter_client's naming) -> `<id>`; else the file's stem."""
    if not path:
        return None
    name = Path(path).name
    m = re.fullmatch(r"kernel-(.+)\.json", name)
    if m:
        return m.group(1)
    return Path(name).stem or None
