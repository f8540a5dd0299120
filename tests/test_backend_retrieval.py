"""The embedded retrieval backend: ranking quality on recorded workflows, corpus, honest outputs."""

from __future__ import annotations

import json

import pytest

from jupyter_themisto.backends import BackendEnv, NoPrediction, create_backend
from jupyter_themisto.backends.retrieval import RetrievalPredictor, predict_output_from_summary
from jupyter_themisto.context import PredictionContext, VariableInfo, build_context
from jupyter_themisto.store import TrajectoryStore

EDA = [
    "import pandas as pd",
    "sales = pd.read_csv('sales.csv')",
    "sales.head()",
    "sales.describe()",
    "sales.isna().sum()",
    "sales = sales.dropna()",
    "sales.groupby('region')['revenue'].sum().plot.bar()",
]
TRAIN = [
    "from sklearn.model_selection import train_test_split",
    "X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2)",
    "from sklearn.ensemble import RandomForestClassifier",
    "clf = RandomForestClassifier(n_estimators=100)",
    "clf.fit(X_train, y_train)",
    "clf.score(X_test, y_test)",
]


@pytest.fixture
def store(tmp_path):
    s = TrajectoryStore(tmp_path / "t.sqlite")
    yield s
    s.close()


def record(store, cells, **kw):
    tid = store.create_trajectory(**kw)
    for c in cells:
        store.add_execution(tid, {"source": c, "status": "ok"})
    return tid


# Tests that record after a first request and expect the new executions indexed: a loaded CI
# machine can take longer than the default 20 ms to build, and then the request would answer
# from the old index while a rebuild runs (test_large_index_refreshes_in_the_background).
REBUILD_FIRST = {"sync_rebuild_seconds": 60}


async def suggestions(backend, ctx, n=3):
    return [c.text async for c in backend.predict_next_cell(ctx, n=n)]


async def test_ranks_the_next_step_of_a_known_workflow(store):
    for _ in range(2):
        record(store, EDA)
        record(store, TRAIN)
    backend = RetrievalPredictor({}, BackendEnv(store=store))
    hits = total = 0
    for workflow in (EDA, TRAIN):
        for i in range(1, len(workflow) - 1):
            ctx = build_context([{"source": s} for s in workflow[: i + 1]])
            top = await suggestions(backend, ctx, n=1)
            total += 1
            hits += top == [workflow[i + 1]]
    # Every next step was seen twice after the same cells: retrieval must find nearly all.
    assert hits / total >= 0.8, (hits, total)


async def test_scores_are_relative_to_the_best_match(store):
    """The panel shows each suggestion's score: on the 0-1 scale of the models' ranked lists
    (BM25 over the best match's, best first), not a raw BM25 score; the cell that followed
    these very cells before takes the first place and 1."""
    record(store, EDA)
    record(store, TRAIN)
    ctx = build_context([{"source": s} for s in EDA[:3]])
    for settings in ({"continuation_cells": 0}, {}):
        backend = RetrievalPredictor(settings, BackendEnv(store=store))
        chunks = [c async for c in backend.predict_next_cell(ctx, n=4)]
        scores = [c.score for c in chunks]
        assert len(scores) == 4 and scores[0] == 1.0, scores
        assert scores == sorted(scores, reverse=True) and 0 < scores[-1] < 1, scores
    assert chunks[0].text == EDA[3]  # (the next step of the one workflow recorded)


async def test_live_variable_names_steer_the_ranking(store):
    uses = {"arr": ["arr = np.zeros(3)", "arr.sum()"], "mat": ["mat = np.eye(3)", "mat.T"]}
    for cells in uses.values():
        record(store, ["import numpy as np", *cells])
    backend = RetrievalPredictor({}, BackendEnv(store=store))
    base = [{"source": "import numpy as np"}]
    for name, cells in uses.items():
        ctx = build_context(base, [{"name": name, "type": "numpy.ndarray"}])
        # Both workflows follow the same cell: the cells that use the live variable rank
        # first (the query's "v:" term matches them only), the other workflow's after them.
        ranked = await suggestions(backend, ctx, n=3)
        assert sorted(ranked[:2]) == sorted(cells), ranked
        assert ranked[2] not in cells, ranked
    ctx_arr = build_context(base, [{"name": "arr", "type": "numpy.ndarray"}])
    ctx_mat = build_context(base, [{"name": "mat", "type": "numpy.ndarray"}])
    assert (await suggestions(backend, ctx_arr, n=5)) != (await suggestions(backend, ctx_mat, n=5))


async def test_no_repeat_of_the_cell_just_run_and_new_executions_are_indexed(store):
    tid = record(store, ["a = 1", "b = a + 1"])
    backend = RetrievalPredictor(REBUILD_FIRST, BackendEnv(store=store))
    ctx = build_context([{"source": "a = 1"}, {"source": "b = a + 1"}])
    with pytest.raises(NoPrediction):
        await suggestions(backend, ctx)
    store.add_execution(tid, {"source": "print(b)", "status": "ok"})
    record(store, ["a = 1", "b = a + 1", "print(a, b)"])
    out = await suggestions(backend, ctx)
    assert "b = a + 1" not in out and "print(a, b)" in out


async def test_a_history_deleted_is_forgotten_even_by_an_equal_count(tmp_path):
    """The store is deleted to start afresh (as the server follows it): the index is rebuilt
    from the new file, though it holds as many executions as the old one did."""
    path = tmp_path / "t.sqlite"
    old = TrajectoryStore(path)
    record(old, ["a = 1", "b = a + 1", "print('old history')"])
    store = TrajectoryStore(path, follow=True)
    backend = RetrievalPredictor(REBUILD_FIRST, BackendEnv(store=store))
    ctx = build_context([{"source": "a = 1"}, {"source": "b = a + 1"}])
    assert "print('old history')" in await suggestions(backend, ctx)
    old.close()
    for f in tmp_path.glob("t.sqlite*"):
        f.unlink()
    with TrajectoryStore(path) as new:
        record(new, ["a = 1", "b = a + 1", "print('new history')"])
    assert await suggestions(backend, ctx) == ["print('new history')"]
    store.close()


async def test_corpus_directory_without_history(tmp_path):
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": "# Plot"},
            {"cell_type": "code", "source": ["import matplotlib.pyplot as plt\n"]},
            {"cell_type": "code", "source": "fig, ax = plt.subplots()"},
            {"cell_type": "code", "source": "ax.plot([1, 2, 3])"},
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / "sub" / "plot.ipynb").write_text(json.dumps(nb))
    (tmp_path / "corpus" / "broken.ipynb").write_text("{not json")
    backend = create_backend("retrieval", {"corpus_dir": str(tmp_path / "corpus")}, BackendEnv())
    assert (await backend.health())["ok"]
    ctx = build_context([{"source": "import matplotlib.pyplot as plt"}])
    assert (await suggestions(backend, ctx, n=1)) == ["fig, ax = plt.subplots()"]
    missing = RetrievalPredictor({"corpus_dir": str(tmp_path / "nope")})
    assert (await missing.health())["ok"] is False


async def test_examples_are_places_in_other_notebooks_with_the_cells_before_them(store, tmp_path):
    mine = record(store, EDA, notebook_path="work/sales.ipynb")
    record(store, EDA, notebook_path="old/eda.ipynb")
    record(store, EDA[:4] + ["sales.info()"], notebook_path="old/again.ipynb")
    record(store, TRAIN, notebook_path="old/train.ipynb")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "tutorial.ipynb").write_text(
        json.dumps({"cells": [{"cell_type": "code", "source": c} for c in EDA]})
    )
    backend = RetrievalPredictor({"corpus_dir": str(tmp_path / "corpus")}, BackendEnv(store=store))
    ctx = build_context([{"source": s} for s in EDA[:3]], trajectory_id=mine)
    found = await backend.examples(ctx, 3)
    # One place per notebook, never the notebook's own trajectory (its cells are in the prompt):
    # each the cell that came after cells like these, and the two run before it there.
    assert {e.name for e in found} == {"old/eda.ipynb", "old/again.ipynb", "tutorial.ipynb"}
    assert all(e.cells == tuple(EDA[1:4]) for e in found)
    assert [e.name for e in await backend.examples(ctx, 1)] == [found[0].name]
    # Found from the code alone: a prompt warmed before the newest cell's variables existed has
    # the same examples (live names steer the ranked cells, not these).
    assert "clf.fit(X_train, y_train)" not in await suggestions(backend, ctx, n=6)
    ctx.variables = [VariableInfo(name="clf", type="RandomForestClassifier", summary={})]
    assert "clf.fit(X_train, y_train)" in await suggestions(backend, ctx, n=6)
    assert await backend.examples(ctx, 3) == found
    assert len(await backend.examples(ctx, 1, before=0)) == 1
    assert (await backend.examples(ctx, 1, before=0))[0].cells == (EDA[3],)
    # Nothing alike, or nothing recorded: no examples (the prompt goes without them).
    unknown = build_context([{"source": "zzz_qqq = 1"}])
    assert await backend.examples(unknown, 2) == []
    empty = RetrievalPredictor({}, BackendEnv(store=TrajectoryStore(tmp_path / "e.sqlite")))
    assert await empty.examples(ctx, 2) == []


async def test_empty_history_is_no_prediction(store):
    backend = RetrievalPredictor({}, BackendEnv(store=store))
    with pytest.raises(NoPrediction, match="no recorded history"):
        await suggestions(backend, build_context([{"source": "x = 1"}]))


def var(name, type_, **summary):
    return VariableInfo(name=name, type=type_, summary=summary)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("n", "42\n"),
        ("  n  ", "42\n"),
        ("name", "'Ada'\n"),
        ("pair", "(1, 2)\n"),
        ("len(items)", "12\n"),
        ("arr.shape", "(3, 4)\n"),
    ],
)
def test_honest_output_predictions(source, expected):
    ctx = PredictionContext(
        variables=[
            var("n", "int", repr="42"),
            var("name", "str", repr="'Ada'", len=3),
            var("pair", "tuple", repr="(1, 2)", len=2),
            var("items", "list", repr="[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ...]", len=12),
            var("arr", "numpy.ndarray", shape=[3, 4], dtype="float64", repr="array(...)"),
        ],
        target_source=source,
    )
    assert predict_output_from_summary(ctx) == expected


@pytest.mark.parametrize(
    "source, reason",
    [
        ("items", "not its whole repr"),  # reprlib cut the list
        ("long", "not its whole repr"),  # reprlib cut the string
        ("arr", "not its whole repr"),  # an array's repr is not in the summary
        ("token", "secret"),
        ("n;", "semicolon"),
        ("missing", "not among"),
        ("n + 1", "only a bare variable"),
        ("print(n)", "only a bare variable"),
        ("n\nn", "one-line"),
        ("", "empty"),
    ],
)
def test_no_output_prediction_when_unsure(source, reason):
    ctx = PredictionContext(
        variables=[
            var("n", "int", repr="42"),
            var("items", "list", repr="[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ...]", len=12),
            var("long", "str", repr="'aaaa...aaaa'", len=500),
            var("arr", "numpy.ndarray", shape=[3, 4], repr="array([[0., ...]])"),
            var("token", "str", redacted=True),
        ],
        target_source=source,
    )
    with pytest.raises(NoPrediction, match=reason):
        predict_output_from_summary(ctx)
    ctx.with_runtime = False
    ctx.target_source = "n"
    with pytest.raises(NoPrediction, match="runtime"):
        predict_output_from_summary(ctx)


def test_no_output_prediction_from_a_stale_snapshot():
    ctx = PredictionContext(variables=[var("n", "int", repr="42")], target_source="n")
    assert predict_output_from_summary(ctx) == "42\n"
    ctx.runtime_lag = 1
    with pytest.raises(NoPrediction, match="snapshot"):
        predict_output_from_summary(ctx)


async def test_large_index_refreshes_in_the_background(store):
    record(store, ["import os", "os.getcwd()"])
    # Every build counts as slow: refreshes happen in the background.
    backend = RetrievalPredictor({"sync_rebuild_seconds": -1}, BackendEnv(store=store))
    ctx = build_context([{"source": "import os"}])
    assert await suggestions(backend, ctx, n=5) == ["os.getcwd()"]
    record(store, ["import os", "os.listdir('.')"])
    # Answered at once from the index it has, while the new one is built.
    assert await suggestions(backend, ctx, n=5) == ["os.getcwd()"]
    await backend._refresh
    assert sorted(await suggestions(backend, ctx, n=5)) == ["os.getcwd()", "os.listdir('.')"]


# -- what followed the same cells before ------------------------------------------------------


async def test_what_followed_the_same_cells_before_comes_first(store):
    stretch = ["import numpy as np", "x = np.arange(10)", "y = x ** 2"]
    record(store, ["import os", *stretch, "y.mean()"])
    # After cells that look the same to BM25 (it reads the newest two), a cell that uses a live
    # variable: BM25 alone ranks it first.
    for _ in range(3):
        record(store, ["import pandas as pd", *stretch[1:], "total = y.cumsum().max()"])
    ctx = build_context([{"source": s} for s in stretch], [{"name": "total", "type": "int"}])
    three = {"continuation_cells": 3, **REBUILD_FIRST}
    off = RetrievalPredictor({"continuation_cells": 0}, BackendEnv(store=store))
    assert await suggestions(off, ctx, n=2) == ["total = y.cumsum().max()", "y.mean()"]
    backend = RetrievalPredictor(three, BackendEnv(store=store))
    assert await backend.continuation(ctx) == "y.mean()"
    assert await suggestions(backend, ctx, n=2) == ["y.mean()", "total = y.cumsum().max()"]
    # The default looks at the newest two cells, which ran before four times: three of them
    # followed by the other cell, and three of four agree.
    default = RetrievalPredictor({}, BackendEnv(store=store))
    assert await default.continuation(ctx) == "total = y.cumsum().max()"
    # Two of three places agree: enough. Two of four: not.
    record(store, ["import os", *stretch, "y.mean()"])
    record(store, ["import os", *stretch, "y.sum()"])
    assert await backend.continuation(ctx) == "y.mean()"
    record(store, ["import os", *stretch, "y.sum()"])
    assert await backend.continuation(ctx) is None


async def test_a_continuation_is_never_the_newest_cell_again_nor_only_comments(store):
    stretch = ["df = load()", "df.plot()"]
    record(store, [*stretch, "df.plot()", "# looks right"])
    record(store, [*stretch, "# looks right"])
    backend = RetrievalPredictor({}, BackendEnv(store=store))
    assert await backend.continuation(build_context([{"source": s} for s in stretch])) is None
    # Fewer cells than the stretch: nothing to match.
    assert await backend.continuation(build_context([{"source": "df.plot()"}])) is None
    # Whitespace does not make cells differ; a corpus notebook counts as a place too.
    nb = {"cells": [{"cell_type": "code", "source": s} for s in [*stretch, "df.describe()"]]}
    corpus = store.path.parent / "corpus"
    corpus.mkdir()
    (corpus / "a.ipynb").write_text(json.dumps(nb))
    other = RetrievalPredictor({"history": False, "corpus_dir": str(corpus)}, BackendEnv())
    spaced = build_context([{"source": "df = load()  \n"}, {"source": "\ndf.plot()"}])
    assert await other.continuation(spaced) == "df.describe()"
