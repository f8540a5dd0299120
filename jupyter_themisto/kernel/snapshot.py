"""Namespace snapshots: per-variable summaries and content-addressed blobs after each execution.

What is snapshotted is what `%who` shows: the user namespace without names starting with `_`,
without IPython's own (hidden) names and without modules.

Per variable, in this order:

1. a name matching the secret pattern, a dict holding a secret-named key (one level deep), or
   a value, serialized bytes or summary holding a value known secret (jupyter_themisto.
   redaction.KernelSecrets: `x = api_key`, a list or DataFrame holding it)
   -> stub with the type only (no value, repr, fingerprint);
2. objects that must not or cannot be pickled -> stub (type, short repr, reason): file objects
   (pickling flushes them: in a forked child that writes the person's buffered data twice),
   sockets, locks, generators, coroutines, frames, tracebacks, modules inside containers,
   database connections; matplotlib figures/artists are *summarized* (their pickle differs
   every time, so content hashing cannot tell them unchanged);
3. a cheap fingerprint (xxh3 of an ndarray's buffer, of each DataFrame/Series column, of a
   str/bytes/number) equal to the previous snapshot's -> the previous blob is reused without
   serializing (`changed = false`);
4. an estimated size over `max_variable_bytes` -> summarized only ("too large");
5. pickle protocol 5, then dill only if pickle refused; both through a pickler that refuses the
   objects of (2) wherever they sit in a container, with a size bound (the pickler stops as
   soon as the output passes the bound) and a time bound (SIGALRM, main thread only);
6. the bytes go to the blob store under their sha256 (stored once however many steps reuse
   them); `changed` says whether the hash differs from the previous snapshot's.

5b. a variable without a cheap fingerprint that could not be serialized last time (too slow,
   too large, refused) and whose identity fingerprint (type, id, size, attributes' identities)
   is unchanged -> the previous stub again, not tried again (`changed = false`);

When (SnapshotManager): the snapshot of an execution is due once the row is handed to the
writer, and taken after `snapshot_delay` seconds of idleness; a cell that starts first takes
its place (the earlier execution is `coalesced`, noted in batches), except that one is taken
right after the reply when the last is older than `snapshot_max_deferral`. A silent request
(no cell hooks) takes a due snapshot before it runs. Before forking, the kernel compares the
namespace's bindings with those of the last snapshot and parses the cells run since
(kernel/changes.py): when nothing can have changed, the execution is `unchanged` (`same_as`
the execution whose snapshot holds the namespace) and no child is made. When every variable
that may have changed is small and serializing it runs none of the person's code (_small_value:
scalars, strings, small containers of them, arrays and plain frames under 1 MB, functions,
plain instances of their classes), the kernel takes the snapshot itself within
`small_snapshot_seconds` (its blobs and rows handed to the writer) instead of forking; past
that time it gives up and forks.

Snapshot status: `ok` (every variable serialized, unchanged or redacted), `partial` (some are
stubs or summaries), `unchanged`, `coalesced`, `skipped` (fork mode, `max_snapshot_children`
children still running after waiting `snapshot_slot_wait` seconds (default 0): this execution
is not snapshotted, `detail` says so — skipping rather than queueing, because a queued
snapshot would capture a later namespace than the execution it belongs to), `failed` (the
child died, was killed or ran past `max_snapshot_seconds`; `detail` says which).

Fork mode (default on Linux/macOS): the kernel takes the writer's fork lock (its background
thread is then outside SQLite), calls `gc.freeze()` (the kernel's collections then do not touch
the child's copy-on-write pages) and forks; its own store connection stays open (the child
never touches it). The child ignores SIGINT, leaves the kernel's process group (ipykernel
terminates that group's processes at shutdown; a snapshot should outlive the kernel by the
moment it needs), bounds its own CPU time (`max_snapshot_seconds`), lowers its priority
(nice 19), points fds 1 and 2 at /dev/null (ipykernel forwards a forked child's output into the
person's cell), disables gc (a collected file object would flush), opens its own connection,
waits for the execution's row if the writer has not written it yet, serializes and writes, and
leaves with `os._exit`. A thread per child (waiting on a pidfd) reaps it and marks its snapshot
`failed` with the reason if it died without writing one; gc is unfrozen once none is left.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import reprlib
import signal
import socket
import sqlite3
import sys
import threading
import time
import types
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..redaction import REDACTED_REASON, KernelSecrets, is_secret_name, stub_variable

# Exit codes of the snapshot child.
_CHILD_OK = 0
_CHILD_FAILED = 3
_CHILD_NO_ROW = 4  # the execution was never written (lost): nothing to attach a snapshot to
_CHILD_NICE = 19

_SMALL_CONTAINER = 1000


class _Refused(Exception):
    """An object the snapshot must not serialize; the message is the stub's reason."""


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


# -- what to refuse ---------------------------------------------------------------------------


def _refused_types() -> tuple[tuple[type, str], ...]:
    found: list[tuple[type, str]] = [
        (io.IOBase, "file object (never serialized: pickling one flushes it)"),
        (socket.socket, "socket"),
        (types.GeneratorType, "generator"),
        (types.CoroutineType, "coroutine"),
        (types.AsyncGeneratorType, "async generator"),
        (types.FrameType, "frame"),
        (types.TracebackType, "traceback"),
        (type(threading.Lock()), "lock"),
        (type(threading.RLock()), "lock"),
        (threading.Thread, "thread"),
    ]
    try:
        import sqlite3

        found.append((sqlite3.Connection, "database connection"))
        found.append((sqlite3.Cursor, "database cursor"))
    except ImportError:
        pass
    return tuple(found)


_REFUSED = _refused_types()
_REFUSED_TYPES = tuple(t for t, _ in _REFUSED)


def refusal(obj: Any, *, top_level: bool = True) -> str | None:
    """Why `obj` must not be serialized, or None."""
    if isinstance(obj, _REFUSED_TYPES):
        for t, reason in _REFUSED:
            if isinstance(obj, t):
                return reason
    if not top_level and isinstance(obj, types.ModuleType):
        return "contains a module"
    module = getattr(type(obj), "__module__", "") or ""
    if module.startswith("matplotlib") and "matplotlib" in sys.modules:
        try:
            from matplotlib.artist import Artist
            from matplotlib.figure import FigureBase

            if isinstance(obj, (Artist, FigureBase)):
                return "matplotlib object (summarized: its pickle differs every time)"
        except Exception:
            pass
    if module.startswith("zmq"):
        return "zmq object"
    return None


class _GuardedPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        reason = refusal(obj, top_level=False)
        if reason:
            raise _Refused(reason)
        return NotImplemented


def _dill_pickler() -> type:
    import dill

    class GuardedDillPickler(dill.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            reason = refusal(obj, top_level=False)
            if reason:
                raise _Refused(reason)
            return NotImplemented

    return GuardedDillPickler


class _BoundedSink:
    """A write-only file for the pickler that stops it once the bound is passed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        self.size += n
        if self.size > self.limit:
            raise _TooLarge(self.size)
        self.parts.append(bytes(data))
        return n

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


def serialize(value: Any, *, max_bytes: int) -> tuple[bytes, str]:
    """Bytes of `value` and the codec used ('pickle' or 'dill').

    Raises _Refused, _TooLarge, _TooSlow, or the serializer's own error when both refuse.
    """
    sink = _BoundedSink(max_bytes)
    try:
        _GuardedPickler(sink, protocol=5).dump(value)
        return sink.getvalue(), "pickle"
    except (_Refused, _TooLarge, _TooSlow):
        raise
    except RecursionError:
        raise
    except Exception as first:
        try:
            dill_pickler = _dill_pickler()
        except ImportError:
            raise first from None
        sink = _BoundedSink(max_bytes)
        dill_pickler(sink, protocol=5).dump(value)
        return sink.getvalue(), "dill"


class _time_limit:
    """SIGALRM-based time bound around pure-Python work (no-op off the main thread)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.active = False
        self.previous: Any = None

    def _fire(self, signum: int, frame: Any) -> None:
        raise _TooSlow()

    def __enter__(self) -> _time_limit:
        if (
            self.seconds > 0
            and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
        ):
            previous = signal.getsignal(signal.SIGALRM)
            # Never take over an alarm the person set for their own code.
            if previous in (signal.SIG_DFL, signal.SIG_IGN, None) and signal.getitimer(
                signal.ITIMER_REAL
            ) == (0.0, 0.0):
                self.previous = previous
                signal.signal(signal.SIGALRM, self._fire)
                signal.setitimer(signal.ITIMER_REAL, self.seconds)
                self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous or signal.SIG_DFL)


# -- namespace, summaries, fingerprints -------------------------------------------------------


def user_variables(shell: Any) -> Iterator[tuple[str, Any]]:
    """(name, value) of the person's variables, as `%who` lists them, minus modules."""
    ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    missing = object()
    for name, value in list(ns.items()):
        if name.startswith("_"):
            continue
        if hidden.get(name, missing) is value:
            continue
        if isinstance(value, types.ModuleType):
            continue
        yield name, value


def type_name(value: Any) -> str:
    t = type(value)
    module = getattr(t, "__module__", None)
    name = getattr(t, "__qualname__", t.__name__)
    return name if module in (None, "builtins") else f"{module}.{name}"


def _short_repr(value: Any, limit: int) -> str:
    r = reprlib.Repr()
    r.maxstring = limit
    r.maxother = limit
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 10
    r.maxdict = 10
    try:
        text = r.repr(value)
    except Exception as e:
        return f"<repr failed: {type(e).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def estimated_size(value: Any) -> int | None:
    """Bytes the value holds, where it is cheap to know (arrays, frames, buffers)."""
    try:
        if isinstance(value, (bytes, bytearray, str)):
            return len(value)
        mod = type(value).__module__ or ""
        if mod.startswith("numpy") and hasattr(value, "nbytes"):
            return int(value.nbytes)
        if mod.startswith("pandas"):
            usage = getattr(value, "memory_usage", None)
            if usage is not None:
                u = usage(index=True, deep=False)
                return int(u.sum()) if hasattr(u, "sum") else int(u)
        return None
    except Exception:
        return None


def summarize(value: Any, max_repr: int) -> dict[str, Any]:
    """Cheap facts about a value: len, shape, dtype, DataFrame columns and dtypes, short repr."""
    s: dict[str, Any] = {}
    mod = type(value).__module__ or ""
    try:
        if isinstance(value, (list, tuple, dict, set, frozenset, str, bytes, bytearray)):
            s["len"] = len(value)
        if mod.startswith("numpy") and hasattr(value, "shape") and hasattr(value, "dtype"):
            s["shape"] = list(value.shape)
            s["dtype"] = str(value.dtype)
            if hasattr(value, "__len__") and getattr(value, "ndim", 0) > 0:
                s["len"] = len(value)
        elif mod.startswith("pandas"):
            if hasattr(value, "shape"):
                s["shape"] = list(value.shape)
                s["len"] = int(value.shape[0]) if value.shape else None
            if hasattr(value, "columns") and hasattr(value, "dtypes"):
                cols = list(value.columns[:100])
                s["columns"] = [str(c) for c in cols]
                dtypes = value.dtypes
                s["dtypes"] = {str(c): str(dtypes.iloc[i]) for i, c in enumerate(cols)}
                if len(value.columns) > 100:
                    s["columns_omitted"] = len(value.columns) - 100
            elif hasattr(value, "dtype"):
                s["dtype"] = str(value.dtype)
                if getattr(value, "name", None) is not None:
                    s["name"] = str(value.name)
    except Exception:
        pass
    s["repr"] = _short_repr(value, max_repr)
    return s


def fingerprint(value: Any) -> str | None:
    """A cheap change detector (xxh3-128), or None when only serializing can tell."""
    try:
        import xxhash
    except ImportError:
        return None
    try:
        h = _fingerprint(value, xxhash)
    except Exception:
        return None
    return None if h is None else f"{type_name(value)}:{h}"


def _fingerprint(value: Any, xxhash: Any) -> str | None:
    t = type(value)
    if value is None or t in (bool, int, float, complex):
        return xxhash.xxh3_128_hexdigest(repr(value).encode())
    if t is str:
        return xxhash.xxh3_128_hexdigest(value.encode("utf-8", "surrogatepass"))
    if t is bytes:
        return xxhash.xxh3_128_hexdigest(value)
    if t in (tuple, frozenset) and len(value) <= _SMALL_CONTAINER:
        items = sorted(value, key=repr) if t is frozenset else value
        parts = []
        for item in items:
            sub = _fingerprint(item, xxhash)
            if sub is None:
                return None
            parts.append(sub)
        return xxhash.xxh3_128_hexdigest("|".join(parts).encode())
    mod = t.__module__ or ""
    if mod.startswith("numpy") and t.__name__ == "ndarray":
        return _array_fingerprint(value, xxhash)
    if mod.startswith("pandas"):
        return _pandas_fingerprint(value, xxhash)
    return None


def _xxh3(data: bytes) -> str:
    try:
        import xxhash

        return xxhash.xxh3_128_hexdigest(data)
    except ImportError:
        import hashlib

        return hashlib.blake2b(data, digest_size=16).hexdigest()


def _array_fingerprint(a: Any, xxhash: Any) -> str | None:
    import numpy as np

    if a.dtype.hasobject:
        return None
    h = xxhash.xxh3_128()
    h.update(f"{a.dtype.str}{a.shape}".encode())
    buf = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    h.update(buf.reshape(-1).view(np.uint8).data if buf.size else b"")
    return h.hexdigest()


def _pandas_fingerprint(value: Any, xxhash: Any) -> str | None:
    import numpy as np
    import pandas as pd

    def column_hash(col: Any) -> str | None:
        dtype = col.dtype
        if isinstance(dtype, np.dtype) and not dtype.hasobject:
            # A numpy-backed column: its buffer, without a copy.
            return _array_fingerprint(col.to_numpy(), xxhash)
        arrow = _arrow_fingerprint(col, xxhash)
        if arrow is not None:
            return arrow
        hashed = pd.util.hash_pandas_object(col, index=False).to_numpy()
        return _array_fingerprint(hashed, xxhash)

    def index_hash(index: Any) -> str | None:
        if isinstance(index, pd.RangeIndex):
            return repr(index)
        return _array_fingerprint(pd.util.hash_pandas_object(index).to_numpy(), xxhash)

    h = xxhash.xxh3_128()
    if isinstance(value, pd.DataFrame):
        h.update(repr(list(value.columns)).encode())
        h.update(repr([str(d) for d in value.dtypes]).encode())
        h.update(str(index_hash(value.index)).encode())
        for _, col in value.items():
            part = column_hash(col)
            if part is None:
                return None
            h.update(part.encode())
        return h.hexdigest()
    if isinstance(value, pd.Series):
        h.update(f"{value.name!r}{value.dtype}".encode())
        h.update(str(index_hash(value.index)).encode())
        part = column_hash(value)
        if part is None:
            return None
        h.update(part.encode())
        return h.hexdigest()
    return None


def _arrow_fingerprint(col: Any, xxhash: Any) -> str | None:
    """Hash of an Arrow-backed column's buffers (pandas' string dtype): no per-element work."""
    if not hasattr(col.array, "__arrow_array__") or "pyarrow" not in sys.modules:
        return None
    try:
        import pyarrow as pa

        # The extension array's own Arrow data (zero-copy), never an element-wise conversion.
        chunked = col.array.__arrow_array__()
        if isinstance(chunked, pa.Array):
            chunked = pa.chunked_array([chunked])
        if not isinstance(chunked, pa.ChunkedArray):
            return None
    except Exception:
        return None
    h = xxhash.xxh3_128()
    h.update(str(chunked.type).encode())
    for chunk in chunked.chunks:
        h.update(f"{chunk.offset}:{len(chunk)}".encode())
        for buf in chunk.buffers():
            h.update(b"-" if buf is None else memoryview(buf))
    return h.hexdigest()


# Stub reasons worth remembering: trying again costs the same and fails the same way.
_EXPENSIVE = ("too slow", "too large", "unpicklable")


def identity_fingerprint(value: Any) -> str:
    """A cheap guess that an object is unchanged: its type, identity and size, the identities of
    its attributes (or of a container's first and last items). For objects that a snapshot
    could not serialize (too slow, too large, refused): they are not tried again while this
    stays the same."""
    parts = [type_name(value), str(id(value))]
    try:
        parts.append(str(sys.getsizeof(value)))
        if isinstance(value, (list, tuple, dict, set, frozenset, str, bytes, bytearray)):
            parts.append(str(len(value)))
            if isinstance(value, (list, tuple)):
                ends = [*value[:8], *value[-8:]]
                parts.append(",".join(str(id(v)) for v in ends))
            elif isinstance(value, dict):
                parts.append(",".join(f"{id(k)}:{id(v)}" for k, v in list(value.items())[:16]))
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and len(attrs) <= 1000:
            parts.append(",".join(f"{k}:{id(v)}" for k, v in attrs.items()))
    except Exception:
        pass
    return "ident:" + _xxh3("|".join(parts).encode("utf-8", "surrogatepass"))


def _secret_key_in(value: Any, pattern: str | None) -> str | None:
    """A secret-named string key of a mapping (one level deep: `{"db": {"password": ..}}`)."""
    if not isinstance(value, dict) or len(value) > 10 * _SMALL_CONTAINER:
        return None
    for key, item in value.items():
        if isinstance(key, str) and is_secret_name(key, pattern):
            return key
        if isinstance(item, dict) and len(item) <= _SMALL_CONTAINER:
            for sub in item:
                if isinstance(sub, str) and is_secret_name(sub, pattern):
                    return f"{key}.{sub}"
    return None


# -- writing a snapshot ------------------------------------------------------------------------


def snapshot_status(records: list[dict[str, Any]]) -> str:
    """`ok` when every variable has its value stored (or was redacted), else `partial`."""
    complete = all(
        r.get("blob_hash") or str(r.get("stub_reason") or "").startswith("redacted")
        for r in records
    )
    return "ok" if complete else "partial"


class SnapshotWriter:
    """Serializes one namespace into the store (used in the fork child and in inline mode)."""

    def __init__(
        self,
        store: Any,
        trajectory_id: str,
        *,
        secret_pattern: str | None,
        max_variable_bytes: int,
        max_variable_seconds: float,
        max_repr_chars: int,
        secrets: KernelSecrets | None = None,
        recheck: bool = False,
        put_blob: Callable[[bytes], str] | None = None,
    ) -> None:
        self.store = store
        # Where serialized values go (the store; a snapshot the kernel takes itself collects
        # them first and writes them with its rows).
        self.put_blob = put_blob or store.put_blob
        self.secrets = secrets
        # Values learnt secret since the last snapshot: nothing is reused unseen.
        self.recheck = recheck
        self.trajectory_id = trajectory_id
        self.secret_pattern = secret_pattern
        self.max_variable_bytes = max_variable_bytes
        self.max_variable_seconds = max_variable_seconds
        self.max_repr_chars = max_repr_chars

    def previous(self) -> dict[str, dict[str, Any]]:
        try:
            return {v["name"]: v for v in self.store.latest_variables(self.trajectory_id)}
        except Exception:
            return {}

    def write(
        self, execution_id: int, variables: list[tuple[str, Any]], *, mode: str
    ) -> tuple[int, str]:
        t0 = time.perf_counter()
        previous = self.previous()
        records = [self.record(name, value, previous.get(name)) for name, value in variables]
        status = snapshot_status(records)
        sid = self.store.write_snapshot(
            execution_id,
            records,
            status=status,
            mode=mode,
            duration=time.perf_counter() - t0,
            # A child's snapshot wins over a sweep's 'failed' (see set_snapshot_owner).
            replace_failed=mode == "fork",
        )
        return sid, status

    def _holds_secret(self, rec: dict[str, Any], **what: Any) -> bool:
        """Make `rec` a stub if the value, its bytes or its summary hold a secret value."""
        reason = self.secrets.stub_reason(**what) if self.secrets is not None else None
        if reason:
            rec.update(stub_variable(rec, reason), changed=True)
        return reason is not None

    def record(self, name: str, value: Any, prev: dict[str, Any] | None) -> dict[str, Any]:
        rec: dict[str, Any] = {"name": name, "type": type_name(value)}
        if is_secret_name(name, self.secret_pattern):
            rec.update(summary={"redacted": True}, stub_reason=REDACTED_REASON)
            rec["changed"] = prev is None or prev.get("type") != rec["type"]
            return rec
        secret_key = _secret_key_in(value, self.secret_pattern)
        if secret_key is not None:
            rec.update(
                summary={"redacted": True, "len": len(value)},
                stub_reason=f"redacted: holds the secret-named key {secret_key!r}",
            )
            rec["changed"] = prev is None or prev.get("stub_reason") != rec["stub_reason"]
            return rec
        if self._holds_secret(rec, value=value):
            return rec
        reason = refusal(value)
        if reason:
            summary = summarize(value, self.max_repr_chars)
            if self._holds_secret(rec, summary=summary):
                return rec
            rec.update(summary=summary, stub_reason=reason)
            rec["changed"] = prev is None or prev.get("summary", {}).get("repr") != summary["repr"]
            return rec
        fp = fingerprint(value)
        rec["fingerprint"] = fp
        # Nothing is reused unseen once a value was learnt secret since the last snapshot.
        same_type = prev is not None and prev.get("type") == rec["type"] and not self.recheck
        ident = identity_fingerprint(value) if fp is None else None
        if (
            ident is not None
            and same_type
            and prev is not None
            and prev.get("fingerprint") == ident
            and str(prev.get("stub_reason") or "").startswith(_EXPENSIVE)
        ):
            # Failed last time and looks the same: remembered, not tried again.
            rec.update(
                summary=dict(prev.get("summary") or {}),
                size=prev.get("size"),
                stub_reason=prev.get("stub_reason"),
                fingerprint=ident,
                changed=False,
            )
            return rec
        if fp is not None and same_type and prev is not None and prev.get("fingerprint") == fp:
            # Unchanged by its fingerprint: reuse the previous summary and blob (or stub).
            rec.update(
                summary=dict(prev.get("summary") or {}),
                size=prev.get("size"),
                blob_hash=prev.get("blob_hash"),
                stub_reason=prev.get("stub_reason"),
                changed=False,
            )
            return rec
        summary = summarize(value, self.max_repr_chars)
        if self._holds_secret(rec, summary=summary):
            return rec
        rec["summary"] = summary
        estimate = estimated_size(value)
        if estimate is not None and estimate > self.max_variable_bytes:
            rec.update(
                fingerprint=fp or ident,
                size=estimate,
                stub_reason=f"too large: ~{estimate} bytes > {self.max_variable_bytes} "
                "(summarized only)",
                changed=True,
            )
            return rec
        try:
            with _time_limit(self.max_variable_seconds):
                data, codec = serialize(value, max_bytes=self.max_variable_bytes)
        except _Refused as e:
            rec.update(stub_reason=str(e), changed=True)
            return rec
        except _TooLarge as e:
            rec.update(
                fingerprint=ident,
                size=e.args[0] if e.args else None,
                stub_reason=f"too large: over {self.max_variable_bytes} bytes serialized "
                "(summarized only)",
                changed=True,
            )
            return rec
        except _TooSlow:
            rec.update(
                fingerprint=ident,
                stub_reason=f"too slow: over {self.max_variable_seconds}s to serialize "
                "(summarized only)",
                changed=True,
            )
            return rec
        except BaseException as e:  # noqa: B036 - unpicklable: any error makes a stub
            if isinstance(e, (SystemExit, KeyboardInterrupt)):
                raise
            rec.update(
                fingerprint=ident,
                stub_reason=f"unpicklable: {type(e).__name__}: {str(e)[:200]}",
                changed=True,
            )
            return rec
        if self._holds_secret(rec, data=data):
            return rec
        summary["codec"] = codec
        if fp is None:
            # No cheap fingerprint: the pickle's own hash spares the compression and write of
            # a value serialized to the same bytes as last time.
            fp = rec["fingerprint"] = f"pickle:{_xxh3(data)}"
            if same_type and prev is not None and prev.get("fingerprint") == fp:
                rec.update(size=len(data), blob_hash=prev.get("blob_hash"), changed=False)
                if rec["blob_hash"]:
                    return rec
        digest = self.put_blob(data)
        rec.update(
            size=len(data),
            blob_hash=digest,
            changed=prev is None or prev.get("blob_hash") != digest,
        )
        return rec


# -- scheduling: when, whether and how a snapshot is taken -------------------------------------

# What the kernel may snapshot itself (small_snapshot_seconds): values whose serialization is
# bounded by a glance at them.
_SMALL_BYTES = 1 << 20
_SMALL_LEN = 5000
_SMALL_CELLS = 20_000


def _remembered(value: Any, prev: dict[str, Any] | None, recheck: bool) -> bool:
    """A variable that could not be serialized last time and looks the same (5b above)."""
    return (
        prev is not None
        and not recheck
        and prev.get("type") == type_name(value)
        and str(prev.get("stub_reason") or "").startswith(_EXPENSIVE)
        and prev.get("fingerprint") == identity_fingerprint(value)
    )


def _small_value(value: Any, seen: list[int] | None = None, depth: int = 0) -> bool:
    """True if `value` is cheap to fingerprint or serialize, and serializing it runs no code of
    the person's (a `__reduce__`, `__getstate__` or `__repr__` of theirs could take any time,
    print into a cell's output or change something): judged by its type and size alone,
    looking at no more than _SMALL_LEN items of nested containers in all."""
    seen = [0] if seen is None else seen
    seen[0] += 1
    if seen[0] > _SMALL_LEN or depth > 4:
        return False
    t = type(value)
    if value is None or t in (bool, int, float, complex):
        return True
    if t in (str, bytes, bytearray):
        return len(value) <= _SMALL_BYTES
    if t in (list, tuple, set, frozenset, dict):
        if len(value) + seen[0] > _SMALL_LEN:
            return False
        if t is dict:
            return all(
                _small_value(k, seen, depth + 1) and _small_value(v, seen, depth + 1)
                for k, v in value.items()
            )
        return all(_small_value(v, seen, depth + 1) for v in value)
    if refusal(value):
        return True  # a stub: its type and a short repr
    module = t.__module__ or ""
    if module.startswith("numpy"):
        size = estimated_size(value)
        dtype = getattr(value, "dtype", None)
        return size is not None and size <= _SMALL_BYTES and not getattr(dtype, "hasobject", True)
    if depth > 0:
        return False
    if module.startswith("pandas"):
        return _small_frame(value)
    if t in (types.FunctionType, type) and (
        "<" in value.__qualname__ or getattr(value, "__closure__", None)
    ):
        return False  # a lambda, a closure or a local class: pickled by value, with what it holds
    if t is types.FunctionType:
        return True  # pickled by reference (its module and name)
    if t is type:
        return _plain_class(value)
    # An instance of a class of the person's own, holding small values, pickled and shown the
    # plain way.
    attrs = getattr(value, "__dict__", None)
    return (
        module == "__main__"
        and _plain_class(t)
        and isinstance(attrs, dict)
        and all(_small_value(v, seen, depth + 1) for v in attrs.values())
    )


# What pandas infers a column or index to hold, when nothing in it is an object of the person's.
_PLAIN_KINDS = frozenset(
    """string empty integer floating mixed-integer-float complex boolean datetime64 datetime
    date timedelta64 timedelta time""".split()
)


def _plain_values(values: Any, pd: Any) -> bool:
    kind = pd.api.types.infer_dtype(values, skipna=True)
    if kind == "categorical":
        return _plain_values(values.dtype.categories, pd)
    return kind in _PLAIN_KINDS


def _plain_class(t: type) -> bool:
    """A class whose instances pickle, show and look attributes up as `object` does."""
    return (
        t.__reduce_ex__ is object.__reduce_ex__
        and t.__reduce__ is object.__reduce__
        and getattr(t, "__getstate__", None) is getattr(object, "__getstate__", None)
        and t.__repr__ is object.__repr__
        and t.__getattribute__ is object.__getattribute__
        and not any(
            hasattr(t, name)
            for name in ("__getattr__", "__getnewargs_ex__", "__getnewargs__", "__setstate__")
        )
        and type(t) is type  # no metaclass of theirs
    )


def _small_frame(value: Any) -> bool:
    """A pandas Series or DataFrame of at most _SMALL_CELLS cells holding numbers, dates,
    strings or missing values only (no objects of the person's)."""
    try:
        import numpy as np
        import pandas as pd

        if isinstance(value, pd.Series):
            dtypes, column = [value.dtype], (lambda i: value)
            labels = [value.index]
        elif isinstance(value, pd.DataFrame):
            dtypes, column = list(value.dtypes), (lambda i: value.iloc[:, i])
            labels = [value.index, value.columns]
        else:
            return False
        if value.size > _SMALL_CELLS or value.attrs:
            return False  # large, or attrs holding anything (pickled with it)
        for label in labels:
            if not isinstance(label, pd.RangeIndex) and not _plain_values(label, pd):
                return False
        for i, dtype in enumerate(dtypes):
            if isinstance(dtype, np.dtype) and dtype.kind in "biufcmM":
                continue
            if not _plain_values(column(i), pd):
                return False
        return True
    except Exception:
        return False


class _Child:
    __slots__ = ("pid", "order_index", "started", "killed")

    def __init__(self, pid: int, order_index: int) -> None:
        self.pid = pid
        self.order_index = order_index
        self.started = time.monotonic()
        self.killed = False


class SnapshotManager:
    """Decides, per execution, to snapshot (fork / inline), to note `unchanged`, to coalesce
    into a later snapshot, or to skip; watches the snapshot children (see the module doc)."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.children: dict[int, _Child] = {}
        self._children_lock = threading.Lock()
        self._frozen = False
        # Set at interpreter exit: no fork then, the snapshot is taken inline.
        self.exiting = False
        # The execution whose snapshot is due (its order index), and the timer that takes it.
        self.due: int | None = None
        self._timer: Any = None
        # The namespace at the last snapshot: which execution holds it, its bindings, and the
        # sources of the cells run since (to tell whether they may have changed anything).
        self.base_order: int | None = None
        self.base_bindings: dict[str, int] | None = None
        self.sources_since: list[str] = []
        self._coalesced: list[int] = []
        # Counted from the start: the first cells of a "Run All" coalesce like the others.
        self.last_taken = time.monotonic()
        #: how many executions went which way (`%themisto status`, benchmarks)
        self.counts: dict[str, int] = {}
        #: seconds the kernel spent per fork (gc.freeze + fork + bookkeeping)
        self.fork_seconds: deque[float] = deque(maxlen=100_000)
        #: seconds the kernel spent per snapshot it took itself (small_snapshot_seconds)
        self.small_seconds: deque[float] = deque(maxlen=100_000)
        # The variable records of the last snapshot taken by the kernel itself, by execution.
        self._kept: tuple[int | None, dict[str, dict[str, Any]]] = (None, {})
        # The recorder's KernelSecrets generation the last snapshot was taken with.
        self.secrets_generation = 0

    def will_snapshot(self) -> bool:
        return self.recorder.snapshot_mode != "off"

    def running(self) -> int:
        return len(self.children)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # -- the recorder's events ---------------------------------------------------------------

    def execution_done(self, order_index: int, source: str, wall: float) -> None:
        """An execution was handed to the writer: its snapshot is due now or a moment later."""
        r = self.recorder
        if r.snapshot_mode == "off":
            self.base_bindings = None  # the namespace is no longer followed
            return
        self.sources_since.append(source)
        if self.due is not None:
            self.coalesce()
        self.due = order_index
        now = time.monotonic()
        loop = getattr(getattr(r.shell, "kernel", None), "io_loop", None)
        if (
            r.snapshot_mode == "inline"
            or self.exiting
            or loop is None
            or r.snapshot_delay <= 0
            or now - self.last_taken >= r.snapshot_max_deferral
        ):
            self.take_due()
            return
        self._timer = loop.call_later(r.snapshot_delay, self.take_due)

    def cell_starting(self) -> None:
        """A cell is about to run: a snapshot still due gives way to this cell's."""
        self.unfreeze_if_idle()
        if self.due is not None:
            self.coalesce()

    def silent_request(self) -> None:
        """A silent execute is about to run (it fires no cell hooks): take a due snapshot now,
        while the namespace is still the execution's."""
        if self.due is not None:
            self.take_due()

    def coalesce(self) -> None:
        order, self.due = self.due, None
        self._cancel_timer()
        if order is None:
            return
        self._count("coalesced")
        # Noted in batches (one statement at the next snapshot), not one write per cell.
        self._coalesced.append(order)
        if len(self._coalesced) >= 64:
            self.flush_coalesced()

    def flush_coalesced(self) -> None:
        orders, self._coalesced = self._coalesced, []
        r = self.recorder
        tid = r.trajectory_id
        if not orders or tid is None or r.writer is None:
            return
        r.writer.submit(lambda store: store.mark_pending_snapshots(tid, orders, "coalesced"))

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            loop: Any = getattr(getattr(self.recorder.shell, "kernel", None), "io_loop", None)
            try:
                loop.remove_timeout(timer)
            except Exception:
                pass

    # -- taking it ---------------------------------------------------------------------------

    def take_due(self) -> None:
        order, self.due = self.due, None
        self._cancel_timer()
        if order is None or os.getpid() != self.recorder.pid:
            return
        try:
            self._take(order)
        except BaseException as e:  # noqa: B036 - a recorder must never break the kernel
            self.recorder._report("taking the snapshot failed", e)
            self._write_status(order, "failed", f"{type(e).__name__}: {str(e)[:300]}")

    def _take(self, order: int) -> None:
        r = self.recorder
        self.flush_coalesced()
        variables = list(user_variables(r.shell))
        current = {name: id(value) for name, value in variables}
        generation = self._secrets_generation()
        inline = r.snapshot_mode == "inline" or self.exiting or not hasattr(os, "fork")
        small = not inline and r.small_snapshot_seconds > 0 and not self.children
        # Names bound to the same objects as at the last snapshot, no cell run since able to
        # change an object in place: those variables are as the last snapshot holds them.
        same: set[str] = set()
        if (
            self.base_bindings is not None
            and generation == self.secrets_generation
            and (current == self.base_bindings or small)
            and not self._may_have_changed_in_place()
        ):
            same = {n for n, i in current.items() if self.base_bindings.get(n) == i}
            if current == self.base_bindings:
                base = self.base_order
                self.sources_since = []
                self._count("unchanged")
                self._write_status(
                    order, "unchanged", f"no variable changed since execution {base}", same_as=base
                )
                return
        if inline:
            ok = self._inline(order, variables)
        else:
            ok = (small and self._small(order, variables, same, generation)) or self._fork(order)
        if ok:
            self.base_order = order
            self.base_bindings = current
            self.sources_since = []
            self.last_taken = time.monotonic()
            self.secrets_generation = generation

    def _secrets_generation(self) -> int:
        secrets = getattr(self.recorder, "secrets", None)
        return secrets.generation if secrets is not None else 0

    def _inline(self, order: int, variables: list[tuple[str, Any]]) -> bool:
        r = self.recorder
        writer = r.writer
        writer.wait_idle(30.0)  # the execution's row first
        store = writer.store
        execution_id = store.execution_id(r.trajectory_id, order) if store is not None else None
        if execution_id is None:
            return False  # not written (lost): nothing to attach a snapshot to
        self._count("inline")
        # The person waits for an inline snapshot anyway: a write of another process (a kernel
        # recording beside this one) is waited for, as the writer thread would, not a failure.
        store.set_busy_timeout(writer.locked_retry_seconds)
        try:
            self._writer(store).write(execution_id, variables, mode="inline")
        finally:
            store.set_busy_timeout(0)  # this thread's writes never wait (RecordWriter._direct)
        return True

    def _may_have_changed_in_place(self) -> bool:
        """Could a cell run since the last snapshot have changed an object in place?"""
        from .changes import may_change

        r = self.recorder
        transform = getattr(r.shell, "transform_cell", None)
        ns = r.shell.user_ns
        return any(
            may_change(transform(src) if transform else src, ns) for src in self.sources_since
        )

    def _small(
        self, order: int, variables: list[tuple[str, Any]], same: set[str], generation: int
    ) -> bool:
        """Take the snapshot in the kernel when what changed since the last one is small (see
        small_snapshot_seconds); False (nothing written) when it is not, when the store is
        busy, or when it takes too long. `same`: the names known unchanged since then."""
        r = self.recorder
        budget = r.small_snapshot_seconds
        started = time.perf_counter()
        # Called with no child running (the earlier snapshots' rows, which an unchanged variable
        # reuses, are written); the execution's row must be written too (the writer idle).
        if r.writer is None:
            return False
        r.writer.wait_idle(budget)
        store = r.writer._direct()
        tid = r.trajectory_id
        if store is None or tid is None:
            return False
        recheck = generation != self.secrets_generation
        try:
            execution_id = store.execution_id(tid, order)
            previous: dict[str, dict[str, Any]] = {}
            if self.base_order is not None:
                kept_order, kept = self._kept
                if kept_order == self.base_order:
                    previous = kept  # taken here last time: no need to read it back
                else:
                    rows = store.snapshot_variables(tid, self.base_order)
                    if rows is None:
                        return False  # the last one was not written (failed): a full one is due
                    previous = {v["name"]: v for v in rows}
        except sqlite3.Error:
            return False  # locked by another process (this connection never waits): a child
        if execution_id is None:
            return False
        reuse = {n for n in same if n in previous}
        if not all(
            _small_value(v) or _remembered(v, previous.get(n), recheck)
            for n, v in variables
            if n not in reuse
        ):
            return False
        from ..store import blob_hash

        blobs: dict[str, bytes] = {}

        def collect(data: bytes) -> str:
            digest = blob_hash(data)
            blobs[digest] = bytes(data)
            return digest

        writer = self._writer(store, put_blob=collect)
        records = []
        for name, value in variables:
            if name in reuse:
                records.append({**previous[name], "changed": False})
            else:
                records.append(writer.record(name, value, previous.get(name)))
            if time.perf_counter() - started > budget:
                self._count("small_over_budget")
                return False
        status = snapshot_status(records)
        duration = time.perf_counter() - started

        def job(store: Any) -> None:
            # Idempotent: the writer thread runs it again if it failed here.
            for digest, data in blobs.items():
                store.put_blob(data, digest)
            if store.get_snapshot(execution_id) is None:
                store.write_snapshot(
                    execution_id, records, status=status, mode="inline", duration=duration
                )

        r.writer.submit(job)
        self._kept = (order, {rec["name"]: rec for rec in records})
        self._count("small")
        self.small_seconds.append(time.perf_counter() - started)
        return True

    def _fork(self, order: int) -> bool:
        r = self.recorder
        writer = r.writer
        if len(self.children) >= max(1, r.max_snapshot_children) and r.snapshot_slot_wait > 0:
            self.wait(r.snapshot_slot_wait, below=max(1, r.max_snapshot_children))
        if len(self.children) >= max(1, r.max_snapshot_children):
            self._count("skipped")
            self._write_status(
                order,
                "skipped",
                f"{len(self.children)} snapshot children still running "
                f"(max_snapshot_children={r.max_snapshot_children})",
            )
            return False
        started = time.perf_counter()
        # The writer thread must not be inside SQLite when the child is made.
        if not writer.fork_lock.acquire(timeout=1.0):
            self._count("skipped")
            self._write_status(order, "skipped", "the store was busy (no fork within 1 s)")
            return False
        try:
            gc.freeze()
            self._frozen = True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                self._child(order)  # never returns
        finally:
            writer.fork_lock.release()
        # Both sides set the group (the classic race: a shutdown signalling the kernel's group
        # between fork and the child's own setpgid would otherwise reach the child).
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        child = _Child(pid, order)
        with self._children_lock:
            self.children[pid] = child
        threading.Thread(
            target=self._watch, args=(child,), name="themisto-snapshot-watch", daemon=True
        ).start()
        self._count("fork")
        self.fork_seconds.append(time.perf_counter() - started)
        return True

    def _writer(self, store: Any, put_blob: Callable[[bytes], str] | None = None) -> SnapshotWriter:
        r = self.recorder
        return SnapshotWriter(
            store,
            r.trajectory_id,
            secret_pattern=r.secret_pattern,
            max_variable_bytes=r.max_variable_bytes,
            max_variable_seconds=r.max_variable_seconds,
            max_repr_chars=r.max_repr_chars,
            secrets=getattr(r, "secrets", None),
            recheck=self._secrets_generation() != self.secrets_generation,
            put_blob=put_blob,
        )

    def _write_status(
        self, order: int, status: str, detail: str, *, same_as: int | None = None
    ) -> None:
        """Note a snapshot without variables (through the writer, after the row)."""
        r = self.recorder
        tid = r.trajectory_id
        if tid is None or r.writer is None:
            return

        def job(store: Any) -> None:
            execution_id = store.execution_id(tid, order)
            if execution_id is None or store.get_snapshot(execution_id) is not None:
                return
            holder = store.execution_id(tid, same_as) if same_as is not None else None
            store.write_snapshot(
                execution_id,
                [],
                status=status,
                mode=r.snapshot_mode,
                detail=detail,
                same_as=holder,
            )

        r.writer.submit(job)

    # -- the child ---------------------------------------------------------------------------

    def _child(self, order: int) -> None:
        code = _CHILD_FAILED
        try:
            gc.disable()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            # Out of the kernel's process group: ipykernel terminates its group's children at
            # shutdown and jupyter_client signals the group; the snapshot must outlive both.
            # An orphan still stops on its own: a CPU-time limit bounds it.
            try:
                os.setpgid(0, 0)
                import resource

                limit = max(1, int(self.recorder.max_snapshot_seconds))
                resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
            except (OSError, ValueError, ImportError):
                pass
            # The kernel comes first: the child takes leftover CPU (renice at kernel exit).
            try:
                os.nice(_CHILD_NICE)
            except OSError:
                pass
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            sink = open(os.devnull, "w")  # noqa: SIM115 - lives until os._exit
            sys.stdout = sys.stderr = sink
            variables = list(user_variables(self.recorder.shell))
            from ..store import TrajectoryStore
            from ..store.processes import process_identity

            # Its own connection; nothing of the kernel's (the writer thread's) is touched.
            store = TrajectoryStore(self.recorder.store_file, migrate=False)
            execution_id = _wait_for_row(store, self.recorder.trajectory_id, order)
            if execution_id is None:
                code = _CHILD_NO_ROW
            else:
                try:
                    # This process resolves the snapshot now: if it dies (with its kernel or
                    # not), a sweep finds it gone and marks the snapshot failed.
                    store.set_snapshot_owner(execution_id, process_identity("snapshot"))
                    self._writer(store).write(execution_id, variables, mode="fork")
                    code = _CHILD_OK
                except BaseException as e:  # noqa: B036
                    try:
                        store.write_snapshot(
                            execution_id,
                            [],
                            status="failed",
                            mode="fork",
                            detail=f"{type(e).__name__}: {str(e)[:500]}",
                            replace_failed=True,
                        )
                    except BaseException:  # noqa: B036
                        pass
        finally:
            os._exit(code)

    # -- watching the children ---------------------------------------------------------------

    def _watch(self, child: _Child) -> None:
        """Wait for one child (on its own thread); a child that died without writing its
        snapshot, or ran past max_snapshot_seconds, gets a `failed` snapshot with the reason."""
        r = self.recorder
        reason: str | None = None
        try:
            status = self._wait_child(child, r.max_snapshot_seconds)
            if child.killed:
                reason = f"snapshot killed after {r.max_snapshot_seconds:g}s"
            elif status is None:
                reason = "the snapshot process was reaped by someone else (status unknown)"
            else:
                code = os.waitstatus_to_exitcode(status)
                if code < 0:
                    try:
                        name = signal.Signals(-code).name
                    except ValueError:
                        name = f"signal {-code}"
                    reason = f"the snapshot process was killed by {name}"
                elif code not in (_CHILD_OK, _CHILD_FAILED, _CHILD_NO_ROW):
                    reason = f"the snapshot process exited with status {code}"
        except BaseException as e:  # noqa: B036
            reason = f"watching the snapshot process failed: {type(e).__name__}: {e}"
        finally:
            with self._children_lock:
                self.children.pop(child.pid, None)
        if reason is not None:
            self._write_status(child.order_index, "failed", reason)

    def _wait_child(self, child: _Child, limit: float) -> int | None:
        deadline = child.started + limit
        pidfd = None
        try:
            pidfd = os.pidfd_open(child.pid) if hasattr(os, "pidfd_open") else None
        except OSError:
            pidfd = None
        try:
            while True:
                try:
                    done, status = os.waitpid(child.pid, os.WNOHANG)
                except ChildProcessError:
                    return None
                if done:
                    return status
                left = deadline - time.monotonic()
                if left <= 0 and not child.killed:
                    child.killed = True
                    try:
                        os.kill(child.pid, signal.SIGKILL)
                    except OSError:
                        pass
                    left = 5.0
                wait = min(max(left, 0.01), 1.0)
                if pidfd is not None:
                    import select

                    select.select([pidfd], [], [], wait)
                else:
                    time.sleep(min(wait, 0.05))
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def reap(self) -> None:
        """Children are reaped by their watcher threads; this only gives gc back its
        collections once none is left (called from the kernel's thread)."""
        self.unfreeze_if_idle()

    def unfreeze_if_idle(self) -> None:
        if self._frozen and not self.children:
            gc.unfreeze()
            self._frozen = False

    def wait(self, seconds: float, below: int = 1, *, hurry: bool = False) -> None:
        """Until fewer than `below` children run, for at most `seconds`.

        `hurry` (at kernel exit) gives the children normal priority again where allowed.
        """
        if hurry:
            for pid in list(self.children):
                try:
                    os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0))
                except (OSError, AttributeError):
                    pass
        deadline = time.monotonic() + seconds
        while len(self.children) >= below and time.monotonic() < deadline:
            time.sleep(0.005)
        self.unfreeze_if_idle()

    def close(self) -> None:
        # Running children finish on their own; they hold nothing of the kernel's.
        self._cancel_timer()
        self.flush_coalesced()
        self.unfreeze_if_idle()


def _wait_for_row(store: Any, trajectory_id: str | None, order: int) -> int | None:
    """The execution's id once the kernel's writer has written it (the child may be first)."""
    if trajectory_id is None:
        return None
    deadline = time.monotonic() + 120.0
    pause = 0.005
    while True:
        try:
            found = store.execution_id(trajectory_id, order)
        except Exception:
            found = None
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
