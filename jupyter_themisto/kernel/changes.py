"""Could a cell have changed the person's variables? A cheap, conservative test that spares a fork.

Two checks, both in the kernel and both far cheaper than a snapshot:

1. **Bindings**: the names of the namespace (as `%who` lists them) and the identity of the
   object each is bound to, compared with those at the last snapshot. A new, deleted or
   rebound name is a change.
2. **In-place changes**: the code of every cell run since the last snapshot (after IPython's
   transformation, so magics count as calls) is parsed. It may have changed an object in
   place unless it only reads: no assignment to an attribute or an item, no augmented
   assignment, no `del` of either, no `await`/`yield`, and every call is one known not to
   change its arguments (`print`, `len`, `display`, `df.head()`, `df.describe()`, `plt.show()`…,
   never with `inplace=True`, never passing a function the person defined or a lambda), or
   a function or class of a library (`np.arange(10)`, `array([1, 2])`, `pd.read_csv(path)`)
   given only fresh values: literals, modules, numbers and strings, other library functions
   — nothing of the person's it could change.

Anything it cannot tell (a syntax error, a user-defined function called) counts as a change.
What it misses — a property or `__repr__` that changes its object, a C extension that mutates
an argument of a function on the list, a library function changing an object of the person's
it holds on to (a figure pyplot draws on) — leaves the previous snapshot standing for this
execution until the next snapshot.
"""

from __future__ import annotations

import ast
import builtins
import numbers
import types
from collections.abc import Iterable
from typing import Any

from ..references import library_reference

# Builtins that never change their arguments (called on a name the person has not rebound).
PURE_BUILTINS = frozenset(
    """abs all any ascii bin bool bytes callable chr complex dict dir divmod enumerate float
    format frozenset getattr hasattr hash hex id int isinstance issubclass iter len list max
    min oct ord pow print range repr reversed round set slice sorted str sum tuple type zip
    display""".split()
)
# Method and module-function names that read without changing what they are called on or with
# (pandas/numpy/str/dict/list readers, matplotlib drawing on its own state, estimators' reads).
PURE_ATTRIBUTES = frozenset(
    """head tail describe info sample copy mean median mode std var sum prod min max count
    nunique unique value_counts isna isnull notna notnull corr cov to_string to_numpy tolist
    items keys values astype reshape round abs any all idxmax idxmin argmax argmin
    quantile cumsum cumprod diff pct_change shift rank sort_values sort_index groupby agg
    aggregate size first last nlargest nsmallest query filter select_dtypes memory_usage
    drop dropna fillna replace rename reset_index set_index merge join concat pivot
    pivot_table melt stack unstack transpose explode crosstab isin between where mask clip
    loc iloc at iat format startswith endswith split rsplit strip lstrip rstrip lower upper
    title capitalize find index count encode decode splitlines zfill center ljust rjust
    predict predict_proba predict_log_proba decision_function score transform
    get_params summary show plot scatter hist bar barh boxplot pie imshow title xlabel ylabel
    legend grid tight_layout xlim ylim xticks yticks suptitle text annotate axhline axvline
    heatmap histplot lineplot scatterplot barplot countplot boxplot violinplot pairplot
    displot catplot regplot lmplot kdeplot relplot jointplot
    array asarray arange linspace zeros ones full eye dot matmul sqrt exp log log10 sin cos
    isclose allclose array_equal where nonzero""".split()
)
_MUTATING_NODES = (ast.AugAssign, ast.Delete, ast.Await, ast.Yield, ast.YieldFrom, ast.Global)


def bindings(variables: Iterable[tuple[str, Any]]) -> dict[str, int]:
    """name -> id() of what it is bound to."""
    return {name: id(value) for name, value in variables}


def may_change(code: str, user_ns: dict[str, Any]) -> bool:
    """True unless `code` (transformed Python) can only read the person's objects."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError):
        return True
    try:
        for node in ast.walk(tree):
            if isinstance(node, _MUTATING_NODES):
                return True
            if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                return True
            if isinstance(node, ast.Lambda):
                return True
            if isinstance(node, ast.Call) and not _pure_call(node, user_ns):
                return True
    except RecursionError:
        return True
    return False


def _pure_call(call: ast.Call, user_ns: dict[str, Any]) -> bool:
    for kw in call.keywords:
        if kw.arg == "inplace" and not (
            isinstance(kw.value, ast.Constant) and kw.value.value in (False, None)
        ):
            return False
    for arg in [*call.args, *(kw.value for kw in call.keywords)]:
        target = arg.value if isinstance(arg, ast.Starred) else arg
        if isinstance(target, ast.Name) and _user_callable(user_ns.get(target.id)):
            return False  # a function of theirs handed to something that may call it
    func = call.func
    if _library_callable(func, user_ns) and all(
        _fresh(arg, user_ns) for arg in [*call.args, *(kw.value for kw in call.keywords)]
    ):
        return True
    if isinstance(func, ast.Name):
        if func.id not in PURE_BUILTINS:
            return False
        bound = user_ns.get(func.id, _MISSING)
        return (
            bound is _MISSING
            or bound is getattr(builtins, func.id, _MISSING)
            or (
                func.id == "display"
                and type(bound) is types.FunctionType
                and str(bound.__module__).startswith("IPython")
            )
        )
    if isinstance(func, ast.Attribute):
        return func.attr in PURE_ATTRIBUTES
    return False


_MISSING = object()


def _user_callable(value: Any) -> bool:
    # By type(value) only: isinstance() could ask a metaclass of theirs (its __class__).
    t = type(value)
    if value is None or issubclass(t, types.ModuleType):
        return False
    if t is types.FunctionType:
        return value.__module__ in ("__main__", None)
    if t is types.MethodType:
        func = value.__func__
        return type(func) is not types.FunctionType or func.__module__ in ("__main__", None)
    if issubclass(t, type):
        return library_reference(value) is None
    return False


# Values no call can change (numbers.Number: numpy's scalars too).
_IMMUTABLE = (type(None), numbers.Number, str, bytes, range, types.EllipsisType)


def _library_callable(func: ast.expr, user_ns: dict[str, Any]) -> bool:
    """A function or class of a library module (not the person's, not a builtin such as exec
    or setattr, not IPython's shell): a name bound to one, or an attribute path from a module
    (`np.linalg.norm`)."""
    target = _named_value(func, user_ns)
    if target is _MISSING:
        return False
    # Identical to its library module's attribute, looked at without running code of theirs
    # (references.py); bound methods of objects never are.
    ref = library_reference(target)
    if ref is None:
        return False
    module = ref["ref"].partition(":")[0]
    return module != "builtins" and not module.startswith(("IPython", "ipykernel"))


def _named_value(expr: ast.expr, user_ns: dict[str, Any]) -> Any:
    """What a name, or an attribute path from a module (`np.linalg.norm`), is bound to
    (_MISSING for anything else: an attribute of an object may be a property)."""
    if isinstance(expr, ast.Name):
        return user_ns.get(expr.id, _MISSING)
    path: list[str] = []
    while isinstance(expr, ast.Attribute):
        path.append(expr.attr)
        expr = expr.value
    if not path or not isinstance(expr, ast.Name):
        return _MISSING
    target = user_ns.get(expr.id, _MISSING)
    for name in reversed(path):
        if not issubclass(type(target), types.ModuleType):
            return _MISSING  # a module's attribute of an attribute: an object's
        # From its namespace: no module __getattr__ (of theirs, or a lazy import) runs.
        namespace = target.__dict__
        target = namespace.get(name, _MISSING) if isinstance(namespace, dict) else _MISSING
    return target


def _fresh(expr: ast.expr, user_ns: dict[str, Any]) -> bool:
    """True if `expr` can hand a callee nothing of the person's it could change."""
    for node in ast.walk(expr):
        if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
        if isinstance(node, ast.Call) and not _pure_call(node, user_ns):
            return False
        if isinstance(node, ast.Attribute) and issubclass(
            type(_named_value(node.value, user_ns)), types.ModuleType
        ):
            # A module's attribute (`mod.data`): a value held there may be the person's too.
            if not _harmless(_named_value(node, user_ns), node, user_ns):
                return False
        if isinstance(node, ast.Name) and not _harmless(
            user_ns.get(node.id, _MISSING), node, user_ns
        ):
            return False
    return True


def _harmless(value: Any, node: ast.expr, user_ns: dict[str, Any]) -> bool:
    """A value a callee cannot change (or a builtin, a comprehension's own name: _MISSING)."""
    if value is _MISSING or issubclass(type(value), (types.ModuleType, *_IMMUTABLE)):
        return True
    if issubclass(type(value), (tuple, frozenset)):
        return all(issubclass(type(v), _IMMUTABLE) for v in value)
    return not _user_callable(value) and _library_callable(node, user_ns)
