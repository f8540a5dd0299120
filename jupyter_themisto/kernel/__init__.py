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
# A reload (%reload_ext) continues the kernel session's trajectory rather than starting one.
_TRAJECTORIES: dict[int, tuple[str, int]] = {}


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
        if id(ipython) in _TRAJECTORIES:
            recorder.trajectory_id, recorder.next_order = _TRAJECTORIES[id(ipython)]
        _RECORDERS[id(ipython)] = recorder
        # Lets `%config ThemistoRecorder.snapshot_mode = "inline"` reach it.
        configurables = getattr(ipython, "configurables", None)
        if isinstance(configurables, list):
            configurables.append(recorder)
    recorder.register()
    from .magics import ThemistoMagics

    ipython.register_magics(ThemistoMagics(ipython, recorder=recorder))


def unload_ipython_extension(ipython: Any) -> None:
    recorder = _RECORDERS.pop(id(ipython), None)
    if recorder is not None:
        recorder.unregister()
        if recorder.trajectory_id is not None:
            _TRAJECTORIES[id(ipython)] = (recorder.trajectory_id, recorder.next_order)
        configurables = getattr(ipython, "configurables", None)
        if isinstance(configurables, list) and recorder in configurables:
            configurables.remove(recorder)
