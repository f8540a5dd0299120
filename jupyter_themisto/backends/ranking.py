"""Ranking next-cell candidates from several sources (greedy, sampled, retrieved) on one scale.

Candidates are deduplicated after whitespace normalization, degenerate ones (nothing but
comments, the previous cell again) dropped, and each scored by consensus (minimum Bayes risk):
its mean chrF against every *other* candidate, each vote weighted by its source. A cell that
many independent candidates resemble is likely; one that nobody agrees with is not. The score
is a number in [0, 1] computed the same way for every candidate, whatever produced it, so
the scores of one ranked list are comparable with each other (not across requests: a list of
near-identical candidates scores high throughout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sacrebleu.metrics import CHRF

from ._text import degenerate_reason, normalized

#: how much a candidate's vote counts, by source: the greedy answer is the model's best guess,
#: a sample one draw of many, a retrieved cell was written by someone in a similar context, a
#: history one ran after these very cells (`RetrievalPredictor.continuation`)
SOURCE_WEIGHTS = {"history": 1.5, "greedy": 1.5, "sampled": 1.0, "retrieved": 0.75}

_CHRF = CHRF()


@dataclass
class Candidate:
    """One suggested cell and where it came from."""

    text: str
    source: str
    score: float = 0.0
    #: other sources that proposed the same cell (merged by deduplication)
    also: list[str] = field(default_factory=list)


def degenerate(text: str, previous: str | None = None) -> bool:
    """Not worth showing: empty, only comments, or the previous cell again."""
    return degenerate_reason(text, previous) is not None


def similarity(a: str, b: str) -> float:
    """chrF of `a` against `b`, 0–1."""
    if not a.strip() or not b.strip():
        return 0.0
    return _CHRF.sentence_score(a, [b]).score / 100


def rank(candidates: Sequence[Candidate], previous: str | None = None) -> list[Candidate]:
    """Distinct, non-degenerate candidates, best first, each with its consensus score.

    A duplicate adds its source's weight to the first candidate of that text. A lone
    candidate scores 1 (it has no rival). Ties keep the order the candidates came in.
    """
    distinct: dict[str, Candidate] = {}
    weight: dict[str, float] = {}
    for c in candidates:
        key = normalized(c.text)
        if degenerate(c.text, previous):
            continue
        w = SOURCE_WEIGHTS.get(c.source, 1.0)
        if key in distinct:
            distinct[key].also.append(c.source)
            weight[key] += w
        else:
            distinct[key] = Candidate(c.text, c.source)
            weight[key] = w
    keys = list(distinct)
    if len(keys) == 1:
        distinct[keys[0]].score = 1.0
    for key in keys:
        others = [k for k in keys if k != key]
        total = sum(weight[k] for k in others)
        if not total:
            continue
        # Its own duplicates are votes for it too, at full similarity.
        own = weight[key] - SOURCE_WEIGHTS.get(distinct[key].source, 1.0)
        agree = sum(weight[k] * similarity(key, k) for k in others) + own
        distinct[key].score = round(agree / (total + own), 4)
    order = sorted(range(len(keys)), key=lambda i: (-distinct[keys[i]].score, i))
    return [distinct[keys[i]] for i in order]


def with_each_source(ranked: list[Candidate], places: int) -> list[Candidate]:
    """The best `places` candidates, where the best of a source left out (a retrieved cell,
    written by a person, among model samples) takes the last place: a list of alternatives
    should offer different kinds of answer, not only variations of one."""
    chosen = ranked[:places]
    for source in dict.fromkeys(c.source for c in ranked):
        if places > 1 and all(c.source != source for c in chosen):
            best = next(c for c in ranked if c.source == source)
            kept = [c for c in chosen if sum(x.source == c.source for x in chosen) > 1]
            if kept:
                chosen.remove(kept[-1])
                chosen.append(best)
    return sorted(chosen, key=ranked.index)
