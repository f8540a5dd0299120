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


def test_request_cells_with_ids_and_cells_below_reach_the_context(tmp_path):
    """What the browser sends (cells above with ids, cells below) shapes the context: markdown
    beside the recorded run of the code above it, the cells below for a FIM prompt."""
    store = TrajectoryStore(tmp_path / "t.sqlite")
    tid = store.create_trajectory(kernel_id="k")
    for cid, source in [("c0", "import pandas as pd"), ("c1", "df = pd.read_csv('a.csv')")]:
        store.add_execution(tid, {"source": source, "status": "ok", "cell_id": cid})
    req = NextCellRequest.model_validate(
        {
            "kernel_id": "k",
            "cells": [
                {"cell_type": "code", "source": "import pandas as pd", "id": "c0"},
                {"cell_type": "markdown", "source": "Load the sales", "id": "m0"},
                {"cell_type": "code", "source": "df = pd.read_csv('a.csv')", "id": "c1"},
                {"cell_type": "markdown", "source": "Plot revenue", "id": "m1"},
            ],
            "cells_below": [{"cell_type": "code", "source": "plt.show()", "id": "c9"}],
        }
    )
    manager = ThemistoManager(store)
    ctx = manager.context(req, manager.resolve(req))
    assert [c.source for c in ctx.cells] == [
        "import pandas as pd",
        "Load the sales",
        "df = pd.read_csv('a.csv')",
        "Plot revenue",
    ]
    assert [c.source for c in ctx.cells_below] == ["plt.show()"]
    store.close()
