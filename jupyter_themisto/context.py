"""The prediction context: prior cells and a curated runtime summary, within a token budget."""

from __future__ import annotations

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


def build_context(
    executions: Iterable[dict[str, Any]],
    variables: Iterable[dict[str, Any]] = (),
    *,
    with_runtime: bool = True,
    target_source: str | None = None,
    **ids: str | None,
) -> PredictionContext:
    """A context from store-shaped rows: executions (as list_executions gives them) and the
    variables of the latest snapshot (as get_variables gives them)."""
    cells = [
        ContextCell(
            source=e["source"],
            output_text=outputs_to_text(e.get("outputs") or []),
            status=e.get("status", "ok"),
            execution_count=e.get("execution_count"),
        )
        for e in executions
    ]
    infos = [
        VariableInfo(name=v["name"], type=v["type"], summary=dict(v.get("summary") or {}))
        for v in variables
    ]
    return PredictionContext(
        cells=cells,
        variables=infos if with_runtime else [],
        with_runtime=with_runtime,
        target_source=target_source,
        **ids,
    )
