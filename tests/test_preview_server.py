"""The preview backend through the real server: POST /themisto/predict/output with a live,
auto-recorded kernel; cells that write files are previewed in a private copy; stopped previews
fall back or say why; a busy kernel is not queued on, and a kernel that has just answered (a
preview, a cell) is not taken for busy."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import sqlite3
import time

import nbformat
import psutil
import pytest
from tornado.httpclient import HTTPClientError

from jupyter_themisto.backends.preview import _not_idle
from jupyter_themisto.store import TrajectoryStore
from tests.helpers import (
    gone,
    parse_sse,
    post,
    run_cell,
    running,
    server_config,
    start_session,
    wait_for,
)
from tests.peers import OpenAIPeer


@pytest.fixture
def fallback():
    return None


@pytest.fixture
def fallback_settings(fallback, request):
    if fallback == "openai":  # a loopback model server stands in
        peer = request.getfixturevalue("peer")
        return {"openai": {"base_url": peer.url, "api_key": "loopback", "max_retries": 0}}
    if fallback == "llamacpp":
        # A whole answer within the default 5 s is not what is tested here: a loaded machine
        # ended it before the model's first word (an empty answer).
        return {"llamacpp": {"suggestion_timeout": 120.0, "output_timeout": 120.0}}
    return {}


@pytest.fixture
def preview_timeout():
    return 5.0


@pytest.fixture
def preview_settings():
    return {}


@pytest.fixture
def busy_wait():
    return None  # the default


@pytest.fixture
def jp_server_config(
    store_path, fallback, fallback_settings, preview_timeout, preview_settings, busy_wait
):
    settings = {"timeout": preview_timeout, **preview_settings}
    if busy_wait is not None:
        settings["busy_wait"] = busy_wait
    if fallback:
        settings["fallback"] = fallback
    backends = {"preview": settings, **fallback_settings}
    return server_config(auto_record=True, backend_settings=backends)


async def live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, setup: str) -> str:
    """A notebook session whose kernel ran `setup` and recorded it."""
    nb = nbformat.v4.new_notebook()
    nbformat.write(nb, str(jp_root_dir / "p.ipynb"))
    kernel_id = await start_session(jp_fetch, "p.ipynb")
    app = jp_serverapp.web_app.settings["themisto_app"]
    await wait_for(lambda: kernel_id in app.auto_recorder.outcomes)
    await run_cell(jp_serverapp, kernel_id, setup)
    store = TrajectoryStore(store_path)

    def recorded() -> bool:
        # The setup's row, not only its trajectory: on a loaded machine the first row follows
        # the trajectory on the recorder's writer thread, after the cell's reply.
        trajectory = store.latest_trajectory_for_kernel(kernel_id)
        return bool(trajectory and trajectory.get("n_executions"))

    try:
        await wait_for(recorded)
    finally:
        store.close()
    kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    await wait_for(lambda: kernel.execution_state == "idle")
    return kernel_id


async def predict(jp_fetch, kernel_id, source, **extra):
    body = {"kernel_id": kernel_id, "source": source, "backend": "preview", **extra}
    r = await post(jp_fetch, "output", body, request_timeout=120)
    return parse_sse(r.body.decode())


#: a long cell whose preview starts a process of its own: a cancelled preview leaves neither
#: (this test run's own sleeper: another run of these tests on the machine has its own)
SLEEPER = ["sleep", f"301.{os.getpid()}"]
LONG = f"import subprocess, time\np = subprocess.Popen({SLEEPER!r})\ntime.sleep(300)"


def sleepers() -> list[psutil.Process]:
    """LONG's `sleep 301` processes that still run (wherever a preview left them)."""
    found = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == SLEEPER]
    return [p for p in found if running(p)]


def preview_processes(kernel_pid: int) -> list[psutil.Process]:
    """The kernel's running descendants (the preview's monitor, first process, `sleep 301`)."""
    try:
        found = psutil.Process(kernel_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        found = []
    return [p for p in found if running(p)] + sleepers()


async def long_preview_running(jp_fetch, jp_serverapp, kernel_id, request_timeout=120, **extra):
    """A request previewing LONG, once its `sleep 301` runs: (the request's task, kernel pid)."""
    pid = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.process.pid
    await wait_for(lambda: not preview_processes(pid))  # (the recorder's snapshot child)
    for _ in range(50):
        task = asyncio.ensure_future(
            post(
                jp_fetch,
                "output",
                {"kernel_id": kernel_id, "source": LONG, "backend": "preview", **extra},
                request_timeout=request_timeout,
            )
        )
        await wait_for(lambda task=task: task.done() or sleepers())
        if not task.done():
            return task, pid
        # Refused: a preview answered just before may leave the kernel busy for a moment after
        # its answer (its reply and idle status come next), and with `busy_wait` 0 a busy
        # kernel is refused at once. Anything else is a failure.
        events = parse_sse((await task).body.decode())
        reasons = [d["reason"] for n, d in events if n == "no_prediction"]
        assert reasons and reasons[0].startswith("kernel busy"), events
        await asyncio.sleep(0.1)
    raise AssertionError("the kernel stayed busy")


async def superseded_by_its_client(jp_fetch, jp_serverapp, kernel_id) -> int:
    """A long preview of client browser-1 superseded by its next request (409), which answers
    `print(x)` with x = 1: the kernel's pid."""
    first, pid = await long_preview_running(
        jp_fetch, jp_serverapp, kernel_id, client_id="browser-1"
    )
    events = await predict(jp_fetch, kernel_id, "print(x)", client_id="browser-1")
    assert "".join(d["text"] for n, d in events if n == "chunk") == "1\n", events
    with pytest.raises(HTTPClientError) as superseded:
        await first
    assert superseded.value.code == 409
    return pid


async def refused_for_another_client(jp_fetch, jp_serverapp, kernel_id):
    """A long preview running while another client asks: that one is refused at once ("kernel
    busy"), not queued behind: (the running preview's task, kernel pid)."""
    task, pid = await long_preview_running(jp_fetch, jp_serverapp, kernel_id)
    events = await predict(jp_fetch, kernel_id, "print(x)", client_id="browser-2")
    reasons = [d["reason"] for n, d in events if n == "no_prediction"]
    assert reasons and reasons[0].startswith("kernel busy"), events
    return task, pid


@pytest.mark.parametrize("preview_timeout", [50.0])
async def test_a_long_preview_runs_and_is_cancelled_with_its_request(
    jp_fetch, jp_serverapp, jp_root_dir, store_path
):
    """A preview may run as long as the cell would; when its request goes (the client went
    away, asked for another prediction, the kernel is interrupted or restarted) the preview in
    the kernel is killed with every process it started, and the person's cell runs at once."""
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 1")
    backend = jp_serverapp.web_app.settings["themisto_app"].manager.backend("preview")
    try:
        # Longer than the old 5 s bound.
        events = await predict(jp_fetch, kernel_id, "import time\ntime.sleep(6)\nprint('done')")
        assert "".join(d["text"] for n, d in events if n == "chunk") == "done\n", events

        # The client goes away: it gives up after 8 s and closes its connection.
        task, pid = await long_preview_running(jp_fetch, jp_serverapp, kernel_id, request_timeout=8)
        with pytest.raises(HTTPClientError) as gone:
            await task
        assert gone.value.code == 599  # (the client's own timeout)
        started = time.monotonic()
        await wait_for(lambda: not preview_processes(pid), timeout=20)
        reply = await run_cell(jp_serverapp, kernel_id, "", user_expressions={"v": "x + 1"})
        assert reply["user_expressions"]["v"]["data"]["text/plain"] == "2"
        assert time.monotonic() - started < 30  # not after the preview's 50 s
        assert backend.cancelled == 1

        # The same client asks for another prediction on that kernel: the first is superseded.
        pid = await superseded_by_its_client(jp_fetch, jp_serverapp, kernel_id)
        assert backend.cancelled == 2
        # (the second preview's own processes end just after its reply)
        await wait_for(lambda: not preview_processes(pid), timeout=20)

        # Another client's preview on that kernel meanwhile: not queued behind, said so.
        task, pid = await refused_for_another_client(jp_fetch, jp_serverapp, kernel_id)

        # An interrupt of the kernel ends the preview: said so, nothing left running.
        await jp_fetch("api", "kernels", kernel_id, "interrupt", method="POST", body="")
        events = parse_sse((await task).body.decode())
        reasons = [d["reason"] for n, d in events if n == "no_prediction"]
        assert reasons == ["preview cancelled: the kernel was interrupted"], events
        await wait_for(lambda: not preview_processes(pid), timeout=20)

        # A restart: the old kernel and its preview are gone, the new kernel answers.
        task, pid = await long_preview_running(
            jp_fetch, jp_serverapp, kernel_id, request_timeout=20
        )
        await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="")
        await wait_for(lambda: not preview_processes(pid), timeout=30)
        # The request is answered (within its 20 s, not the preview's 50): that kernel will
        # never reply. (The old kernel may still have cancelled it itself while shutting down.)
        events = parse_sse((await task).body.decode())
        reasons = [d["reason"] for n, d in events if n == "no_prediction"]
        assert len(reasons) == 1 and reasons[0].startswith("preview cancelled"), events
        reply = await run_cell(jp_serverapp, kernel_id, "", user_expressions={"v": "'x' in dir()"})
        assert reply["user_expressions"]["v"]["data"]["text/plain"] == "False"
        # and the new kernel previews at once (nothing of the old preview holds it)
        events = await predict(jp_fetch, kernel_id, "print('again')")
        assert "".join(d["text"] for n, d in events if n == "chunk") == "again\n", events
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
    assert not sleepers()


@pytest.mark.parametrize("preview_timeout", [50.0])
@pytest.mark.parametrize("end", ["shut down", "killed"])
async def test_a_preview_whose_kernel_ends_is_answered_at_once(
    jp_fetch, jp_serverapp, jp_root_dir, store_path, end
):
    """The kernel is shut down, or killed (the server restarts it), while its preview runs:
    the request is answered within seconds (not after the preview's 50 s), and nothing the
    preview started is left running."""
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 1")
    task, pid = await long_preview_running(jp_fetch, jp_serverapp, kernel_id, request_timeout=30)
    started = time.monotonic()
    if end == "shut down":
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
    else:
        os.kill(pid, signal.SIGKILL)
    events = parse_sse((await task).body.decode())
    reasons = [d["reason"] for n, d in events if n == "no_prediction"]
    assert len(reasons) == 1 and reasons[0].startswith("preview cancelled"), events
    assert time.monotonic() - started < 25
    await wait_for(lambda: not preview_processes(pid), timeout=20)
    assert gone(pid)
    if end == "killed":
        # The server restarts a killed kernel. Shut it down here once that restart is over:
        # the fixture's teardown, meeting a restart half done, fails in jupyter_client
        # (InvalidStateError from km.ready.exception(), CI of 86c1b9f).
        km = jp_serverapp.kernel_manager.get_kernel(kernel_id)

        def restarted() -> bool:
            process = getattr(km.provisioner, "process", None)  # (None mid-restart)
            return bool(process and process.pid != pid and km.ready.done())

        await wait_for(restarted, timeout=60)
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("preview_timeout", [50.0])
@pytest.mark.parametrize("busy_wait", [0.0])
async def test_a_superseded_preview_is_waited_for_however_long_it_takes_to_end(
    jp_fetch, jp_serverapp, jp_root_dir, store_path
):
    """The request that supersedes its client's running preview waits until that preview,
    cancelled, has ended and its kernel is idle (moments, or seconds on a loaded machine: here
    busy_wait gives a busy kernel no time at all), instead of answering "kernel busy"."""
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 1")
    try:
        pid = await superseded_by_its_client(jp_fetch, jp_serverapp, kernel_id)
        await wait_for(lambda: not preview_processes(pid), timeout=30)
        # Another client's preview is not superseded by it: refused at once, as before.
        other, pid = await refused_for_another_client(jp_fetch, jp_serverapp, kernel_id)
        await jp_fetch("api", "kernels", kernel_id, "interrupt", method="POST", body="")
        await other
        await wait_for(lambda: not preview_processes(pid), timeout=30)
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_a_cell_that_waits_for_input_says_so(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 1")
    try:
        events = await predict(jp_fetch, kernel_id, "name = input('Name? ')\nprint(name)")
        stopped = [d for n, d in events if n == "no_prediction"]
        assert stopped == [
            {
                "reason": "this cell waits for input; no preview (no fallback backend configured)",
                "code": "waits_for_input",
                "details": {},
            }
        ], events
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("preview_timeout, preview_settings", [(60.0, {"cpu_seconds": 1})])
async def test_a_preview_stopped_by_its_cpu_bound_says_so(
    jp_fetch, jp_serverapp, jp_root_dir, store_path
):
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 1")
    try:
        events = await predict(jp_fetch, kernel_id, "print('go')\nwhile True:\n    x += 1")
        stopped = [d for n, d in events if n == "no_prediction"]
        # (it said "crash the kernel (signal SIGKILL)"; the frontend words it from the code)
        assert stopped == [
            {
                "reason": "the preview used its 1 CPU second and was stopped; the real cell may"
                " take long (no fallback backend configured)",
                "code": "preview_cpu_bound",
                "details": {"seconds": 1},
            }
        ], events
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_preview_through_the_server(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    kernel_id = await live_kernel(
        jp_fetch, jp_serverapp, jp_root_dir, store_path, "xs = [1, 2]\nprint('set up')"
    )
    try:
        r = await jp_fetch("themisto", "backends")
        preview = [b for b in json.loads(r.body)["backends"] if b["name"] == "preview"]
        assert preview and preview[0]["tasks"] == ["output"] and preview[0]["health"]["ok"]

        events = await predict(jp_fetch, kernel_id, "xs.append(3)\nprint('hello')\nxs")
        assert events[0][0] == "meta" and events[0][1]["backend"] == "preview"
        text = "".join(d["text"] for name, d in events if name == "chunk")
        assert text == "hello\n[1, 2, 3]\n"
        assert events[-1][0] == "done"

        # A preview right after a preview: answered, not refused for the first one's status.
        for _ in range(5):
            events = await predict(jp_fetch, kernel_id, "print(len(xs))")
            assert "".join(d["text"] for n, d in events if n == "chunk") == "2\n", events

        # A cell that writes a file and reads it back: its real output, nothing real written.
        events = await predict(
            jp_fetch,
            kernel_id,
            "open('results.csv', 'w').write('1,2')\nprint(open('results.csv').read())",
        )
        assert "".join(d["text"] for n, d in events if n == "chunk") == "1,2\n", events
        assert not (jp_root_dir / "results.csv").exists()

        # Stopped: no fallback configured, so the reason is the answer.
        events = await predict(
            jp_fetch, kernel_id, "import socket\nsocket.create_connection(('127.0.0.1', 9))"
        )
        reasons = [d["reason"] for name, d in events if name == "no_prediction"]
        assert reasons == [
            "preview stopped: the cell would open a network connection (('127.0.0.1', 9)) "
            "(no fallback backend configured)"
        ], events

        # Right after a cell finished: answered.
        await run_cell(jp_serverapp, kernel_id, "ys = [5]")
        events = await predict(jp_fetch, kernel_id, "ys")
        assert "".join(d["text"] for n, d in events if n == "chunk") == "[5]\n", events

        # Busy: a running cell is never queued behind. (The cell runs until the test lets it
        # end: a fixed time could run out first on a loaded machine.)
        kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        release = jp_root_dir / "release-the-cell"
        sleep = run_cell(
            jp_serverapp,
            kernel_id,
            "import os, time\n_end = time.monotonic() + 50\n"
            f"while not os.path.exists({str(release)!r}) and time.monotonic() < _end:\n"
            "    time.sleep(0.05)",
        )
        sleeping = asyncio.create_task(sleep)
        await wait_for(lambda: kernel.execution_state == "busy")
        # The new client's kernel_info_request is busy for a moment too: outlast it.
        await asyncio.sleep(1.0)
        await wait_for(lambda: kernel.execution_state == "busy")
        events = await predict(jp_fetch, kernel_id, "xs")
        assert [n for n, _ in events if n == "no_prediction"], events
        assert "kernel busy" in [d for n, d in events if n == "no_prediction"][0]["reason"]
        release.touch()

        # The person's namespace is untouched by the previews.
        await sleeping
        reply = await run_cell(jp_serverapp, kernel_id, "", user_expressions={"v": "xs"})
        assert reply["user_expressions"]["v"]["data"]["text/plain"] == "[1, 2]"
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("fallback", ["repeat-previous"])
async def test_stopped_preview_falls_back(jp_fetch, jp_serverapp, jp_root_dir, store_path):
    """...and the server's log tells that it stopped, not the reasons: they quote what the
    cell chose (a host name here), which only the person is shown."""
    kernel_id = await live_kernel(
        jp_fetch, jp_serverapp, jp_root_dir, store_path, "print('recorded output')"
    )
    ext_log = next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_themisto"])).log
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    ext_log.addHandler(handler)
    try:
        events = await predict(
            jp_fetch,
            kernel_id,
            "import urllib.request\nurllib.request.urlopen('http://hostplanted-0014.example.org')",
        )
        assert events[0] == ("meta", events[0][1]) and events[0][1]["backend"] == "preview"
        text = "".join(d["text"] for name, d in events if name == "chunk")
        # repeat-previous predicts the last recorded output.
        assert text == "recorded output\n"
        # The client learns what stopped the preview and which backend stood in.
        meta = next(d for name, d in events if name == "chunk")["metadata"]["preview"]
        assert meta["fallback"] == "repeat-previous"
        assert meta["stopped"] == ["look up 'hostplanted-0014.example.org' on the network"]
        assert "a preview stopped" in lines.getvalue()
        assert "hostplanted-0014" not in lines.getvalue()
    finally:
        ext_log.removeHandler(handler)
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize(
    "fallback, preview_timeout, preview_settings", [("repeat-previous", 60.0, {"cpu_seconds": 1})]
)
async def test_a_preview_stopped_by_its_cpu_bound_falls_back_and_says_why(
    jp_fetch, jp_serverapp, jp_root_dir, store_path
):
    kernel_id = await live_kernel(
        jp_fetch, jp_serverapp, jp_root_dir, store_path, "print('recorded output')"
    )
    try:
        events = await predict(jp_fetch, kernel_id, "while True:\n    pass")
        assert "".join(d["text"] for n, d in events if n == "chunk") == "recorded output\n"
        # (the frontend words the note from cpu_bound)
        meta = next(d for n, d in events if n == "chunk")["metadata"]["preview"]
        assert meta["fallback"] == "repeat-previous" and meta["cpu_bound"] == 1, meta
        assert meta["stopped"] == ["use more than the preview's 1 CPU second"]
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("fallback", ["llamacpp"])
async def test_stopped_preview_falls_back_to_a_local_model(
    jp_fetch, jp_serverapp, jp_root_dir, store_path
):
    """A real model (the default code model, through llamacpp) stands in for a preview the
    sandbox stopped."""
    kernel_id = await live_kernel(
        jp_fetch, jp_serverapp, jp_root_dir, store_path, "words = ['a', 'b']\nprint(len(words))"
    )
    try:
        events = await predict(
            jp_fetch,
            kernel_id,
            "import socket\nsocket.create_connection(('10.1.2.3', 80))\nprint(len(words) + 1)",
        )
        chunks = [d for name, d in events if name == "chunk"]
        assert chunks, events
        # (After `print(2)` the model had only prose to offer, after a code fence it may not open.)
        text = "".join(c["text"] for c in chunks)
        assert text.strip() and "``" not in text
        meta = chunks[0]["metadata"]["preview"]
        assert meta["fallback"] == "llamacpp"
        assert meta["stopped"] == ["open a network connection (('10.1.2.3', 80))"]
        assert events[-1][0] == "done"
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_a_status_that_lags_behind_the_kernel_is_waited_for(
    jp_fetch, jp_serverapp, jp_root_dir, store_path
):
    """The server learns the kernel's state from status messages that arrive after the replies
    they follow. A preview asked while the state still says "busy" from a request that has
    already been answered waits for the "idle" instead of answering "kernel busy"."""
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 41")
    kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    try:
        kernel.execution_state = "busy"  # as it reads right after a reply

        async def idle_soon() -> None:
            await asyncio.sleep(0.3)
            kernel.execution_state = "idle"

        idle = asyncio.create_task(idle_soon())
        events = await predict(jp_fetch, kernel_id, "x + 1")
        await idle
        assert "".join(d["text"] for n, d in events if n == "chunk") == "42\n", events
        # A state that stays busy past `busy_wait` is a running cell: no preview. (The first
        # preview's own status messages land first, or they would reset the state by hand.)
        await wait_for(lambda: kernel.execution_state == "idle")
        await asyncio.sleep(1.0)
        kernel.execution_state = "busy"
        events = await predict(jp_fetch, kernel_id, "x + 1")
        reasons = [d["reason"] for n, d in events if n == "no_prediction"]
        assert reasons and reasons[0] == "kernel busy: no preview while a cell runs", events
        kernel.execution_state = "idle"
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("busy", "kernel busy: no preview while a cell runs"),
        ("starting", "kernel busy: no preview while the kernel starts"),
        ("restarting", "kernel busy: no preview while the kernel starts"),
        ("dead", "kernel busy (dead): no preview until it is idle"),
    ],
)
def test_a_kernel_that_is_not_idle_is_named_by_its_state(state, reason):
    assert _not_idle(state) == reason


SECRET = "hunter2-planted-preview-0001"


@pytest.fixture
def peer():
    with OpenAIPeer(reply="42") as p:
        yield p


@pytest.mark.parametrize("fallback", ["openai"])
async def test_the_preview_runs_the_cell_as_written_and_its_fallback_gets_no_secret(
    jp_fetch, jp_serverapp, jp_root_dir, store_path, peer
):
    """Secrets are scrubbed from what a model receives, not from what runs in the person's
    own kernel: the preview answers as the real cell would; a stopped preview's stand-in (a
    loopback model server) never sees the value."""
    kernel_id = await live_kernel(
        jp_fetch, jp_serverapp, jp_root_dir, store_path, f"api_key = {SECRET!r}"
    )
    try:
        source = f"print(len(api_key), api_key == {SECRET!r})"
        events = await predict(jp_fetch, kernel_id, source)
        assert "".join(d["text"] for n, d in events if n == "chunk") == "28 True\n", events
        assert peer.requests == []

        stopped = f"import socket\nsocket.create_connection(('10.1.2.3', 80))\nprint({SECRET!r})"
        events = await predict(jp_fetch, kernel_id, stopped)
        chunks = [d for n, d in events if n == "chunk"]
        assert chunks and chunks[0]["metadata"]["preview"]["fallback"] == "openai", events
        assert len(peer.requests) == 1
        sent = json.dumps([r.body for r in peer.requests])
        assert "socket.create_connection" in sent and SECRET not in sent
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


#: a kernel whose Linux lacks seccomp (the preview then answers "unsupported")
NO_SECCOMP = (
    "import jupyter_themisto.kernel.sandbox as _sandbox\n"
    "def _lacking(permissive):\n"
    "    raise _sandbox.Unavailable('seccomp')\n"
    "_sandbox.seccomp_program = _lacking"
)


@pytest.mark.parametrize("fallback", ["openai"])
@pytest.mark.parametrize("ending", ["stopped", "unsupported"])
async def test_a_secret_the_store_has_not_taken_yet_reaches_no_fallback(
    jp_fetch, jp_serverapp, jp_root_dir, store_path, peer, ending
):
    """Another process holds the store's write lock while a cell binds a secret, and while a
    cell printing it is previewed: the value's hash is not in the store yet, and the fallback
    model still never sees the value, whatever the preview ended with (the kernel scrubs the
    cell in every reply): stopped by the sandbox, or not run (a Linux without seccomp)."""
    secret = "hunter2-planted-preview-0002"
    kernel_id = await live_kernel(jp_fetch, jp_serverapp, jp_root_dir, store_path, "x = 1")
    holder = sqlite3.connect(store_path, timeout=0, isolation_level=None)
    try:
        if ending == "unsupported":
            await run_cell(jp_serverapp, kernel_id, NO_SECCOMP)
        holder.execute("BEGIN IMMEDIATE")
        await run_cell(jp_serverapp, kernel_id, f"api_key = {secret!r}")
        stopped = f"import socket\nsocket.create_connection(('10.1.2.3', 80))\nprint({secret!r})"
        events = await predict(jp_fetch, kernel_id, stopped)
        with TrajectoryStore(store_path, readonly=True) as store:
            assert store.secret_digest_count() == 0  # (still held: the server cannot know it)
        chunks = [d for n, d in events if n == "chunk"]
        assert chunks and chunks[0]["metadata"]["preview"]["fallback"] == "openai", events
        assert chunks[0]["metadata"]["preview"]["status"] == (
            "unsupported" if ending == "unsupported" else "ok"
        )
        sent = json.dumps([r.body for r in peer.requests])
        assert "socket.create_connection" in sent and secret not in sent
    finally:
        holder.close()
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
