"""Prediction backends: the Predictor interface, the entry-point registry and built-in backends."""

from .base import (
    BackendEnv,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    NextCellChunk,
    NoPrediction,
    OutputChunk,
    Predictor,
    Task,
)
from .registry import (
    ENTRY_POINT_GROUP,
    UnknownBackend,
    available_backends,
    check_backend_settings,
    create_backend,
    default_backend_name,
    load_backend_class,
)
from .settings import BackendSettings, InvalidSettings, settings_schema

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendEnv",
    "BackendSettings",
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "InvalidSettings",
    "NextCellChunk",
    "NoPrediction",
    "OutputChunk",
    "Predictor",
    "Task",
    "UnknownBackend",
    "available_backends",
    "check_backend_settings",
    "create_backend",
    "default_backend_name",
    "load_backend_class",
    "settings_schema",
]
