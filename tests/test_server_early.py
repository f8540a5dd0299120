"""The early answer through the real server: while a model backend's first next-cell text is
slow to come, the cell the retrieval backend ranks first is sent, and the model's first text
replaces it (`"replace": true`); it stays when the model has nothing; failures still say so."""

from __future__ import annotations

import pytest

from jupyter_themisto.backends import create_backend
from tests.helpers import open_next_cell_stream, parse_sse, post, server_config, wait_for
from tests.peers import Fault, OpenAIPeer

HISTORY = ["import pandas as pd", "df = pd.read_csv('data.csv')", "df.head()", "df.describe()"]


@pytest.fixture
def peer():
    with OpenAIPeer(reply="df.groupby('a').mean()", chunk_size=4) as p:
        yield p


@pytest.fixture
def early_answer_ms():
    return 100.0


@pytest.fixture
def prediction_timeout():
    return 60.0


@pytest.fixture
def jp_server_config(store_path, peer, early_answer_ms, prediction_timeout):
    openai = {"base_url": peer.url, "api_key": "loopback", "max_retries": 0, "timeout": 10.0}
    return server_config(
        default_backend="openai",
        early_answer_ms=early_answer_ms,
        prediction_timeout=prediction_timeout,
        backend_settings={"openai": openai},
    )


def history(store) -> str:
    """An earlier notebook in which HISTORY ran, and the kernel's own trajectory so far (its
    first three cells): the retrieval backend's first cell for it is HISTORY[3]."""
    earlier = store.create_trajectory(notebook_path="earlier.ipynb")
    for source in HISTORY:
        store.add_execution(earlier, {"source": source, "status": "ok", "outputs": []})
    tid = store.create_trajectory(notebook_path="now.ipynb", kernel_id="k")
    for source in HISTORY[:3]:
        store.add_execution(tid, {"source": source, "status": "ok", "outputs": []})
    return tid


def first_suggestion(events) -> str:
    """Suggestion 0 as the browser folds the chunks (result.ts)."""
    text = ""
    for name, data in events:
        if name == "chunk" and data["index"] == 0:
            text = ("" if data.get("replace") else text) + data["text"]
    return text


async def test_a_slow_models_text_replaces_the_retrieved_cell_shown_first(jp_fetch, store, peer):
    history(store)
    peer.fail(Fault.hang(1.5))  # (nothing of the model's answer for 1.5 s)
    events = parse_sse((await post(jp_fetch, "next-cell", {"kernel_id": "k"})).body.decode())
    chunks = [d for name, d in events if name == "chunk"]
    assert chunks[0] == {"index": 0, "text": HISTORY[3], "done": False}
    assert [c.get("replace", False) for c in chunks] == [False, True] + [False] * (len(chunks) - 2)
    assert first_suggestion(events) == "df.groupby('a').mean()"
    assert events[0][0] == "meta" and events[-1][0] == "done"
    assert len(peer.requests) == 1  # the model was asked all the same


async def test_a_models_text_that_goes_on_from_the_early_answer_never_replaces_it(
    jp_fetch, store, peer
):
    # The model writes the retrieved cell and more, 4 characters a chunk: the screen keeps
    # the early answer while the model's text is its beginning, then gets the rest added.
    history(store)
    peer.reply = HISTORY[3] + "\ndf.info()"
    peer.fail(Fault.hang(1.0))
    events = parse_sse((await post(jp_fetch, "next-cell", {"kernel_id": "k"})).body.decode())
    chunks = [d for name, d in events if name == "chunk" and d["index"] == 0]
    assert chunks[0] == {"index": 0, "text": HISTORY[3], "done": False}
    assert not any(c.get("replace") for c in chunks)
    assert "".join(c["text"] for c in chunks[1:]) == "\ndf.info()"
    assert first_suggestion(events) == peer.reply and chunks[-1]["done"]


async def test_the_retrieved_cell_stays_when_the_model_has_nothing(jp_fetch, store, peer):
    history(store)
    peer.reply = ""
    peer.fail(Fault.hang(1.0))
    events = parse_sse((await post(jp_fetch, "next-cell", {"kernel_id": "k"})).body.decode())
    assert first_suggestion(events) == HISTORY[3]
    chunks = [d for name, d in events if name == "chunk" and d["index"] == 0]
    assert chunks == [
        {"index": 0, "text": HISTORY[3], "done": False},
        {"index": 0, "text": "", "done": True},
    ]
    assert first_suggestion(events) == HISTORY[3] and events[-1][0] == "done"


@pytest.mark.parametrize("prediction_timeout", [2.0])
async def test_a_model_failing_after_the_early_answer_says_so_in_the_stream(jp_fetch, store, peer):
    history(store)
    peer.fail(Fault.hang(4.0))  # past the server's prediction_timeout
    events = parse_sse((await post(jp_fetch, "next-cell", {"kernel_id": "k"})).body.decode())
    assert [name for name, _ in events] == ["meta", "chunk", "error", "done"]
    assert events[1][1]["text"] == HISTORY[3] and events[2][1]["status"] == 504


@pytest.mark.parametrize("early_answer_ms", [0.0, 5000.0])
async def test_no_early_answer_when_off_or_when_the_model_answers_in_time(
    jp_fetch, store, peer, early_answer_ms
):
    history(store)
    if early_answer_ms == 0:
        peer.fail(Fault.hang(1.0))
    events = parse_sse((await post(jp_fetch, "next-cell", {"kernel_id": "k"})).body.decode())
    chunks = [d for name, d in events if name == "chunk"]
    assert chunks and not any(c.get("replace") for c in chunks)
    assert first_suggestion(events) == "df.groupby('a').mean()"


async def test_no_early_answer_from_an_empty_history_nor_for_retrieval_itself(
    jp_fetch, store, peer
):
    tid = store.create_trajectory(notebook_path="now.ipynb", kernel_id="k")
    store.add_execution(tid, {"source": "x = 1", "status": "ok", "outputs": []})
    peer.fail(Fault.hang(1.0))
    events = parse_sse((await post(jp_fetch, "next-cell", {"kernel_id": "k"})).body.decode())
    assert first_suggestion(events) == "df.groupby('a').mean()"
    assert not any(d.get("replace") for name, d in events if name == "chunk")
    history(store)
    body = {"kernel_id": "k", "backend": "retrieval"}
    events = parse_sse((await post(jp_fetch, "next-cell", body)).body.decode())
    assert not any(d.get("replace") for name, d in events if name == "chunk")


async def test_going_away_during_the_early_answer_stops_the_model_upstream(
    jp_fetch, jp_serverapp, store, peer, jp_base_url, jp_http_port, jp_auth_header
):
    history(store)
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    peer.reply = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\nf = 6\n"
    peer.fail(Fault.slow(0.5))
    received, writer = await open_next_cell_stream(
        {"kernel_id": "k"}, jp_http_port, jp_base_url, jp_auth_header
    )
    assert HISTORY[3].encode() in received  # the early answer, the model still streaming
    writer.close()
    await wait_for(lambda: manager.cancelled and peer.disconnects)
    assert manager.cancelled == 1 and peer.disconnects == ["/v1/chat/completions"]


async def test_the_local_models_history_is_the_servers_retrieval_backend(jp_fetch, jp_serverapp):
    """One index of the history per server: the early answer's and the local model's
    continuation (unless the model's settings name retrieval settings of their own)."""
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    retrieval = manager.backend("retrieval")
    assert manager.backend("llamacpp")._retrieval_backend() is retrieval
    own = create_backend("llamacpp", {"retrieval": {"continuation_cells": 0}}, retrieval.env)
    assert own._retrieval_backend() is not retrieval
