"""Baselines that give benchmark numbers a floor: repeat the previous cell, and JuICe-style
retrieval (Ret-Train over other trajectories, Ret-Context within the current one).

- `repeat-previous`: the next cell is the last cell run again; a cell's output is the previous
  cell's output.
- `ret-train` (JuICe's Ret-Train): BM25 over (previous cell -> next cell) pairs of the *other*
  trajectories in the store lent by the host (`evaluate --train DUMP` fills one); the next
  cell is the one that followed the most similar previous cell. For outputs, the output of
  the most similar recorded cell. The current trajectory is always excluded, so a store that
  also holds the test trajectories cannot leak their answers.
- `ret-context` (JuICe's Ret-Context): the same ranking, but over the current trajectory's
  own earlier cells: the cell that followed the earlier cell most like the last one; for
  outputs, the output of the earlier cell most like the target (often the same cell run
  before).

BM25 here is a few lines of standard library code (k1 = 1.5, b = 0.75) over identifier
tokens, so the baselines need no index files and no network.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import Field

from ..context import PredictionContext, outputs_to_text
from .base import NextCellChunk, NoPrediction, OutputChunk, Predictor
from .settings import BackendSettings

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[^\sA-Za-z0-9_]")
_K1, _B = 1.5, 0.75


def tokens(text: str) -> list[str]:
    """Identifiers, numbers and punctuation marks of a cell, lower-cased."""
    return [t.lower() for t in _IDENT.findall(text)]


class BM25Index:
    """A small in-memory BM25 index over token lists."""

    def __init__(self, docs: Sequence[Sequence[str]]) -> None:
        self.n = len(docs)
        self.lengths = [len(d) for d in docs]
        self.avg = (sum(self.lengths) / self.n) if self.n else 0.0
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, d in enumerate(docs):
            for term, tf in Counter(d).items():
                self.postings[term].append((i, tf))

    def scores(self, query: Sequence[str]) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        for term in set(query):
            posting = self.postings.get(term)
            if not posting:
                continue
            idf = math.log(1 + (self.n - len(posting) + 0.5) / (len(posting) + 0.5))
            for i, tf in posting:
                norm = tf + _K1 * (1 - _B + _B * self.lengths[i] / (self.avg or 1.0))
                out[i] += idf * tf * (_K1 + 1) / norm
        return out

    def ranked(self, query: Sequence[str]) -> list[int]:
        """Document indices with a positive score, best first (ties: the later document)."""
        s = self.scores(query)
        return sorted((i for i, v in s.items() if v > 0), key=lambda i: (-s[i], -i))


def _code_cells(ctx: PredictionContext) -> list[tuple[str, str]]:
    return [(c.source, c.output_text) for c in ctx.cells if c.cell_type == "code"]


def _same(a: str, b: str) -> bool:
    return a.strip() == b.strip()


class RepeatPreviousPredictor(Predictor):
    """The last cell again; the previous cell's output."""

    name = "repeat-previous"
    description = "Baseline: repeats the previous cell (and its output)"
    settings_model = BackendSettings

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        cells = _code_cells(ctx)
        if not cells:
            raise NoPrediction("no cell has run yet")
        yield NextCellChunk(index=0, text=cells[-1][0], done=True)

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        cells = _code_cells(ctx)
        if not cells:
            raise NoPrediction("no cell has run yet")
        yield OutputChunk(text=cells[-1][1])


class RetContextPredictor(Predictor):
    """JuICe's Ret-Context over the current trajectory's earlier cells."""

    name = "ret-context"
    description = "Baseline (JuICe Ret-Context): what followed a similar earlier cell here"
    settings_model = BackendSettings

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        cells = [s for s, _ in _code_cells(ctx)]
        if len(cells) < 2:
            raise NoPrediction("fewer than two cells have run")
        index = BM25Index([tokens(s) for s in cells[:-1]])
        seen: list[str] = []
        for i in index.ranked(tokens(cells[-1])):
            follower = cells[i + 1]
            if any(_same(follower, s) for s in seen):
                continue
            seen.append(follower)
            yield NextCellChunk(index=len(seen) - 1, text=follower, done=True)
            if len(seen) >= n:
                return
        if not seen:
            raise NoPrediction("no earlier cell resembles the last one")

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        cells = _code_cells(ctx)
        target = ctx.target_source or ""
        if not cells or not target.strip():
            raise NoPrediction("no earlier cell, or an empty target")
        ranked = BM25Index([tokens(s) for s, _ in cells]).ranked(tokens(target))
        if not ranked:
            raise NoPrediction("no earlier cell resembles this one")
        yield OutputChunk(text=cells[ranked[0]][1])


class RetTrainSettings(BackendSettings):
    max_trajectories: int = Field(
        1000, ge=1, description="most recorded trajectories drawn from (the newest)"
    )


class RetTrainPredictor(Predictor):
    """JuICe's Ret-Train over the other trajectories of the host's store (settings:
    `RetTrainSettings`)."""

    name = "ret-train"
    description = "Baseline (JuICe Ret-Train): what followed a similar cell in other trajectories"
    settings_model = RetTrainSettings
    settings: RetTrainSettings

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        self._lock = threading.Lock()
        self._built_for: int | None = None
        # next-cell pairs: (previous cell -> next cell); output pairs: (cell -> its output)
        self._next: tuple[BM25Index, list[str], list[str]] | None = None
        self._out: tuple[BM25Index, list[str], list[str]] | None = None

    def _build(self) -> None:
        store = self.env.store
        if store is None:
            raise NoPrediction("ret-train needs recorded trajectories (evaluate --train DUMP)")
        key = store.count_executions()
        with self._lock:
            if self._built_for == key:
                return
            prev_docs: list[list[str]] = []
            nexts: list[str] = []
            next_origin: list[str] = []
            cell_docs: list[list[str]] = []
            outs: list[str] = []
            out_origin: list[str] = []
            for t in store.list_trajectories(limit=self.settings.max_trajectories):
                rows = [r for r in store.list_executions(t["id"]) if r["source"].strip()]
                for i, r in enumerate(rows):
                    cell_docs.append(tokens(r["source"]))
                    outs.append(outputs_to_text(r.get("outputs") or []))
                    out_origin.append(t["id"])
                    if i + 1 < len(rows):
                        prev_docs.append(tokens(r["source"]))
                        nexts.append(rows[i + 1]["source"])
                        next_origin.append(t["id"])
            self._next = (BM25Index(prev_docs), nexts, next_origin)
            self._out = (BM25Index(cell_docs), outs, out_origin)
            self._built_for = key

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        self._build()
        assert self._next is not None
        index, nexts, origin = self._next
        cells = [s for s, _ in _code_cells(ctx)]
        if not cells:
            raise NoPrediction("no cell has run yet")
        seen: list[str] = []
        for i in index.ranked(tokens(cells[-1])):
            if origin[i] == ctx.trajectory_id or any(_same(nexts[i], s) for s in seen):
                continue
            seen.append(nexts[i])
            yield NextCellChunk(index=len(seen) - 1, text=nexts[i], done=True)
            if len(seen) >= n:
                return
        if not seen:
            raise NoPrediction("no recorded cell resembles the last one")

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        self._build()
        assert self._out is not None
        index, outs, origin = self._out
        for i in index.ranked(tokens(ctx.target_source or "")):
            if origin[i] != ctx.trajectory_id:
                yield OutputChunk(text=outs[i])
                return
        raise NoPrediction("no recorded cell resembles this one")
