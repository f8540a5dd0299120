"""jupyter-themisto: record notebook trajectories and predict the next cell and cell outputs.

This module stays light: the kernel loads it as an IPython extension, the server as a server
extension, and neither should pay for the other's imports.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

__all__ = ["__version__"]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext jupyter_themisto`: start recording this kernel's executions."""
    from .kernel import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .kernel import unload_ipython_extension as unload

    unload(ipython)


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .server.app import ThemistoExtensionApp

    return [{"module": "jupyter_themisto", "app": ThemistoExtensionApp}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "jupyter-themisto"}]
