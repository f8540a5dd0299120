"""Which backend answers when a request names none: the embedded code model where the [llm] extra
is installed (it is, in CI), else retrieval; a new user with nothing recorded still gets a
suggestion; a warm request prepares the next one."""

from __future__ import annotations

import asyncio
import json

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_themisto.backends import default_backend_name, model_files
from jupyter_themisto.backends._local import loaded_models
from jupyter_themisto.backends.llamacpp import local_model_installed
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import engine_runs, parse_sse, post, server_config, wait_for


@pytest.fixture
def early_answer_ms():
    return 50.0


@pytest.fixture
def jp_server_config(store_path, early_answer_ms):
    return server_config(
        early_answer_ms=early_answer_ms, backend_settings={"llamacpp": {"max_tokens": 24}}
    )


def test_the_default_is_the_local_model_when_installed(monkeypatch):
    assert local_model_installed()
    assert default_backend_name() == "llamacpp"
    # One slice missing: the model cannot be made, so retrieval stays the default.
    real = model_files.part_path
    sixth = model_files.QWEN_CODER_05B.parts[5]
    monkeypatch.setattr(
        model_files, "part_path", lambda part: None if part == sixth else real(part)
    )
    monkeypatch.setattr(model_files, "find_model", lambda spec: None)
    assert not local_model_installed()
    assert default_backend_name() == "retrieval"


async def test_the_server_routes_to_the_code_model(jp_fetch, store_path):
    listing = json.loads((await jp_fetch("themisto", "backends")).body)
    assert listing["default"] == "llamacpp"
    health = {b["name"]: b["health"] for b in listing["backends"]}["llamacpp"]
    assert health["ok"] is True and "qwen2.5-coder-0.5b" in health["detail"]
    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(notebook_path="a.ipynb", kernel_id="k-1")
    for i, source in enumerate(["import math", "r = 2.0", "area = math.pi * r ** 2"]):
        store.add_execution(tid, {"source": source, "status": "ok", "execution_count": i + 1})
    store.close()
    for _ in range(2):
        r = await post(jp_fetch, "next-cell", {"trajectory_id": tid, "n": 1})
        events = parse_sse(r.body.decode())
        assert events[0][0] == "meta" and events[0][1]["backend"] == "llamacpp"
        assert events[-1][0] == "done"
        text = "".join(d["text"] for name, d in events if name == "chunk")
        assert text.strip() and text.strip() != "area = math.pi * r ** 2"
    # the default model (the larger one may be loaded too, by an earlier test of this process)
    assert any(k[0] == "llamacpp" and "qwen2.5-coder-0.5b" in k[1] for k in loaded_models())


async def test_a_new_user_with_an_empty_store_gets_a_suggestion(jp_fetch, store_path):
    """Nothing recorded at all: the cells the browser sends are enough for the model."""
    assert TrajectoryStore(store_path).list_trajectories() == []
    body = {
        "kernel_id": "never-recorded",
        "notebook_path": "new.ipynb",
        "n": 1,
        "cells": [
            {"cell_type": "markdown", "source": "# Loading the iris data"},
            {"cell_type": "code", "source": "import pandas as pd"},
            {"cell_type": "code", "source": "iris = pd.read_csv('iris.csv')"},
        ],
    }
    r = await post(jp_fetch, "next-cell", body)
    events = parse_sse(r.body.decode())
    assert events[0][1]["backend"] == "llamacpp"
    text = "".join(d["text"] for name, d in events if name == "chunk")
    assert text.strip(), events
    # Retrieval has nothing to go on there: it says so, it does not make something up.
    r = await post(jp_fetch, "next-cell", {**body, "backend": "retrieval"})
    assert [name for name, _ in parse_sse(r.body.decode())][1] == "no_prediction"
    # Without cells there is nothing at all to go on: a clear 404.
    del body["cells"]
    with pytest.raises(HTTPClientError) as e:
        await post(jp_fetch, "next-cell", body)
    assert e.value.code == 404 and "no trajectory recorded" in e.value.response.body.decode()


async def assert_prompt_cached(backend, ctx) -> None:
    """The next-cell prompt for `ctx` is in the local model's cache, whole (asked of the engine
    directly, once the suggestion the warm-up writes ahead, in the prompt's slot, is stopped)."""
    backend.stop_ahead()
    await asyncio.gather(*backend._writing_ahead.values(), return_exceptions=True)
    from jupyter_themisto.backends._local import Completion
    from jupyter_themisto.backends.prompts import next_cell_prompt

    job = Completion.of(next_cell_prompt(ctx, backend.prompt_options), 2)
    model = backend.shared()
    with model.lock:
        answer = model.model.handle_completions(backend.request(job, stream=False))
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1


async def test_a_warm_request_prepares_and_answers_nothing(jp_fetch, jp_serverapp):
    cells = [
        {"cell_type": "code", "source": "import numpy as np"},
        {"cell_type": "code", "source": "xs = np.linspace(0, 1, 50)"},
    ]
    body = {"notebook_path": "w.ipynb", "kernel_id": "k-warm", "cells": cells, "warm": True}
    r = await post(jp_fetch, "next-cell", body)
    assert r.code == 204 and r.body == b""
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    backend = manager.backend(None)
    # The prompt of the suggestion asked next is in the engine's cache now, whole.
    from jupyter_themisto.server.models import NextCellRequest

    ctx = manager.browser_context(NextCellRequest.model_validate({**body, "warm": False}))
    await assert_prompt_cached(backend, ctx)
    # A warm request for a backend with nothing to prepare is answered the same way.
    body["backend"] = "retrieval"
    r = await post(jp_fetch, "next-cell", body)
    assert r.code == 204


def record(store: TrajectoryStore, kernel_id: str, sources: list[str]) -> str:
    """A trajectory of kernel `kernel_id` in which `sources` ran; its id."""
    tid = store.create_trajectory(notebook_path=f"{kernel_id}.ipynb", kernel_id=kernel_id)
    for i, source in enumerate(sources):
        store.add_execution(tid, {"source": source, "status": "ok", "execution_count": i + 1})
    return tid


async def test_a_warm_request_as_a_cell_starts_covers_that_cell(jp_fetch, jp_serverapp, store_path):
    """Sent as a cell starts running: the cell is not recorded yet, but its source is read."""
    from jupyter_themisto.context import ContextCell

    store = TrajectoryStore(store_path)
    recorded = ["import numpy as np", "xs = np.arange(10)"]
    record(store, "k-run", recorded)
    running = "ys = xs ** 2"
    cells = [{"cell_type": "code", "source": s} for s in [*recorded, running]]
    body = {"kernel_id": "k-run", "cells": cells, "warm": True, "with_runtime": False}
    r = await post(jp_fetch, "next-cell", body)
    assert r.code == 204
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    backend = manager.backend(None)
    # The prompt that ends with the running cell is in the cache.
    from jupyter_themisto.context import PredictionContext

    ctx = PredictionContext(
        cells=[ContextCell(source=c["source"], order_index=i) for i, c in enumerate(cells)],
        with_runtime=False,
    )
    await assert_prompt_cached(backend, ctx)
    store.close()


async def test_typing_on_stops_the_suggestion_being_written_ahead(
    jp_fetch, jp_serverapp, store_path
):
    """The plugin's `stop_ahead`, sent when the typing goes on after a warm-up with `ahead`:
    the suggestion for the cell as it was stops at the next token, and none is kept."""
    store = TrajectoryStore(store_path)
    recorded = ["import numpy as np"]
    record(store, "k-stop", recorded)
    cells = [{"cell_type": "code", "source": s} for s in [*recorded, "xs = np.arange(10)"]]
    body = {"kernel_id": "k-stop", "cells": cells, "warm": True, "ahead": True}
    assert (await post(jp_fetch, "next-cell", body)).code == 204
    backend = jp_serverapp.web_app.settings["themisto_manager"].backend(None)
    (writing,) = backend._writing_ahead.values()
    r = await post(jp_fetch, "next-cell", {"kernel_id": "k-stop", "stop_ahead": True})
    assert r.code == 204 and not r.body
    await asyncio.gather(writing, return_exceptions=True)
    assert writing.cancelled() and "k-stop" not in backend._ahead
    # It asks for nothing else: combined with a warm-up, a clear error.
    for extra in ({"warm": True}, {"ahead": True}):
        with pytest.raises(HTTPClientError) as e:
            await post(jp_fetch, "next-cell", {"kernel_id": "k-stop", "stop_ahead": True, **extra})
        assert e.value.code == 400
        assert "stop_ahead asks for nothing else" in e.value.response.body.decode()
    store.close()


async def typed_after_two_cells(jp_fetch, store, kernel_id, typed):
    """Two cells recorded, then `typed` warmed with `ahead` as at a pause in its typing (204);
    the trajectory id and that warm-up's body."""
    recorded = ["import numpy as np", "import matplotlib.pyplot as plt"]
    tid = record(store, kernel_id, recorded)
    cells = [{"cell_type": "code", "source": s} for s in [*recorded, typed]]
    body = {"kernel_id": kernel_id, "cells": cells, "warm": True, "ahead": True}
    assert (await post(jp_fetch, "next-cell", body)).code == 204
    return tid, body


@pytest.mark.parametrize("early_answer_ms", [1.0])
async def test_the_suggestion_written_ahead_is_on_screen_first_once_the_cell_ran(
    jp_fetch, jp_serverapp, store_path
):
    """The plugin's warm-up (a cell typed, or starting to run) lets the model write that cell's
    suggestion ahead; asked for once the cell ran, it is the answer, at once: the run's output
    is not in the prompt (only an error would be), so the model is not asked again."""
    store = TrajectoryStore(store_path)
    typed = "xs = np.linspace(0, 10, 100)\nys = np.sin(xs)\nprint(ys.max())"
    tid, body = await typed_after_two_cells(jp_fetch, store, "k-ahead", typed)
    backend = jp_serverapp.web_app.settings["themisto_manager"].backend(None)
    (ran, _, written, _) = await wait_for(lambda: backend._ahead.get("k-ahead"))
    assert ran == typed and written.strip()
    output = {"output_type": "stream", "name": "stdout", "text": "0.9999270909904768\n"}
    store.add_execution(
        tid, {"source": typed, "status": "ok", "execution_count": 3, "outputs": [output]}
    )
    runs = engine_runs(backend)
    body = {"kernel_id": "k-ahead", "n": 1}
    events = parse_sse((await post(jp_fetch, "next-cell", body)).body.decode())
    chunks = [d for name, d in events if name == "chunk" and d["index"] == 0]
    assert chunks[0]["text"] == written and not any(c.get("replace") for c in chunks)
    assert "".join(c["text"] for c in chunks) == written and chunks[-1]["done"]
    assert events[-1][0] == "done" and runs == []
    store.close()


@pytest.mark.parametrize("early_answer_ms", [1.0])
async def test_a_suggestion_asked_while_it_is_written_ahead_follows_the_writing(
    jp_fetch, jp_serverapp, store_path
):
    """Asked before the answer written ahead is done (the cell ran at once after the pause),
    the suggestion is that answer, as it is written: the warm-up as the cell starts running
    does not stop it, and the model is not asked again."""
    store = TrajectoryStore(store_path)
    typed = "xs = np.linspace(0, 10, 100)\nys = np.sin(xs)"
    tid, body = await typed_after_two_cells(jp_fetch, store, "k-follow", typed)
    backend = jp_serverapp.web_app.settings["themisto_manager"].backend(None)
    writing = await wait_for(lambda: backend._writing.get("k-follow"))
    del body["ahead"]  # (as the cell starts running)
    assert (await post(jp_fetch, "next-cell", body)).code == 204
    store.add_execution(tid, {"source": typed, "status": "ok", "execution_count": 3})
    # Counted once its first words came: its own run began (the engine's thread looks the run
    # up when it starts, which a loaded machine can delay past this point), and a streamed
    # answer has no stand-ins after it. A run counted from here is the model asked again.
    await wait_for(lambda: writing.chunks or writing.over)
    runs = engine_runs(backend)
    # (mostly still being written when asked; done or not, the run-start warm-up left it going)
    assert typed in writing.prompt
    body = {"kernel_id": "k-follow", "n": 1}
    events = parse_sse((await post(jp_fetch, "next-cell", body)).body.decode())
    chunks = [d for name, d in events if name == "chunk" and d["index"] == 0]
    text = ""
    for c in chunks:  # (an early answer may be on screen until the model's text replaces it)
        text = c["text"] if c.get("replace") else text + c["text"]
    assert text.strip() and chunks[-1]["done"]
    assert events[-1][0] == "done" and runs == []
    (ran, _, written, _) = backend._ahead["k-follow"]
    assert ran == typed and written == text
    store.close()
