"""The prediction context: prior cells and a curated runtime summary, within a token budget."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ContextCell:
    """One prior step: an executed cell (in the order it ran) or a markdown cell."""

    source: str
    output_text: str = ""
    status: str = "ok"
    cell_type: str = "code"
    execution_count: int | None = None


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
    variables: list[VariableInfo] = field(default_factory=list)
    with_runtime: bool = True
    #: the cell whose output is predicted (output task only)
    target_source: str | None = None
    notebook_path: str | None = None
    trajectory_id: str | None = None
    kernel_id: str | None = None
    #: executions run after the one whose snapshot gave `variables` (0: the summary is current)
    runtime_lag: int = 0


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
# Types whose values say little about what comes next; listed last, and dropped first.
_NOISE_TYPES = ("module", "function", "builtin_function_or_method", "type", "method")


def estimate_tokens(text: str) -> int:
    """A cheap, model-free token estimate."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


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
    """One line describing a variable: name, type and the summary fields that matter."""
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


def build_context(
    executions: Iterable[dict[str, Any]],
    variables: Iterable[dict[str, Any]] = (),
    *,
    with_runtime: bool = True,
    target_source: str | None = None,
    notebook_cells: Sequence[dict[str, Any]] | None = None,
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
    `changed` flag ranks it); executions fill the rest from the newest backwards, each output
    cut to `max_output_chars`; markdown cells of the request's notebook (`notebook_cells`,
    nbformat-like dicts with cell_type and source) come first when room is left.
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

    cells: list[ContextCell] = []
    for e in reversed(rows):
        cell = ContextCell(
            source=e["source"],
            output_text=outputs_to_text(e.get("outputs") or [], limit=max_output_chars),
            status=e.get("status", "ok"),
            execution_count=e.get("execution_count"),
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

    notes: list[ContextCell] = []
    # Nothing run yet (a fresh kernel): the notebook's code cells are the best context there is.
    kinds = ("markdown",) if rows else ("markdown", "code")
    for c in reversed(list(notebook_cells or [])):
        if c.get("cell_type") not in kinds:
            continue
        text = c.get("source") or ""
        text = "".join(text) if isinstance(text, list) else str(text)
        text = truncate_text(text.strip(), max_output_chars)
        if not text:
            continue
        cost = estimate_tokens(text) + 2
        if budget is not None and cost > budget:
            break
        kind = str(c.get("cell_type"))
        notes.append(
            ContextCell(
                source=text, cell_type=kind, status="ok" if kind == "markdown" else "not run"
            )
        )
        if budget is not None:
            budget -= cost
    notes.reverse()

    return PredictionContext(
        cells=notes + cells,
        variables=infos,
        with_runtime=with_runtime,
        target_source=target_source,
        **ids,
    )


NEXT_CELL_INSTRUCTIONS = (
    "You predict the next code cell a person will run in a Jupyter notebook, from the cells "
    "they ran so far (in the order they ran them) and the live variables of their kernel. "
    "Answer with the Python code of the next cell only: no explanation, no Markdown fences."
)
OUTPUT_INSTRUCTIONS = (
    "You predict the text output a Jupyter notebook cell will print or display when it runs, "
    "from the cells run before it and the live variables of the kernel. Answer with the "
    "output text only, exactly as Jupyter would show it: no explanation, no Markdown fences."
)


def render_context(ctx: PredictionContext) -> str:
    """The context as plain text for a language model: notes, cells in run order, variables."""
    lines: list[str] = []
    if ctx.notebook_path:
        lines.append(f"# Notebook: {ctx.notebook_path}")
    for c in ctx.cells:
        if c.cell_type == "markdown":
            lines.append("# [markdown]")
            lines.extend("# " + line for line in c.source.splitlines())
            continue
        count = c.execution_count if c.execution_count is not None else " "
        lines.append(f"# In[{count}]:" + ("" if c.status == "ok" else f" ({c.status})"))
        lines.append(c.source.rstrip())
        if c.output_text.strip():
            lines.append("# Out:")
            lines.extend("# " + line for line in c.output_text.rstrip().splitlines())
    if ctx.with_runtime and ctx.variables:
        lines.append("# Live variables (most recently changed first):")
        lines.extend("#   " + variable_line(v) for v in ctx.variables)
    return "\n".join(lines) + "\n"


def render_prompt(ctx: PredictionContext, task: str) -> tuple[str, str]:
    """(instructions, prompt text) for `task` "next-cell" or "output"."""
    body = render_context(ctx)
    if task == "output":
        body += f"# The cell to predict the output of:\n{(ctx.target_source or '').rstrip()}\n"
        return OUTPUT_INSTRUCTIONS, body
    if task != "next-cell":
        raise ValueError(f"unknown task {task!r}: expected 'next-cell' or 'output'")
    body += "# The next cell:\n"
    return NEXT_CELL_INSTRUCTIONS, body


def completion_prompt(ctx: PredictionContext, task: str) -> tuple[str, list[str]]:
    """(prompt, stop strings) for a small model that continues text rather than chats.

    Each task gets the shape such models have seen most often. The next cell continues a
    Jupytext "percent" script (each cell behind a "# %%" line, outputs and live variables as
    comments); an output continues a Python console session (">>> " and "... " before each
    cell's lines, then what it printed; of the live variables only those the cell names). The
    stop strings end the answer at the next cell.
    """
    shown = ctx.variables if ctx.with_runtime else []
    if task == "output":
        # A small model copies what it is shown: only the variables the cell itself names.
        named = set(re.findall(r"[A-Za-z_]\w*", ctx.target_source or ""))
        shown = [v for v in shown if v.name in named]
    variables = [variable_line(v) for v in shown]
    if task == "next-cell":
        lines: list[str] = []
        for c in ctx.cells:
            if c.cell_type == "markdown":
                lines.append("# %% [markdown]")
                lines.extend("# " + line for line in c.source.splitlines())
                continue
            lines += ["# %%", c.source.rstrip()]
            out = c.output_text.rstrip().splitlines()
            lines.extend(("# Out: " if i == 0 else "# ") + line for i, line in enumerate(out))
            lines.append("")
        if variables:
            lines.append("# Live variables (most recently changed first):")
            lines.extend("#   " + v for v in variables)
            lines.append("")
        return "\n".join(lines + ["# %%", ""]), ["# %%", "\n# Out"]
    if task != "output":
        raise ValueError(f"unknown task {task!r}: expected 'next-cell' or 'output'")

    def console(source: str) -> list[str]:
        src = source.rstrip().splitlines() or [""]
        return [">>> " + src[0]] + ["... " + line for line in src[1:]]

    lines = []
    for c in ctx.cells:
        if c.cell_type != "code" or c.status == "not run":
            continue
        lines += console(c.source)
        if c.output_text.strip():
            lines.append(c.output_text.rstrip())
    lines.extend(">>> # " + v for v in variables)
    lines += console(ctx.target_source or "")
    return "\n".join(lines + [""]), [">>> "]
