"""Metric values against examples computed by hand (see each test's arithmetic)."""

from __future__ import annotations

import math

import pytest

from jupyter_themisto import metrics as M


def test_whitespace_normalization_and_exact_match():
    assert M.normalize_whitespace("\n\n  x = 1   \r\ny = 2\t\n\n") == "  x = 1\ny = 2"
    assert M.exact_match("df.head()  \n\n", "\r\ndf.head()") == 1.0
    # Indentation and inner blank lines change code and outputs: they are kept.
    assert M.exact_match("  df.head()", "df.head()") == 0.0
    assert M.exact_match("a\n\nb", "a\nb") == 0.0


def test_rouge_l_by_hand():
    # LCS("the cat sat", "the cat sat on the mat") = 3 words: P = 3/3, R = 3/6, F = 2PR/(P+R).
    assert M.rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # rouge-score lower-cases and keeps alphanumeric words: df, groupby, a, mean vs df, mean.
    # LCS = 2; P = 2/4, R = 2/2 -> F = 2 * 0.5 * 1 / 1.5.
    assert M.rouge_l("df.groupby('a').mean()", "df.mean()") == pytest.approx(2 / 3)
    assert M.rouge_l("", "") == 1.0
    assert M.rouge_l("", "x") == 0.0


def test_bleu_by_hand():
    # hyp "the cat sat on mat" vs ref "the cat sat on the mat":
    # p1 = 5/5, p2 = 3/4 ("on mat" misses), p3 = 2/3, p4 = 1/2; BP = exp(1 - 6/5).
    expected = math.exp(1 - 6 / 5) * (1 * 0.75 * (2 / 3) * 0.5) ** 0.25
    assert M.bleu("the cat sat on mat", "the cat sat on the mat") == pytest.approx(expected)
    assert M.bleu("x = 1", "x = 1") == pytest.approx(1.0)


def test_chrf_by_hand():
    # chrF (beta 2) over character n-grams of "abc" vs "abd": unigrams P = R = 2/3,
    # bigrams P = R = 1/2, trigrams 0; orders 4-6 exist in neither and are not averaged.
    assert M.chrf("abc", "abd") == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    assert M.chrf("same text", "same text") == pytest.approx(1.0)
    assert M.chrf("", "") == 1.0


def test_api_calls_extracted_with_ast():
    src = "df = pd.read_csv('x.csv')\ndf.groupby('a').mean()\nprint(len(df))"
    assert M.api_calls(src) == ["read_csv", "groupby", "mean", "print", "len"]
    # Magics are blanked so the Python around them still parses.
    assert M.api_calls("%matplotlib inline\nplt.plot(x)") == ["plot"]
    # Code that does not parse falls back to the `name(` pattern.
    assert M.api_calls("df.head(\nfoo(") == ["head", "foo"]


def test_api_precision_recall_by_hand():
    # pred calls {head, mean}, ref calls {head, print}: 1 hit -> P = 1/2, R = 1/2.
    assert M.api_precision_recall("df.head()\ndf.mean()", "df.head()\nprint(df)") == (0.5, 0.5)
    # Multisets: pred head x2, ref head x1 -> P = 1/2, R = 1.
    assert M.api_precision_recall("a.head()\nb.head()", "c.head()") == (0.5, 1.0)
    # Undefined when one side calls nothing.
    assert M.api_precision_recall("x = 1", "f()") == (None, 0.0)
    assert M.api_precision_recall("f()", "x = 1") == (0.0, None)


def test_score_and_means():
    s = M.score("df.head()", "df.head()\n", "next-cell")
    assert s == {
        "exact_match": 1.0,
        "rouge_l": 1.0,
        "chrf": pytest.approx(1.0),
        "bleu": pytest.approx(1.0),
        "api_precision": 1.0,
        "api_recall": 1.0,
    }
    assert set(M.score("a", "b")) == set(M.METRICS)
    means = M.mean_scores(
        [{"exact_match": 1.0, "api_precision": None}, {"exact_match": 0.0, "api_precision": 0.5}]
    )
    assert means == {"exact_match": 0.5, "api_precision": 0.5}
    corpus = M.corpus_scores(["the cat sat on mat"], ["the cat sat on the mat"])
    assert corpus["corpus_bleu"] == pytest.approx(
        M.bleu("the cat sat on mat", "the cat sat on the mat")
    )


def test_paired_difference():
    a = [0.2, 0.5, 0.4, 0.9, 0.1, 0.3, 0.6, 0.7]
    # Better by 0.1 on every example: the interval is that one value.
    up = M.paired_difference(a, [x + 0.1 for x in a])
    assert up["n"] == 8 and up["better"] == 8 and up["worse"] == 0
    assert up["mean"] == pytest.approx(0.1)
    assert up["low"] == pytest.approx(0.1) and up["high"] == pytest.approx(0.1)
    # Half better, half worse by as much: no difference, and the interval says so.
    mixed = [x + (0.2 if i % 2 else -0.2) for i, x in enumerate(a)]
    d = M.paired_difference(a, mixed)
    assert d["mean"] == pytest.approx(0.0, abs=1e-12) and (d["better"], d["worse"]) == (4, 4)
    assert d["low"] < 0 < d["high"]
    # Seeded (a report can be reproduced), and antisymmetric.
    assert M.paired_difference(a, mixed) == d
    back = M.paired_difference(mixed, a)
    assert back["mean"] == pytest.approx(-d["mean"], abs=1e-12)
    assert back["low"] == pytest.approx(-d["high"]) and back["high"] == pytest.approx(-d["low"])
    assert M.paired_difference([0.5] * 3, [0.5] * 3)["better"] == 0
    for bad in (([], []), ([0.1], [0.1, 0.2])):
        with pytest.raises(ValueError, match="equally long"):
            M.paired_difference(*bad)
