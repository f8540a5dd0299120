"""llama.cpp's engine (xllamacpp) in a child process of its own, and the watchdog that ends it.

In the Jupyter server's process, a native engine that crashes takes the server down with it,
and one that stops answering can only be ended by restarting the server: once, in a long run
on the benchmark corpus, the engine's thread spun for ever in `update_slots` and every later
request waited until its timeout (llama.cpp reports alike: ggml-org/llama.cpp#16448). Here the
engine runs in a child process, behind the same `handle_completions` the backend used in
process: a child that ends, or that has work and says nothing for `stall_timeout` seconds, is
killed; the requests it held end with an error that says so, and a new engine starts at once
(the model loads again, 1.5-2 s for the default model on 2 cores, which a request asked
meanwhile waits for; its prompt cache starts empty).

The child is `python -m jupyter_themisto.backends._engine`. It reads the engine's settings as
one JSON line on stdin and answers `{"ready": address}` (its HTTP listener, which xllamacpp
always opens: loopback, refusing every request without a random key that never leaves the
child) or `{"failed": message}`; then each request as a line `{"id", "body", "stream"}`, which it
answers with lines `{"id", "chunk"}` (streamed requests) and a last one `{"id", "end", "result"
| "error"}`; `{"cancel": id}` stops a request at the engine's next chunk (a token, or a step of
`n_batch` tokens of the prompt). It exits when its stdin closes: the server ended, however it
ended. Its own session keeps a Ctrl+C meant for the server (which asks before it stops) away.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from .base import BackendError

#: seconds the engine may say nothing while it has work before it is taken for stuck (one step
#: of a prompt, 128 tokens, takes ~1-2 s on 2 idle cores: 30 s leaves room for busy cores)
STALL_TIMEOUT = 30.0
#: seconds a model may take to load in the child (a large file read from a slow disk)
LOAD_TIMEOUT = 300.0
#: seconds a closed engine gets to exit before it is killed
CLOSE_TIMEOUT = 5.0

log = logging.getLogger(__name__)


class EngineError(BackendError):
    """The engine failed a request, or ended while it held it."""


class _Child:
    """One engine process: its pipes, and the requests it holds."""

    def __init__(
        self, proc: subprocess.Popen[str], on_end: Callable[[_Child], None] | None = None
    ) -> None:
        self.proc = proc
        #: called (in the reader thread) once a child that had loaded its model has ended
        self.on_end = on_end
        self.ready = False
        #: each request's messages, by id (a request sent to a child that ended gets its end)
        self.pending: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.started: queue.Queue[dict[str, Any]] = queue.Queue()
        #: when the child last wrote a line (`time.monotonic()`)
        self.heard = time.monotonic()
        #: why the child ended, once it has (None: it runs)
        self.ended: str | None = None
        self.killed_for: str | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        """Write `message` to the child; False when it is gone."""
        assert self.proc.stdin is not None
        with self._send_lock:
            try:
                self.proc.stdin.write(json.dumps(message) + "\n")
                self.proc.stdin.flush()
                return True
            except (OSError, ValueError):  # a closed pipe: the child ended
                return False

    def register(self, rid: int) -> queue.Queue[dict[str, Any]] | None:
        """A queue for request `rid`'s messages; None when the child has ended."""
        with self._lock:
            if self.ended is not None:
                return None
            found: queue.Queue[dict[str, Any]] = queue.Queue()
            self.pending[rid] = found
            return found

    def ending(self, why: str) -> None:
        """The child is being ended for `why`: what its requests are told when it has."""
        with self._lock:
            if self.killed_for is None and self.ended is None:
                self.killed_for = why

    def kill(self, why: str) -> None:
        """End the child for `why` (its requests then end with it, see `read`)."""
        self.ending(why)
        try:
            self.proc.kill()
        except OSError:
            pass

    def read(self) -> None:
        """The child's lines, handed to their requests until it ends (the reader thread)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.heard = time.monotonic()
            try:
                message = json.loads(line)
            except ValueError:
                log.debug("llamacpp engine: not a message: %r", line[:200])
                continue
            if "ready" in message or "failed" in message:
                self.ready = "ready" in message
                self.started.put(message)
                continue
            with self._lock:
                found = self.pending.get(message.get("id", -1))
                if message.get("end"):
                    self.pending.pop(message["id"], None)
            if found is not None:
                found.put(message)
        code = self.proc.wait()
        with self._lock:
            self.ended = self.killed_for or f"ended (exit code {code})"
            pending, self.pending = self.pending, {}
        self.started.put({"failed": f"the engine process {self.ended}"})
        for found in pending.values():
            found.put({"end": True, "error": f"the engine process {self.ended}"})
        if self.ready and self.on_end is not None:
            self.on_end(self)


class EngineProcess:
    """llama.cpp's engine in a child process, asked as an `xllamacpp.Server` is
    (`handle_completions`), started again as soon as it ended or stopped answering.

    `config`: the engine's settings (see `_params`); `stall_timeout`: seconds of silence with
    work pending after which the engine is killed (its requests then fail, and a new engine
    starts); `log`: where restarts are told (the server's log)."""

    def __init__(
        self,
        config: dict[str, Any],
        stall_timeout: float = STALL_TIMEOUT,
        log: logging.Logger = log,
    ) -> None:
        self.config = config
        self.stall_timeout = stall_timeout
        self.log = log
        #: engines started after the first one ended, and why each of those ended
        self.restarts: list[str] = []
        self.listening_address = ""
        self._ids = itertools.count(1)
        self._start_lock = threading.Lock()
        self._closed = False
        self._child = self._start()

    @property
    def pid(self) -> int:
        return self._child.proc.pid

    def _start(self) -> _Child:
        env = dict(os.environ)
        # llama.cpp's OpenMP threads sleep while they wait instead of spinning: on busy cores
        # (a kernel computing) spinning made generation ~10 times slower here (1 token/s
        # instead of 10 on 2 loaded cores). A value the person set is kept.
        env.setdefault("OMP_WAIT_POLICY", "passive")
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            env=env,
            start_new_session=True,
        )
        child = _Child(proc, self._ended)
        threading.Thread(target=child.read, name="themisto-engine-reader", daemon=True).start()
        child.send(self.config)
        try:
            started = child.started.get(timeout=LOAD_TIMEOUT)
        except queue.Empty:
            child.kill(f"did not load the model within {LOAD_TIMEOUT:g} s")
            raise EngineError(
                f"the engine did not load the model within {LOAD_TIMEOUT:g} s"
            ) from None
        if "failed" in started:
            child.kill("failed to start")
            raise EngineError(f"cannot load {self.config.get('model_path')}: {started['failed']}")
        self.listening_address = str(started["ready"])
        return child

    def _ended(self, child: _Child) -> None:
        """A child that had loaded its model ended: a new one starts at once, in the background,
        unless the engine was closed (a request asked meanwhile waits for it)."""
        if child is self._child and not self._closed:
            name = "themisto-engine-start"
            threading.Thread(target=self._restart, name=name, daemon=True).start()

    def _restart(self) -> None:
        try:
            self._running()
        except EngineError as e:
            if not self._closed:  # (closed meanwhile: nothing was to start)
                self.log.warning(
                    "llamacpp: the engine did not start again (%s); the next request tries", e
                )

    def _running(self) -> _Child:
        """The running child, a new one if the last one ended."""
        with self._start_lock:
            if self._closed:
                raise EngineError("the engine was closed")
            child = self._child
            ended = child.ended or child.killed_for  # (a killed child may not have ended yet)
            if ended is not None:
                self.log.warning("llamacpp: the engine process %s: starting a new one", ended)
                self.restarts.append(ended)
                self._child = child = self._start()
            return child

    def handle_completions(
        self,
        body: dict[str, Any],
        callback: Callable[[Any], bool] | None = None,
        cancelled: threading.Event | None = None,
    ) -> Any:
        """The engine's answer to the completion request `body`: as xllamacpp's, with
        `callback` called with each chunk (a True return stops the request) and None
        returned, else the whole answer returned. `cancelled`, once set, stops the request
        at the engine's next chunk even while no chunk reaches `callback`."""
        child = self._running()
        rid = next(self._ids)
        messages = child.register(rid)
        if messages is None or not child.send({"id": rid, "body": body, "stream": bool(callback)}):
            raise EngineError(f"the engine process {child.ended or 'ended'}")
        sent = time.monotonic()
        stopping = False
        while True:
            try:
                message: dict[str, Any] | None = messages.get(
                    timeout=0.05 if cancelled is not None else 1.0
                )
            except queue.Empty:
                message = None
                silent = time.monotonic() - max(child.heard, sent)
                if silent > self.stall_timeout and child.killed_for is None:
                    why = f"stopped answering for {silent:.0f} s: killed"
                    self.log.warning("llamacpp: the engine %s; a new one starts", why)
                    child.kill(why)
            if not stopping:
                chunk = message.get("chunk") if message is not None else None
                asked = callback is not None and chunk is not None and bool(callback(chunk))
                if asked or (cancelled is not None and cancelled.is_set()):
                    child.send({"cancel": rid})
                    stopping = True
            if message is not None and message.get("end"):
                if message.get("error"):
                    raise EngineError(str(message["error"]))
                return message.get("result")

    def close(self) -> None:
        """End the engine (its pending requests fail); it is not started again."""
        with self._start_lock:
            self._closed = True
            child = self._child
        proc = child.proc
        child.ending("was closed")
        if proc.stdin is not None:
            try:
                proc.stdin.close()  # the child exits when its stdin closes
            except OSError:
                pass
        try:
            proc.wait(timeout=CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            child.kill("was closed")
            proc.wait()


# -- the child -------------------------------------------------------------------------------


def _params(xllamacpp: Any, config: dict[str, Any]) -> Any:
    """xllamacpp's CommonParams for `config` (what `LlamaCppPredictor.engine_config` sends)."""
    params = xllamacpp.CommonParams()
    params.model.path = config["model_path"]
    params.n_ctx = config["n_ctx"]
    params.n_parallel = config["parallel"]
    params.n_predict = config["n_predict"]
    params.cpuparams.n_threads = config["n_threads"]
    params.cpuparams_batch.n_threads = config["n_threads"]
    # The engine looks for cancelled requests between steps of n_batch tokens: a long prompt
    # evaluated in one step could not be stopped for seconds.
    params.n_batch = params.n_ubatch = config["n_batch"]
    params.cache_ram_mib = config["cache_ram_mb"]
    params.flash_attn_type = (
        xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if config["flash_attn"]
        else xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    if config["speculative_ngram"]:
        spec = params.speculative
        spec.types = [xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
        spec.ngram_simple.size_n = config["speculative_ngram"]
        spec.ngram_simple.size_m = spec.draft.n_max = config["speculative_draft"]
    params.sampling.seed = config["seed"]
    params.verbosity = -1
    # The engine's HTTP listener cannot be turned off: loopback, a free port, and a key nobody
    # outside this process knows; no web page, no slot or metrics endpoints.
    params.hostnames = ["127.0.0.1"]
    params.port = 0
    params.api_keys = [secrets.token_urlsafe(32)]
    params.ui = False
    params.endpoint_slots = False
    params.endpoint_metrics = False
    params.endpoint_props = False
    return params


def main() -> None:
    # The messages go to the parent through a copy of stdout; whatever native code prints goes
    # to stderr, never into them.
    out: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    write_lock = threading.Lock()

    def write(message: dict[str, Any]) -> None:
        with write_lock:
            out.write(json.dumps(message) + "\n")
            out.flush()

    config = json.loads(sys.stdin.readline() or "{}")
    try:
        import xllamacpp

        server = xllamacpp.Server(_params(xllamacpp, config))
    except Exception as e:  # noqa: BLE001 - told to the parent
        write({"failed": str(e)})
        return
    write({"ready": server.listening_address})
    flags: dict[int, threading.Event] = {}

    def serve(rid: int, body: dict[str, Any], stream: bool, flag: threading.Event) -> None:
        def on_chunk(chunk: Any) -> bool:
            write({"id": rid, "chunk": chunk})
            return flag.is_set()

        try:
            if stream:
                server.handle_completions(body, on_chunk)
                write({"id": rid, "end": True})
            else:
                write({"id": rid, "end": True, "result": server.handle_completions(body)})
        except Exception as e:  # noqa: BLE001 - told to the parent
            write({"id": rid, "end": True, "error": f"{type(e).__name__}: {e}"})
        finally:
            flags.pop(rid, None)

    for line in sys.stdin:
        message = json.loads(line)
        if "cancel" in message:
            found = flags.get(message["cancel"])
            if found is not None:
                found.set()
            continue
        rid = message["id"]
        flag = flags[rid] = threading.Event()
        args = (rid, message["body"], message["stream"], flag)
        threading.Thread(target=serve, args=args, daemon=True).start()
    # stdin closed: the server ended. Exit at once (the engine's threads and finalizers are
    # of no use any more and may be mid-request).
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
