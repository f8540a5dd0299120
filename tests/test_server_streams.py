"""A model server cannot exhaust the Jupyter server's memory: endless lines, huge events and
endless streams from real loopback servers, through a real jupyter_server, memory measured."""

from __future__ import annotations

import json
import re

import pytest
from tornado.httpclient import HTTPClientError

from tests.helpers import post, server_config
from tests.peers import AnthropicPeer, Fault, OpenAIPeer

KEY = "sk-ant-stream-test-0123456789"
# Each endless answer stops there at the latest: a regression fails instead of filling the
# shared machine (unbounded, four of them grew a server from 98 MB to 1.76 GB).
LIMIT = 512 << 20


@pytest.fixture
def peers():
    with OpenAIPeer(reply="df.head()") as o, AnthropicPeer(reply="df.tail()", api_key=KEY) as a:
        yield {"openai": o, "anthropic": a}


@pytest.fixture
def jp_server_config(store_path, peers):
    # Default line and event bounds; a smaller total keeps the endless stream of valid events
    # (each one relayed to the browser) short.
    settings = {"timeout": 10.0, "max_retries": 0, "max_response_bytes": 2 << 20}
    return server_config(
        # Not the embedded model (the default with the [llm] extra): these tests are not
        # about it, and it would answer slowly on a busy machine.
        default_backend="retrieval",
        prediction_timeout=60.0,
        backend_settings={
            "openai": {"base_url": peers["openai"].url, **settings},
            "anthropic": {"base_url": peers["anthropic"].base, "api_key": KEY, **settings},
        },
    )


def chunk_text(sse: str) -> str:
    """The text of a next-cell stream's chunks (its first suggestion)."""
    out = []
    for block in sse.split("\n\n"):
        if block.startswith("event: chunk"):
            data = json.loads(block.split("data: ", 1)[1])
            if data.get("index", 0) == 0:
                out.append(data["text"])
    return "".join(out)


def peak_rss() -> int:
    """The process's peak resident memory since the last reset_peak (Linux VmHWM), bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


async def predict(jp_fetch, body: dict) -> tuple[int, str]:
    try:
        r = await post(jp_fetch, "next-cell", body)
        return r.code, r.body.decode()
    except HTTPClientError as e:
        return e.code, e.response.body.decode()


FAULTS = [
    (Fault.endless_line(LIMIT), "max_line_bytes"),
    (Fault.huge_event(LIMIT), "max_event_bytes"),
    (Fault.endless_events(LIMIT), "max_response_bytes"),
    (Fault.gzip_line(LIMIT >> 10), "max_line_bytes"),
]


async def test_endless_answers_leave_the_server_memory_bounded(jp_fetch, store, peers):
    tid = store.create_trajectory(kernel_id="k-stream")
    store.add_execution(tid, {"source": "import pandas as pd", "status": "ok"})
    # Warm up both backends (imports, connection pools) before measuring.
    for name in ("openai", "anthropic"):
        code, text = await predict(jp_fetch, {"trajectory_id": tid, "backend": name})
        assert code == 200 and "chunk" in text
    reset_peak()
    before = peak_rss()
    answers = []
    for name, peer in peers.items():
        for fault, setting in FAULTS:
            if name == "anthropic" and fault.kind == "gzip_line":
                continue
            for _ in range(2):
                peer.fail(fault)
                code, text = await predict(jp_fetch, {"trajectory_id": tid, "backend": name})
                answers.append((name, fault.kind, setting, code, text))
    growth = peak_rss() - before
    print(f"peak RSS {before / 2**20:.0f} MB before, +{growth / 2**20:.1f} MB over {len(answers)}")
    for name, kind, setting, code, text in answers:
        # Before the first chunk a 502 with a JSON message; after it, an error event.
        if code == 200:
            assert "event: error" in text and setting in text, (name, kind, text[-300:])
        else:
            assert code == 502 and setting in json.loads(text)["message"], (name, kind, text)
    # Twelve endless answers of up to 512 MB each cost the server a few MB, not gigabytes.
    assert growth < 100 * 1024 * 1024, f"peak RSS grew by {growth / 2**20:.0f} MB"
    # The peers saw the server hang up long before their limit.
    for peer in peers.values():
        assert peer.sent_bytes and max(peer.sent_bytes) < 64 * 1024 * 1024
    # And the server answers normally afterwards.
    code, text = await predict(jp_fetch, {"trajectory_id": tid, "backend": "openai"})
    assert code == 200 and chunk_text(text) == "df.head()"
