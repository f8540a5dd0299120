"""The anthropic backend against a loopback server speaking the Messages API streaming format."""

from __future__ import annotations

import pytest

from jupyter_themisto.backends import BackendError, BackendTimeout, BackendUnavailable
from jupyter_themisto.backends.anthropic import ANTHROPIC_VERSION, AnthropicPredictor
from jupyter_themisto.context import ContextCell, PredictionContext
from tests.peers import AnthropicPeer, Fault

KEY = "sk-ant-test-0123456789abcdef"


def ctx(**kw) -> PredictionContext:
    return PredictionContext(cells=[ContextCell(source="s = 'abc'")], **kw)


def backend(peer, **settings) -> AnthropicPredictor:
    config = {"base_url": peer.base, "api_key": KEY, "timeout": 2, "backoff": 0.01, **settings}
    return AnthropicPredictor(config)


async def next_text(b, n=1) -> str:
    chunks = [c async for c in b.predict_next_cell(ctx(), n=n)]
    assert chunks[-1].done and all(c.index == 0 for c in chunks)
    return "".join(c.text for c in chunks)


@pytest.fixture
def peer():
    with AnthropicPeer(reply="```python\ns.upper()\n```", api_key=KEY) as p:
        yield p


async def test_stream_and_request_shape(peer):
    b = backend(peer, model="claude-test")
    assert await next_text(b, n=3) == "s.upper()\n"
    req = peer.requests[-1]
    assert req.path == "/v1/messages"
    assert req.headers["x-api-key"] == KEY
    assert req.headers["anthropic-version"] == ANTHROPIC_VERSION
    assert req.body["model"] == "claude-test" and req.body["stream"] is True
    assert "next code cell" in req.body["system"]
    assert "s = 'abc'" in req.body["messages"][0]["content"]
    peer.reply = "'ABC'\n"
    out = "".join([c.text async for c in b.predict_output(ctx(target_source="s.upper()"))])
    assert out == "'ABC'\n"
    await b.aclose()


async def test_an_answer_cut_at_max_tokens_ends_at_its_last_whole_statement(peer):
    """stop_reason "max_tokens" inside `plt.plot(`: the unfinished statement shown gives way."""
    peer.reply = "df = load()\nplt.plot(x, y, color='red')\n"
    chunks = [c async for c in backend(peer, max_tokens=6).predict_next_cell(ctx())]
    assert "".join(c.text for c in chunks[:-1]) == "df = load()\nplt.plot(x, "
    assert chunks[-1].replace and chunks[-1].done and chunks[-1].text == "df = load()"
    whole = [c async for c in backend(peer).predict_next_cell(ctx())]
    assert "".join(c.text for c in whole) == peer.reply and not any(c.replace for c in whole)


async def test_retries_overloaded_and_rate_limit(peer):
    peer.fail(Fault.error(529), Fault.error(429, retry_after=0.2))
    b = backend(peer, max_retries=2)
    assert await next_text(b) == "s.upper()\n"
    assert len(peer.requests) == 3
    await b.aclose()


async def test_errors(peer):
    b = backend(peer, max_retries=0)
    peer.fail(Fault.error(500))
    with pytest.raises(BackendError, match="HTTP 500.*Internal server error"):
        await next_text(b)
    # A short bound for the hang only (0.5 s can run out on a loaded machine before a reply).
    hasty = backend(peer, max_retries=0, timeout=0.5)
    peer.fail(Fault.hang(1.5))
    with pytest.raises(BackendTimeout):
        await next_text(hasty)
    await hasty.aclose()
    peer.fail(Fault.malformed())
    with pytest.raises(BackendError, match="malformed JSON"):
        await next_text(b)
    peer.fail(Fault.cut(after_chunks=1))
    with pytest.raises(BackendError, match="cut off"):
        await next_text(b)
    wrong = backend(peer, api_key="sk-ant-wrong-000000")
    with pytest.raises(BackendError, match="HTTP 401.*invalid x-api-key") as info:
        await next_text(wrong)
    assert "sk-ant-wrong" not in str(info.value)
    await b.aclose()
    await wrong.aclose()


async def test_no_key(monkeypatch, peer):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    b = AnthropicPredictor({"base_url": peer.base})
    assert (await b.health())["ok"] is False
    with pytest.raises(BackendUnavailable, match="ANTHROPIC_API_KEY"):
        await next_text(b)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    b = AnthropicPredictor({"base_url": peer.base})
    assert await next_text(b) == "s.upper()\n"
    assert KEY not in str(await b.health())


async def test_error_event_mid_stream(peer):
    peer.reply = "a = 1\nb = 2\nc = 3\n"
    peer.fail(Fault.stream_error(after_chunks=2))
    b = backend(peer)
    got = []
    with pytest.raises(BackendError, match="overloaded_error"):
        async for c in b.predict_next_cell(ctx()):
            got.append(c.text)
    assert "".join(got) == "a = 1\nb "  # what streamed before the error passed on
    await b.aclose()


# An endless fault stops there: a regression fails the test instead of filling the machine.
LIMIT = 256 << 20


@pytest.mark.parametrize(
    "fault, setting",
    [
        (Fault.endless_line(LIMIT), "max_line_bytes"),
        (Fault.huge_event(LIMIT), "max_event_bytes"),
        (Fault.endless_events(LIMIT), "max_response_bytes"),
    ],
)
async def test_oversized_answers_stop_reading_with_a_clear_error(peer, fault, setting):
    b = backend(peer, max_retries=0, max_response_bytes=2 * 1024 * 1024)
    peer.fail(fault)
    with pytest.raises(BackendError, match=setting) as info:
        await next_text(b)
    assert "stopped reading" in str(info.value) and KEY not in str(info.value)
    assert await next_text(b) == "s.upper()\n"
    await b.aclose()
