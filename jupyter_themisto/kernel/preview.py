"""Runs a cell speculatively in an isolated fork of the kernel and returns what it would show.

The server calls `run_preview(source)` through a silent execute_request's user_expressions.
The kernel forks a monitor, which enters new namespaces and forks the preview's first process
into them (see `sandbox`). That process isolates itself — private copy-on-write root, no
descriptor shared with the kernel but the reply pipe, no capability, Landlock, seccomp — runs the
cell against its copy-on-write namespace with IPython-like semantics (streams, displays, the last
expression's execute_result formatted by the shell's own display formatter), sends the outputs
back as JSON and leaves with os._exit. The kernel reads the reply within bounds of time, bytes
and memory, and has the monitor kill the whole namespace at the end, whatever it is doing.
"""

from __future__ import annotations

import ast
import errno
import gc
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from . import sandbox

DEFAULT_TIMEOUT = 5.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_CPU_SECONDS = 10
#: the most JSON a child sends back (outputs beyond it are cut)
MAX_PAYLOAD = 4 * 2**20
#: the most the kernel reads from a preview (more: the preview is killed and stopped)
MAX_REPLY = MAX_PAYLOAD + 2**16
#: what ends a reply (JSON escapes control characters, so it never holds this): the kernel
#: need not wait for the preview's processes to exit
REPLY_END = b"\n\x04"
#: how often the kernel checks the child's memory while it runs (seconds)
MEMORY_POLL = 0.02


class PreviewReply(dict):
    """The preview's result; formats as application/json so that user_expressions carries it
    to the server intact."""

    def _repr_json_(self) -> dict[str, Any]:
        return dict(self)

    def __repr__(self) -> str:
        return f"<preview: {len(self.get('outputs', []))} outputs, stopped={self.get('stopped')}>"


class _Capture(io.TextIOBase):
    """A stream (stdout or stderr) that appends to the preview's output list. Past MAX_PAYLOAD
    characters in all it stops the preview (the kernel would read no more)."""

    total = 0

    def __init__(self, name: str, outputs: list[dict[str, Any]], stopped: list[str]):
        self.name = name
        self._outputs = outputs
        self._stopped = stopped
        self._parts: list[str] | None = None  # of the last output, while it is this stream's

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if not s:
            return 0
        _Capture.total += len(s)
        if _Capture.total > MAX_PAYLOAD:
            what = f"show more than {MAX_PAYLOAD >> 20} MB of output"
            self._stopped.append(what)
            raise sandbox.PreviewStopped(f"preview stopped: the cell would {what}")
        last = self._outputs[-1] if self._outputs else None
        parts = self._parts
        if parts is not None and last is not None and id(last.get("text")) == id(parts):
            parts.append(s)  # (the same stream's output, not cleared, nothing in between)
        else:
            self._parts = [s]
            self._outputs.append({"output_type": "stream", "name": self.name, "text": self._parts})
        return len(s)


def _join_streams(outputs: list[dict[str, Any]]) -> None:
    for out in outputs:
        if out.get("output_type") == "stream" and isinstance(out.get("text"), list):
            out["text"] = "".join(out["text"])


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in data.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = repr(v)
    return out


def _semicolon_quiet(shell: Any, source: str) -> bool:
    check = getattr(type(shell.displayhook), "semicolon_at_end_of_expression", None)
    if check is not None:
        try:
            return bool(check(source))
        except Exception:
            pass
    return source.rstrip().endswith(";")


def _run_cell(shell: Any, source: str, outputs: list[dict[str, Any]]) -> None:
    """Run `source` in the shell's namespace as IPython would show it (without its hooks,
    history or execution counter: those belong to the real kernel)."""
    cell = shell.transform_cell(source)
    try:  # tracebacks then show the cell's lines, as IPython's do ("Cell In[n], line k")
        filename = shell.compile.cache(cell, shell.execution_count, raw_code=source)
    except Exception:
        filename = "<preview>"
    tree = ast.parse(cell, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop()
    ns = shell.user_ns
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code = compile(tree, filename, "exec", flags=flags)
    if code.co_flags & 0x80:  # CO_COROUTINE: top-level await needs the kernel's event loop
        raise NotImplementedError("cells with top-level await are not previewed")
    exec(code, ns)
    value = None
    if last is not None:
        expr = compile(ast.Expression(last.value), filename, "eval", flags=flags)
        if expr.co_flags & 0x80:
            raise NotImplementedError("cells with top-level await are not previewed")
        value = eval(expr, ns)
    if value is not None and not _semicolon_quiet(shell, cell):
        data, metadata = shell.display_formatter.format(value)
        outputs.append(
            {
                "output_type": "execute_result",
                "data": _jsonable(data),
                "metadata": _jsonable(metadata),
                "execution_count": None,
            }
        )
    # After the result, as the inline backend shows figures after the cell (post_execute).
    _flush_inline_figures()


def _flush_inline_figures() -> None:
    # The inline backend shows figures from a post_execute hook the preview does not fire.
    if "matplotlib.pyplot" not in sys.modules:
        return
    try:
        import matplotlib

        if "inline" in str(matplotlib.get_backend()):
            from matplotlib_inline.backend_inline import flush_figures

            flush_figures()
    except Exception:
        pass


def _error_output(shell: Any, exc: BaseException) -> dict[str, Any]:
    # Start at the cell's own frame, not at _child and _run_cell.
    etb = None if isinstance(exc, SyntaxError) else exc.__traceback__
    while etb is not None and etb.tb_frame.f_code.co_filename == __file__:
        etb = etb.tb_next
    try:
        tb = shell.InteractiveTB.structured_traceback(type(exc), exc, etb)
    except Exception:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {
        "output_type": "error",
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": [str(line) for line in tb],
    }


def _child(
    shell: Any,
    source: str,
    wfd: int,
    memory_mb: int,
    cpu_seconds: int,
    programs: dict,
    times: dict[str, float],
    cell_dir: str | None,
) -> None:
    """The preview's first process (PID 1 of its namespace): isolate, tell the kernel, run the
    cell, send the outputs back. Never returns."""
    reply: dict[str, Any] = {"outputs": [], "stopped": [], "sandbox": {}, "status": "ok"}
    outputs: list[dict[str, Any]] = reply["outputs"]
    try:
        started = time.perf_counter()
        try:
            signal.set_wakeup_fd(-1)  # the kernel's event loop owns the wakeup fd
        except Exception:
            pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            iso = sandbox.isolate(
                keep={wfd}, memory_mb=memory_mb, cpu_seconds=cpu_seconds, programs=programs
            )
        except sandbox.Unavailable as e:
            # The cell never runs where a layer is missing.
            _send(wfd, {"unavailable": f"preview unavailable: this Linux lacks {e}"}, line=True)
            os._exit(0)
        reply["sandbox"] = dict(iso.state)
        reply["sandbox"]["memory"] = f"watched by the kernel ({memory_mb} MB)"
        reply["setup_ms"] = (time.perf_counter() - started) * 1000
        times["isolated"] = time.perf_counter()
        reply["times"] = times  # (perf_counter readings: one clock for every process)
        # The header: from here on the kernel counts the whole namespace's memory.
        _send(wfd, {"scratch_fd": iso.scratch_fd}, line=True)
        if cell_dir is not None:
            # The cell's file name is the kernel's (it holds the kernel's pid: in tracebacks and
            # warnings), not one with this process's pid (1).
            compiler = sys.modules.get("ipykernel.compiler")
            if compiler is not None:
                compiler.get_tmp_directory = lambda: cell_dir  # type: ignore[attr-defined]
        sys.stdout = _Capture("stdout", outputs, reply["stopped"])
        sys.stderr = _Capture("stderr", outputs, reply["stopped"])
        pub = shell.display_pub

        def publish(
            data: Any, metadata: Any = None, transient: Any = None, update: bool = False, **kw: Any
        ) -> None:
            outputs.append(
                {
                    "output_type": "update_display_data" if update else "display_data",
                    "data": _jsonable(dict(data or {})),
                    "metadata": _jsonable(dict(metadata or {})),
                }
            )

        def clear_output(wait: bool = False) -> None:
            outputs.clear()

        pub.publish = publish
        pub.clear_output = clear_output
        stopped: list[str] = reply["stopped"]
        sandbox.stub_handles(shell.user_ns, iso.stubbed, stopped)
        sandbox.install_audit_hook(stopped, iso.processes)
        started = time.perf_counter()
        try:
            _run_cell(shell, source, outputs)
        except sandbox.PreviewStopped:
            pass
        except NotImplementedError as e:
            reply["status"] = "unsupported"
            reply["detail"] = str(e)
        except MemoryError as e:
            stopped.append(f"use more than {memory_mb} MB of memory")
            outputs.append(_error_output(shell, e))
        except BaseException as e:  # the cell's own error is part of its output
            if isinstance(e, OSError) and e.errno == errno.EBADF and iso.stubbed:
                # A handle on a descriptor the kernel holds (a stub here) was used.
                stopped.append(
                    "use a descriptor the kernel holds open (a socket, a pipe or a file open "
                    "for writing)"
                )
            outputs.append(_error_output(shell, e))
        reply["cell_time"] = time.perf_counter() - started
        times["ran"] = time.perf_counter()
    except BaseException as e:
        reply["status"] = "failed"
        reply["detail"] = f"{type(e).__name__}: {e}"
    try:
        _join_streams(outputs)
        data = json.dumps(reply, default=repr).encode()
        if len(data) > MAX_PAYLOAD:
            # Keep the outputs that fit; the kernel would read no more than that anyway.
            kept, size = [], 0
            for out in reply["outputs"]:
                size += len(json.dumps(out, default=repr)) + 2
                if size > MAX_PAYLOAD - 2**16:
                    break
                kept.append(out)
            reply["outputs"] = kept
            reply["truncated"] = True
            reply["stopped"].append(f"show more than {MAX_PAYLOAD >> 20} MB of output")
            data = json.dumps(reply, default=repr).encode()
        _write_all(wfd, b"\n" + data + REPLY_END)
    finally:
        os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _send(fd: int, message: dict[str, Any], line: bool = False) -> None:
    _write_all(fd, json.dumps(message, default=repr).encode() + (b"\n" if line else b""))


def _monitor(
    shell: Any,
    source: str,
    wfd: int,
    ctl: int,
    memory_mb: int,
    cpu_seconds: int,
    programs: dict,
    cell_dir: str | None,
) -> None:
    """The kernel's direct child: creates the namespaces, forks the preview's first process
    into them, tells the kernel its pid, answers its questions about memory, and when the kernel
    closes its end of `ctl` (done, deadline, a bound passed, or the kernel itself gone) kills the
    whole namespace and reports how that process ended. Runs no user code. Never returns."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt is the kernel's
        sandbox.prctl(sandbox.PR_SET_PDEATHSIG, signal.SIGKILL)
        times = {"monitor": time.perf_counter()}
        try:
            sandbox.enter_namespaces()
        except sandbox.Unavailable as e:
            os.write(ctl, f"E preview unavailable: this Linux lacks {e}\n".encode())
            os._exit(0)
        times["namespaces"] = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            times["first process"] = time.perf_counter()
            os.close(ctl)
            _child(shell, source, wfd, memory_mb, cpu_seconds, programs, times, cell_dir)
        os.close(wfd)
        os.write(ctl, f"P {pid}\n".encode())
        # Hold nothing of the kernel's while waiting.
        os.closerange(0, ctl)
        os.closerange(ctl + 1, os.sysconf("SC_OPEN_MAX"))
        # The kernel asks for what it cannot see from outside: the System V shared memory of
        # the preview's IPC namespace, which this process shares.
        while request := os.read(ctl, 4096):
            if b"M" in request:
                os.write(ctl, f"M {sandbox.sysv_shared_memory()}\n".encode())
        try:
            os.kill(pid, signal.SIGKILL)  # the first process: the namespace goes with it
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        os.write(ctl, f"S {status}\n".encode())
    except BaseException as e:
        try:
            os.write(ctl, f"E preview failed: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    os._exit(0)


class _Watch:
    """The kernel's side of one preview: reads the monitor's messages and the reply, bounded in
    bytes, time and the namespace's memory."""

    def __init__(self, ctl: int, rfd: int, deadline: float, memory_mb: int) -> None:
        self.ctl, self.rfd, self.deadline = ctl, rfd, deadline
        self.memory = memory_mb * 2**20
        self.ctl_buffer = b""
        self.reply = bytearray()
        self.header: dict[str, Any] | None = None
        self.child: int | None = None
        self.killed: str | None = None
        self.complete = False

    def ctl_line(self, until: float) -> str | None:
        """The monitor's next line ("P pid", "E reason", "S status"); None at `until` or EOF."""
        while b"\n" not in self.ctl_buffer:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.ctl], [], [], remaining)
            if ready:
                block = os.read(self.ctl, 4096)
                if not block:
                    return None
                self.ctl_buffer += block
        line, _, self.ctl_buffer = self.ctl_buffer.partition(b"\n")
        return line.decode(errors="replace")

    def run(self) -> None:
        """Read the reply until the namespace closes it, or a bound is passed (`killed`)."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.killed = "timeout"
                return
            ready, _, _ = select.select([self.rfd], [], [], min(remaining, MEMORY_POLL))
            if ready:
                block = os.read(self.rfd, 1 << 16)
                if not block:
                    return
                self.reply += block
                if len(self.reply) > MAX_REPLY:
                    self.killed = "reply"
                    return
                if self.reply.endswith(REPLY_END):
                    self.complete = True
                    return
                if self.header is None and b"\n" in self.reply:
                    line, _, rest = bytes(self.reply).partition(b"\n")
                    self.reply = bytearray(rest)
                    try:
                        self.header = json.loads(line)
                    except (ValueError, RecursionError):
                        self.header = {}
                    if not isinstance(self.header, dict):
                        self.header = {}
            elif self.child is not None:
                scratch = self.header.get("scratch_fd") if self.header else None
                if not isinstance(scratch, int):
                    scratch = None
                used = sandbox.namespace_memory(self.child, scratch)
                if used is not None and scratch is not None:
                    used += self.sysv_shared_memory()
                if used is not None and used > self.memory:
                    self.killed = "memory"
                    return

    def sysv_shared_memory(self) -> int:
        """The System V shared memory of the preview's IPC namespace, asked of the monitor."""
        os.write(self.ctl, b"M\n")
        line = self.ctl_line(time.monotonic() + 0.5)
        if line and line.startswith("M "):
            return int(line[2:])
        return 0


def _describe_status(
    status: int | None,
    timeout: float,
    cpu_seconds: int,
    killed: str | None,
    memory_mb: int,
    garbled: bool = False,
) -> str:
    if killed == "memory":
        return f"use more than {memory_mb} MB of memory"
    if killed == "timeout":
        return f"run longer than {timeout:g} s"
    if killed == "reply":
        return f"show more than {MAX_REPLY >> 20} MB of output"
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"use more than {cpu_seconds} s of CPU time"
        if sig == signal.SIGSYS:
            return "make a system call the sandbox forbids"
        return f"crash the kernel (signal {signal.Signals(sig).name})"
    if garbled:
        return "write over its reply to the kernel"
    if status is None:
        return "end without a reply"
    return f"exit early (status {os.WEXITSTATUS(status)})"


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _unsupported(detail: str, **extra: Any) -> PreviewReply:
    return PreviewReply(
        status="unsupported", detail=detail, outputs=[], stopped=[], sandbox={}, **extra
    )


def run_preview(
    source: str,
    timeout: float = DEFAULT_TIMEOUT,
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpu_seconds: int = DEFAULT_CPU_SECONDS,
) -> PreviewReply:
    """Preview `source` in an isolated fork of this kernel; the namespace stays untouched.

    The reply holds nbformat `outputs`, the side effects that `stopped` the preview (empty if
    none), each isolation layer's state, `status` ("ok", "unsupported", "failed") and timings.
    Whatever the cell does, the kernel waits at most `timeout` seconds, reads at most
    MAX_REPLY bytes, and kills the preview's namespace past `memory_mb`.
    """
    if not isinstance(source, str):
        raise TypeError("source must be a str")
    if not sys.platform.startswith("linux"):
        return _unsupported("preview unavailable: the preview needs Linux")
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("run_preview runs inside an IPython kernel")
    try:  # built once per kernel, before the fork: the child only loads them
        programs = {p: sandbox.seccomp_program(p) for p in (False, True)}
    except sandbox.Unavailable as e:
        return _unsupported(f"preview unavailable: this Linux lacks {e}")
    compiler = sys.modules.get("ipykernel.compiler")
    cell_dir = compiler.get_tmp_directory() if compiler is not None else None
    t0 = time.perf_counter()
    rfd, wfd = os.pipe()
    ctl_sock, child_sock = socket.socketpair()
    ctl, child_ctl = ctl_sock.fileno(), child_sock.detach()
    # Objects the child does not touch keep sharing their pages (no copy-on-write by the GC).
    # (Left alone if someone else froze objects: unfreezing would undo theirs.)
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
    except BaseException:
        if freeze:
            gc.unfreeze()
        for fd in (rfd, wfd, child_ctl):
            os.close(fd)
        ctl_sock.close()
        raise
    if pid == 0:
        os.close(rfd)
        os.close(ctl)
        _monitor(shell, source, wfd, child_ctl, memory_mb, cpu_seconds, programs, cell_dir)
    if freeze:
        gc.unfreeze()
    fork_ms = (time.perf_counter() - t0) * 1000
    os.close(wfd)
    os.close(child_ctl)
    watch = _Watch(ctl, rfd, time.monotonic() + timeout, memory_mb)
    status: int | None = None
    refused: str | None = None
    finished = False
    try:
        first = watch.ctl_line(watch.deadline)
        if first is None:
            watch.killed = "timeout" if time.monotonic() >= watch.deadline else None
        elif first.startswith("E "):
            refused = first[2:]
        elif first.startswith("P "):
            watch.child = int(first[2:])
            watch.run()
        finished = True
    finally:
        os.close(rfd)
        # Done, past a bound, or the kernel was interrupted while waiting: the monitor kills
        # the namespace when its end closes, and says how the first process ended.
        if watch.complete and not watch.killed:
            # The reply is whole: the namespace's teardown (exits of processes holding the
            # kernel's memory, copy-on-write) is not worth waiting for.
            ctl_sock.close()
            threading.Thread(target=_reap, args=(pid,), daemon=True).start()
        else:
            try:
                ctl_sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            if watch.child is not None:
                until = time.monotonic() + 5
                while (line := watch.ctl_line(until)) is not None:
                    if line.startswith("S "):
                        status = int(line[2:])
                        break
            try:
                if not finished or watch.child is not None and status is None:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(pid)
            ctl_sock.close()
    if refused is not None:
        return _unsupported(refused, fork_ms=fork_ms)
    header = watch.header or {}
    if "unavailable" in header:
        return _unsupported(str(header["unavailable"]), fork_ms=fork_ms)
    reply: Any
    # The reply is the last line (JSON has no raw newline): whatever the cell itself wrote
    # into the pipe before it is not the reply.
    last = bytes(watch.reply).removesuffix(REPLY_END).rstrip().rpartition(b"\n")[2]
    try:
        reply = json.loads(last) if last else {}
    except (ValueError, RecursionError):
        reply = None
    garbled = not isinstance(reply, dict)
    if garbled:
        reply = {}
    if not reply or watch.killed:
        partial = reply
        reply = {
            "outputs": partial.get("outputs", []),
            "sandbox": partial.get("sandbox", {}),
            "status": "ok",
            "stopped": [
                _describe_status(status, timeout, cpu_seconds, watch.killed, memory_mb, garbled)
            ],
        }
    reply["fork_ms"] = fork_ms
    reply["elapsed_ms"] = (time.perf_counter() - t0) * 1000
    times = reply.pop("times", None)
    if isinstance(times, dict) and all(isinstance(v, float) for v in times.values()):
        # How long each step took, from the fork on (ms).
        steps = ["monitor", "namespaces", "first process", "isolated", "ran"]
        previous, timing = t0, {}
        for step in steps:
            if step in times:
                timing[step] = round((times[step] - previous) * 1000, 2)
                previous = times[step]
        timing["reply"] = round((time.perf_counter() - previous) * 1000, 2)
        reply["timing_ms"] = timing
    return PreviewReply(reply)
