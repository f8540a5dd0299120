"""The llamacpp backend with the real embedded code model (Qwen2.5-Coder-0.5B-Instruct, assembled
from the packages of the [llm] extra) run by llama.cpp (xllamacpp) in a child process.

Also the openai backend against the same llama.cpp engine's own OpenAI-compatible HTTP server
(a third-party server, not our loopback peer) on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import sqlite3
import threading
import time

import httpx
import pytest

from jupyter_themisto.backends import (
    BackendEnv,
    BackendUnavailable,
    NoPrediction,
    _local,
    create_backend,
)
from jupyter_themisto.backends._local import (
    Completion,
    LocalModelPredictor,
    SharedModel,
    loaded_models,
)
from jupyter_themisto.backends._text import whole_statements
from jupyter_themisto.backends.llamacpp import LlamaCppPredictor, bundled_model_path
from jupyter_themisto.backends.model_files import QWEN_CODER_05B, QWEN_CODER_15B, find_model
from jupyter_themisto.backends.openai import OpenAIPredictor
from jupyter_themisto.backends.prompts import (
    FENCES,
    NBCONVERT_HEAD,
    NOT_FIRST,
    QWEN_FIM,
    QWEN_REPO,
    next_cell_prompt,
    output_prompt,
)
from jupyter_themisto.context import ContextCell, PredictionContext, VariableInfo, parse_cell
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import engine_runs, wait_for

#: A prompt the model continues for long: counting, with no cell boundary in sight.
ENDLESS = "# %%\nnumbers = [\n    1,\n    2,\n    3,\n"


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


TRAIN_CELLS = [
    "from sklearn.linear_model import LinearRegression",
    "model = LinearRegression()",
]


def llama(**settings) -> LlamaCppPredictor:
    """The backend with time limits no loaded test machine reaches (the limits are tested alone)."""
    settings.setdefault("suggestion_timeout", 300)
    settings.setdefault("output_timeout", 300)
    return LlamaCppPredictor(settings)


def generate(backend, job, *, cancel_after=None):
    """Run one job on the engine directly (in this thread); the pieces it handed out."""
    model = backend.shared()
    cancelled = threading.Event()
    pieces: list[str] = []

    def emit(piece: str) -> None:
        pieces.append(piece)
        if cancel_after is not None and len(pieces) >= cancel_after:
            cancelled.set()

    with model.lock:
        backend.run(model, job, cancelled, emit)
    return pieces


@pytest.fixture(scope="module")
def model_file():
    path = find_model(QWEN_CODER_05B)
    assert path is not None, "the [llm] extra and `jupyter themisto model install` (.ci/setup)"
    return path


async def test_default_model_is_the_code_model_and_loads_once(model_file):
    a = create_backend("llamacpp", {"max_tokens": 24, "suggestion_timeout": 300})
    b = create_backend("llamacpp", {"max_tokens": 24, "suggestion_timeout": 300})
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


async def test_next_cell_streams_and_stops_at_the_cell_boundary(model_file):
    backend = llama(max_tokens=64)
    chunks = [c async for c in backend.predict_next_cell(session())]
    text = "".join(c.text for c in chunks)
    assert chunks[-1].done and text.strip()
    assert "# In[" not in text and "```" not in text
    # The prompt is a script as nbconvert writes a notebook, ending with an open `# In[ ]:`
    # cell; the answer is what the model writes there, up to the next cell marker or output
    # comment: the same greedy answer straight from the engine, cut at the first stop string.
    p = next_cell_prompt(session(), backend.prompt_options)
    assert p.text.endswith("\n# In[ ]:\n\n\n") and "# In[" in p.stops and p.suffix is None
    raw = "".join(generate(backend, Completion(p.text, [], 64)))
    cut = min((raw.find(s) for s in p.stops if s in raw), default=len(raw))
    assert text.strip() == raw[:cut].strip()


async def test_ranked_suggestions_are_distinct(model_file):
    backend = llama(max_tokens=24)
    texts = await next_cells(backend, session(), n=3)
    assert 1 <= len(texts) <= 3
    assert len({t.strip() for t in texts.values()}) == len(texts)


async def test_output_prediction_streams_text(model_file):
    backend = llama(output_max_tokens=32)
    ctx = session(target_source="print(df['a'].sum())")
    text = "".join([c.text async for c in backend.predict_output(ctx)])
    assert text.strip() and ">>>" not in text


async def test_an_output_prediction_never_opens_a_code_fence(model_file):
    backend = llama()
    model = backend.shared()
    # The model has these as single tokens: a bias on each touches nothing else.
    fences = model.details["single_tokens"] & set(FENCES)
    assert fences == {"```", "``", " ```", " ``", " ```\n"}
    assert output_prompt(session(target_source="df")).banned == FENCES
    asked = "Show a Python hello world program in a Markdown code block:\n\n"
    free = "".join(generate(backend, Completion(asked, [], 16)))
    assert free.startswith("```")
    banned = "".join(generate(backend, Completion(asked, [], 16, banned=FENCES)))
    assert banned.strip() and "``" not in banned
    # Only single tokens are banned: a string of several would ban each of its tokens.
    body = backend.request(Completion(asked, [], 1, banned=("```", "```\n", "x y")), model=model)
    assert body["logit_bias"] == [["```", False]]
    assert "logit_bias" not in backend.request(Completion(asked, [], 1), model=model)


async def test_speculative_ngram_drafts_from_the_prompt(model_file):
    cell = "for name in ['ada', 'bob', 'cy']:\n    print(name.upper(), len(name), name * 2)\n"
    head = cell[: cell.index(":\n") + 2]  # the loop's first line: its body comes next
    prompt = f"# %%\nimport math\n\n# %%\n{cell}\n# %%\nx = 1\n\n# %%\n{head}"
    job = Completion(prompt, ["# %%"], 32)
    drafted = {}
    for speculative in (0, 4):
        backend = llama(speculative_ngram=speculative, speculative_draft=8)
        model = backend.shared()
        with model.lock:
            answer = model.model.handle_completions(backend.request(job, stream=False, model=model))
        assert "print(name.upper()" in answer["choices"][0]["text"]  # the cell, repeated
        drafted[speculative] = answer["timings"].get("draft_n_accepted", 0)
    # The setting is the engine's: each value loads its own; only the one on drafts.
    assert llama(speculative_ngram=4, speculative_draft=8).shared() is not llama().shared()
    assert drafted[0] == 0 and drafted[4] >= 8


async def test_cancelling_stops_generation_at_the_next_token(model_file):
    backend = llama()
    job = Completion(ENDLESS, [], max_tokens=64)
    full = generate(backend, job)
    assert len(full) >= 40, "".join(full)
    stopped = generate(backend, job, cancel_after=3)
    assert len(stopped) == 3  # the engine asked for no further token once cancelled


async def test_closing_the_stream_frees_the_model(model_file):
    backend = llama(parallel=1, max_lines=200)
    job = Completion(ENDLESS, [], max_tokens=120)
    stream = backend._complete(job)
    got = [await stream.__anext__(), await stream.__anext__()]
    await stream.aclose()
    assert got
    model = backend.shared()
    # The worker lets go of the model's only slot at the next token: taken again at once.
    assert await asyncio.to_thread(model.lock.acquire, True, 30)
    model.lock.release()
    text = "".join([p async for p in backend._complete(Completion(ENDLESS, [], max_tokens=8))])
    assert text.strip()


async def test_an_answer_ends_at_its_time_limit(model_file):
    backend = llama(max_lines=200)
    job = Completion(ENDLESS, [], max_tokens=120)
    whole = "".join([p async for p in backend._complete(job)])
    timed = llama(max_lines=200, suggestion_timeout=0.05)
    start = time.monotonic()
    cut = "".join([p async for p in timed._complete(job)])
    # Shorter than the whole answer, and its beginning (no timing is asserted, only that it
    # ended early and kept what came).
    assert len(cut) < len(whole) and whole.startswith(cut)
    print(f"\nanswer with a 0.05 s limit: {len(cut)} chars in {time.monotonic() - start:.2f} s")


async def test_an_output_prediction_has_its_own_time_limit(model_file):
    """An output prediction streams into an area with a Cancel button: `output_timeout` bounds
    it, not the ghost text's `suggestion_timeout`."""
    ctx = PredictionContext(cells=[], target_source="for i in range(30):\n    print(i)")

    async def output(backend):
        try:
            return "".join([c.text async for c in backend.predict_output(ctx)])
        except NoPrediction:  # nothing came within the time
            return ""

    whole = await output(llama(output_max_tokens=24))
    ghost_bound = llama(output_max_tokens=24, suggestion_timeout=0.05)
    assert await output(ghost_bound) == whole and ghost_bound.timed_out == 0
    output_bound = llama(output_max_tokens=24, output_timeout=0.05)
    cut = await output(output_bound)
    assert output_bound.timed_out == 1 and len(cut) < len(whole) and whole.startswith(cut)


async def test_answers_are_capped_in_lines(model_file):
    backend = llama(max_lines=3)
    text = "".join([p async for p in backend._complete(Completion(ENDLESS, [], 120))])
    assert 1 <= len(text.splitlines()) <= 3


async def test_a_suggestion_its_token_limit_cut_ends_where_its_code_is_whole(model_file):
    """The limit came in the middle of a statement: what was shown of it gives way (a chunk
    with `replace`) to the suggestion up to its last whole statement, which parses."""
    cells = [
        ContextCell(
            source=f"total_{i} = {i} * 10\nrun_{i} = dict(\n    alpha={i}.1,\n    beta={i}.2,\n)",
            execution_count=i,
        )
        for i in range(1, 4)
    ]
    ctx = PredictionContext(cells=cells)
    backend = llama(max_tokens=20)
    p = next_cell_prompt(ctx, backend.prompt_options)
    model = backend.shared()
    raw: list[str] = []
    with model.lock:
        limited = backend.run(model, Completion(p.text, p.stops, 20), threading.Event(), raw.append)
    answer = "".join(raw)
    assert limited and parse_cell(answer) is None, answer  # cut inside `run_4 = dict(`
    chunks = [c async for c in backend.predict_next_cell(ctx)]
    shown = "".join(c.text for c in chunks if not c.replace)
    assert shown == answer.rstrip()[: len(shown)] and "dict(" in shown  # streamed as it came
    assert [c.replace for c in chunks].count(True) == 1 and chunks[-1].replace and chunks[-1].done
    assert chunks[-1].text == whole_statements(answer) == "total_4 = 4 * 10"
    # An answer that ends by itself, at the cell boundary, is not cut.
    whole = Completion(p.text, p.stops, 200)
    with model.lock:
        assert not backend.run(model, whole, threading.Event(), raw.append)


async def test_two_generations_run_at_once_in_two_slots(model_file):
    backend = llama(max_tokens=24, parallel=2)
    ctx = session()
    spans: dict[str, list[float]] = {"a": [], "b": []}

    async def run(tag):
        async for _ in backend.predict_next_cell(ctx):
            spans[tag].append(time.monotonic())

    await asyncio.gather(run("a"), run("b"))
    assert spans["a"] and spans["b"]
    one = llama(max_tokens=24, parallel=1)
    spans = {"a": [], "b": []}
    backend = one
    await asyncio.gather(run("a"), run("b"))
    first, second = sorted(spans.values(), key=lambda s: s[0])
    # With one slot, the second request's first chunk comes only after the first one's last.
    assert first and second and second[0] >= first[-1]


async def test_fill_in_the_middle(model_file):
    backend = llama(max_lines=5)
    job = Completion("def add(a, b):\n    ", ["\n\n"], 24, suffix="\n\nprint(add(1, 2))\n")
    assert "<|fim_prefix|>" in backend.request(job)["prompt"]
    text = "".join([p async for p in backend._complete(job)])
    assert "return" in text and "a" in text and "b" in text


async def test_fim_tokens_are_found_in_the_models_vocabulary(model_file):
    backend = llama()
    assert backend.fim_tokens(backend.shared()) == QWEN_FIM
    tiny = llama(model="smollm2-135m")
    assert tiny.fim_tokens(tiny.shared()) is None  # it spells them with several tokens


async def test_what_came_next_in_another_notebook_reaches_the_model(model_file, tmp_path):
    # The history holds a notebook whose cells resemble this one's: the cell that came next
    # there goes before the script as another file of the repository, and the model uses it.
    store = TrajectoryStore(tmp_path / "t.sqlite")
    other = store.create_trajectory(notebook_path="old/report.ipynb")
    for source in (
        "import pandas as pd",
        "orders = pd.read_csv('orders.csv')",
        "orders.groupby('zq_region')['zq_revenue'].sum()",
    ):
        store.add_execution(other, {"source": source, "status": "ok"})
    # (no continuation: the cells ran in the same order there, which would answer first)
    settings = {
        "max_tokens": 24,
        "suggestion_timeout": 300,
        "prompt_examples": 2,
        "retrieval": {"continuation_cells": 0},
    }
    backend = LlamaCppPredictor(settings, BackendEnv(store=store))
    model = backend.shared()
    assert backend.repo_tokens(model) == QWEN_REPO
    ctx = PredictionContext(
        cells=[
            ContextCell(source="import pandas as pd", execution_count=1, order_index=0),
            ContextCell(
                source="orders = pd.read_csv('orders.csv')", execution_count=2, order_index=1
            ),
        ],
        notebook_path="new/sales.ipynb",
        with_runtime=False,
    )
    prompt = await backend._prompt_with_examples(ctx, model)
    head = "#!/usr/bin/env python\n# coding: utf-8\n\n# In[ ]:\n\n\n"
    assert prompt.text.startswith("<|repo_name|>notebooks\n<|file_sep|>old/report.py\n" + head)
    assert "<|file_sep|>new/sales.py\n" + head + "import pandas as pd\n" in prompt.text
    texts = await next_cells(backend, ctx)
    assert "zq_region" in texts[0], texts
    off = LlamaCppPredictor({**settings, "prompt_examples": 0}, BackendEnv(store=store))
    assert "zq_region" not in (await off._prompt_with_examples(ctx, model)).text
    assert "zq_region" not in (await next_cells(off, ctx))[0]
    tiny = llama(model="smollm2-135m", prompt_examples=2)
    assert tiny.repo_tokens(tiny.shared()) is None  # it spells them with several tokens
    assert (await tiny._prompt_with_examples(ctx, tiny.shared())).text.startswith("#!/usr/")
    store.close()


async def test_cells_below_become_a_fim_suffix_that_a_long_prompt_keeps(model_file):
    backend = llama(prompt_below=True, max_prompt_tokens=64, max_tokens=16)
    ctx = session(with_runtime=False)
    ctx.cells_below = [ContextCell(source="print(total)", status="not run")]
    ctx.cells[0] = ContextCell(source="import pandas as pd  # " + "x" * 600, execution_count=1)
    prompt = next_cell_prompt(ctx, backend.prompt_options, backend.fim_tokens(backend.shared()))
    job = Completion.of(prompt, 16)
    assert job.suffix == "\n# In[ ]:\n\n\nprint(total)\n\n" and job.fim == QWEN_FIM
    body = backend.request(job)["prompt"]
    # Cut to its newest part, the prompt still opens with the FIM prefix token and keeps the
    # suffix and the middle token.
    assert len(body) < len(prompt.text)
    assert body.startswith("<|fim_prefix|>") and body.endswith("print(total)\n\n<|fim_middle|>")
    assert body.count("<|fim_prefix|>") == 1 and "x" * 600 not in body
    plain = llama(max_prompt_tokens=64)  # the cells below are off by default
    assert next_cell_prompt(ctx, plain.prompt_options, None).suffix is None
    chunks = [c async for c in backend.predict_next_cell(ctx)]
    assert chunks and chunks[-1].done


async def test_warm_evaluates_the_prompt_ahead(model_file):
    backend = llama(max_tokens=16, parallel=1)
    ctx = session()
    await backend.warm(ctx)
    job = Completion.of(next_cell_prompt(ctx, backend.prompt_options), 4)
    body = backend.request(job, stream=False)
    model = backend.shared()
    with model.lock:
        answer = model.model.handle_completions(body)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= answer["usage"]["prompt_tokens"] - 1  # all of it came from the cache


async def test_a_warm_up_writes_the_suggestion_ahead_for_the_cell_once_it_ran(model_file):
    backend = llama(max_tokens=16, parallel=1)
    ran = session(kernel_id="k")
    typed = dataclasses.replace(
        ran, cells=[*ran.cells[:-1], ContextCell(source="print(df.shape)", execution_count=3)]
    )
    await backend.warm(typed)  # (evaluate --warm's: nothing written)
    assert backend.answer_ahead(ran) is None and not backend._writing_ahead
    await backend.warm(typed, ahead=True)
    written = await wait_for(lambda: backend.answer_ahead(ran))
    # Asked once the cell ran, whose run left the prompt as it was (an output, not an error,
    # is not shown): the answer written ahead is the model's answer, not written again.
    runs = engine_runs(backend)
    assert (await next_cells(backend, ran))[0] == written and runs == []
    # It is the greedy suggestion for that prompt.
    backend._ahead.clear()
    assert written == (await next_cells(backend, ran))[0] and runs
    # The cell raised: its error is in the prompt, so the model answers it anew.
    await backend.warm(typed, ahead=True)
    await wait_for(lambda: backend.answer_ahead(ran))
    failed = dataclasses.replace(
        ran,
        cells=[
            *ran.cells[:-1],
            ContextCell(source="print(df.shape)", output_text="NameError: df", status="error"),
        ],
    )
    runs.clear()
    await next_cells(backend, failed)
    assert backend.answer_ahead(failed) == written and runs
    other = dataclasses.replace(ran, cells=[*ran.cells[:-1], ContextCell(source="df.head()")])
    assert backend.answer_ahead(other) is None  # (another cell ran)
    assert backend.answer_ahead(dataclasses.replace(ran, kernel_id="other")) is None


async def test_answers_written_ahead_are_kept_for_the_newest_notebooks(model_file, monkeypatch):
    monkeypatch.setattr(_local, "AHEAD_KEPT", 2)
    backend = llama(max_tokens=8, parallel=1)
    # n1's second answer, for another cell, makes it the newest but one: n2 is dropped.
    runs = [("n1", "print(df.shape)"), ("n2", "df.describe()"), ("n1", "df.head()")]
    for kernel, source in [*runs, ("n3", "df.columns")]:
        ctx = session(kernel_id=kernel)
        ctx.cells[-1] = ContextCell(source=source)
        await backend.warm(ctx, ahead=True)
        await wait_for(lambda ctx=ctx: backend.answer_ahead(ctx))
    assert list(backend._ahead) == ["n1", "n3"]
    assert backend._ahead["n1"][0] == "df.head()"


async def test_a_prediction_stops_the_answer_being_written_ahead(model_file):
    backend = llama(max_tokens=64, parallel=1)
    ctx = session(kernel_id="k2")
    await backend.warm(ctx, ahead=True)
    (writing,) = backend._writing_ahead.values()
    assert not writing.done()
    texts = await next_cells(backend, dataclasses.replace(ctx, kernel_id="k3"))
    assert writing.cancelled() and backend.answer_ahead(ctx) is None
    assert texts[0]


async def test_a_warm_up_a_prediction_overtakes_writes_nothing_ahead(model_file):
    # Cells run without a pause: the warm-up as a cell starts is still evaluating its prompt
    # when the suggestion is asked for; writing an answer after it would hold the model.
    backend = llama(max_tokens=16, parallel=1)
    ctx = session(kernel_id="k4")
    ctx.cells.append(ContextCell(source=f"seed = {secrets.randbelow(10**9)}"))  # (not cached)
    warming = asyncio.ensure_future(backend.warm(ctx, ahead=True))
    await asyncio.sleep(0.05)
    assert not warming.done()
    await next_cells(backend, ctx)
    await warming
    assert not backend._writing_ahead and backend.answer_ahead(ctx) is None


async def test_a_prompt_with_examples_warmed_before_the_cell_ran_serves_it_after(
    model_file, tmp_path
):
    # The plugin warms the next prompt when a cell starts running: its variables do not exist
    # yet. The examples must be the same once they do, or the warm-up was for nothing.
    store = TrajectoryStore(tmp_path / "t.sqlite")
    other = store.create_trajectory(notebook_path="old/fit.ipynb")
    for source in (TRAIN_CELLS[0], TRAIN_CELLS[1], "model.fit(X, y)", "model.score(X, y)"):
        store.add_execution(other, {"source": source, "status": "ok"})
    backend = LlamaCppPredictor(
        {"max_tokens": 8, "parallel": 1, "suggestion_timeout": 300, "prompt_examples": 2},
        BackendEnv(store=store),
    )
    cells = [
        ContextCell(source=source, execution_count=i + 1, order_index=i)
        for i, source in enumerate(TRAIN_CELLS)
    ]
    before = PredictionContext(cells=cells, notebook_path="new.ipynb")
    await backend.warm(before)
    after = dataclasses.replace(
        before, variables=[VariableInfo(name="model", type="LinearRegression", summary={})]
    )
    model = backend.shared()
    prompt = await backend._prompt_with_examples(after, model)
    assert prompt.text.startswith("<|repo_name|>notebooks\n<|file_sep|>old/fit.py\n")
    body = backend.request(Completion.of(prompt, 4), stream=False)
    with model.lock:
        usage = model.model.handle_completions(body)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    store.close()


async def test_a_cancelled_request_stops_while_its_prompt_is_evaluated(model_file):
    # An answer ended by its time before its first token must not keep the engine evaluating
    # a long prompt for seconds (the next request would wait behind it): the engine stops at
    # the next step of n_batch tokens. What it evaluated is in its cache: a step or two, not
    # the first half of the prompt that the check asks for again.
    backend = llama(max_tokens=4, parallel=1)  # (n_batch 128, the default)
    lines = [f"value_{i} = compute({i}, scale={i * 7})\n" for i in range(80)]
    prompt = f"# {secrets.token_hex(8)}\n" + "".join(lines)
    cancelled = threading.Event()
    cancelled.set()  # stopped at its first chance
    pieces: list[str] = []
    model = backend.shared()
    with model.lock:
        backend.run(model, Completion(prompt, [], 4), cancelled, pieces.append)
    assert pieces == []
    half = prompt[: len(prompt) // 2]
    body = backend.request(Completion(half, [], 1), stream=False)
    with model.lock:
        usage = model.model.handle_completions(body)["usage"]
    total, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert total > 400 and cached <= 2 * 128, usage


def long_notebook(n: int, mark: str) -> PredictionContext:
    cells = [ContextCell(source=mark, execution_count=0, order_index=0)]
    for i in range(1, n):
        source = f"part_{i} = frame.loc[frame['group'] == {i}, ['a', 'b']].mean()  # step {i}"
        cells.append(ContextCell(source=source, execution_count=i, order_index=i))
    return PredictionContext(cells=cells, with_runtime=False)


def cached_share(backend, ctx) -> tuple[int, int]:
    """(tokens of the prompt of `ctx`, how many the engine's cache held), asked directly."""
    model = backend.shared()
    job = Completion.of(backend.next_cell_prompt(ctx, model), 1, slot=backend.slot(ctx, model))
    body = backend.request(job, stream=False)
    with model.lock:
        answer = model.model.handle_completions(body)
    usage = answer["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def test_a_long_notebooks_next_prompt_is_served_by_the_cache(model_file, caplog):
    # Over the budget, consecutive prompts keep their first cell: the engine evaluates only
    # the new cell (a cut that moved with each cell evaluated all of it every time).
    backend = llama(
        max_tokens=8, parallel=1, max_prompt_tokens=200, prompt_cells=0, stable_prompt_start=True
    )
    mark = f"# {secrets.token_hex(8)}"
    first = long_notebook(40, mark)
    assert len(backend.next_cell_prompt(first, backend.shared()).text) <= 600
    caplog.set_level("DEBUG", logger="jupyter_themisto")
    await next_cells(backend, first)
    assert "from the cache" in caplog.text  # what the engine reused is logged per answer
    total, cached = cached_share(backend, long_notebook(41, mark))
    assert cached >= total - 40, (total, cached)


def marked_notebook(n: int, mark: str) -> PredictionContext:
    """A long notebook whose every cell carries `mark` (no other test's prompt shares a run of
    its tokens, however it is cut)."""
    cells = [
        ContextCell(
            source=f"part_{i} = frame.loc[frame['group'] == {i}, ['a', 'b']].mean()  # {mark}",
            execution_count=i,
            order_index=i,
        )
        for i in range(1, n)
    ]
    return PredictionContext(cells=cells, with_runtime=False)


async def test_cache_reuse_serves_a_prompt_cut_anew(model_file):
    # Over the budget, each prompt is cut anew: its beginning moves with every cell. Off, the
    # engine evaluates it whole again; with cache_reuse_tokens, it shifts the runs of tokens it
    # evaluated for the previous prompt into place and evaluates only the new cell.
    for reuse in (0, 16):
        backend = llama(
            max_tokens=4,
            parallel=1,
            max_prompt_tokens=200,
            prompt_cells=0,
            cache_reuse_tokens=reuse,
        )
        mark = secrets.token_hex(6)
        model = backend.shared()
        before, after = (
            backend.request(Completion.of(backend.next_cell_prompt(ctx, model), 1))["prompt"]
            for ctx in (marked_notebook(40, mark), marked_notebook(41, mark))
        )
        assert before[:40] != after[:40] and before[-100:] in after  # the cut moved
        cached_share(backend, marked_notebook(40, mark))
        total, cached = cached_share(backend, marked_notebook(41, mark))
        if reuse:
            assert cached >= total - 60, (total, cached)
        else:
            assert cached < total // 2, (total, cached)


async def test_with_two_slots_each_notebook_keeps_the_slot_holding_its_runs(model_file):
    # Two notebooks in turn, each prompt cut anew. The engine would choose slots by the
    # prompts' beginnings, which moved: a notebook's next prompt would land in the slot the
    # other notebook used, whose runs of tokens are not its own. With cache_reuse_tokens each
    # notebook's prompts go to a slot of its own.
    backend = llama(
        max_tokens=4, parallel=2, max_prompt_tokens=200, prompt_cells=0, cache_reuse_tokens=16
    )
    marks = {name: secrets.token_hex(6) for name in ("a.ipynb", "b.ipynb")}

    def notebook(name: str, n: int) -> PredictionContext:
        return dataclasses.replace(marked_notebook(n, marks[name]), notebook_path=name)

    model = backend.shared()
    assert backend.slot(notebook("a.ipynb", 40), model) != backend.slot(
        notebook("b.ipynb", 40), model
    )
    cached_share(backend, notebook("a.ipynb", 40))
    cached_share(backend, notebook("b.ipynb", 40))
    cached_share(backend, notebook("b.ipynb", 41))
    total, cached = cached_share(backend, notebook("a.ipynb", 41))
    assert cached >= total - 60, (total, cached)
    body = backend.request(
        Completion.of(backend.next_cell_prompt(notebook("a.ipynb", 42), model), 1, slot=1)
    )
    assert body["id_slot"] == 1 and body["n_cache_reuse"] == 16


def test_a_notebook_keeps_its_slot_and_a_new_one_takes_the_least_recently_used():
    model = SharedModel(None, 0.0, slots=2)
    assert model.slot_for("") == -1  # a request of no notebook: any slot
    assert SharedModel(None, 0.0, slots=1).slot_for("a") == -1
    a, b = model.slot_for("a"), model.slot_for("b")
    assert {a, b} == {0, 1}
    assert model.slot_for("a") == a  # used again: b is now the least recently used
    assert model.slot_for("c") == b
    assert model.slot_for("b") == a  # b lost its slot to c; a's is the least recently used
    assert model.slot_for("c") == b


def test_what_the_cache_holds_of_a_prompt():
    """A prompt the engine evaluated lately spares most of a new one that begins with half of
    it; with runs of it shifted into place (`cache_reuse_tokens`), also of one whose window
    dropped its oldest cells, as a long notebook's does."""
    cells = [f"# %%\nstep_{i} = {i}\n" for i in range(10)]
    model = SharedModel(None, 0.0)
    model.remember("".join(cells[:8]))
    grown = "".join(cells[:9])  # one cell more
    slid = "".join(cells[3:10])  # the window dropped three cells and took a new one
    other = "".join(cells[5:6] + cells[:3])  # its first half nowhere in what was evaluated
    assert model.holds(grown) and model.holds(grown, shifted=True)
    assert not model.holds(slid) and model.holds(slid, shifted=True)
    assert not model.holds(other) and not model.holds(other, shifted=True)
    assert not SharedModel(None, 0.0).holds(grown, shifted=True)  # nothing evaluated yet


async def test_a_cold_prompt_is_answered_short_and_evaluated_whole_after(model_file, caplog):
    backend = llama(max_tokens=8, parallel=1, cold_prompt_tokens=60, prompt_cells=0)
    model = backend.shared()
    ctx = long_notebook(12, f"# {secrets.token_hex(8)}")
    whole = backend.next_cell_prompt(ctx, model)
    short = backend.cold_prompt(ctx, model, whole)
    assert short is not None and len(short.text) <= 180 < len(whole.text)
    # The script's first lines, then the newest cells as the whole prompt has them.
    head = "\n".join(NBCONVERT_HEAD) + "\n"
    assert short.text.startswith(head) and whole.text.endswith(short.text.removeprefix(head))
    caplog.set_level("INFO", logger="jupyter_themisto")
    await next_cells(backend, ctx)
    assert "cold prompt" in caplog.text
    await backend.idle()  # the whole prompt is evaluated after the answer
    assert backend.cold_prompt(ctx, model, whole) is None
    total, cached = cached_share(backend, ctx)
    assert cached >= total - 1, (total, cached)
    # Off: the whole prompt, however cold.
    off = llama(max_tokens=8, cold_prompt_tokens=0)
    fresh = long_notebook(12, f"# {secrets.token_hex(8)}")
    assert off.cold_prompt(fresh, model, off.next_cell_prompt(fresh, model)) is None
    # Nor when a cold prompt would be no shorter than the budget every prompt is cut to.
    for cold, budget, short_one in ((60, 200, True), (200, 200, False), (300, 200, False)):
        b = llama(max_tokens=8, cold_prompt_tokens=cold, max_prompt_tokens=budget)
        answer = b.cold_prompt(fresh, model, b.next_cell_prompt(fresh, model))
        assert (answer is not None) == short_one, (cold, budget)


async def test_smollm2_stays_available(model_file):
    assert bundled_model_path() is not None
    tiny = llama(model="smollm2-135m", max_tokens=16)
    assert tiny.model_path() == bundled_model_path()
    assert (await next_cells(tiny, session()))[0].strip()


async def test_the_larger_code_model_is_a_setting_away(model_file):
    """`model = "qwen2.5-coder-1.5b"` (extra [llm-large]): its own file and engine beside the
    default's, Qwen2.5-Coder's FIM tokens, and a suggestion for the same session."""
    large = llama(model="qwen2.5-coder-1.5b", max_tokens=24)
    path = find_model(QWEN_CODER_15B)
    assert path is not None and large.model_path() == path != model_file
    assert (await large.health())["ok"] is True
    texts = await next_cells(large, session())
    # code (a comment-only answer is dropped), cut at the cell boundary
    assert texts[0].strip() and "# In[" not in texts[0]
    assert large.fim_tokens(large.shared()) == QWEN_FIM
    assert large.model_key() != llama().model_key()


async def test_bad_settings_and_model_paths_are_clear(tmp_path):
    missing = llama(model_path=str(tmp_path / "nope.gguf"))
    with pytest.raises(BackendUnavailable, match="no model file"):
        await next_cells(missing, session())
    assert (await missing.health())["ok"] is False
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is not a model")
    broken = llama(model_path=str(not_gguf))
    with pytest.raises(BackendUnavailable, match="cannot load"):
        await next_cells(broken, session())
    with pytest.raises(ValueError, match="n_ctx"):
        llama(n_ctx=128, max_tokens=256)
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        llama(model="gpt")
    with pytest.raises(ValueError, match="suggestion_timeout"):
        llama(suggestion_timeout=0)
    with pytest.raises(ValueError, match="output_timeout"):
        llama(output_timeout=-1)


async def test_the_engines_own_listener_refuses_everyone(model_file):
    """xllamacpp always opens an HTTP listener: another local user or a web page must get
    nothing from it (no completions, no model list, no slots, no web page)."""
    backend = llama()
    address = backend.shared().model.listening_address
    assert address.startswith("http://127.0.0.1:")
    with httpx.Client(timeout=30) as client:
        for method, path in [
            ("POST", "/completion"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/slots"),
            ("GET", "/props"),
        ]:
            r = client.request(method, address + path, json={"prompt": "x", "n_predict": 1})
            assert r.status_code in (401, 403, 404, 501), (path, r.status_code, r.text[:200])
        page = client.get(address + "/")
        assert "<html" not in page.text.lower()  # the web page is off


# -- degenerate answers are dropped, never shown ---------------------------------------------


class ScriptedEngine(LocalModelPredictor):
    """The real answer pipeline (bounds, hold-back, dropping) over scripted model text: a real
    model cannot be made to write a degenerate answer on demand."""

    name = "scripted"

    def __init__(self, answers: list[str], settings: dict | None = None, env=None) -> None:
        super().__init__(settings or {}, env)
        self.answers = list(answers)
        self.model = SharedModel(None, 0.0)

    def shared(self):
        return self.model

    def produce(self, model, job, cancelled):
        text = self.answers.pop(0) if self.answers else ""
        for i in range(0, len(text), 3):
            yield text[i : i + 3]


async def stream(backend, ctx, n=1):
    return [(c.index, c.text, c.done) async for c in backend.predict_next_cell(ctx, n=n)]


async def test_comment_only_and_repeated_cells_are_dropped_unseen():
    ctx = session()
    previous = ctx.cells[-1].source
    backend = ScriptedEngine(["# Out: (3, 2)\n# q8.shape\n", previous + "\n", "df.describe()\n"])
    chunks = await stream(backend, ctx)
    # Neither the comments nor the previous cell ever reached the stream: the third answer did.
    assert "".join(t for _, t, _ in chunks) == "df.describe()"
    assert all(i == 0 for i, _, _ in chunks) and chunks[-1][2]


async def test_a_stand_in_for_a_dropped_answer_streams():
    # The greedy answer was the previous cell again: the sample standing in for it is shown as
    # it comes, not once it is complete (its first line is on screen before the rest exists).
    ctx = session()
    sample = "df.describe()\ndf['a'].sum()\n"
    backend = ScriptedEngine([ctx.cells[-1].source + "\n", sample])
    chunks = await stream(backend, ctx)
    assert "".join(t for _, t, _ in chunks) == sample.rstrip()
    streamed = [t for _, t, done in chunks if t and not done]
    assert streamed and streamed[0].startswith("df.")
    assert len(streamed[0]) < len(sample)


async def test_an_answer_written_ahead_is_the_one_a_suggestion_would_have_been():
    # Written ahead as asked for: the greedy answer was the previous cell again, so the sample
    # standing in for it is kept; asked once the cell ran (the same prompt), it is the whole
    # suggestion, and the model is not asked again.
    ctx = session(kernel_id="k")
    backend = ScriptedEngine([ctx.cells[-1].source + "\n", "df.describe()\n", "df.sum()\n"])
    await backend.warm(ctx, ahead=True)
    assert await wait_for(lambda: backend.answer_ahead(ctx)) == "df.describe()"
    assert await stream(backend, ctx) == [(0, "df.describe()", True)]
    assert backend.answers == ["df.sum()\n"]


class GatedScriptedEngine(ScriptedEngine):
    """A scripted model that writes each answer's first `head` characters at once and the rest
    only once `gate` is set."""

    def __init__(self, answers, head, settings=None):
        super().__init__(answers, settings)
        self.head = head
        self.gate = threading.Event()

    def produce(self, model, job, cancelled):
        text = self.answers.pop(0) if self.answers else ""
        for i in range(0, len(text), 3):
            if i >= self.head:
                while not self.gate.wait(0.01):
                    if cancelled.is_set():
                        return
            yield text[i : i + 3]


ANSWER = "df.describe()\ndf['a'].sum()\ndf.plot()\n"  # (its first 15 characters at once)


async def test_a_suggestion_asked_while_its_answer_is_written_ahead_follows_it():
    # The cell was typed, the answer for it is being written at the pause, the cell starts
    # running and then ran: the suggestion asked for that same prompt is the answer being
    # written, what it has so far at once and then the rest, not a new one begun from nothing.
    ctx = session(kernel_id="k")
    backend = GatedScriptedEngine([ANSWER, "never_asked()\n"], 15, {"suggestion_timeout": 2.0})
    await backend.warm(ctx, ahead=True)
    (task,) = backend._writing_ahead.values()
    await asyncio.sleep(0.2)
    await backend.warm(ctx)  # (as the cell starts running: the same prompt)
    assert not task.cancelled()
    await asyncio.sleep(0.8)
    runs = engine_runs(backend)
    asked = time.monotonic()
    # The rest comes after the writing's own 2 s are over, within the suggestion's 2 s.
    asyncio.get_running_loop().call_later(1.5, backend.gate.set)
    chunks, times = [], []
    async for chunk in backend.predict_next_cell(ctx):
        chunks.append(chunk)
        times.append(time.monotonic() - asked)
        backend.stop_ahead()  # (as asked by another notebook: a followed answer goes on)
    assert "".join(c.text for c in chunks) == ANSWER.rstrip() and chunks[-1].done
    assert runs == [] and backend.answers == ["never_asked()\n"]  # (the model not asked again)
    at_once = "".join(c.text for c, t in zip(chunks, times, strict=True) if t < 1.0)
    assert at_once == "df.describe()"  # (what it had written when asked)
    assert backend.answer_ahead(ctx) == ANSWER.rstrip()
    assert not task.cancelled()


async def test_an_answer_written_ahead_alone_keeps_its_time_and_another_prompt_stops_it():
    ctx = session(kernel_id="k")
    backend = GatedScriptedEngine([ANSWER], 15, {"suggestion_timeout": 1.0})
    await backend.warm(ctx, ahead=True)
    # Nobody asked for it: it ended at its own 1 s, with what it had written.
    assert await wait_for(lambda: backend.answer_ahead(ctx)) == "df.describe()"
    # Another cell ran (its error is in the prompt now): what is written for the cell as it
    # was typed stops, and the suggestion is the model's answer to the new prompt.
    backend = GatedScriptedEngine([ANSWER, "df.head()\n"], 15, {"suggestion_timeout": 2.0})
    await backend.warm(ctx, ahead=True)
    (task,) = backend._writing_ahead.values()
    await asyncio.sleep(0.3)
    raised = dataclasses.replace(ctx.cells[-1], output_text="E", status="error")
    failed = dataclasses.replace(ctx, cells=[*ctx.cells[:-1], raised])
    assert "".join(t for _, t, _ in await stream(backend, failed)) == "df.head()"
    assert task.cancelled() and backend.answer_ahead(ctx) is None


async def test_an_answer_its_time_ended_while_it_was_the_previous_cells_beginning_is_dropped():
    # The model was writing the cell just run again and its time ran out: what it had (the
    # beginning of that cell, held back all along) is not shown either.
    ctx = session()
    previous = "people = {\n    'first': ['Corey', 'Jane'],\n    'last': ['Schafer', 'Doe'],\n}"
    ctx.cells[-1] = ContextCell(source=previous, execution_count=3)
    backend = GatedScriptedEngine([previous + "\n"], 30, {"suggestion_timeout": 0.5})
    with pytest.raises(NoPrediction, match="previous cell's beginning again"):
        await stream(backend, ctx)
    # One that departed from it before its time ran out is shown, cut where its code is whole.
    backend = GatedScriptedEngine(
        ["people = {'a': 1}\nprint(people)\n"], 30, {"suggestion_timeout": 0.5}
    )
    text = ""
    async for chunk in backend.predict_next_cell(ctx):
        text = chunk.text if chunk.replace else text + chunk.text
    assert text == "people = {'a': 1}"


async def test_only_degenerate_answers_give_no_prediction():
    ctx = session()
    backend = ScriptedEngine(["# just a comment\n", "\n\n", "print(df.shape)"])
    with pytest.raises(NoPrediction, match="only comments or blank lines.*previous cell again"):
        await stream(backend, ctx)


async def test_a_greedy_answer_starting_with_a_comment_streams_once_code_comes():
    backend = ScriptedEngine(["# the mean\ndf.mean()\n"])
    chunks = await stream(backend, session())
    assert "".join(t for _, t, _ in chunks) == "# the mean\ndf.mean()"


async def test_an_answer_never_ends_in_blank_lines():
    # Tab puts the whole ghost text into the cell: trailing blank lines would go with it. They
    # wait for what follows them, which comes on a line within the answer.
    backend = ScriptedEngine(["df.mean()\n\n\ndf.sum()  \n\n\n"])
    chunks = await stream(backend, session())
    assert "".join(t for _, t, _ in chunks) == "df.mean()\n\n\ndf.sum()"
    assert not any(t != t.rstrip() for _, t, _ in chunks[-1:])
    alternatives = ScriptedEngine(["df.mean()\n", "df.sum()\n\n"])
    texts: dict[int, str] = {}
    async for c in alternatives.predict_next_cell(session(), n=2):
        texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "df.mean()", 1: "df.sum()"}


async def test_ranked_alternatives_follow_the_suggestion_on_screen():
    backend = ScriptedEngine(["df.describe()\n", "df.head()\n", "df.describe()\n"])
    chunks = [c async for c in backend.predict_next_cell(session(), n=3)]
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c.index] = texts.get(c.index, "") + c.text
    # The greedy answer streams first as index 0, then gets its score: a sample agreed with it.
    assert chunks[0].index == 0 and not chunks[0].done
    assert texts == {0: "df.describe()", 1: "df.head()"}
    score0 = [c.score for c in chunks if c.index == 0 and c.score is not None]
    alt = [c for c in chunks if c.index == 1]
    assert score0 and alt[0].metadata == {"source": "sampled"} and alt[0].score is not None
    assert score0[0] > alt[0].score


async def test_a_degenerate_greedy_answer_leaves_index_0_to_a_sample_in_a_ranked_list():
    backend = ScriptedEngine(["# only a comment\n", "df.tail()\n", "df.mean()\n", "df.sum()\n"])
    chunks = [c async for c in backend.predict_next_cell(session(), n=3)]
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == "df.tail()" and "# only a comment" not in "".join(texts.values())
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 3


async def test_repetition_is_cut():
    backend = ScriptedEngine(["df.head()\ndf.tail()\ndf.head()\ndf.head()\ndf.head()\n"])
    text = "".join(t for _, t, _ in await stream(backend, session()))
    assert text == "df.head()\ndf.tail()\ndf.head()"


async def test_an_output_keeps_its_repeated_lines_and_fences():
    # What a cell prints may repeat itself and hold Markdown: only code answers lose either.
    out = "[0, 1, 4]\n[0, 1, 4]\n[0, 1, 4]\n```\nhello\n"
    backend = ScriptedEngine([out])
    ctx = session(target_source="print(L)\nprint(L)\nprint(L)\nprint(md)")
    assert "".join([c.text async for c in backend.predict_output(ctx)]) == out


async def test_an_empty_output_answer_is_asked_again_not_to_end_at_once():
    """Greedy, the model may go straight on to the next `>>> `: asked again, its first token may
    not be that (NOT_FIRST); what it then says is kept unless it is chat about the code."""
    ctx = session(target_source="plt.plot(xs)")
    jobs = []

    class Recording(ScriptedEngine):
        def produce(self, model, job, cancelled):
            jobs.append(job)
            return super().produce(model, job, cancelled)

    backend = Recording(["", "<Figure size 640x480 with 1 Axes>\n"])
    text = "".join([c.text async for c in backend.predict_output(ctx)])
    assert text == "<Figure size 640x480 with 1 Axes>\n"
    assert [j.banned_first for j in jobs] == [(), NOT_FIRST]
    assert jobs[1].banned == FENCES and jobs[1].prompt == jobs[0].prompt
    for chat in (
        "This code snippet creates a plot of the data.",
        "...\n\n**Created Question**:\nWhat is the purpose of it?",
        "To solve the problem, we read the data first.",
    ):
        with pytest.raises(NoPrediction, match="no output"):
            [c async for c in ScriptedEngine(["", chat]).predict_output(ctx)]
    # A first answer with text is not asked again.
    backend = Recording(["42\n", "never"])
    jobs.clear()
    assert "".join([c.text async for c in backend.predict_output(ctx)]) == "42\n"
    assert len(jobs) == 1


async def test_a_first_token_ban_holds_with_the_real_model(model_file):
    backend = llama()
    model = backend.shared()
    assert {">>>", "\n", "..."} <= model.details["single_tokens"]
    # After an assignment (no output), the model's first choice is the next `>>> `.
    prompt = ">>> x = 5\n>>> x\n5\n>>> y = x + 1\n"
    free = "".join(generate(backend, Completion(prompt, [], 6)))
    assert free.startswith(">>>"), free
    again = "".join(generate(backend, Completion(prompt, [], 6, banned_first=NOT_FIRST)))
    assert again.strip() and not again.startswith((">", "\n", "...")), again


# -- the same engine's OpenAI-compatible HTTP server, for the openai backend ----------------------


@pytest.fixture(scope="module")
def llama_server(model_file):
    """llama.cpp's own OpenAI-compatible server (xllamacpp), with the code model, on loopback."""
    import xllamacpp

    key = secrets.token_hex(16)
    params = xllamacpp.CommonParams()
    params.model.path = str(model_file)
    params.n_ctx = 2048
    params.n_parallel = 1
    params.hostnames = ["127.0.0.1"]
    params.api_keys = [key]
    params.verbosity = -1
    server = xllamacpp.Server(params)
    url = server.listening_address + "/v1"
    assert url.startswith("http://127.0.0.1:")
    yield url, key
    del server


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_openai_backend_against_llama_cpp_server(llama_server, api):
    url, key = llama_server
    models = httpx.get(url + "/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert len(models["data"]) == 1
    model = models["data"][0]["id"]
    backend = OpenAIPredictor(
        {"base_url": url, "api_key": key, "model": model, "api": api, "max_tokens": 16}
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


async def test_llama_cpp_server_streams_sse_and_wants_its_key(llama_server):
    """What the openai backend relies on, as the third-party server really sends it."""
    url, key = llama_server
    body = {
        "model": "any",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello"}],
    }
    async with httpx.AsyncClient(timeout=60) as client:
        refused = await client.post(url + "/chat/completions", json=body)
        assert refused.status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream(
            "POST", url + "/chat/completions", json=body, headers=headers
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and "delta" in first["choices"][0]


# -- cells that ran in this order before ---------------------------------------------------------


def followed_history(tmp_path, stretch: list[str], followers: list[str]) -> TrajectoryStore:
    """A store in which `stretch` ran once before each of `followers`, each in a notebook."""
    store = TrajectoryStore(tmp_path / "history.sqlite")
    for after in followers:
        tid = store.create_trajectory(notebook_path="old.ipynb")
        for source in ["import os", *stretch, after]:
            store.add_execution(tid, {"source": source, "status": "ok", "outputs": []})
    return store


async def test_what_followed_the_same_cells_before_is_shown_at_once(tmp_path):
    ctx = session()
    stretch = [c.source for c in ctx.cells[-2:]]
    store = followed_history(tmp_path, stretch, ["df.groupby('a').sum()"] * 2)
    backend = ScriptedEngine(["df.head()\n"], env=BackendEnv(store=store))
    chunks = [c async for c in backend.predict_next_cell(ctx)]
    assert [(c.index, c.text, c.done, c.metadata) for c in chunks] == [
        (0, "df.groupby('a').sum()", True, {"source": "history"})
    ]
    assert backend.answers == ["df.head()\n"]  # the model was not asked
    # In a ranked list it keeps the first place, scored; the model's samples follow.
    backend = ScriptedEngine(["df.head()\n", "df.mean()\n"], env=BackendEnv(store=store))
    chunks = [c async for c in backend.predict_next_cell(ctx, n=3)]
    assert (chunks[0].index, chunks[0].text) == (0, "df.groupby('a').sum()")
    assert [c.score is not None for c in chunks if c.index == 0] == [False, True]
    rest = {c.text: c.metadata["source"] for c in chunks if c.index > 0}
    assert len(rest) == 2 and "sampled" in rest.values() and chunks[0].text not in rest
    assert backend.answers == []  # the model wrote the alternatives
    store.close()


async def test_history_that_disagrees_or_is_off_leaves_the_suggestion_to_the_model(tmp_path):
    ctx = session()
    stretch = [c.source for c in ctx.cells[-2:]]
    # Three places, three different cells after the stretch: no one cell follows it.
    store = followed_history(tmp_path, stretch, ["df.sum()", "df.mean()", "df.max()"])
    backend = ScriptedEngine(["df.head()\n"], env=BackendEnv(store=store))
    assert await next_cells(backend, ctx) == {0: "df.head()"}
    store.close()
    store = followed_history(tmp_path / "b", stretch, ["df.sum()"])
    off = {"retrieval": {"continuation_cells": 0}}
    backend = ScriptedEngine(["df.head()\n"], off, env=BackendEnv(store=store))
    assert await next_cells(backend, ctx) == {0: "df.head()"}
    store.close()


async def test_preloading_indexes_the_history_and_a_history_that_fails_is_passed_over(tmp_path):
    ctx = session()
    stretch = [c.source for c in ctx.cells[-2:]]
    store = followed_history(tmp_path, stretch, ["df.groupby('a').sum()"])
    backend = ScriptedEngine([], env=BackendEnv(store=store))
    backend.preload()  # (the server's start, for its default backend)
    deadline = time.monotonic() + 60
    while backend._retrieval_backend()._index is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert backend._retrieval_backend()._index is not None
    assert await next_cells(backend, ctx) == {0: "df.groupby('a').sum()"}
    store.close()

    class BrokenStore:
        def count_executions(self, *a):
            raise sqlite3.DatabaseError("file is not a database")

        list_trajectories = count_executions

    backend = ScriptedEngine(["df.head()\n"], env=BackendEnv(store=BrokenStore()))
    assert await next_cells(backend, ctx) == {0: "df.head()"}
