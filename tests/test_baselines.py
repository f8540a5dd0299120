"""The baselines: repeat-previous, ret-context and ret-train, through the backend registry."""

from __future__ import annotations

import asyncio

import pytest

from jupyter_themisto.backends import BackendEnv, NoPrediction, create_backend
from jupyter_themisto.context import ContextCell, PredictionContext
from jupyter_themisto.store import TrajectoryStore


def _ctx(cells, target=None, tid="t-now"):
    return PredictionContext(
        cells=[ContextCell(source=s, output_text=o) for s, o in cells],
        target_source=target,
        trajectory_id=tid,
    )


async def _next(backend, ctx, n=1):
    return [c.text async for c in backend.predict_next_cell(ctx, n=n)]


async def _out(backend, ctx):
    return "".join([c.text async for c in backend.predict_output(ctx)])


def test_repeat_previous():
    b = create_backend("repeat-previous")
    ctx = _ctx([("x = 1", ""), ("print(x)", "1\n")], target="print(x + 1)")
    assert asyncio.run(_next(b, ctx)) == ["print(x)"]
    assert asyncio.run(_out(b, ctx)) == "1\n"
    with pytest.raises(NoPrediction):
        asyncio.run(_next(b, _ctx([])))


def test_ret_context_follows_the_most_similar_earlier_cell():
    b = create_backend("ret-context")
    cells = [
        ("df = pd.read_csv('a.csv')", ""),
        ("df.describe()", "stats a"),
        ("model.fit(X, y)", ""),
        ("df = pd.read_csv('b.csv')", ""),
    ]
    # The last cell is most like cell 0, which was followed by df.describe().
    assert asyncio.run(_next(b, _ctx(cells))) == ["df.describe()"]
    # The output of the earlier cell most like the target.
    assert asyncio.run(_out(b, _ctx(cells, target="df.describe()"))) == "stats a"
    with pytest.raises(NoPrediction):
        asyncio.run(_next(b, _ctx([("x = 1", "")])))


def test_ret_train_uses_other_trajectories_only(tmp_path):
    store = TrajectoryStore(tmp_path / "s.sqlite")
    other = store.create_trajectory(notebook_path="other.ipynb")
    for src, out in [
        ("import pandas as pd", ""),
        ("df = pd.read_csv('x')", ""),
        ("df.info()", "<class DataFrame>"),
    ]:
        outputs = [{"output_type": "stream", "name": "stdout", "text": out}] if out else []
        store.add_execution(other, {"source": src, "status": "ok", "outputs": outputs})
    mine = store.create_trajectory(notebook_path="mine.ipynb")
    store.add_execution(mine, {"source": "df = pd.read_csv('x')", "status": "ok"})
    store.add_execution(mine, {"source": "df.tail()", "status": "ok"})
    b = create_backend("ret-train", {}, BackendEnv(store=store))
    ctx = _ctx([("import pandas as pd", ""), ("df = pd.read_csv('y')", "")], tid=mine)
    assert asyncio.run(_next(b, ctx)) == ["df.info()"]
    assert asyncio.run(_out(b, _ctx([], target="df.info()", tid=mine))) == "<class DataFrame>"
    # The trajectory being predicted is never a source: predicting for `other` itself, the
    # answer comes from `mine` (df.tail(), no output), not from `other`'s own df.info().
    assert asyncio.run(_out(b, _ctx([], target="df.info()", tid=other))) == ""
    with pytest.raises(NoPrediction):
        asyncio.run(_next(create_backend("ret-train"), ctx))
