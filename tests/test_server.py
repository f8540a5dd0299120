"""The server extension over real HTTP (pytest-jupyter): routes, validation, SSE, errors, auth."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_themisto.store import TrajectoryStore
from tests.helpers import (
    body_of,
    error_of,
    open_next_cell_stream,
    parse_sse,
    post,
    server_config,
    wait_for,
)
from tests.peers import Fault, OpenAIPeer

PLANTED_KEY = "sk-planted-0123456789abcdef"


@pytest.fixture
def peer():
    with OpenAIPeer(reply=["df.head()", "df.describe()"], api_key=PLANTED_KEY) as p:
        yield p


@pytest.fixture
def jp_server_config(store_path, peer):
    return server_config(
        default_backend="retrieval",  # the server's choice is tested in test_routing.py
        prediction_timeout=5.0,
        backend_settings={
            "openai": {
                "base_url": peer.url,
                "api_key": PLANTED_KEY,
                "timeout": 2.0,
                "max_retries": 1,
                "backoff": 0.05,
            }
        },
    )


def make_trajectory(store, kernel_id="k-1", n=5):
    tid = store.create_trajectory(notebook_path="work/analysis.ipynb", kernel_id=kernel_id)
    sources = [
        "import pandas as pd",
        "df = pd.read_csv('data.csv')",
        "df.head()",
        "df.describe()",
        "df.groupby('a').mean()",
    ]
    ids = []
    for i in range(n):
        ids.append(
            store.add_execution(
                tid,
                {
                    "source": sources[i % len(sources)],
                    "status": "ok",
                    "execution_count": i + 1,
                    "outputs": [{"output_type": "stream", "name": "stdout", "text": f"out {i}\n"}],
                },
            )
        )
    store.write_snapshot(
        ids[-1],
        [
            {"name": "n_rows", "type": "int", "summary": {"repr": "42"}},
            {"name": "df", "type": "pandas.DataFrame", "summary": {"shape": [3, 2], "len": 3}},
            {"name": "api_key", "type": "str", "summary": {"repr": "'hunter2-secret'"}},
        ],
    )
    return tid, ids


async def test_trajectory_routes(jp_fetch, store):
    tid, ids = make_trajectory(store)
    r = await jp_fetch("themisto", "trajectories")
    assert [t["id"] for t in json.loads(r.body)["trajectories"]] == [tid]
    r = await jp_fetch("themisto", "trajectories", params={"notebook_path": "other.ipynb"})
    assert json.loads(r.body)["trajectories"] == []
    r = await jp_fetch("themisto", "trajectories", tid)
    t = json.loads(r.body)
    assert t["n_executions"] == 5 and t["kernel_id"] == "k-1"
    r = await jp_fetch(
        "themisto", "trajectories", tid, "executions", params={"offset": 1, "limit": 2}
    )
    page = json.loads(r.body)
    assert page["total"] == 5
    assert [e["order_index"] for e in page["executions"]] == [1, 2]
    assert page["executions"][0]["outputs"][0]["text"] == "out 1\n"
    r = await jp_fetch("themisto", "executions", str(ids[-1]), "variables")
    variables = {v["name"]: v for v in json.loads(r.body)["variables"]}
    assert variables["n_rows"]["summary"]["repr"] == "42"
    # A secret's value never leaves the server, even if an older store kept its repr.
    assert "hunter2" not in r.body.decode()
    assert variables["api_key"]["summary"] == {"redacted": True}


async def test_a_store_deleted_while_the_server_runs_is_served_anew(jp_fetch, store_path):
    """`rm` the store to start afresh: the kernels' writers record into a new file at the same
    path, and the server serves that one (it went on serving the deleted file until it was
    restarted)."""
    writer = TrajectoryStore(store_path)
    old, _ = make_trajectory(writer)
    r = await jp_fetch("themisto", "trajectories")
    assert [t["id"] for t in json.loads(r.body)["trajectories"]] == [old]
    writer.close()
    for f in store_path.parent.glob(store_path.name + "*"):
        f.unlink()
    with TrajectoryStore(store_path) as writer:
        new, ids = make_trajectory(writer, kernel_id="k-2", n=3)
    r = await jp_fetch("themisto", "trajectories")
    assert [t["id"] for t in json.loads(r.body)["trajectories"]] == [new]
    r = await jp_fetch("themisto", "trajectories", new, "executions")
    assert json.loads(r.body)["total"] == 3
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("themisto", "trajectories", old)
    assert e.value.code == 404


async def test_not_found_and_bad_queries(jp_fetch, store):
    make_trajectory(store)
    assert (await error_of(jp_fetch("themisto", "trajectories", "nope")))[0] == 404
    code, msg = await error_of(jp_fetch("themisto", "trajectories", "nope", "executions"))
    assert code == 404 and "nope" in msg
    assert (await error_of(jp_fetch("themisto", "executions", "999", "variables")))[0] == 404
    code, msg = await error_of(jp_fetch("themisto", "executions", "abc", "variables"))
    assert code == 400 and "execution id" in msg
    code, msg = await error_of(jp_fetch("themisto", "trajectories", params={"limit": "x"}))
    assert code == 400 and msg.startswith("limit")
    code, msg = await error_of(jp_fetch("themisto", "trajectories", params={"offset": "-1"}))
    assert code == 400 and msg.startswith("offset")


async def test_backends_lists_builtins_without_secrets(jp_fetch):
    r = await jp_fetch("themisto", "backends")
    body = json.loads(r.body)
    assert body["default"] == "retrieval"
    names = {b["name"]: b for b in body["backends"]}
    assert {"retrieval", "openai", "anthropic"} <= set(names)
    assert names["retrieval"]["health"]["ok"] is True
    assert "next-cell" in names["retrieval"]["tasks"]
    assert names["anthropic"]["health"]["ok"] is False  # no key configured
    assert PLANTED_KEY not in r.body.decode()


async def test_next_cell_with_retrieval_streams_sse(jp_fetch, store):
    tid, _ = make_trajectory(store)
    other = store.create_trajectory(kernel_id="k-2")
    store.add_execution(other, {"source": "import pandas as pd", "status": "ok"})
    store.add_execution(other, {"source": "df = pd.read_csv('b.csv')", "status": "ok"})
    r = await post(jp_fetch, "next-cell", {"kernel_id": "k-2", "n": 2})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(r.body.decode())
    assert events[0][0] == "meta" and events[0][1]["backend"] == "retrieval"
    assert events[-1][0] == "done"
    chunks = [d for name, d in events if name == "chunk"]
    assert [c["index"] for c in chunks] == [0, 1]
    assert chunks[0]["text"] == "df.head()" and chunks[0]["done"] is True
    # On the 0-1 scale of the models' lists: BM25 over the best match's.
    assert chunks[0]["score"] == 1.0 and 0 < chunks[1]["score"] <= 1.0


async def test_output_prediction_retrieval(jp_fetch, store):
    tid, _ = make_trajectory(store)
    r = await post(jp_fetch, "output", {"trajectory_id": tid, "source": "n_rows"})
    events = parse_sse(r.body.decode())
    assert [d["text"] for n, d in events if n == "chunk"] == ["42\n"]
    r = await post(jp_fetch, "output", {"trajectory_id": tid, "source": "df.shape"})
    assert [d["text"] for n, d in parse_sse(r.body.decode()) if n == "chunk"] == ["(3, 2)\n"]
    r = await post(jp_fetch, "output", {"trajectory_id": tid, "source": "api_key"})
    events = parse_sse(r.body.decode())
    assert [n for n, _ in events] == ["meta", "no_prediction", "done"]
    assert "secret" in events[1][1]["reason"]
    r = await post(
        jp_fetch, "output", {"trajectory_id": tid, "source": "n_rows", "with_runtime": False}
    )
    assert [n for n, _ in parse_sse(r.body.decode())] == ["meta", "no_prediction", "done"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "kernel_id, trajectory_id or notebook_path"),
        ({"kernel_id": "k", "n": 0}, "n:"),
        ({"kernel_id": "k", "n": "many"}, "n:"),
        ({"kernel_id": "k", "with_runtime": "perhaps"}, "with_runtime"),
        ({"kernel_id": "k", "bogus": 1}, "bogus: unknown field"),
        ({"kernel_id": "k", "cells": [{"cell_type": "slide"}]}, "cells.0.cell_type"),
        ({"kernel_id": "k", "after_execution_count": 0}, "after_execution_count:"),
        ({"kernel_id": "k", "after_execution_count": 2**63}, "after_execution_count:"),
        ({"kernel_id": "k", "after_execution_count": "later"}, "after_execution_count:"),
        ([1, 2], "body"),
    ],
)
async def test_next_cell_400_names_the_field(jp_fetch, store, body, field):
    code, msg = await error_of(post(jp_fetch, "next-cell", body))
    assert code == 400 and field in msg


async def test_output_400_and_bad_json(jp_fetch, store):
    code, msg = await error_of(post(jp_fetch, "output", {"kernel_id": "k"}))
    assert code == 400 and "source" in msg
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch("themisto", "predict", "output", method="POST", body="{not json")
    assert info.value.code == 400


async def test_prediction_404s(jp_fetch, store):
    tid, _ = make_trajectory(store)
    code, msg = await error_of(post(jp_fetch, "next-cell", {"kernel_id": "no-such-kernel"}))
    assert code == 404 and "no-such-kernel" in msg
    code, _ = await error_of(post(jp_fetch, "next-cell", {"trajectory_id": "nope"}))
    assert code == 404
    code, msg = await error_of(post(jp_fetch, "next-cell", {"notebook_path": "other.ipynb"}))
    assert code == 404 and "other.ipynb" in msg
    r = await post(jp_fetch, "output", {"notebook_path": "work/analysis.ipynb", "source": "n_rows"})
    assert '"text": "42\\n"' in r.body.decode()
    code, msg = await error_of(post(jp_fetch, "next-cell", {"trajectory_id": tid, "backend": "x9"}))
    assert code == 404 and "x9" in msg


async def test_openai_backend_through_server(jp_fetch, store, peer):
    tid, _ = make_trajectory(store)
    r = await post(jp_fetch, "next-cell", {"trajectory_id": tid, "backend": "openai", "n": 2})
    events = parse_sse(r.body.decode())
    texts: dict[int, str] = {}
    for name, d in events:
        if name == "chunk":
            texts[d["index"]] = texts.get(d["index"], "") + d["text"]
    assert texts == {0: "df.head()", 1: "df.describe()"}
    sent = peer.requests[-1]
    assert sent.body["n"] == 2 and sent.body["stream"] is True
    prompt = sent.body["messages"][1]["content"]
    assert "df = pd.read_csv('data.csv')" in prompt and "n_rows: int" in prompt
    assert "hunter2" not in prompt


async def test_backend_failures_map_to_502_504(jp_fetch, store, peer):
    tid, _ = make_trajectory(store)
    body = {"trajectory_id": tid, "backend": "openai"}
    peer.fail(Fault.error(500), Fault.error(500))
    code, msg = await error_of(post(jp_fetch, "next-cell", body))
    assert code == 502 and "HTTP 500" in msg
    assert len(peer.requests) == 2  # one retry
    peer.fail(Fault.hang(3.0))
    code, msg = await error_of(post(jp_fetch, "next-cell", body))
    assert code == 504 and "timeout" in msg
    # A stream cut before any text came fails before streaming: a plain 502.
    peer.fail(Fault.cut(after_chunks=0))
    assert (await error_of(post(jp_fetch, "next-cell", body)))[0] == 502
    # Cut after the first chunk reached the browser: an `error` event, then `done`.
    peer.reply = "import numpy as np\nx = np.arange(10)\nprint(x)\n"
    peer.fail(Fault.cut(after_chunks=6))
    r = await post(jp_fetch, "next-cell", body)
    events = parse_sse(r.body.decode())
    streamed = "".join(d["text"] for name, d in events if name == "chunk")
    assert events[1][0] == "chunk" and streamed and peer.reply.startswith(streamed)
    assert events[-2][0] == "error" and events[-2][1]["status"] == 502
    assert "cut off" in events[-2][1]["message"]
    assert events[-1][0] == "done"
    # Failed requests write nothing.
    assert store.count_trajectories() == 1 and store.count_executions() == 5
    assert store.blob_stats()["count"] == 0


async def test_disconnect_cancels_backend(
    jp_fetch, jp_serverapp, store, peer, jp_base_url, jp_http_port, jp_auth_header
):
    tid, _ = make_trajectory(store)
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    peer.reply = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\nf = 6\n"
    peer.fail(Fault.slow(0.3))
    body = {"trajectory_id": tid, "backend": "openai"}
    received, writer = await open_next_cell_stream(body, jp_http_port, jp_base_url, jp_auth_header)
    assert b"200 OK" in received
    writer.close()
    await wait_for(lambda: manager.cancelled and peer.disconnects)
    assert manager.cancelled == 1
    # The model server saw its client go away: generation stopped upstream too.
    assert peer.disconnects


async def test_newer_request_supersedes_older(jp_fetch, jp_serverapp, store, peer):
    tid, _ = make_trajectory(store)
    manager = jp_serverapp.web_app.settings["themisto_manager"]
    peer.fail(Fault.hang(1.5))
    body = {"trajectory_id": tid, "backend": "openai", "client_id": "tab-1"}
    older = asyncio.ensure_future(post(jp_fetch, "next-cell", body))
    await wait_for(lambda: peer.requests)  # the older one is at the model server
    newer = await post(jp_fetch, "next-cell", body)
    assert parse_sse(newer.body.decode())[-1][0] == "done"
    code, msg = await error_of(older)
    assert code == 409 and "superseded" in msg
    assert manager.superseded == 1
    # The model server saw the superseded request's connection go (its answer, once it came,
    # had nobody to go to): upstream work is not left running.
    await wait_for(lambda: peer.disconnects)
    assert peer.disconnects == ["/v1/chat/completions"]


ROUTES = [
    ("GET", ("themisto", "trajectories")),
    ("GET", ("themisto", "trajectories", "x")),
    ("GET", ("themisto", "trajectories", "x", "executions")),
    ("GET", ("themisto", "executions", "1", "variables")),
    ("GET", ("themisto", "executions", "1", "variables", "x", "blob")),
    ("GET", ("themisto", "backends")),
    ("POST", ("themisto", "predict", "next-cell")),
    ("POST", ("themisto", "predict", "output")),
]


@pytest.mark.parametrize("method, parts", ROUTES)
async def test_unauthenticated_requests_are_refused(jp_fetch, store, method, parts):
    kw = {"body": json.dumps({"trajectory_id": "x", "source": "1"})} if method == "POST" else {}
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch(*parts, method=method, headers={"Authorization": ""}, **kw)
    assert info.value.code == 403


async def test_planted_key_never_leaks(jp_fetch, jp_serverapp, store, peer, caplog):
    caplog.set_level(logging.DEBUG)
    # The extension's own log does not propagate to the root logger: listen to it directly.
    ext_log = next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_themisto"])).log
    ext_lines = io.StringIO()
    handler = logging.StreamHandler(ext_lines)
    ext_log.addHandler(handler)
    level = ext_log.level
    ext_log.setLevel(logging.DEBUG)
    tid, ids = make_trajectory(store)
    body = {"trajectory_id": tid, "backend": "openai"}
    bodies = [
        await body_of(jp_fetch("themisto", "backends")),
        await body_of(jp_fetch("themisto", "trajectories")),
        await body_of(jp_fetch("themisto", "trajectories", tid)),
        await body_of(jp_fetch("themisto", "trajectories", tid, "executions")),
        await body_of(jp_fetch("themisto", "executions", str(ids[-1]), "variables")),
        await body_of(post(jp_fetch, "next-cell", body)),
    ]
    # Real servers echo (part of) a refused key in the error message.
    peer.fail(Fault.error(401, message=f"Incorrect API key provided: {PLANTED_KEY}"))
    bodies.append(await body_of(post(jp_fetch, "next-cell", body)))
    assert b"HTTP 401" in bodies[-1] and b"***" in bodies[-1]
    peer.fail(Fault.error(429), Fault.error(429))
    bodies.append(await body_of(post(jp_fetch, "output", {**body, "source": "df"})))
    assert b"HTTP 429" in bodies[-1]
    peer.fail(Fault.malformed())
    bodies.append(await body_of(post(jp_fetch, "next-cell", body)))
    assert b"malformed JSON" in bodies[-1]
    peer.fail(Fault.hang(3))
    bodies.append(await body_of(post(jp_fetch, "next-cell", body)))
    ext_log.removeHandler(handler)
    ext_log.setLevel(level)
    for b in bodies:
        assert PLANTED_KEY not in b.decode()
    assert caplog.text and PLANTED_KEY not in caplog.text
    # The retries after the 429s went through the extension's log: it was heard, and is clean.
    assert "retrying" in ext_lines.getvalue() and PLANTED_KEY not in ext_lines.getvalue()


async def test_output_waits_for_a_pending_snapshot_and_refuses_a_stale_one(jp_fetch, store):
    tid, _ = make_trajectory(store)
    body = {"trajectory_id": tid, "source": "n_rows"}
    # A later execution without a snapshot: the recorded n_rows may be out of date.
    store.add_execution(tid, {"source": "n_rows = 7", "status": "ok", "snapshot_status": "off"})
    events = parse_sse((await post(jp_fetch, "output", body)).body.decode())
    assert events[1][0] == "no_prediction" and "snapshot" in events[1][1]["reason"]
    # A pending snapshot written while the request waits is used.
    eid = store.add_execution(
        tid, {"source": "n_rows = 8", "status": "ok", "snapshot_status": "pending"}
    )

    async def write_later():
        await asyncio.sleep(0.3)
        store.write_snapshot(eid, [{"name": "n_rows", "type": "int", "summary": {"repr": "8"}}])

    writer = asyncio.ensure_future(write_later())
    events = parse_sse((await post(jp_fetch, "output", body)).body.decode())
    await writer
    assert events[1] == ("chunk", {"text": "8\n"})
    # A snapshot skipped (or failed) after a later execution leaves the summary of n_rows = 8.
    eid = store.add_execution(tid, {"source": "n_rows = 9", "status": "ok"})
    store.write_snapshot(eid, [], status="skipped", detail="the store was busy")
    events = parse_sse((await post(jp_fetch, "output", body)).body.decode())
    assert events[1][0] == "no_prediction" and "snapshot" in events[1][1]["reason"]


async def test_variable_blob_only_on_explicit_request(jp_fetch, store):
    import pickle

    tid = store.create_trajectory()
    eid = store.add_execution(tid, {"source": "xs = [1, 2]", "status": "ok"})
    digest = store.put_blob(pickle.dumps([1, 2], protocol=5))
    secret = store.put_blob(pickle.dumps("hunter2-secret"))
    store.write_snapshot(
        eid,
        [
            {"name": "xs", "type": "list", "summary": {"repr": "[1, 2]"}, "blob_hash": digest},
            {"name": "db_password", "type": "str", "summary": {}, "blob_hash": secret},
            {"name": "fh", "type": "_io.TextIOWrapper", "stub_reason": "open file"},
        ],
    )
    listing = (await jp_fetch("themisto", "executions", str(eid), "variables")).body.decode()
    assert digest not in listing and "blob_hash" not in listing
    r = await jp_fetch("themisto", "executions", str(eid), "variables", "xs", "blob")
    assert pickle.loads(r.body) == [1, 2]
    assert r.headers["Content-Type"] == "application/octet-stream"
    code, msg = await error_of(
        jp_fetch("themisto", "executions", str(eid), "variables", "db_password", "blob")
    )
    assert code == 404 and "redacted" in msg
    code, msg = await error_of(
        jp_fetch("themisto", "executions", str(eid), "variables", "fh", "blob")
    )
    assert code == 404 and "open file" in msg
    code, _ = await error_of(
        jp_fetch("themisto", "executions", str(eid), "variables", "zz", "blob")
    )
    assert code == 404
