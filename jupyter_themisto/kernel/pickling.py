"""What a snapshot may pickle and how: refusals, bounded pickle/dill, what the kernel may pickle.

Refused (a stub with type, short repr and reason, never serialized): file objects (pickling
flushes them: in a forked child that writes the person's buffered data twice), sockets, locks,
generators, coroutines, frames, tracebacks, modules inside containers, database connections;
matplotlib figures/artists are *summarized* (their pickle differs every time, so content
hashing cannot tell them unchanged).

Serializing is pickle protocol 5, then dill only if pickle refused; both through a pickler that
refuses those objects wherever they sit in a container, with a size bound (the pickler stops as
soon as the output passes the bound) and a time bound (SIGALRM, main thread only).

`small_value` says what the kernel may snapshot itself (small_snapshot_seconds): scalars,
strings, small containers of them, arrays and plain frames under 1 MB, functions, plain
instances of the person's classes — values whose serialization runs none of the person's code
(a reducer they registered with `copyreg.pickle` included: every pickler calls it).
"""

from __future__ import annotations

import copyreg
import io
import itertools
import pickle
import signal
import socket
import sys
import threading
import types
from typing import Any

from ..references import _library_code, inspectable, library_class, library_reference
from .variables import estimated_size


class Refused(Exception):
    """An object the snapshot must not serialize; the message is the stub's reason."""


class TooLarge(Exception):
    pass


class TooSlow(Exception):
    pass


class NotInKernel(Exception):
    """The kernel must not take this snapshot itself (a child will): something in the value
    is of a class of the person's, or it is too large or too slow for the kernel's budget."""


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
            from matplotlib.container import Container
            from matplotlib.figure import FigureBase

            if isinstance(obj, (Artist, FigureBase, Container)):
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
            raise Refused(reason)
        return NotImplemented


def _dill_pickler() -> type:
    import dill

    class GuardedDillPickler(dill.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            reason = refusal(obj, top_level=False)
            if reason:
                raise Refused(reason)
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
            raise TooLarge(self.size)
        self.parts.append(bytes(data))
        return n

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class _KernelPickler(_GuardedPickler):
    """What the kernel pickles itself (strict): only builtin and library objects, and plain
    instances of the person's classes (object's own reduction), none of whose types copyreg
    hands to a reducer of theirs: no code of theirs runs."""

    def reducer_override(self, obj: Any) -> Any:
        result = super().reducer_override(obj)
        if not kernel_may_pickle(obj):
            raise NotInKernel(type(obj).__qualname__)
        return result


_CYTHON_TYPES = frozenset({"cython_function_or_method", "fused_cython_function"})


def kernel_may_pickle(obj: Any) -> bool:
    """An object the kernel may pickle itself: of a builtin or C type, a library's class, or a
    plain class of the person's (see small_value)."""
    t = type(obj)
    if not t.__flags__ & (1 << 9) or t.__name__ in _CYTHON_TYPES:
        # Not a heap type, or Cython's own (pandas' functions): C code, unless copyreg hands
        # it to a reducer of the person's (`copyreg.pickle(datetime.date, f)`).
        return not _reducer_of_theirs(t)
    return (
        inspectable(obj)
        and not _reducer_of_theirs(t)
        and (library_class(t) or (t.__module__ == "__main__" and _plain_class(t)))
    )


def _reducer_of_theirs(t: type) -> bool:
    """True if copyreg holds a reducer for `t` (`copyreg.pickle(t, f)`) other than a library's
    own for a library's or a builtin type (the standard library's for complex and re.Pattern,
    NumPy's for ufuncs): every pickler calls it, in place of the class's own reduction. Looks
    `t` up by its hash: callers first make sure no metaclass of the person's hashes it (a C
    type, `type(t) is type`, or an inspectable instance's type)."""
    reducer = copyreg.dispatch_table.get(t)
    return reducer is not None and not _library_reducer(t, reducer)


def _library_reducer(t: type, reducer: Any) -> bool:
    return type(reducer) is types.FunctionType and _library_code(reducer) and library_class(t)


def _reducers_of_theirs() -> bool:
    """True if copyreg holds any reducer of the person's (see _reducer_of_theirs). Asked for
    each NumPy or pandas value of a snapshot: the answer is kept while the table holds the
    same entries. They are compared by identity (`==` could run a metaclass of the person's),
    and kept alive with the answer so that no other object takes one's id meanwhile."""
    global _theirs_checked
    items = tuple(copyreg.dispatch_table.items())
    ids = tuple(map(id, itertools.chain.from_iterable(items)))
    if ids != _theirs_checked[0]:
        _theirs_checked = (ids, items, not all(_library_reducer(t, r) for t, r in items))
    return _theirs_checked[2]


_theirs_checked: tuple[tuple[int, ...], tuple[Any, ...], bool] = ((), (), False)


def serialize(value: Any, *, max_bytes: int, strict: bool = False) -> tuple[bytes, str]:
    """Bytes of `value` and the codec used ('pickle' or 'dill').

    Raises Refused, TooLarge, TooSlow, or the serializer's own error when both refuse.
    `strict` (the kernel's own snapshot): NotInKernel for anything of the person's that is not
    plain, and never dill.
    """
    sink = _BoundedSink(max_bytes)
    try:
        (_KernelPickler if strict else _GuardedPickler)(sink, protocol=5).dump(value)
        return sink.getvalue(), "pickle"
    except NotInKernel:
        raise
    except Exception as e:
        if strict and not isinstance(e, (Refused, TooLarge, TooSlow, RecursionError)):
            raise NotInKernel(f"{type(e).__name__}: {e}") from e
        if isinstance(e, (Refused, TooLarge, TooSlow, RecursionError)):
            raise
        first = e
        try:
            dill_pickler = _dill_pickler()
        except ImportError:
            raise first from None
        sink = _BoundedSink(max_bytes)
        dill_pickler(sink, protocol=5).dump(value)
        return sink.getvalue(), "dill"


class time_limit:
    """SIGALRM-based time bound around pure-Python work (no-op off the main thread)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.active = False
        self.previous: Any = None

    def _fire(self, signum: int, frame: Any) -> None:
        raise TooSlow()

    def __enter__(self) -> time_limit:
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


class interrupt_watch:
    """Tells the person pressing interrupt from a KeyboardInterrupt their code raises.

    While active on the main thread, the SIGINT handler in place (ipykernel's
    `default_int_handler` while it handles a request) is wrapped so that `interrupted` says it
    ran: a real interrupt. A KeyboardInterrupt raised with `interrupted` False came from code
    (a `__reduce__` raising it). Off the main thread, or where SIGINT is ignored (outside a
    request, in a snapshot child), no signal raises anything: `interrupted` stays False.
    Costs a `signal.getsignal` where SIGINT is ignored (snapshots taken after the reply), two
    `signal.signal` calls more (about 10 us) while a request is handled.
    """

    def __init__(self) -> None:
        self.interrupted = False
        self.previous: Any = None

    def _noted(self, signum: int, frame: Any) -> Any:
        self.interrupted = True
        return self.previous(signum, frame)

    def __enter__(self) -> interrupt_watch:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self.previous = previous
                signal.signal(signal.SIGINT, self._noted)
        return self

    def __exit__(self, *exc: object) -> None:
        # (Left alone if code replaced it meanwhile: theirs stays.)
        if self.previous is not None and signal.getsignal(signal.SIGINT) == self._noted:
            signal.signal(signal.SIGINT, self.previous)


# What the kernel may snapshot itself (small_snapshot_seconds): values whose serialization is
# bounded by a glance at them.
_SMALL_BYTES = 1 << 20
_SMALL_LEN = 5000
_SMALL_CELLS = 20_000


def small_value(value: Any, seen: list[int] | None = None, depth: int = 0) -> bool:
    """True if `value` is cheap to fingerprint or serialize, and serializing it runs no code of
    the person's (a `__reduce__`, `__getstate__` or `__repr__` of theirs could take any time,
    print into a cell's output or change something): judged by its type and size alone,
    looking at no more than _SMALL_LEN items of nested containers in all."""
    seen = [0] if seen is None else seen
    seen[0] += 1
    if seen[0] > _SMALL_LEN or depth > 4:
        return False
    t = type(value)
    if value is None or t in (bool, int, float):
        return True
    if t is complex:
        return not _reducer_of_theirs(t)  # pickled through copyreg's table
    if library_reference(value) is not None:
        return True  # a reference to a library's function or class (references.py)
    if not inspectable(value):
        return False  # even an isinstance() could run a metaclass's or class's code of theirs
    if t in (str, bytes, bytearray):
        return len(value) <= _SMALL_BYTES
    if t in (list, tuple, set, frozenset, dict):
        if len(value) + seen[0] > _SMALL_LEN:
            return False
        if t is dict:
            return all(
                small_value(k, seen, depth + 1) and small_value(v, seen, depth + 1)
                for k, v in value.items()
            )
        return all(small_value(v, seen, depth + 1) for v in value)
    if refusal(value):
        return True  # a stub: its type and a short repr
    module = t.__module__ or ""
    if module.startswith(("numpy", "pandas")) and _reducers_of_theirs():
        # Their pickles meet internal objects of many types, any of which copyreg may hand to a
        # reducer of the person's: pickled strictly (kernel_may_pickle meets each one), or by a
        # child.
        return False
    if module.startswith("numpy"):
        size = estimated_size(value)
        dtype = getattr(value, "dtype", None)
        if t.__name__ == "ndarray" and getattr(dtype, "hasobject", False):
            # An array of objects (plt.subplots' axes): small if each item is.
            return value.size + seen[0] <= _SMALL_LEN and all(
                small_value(v, seen, depth + 1) for v in value.flat
            )
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
    # plain way; or of a library's plain class (`from __future__ import division` binds one),
    # whose own __repr__ is the library's code.
    attrs = getattr(value, "__dict__", None)
    return (
        (
            (module == "__main__" and _plain_class(t))
            or (library_class(t) and _plain_class(t, library_repr=True))
        )
        and isinstance(attrs, dict)
        and all(small_value(v, seen, depth + 1) for v in attrs.values())
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


def _plain_class(t: type, *, library_repr: bool = False) -> bool:
    """A class whose instances pickle, show and look attributes up as `object` does (shown by
    a __repr__ of its own if `library_repr`: a library class's)."""
    return (
        type(t) is type  # no metaclass (its attribute lookup could run anything): first
        and not _reducer_of_theirs(t)
        and t.__reduce_ex__ is object.__reduce_ex__
        and t.__reduce__ is object.__reduce__
        and getattr(t, "__getstate__", None) is getattr(object, "__getstate__", None)
        and (library_repr or t.__repr__ is object.__repr__)
        and t.__getattribute__ is object.__getattribute__
        and not any(
            hasattr(t, name)
            for name in ("__getattr__", "__getnewargs_ex__", "__getnewargs__", "__setstate__")
        )
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
