"""Library objects in a snapshot as references (module, qualified name, version), not pickles.

`from sympy import *` binds about 900 names to functions and classes of an installed library;
pickled one by one they took about 390 kB of a store (a blob, a hash and a record each) and
kept the kernel from taking the snapshot itself (a fork instead). A pickle of such an object is
itself only a reference (module and name), so nothing is lost by storing the reference alone:
`{"ref": "module:qualname", "version": "...", "check": "..."}` in the variable's summary, no
blob. `load_reference` gives the object back, or raises `ReferenceMismatch`, never another
object.

What qualifies (`library_reference`), judged without running any code of the person's (only
C-level attributes of a few exact types are read; a class's `__module__` and `__qualname__`
through `type`'s own descriptors, never the class's or its metaclass's attribute lookup):

- a function (its code in a file of the installed library), a builtin function, a NumPy ufunc
  or array function, a Cython function, an `lru_cache` wrapper of a library function, a
  class, or one of `typing`'s aliases (`Iterator`, `Tuple`);
- whose module is an installed library (a file under the interpreter's standard library or
  site-packages: not the notebook's folder, not an editable checkout) or a builtin module;
- which is *identical* to the attribute its module and qualified name name now (read from the
  module's and classes' `__dict__`, no `__getattr__`): an object the person replaced in a
  library module or a function they defined and renamed does not qualify, nor does a bound
  method or an object reachable only under another name;
- whose library version is known (`__version__`, the distribution's metadata, or Python's own
  for the standard library).

`check` is a short hash of the object's shape (a function's name, file and first line; a
class's metaclass and own attribute names): `load_reference` refuses an object whose version
or shape differs from the one recorded (another version of the library, or a name that now
holds something else).
"""

from __future__ import annotations

import functools
import importlib
import os
import site
import sys
import sysconfig
import types
from typing import Any

# Exact types whose module and qualified name are C-level attributes (no code of the person's
# runs to read them); found by name (their modules differ between library versions).
_CALLABLE_TYPE_NAMES = frozenset(
    {
        ("numpy", "ufunc"),
        ("numpy", "_ArrayFunctionDispatcher"),
        ("functools", "_lru_cache_wrapper"),
    }
)
_CYTHON_FUNCTION = "cython_function_or_method"

_type_module = type.__dict__["__module__"].__get__
_type_qualname = type.__dict__["__qualname__"].__get__
_type_dict = type.__dict__["__dict__"].__get__
_type_flags = type.__dict__["__flags__"].__get__
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: every class made by a class statement or type()
# References found, by id (holding the object, so the id stays its own; library objects only,
# which their modules keep alive anyway): the same ones are met again at every snapshot, and
# only their identity with the module's attribute is checked again.
_CACHE: dict[int, tuple[Any, Any, str, dict[str, str]]] = {}
_CACHE_MAX = 50_000


class ReferenceMismatch(Exception):
    """The object a reference names is not there, or is not the one recorded."""


@functools.cache
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(site-packages folders, standard library folders), real paths with a trailing sep."""
    paths = sysconfig.get_paths()
    packages = {paths.get("purelib"), paths.get("platlib")}
    try:
        packages.update(site.getsitepackages())
        packages.add(site.getusersitepackages())
    except Exception:
        pass
    stdlib = {paths.get("stdlib"), paths.get("platstdlib")}

    def norm(found: set[str | None]) -> tuple[str, ...]:
        return tuple(
            sorted({os.path.join(os.path.realpath(p), "") for p in found if p}, key=len)[::-1]
        )

    return norm(packages), norm(stdlib)


@functools.cache
def _file_kind(path: str) -> str | None:
    """'package' (site-packages), 'stdlib', or None (anywhere else)."""
    real = os.path.realpath(path)
    packages, stdlib = _library_roots()
    if any(real.startswith(root) for root in packages):
        return "package"
    if any(real.startswith(root) for root in stdlib):
        return "stdlib"
    return None


def _module_kind(module: Any) -> str | None:
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, dict):
        return None
    name = namespace.get("__name__")
    path = namespace.get("__file__")
    if isinstance(path, str):
        return _file_kind(path)
    if isinstance(name, str) and name in sys.builtin_module_names:
        return "stdlib"
    return None


@functools.cache
def _package_version(top: str) -> str | None:
    module = sys.modules.get(top)
    version = getattr(module, "__dict__", {}).get("__version__") if module is not None else None
    if isinstance(version, str) and version:
        return version
    try:
        from importlib import metadata

        return metadata.version(top)
    except Exception:
        return None


def _version(module_name: str, kind: str) -> str | None:
    if kind == "stdlib":
        return "python " + ".".join(map(str, sys.version_info[:3]))
    version = _package_version(module_name.split(".")[0])
    return f"{module_name.split('.')[0]} {version}" if version else None


def _resolve_static(module: Any, qualname: str) -> Any:
    """The object at `qualname` in `module`, through `__dict__`s only (no `__getattr__`)."""
    parts = qualname.split(".")
    if "<locals>" in parts or not all(p.isidentifier() for p in parts):
        return _MISSING
    namespace = module.__dict__
    found = namespace.get(parts[0], _MISSING)
    for part in parts[1:]:
        if not isinstance(found, type):
            return _MISSING
        found = _type_dict(found).get(part, _MISSING)
    return found


_MISSING = object()


def _library_code(func: Any) -> bool:
    """A function whose code was read from a file of an installed library."""
    path = func.__code__.co_filename if type(func) is types.FunctionType else None
    if isinstance(path, str) and path.startswith("<frozen "):
        return True  # a standard library module frozen into the interpreter (abc, os...)
    return isinstance(path, str) and _file_kind(path) is not None


def _shape(value: Any, kind: str) -> str:
    """What `check` hashes: enough to tell the recorded object from another under its name."""
    if kind == "function":
        code = value.__code__
        return f"function {code.co_name} {os.path.basename(code.co_filename)} {code.co_firstlineno}"
    if kind == "class":
        own = _type_dict(value)
        names = sorted(k for k in own if isinstance(k, str) and not k.startswith("__"))
        return f"class {_type_qualname(type(value))} {' '.join(names)}"
    return kind


def _check(shape: str) -> str:
    import hashlib

    return hashlib.blake2b(shape.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


def _describe(value: Any) -> tuple[str, str, str, Any] | None:
    """(module name, qualified name, kind, function whose code must be the library's) of a
    value of a qualifying type, read without running code of the person's; else None."""
    t = type(value)
    if t is types.FunctionType:
        return value.__module__, value.__qualname__, "function", value
    if t is types.BuiltinFunctionType:
        if not isinstance(value.__self__, types.ModuleType) and value.__self__ is not None:
            return None  # a method bound to an object
        return value.__module__, value.__qualname__, "builtin", None
    if isinstance(value, type):
        return _type_module(value), _type_qualname(value), "class", None
    if type(t) is not type:
        return None  # a type with a metaclass: attribute lookup could run anything
    t_module, t_name = _type_module(t), t.__name__
    if (t_module, t_name) in _CALLABLE_TYPE_NAMES:
        if t_name == "ufunc":
            # A ufunc has no __module__ of its own before NumPy 2: its name is enough.
            module = getattr(value, "__module__", None) or "numpy"
            return module, value.__name__, "ufunc", None
        inner = getattr(value, "_implementation", None) or getattr(value, "__wrapped__", None)
        if type(inner) is not types.FunctionType:
            return None
        return value.__module__, value.__qualname__, t_name, inner
    if t_name == _CYTHON_FUNCTION:
        return value.__module__, value.__qualname__, "cython", None
    if t_module == "typing" and library_class(t):
        # typing's aliases (`from typing import Iterator, Tuple`): named in their own __dict__
        # (read past typing's __getattr__, which forwards to the aliased class).
        own = object.__getattribute__(value, "__dict__")
        name = own.get("_name") if isinstance(own, dict) else None
        return ("typing", name, "typing", None) if isinstance(name, str) else None
    return None


def library_reference(value: Any) -> dict[str, str] | None:
    """The reference standing for `value` in a snapshot, or None when it must be pickled (see
    the module doc). Cheap once seen: cached by identity."""
    cached = _CACHE.get(id(value))
    if cached is not None and cached[0] is value:
        _, module, qualname, ref = cached
        if _resolve_static(module, qualname) is value:
            return ref
        del _CACHE[id(value)]
    found = _reference(value)
    if found is None:
        return None
    module, qualname, ref = found
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[id(value)] = (value, module, qualname, ref)
    return ref


def _reference(value: Any) -> tuple[Any, str, dict[str, str]] | None:
    try:
        described = _describe(value)
        if described is None:
            return None
        module_name, qualname, kind, func = described
        if not isinstance(module_name, str) or not isinstance(qualname, str):
            return None
        if module_name == "__main__" or module_name.startswith("__main__."):
            return None
        module = sys.modules.get(module_name)
        if module is None or not isinstance(module, types.ModuleType):
            return None
        module_kind = _module_kind(module)
        if module_kind is None:
            return None
        if _resolve_static(module, qualname) is not value:
            return None  # not the library's own attribute (replaced, renamed or bound)
        if func is not None and not _library_code(func):
            return None  # the code is not the library's (defined by the person, renamed)
        if kind == "class" and not all(
            _library_code(member)
            for member in _type_dict(value).values()
            if type(member) is types.FunctionType
        ):
            return None  # a class of the person's (its methods' code is theirs)
        version = _version(module_name, module_kind)
        if version is None:
            return None
        ref = {
            "ref": f"{module_name}:{qualname}",
            "version": version,
            "check": _check(_shape(func if kind == "function" else value, kind)),
        }
        return module, qualname, ref
    except Exception:
        return None


def library_class(t: type) -> bool:
    """A class defined by an installed library, as are all its bases (C types count): its
    instances' methods run the library's code, not the person's. Its module is an installed
    library's and the code of each function in its namespace was read from a library's file
    (a class made inside a library function qualifies too). Positive answers are cached."""
    cached = _LIBRARY_CLASSES.get(id(t))
    if cached is t:
        return True
    try:
        mro = _type_dict(type).get("__mro__").__get__(t)
        ok = all(not _type_flags(base) & _HEAPTYPE or _library_defined(base) for base in mro)
    except Exception:
        return False
    if ok:
        if len(_LIBRARY_CLASSES) >= _CACHE_MAX:
            _LIBRARY_CLASSES.clear()
        _LIBRARY_CLASSES[id(t)] = t
    return ok


def _library_defined(cls: type) -> bool:
    module = sys.modules.get(_type_module(cls))
    if module is None or _module_kind(module) is None:
        return False
    return all(
        _library_code(member)
        for member in _type_dict(cls).values()
        if type(member) is types.FunctionType
    )


_LIBRARY_CLASSES: dict[int, type] = {}


# What a class of the person's may define and still be looked at (type, size, attributes)
# without running its code.
_INERT_DUNDERS = frozenset(
    """__module__ __qualname__ __doc__ __dict__ __weakref__ __init__ __annotations__
    __firstlineno__ __static_attributes__ __slots__ __orig_bases__ __parameters__
    __slotnames__ __match_args__ __dataclass_fields__ __dataclass_params__""".split()
)


def inspectable(value: Any) -> bool:
    """True if the kernel may look at `value` (its type, attributes, size, items of a builtin
    container) without running code of the person's: no metaclass of theirs, and no class of
    theirs in its type's MRO defines a dunder (a `__getattribute__`, `__getattr__`,
    `__sizeof__`, `__len__`, `__class__` property...). Library classes may: their code is the
    library's."""
    try:
        t = type(value)
        for cls in (t, type(t)):
            for base in _type_dict(type).get("__mro__").__get__(cls):
                if not _type_flags(base) & _HEAPTYPE:
                    continue  # a static type: C code, not the person's
                names = _type_dict(base)
                if any(
                    isinstance(n, str) and n.startswith("__") and n not in _INERT_DUNDERS
                    for n in names
                ) and not library_class(base):
                    return False
        return True
    except Exception:
        return False


def load_reference(ref: dict[str, Any]) -> Any:
    """The object a recorded reference names, imported now; ReferenceMismatch if it is not
    there, if the library's version differs from the recorded one, or if the object under that
    name is not of the recorded shape (never another object silently)."""
    target = str(ref.get("ref") or "")
    module_name, _, qualname = target.partition(":")
    if not module_name or not qualname:
        raise ReferenceMismatch(f"not a reference: {target!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ReferenceMismatch(f"{target}: cannot import {module_name}: {e}") from e
    found: Any = module
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except AttributeError as e:
            raise ReferenceMismatch(f"{target}: no {qualname} in {module_name}") from e
    now = library_reference(found)
    if now is None or now["ref"] != target:
        raise ReferenceMismatch(f"{target}: what is there now is not a library object of that name")
    if now["version"] != ref.get("version"):
        raise ReferenceMismatch(
            f"{target}: recorded with {ref.get('version')}, installed is {now['version']}"
        )
    if now["check"] != ref.get("check"):
        raise ReferenceMismatch(f"{target}: the object under that name is not the recorded one")
    return found


class _Loads:
    """Pickles as a call of load_reference (the bytes the server serves for a reference)."""

    def __init__(self, ref: dict[str, Any]) -> None:
        self.ref = ref

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return load_reference, (self.ref,)


def reference_pickle(ref: dict[str, Any]) -> bytes:
    """Pickle bytes that load the referenced object through `load_reference` (with its checks;
    jupyter_themisto must be installed where they are loaded)."""
    import pickle

    keep: dict[str, Any] = {k: str(ref[k]) for k in ("ref", "version", "check") if k in ref}
    return pickle.dumps(_Loads(keep), protocol=4)
