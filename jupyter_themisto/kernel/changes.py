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
   never with `inplace=True`, never passing a function the person defined or a lambda).

Anything it cannot tell (a syntax error, a user-defined function called) counts as a change.
What it misses — a property or `__repr__` that changes its object, a C extension that mutates
an argument of a function on the list — leaves the previous snapshot standing for this
execution until the next snapshot.
"""

from __future__ import annotations

import ast
import builtins
import types
from collections.abc import Iterable
from typing import Any

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
    if isinstance(func, ast.Name):
        if func.id not in PURE_BUILTINS:
            return False
        bound = user_ns.get(func.id, _MISSING)
        return (
            bound is _MISSING
            or bound is getattr(builtins, func.id, _MISSING)
            or (func.id == "display" and getattr(bound, "__module__", "").startswith("IPython"))
        )
    if isinstance(func, ast.Attribute):
        return func.attr in PURE_ATTRIBUTES
    return False


_MISSING = object()


def _user_callable(value: Any) -> bool:
    if value is None or isinstance(value, types.ModuleType):
        return False
    if isinstance(value, (types.FunctionType, types.MethodType, type)):
        return getattr(value, "__module__", None) in ("__main__", None)
    return False
