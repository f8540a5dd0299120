"""The `retrieval` backend, the embedded default: BM25 over the person's own history and a corpus.

No network, no model weights. A next-cell candidate is a cell that was run after cells like
the current ones, in any recorded trajectory or in a corpus notebook; candidates are ranked by
bm25s against the latest cells and the names of the live variables. When the newest cells ran
in the same order before, what followed them there comes first (`continuation`); the local
models' backends ask for it too. Outputs are predicted only where the runtime summary already
holds the answer (a bare variable name, `len(x)`, `x.shape`).
"""

from __future__ import annotations

import asyncio
import json
import keyword
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bm25s
import numpy as np
from pydantic import Field

from ..context import PredictionContext, VariableInfo
from ._text import code_lines, normalized
from .base import NextCellChunk, NoPrediction, OutputChunk, Predictor
from .prompts import Example
from .settings import BackendSettings

# bm25s sets its own logger to DEBUG on import: "Building index from tokens" at every index
# would reach any handler on the root logger (the server's log, `evaluate`'s console).
logging.getLogger("bm25s").setLevel(logging.WARNING)

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words that occur in almost every cell and say nothing about which cell comes next.
_STOP = frozenset(keyword.kwlist) | {"self", "print", "none", "true", "false"}
# reprlib shortens containers of more items than this (the recorder's summaries use reprlib).
_REPR_MAX_ITEMS = 10
_EXACT_REPR_TYPES = frozenset({"int", "float", "bool", "str", "NoneType", "complex"})
_CONTAINER_TYPES = frozenset({"list", "tuple"})


def tokenize(text: str) -> list[str]:
    """Identifiers of code, lower-cased, with snake_case parts: `read_csv` -> read_csv, read,
    csv. Keywords dropped."""
    out: list[str] = []
    for m in _IDENT.finditer(text):
        word = m.group().lower()
        if word in _STOP:
            continue
        out.append(word)
        if "_" in word.strip("_"):
            out.extend(p for p in word.split("_") if len(p) > 1 and p not in _STOP)
    return out


@dataclass
class _Sequence:
    """The code cells of one trajectory or corpus notebook, in order, as the index reads them."""

    #: the notebook's path (or the trajectory's id), as the person knows it
    name: str
    sources: list[str]
    normalized: list[str]
    #: (tokens, the cell's position in `sources`) for each cell that has tokens
    documents: list[tuple[list[str], int]]


@dataclass
class _Index:
    retriever: bm25s.BM25 | None
    #: where each document's candidate cell is: (its origin, the sequence, its position there)
    places: list[tuple[str, _Sequence, int]]
    #: the cells that followed each stretch of `continuation_cells` cells (normalized), each
    #: as (normalized, as written), in the order found
    followers: dict[tuple[str, ...], list[tuple[str, str]]]


def notebook_code_cells(path: Path) -> list[str]:
    """Code cell sources of an .ipynb file, in notebook order (empty on unreadable files)."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    out = []
    for cell in nb.get("cells", []) if isinstance(nb, dict) else []:
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else str(src)
        if src.strip():
            out.append(src)
    return out


class RetrievalSettings(BackendSettings):
    corpus_dir: str | None = Field(
        None, description="a folder of .ipynb files (searched recursively) to draw cells from too"
    )
    history: bool = Field(True, description="draw cells from the store's recorded trajectories")
    max_trajectories: int = Field(
        500, ge=1, description="most recorded trajectories indexed (the newest)"
    )
    context_cells: int = Field(
        2, ge=1, description="cells before a candidate that describe where it fits"
    )
    continuation_cells: int = Field(
        2,
        ge=0,
        description="when the newest this many cells ran in the same order before (in the"
        " history or the corpus), the cell that followed them there is the first suggestion,"
        " if at least 2 of 3 such places agree on it (0: off; see README for what it does)",
    )
    sync_rebuild_seconds: float = Field(
        0.02,
        description="an index that took longer than this to build is refreshed in the"
        " background after new executions (the request answers from the one it has;"
        " negative: always)",
    )


class RetrievalPredictor(Predictor):
    """BM25 over the recorded history and a corpus (settings: `RetrievalSettings`)."""

    name = "retrieval"
    description = "Embedded default: BM25 over your own recorded history and a notebook corpus"
    settings_model = RetrievalSettings
    settings: RetrievalSettings

    def __init__(self, config: dict[str, Any] | None = None, env: Any = None) -> None:
        super().__init__(config, env)
        s = self.settings
        self.corpus_dir = Path(s.corpus_dir).expanduser() if s.corpus_dir else None
        self._index: _Index | None = None
        self._index_key: Any = None
        self._lock = threading.Lock()
        self._corpus: list[tuple[str, _Sequence]] | None = None
        self._history_docs: dict[str, tuple[int, _Sequence]] = {}
        self._build_seconds = 0.0
        self._refresh: asyncio.Future[Any] | None = None

    async def health(self) -> dict[str, Any]:
        if self.corpus_dir is not None and not self.corpus_dir.is_dir():
            return {"ok": False, "detail": f"corpus_dir {self.corpus_dir} is not a folder"}
        source = "your recorded history" + (f" and {self.corpus_dir}" if self.corpus_dir else "")
        return {"ok": True, "detail": f"ranks cells from {source}"}

    # -- the index ---------------------------------------------------------------------------

    def _sequence(self, name: str, cells: list[str]) -> _Sequence:
        return _Sequence(name, cells, [normalized(c) for c in cells], self._documents(cells))

    def _documents(self, cells: list[str]) -> list[tuple[list[str], int]]:
        """(tokens, position) for each cell of one sequence.

        A document describes where a candidate fits (the cells run before it, "c:" terms) and
        which names it uses ("v:" terms, matched against live variable names); the candidate's
        own code is not matched against the query, or the cell just run would always find
        itself.
        """
        out = []
        for i, cell in enumerate(cells):
            tokens = self._context_tokens(cells[max(0, i - self.settings.context_cells) : i])
            tokens += ["v:" + t for t in set(_IDENT.findall(cell))]
            if tokens:
                out.append((tokens, i))
        return out

    def _sequences(self) -> Iterable[tuple[str, _Sequence]]:
        store = self.env.store
        if self.settings.history and store is not None:
            # A trajectory's cells are kept while its length is unchanged: a new execution
            # re-reads only its own trajectory.
            fresh: dict[str, tuple[int, _Sequence]] = {}
            for t in store.list_trajectories(limit=self.settings.max_trajectories):
                cached = self._history_docs.get(t["id"])
                if cached is None or cached[0] != t["n_executions"]:
                    rows = store.list_executions(t["id"])
                    sources = [r["source"] for r in rows if r["source"].strip()]
                    name = t.get("notebook_path") or t["id"]
                    cached = (t["n_executions"], self._sequence(name, sources))
                fresh[t["id"]] = cached
                yield f"trajectory {t['id']}", cached[1]
            self._history_docs = fresh
        if self.corpus_dir is not None:
            if self._corpus is None:
                files = sorted(self.corpus_dir.rglob("*.ipynb")) if self.corpus_dir.is_dir() else []
                root = self.corpus_dir
                self._corpus = [
                    (str(p), self._sequence(str(p.relative_to(root)), notebook_code_cells(p)))
                    for p in files
                ]
            yield from self._corpus

    def _context_tokens(self, before: list[str]) -> list[str]:
        # The closest cell counts double: what was just run says most about what comes next.
        out: list[str] = []
        for distance, cell in enumerate(reversed(before[-self.settings.context_cells :])):
            toks = ["c:" + t for t in tokenize(cell)]
            out += toks * (2 if distance == 0 else 1)
        return out

    def _build(self) -> _Index:
        docs: list[list[str]] = []
        places: list[tuple[str, _Sequence, int]] = []
        followers: dict[tuple[str, ...], list[tuple[str, str]]] = {}
        k = self.settings.continuation_cells
        for origin, seq in self._sequences():
            for tokens, position in seq.documents:
                docs.append(tokens)
                places.append((origin, seq, position))
            for j in range(k, len(seq.sources)) if k else ():
                after = (seq.normalized[j], seq.sources[j])
                followers.setdefault(tuple(seq.normalized[j - k : j]), []).append(after)
        if not docs:
            return _Index(None, [], followers)
        retriever = bm25s.BM25()
        retriever.index(docs, show_progress=False)
        return _Index(retriever, places, followers)

    def _key(self) -> tuple[int, int | None]:
        """What the index was built from: the store's executions, and which file holds them (a
        store deleted to start afresh, and made anew, may hold as many)."""
        store = self.env.store
        if not self.settings.history or store is None:
            return (0, None)
        return (store.count_executions(), getattr(store, "file_id", None))

    def index(self) -> _Index:
        """The index, rebuilt when the store has new executions (cheap check: a count)."""
        key = self._key()
        with self._lock:
            if self._index is None or key != self._index_key:
                t0 = time.perf_counter()
                self._index = self._build()
                self._index_key = key
                self._build_seconds = time.perf_counter() - t0
            return self._index

    async def _fresh_index(self) -> _Index:
        """The index for a request. A small history is re-indexed before answering; a large
        one answers from the index it has while a rebuild runs in the background: the newest
        executions matter as the query (taken from the request), hardly as documents."""
        # The count is a store query: off the event loop, as every store call.
        key = await asyncio.to_thread(self._key)
        if self._index is None or (
            key != self._index_key and self._build_seconds <= self.settings.sync_rebuild_seconds
        ):
            return await asyncio.to_thread(self.index)
        if key != self._index_key and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.ensure_future(asyncio.to_thread(self.index))
        return self._index

    # -- next cell ---------------------------------------------------------------------------

    async def continuation(self, ctx: PredictionContext) -> str | None:
        """The cell that followed the newest `continuation_cells` cells where they ran in the
        same order before (recorded trajectories, corpus notebooks), when at least 2 of 3 of
        those places agree on it; None otherwise. Never the newest cell again, nor a cell of
        only comments."""
        k = self.settings.continuation_cells
        if not k:
            return None
        return self._continuation(ctx, await self._fresh_index(), k)

    @staticmethod
    def _continuation(ctx: PredictionContext, idx: _Index, k: int) -> str | None:
        code = [normalized(c.source) for c in ctx.cells if c.cell_type == "code"]
        code = [c for c in code if c]
        found = idx.followers.get(tuple(code[-k:])) if len(code) >= k else None
        if not found:
            return None
        counts = Counter(key for key, _ in found if key != code[-1] and code_lines(key))
        if not counts:
            return None
        top, n = counts.most_common(1)[0]
        if 3 * n < 2 * sum(counts.values()):
            return None  # the places disagree: no one cell follows these
        return next(text for key, text in found if key == top)

    def _search(
        self, ctx: PredictionContext, idx: _Index, k: int, names: bool = True
    ) -> list[tuple[int, float]]:
        """The `k` best documents for the cells of `ctx` (and, with `names`, its live variables'
        names), as (document, BM25 score), best first; only those that match at all."""
        if idx.retriever is None:
            raise NoPrediction("no recorded history or corpus to draw suggestions from yet")
        code = [c.source for c in ctx.cells if c.cell_type == "code"]
        query = self._context_tokens(code)
        if names and ctx.with_runtime:
            query += ["v:" + v.name for v in ctx.variables]
        vocab = idx.retriever.vocab_dict
        query = [t for t in query if t in vocab]
        if not query:
            raise NoPrediction("nothing in the history resembles the current cells")
        docs, scores = idx.retriever.retrieve(
            [query],
            k=min(len(idx.places), k),
            show_progress=False,
            n_threads=1,
            return_as="tuple",
        )
        found = zip(np.asarray(docs)[0], np.asarray(scores)[0], strict=True)
        return [(int(d), float(s)) for d, s in found if s > 0]

    def rank(
        self, ctx: PredictionContext, n: int, idx: _Index | None = None
    ) -> list[tuple[str, float]]:
        """Up to `n` distinct candidate cells with their BM25 scores, best first."""
        idx = idx or self.index()
        code = [c.source for c in ctx.cells if c.cell_type == "code"]
        last = normalized(code[-1]) if code else None
        seen: set[str] = set()
        out: list[tuple[str, float]] = []
        for d, s in self._search(ctx, idx, max(10, n * 8)):
            _, seq, position = idx.places[d]
            cand = seq.sources[position]
            norm = normalized(cand)
            # Re-suggesting the cell just run, or one already offered, helps nobody.
            if norm == last or norm in seen:
                continue
            seen.add(norm)
            out.append((cand, s))
            if len(out) >= n:
                break
        if not out:
            raise NoPrediction("nothing in the history resembles the current cells")
        return out

    async def examples(self, ctx: PredictionContext, k: int, before: int = 2) -> list[Example]:
        """Up to `k` places in other notebooks (one each) whose cells resemble the newest ones
        of `ctx`: each the best-ranked candidate cell with the `before` cells run before it
        there, for a model to read as examples of what came next. Not `ctx`'s own trajectory
        (its cells are in the prompt already); none when nothing matches. Found from the cells'
        code alone: the prompt warmed ahead when a cell starts running, before its variables
        exist, must have the same examples as the one asked for after it ran."""
        idx = await self._fresh_index()
        own = f"trajectory {ctx.trajectory_id}" if ctx.trajectory_id else None
        try:
            found = self._search(ctx, idx, max(10, k * 8), names=False)
        except NoPrediction:
            return []
        out: list[Example] = []
        used: set[str] = set()
        for d, _ in found:
            origin, seq, position = idx.places[d]
            if origin == own or origin in used:
                continue
            used.add(origin)
            cells = seq.sources[max(0, position - before) : position + 1]
            out.append(Example(seq.name, tuple(cells)))
            if len(out) >= k:
                break
        return out

    async def predict_next_cell(
        self, ctx: PredictionContext, *, n: int = 1
    ) -> AsyncIterator[NextCellChunk]:
        idx = await self._fresh_index()
        k = self.settings.continuation_cells
        first = self._continuation(ctx, idx, k) if k else None
        try:
            ranked = self.rank(ctx, max(1, n), idx)
        except NoPrediction:
            if first is None:
                raise
            ranked = []
        # Scores on the 0-1 scale of the models' ranked lists: each cell's BM25 score over the
        # best one's (a raw BM25 score, "4.68", means nothing to the person reading the panel).
        top = max((score for _, score in ranked), default=0.0) or 1.0
        if first is not None:
            # It ran after these very cells: first, scored as the best BM25 candidate.
            ranked = [(first, top)] + [r for r in ranked if normalized(r[0]) != normalized(first)]
        for i, (text, score) in enumerate(ranked[: max(1, n)]):
            yield NextCellChunk(index=i, text=text, done=True, score=round(score / top, 4))

    # -- output ------------------------------------------------------------------------------

    async def predict_output(self, ctx: PredictionContext) -> AsyncIterator[OutputChunk]:
        yield OutputChunk(text=predict_output_from_summary(ctx))


def _exact_repr(v: VariableInfo) -> str | None:
    """The variable's repr when the summary's short repr is known to be the whole of it."""
    s = v.summary
    text = s.get("repr")
    if not isinstance(text, str) or s.get("redacted") or text.startswith("<repr failed"):
        return None
    # The recorder names builtins bare ("int") and everything else module-qualified.
    t = v.type
    if t == "str":
        # reprlib cuts long strings in the middle; uncut, repr is the string plus its quotes.
        n = s.get("len")
        return text if isinstance(n, int) and len(text) >= n + 2 and "..." not in text else None
    if t in _EXACT_REPR_TYPES:
        return text if "..." not in text else None
    if t in _CONTAINER_TYPES:
        n = s.get("len")
        if isinstance(n, int) and n <= _REPR_MAX_ITEMS and "..." not in text:
            return text
    return None


_BARE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*;?\s*$")
_LEN = re.compile(r"^\s*len\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")
_SHAPE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\.shape\s*$")


def predict_output_from_summary(ctx: PredictionContext) -> str:
    """The output of `ctx.target_source` if the runtime summary answers it exactly, else
    NoPrediction with the reason."""
    source = (ctx.target_source or "").strip()
    if not source:
        raise NoPrediction("the cell is empty")
    if not ctx.with_runtime:
        raise NoPrediction("the retrieval backend predicts outputs only from runtime information")
    if "\n" in source:
        raise NoPrediction("the retrieval backend predicts only one-line lookups of variables")
    if ctx.runtime_lag:
        raise NoPrediction("the runtime snapshot is older than the latest execution")
    variables = {v.name: v for v in ctx.variables}
    for pattern, kind in ((_BARE, "repr"), (_LEN, "len"), (_SHAPE, "shape")):
        m = pattern.match(source)
        if not m:
            continue
        if m.group(0).rstrip().endswith(";"):
            raise NoPrediction("a trailing semicolon hides the value")
        v = variables.get(m.group(1))
        if v is None:
            raise NoPrediction(f"{m.group(1)!r} is not among the recorded live variables")
        if v.summary.get("redacted"):
            raise NoPrediction(f"{v.name!r} is a secret; its value is not recorded")
        if kind == "repr":
            text = _exact_repr(v)
            if text is None or v.type == "NoneType":
                raise NoPrediction(f"the recorded summary of {v.name!r} is not its whole repr")
            return text + "\n"
        if kind == "len" and isinstance(v.summary.get("len"), int):
            return f"{v.summary['len']}\n"
        if kind == "shape" and isinstance(v.summary.get("shape"), list):
            return repr(tuple(v.summary["shape"])) + "\n"
        raise NoPrediction(f"the recorded summary of {v.name!r} has no {kind}")
    raise NoPrediction("the retrieval backend predicts only a bare variable, len(x) or x.shape")
