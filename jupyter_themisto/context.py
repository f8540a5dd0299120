"""The prediction context: prior cells and a curated runtime summary, within a token budget.

How a context becomes a model's prompt is jupyter_themisto.backends.prompts' job."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .store import NAMESPACE_STATUSES


@dataclass
class ContextCell:
    """One prior step: an executed cell (in the order it ran) or a markdown cell."""

    source: str
    output_text: str = ""
    status: str = "ok"
    cell_type: str = "code"
    execution_count: int | None = None
    #: the execution's place in the trajectory (0: the first cell run); None for notebook cells
    order_index: int | None = None
    #: the notebook cell's id, where known (lets markdown stand beside the code it explains)
    cell_id: str | None = None


@dataclass
class VariableInfo:
    """One live variable as the runtime summary shows it (never its value)."""

    name: str
    type: str
    summary: dict[str, Any] = field(default_factory=dict)
    #: order index of the execution that last changed it (higher = more recent)
    changed_at: int | None = None


@dataclass
class PredictionContext:
    """Everything a backend may use for one prediction."""

    cells: list[ContextCell] = field(default_factory=list)
    #: the notebook's cells below the insertion point, nearest first (next-cell task)
    cells_below: list[ContextCell] = field(default_factory=list)
    variables: list[VariableInfo] = field(default_factory=list)
    with_runtime: bool = True
    #: the cell whose output is predicted (output task only)
    target_source: str | None = None
    notebook_path: str | None = None
    trajectory_id: str | None = None
    kernel_id: str | None = None
    #: executions run after the one whose snapshot gave `variables` (0: the summary is current)
    runtime_lag: int = 0
    #: every name the kernel has bound as far as the runtime information tells (the snapshot's
    #: variables, whatever the executed cells bound, builtins); None: not known
    defined_names: frozenset[str] | None = None

    def previous_code(self) -> str | None:
        """The source of the code cell run last (a suggestion repeating it is not shown)."""
        for cell in reversed(self.cells):
            if cell.cell_type == "code":
                return cell.source
        return None


def outputs_problem(outputs: Any) -> str | None:
    """Why an execution's stored outputs are not what readers take them for, a list of
    nbformat output objects (None: they are). The recorder writes them through the kernel's
    own `json` module, which a cell can replace: a row may then hold `"patched"`."""
    if not isinstance(outputs, list):
        return f"a JSON {_json_kind(outputs)}, not a list of outputs"
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            return f"output {i} is a JSON {_json_kind(out)}, not an object"
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def outputs_to_text(outputs: Sequence[dict[str, Any]], limit: int = 2000) -> str:
    """The text a person sees from nbformat outputs: streams, text/plain results, errors."""
    parts: list[str] = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            text = out.get("text", "")
            parts.append("".join(text) if isinstance(text, list) else str(text))
        elif kind in ("execute_result", "display_data"):
            plain = out.get("data", {}).get("text/plain")
            if plain is not None:
                text = "".join(plain) if isinstance(plain, list) else str(plain)
                parts.append(text if text.endswith("\n") else text + "\n")
        elif kind == "error":
            parts.append(f"{out.get('ename', 'Error')}: {out.get('evalue', '')}\n")
    text = "".join(parts)
    if len(text) > limit:
        text = text[:limit] + f"\n… [{len(text) - limit} more characters]\n"
    return text


# A token is about four characters of code or English; close enough to keep a prompt in budget
# without loading a tokenizer (which would need model files).
CHARS_PER_TOKEN = 4
DEFAULT_TOKEN_BUDGET = 3000
DEFAULT_MAX_OUTPUT_CHARS = 600
DEFAULT_MAX_VARIABLES = 25
# The runtime summary may take at most this share of the budget: the Themisto paper found that
# adding all runtime information does not help, so it is curated, not dumped.
RUNTIME_SHARE = 0.3
# The cells below the insertion point (fill-in-the-middle) may take at most this share.
BELOW_SHARE = 0.2
# Types whose values say little about what comes next; listed last, and dropped first.
_NOISE_TYPES = ("module", "function", "builtin_function_or_method", "type", "method")


def estimate_tokens(text: str) -> int:
    """A cheap, model-free token estimate."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


#: names every IPython kernel has without a cell binding them
KERNEL_NAMES = frozenset(dir(builtins)) | {
    "get_ipython",
    "display",
    "In",
    "Out",
    "exit",
    "quit",
    "_",
    "__",
    "___",
    "_i",
    "_ii",
    "_iii",
    "__name__",
    "__file__",
    "__builtins__",
}


def parse_cell(source: str) -> ast.Module | None:
    """A cell's code as Python syntax (IPython's `%magic` and `!shell` lines blanked), or None."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        return None  # a cell magic: not Python
    kept = ["" if line.lstrip().startswith(("%", "!")) else line for line in lines]
    try:
        return ast.parse("\n".join(kept))
    except (SyntaxError, ValueError):
        return None


def bound_names(tree: ast.AST) -> set[str]:
    """Every name `tree` binds anywhere (assignments, imports, definitions and their parameters,
    loop/with/except targets, comprehension variables); "*" after `from m import *`."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.alias):
            out.add("*" if n.name == "*" else (n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            out.update(n.names)
        elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
            out.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            out.add(n.rest)
    return out


def defined_names(sources: Iterable[str], variables: Iterable[str]) -> frozenset[str]:
    """The names a kernel has after running `sources`, with the snapshot's `variables`."""
    names = set(KERNEL_NAMES) | set(variables)
    for source in sources:
        tree = parse_cell(source)
        if tree is not None:
            names |= bound_names(tree)
    return frozenset(names)


def truncate_text(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (head and tail kept), marked where it was cut."""
    if limit <= 0:
        return ""
    if len(text) <= limit:
        return text
    head = max(1, limit * 2 // 3)
    tail = max(0, limit - head)
    cut = len(text) - head - tail
    return text[:head] + f"\n… [{cut} characters cut] …\n" + (text[-tail:] if tail else "")


def variable_line(v: VariableInfo) -> str:
    """One line describing a variable: name, type and the summary fields that matter.

    The runtime summary's unit: curation spends the budget in these lines and the prompts
    (backends/prompts.py) show them as they are, so it lives with the budget it is counted in.
    """
    s = v.summary
    if s.get("redacted"):
        return f"{v.name}: {v.type} (redacted)"
    parts = [f"{v.name}: {v.type}"]
    for key in ("shape", "dtype", "len"):
        if s.get(key) is not None:
            parts.append(f"{key}={s[key]}")
    if s.get("columns"):
        cols = [str(c) for c in s["columns"]]
        shown = ", ".join(cols[:20]) + (f", … (+{len(cols) - 20})" if len(cols) > 20 else "")
        parts.append(f"columns=[{shown}]")
    if s.get("repr") and not s.get("columns") and not s.get("shape"):
        parts.append("= " + truncate_text(str(s["repr"]).replace("\n", " "), 80))
    return " ".join(parts)


def curate_variables(
    variables: Iterable[VariableInfo],
    *,
    max_variables: int = DEFAULT_MAX_VARIABLES,
    token_budget: int | None = None,
) -> list[VariableInfo]:
    """The variables worth showing: private names and noise types dropped, the most recently
    changed first (then data-like ones), at most `max_variables`, within `token_budget`."""

    def noise(v: VariableInfo) -> bool:
        short = v.type.rsplit(".", 1)[-1]
        return short in _NOISE_TYPES

    keep = [v for v in variables if not v.name.startswith("_") and not noise(v)]
    keep.sort(key=lambda v: (-(v.changed_at if v.changed_at is not None else -1), v.name))
    out: list[VariableInfo] = []
    used = 0
    for v in keep[: max(0, max_variables)]:
        cost = estimate_tokens(variable_line(v)) + 1
        if token_budget is not None and used + cost > token_budget:
            break
        out.append(v)
        used += cost
    return out


def _cell_text(cell: dict[str, Any]) -> str:
    text = cell.get("source") or ""
    return "".join(text) if isinstance(text, list) else str(text)


def _notebook_cell(c: dict[str, Any], limit: int, *, ran: bool) -> ContextCell | None:
    text = truncate_text(_cell_text(c).strip(), limit)
    if not text:
        return None
    kind = str(c.get("cell_type") or "code")
    status = "ok" if kind == "markdown" or ran else "not run"
    return ContextCell(source=text, cell_type=kind, status=status, cell_id=c.get("id"))


def _place_markdown(
    cells: list[ContextCell],
    notebook_cells: Sequence[dict[str, Any]],
    budget: int | None,
    limit: int,
) -> list[ContextCell]:
    """`cells` (executions in run order) with the notebook's markdown cells among them.

    A markdown cell stands after the latest run of the code cell above it in the notebook
    (matched by cell id), the ones directly above the insertion point at the very end; without
    ids they all come first. Within `budget`, the markdown nearest the insertion point wins.
    """
    anchored: dict[str | None, list[ContextCell]] = {}
    anchor: str | None = None
    trailing: list[ContextCell] = []
    for c in notebook_cells:
        if c.get("cell_type") == "code":
            anchor = c.get("id") or anchor
            trailing = []
            continue
        if c.get("cell_type") != "markdown":
            continue
        note = _notebook_cell(c, limit, ran=True)
        if note is not None:
            anchored.setdefault(anchor, []).append(note)
            trailing.append(note)
    ran_ids = {c.cell_id for c in cells if c.cell_id}
    if not ran_ids or not any(k for k in anchored if k):
        notes = [n for group in anchored.values() for n in group]
        return _within(notes, budget) + cells
    # Whom each note goes with, by priority: the trailing ones, then the newest runs first.
    last_run = {c.cell_id: i for i, c in enumerate(cells) if c.cell_id}
    trailing_ids = {id(n) for n in trailing}
    order = list(trailing)
    for cid in sorted(last_run, key=last_run.__getitem__, reverse=True):
        order += [n for n in reversed(anchored.get(cid, [])) if id(n) not in trailing_ids]
    order += [n for n in reversed(anchored.get(None, [])) if id(n) not in trailing_ids]
    kept = {id(n) for n in _within(order, budget, keep_order=True)}
    out = [n for n in anchored.get(None, []) if id(n) in kept and id(n) not in trailing_ids]
    for i, cell in enumerate(cells):
        out.append(cell)
        if cell.cell_id and last_run.get(cell.cell_id) == i:
            out += [
                n
                for n in anchored.get(cell.cell_id, [])
                if id(n) in kept and id(n) not in trailing_ids
            ]
    return out + [n for n in trailing if id(n) in kept]


def _within(
    notes: list[ContextCell], budget: int | None, keep_order: bool = False
) -> list[ContextCell]:
    """The first notes (or, without keep_order, the last ones) that fit `budget` together."""
    if budget is None:
        return notes
    chosen: list[ContextCell] = []
    for n in notes if keep_order else reversed(notes):
        cost = estimate_tokens(n.source) + 2
        if cost > budget:
            break
        chosen.append(n)
        budget -= cost
    return chosen if keep_order else chosen[::-1]


def runtime_lag(executions: Sequence[dict[str, Any]]) -> int:
    """How many of `executions` (store or dump rows, oldest first) ran after the newest one
    whose snapshot gives the namespace: the runtime summary is that many executions old (all of
    them when none has one). A skipped or failed snapshot leaves the variables of an older one."""
    for lag, row in enumerate(reversed(executions)):
        if row.get("snapshot_status") in NAMESPACE_STATUSES:
            return lag
    return len(executions)


def build_context(
    executions: Iterable[dict[str, Any]],
    variables: Iterable[dict[str, Any]] = (),
    *,
    with_runtime: bool = True,
    target_source: str | None = None,
    notebook_cells: Sequence[dict[str, Any]] | None = None,
    cells_below: Sequence[dict[str, Any]] | None = None,
    variable_changes: dict[str, int] | None = None,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    max_variables: int = DEFAULT_MAX_VARIABLES,
    **ids: Any,
) -> PredictionContext:
    """A context from store-shaped rows: executions (as list_executions gives them) and the
    variables of the latest snapshot (as get_variables gives them).

    Curation, within `token_budget` (None: unlimited): the runtime summary takes at most
    RUNTIME_SHARE of the budget (most recently changed variables first; `variable_changes` maps a
    name to the order index of the execution that last changed it, else the snapshot's
    `changed` flag ranks it); the cells below the insertion point (`cells_below`, nearest first)
    at most BELOW_SHARE; executions fill the rest from the newest backwards, each output cut to
    `max_output_chars`; markdown cells of the request's notebook (`notebook_cells`, the cells
    above the insertion point as nbformat-like dicts with cell_type, source and optionally id)
    take what room is left, placed beside the code they follow.
    """
    rows = list(executions)
    infos: list[VariableInfo] = []
    last_order = max((r.get("order_index") or 0 for r in rows), default=0)
    for v in variables:
        changed_at = (variable_changes or {}).get(v["name"])
        if changed_at is None and v.get("changed"):
            changed_at = last_order
        infos.append(
            VariableInfo(
                name=v["name"],
                type=v["type"],
                summary=dict(v.get("summary") or {}),
                changed_at=changed_at,
            )
        )
    names = None
    if with_runtime:
        names = defined_names((r.get("source") or "" for r in rows), (v.name for v in infos))
    budget = token_budget
    if with_runtime:
        runtime_budget = None if budget is None else int(budget * RUNTIME_SHARE)
        infos = curate_variables(infos, max_variables=max_variables, token_budget=runtime_budget)
        if budget is not None:
            budget -= sum(estimate_tokens(variable_line(v)) + 1 for v in infos)
    else:
        infos = []
    if budget is not None and target_source:
        budget -= estimate_tokens(target_source)

    below: list[ContextCell] = []
    below_budget = None if budget is None else int(budget * BELOW_SHARE)
    for c in cells_below or ():
        cell = _notebook_cell(c, max_output_chars * 2, ran=False)
        if cell is None:
            continue
        cost = estimate_tokens(cell.source) + 2
        if below_budget is not None:
            if cost > below_budget:
                break
            below_budget -= cost
            budget = (budget or 0) - cost
        below.append(cell)

    cells: list[ContextCell] = []
    for e in reversed(rows):
        cell = ContextCell(
            source=e["source"],
            output_text=outputs_to_text(e.get("outputs") or [], limit=max_output_chars),
            status=e.get("status", "ok"),
            execution_count=e.get("execution_count"),
            order_index=e.get("order_index"),
            cell_id=e.get("cell_id"),
        )
        cost = estimate_tokens(cell.source) + estimate_tokens(cell.output_text) + 4
        if budget is not None and cost > budget:
            if not cells and budget > 8:
                # The newest cell alone is over budget: keep what fits of it, never nothing.
                room = budget * CHARS_PER_TOKEN
                cell.output_text = ""
                cell.source = truncate_text(cell.source, room)
                cells.append(cell)
            break
        cells.append(cell)
        if budget is not None:
            budget -= cost
    cells.reverse()

    if not rows:
        # Nothing run yet (a fresh kernel): the notebook's cells are the best context there is.
        notes = [
            n
            for c in notebook_cells or ()
            if c.get("cell_type") in ("markdown", "code")
            and (n := _notebook_cell(c, max_output_chars, ran=False)) is not None
        ]
        cells = _within(notes, budget)
    elif notebook_cells:
        cells = _place_markdown(cells, notebook_cells, budget, max_output_chars)

    return PredictionContext(
        cells=cells,
        cells_below=below,
        variables=infos,
        with_runtime=with_runtime,
        target_source=target_source,
        defined_names=names,
        **ids,
    )
