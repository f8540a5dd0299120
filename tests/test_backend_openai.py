"""The openai backend against a loopback OpenAI-compatible server speaking the real wire format."""

from __future__ import annotations

import asyncio
import time

import pytest

from jupyter_themisto.backends import BackendError, BackendTimeout, BackendUnavailable
from jupyter_themisto.backends._http import retry_after_seconds
from jupyter_themisto.backends._text import FenceStripper, strip_code_fences
from jupyter_themisto.backends.openai import OpenAIPredictor
from jupyter_themisto.context import ContextCell, PredictionContext, VariableInfo
from tests.peers import Fault, OpenAIPeer, free_port

KEY = "sk-test-abcdef0123456789"


def ctx(**kw) -> PredictionContext:
    return PredictionContext(
        cells=[ContextCell(source="import numpy as np"), ContextCell(source="x = np.arange(5)")],
        variables=[VariableInfo(name="x", type="numpy.ndarray", summary={"shape": [5]})],
        **kw,
    )


def backend(peer: OpenAIPeer, **settings) -> OpenAIPredictor:
    config = {"base_url": peer.url, "api_key": KEY, "timeout": 2, "backoff": 0.01, **settings}
    return OpenAIPredictor(config)


async def collect_next(b, n=1):
    texts: dict[int, str] = {}
    done = set()
    async for c in b.predict_next_cell(ctx(), n=n):
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.done:
            done.add(c.index)
    assert done == set(texts)
    return texts


async def collect_output(b, source="x.sum()"):
    return "".join([c.text async for c in b.predict_output(ctx(target_source=source))])


@pytest.fixture
def peer():
    with OpenAIPeer(reply="```python\nx.mean()\n```\nThis computes the mean.", api_key=KEY) as p:
        yield p


async def test_chat_stream_strips_fences_and_sends_prompt(peer):
    b = backend(peer)
    assert await collect_next(b) == {0: "x.mean()\n"}
    req = peer.requests[-1]
    assert req.path == "/v1/chat/completions"
    assert req.headers["Authorization"] == f"Bearer {KEY}"
    assert req.body["stream"] is True and "n" not in req.body
    system, user = req.body["messages"]
    assert system["role"] == "system" and "next code cell" in system["content"]
    assert "x = np.arange(5)" in user["content"] and "x: numpy.ndarray shape=[5]" in user["content"]
    await b.aclose()


async def test_n_choices_and_completions_api(peer):
    peer.reply = ["a = 1", "b = 2", "c = 3"]
    b = backend(peer, api="completions", model="tiny")
    assert await collect_next(b, n=3) == {0: "a = 1", 1: "b = 2", 2: "c = 3"}
    req = peer.requests[-1]
    assert req.path == "/v1/completions" and req.body["n"] == 3 and req.body["model"] == "tiny"
    assert "# The next cell:" in req.body["prompt"]
    peer.reply = "array([0, 1, 2, 3, 4])\n"
    assert await collect_output(b, "x") == "array([0, 1, 2, 3, 4])\n"
    assert "# The cell to predict the output of:\nx" in peer.requests[-1].body["prompt"]
    await b.aclose()


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_an_answer_cut_at_max_tokens_ends_at_its_last_whole_statement(peer, api):
    """The server stops at `max_tokens` inside `plt.plot(` (finish_reason "length"): what was
    shown of the unfinished statement gives way to the answer up to the one before it."""
    peer.reply = [
        "df = load()\nplt.plot(x, y, color='red')\n",
        "a = 1\nb = [1,\n  2,\n  3,\n  4]\n",
    ]
    b = backend(peer, api=api, max_tokens=6)  # 6 pieces of 4 characters: 24 of them
    chunks = [c async for c in b.predict_next_cell(ctx(), n=2)]
    ends = {c.index: c for c in chunks if c.done}
    shown = {i: "".join(c.text for c in chunks if c.index == i and not c.done) for i in ends}
    assert shown[0] == "df = load()\nplt.plot(x, "
    assert shown[1].startswith("a = 1\nb = [1,\n  2,") and peer.reply[1][:24].startswith(shown[1])
    assert ends[0].replace and ends[0].text == "df = load()"
    assert ends[1].replace and ends[1].text == "a = 1"
    assert peer.requests[-1].body["max_tokens"] == 6
    # An answer that ends by itself is passed on as it came.
    whole = [c async for c in backend(peer, api=api).predict_next_cell(ctx())]
    assert "".join(c.text for c in whole) == peer.reply[0] and not any(c.replace for c in whole)
    await b.aclose()


async def test_retries_429_honouring_retry_after(peer):
    peer.reply = "y = 2"
    peer.fail(Fault.error(429, retry_after=0.4), Fault.error(503))
    b = backend(peer, max_retries=2)
    t0 = time.monotonic()
    assert await collect_next(b) == {0: "y = 2"}
    assert time.monotonic() - t0 >= 0.4
    assert len(peer.requests) == 3
    await b.aclose()


async def test_retry_after_longer_than_allowed_fails_at_once(peer):
    peer.fail(Fault.error(429, retry_after=120))
    b = backend(peer, max_retries=3, max_backoff=5)
    with pytest.raises(BackendError) as info:
        await collect_next(b)
    assert info.value.status == 502 and "HTTP 429" in str(info.value)
    assert len(peer.requests) == 1
    await b.aclose()


async def test_errors_are_actionable_and_never_carry_the_key(peer):
    b = backend(peer, max_retries=1)
    peer.fail(Fault.error(401, message=f"Incorrect API key provided: {KEY}"))
    with pytest.raises(BackendError) as info:
        await collect_next(b)
    assert "HTTP 401" in str(info.value) and "API key" in str(info.value)
    assert KEY not in str(info.value)
    assert len(peer.requests) == 1  # 401 is not retried
    peer.fail(Fault.error(500), Fault.error(500))
    with pytest.raises(BackendError, match="HTTP 500"):
        await collect_next(b)
    wrong = backend(peer, api_key="sk-wrong-key-000000")
    with pytest.raises(BackendError, match="HTTP 401"):
        await collect_next(wrong)
    await b.aclose()
    await wrong.aclose()


async def test_timeout_malformed_and_cut(peer):
    hasty = backend(peer, timeout=0.5, max_retries=0)
    peer.fail(Fault.hang(1.5))
    with pytest.raises(BackendTimeout) as info:
        await collect_next(hasty)
    assert info.value.status == 504
    await hasty.aclose()
    # (the usual bound for the rest: 0.5 s can run out on a loaded machine before a reply)
    b = backend(peer, max_retries=0)
    peer.fail(Fault.malformed())
    with pytest.raises(BackendError, match="malformed JSON"):
        await collect_next(b)
    peer.fail(Fault.cut(after_chunks=2))
    with pytest.raises(BackendError, match="cut off"):
        await collect_next(b)
    await b.aclose()


async def test_connection_refused_is_a_502_after_retries():
    b = OpenAIPredictor({"base_url": f"http://127.0.0.1:{free_port()}/v1", "backoff": 0.01})
    with pytest.raises(BackendError, match="cannot connect") as info:
        await collect_next(b)
    assert info.value.status == 502 and not isinstance(info.value, BackendTimeout)


async def test_cancellation_closes_the_upstream_stream(peer):
    peer.reply = "".join(f"v{i} = {i}\n" for i in range(40))
    peer.fail(Fault.slow(0.1))
    b = backend(peer)
    got = []

    async def consume():
        async for c in b.predict_next_cell(ctx()):
            got.append(c.text)

    task = asyncio.ensure_future(consume())
    while not got:
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 60
    while not peer.disconnects and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert peer.disconnects == ["/v1/chat/completions"]
    await b.aclose()


async def test_key_from_environment_and_health(monkeypatch, peer):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", peer.url)
    b = OpenAIPredictor({})
    assert b.base_url == peer.url
    peer.reply = "z = 3"
    assert await collect_next(b) == {0: "z = 3"}
    health = await b.health()
    assert health["ok"] and KEY not in str(health)
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.delenv("OPENAI_BASE_URL")
    hosted = OpenAIPredictor({})
    assert (await hosted.health())["ok"] is False
    with pytest.raises(BackendUnavailable, match="OPENAI_API_KEY"):
        await collect_next(hosted)
    await b.aclose()


def test_fence_stripping_streamed_in_pieces():
    text = "```python\nimport os\nos.listdir()\n```\nExplanation here."
    for size in (1, 2, 3, 7, 100):
        s = FenceStripper()
        out = "".join(s.feed(text[i : i + size]) for i in range(0, len(text), size)) + s.finish()
        assert out == "import os\nos.listdir()\n"
    assert strip_code_fences("print(1)") == "print(1)"
    assert strip_code_fences("\n\n```\nx\n```") == "x\n"
    assert strip_code_fences("a = '```'") == "a = '```'"
    # A line that cannot be a fence streams before it ends; one that may be waits.
    s = FenceStripper()
    assert (s.feed("df.he"), s.feed("ad()\n``"), s.feed("`\nrest")) == ("df.he", "ad()\n", "")


def test_retry_after_formats():
    import httpx

    assert retry_after_seconds(httpx.Headers({"retry-after": "2"})) == 2.0
    assert retry_after_seconds(httpx.Headers({"retry-after-ms": "250"})) == 0.25
    when = retry_after_seconds(httpx.Headers({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}))
    assert when == 0.0
    assert retry_after_seconds(httpx.Headers({})) is None


async def test_error_chunk_mid_stream(peer):
    peer.reply = "a = 1\nb = 2\nc = 3\n"
    peer.fail(Fault.stream_error(after_chunks=2))
    b = backend(peer)
    got = []
    with pytest.raises(BackendError, match="model crashed"):
        async for c in b.predict_next_cell(ctx()):
            got.append(c.text)
    assert "".join(got) == "a = 1\nb "  # what streamed before the error passed on
    await b.aclose()


async def wait_sent(peer, n: int) -> list[int]:
    """The bytes the peer wrote for its first `n` endless answers, once it saw them end."""
    deadline = time.monotonic() + 60
    while len(peer.sent_bytes) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return peer.sent_bytes


# An endless fault stops there: a regression fails the test instead of filling the machine.
LIMIT = 256 << 20


@pytest.mark.parametrize(
    "fault, setting",
    [
        (Fault.endless_line(LIMIT), "max_line_bytes"),
        (Fault.huge_event(LIMIT), "max_event_bytes"),
        (Fault.endless_events(LIMIT), "max_response_bytes"),
        (Fault.gzip_line(LIMIT >> 10), "max_line_bytes"),
    ],
)
async def test_oversized_answers_stop_reading_with_a_clear_error(peer, fault, setting):
    limits = {"max_line_bytes": 64 * 1024, "max_event_bytes": 256 * 1024}
    limits["max_response_bytes"] = 1024 * 1024
    b = backend(peer, max_retries=0, **limits)
    peer.fail(fault)
    with pytest.raises(BackendError, match=setting) as info:
        await collect_next(b)
    assert info.value.status == 502 and "stopped reading" in str(info.value)
    assert peer.requests[-1].headers["Accept-Encoding"] == "identity"
    # The connection was dropped: the server stopped writing soon after the bound (what is
    # still in flight is the sockets' buffers), and the backend works again at once.
    (sent,) = await wait_sent(peer, 1)
    assert sent < 64 * 1024 * 1024
    peer.reply = "x.max()"
    assert await collect_next(b) == {0: "x.max()"}
    await b.aclose()


def test_stream_bounds_must_be_positive():
    with pytest.raises(ValueError, match="max_line_bytes"):
        OpenAIPredictor({"max_line_bytes": 0})


async def test_line_endings_split_across_reads():
    from jupyter_themisto.backends._http import bounded_lines, iter_sse

    async def chunks():
        for part in (b"event: a\r", b"\ndata: 1\r\n", b"\r", b"data: 2\rdata", b": 3\n\n"):
            yield part

    lines = bounded_lines(chunks(), max_line=100, max_total=1000, who="t")
    assert [e async for e in iter_sse(lines)] == [("a", "1"), (None, "2\n3")]
