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
)
from .registry import (
    ENTRY_POINT_GROUP,
    UnknownBackend,
    available_backends,
    create_backend,
    default_backend_name,
    load_backend_class,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendEnv",
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "NextCellChunk",
    "NoPrediction",
    "OutputChunk",
    "Predictor",
    "UnknownBackend",
    "available_backends",
    "create_backend",
    "default_backend_name",
    "load_backend_class",
]
