"""Checks of a suggested cell against the live kernel: what it reads that the kernel lacks.

A suggestion that reads a name no cell bound and the kernel does not have, an attribute a
built-in value does not have (`numbers.shape` of a list) or a column a DataFrame does not have
(`df['colour']`) would fail with NameError, AttributeError or KeyError when run. Only runtime
information tells: the names come from `PredictionContext.defined_names`, the types and columns
from its variables. Where the code does not parse, or a star import may have bound anything,
nothing is said.
"""

from __future__ import annotations

import ast
import builtins

from ..context import PredictionContext, bound_names, parse_cell

#: types whose attributes are known without importing anything, by the name the snapshot gives
_BUILTIN_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (list, dict, str, int, float, tuple, set, frozenset, bool, bytes, complex, range)
}
_DATAFRAME_TYPES = ("pandas.DataFrame", "pandas.core.frame.DataFrame")


def _reads(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def unknown_references(text: str, ctx: PredictionContext) -> list[str] | None:
    """What `text` reads that the live kernel does not have (sorted), [] when all of it is
    there, None when it cannot be told (no runtime information, unparsable code, a star
    import)."""
    names = ctx.defined_names
    if not ctx.with_runtime or names is None or "*" in names:
        return None
    tree = parse_cell(text)
    if tree is None:
        return None
    own = bound_names(tree)
    if "*" in own:
        return None
    missing = {n for n in _reads(tree) - own - names if not hasattr(builtins, n)}
    kinds = {v.name: v for v in ctx.variables}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            base = node.value
            if isinstance(base, ast.Name) and base.id not in own and base.id in kinds:
                known = _BUILTIN_TYPES.get(kinds[base.id].type)
                if known is not None and not hasattr(known, node.attr):
                    missing.add(f"{base.id}.{node.attr}")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            base, key = node.value, node.slice
            if (
                isinstance(base, ast.Name)
                and base.id not in own
                and base.id in kinds
                and kinds[base.id].type in _DATAFRAME_TYPES
                and isinstance(key, ast.Constant)
                and isinstance(key.value, str)
            ):
                summary = kinds[base.id].summary
                columns = summary.get("columns")
                if not isinstance(columns, list) or summary.get("columns_omitted"):
                    continue  # the snapshot does not list them all: any column may exist
                if key.value not in {str(c) for c in columns}:
                    missing.add(f"{base.id}[{key.value!r}]")
    return sorted(missing)
