"""ThemistoManager without HTTP: how a request's context is read from the store."""

from __future__ import annotations

from jupyter_themisto.server.manager import ThemistoManager
from jupyter_themisto.server.models import NextCellRequest
from jupyter_themisto.store import TrajectoryStore


def test_context_reads_as_much_of_the_tail_as_fits(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    tid = store.create_trajectory(kernel_id="k")
    for i in range(500):
        store.add_execution(tid, {"source": f"a{i} = {i}", "status": "ok"})
    req = NextCellRequest.model_validate({"kernel_id": "k"})
    small = ThemistoManager(store, token_budget=300)
    ctx = small.context(req, small.resolve(req))
    assert 10 < len(ctx.cells) < 48 and ctx.cells[-1].source == "a499 = 499"
    big = ThemistoManager(store, token_budget=3000)
    ctx = big.context(req, big.resolve(req))
    # Tiny cells: more than the first read of 48 fit in the budget, so more were read.
    assert len(ctx.cells) > 48
    sources = [c.source for c in ctx.cells]
    assert sources == [f"a{i} = {i}" for i in range(500 - len(sources), 500)]
    huge = ThemistoManager(store, token_budget=100_000)
    assert len(huge.context(req, huge.resolve(req)).cells) == 500
    store.close()
