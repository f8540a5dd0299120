"""Runs a cell speculatively in a locked-down fork of the kernel and returns what it would show.

The server calls `run_preview(source)` through a silent execute_request's user_expressions.
The kernel forks; the child points fds 0/1/2 at /dev/null (ipykernel forwards a forked
child's fd output into the person's cell), never touches the kernel's sockets, locks itself
down (see `sandbox`), runs the cell against its copy-on-write namespace with IPython-like
semantics (streams, displays, the last expression's execute_result formatted by the shell's
own display formatter), sends the outputs back over a pipe as JSON and leaves with os._exit.
The kernel waits for the pipe up to a wall-clock timeout and kills the child after it.
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
import sys
import time
import traceback
import warnings
from typing import Any

from . import sandbox

DEFAULT_TIMEOUT = 5.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_CPU_SECONDS = 10
#: the most JSON a child may send back (outputs beyond it are cut)
MAX_PAYLOAD = 4 * 2**20
#: the child's end of the pipe back (the highest descriptor it may write to)
PIPE_FD = 3
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
    """A stream (stdout or stderr) that appends to the preview's output list."""

    def __init__(self, name: str, outputs: list[dict[str, Any]]):
        self.name = name
        self._outputs = outputs

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if s:
            last = self._outputs[-1] if self._outputs else None
            if last and last.get("output_type") == "stream" and last.get("name") == self.name:
                last["text"] += s
            else:
                self._outputs.append({"output_type": "stream", "name": self.name, "text": s})
        return len(s)


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
    _flush_inline_figures()
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
    shell: Any, source: str, wfd: int, timeout: float, memory_mb: int, cpu_seconds: int
) -> None:
    """The forked child's whole life: never returns."""
    reply: dict[str, Any] = {"outputs": [], "stopped": [], "sandbox": {}, "status": "ok"}
    try:
        # No output of this process may reach the kernel's streams or sockets. The pipe moves
        # to fd 3 so that 0..3 are the only writable descriptors (see sandbox.lock_down).
        if wfd != PIPE_FD:
            os.dup2(wfd, PIPE_FD)
            os.close(wfd)
            wfd = PIPE_FD
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        try:
            signal.set_wakeup_fd(-1)  # the kernel's event loop owns the wakeup fd
        except Exception:
            pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        outputs: list[dict[str, Any]] = reply["outputs"]
        sys.stdout = _Capture("stdout", outputs)
        sys.stderr = _Capture("stderr", outputs)
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
        reply["sandbox"] = sandbox.lock_down(max_fd=PIPE_FD, cpu_seconds=cpu_seconds)
        reply["sandbox"]["memory"] = f"watched by the kernel ({memory_mb} MB)"
        missing = sandbox.missing_layers(reply["sandbox"])
        sandbox.install_audit_hook(reply["stopped"])
        started = time.perf_counter()
        try:
            if missing:
                # Without them C code could write files or connect: the cell does not run.
                raise NotImplementedError(
                    "preview unavailable: this kernel lacks " + ", ".join(missing)
                )
            _run_cell(shell, source, outputs)
        except sandbox.PreviewStopped:
            pass
        except NotImplementedError as e:
            reply["status"] = "unsupported"
            reply["detail"] = str(e)
        except MemoryError as e:
            reply["stopped"].append(f"use more than {memory_mb} MB of memory")
            outputs.append(_error_output(shell, e))
        except BaseException as e:  # the cell's own error is part of its output
            if isinstance(e, OSError) and e.errno in (errno.EPERM, errno.EACCES):
                # A barrier below the audit hooks (Landlock, seccomp) refused it.
                reply["stopped"].append(f"do something the sandbox forbids ({e})")
            outputs.append(_error_output(shell, e))
        reply["cell_time"] = time.perf_counter() - started
    except BaseException as e:
        reply["status"] = "failed"
        reply["detail"] = f"{type(e).__name__}: {e}"
    try:
        data = json.dumps(reply, default=repr).encode()
        if len(data) > MAX_PAYLOAD:
            reply["outputs"] = reply["outputs"][:1]
            reply["truncated"] = True
            data = json.dumps(reply, default=repr).encode()[:MAX_PAYLOAD]
        view = memoryview(data)
        while view:
            n = os.write(wfd, view)
            view = view[n:]
    finally:
        os._exit(0)


def _describe_status(
    status: int, timeout: float, cpu_seconds: int, killed: str | None, memory_mb: int
) -> str:
    if killed == "memory":
        return f"use more than {memory_mb} MB of memory"
    if killed == "timeout":
        return f"run longer than {timeout:g} s"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"use more than {cpu_seconds} s of CPU time"
        if sig == signal.SIGSYS:
            return "make a system call the sandbox forbids"
        return f"crash the kernel (signal {signal.Signals(sig).name})"
    return f"exit early (status {os.WEXITSTATUS(status)})"


def run_preview(
    source: str,
    timeout: float = DEFAULT_TIMEOUT,
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpu_seconds: int = DEFAULT_CPU_SECONDS,
) -> PreviewReply:
    """Preview `source` in a sandboxed fork of this kernel; the namespace stays untouched.

    The reply holds nbformat `outputs`, the side effects that `stopped` the preview (empty if
    none), each sandbox layer's state, `status` ("ok", "unsupported", "failed") and timings.
    """
    if not isinstance(source, str):
        raise TypeError("source must be a str")
    if not hasattr(os, "fork"):
        return PreviewReply(
            status="unsupported",
            detail="no fork() on this platform",
            outputs=[],
            stopped=[],
            sandbox={},
        )
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("run_preview runs inside an IPython kernel")
    t0 = time.perf_counter()
    rfd, wfd = os.pipe()
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
        os.close(rfd)
        os.close(wfd)
        raise
    if pid == 0:
        os.close(rfd)
        _child(shell, source, wfd, timeout, memory_mb, cpu_seconds)
    if freeze:
        gc.unfreeze()
    fork_ms = (time.perf_counter() - t0) * 1000
    os.close(wfd)
    chunks: list[bytes] = []
    killed: str | None = None
    status = 0
    memory_ok = sandbox.private_memory(pid) is not None
    finished = False
    try:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "timeout"
                break
            # Poll the child's private memory while it runs (see sandbox.lock_down).
            ready, _, _ = select.select([rfd], [], [], min(remaining, MEMORY_POLL))
            if ready:
                block = os.read(rfd, 1 << 16)
                if not block:
                    break
                chunks.append(block)
            elif memory_ok:
                used = sandbox.private_memory(pid)
                if used is not None and used > memory_mb * 2**20:
                    killed = "memory"
                    break
        finished = True
    finally:
        os.close(rfd)
        # Killed past its limits, or the kernel was interrupted while waiting: never leave it.
        if killed or not finished:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # someone else reaped it; the pipe tells what happened
            status = 0
    payload = b"".join(chunks)
    reply: dict[str, Any]
    try:
        reply = json.loads(payload) if payload else {}
    except ValueError:
        reply = {}
    if not reply or killed:
        partial = reply
        reply = {
            "outputs": partial.get("outputs", []),
            "sandbox": partial.get("sandbox", {}),
            "status": "ok",
            "stopped": [_describe_status(status, timeout, cpu_seconds, killed, memory_mb)],
        }
    reply["fork_ms"] = fork_ms
    reply["elapsed_ms"] = (time.perf_counter() - t0) * 1000
    return PreviewReply(reply)
