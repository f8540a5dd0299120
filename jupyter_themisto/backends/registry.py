"""Finds backends through the `jupyter_themisto.backends` entry-point group and builds them."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from .base import BackendEnv, BackendUnavailable, Predictor
from .settings import InvalidSettings, check_settings

ENTRY_POINT_GROUP = "jupyter_themisto.backends"


class UnknownBackend(LookupError):
    """No backend of that name is installed."""


def available_backends() -> dict[str, EntryPoint]:
    """Installed backends by name (not imported yet)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_backend_class(
    name: str, installed: Mapping[str, EntryPoint] | None = None
) -> type[Predictor]:
    """Import one backend's Predictor class (among `installed`, what `available_backends()`
    returned: each call of it reads every installed package's entry points, ~15 ms).

    Raises UnknownBackend if no such backend is installed, BackendUnavailable if it is
    installed but cannot be imported here (e.g. its optional dependencies are missing).
    """
    eps = available_backends() if installed is None else installed
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise UnknownBackend(f"unknown backend {name!r}; installed backends: {known}")
    try:
        cls = eps[name].load()
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} cannot be loaded: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Predictor)):
        raise BackendUnavailable(
            f"entry point {eps[name].value} for backend {name!r} is not a Predictor subclass"
        )
    return cls


def create_backend(
    name: str, config: dict[str, Any] | None = None, env: BackendEnv | None = None
) -> Predictor:
    """Build a backend by name with its own settings (InvalidSettings if it refuses them)."""
    return load_backend_class(name)(config, env)


def check_backend_settings(backend_settings: Mapping[str, Any]) -> list[str]:
    """What is wrong with a host's settings of every backend, by backend name: one message per
    backend whose settings it refuses (naming the setting), or that is not installed. A
    backend that cannot be imported here is left to say so when it is used."""
    problems = []
    installed = available_backends()
    for name, config in backend_settings.items():
        if name not in installed:
            known = ", ".join(sorted(installed)) or "none"
            problems.append(
                f"backend_settings names {name!r}, which is not an installed backend"
                f" (installed: {known})"
            )
            continue
        try:
            cls = load_backend_class(name)
            check_settings(name, cls.settings_model, config)
        except InvalidSettings as e:
            problems.append(str(e))
        except BackendUnavailable:
            continue
    return problems


def default_backend_name() -> str:
    """The backend a server uses when its configuration names none: `llamacpp` (the embedded
    code model) where its engine and model are installed (the `[llm]` extra), else
    `retrieval`, which needs nothing."""
    if "llamacpp" in available_backends():
        from .llamacpp import local_model_installed

        if local_model_installed():
            return "llamacpp"
    return "retrieval"
