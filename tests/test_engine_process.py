"""The llamacpp backend's engine in its child process (`backends._engine`), attacked: killed
while it answers, frozen, orphaned, closed under a running request, sent requests it rejects,
cancelled by the dozen. Each test looks at the processes before and after, and asks the next
suggestion: the real model must answer it.

Each test has an engine of its own (a distinct `cache_ram_mb` makes a distinct shared model):
killing one never touches the engine another test file shares.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from jupyter_themisto.backends import BackendError, BackendUnavailable, llamacpp
from jupyter_themisto.backends._engine import EngineError, EngineProcess
from jupyter_themisto.backends._local import Completion, close_model, loaded_models
from jupyter_themisto.backends.llamacpp import LlamaCppPredictor
from jupyter_themisto.backends.model_files import QWEN_CODER_05B, find_model
from tests.helpers import gone, running, wait_for
from tests.test_backend_llamacpp import ENDLESS, next_cells, session

#: what a prompt the model continues for long (counting) is asked with
LONG = 120


@pytest.fixture(scope="module")
def model_file():
    path = find_model(QWEN_CODER_05B)
    assert path is not None, "the [llm] extra and `jupyter themisto model install` (.ci/setup)"
    return path


@pytest.fixture(autouse=True)
def _close_own_engines():
    """The engines a test started are closed after it (other test files count the loaded
    models), and none of their processes is left."""
    before, alive = set(loaded_models()), {c.pid for c in engine_children()}
    yield
    for key in set(loaded_models()) - before:
        close_model(key)
    assert {c.pid for c in engine_children()} <= alive


_own = iter(range(200, 10_000, 8))


def own_engine(**settings) -> LlamaCppPredictor:
    """A backend whose engine no other test shares."""
    settings.setdefault("cache_ram_mb", next(_own))
    settings.setdefault("suggestion_timeout", 300)
    settings.setdefault("output_timeout", 300)
    return LlamaCppPredictor(settings)


def engine_children() -> list[psutil.Process]:
    """This process's engine children that still run."""
    found = []
    for child in psutil.Process().children():
        try:
            if "jupyter_themisto.backends._engine" in child.cmdline() and running(child):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def stream(backend, job, on_piece=None, cancelled=None):
    """Run `job` on the backend's engine in this thread: (its pieces, the error it ended with)."""
    model = backend.shared()
    pieces: list[str] = []

    def emit(piece: str) -> None:
        pieces.append(piece)
        if on_piece is not None:
            on_piece(len(pieces))

    try:
        with model.lock:
            backend.run(model, job, cancelled or threading.Event(), emit)
    except BackendError as e:
        return pieces, e
    return pieces, None


def maps_of(process: psutil.Process, path) -> int:
    return sum(1 for m in process.memory_maps(grouped=False) if m.path == str(path.resolve()))


async def test_the_engine_is_a_child_process_and_the_server_holds_no_model(model_file):
    mapped = maps_of(psutil.Process(), model_file)  # (other test files may map it in process)
    backend = own_engine()
    engine = backend.shared().model
    assert isinstance(engine, EngineProcess)
    child = psutil.Process(engine.pid)
    assert engine.pid != os.getpid() and child.ppid() == os.getpid()
    assert child.cmdline()[1:3] == ["-m", "jupyter_themisto.backends._engine"]
    # The model's weights are mapped by the child, not by this process.
    assert maps_of(child, model_file) > 0
    assert maps_of(psutil.Process(), model_file) == mapped
    # Its own session: a Ctrl+C at the server's terminal (which asks before stopping) does not
    # reach it.
    assert os.getsid(engine.pid) == engine.pid != os.getsid(0)
    assert (await next_cells(backend, session()))[0].strip()
    assert engine.restarts == []


async def test_an_engine_killed_while_it_answers_fails_that_answer_and_the_next_is_answered(
    model_file,
):
    backend = own_engine()
    engine = backend.shared().model
    first = engine.pid

    def kill(pieces: int) -> None:
        if pieces == 3:
            os.kill(first, signal.SIGKILL)

    pieces, error = stream(backend, Completion(ENDLESS, max_tokens=LONG), kill)
    assert isinstance(error, EngineError)
    assert "the engine process ended (exit code -9)" in str(error)
    assert 3 <= len(pieces) < LONG
    await wait_for(lambda: not psutil.pid_exists(first), 10)  # reaped: no zombie left behind
    # A new engine starts at once, before anything is asked, and the model answers.
    await wait_for(lambda: engine.pid != first and running(psutil.Process(engine.pid)), 60)
    texts = await next_cells(backend, session())
    assert texts[0].strip()
    assert engine.pid != first and engine.restarts == ["ended (exit code -9)"]
    health = (await backend.health())["detail"]
    assert "its engine restarted 1× (last: it ended (exit code -9))" in health
    assert [c.pid for c in engine_children() if c.pid in (first, engine.pid)] == [engine.pid]


async def test_a_kill_mid_suggestion_reaches_the_person_as_a_backend_error(model_file):
    backend = own_engine()
    engine = backend.shared().model
    first = engine.pid
    real = backend.run

    def run_and_kill(model, job, cancelled, emit):
        def emit_and_kill(piece: str) -> None:
            emit(piece)
            if not gone(first):
                os.kill(first, signal.SIGKILL)

        return real(model, job, cancelled, emit_and_kill)

    backend.run = run_and_kill
    with pytest.raises(BackendError, match="engine process ended") as raised:
        await next_cells(backend, session())
    assert raised.value.status == 502
    backend.run = real
    assert (await next_cells(backend, session()))[0].strip()
    assert engine.pid != first


async def test_a_frozen_engine_is_killed_after_its_stall_timeout_and_replaced(model_file, caplog):
    backend = own_engine(engine_stall_timeout=2.0)
    engine = backend.shared().model
    first = engine.pid

    def freeze(pieces: int) -> None:
        if pieces == 2:
            os.kill(first, signal.SIGSTOP)

    start = time.monotonic()
    pieces, error = stream(backend, Completion(ENDLESS, max_tokens=LONG), freeze)
    took = time.monotonic() - start
    assert isinstance(error, EngineError)
    assert "stopped answering for 2 s: killed" in str(error) or "for 3 s" in str(error)
    assert 2 <= len(pieces) < LONG and took < 15
    await wait_for(lambda: gone(first), 10)
    texts = await next_cells(backend, session())
    assert texts[0].strip() and engine.pid != first
    assert len(engine.restarts) == 1 and "stopped answering" in engine.restarts[0]
    # Said in the log of the backend that loaded it (in a server, the server's log).
    said = [r for r in caplog.records if "stopped answering" in r.getMessage()]
    assert said and {r.name for r in said} == {backend.env.log.name}


async def test_a_frozen_request_that_was_cancelled_still_ends_the_engine(model_file):
    # The suggestion's time ran out and it was cancelled: the engine, frozen, never hears it;
    # the watchdog still ends it, and the slot it held is free again.
    backend = own_engine(engine_stall_timeout=2.0)
    engine = backend.shared().model
    first = engine.pid
    cancelled = threading.Event()

    def freeze(pieces: int) -> None:
        if pieces == 1:
            os.kill(first, signal.SIGSTOP)
            cancelled.set()

    _, error = stream(backend, Completion(ENDLESS, max_tokens=LONG), freeze, cancelled)
    assert isinstance(error, EngineError) and "stopped answering" in str(error)
    assert backend.shared().lock.acquire(timeout=0)  # (the slot was given back)
    backend.shared().lock.release()
    assert (await next_cells(backend, session()))[0].strip() and engine.pid != first


async def test_an_idle_engine_is_never_taken_for_stuck(model_file):
    # Silence counts only while a request waits: a stopped engine with no work is left alone.
    # (steps of a prompt well within the stall timeout)
    backend = own_engine(n_batch=32, engine_stall_timeout=3.0)
    engine = backend.shared().model
    pid = engine.pid
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(5)
    os.kill(pid, signal.SIGCONT)
    # Its last word came long ago: the stall counts from the request, not from then.
    assert (await next_cells(backend, session()))[0].strip()
    assert engine.pid == pid and engine.restarts == []


async def test_a_warm_up_is_heard_while_it_evaluates_a_long_prompt(model_file):
    # A prompt evaluated into the cache (max_tokens 0) says nothing until it is done unless it
    # streams: its progress, a chunk per step of n_batch tokens, is what the watchdog hears.
    backend = own_engine(n_batch=32)
    engine = backend.shared().model
    prompt = "".join(f"value_{i} = {i} * {i}\n" for i in range(60))
    body = backend.request(Completion(prompt, max_tokens=1), model=backend.shared())
    body["max_tokens"] = 0
    chunks: list[dict] = []
    engine.handle_completions(body, lambda chunk: chunks.append(chunk) and False)
    progress = [c for c in chunks if isinstance(c, dict) and "prompt_progress" in c]
    assert len(progress) >= 5, chunks[:3]


async def test_requests_the_engine_rejects_fail_alone(model_file):
    backend = own_engine()
    engine = backend.shared().model
    pid = engine.pid
    for body in [
        {},
        {"prompt": 5, "max_tokens": 4},
        {"prompt": "x = ", "max_tokens": "many"},
        {"prompt": "x = ", "temperature": "hot"},
        {"prompt": [999_999_999], "max_tokens": 4},
    ]:
        answer = engine.handle_completions(body)
        assert answer["error"]["code"] == 400 and answer["error"]["message"], (body, answer)
        chunks: list = []
        engine.handle_completions(dict(body, stream=True), chunks.append)
        assert chunks and "error" in json.dumps(chunks), (body, chunks)
    assert engine.pid == pid and engine.restarts == []
    assert (await next_cells(backend, session()))[0].strip()


async def test_many_requests_cancelled_at_once_leave_the_engine_answering(model_file):
    backend = own_engine(parallel=2)
    engine = backend.shared().model
    pid = engine.pid
    results: list[tuple[list[str], BackendError | None]] = []

    def one(seed: int) -> None:
        cancelled = threading.Event()
        job = Completion(ENDLESS, max_tokens=LONG, temperature=0.8, seed=seed)
        results.append(stream(backend, job, lambda n: n >= 2 and cancelled.set(), cancelled))

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8
    for pieces, error in results:
        assert error is None and 2 <= len(pieces) < 12, (len(pieces), error)
    assert engine.pid == pid and engine.restarts == []
    assert (await next_cells(backend, session()))[0].strip()


def test_closing_ends_the_engine_and_what_it_was_answering(model_file):
    backend = own_engine()
    engine = EngineProcess(backend.engine_config(model_file))
    pid = engine.pid
    errors: list[Exception] = []

    def long_answer() -> None:
        body = backend.request(Completion(ENDLESS, max_tokens=LONG))
        try:
            engine.handle_completions(body, lambda chunk: False)
        except EngineError as e:
            errors.append(e)

    worker = threading.Thread(target=long_answer)
    worker.start()
    time.sleep(1.0)
    start = time.monotonic()
    engine.close()
    worker.join(10)
    assert not worker.is_alive() and time.monotonic() - start < 8
    assert gone(pid) and not psutil.pid_exists(pid)
    assert len(errors) == 1 and "the engine process was closed" in str(errors[0])
    with pytest.raises(EngineError, match="closed"):
        engine.handle_completions({"prompt": "x", "max_tokens": 1})
    time.sleep(1.0)
    assert engine.pid == pid and engine.restarts == []  # (a closed engine is not started again)
    assert pid not in [c.pid for c in engine_children()]


async def test_a_model_file_gone_while_its_engine_runs_is_said_and_then_found_again(
    model_file, tmp_path, caplog
):
    others = {c.pid for c in engine_children()}
    link = tmp_path / "model.gguf"
    link.symlink_to(model_file)
    backend = own_engine(model_path=str(link))
    engine = backend.shared().model
    first = engine.pid
    link.unlink()
    os.kill(first, signal.SIGKILL)
    # The new engine cannot load it: said in the log, and to the next request; nothing loops.
    await wait_for(lambda: "did not start again" in caplog.text, 60)
    assert f"cannot load {link}" in caplog.text
    with pytest.raises(BackendUnavailable, match="no model file"):
        await next_cells(backend, session())
    await asyncio.sleep(1.0)
    assert caplog.text.count("did not start again") == 1
    assert {c.pid for c in engine_children()} <= others
    link.symlink_to(model_file)  # (put back: the next request starts the engine)
    assert (await next_cells(backend, session()))[0].strip()
    assert engine.pid != first and running(psutil.Process(engine.pid))


def test_an_engine_outlives_no_server(model_file, tmp_path):
    # The server is killed (SIGKILL: no atexit, no close): its engine exits on its own.
    script = tmp_path / "server.py"
    script.write_text(
        "import sys, time\n"
        "from jupyter_themisto.backends.llamacpp import LlamaCppPredictor\n"
        "engine = LlamaCppPredictor({}).shared().model\n"
        "print(engine.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(server.stdout.readline())
        assert psutil.Process(pid).ppid() == server.pid
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 15
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid)


def test_an_engine_that_fails_as_the_model_is_first_asked_is_ended_and_said(
    model_file, monkeypatch
):
    # The engine loaded its model, then froze as the server probed its vocabulary (the first
    # requests it gets): the load fails as the backend being unavailable (a 503, not a
    # backend's error), no process is left behind, and the next request loads the model again.
    before = {c.pid for c in engine_children()}
    backend = own_engine(engine_stall_timeout=2.0)
    real = llamacpp._prompt_tokens
    frozen: list[int] = []

    def freeze_at_first(server, prompt):
        if not frozen:
            frozen.append(server.pid)
            os.kill(server.pid, signal.SIGSTOP)
        return real(server, prompt)

    monkeypatch.setattr(llamacpp, "_prompt_tokens", freeze_at_first)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as raised:
        backend.shared()
    assert "failed as the model was first asked: the engine process stopped answering" in str(
        raised.value
    )
    assert raised.value.status == 503 and time.monotonic() - start < 15
    assert backend.model_key() not in loaded_models() and gone(frozen[0])
    time.sleep(0.5)  # (an engine started again behind the failed load would show by now)
    assert {c.pid for c in engine_children()} <= before
    monkeypatch.setattr(llamacpp, "_prompt_tokens", real)
    assert backend.shared().model.pid != frozen[0]
    assert backend.shared().details["single_tokens"]  # (probed this time)


def test_a_model_the_engine_cannot_load_leaves_no_process(model_file, tmp_path):
    before = {c.pid for c in engine_children()}
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(model_file.read_bytes()[: 1 << 20])  # a real file's first MB
    backend = own_engine(model_path=str(broken))
    with pytest.raises(BackendUnavailable, match=f"cannot load {broken}"):
        backend.shared()
    time.sleep(0.5)
    assert {c.pid for c in engine_children()} <= before
