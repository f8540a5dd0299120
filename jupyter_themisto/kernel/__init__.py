"""Code that runs inside the kernel: the recorder extension (hooks, outputs, snapshots).

`%load_ext jupyter_themisto` (or `c.InteractiveShellApp.extensions = ["jupyter_themisto"]`)
calls `load_ipython_extension`; loading twice keeps the one recorder already registered.
"""

from __future__ import annotations

from typing import Any

from .recorder import ThemistoRecorder

__all__ = ["ThemistoRecorder", "get_recorder", "load_ipython_extension", "unload_ipython_extension"]

# One recorder per shell; kept here, not in the person's namespace.
_RECORDERS: dict[int, ThemistoRecorder] = {}


def get_recorder(shell: Any = None) -> ThemistoRecorder | None:
    """The recorder attached to `shell` (default: the running IPython), if loaded."""
    if shell is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            return None
    return _RECORDERS.get(id(shell)) if shell is not None else None


def load_ipython_extension(ipython: Any) -> None:
    recorder = _RECORDERS.get(id(ipython))
    if recorder is None:
        recorder = ThemistoRecorder(ipython)
        _RECORDERS[id(ipython)] = recorder
    recorder.register()
    from .magics import ThemistoMagics

    ipython.register_magics(ThemistoMagics(ipython, recorder=recorder))


def unload_ipython_extension(ipython: Any) -> None:
    recorder = _RECORDERS.pop(id(ipython), None)
    if recorder is not None:
        recorder.unregister()
