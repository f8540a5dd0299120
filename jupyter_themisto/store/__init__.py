"""The trajectory log: one SQLite database used by the kernel recorder, the server and the CLI."""

from .schema import SCHEMA_VERSION
from .trajectory_store import (
    EXECUTION_STATUSES,
    NAMESPACE_STATUSES,
    SNAPSHOT_STATUSES,
    STORE_ENV,
    StoreError,
    TrajectoryStore,
    blob_hash,
    default_store_path,
    resolve_store_path,
)

__all__ = [
    "EXECUTION_STATUSES",
    "NAMESPACE_STATUSES",
    "SCHEMA_VERSION",
    "SNAPSHOT_STATUSES",
    "STORE_ENV",
    "StoreError",
    "TrajectoryStore",
    "blob_hash",
    "default_store_path",
    "resolve_store_path",
]
