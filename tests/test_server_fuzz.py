"""Property-based fuzzing of every /themisto route against a real jupyter_server: whatever the
path segments, query arguments, method and body, the answer is never a 5xx, and every 4xx
carries a JSON body whose message says what was wrong.

The inputs are derived from a fixed seed (hypothesis `derandomize`), so that a run in CI is
reproducible; set THEMISTO_FUZZ_EXAMPLES (e.g. 2000) to explore that many random inputs per
route instead.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tornado.httpclient import HTTPClientError

from jupyter_themisto.store import TrajectoryStore
from tests.peers import AnthropicPeer, OpenAIPeer

EXAMPLES = int(os.environ.get("THEMISTO_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="THEMISTO_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    # One server serves every example (starting one per example would take minutes).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Backends that answer here (the model servers are loopback peers); llamacpp and seq2seq would
# need a model loaded, which is not what these tests are about.
BACKENDS = ["retrieval", "openai", "anthropic", "repeat-previous", "ret-context", "preview"]
SQL_EDGES = [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]


@pytest.fixture
def peers():
    with OpenAIPeer(reply="df.head()") as o, AnthropicPeer(reply="df.tail()") as a:
        yield o, a


@pytest.fixture
def jp_server_config(store_path, peers):
    o, a = peers
    quick = {"timeout": 5.0, "max_retries": 0}
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_themisto": True}},
        "ThemistoExtensionApp": {
            "auto_record": False,
            # Not the embedded model (the default with the [llm] extra): these tests are not
            # about it, and it would answer slowly on a busy machine.
            "default_backend": "retrieval",
            "prediction_timeout": 20.0,
            "snapshot_wait": 0.2,
            "execution_wait": 0.2,
            "backend_settings": {
                "openai": {"base_url": o.url, "api_key": "sk-fuzz-0123456789", **quick},
                "anthropic": {"base_url": a.base, "api_key": "fuzz-key", **quick},
            },
        },
    }


@pytest.fixture
def ids(store_path):
    """A recorded trajectory to aim at: its id and its executions' ids."""
    with TrajectoryStore(store_path) as store:
        tid = store.create_trajectory(notebook_path="fuzz.ipynb", kernel_id="k-fuzz")
        eids = []
        for i, src in enumerate(["import pandas as pd", "df = pd.DataFrame()", "df.head()"]):
            out = [{"output_type": "stream", "name": "stdout", "text": f"{i}\n"}]
            eids.append(
                store.add_execution(
                    tid, {"source": src, "status": "ok", "outputs": out, "execution_count": i + 1}
                )
            )
        blob = store.put_blob(b"\x80\x05K\x03.")  # pickle of 3
        store.write_snapshot(
            eids[-1],
            [{"name": "n", "type": "int", "summary": {"repr": "3"}, "blob_hash": blob}],
        )
    return tid, eids


# -- strategies ----------------------------------------------------------------------------------


# Percent-escapes sent as they are: invalid UTF-8, NUL, an encoded slash, a lone surrogate.
RAW_ESCAPES = ["%ED%A0%80", "%FF%FE", "%00", "%2F", "%C0%AF", "%", "%zz"]


def segments(known: list[str]) -> st.SearchStrategy[str]:
    """A path segment as sent: a known id, a number at SQLite's edges, any text (percent-
    encoded), or a raw escape."""
    text = st.one_of(
        st.sampled_from(SQL_EDGES).map(str),
        st.sampled_from(known),
        st.integers().map(str),
        st.text(min_size=1, max_size=60),
        st.sampled_from(["..", ".", "1e3", "0x10", " 7 ", "١٢", "9" * 5000]),
    ).map(lambda s: quote(s, safe=""))
    return st.one_of(text, st.sampled_from(RAW_ESCAPES))


QUERY_VALUES = st.one_of(
    st.one_of(
        st.sampled_from(SQL_EDGES).map(str),
        st.integers().map(str),
        st.text(max_size=40),
        st.sampled_from(["", "1.5", "nan", "1e999", "١٢", "9" * 5000, "\x00"]),
    ).map(lambda s: quote(s, safe="")),
    st.sampled_from(RAW_ESCAPES),
)
QUERIES = st.lists(
    st.tuples(
        st.sampled_from(["offset", "limit", "notebook_path", "kernel_id", "other"]), QUERY_VALUES
    ),
    min_size=1,
    max_size=3,
)


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=30),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
        ),
        max_leaves=12,
    )


def bodies(tid: str) -> st.SearchStrategy[bytes]:
    """Request bodies: well-formed requests with odd field values, any JSON, and not JSON."""
    field = {
        "kernel_id": st.one_of(st.just("k-fuzz"), st.text(max_size=250), json_values()),
        "trajectory_id": st.one_of(st.just(tid), st.text(max_size=250), json_values()),
        "notebook_path": st.one_of(st.just("fuzz.ipynb"), st.text(max_size=50), json_values()),
        "backend": st.one_of(st.sampled_from(BACKENDS), st.text(max_size=20), json_values()).filter(
            lambda b: b not in ("llamacpp", "seq2seq")
        ),
        "with_runtime": st.one_of(st.booleans(), json_values()),
        "client_id": st.one_of(st.text(max_size=20), json_values()),
        "n": st.one_of(st.integers(min_value=-5, max_value=25), json_values()),
        "after_execution_count": st.one_of(
            st.integers(min_value=-5, max_value=8), st.sampled_from(SQL_EDGES), json_values()
        ),
        "warm": st.one_of(st.booleans(), json_values()),
        "source": st.one_of(st.text(max_size=200), st.just("df.shape"), json_values()),
        "cells": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"cell_type": st.sampled_from(["code", "markdown", "raw", "x"])},
                    optional={"source": st.one_of(st.text(max_size=100), json_values())},
                ),
                max_size=5,
            ),
            json_values(),
        ),
    }
    requests = st.fixed_dictionaries({}, optional={**field, "extra": json_values()})
    as_json = st.one_of(requests, json_values()).map(
        lambda v: json.dumps(v, allow_nan=True).encode()
    )
    surrogates = st.sampled_from(["kernel_id", "trajectory_id", "source", "backend"]).map(
        lambda k: f'{{"{k}": "a\\ud800b", "trajectory_id": "{tid}", "source": "x"}}'.encode()
    )
    nested = st.integers(min_value=1, max_value=200_000).map(
        lambda d: b'{"cells": ' + b"[" * d + b"]" * d + b"}"
    )
    return st.one_of(as_json, surrogates, nested, st.binary(max_size=200))


# -- the property ------------------------------------------------------------------------------


def check(code: int, headers: Any, body: bytes, what: str) -> None:
    assert code < 500, f"{what} -> {code}: {body[:500]!r}"
    if code >= 400:
        message = json.loads(body)["message"]
        assert isinstance(message, str) and message.strip(), f"{what}: {body[:300]!r}"
    elif "text/event-stream" in headers.get("Content-Type", ""):
        # A stream's own errors (status >= 500 in an error event) count as 5xx too.
        for block in body.decode().split("\n\n"):
            if block.startswith("event: error"):
                data = json.loads(block.split("data: ", 1)[1])
                assert data["status"] < 500, f"{what} -> error event {data}"


@pytest.fixture
def fetch(jp_serverapp, http_server_client, jp_base_url, jp_auth_header, jp_asyncio_loop):
    """Send one request with the path and query exactly as given (jp_fetch would encode them
    again); returns (status, headers, body) whatever the status."""

    def send(method: str, path: str, query: list[tuple[str, str]], body: bytes | None):
        url = jp_base_url.rstrip("/") + "/" + path
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query)
        kw: dict[str, Any] = {"method": method, "headers": dict(jp_auth_header)}
        if body is not None:
            kw["body"] = body
        elif method in ("POST", "PUT", "PATCH"):
            kw["body"] = b""
        try:
            r = jp_asyncio_loop.run_until_complete(
                http_server_client.fetch(url, request_timeout=60, **kw)
            )
            return r.code, r.headers, r.body
        except HTTPClientError as e:
            assert e.response is not None, f"{method} {url}: no response ({e})"
            return e.code, e.response.headers, e.response.body

    return send


ROUTES = [
    ("GET", "themisto/trajectories"),
    ("GET", "themisto/trajectories/{t}"),
    ("GET", "themisto/trajectories/{t}/executions"),
    ("GET", "themisto/executions/{e}/variables"),
    ("GET", "themisto/executions/{e}/variables/{v}/blob"),
    ("GET", "themisto/backends"),
    ("POST", "themisto/predict/next-cell"),
    ("POST", "themisto/predict/output"),
]


@pytest.mark.parametrize("method, route", ROUTES)
def test_no_input_gives_a_5xx(fetch, ids, method, route):
    tid, eids = ids

    @FUZZ
    @given(
        t=segments([tid, tid[:8]]),
        e=segments([str(x) for x in eids]),
        v=segments(["n", "df", "nope"]),
        query=QUERIES,
        body=bodies(tid),
        other_method=st.sampled_from([method] * 5 + ["PUT", "DELETE", "PATCH"]),
    )
    def run(t, e, v, query, body, other_method):
        path = route.format(t=t, e=e, v=v)
        send = body if other_method in ("POST", "PUT", "PATCH") else None
        code, headers, data = fetch(other_method, path, query, send)
        check(code, headers, data, f"{other_method} {path} {query} {send!r:.200}")

    run()


# -- the inputs that gave a 500 before, each with the field named ---------------------------------


@pytest.mark.parametrize(
    "path, query, field",
    [
        ("themisto/trajectories", [("offset", str(2**63))], "offset"),
        ("themisto/trajectories", [("limit", str(2**64))], "limit"),
        ("themisto/trajectories/{t}/executions", [("offset", str(10**30))], "offset"),
        ("themisto/trajectories/{t}/executions", [("limit", "9" * 5000)], "limit"),
        ("themisto/executions/99999999999999999999/variables", [], "execution id"),
        ("themisto/executions/99999999999999999999/variables/n/blob", [], "execution id"),
        ("themisto/trajectories", [("notebook_path", "%ED%A0%80")], "notebook_path"),
    ],
)
def test_former_500s_are_400s_naming_the_field(fetch, ids, path, query, field):
    tid, _ = ids
    code, _, body = fetch("GET", path.format(t=tid), query, None)
    assert code == 400, body
    assert field in json.loads(body)["message"], body


@pytest.mark.parametrize(
    "body, field",
    [
        (b'{"cells": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
        (b'{"trajectory_id": "a\\ud800", "source": "x"}', "trajectory_id"),
        (b'{"trajectory_id": "t", "source": "\\udfff"}', "source"),
        (b'{"trajectory_id": "t", "source": "x", "n": 1e999}', "n"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(fetch, ids, body, field):
    for task in ("next-cell", "output"):
        code, _, data = fetch("POST", f"themisto/predict/{task}", [], body)
        if field == "n" and task == "output":
            assert code == 400 and "n" in json.loads(data)["message"], data
            continue
        assert code == 400, data
        assert field in json.loads(data)["message"], data


def test_a_variable_name_no_header_can_carry(fetch, ids, store_path):
    _, eids = ids
    name = 'we"ird\nname é'
    with TrajectoryStore(store_path) as store:
        blob = store.put_blob(b"\x80\x05K\x04.")
        store.write_snapshot(eids[0], [{"name": name, "type": "int", "blob_hash": blob}])
    path = f"themisto/executions/{eids[0]}/variables/{quote(name, safe='')}/blob"
    code, headers, body = fetch("GET", path, [], None)
    assert code == 200 and body == b"\x80\x05K\x04."
    assert "filename*=UTF-8''we%22ird%0Aname%20%C3%A9.pickle" in headers["Content-Disposition"]
