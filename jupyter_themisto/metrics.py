"""Scores for predicted cells and outputs: exact match, ROUGE-L, chrF, BLEU, API-call P/R.

Exact match compares texts after `normalize_whitespace`: line endings become `\\n`, trailing
whitespace is stripped from every line, and leading and trailing blank lines are dropped.
Indentation and blank lines inside the text are kept (they change what Python code means and
what an output looks like). ROUGE-L is rouge-score's F-measure (its default tokenizer:
lower-cased alphanumeric words); chrF and BLEU are sacrebleu's sentence scores (BLEU with
effective order, so short cells are not all zero), all on a 0–1 scale.

API-call precision/recall follow JuICe: the calls of a cell are the names of the functions it
calls (`pd.read_csv(...)` -> `read_csv`, `df.groupby(...).mean()` -> `groupby`, `mean`),
extracted with `ast`; a cell that does not parse falls back to a `name(` pattern. They are
multiset precision and recall; precision is undefined (None) when the prediction calls
nothing, recall when the reference calls nothing; means skip undefined values.

Two runs on the same examples are compared by `paired_difference`: the mean per-example
difference with a percentile bootstrap interval, seeded so that a report can be reproduced.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

METRICS = ("exact_match", "rouge_l", "chrf", "bleu")
NEXT_CELL_METRICS = METRICS + ("api_precision", "api_recall")


def normalize_whitespace(text: str) -> str:
    """The text exact match compares: `\\n` line endings, no trailing spaces on any line, no
    leading or trailing blank lines."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the texts are equal after `normalize_whitespace`, else 0.0."""
    return float(normalize_whitespace(prediction) == normalize_whitespace(reference))


@lru_cache(maxsize=1)
def _rouge() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


@lru_cache(maxsize=1)
def _sacre() -> tuple[Any, Any]:
    from sacrebleu.metrics import BLEU, CHRF

    return CHRF(), BLEU(effective_order=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (0–1); two texts without words score 1.0 when equal, else 0.0."""
    score = _rouge().score(reference, prediction)["rougeL"].fmeasure
    if score == 0.0 and not _has_words(prediction) and not _has_words(reference):
        return exact_match(prediction, reference)
    return float(score)


def _has_words(text: str) -> bool:
    return re.search(r"[A-Za-z0-9]", text) is not None


def chrf(prediction: str, reference: str) -> float:
    """Sentence chrF (0–1)."""
    if not prediction.strip() and not reference.strip():
        return 1.0
    return min(1.0, _sacre()[0].sentence_score(prediction, [reference]).score / 100.0)


def bleu(prediction: str, reference: str) -> float:
    """Sentence BLEU with effective order (0–1)."""
    if not prediction.strip() and not reference.strip():
        return 1.0
    return min(1.0, _sacre()[1].sentence_score(prediction, [reference]).score / 100.0)


_CALL_FALLBACK = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_MAGIC = re.compile(r"^\s*[%!].*$", re.MULTILINE)


def api_calls(source: str) -> list[str]:
    """The names of the functions a cell calls, in source order (see the module docstring)."""
    # IPython magics and shell escapes are not Python; blank them so the rest still parses.
    code = _MAGIC.sub("", source)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return _CALL_FALLBACK.findall(code)
    calls: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name:
            pos = f.end_lineno or node.lineno, f.end_col_offset or node.col_offset
            calls.append((pos[0], pos[1], name))
    return [name for _, _, name in sorted(calls)]


def api_precision_recall(prediction: str, reference: str) -> tuple[float | None, float | None]:
    """(precision, recall) of the predicted cell's calls against the reference's (multisets)."""
    pred, ref = Counter(api_calls(prediction)), Counter(api_calls(reference))
    hit = sum((pred & ref).values())
    n_pred, n_ref = sum(pred.values()), sum(ref.values())
    return (hit / n_pred if n_pred else None, hit / n_ref if n_ref else None)


def score(prediction: str, reference: str, task: str = "output") -> dict[str, float | None]:
    """All metrics of one example; `task` "next-cell" adds API-call precision/recall."""
    out: dict[str, float | None] = {
        "exact_match": exact_match(prediction, reference),
        "rouge_l": rouge_l(prediction, reference),
        "chrf": chrf(prediction, reference),
        "bleu": bleu(prediction, reference),
    }
    if task == "next-cell":
        out["api_precision"], out["api_recall"] = api_precision_recall(prediction, reference)
    return out


def mean_scores(rows: Iterable[dict[str, float | None]]) -> dict[str, float | None]:
    """Per-metric means over examples, skipping undefined (None) values."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    keys: list[str] = []
    for row in rows:
        for k, v in row.items():
            if k not in sums:
                sums[k], counts[k] = 0.0, 0
                keys.append(k)
            if v is not None:
                sums[k] += float(v)
                counts[k] += 1
    return {k: (sums[k] / counts[k] if counts[k] else None) for k in keys}


def corpus_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus-level chrF and BLEU (0–1), as sacrebleu reports them for a test set."""
    if not predictions:
        return {}
    from sacrebleu.metrics import BLEU, CHRF

    return {
        "corpus_chrf": CHRF().corpus_score(list(predictions), [list(references)]).score / 100,
        "corpus_bleu": BLEU().corpus_score(list(predictions), [list(references)]).score / 100,
    }


def paired_difference(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 2000, seed: int = 0
) -> dict[str, float]:
    """How `b` scored against `a` on the same examples (`a[i]` and `b[i]` are one example's
    scores): the mean of b − a, its 95 % percentile bootstrap interval (`low`, `high`; the
    examples resampled `resamples` times with a fixed seed), and how many examples `b` scored
    higher (`better`) and lower (`worse`) on. An interval that holds 0 means the runs are not
    told apart on these examples."""
    if len(a) != len(b) or not a:
        raise ValueError("paired_difference needs two equally long, non-empty score lists")
    d = [float(y) - float(x) for x, y in zip(a, b, strict=True)]
    n = len(d)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(d, k=n)) / n for _ in range(resamples))
    return {
        "n": n,
        "mean": sum(d) / n,
        "low": means[int(0.025 * resamples)],
        "high": means[max(0, int(0.975 * resamples) - 1)],
        "better": sum(1 for x in d if x > 0),
        "worse": sum(1 for x in d if x < 0),
    }
