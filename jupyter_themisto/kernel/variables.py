"""The person's variables as a snapshot sees them: which, their summaries, their fingerprints.

What is snapshotted is what `%who` shows: the user namespace without names starting with `_`,
without IPython's own (hidden) names and without modules.

A cheap fingerprint (xxh3 of an ndarray's buffer, of each DataFrame/Series column, of a
str/bytes/number) equal to the previous snapshot's means the previous blob is reused without
serializing. A variable without one that could not be serialized last time (too slow, too
large, refused) and whose identity fingerprint (type, id, size, attributes' identities) is
unchanged is `remembered`: the previous stub again, not tried again.
"""

from __future__ import annotations

import reprlib
import sys
import types
from collections.abc import Iterator
from typing import Any

# Containers up to this many items are looked into (fingerprints, secret-named keys).
SMALL_CONTAINER = 1000


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
        if issubclass(type(value), types.ModuleType):  # (isinstance could ask a metaclass)
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
    from .pickling import interrupt_watch

    with interrupt_watch() as watch:
        try:
            text = r.repr(value)
        except BaseException as e:  # noqa: B036 - the value's own __repr__: SystemExit too
            if isinstance(e, KeyboardInterrupt) and watch.interrupted:
                raise  # the person pressed interrupt (see pickling.interrupt_watch)
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
    except BaseException as e:  # noqa: B036 - a frame's objects' own __hash__: SystemExit too
        if isinstance(e, KeyboardInterrupt):
            raise  # (the person pressing interrupt, as likely as code raising it)
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
    if t in (tuple, frozenset) and len(value) <= SMALL_CONTAINER:
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


def xxh3(data: bytes) -> str:
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
    except BaseException as e:  # noqa: B036 - the value's own __sizeof__: SystemExit too
        if isinstance(e, KeyboardInterrupt):
            raise  # (the person pressing interrupt, as likely as code raising it)
    return "ident:" + xxh3("|".join(parts).encode("utf-8", "surrogatepass"))


def remembered(value: Any, prev: dict[str, Any] | None, recheck: bool) -> bool:
    """A variable that could not be serialized last time and looks the same: its stub again."""
    return (
        prev is not None
        and not recheck
        and prev.get("type") == type_name(value)
        and str(prev.get("stub_reason") or "").startswith(_EXPENSIVE)
        and prev.get("fingerprint") == identity_fingerprint(value)
    )
