"""Runs a cell speculatively in an isolated fork of the kernel and returns what it would show.

The server calls `run_preview(source)` through a silent execute_request's user_expressions. A
kernel that may create namespaces (root) forks the preview's first process straight into new
ones (`sandbox.fork_into_namespaces`); any other kernel forks a monitor, which enters a user
namespace and the others and forks the first process into them. That process isolates itself —
private copy-on-write root, no descriptor shared with the kernel but the reply pipe, no
capability, Landlock, seccomp — runs the cell against its copy-on-write namespace as the kernel
would (streams interleaved as ipykernel publishes them, displays, the last expression's
execute_result formatted by the shell's own display formatter, the input history, the state of
`random` and numpy's global generator), sends the outputs back as JSON and leaves with os._exit.
The kernel reads the reply within bounds of time, bytes and memory, and kills the whole
namespace at the end, whatever it is doing.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import gc
import importlib
import io
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from . import sandbox

#: as long as a long cell would run, still bounded (below the server's prediction_timeout, 60 s)
DEFAULT_TIMEOUT = 50.0
DEFAULT_MEMORY_MB = 1024
#: at least the wall-clock bound: a CPU-bound long cell is stopped by `timeout`, not sooner
DEFAULT_CPU_SECONDS = 60
#: the most JSON a child sends back (outputs beyond it are cut)
MAX_PAYLOAD = 4 * 2**20
#: the most the kernel reads from a preview (more: the preview is killed and stopped)
MAX_REPLY = MAX_PAYLOAD + 2**16
#: what ends a reply (JSON escapes control characters, so it never holds this): the kernel
#: need not wait for the preview's processes to exit
REPLY_END = b"\n\x04"
#: how often the kernel checks the child's memory while it runs (seconds)
MEMORY_POLL = 0.02
# How much more than its bound the machine's available memory may fall while a preview runs
# (other processes' work meanwhile) before the preview is stopped for memory it holds where
# the count of its processes, memfds and scratch cannot see (socket buffers, kernel objects).
UNCOUNTED_SLACK = 512 * 2**20
#: ipykernel's OutStream.flush_interval (the kernel's own streams' value is used where they have
#: one): what a stream buffers becomes an output this long after the first write
FLUSH_INTERVAL = 0.2
#: what `stopped` says of a cell that calls input() or getpass (the real run waits for the
#: person to type; a preview cannot know what they will type)
WAITS_FOR_INPUT = "wait for input"


def cpu_bound(cpu_seconds: int) -> str:
    """What `stopped` says of a cell whose preview used all its `cpu_seconds` (the reply's
    `cpu_bound` holds them): not the cell's fault; its real run may simply take long."""
    unit = "second" if cpu_seconds == 1 else "seconds"
    return f"use more than the preview's {cpu_seconds} CPU {unit}"


#: the abstract unix socket name a preview listens on for a cancel: this prefix and the token
#: the server chose (abstract names belong to the network namespace: the kernel's, the server's
#: when both run on one machine; never the preview's, which has a network namespace of its own)
CANCEL_PREFIX = "jupyter-themisto-preview-cancel-"


class PreviewReply(dict):
    """The preview's result; formats as application/json so that user_expressions carries it
    to the server intact."""

    def _repr_json_(self) -> dict[str, Any]:
        return dict(self)

    def __repr__(self) -> str:
        outputs, stopped = self.get("outputs"), self.get("stopped")
        n = len(outputs) if isinstance(outputs, list) else 0
        return f"<preview: {n} outputs, stopped={stopped if isinstance(stopped, list) else []}>"


class _Outputs:
    """The preview's outputs as the notebook would receive them from ipykernel: each stream
    buffers what is written and publishes it FLUSH_INTERVAL after the first write, when flushed,
    and before a display, a result or an error (stdout first, then stderr); a clear_output with
    wait waits for the next output. So stdout and stderr interleave as in the real run. Past
    MAX_PAYLOAD characters of streams in all it stops the preview (the kernel would read no
    more)."""

    def __init__(self, stopped: list[str], intervals: dict[str, float]) -> None:
        self.list: list[dict[str, Any]] = []
        self.stopped = stopped
        self.intervals = intervals
        self.total = 0
        self.pending: dict[str, list[str]] = {}
        self.since: dict[str, float] = {}
        self.clear_waiting = False

    def write(self, name: str, s: str) -> None:
        self.total += len(s)
        if self.total > MAX_PAYLOAD:
            what = f"show more than {MAX_PAYLOAD >> 20} MB of output"
            self.stopped.append(what)
            raise sandbox.PreviewStopped(f"preview stopped: the cell would {what}")
        now = time.monotonic()
        self._due(now)
        parts = self.pending.get(name)
        if not parts:
            self.pending[name] = parts = []
            self.since[name] = now
        parts.append(s)

    def _due(self, now: float) -> None:
        for name in sorted(self.since, key=self.since.__getitem__):
            if now - self.since[name] >= self.intervals.get(name, FLUSH_INTERVAL):
                self.flush(name)

    def flush(self, name: str) -> None:
        parts = self.pending.pop(name, None)
        self.since.pop(name, None)
        if not parts:
            return
        self._clear_if_waiting()
        last = self.list[-1] if self.list else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["text"].extend(parts)  # (the notebook shows them as one output)
        else:
            self.list.append({"output_type": "stream", "name": name, "text": parts})

    def flush_streams(self) -> None:
        self._due(time.monotonic())
        self.flush("stdout")
        self.flush("stderr")

    def add(self, output: dict[str, Any]) -> None:
        self.flush_streams()
        self._clear_if_waiting()
        self.list.append(output)

    def clear(self, wait: bool = False) -> None:
        self.flush_streams()
        if wait:
            self.clear_waiting = True
        else:
            self.list.clear()

    def _clear_if_waiting(self) -> None:
        if self.clear_waiting:
            self.clear_waiting = False
            self.list.clear()

    def finish(self) -> list[dict[str, Any]]:
        self.flush_streams()
        for out in self.list:
            if out["output_type"] == "stream":
                out["text"] = "".join(out["text"])
        return self.list


class _Stream(io.TextIOBase):
    """sys.stdout or sys.stderr in the preview (see `_Outputs`)."""

    encoding = "UTF-8"  # (as ipykernel's OutStream)

    def __init__(self, name: str, outputs: _Outputs):
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
            self._outputs.write(self.name, s)
        return len(s)

    def flush(self) -> None:
        self._outputs.flush(self.name)


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


def _store_input(shell: Any, cell: str, source: str, n: int) -> None:
    """What IPython does with a cell's input before running it (the preview's copy of it): the
    input history (`In`, `_ih`) and `_i`, `_ii`, `_iii`, `_i<n>`."""
    hm = getattr(shell, "history_manager", None)
    if hm is None:
        return
    try:
        # (as HistoryManager.store_inputs: without the trailing newlines; exit and quit are
        # not stored)
        cell, source = cell.rstrip("\n"), source.rstrip("\n")
        if hm._exit_re.match(source.strip()):
            return
        hm.input_hist_parsed.append(cell)
        hm.input_hist_raw.append(source)
        hm._iii, hm._ii, hm._i, hm._i00 = hm._ii, hm._i, hm._i00, source
        shell.push({"_i": hm._i, "_ii": hm._ii, "_iii": hm._iii, f"_i{n}": source}, False)
    except Exception:
        pass


def _run_cell(shell: Any, source: str, outputs: _Outputs) -> None:
    """Run `source` in the shell's namespace as IPython would show it (without its hooks,
    history database or execution counter: those belong to the real kernel)."""
    cell = shell.transform_cell(source)
    n = shell.execution_count  # the cell's number (the real run's; the kernel's next)
    try:  # tracebacks then show the cell's lines, as IPython's do ("Cell In[n], line k")
        filename = shell.compile.cache(cell, n, raw_code=source)
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
    _store_input(shell, cell, source, n)
    shell.execution_count = n + 1  # (IPython counts the cell before it runs)
    exec(code, ns)
    value = None
    if last is not None:
        expr = compile(ast.Expression(last.value), filename, "eval", flags=flags)
        if expr.co_flags & 0x80:
            raise NotImplementedError("cells with top-level await are not previewed")
        value = eval(expr, ns)
    if value is not None and not _semicolon_quiet(shell, cell):
        data, metadata = shell.display_formatter.format(value)
        outputs.add(
            {
                "output_type": "execute_result",
                "data": _jsonable(data),
                "metadata": _jsonable(metadata),
                "execution_count": n,
            }
        )


def _waits_for_input(stopped: list[str]) -> None:
    """input() and getpass.getpass() stop the preview with WAITS_FOR_INPUT, before printing
    the prompt (in the real run the kernel would ask the browser, and wait)."""
    import builtins
    import getpass

    def waits(*args: Any, **kwargs: Any) -> str:
        stopped.append(WAITS_FOR_INPUT)
        raise sandbox.PreviewStopped(f"preview stopped: the cell would {WAITS_FOR_INPUT}")

    builtins.input = waits
    getpass.getpass = waits


def _stop_at_cpu_bound(stopped: list[str], reply: dict[str, Any], cpu_seconds: int) -> None:
    """At the soft CPU limit the kernel sends SIGXCPU, which the first process of a PID
    namespace ignores unless it has a handler; with this one the cell stops there and its outputs
    so far are sent (a cell in C code past the hard limit, a second later, is killed: the
    kernel then tells the bound from the CPU time the process used)."""

    def used_up(signum: int, frame: Any) -> None:
        what = cpu_bound(cpu_seconds)
        if what not in stopped:
            stopped.append(what)
        reply["cpu_bound"] = cpu_seconds
        raise sandbox.PreviewStopped(f"preview stopped: the cell would {what}")

    signal.signal(signal.SIGXCPU, used_up)


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


def _capture_session(shell: Any, outputs: _Outputs) -> None:
    """What the kernel's code sends through its session in the preview: an error (IPython's
    traceback of a failing display formatter) becomes the error output the notebook would show;
    anything else (comm messages of widgets and nbagg figures) goes to the browser, not into
    the cell's output, and is dropped. (Sent as it is, from a fork, jupyter_client would log a
    warning that the stub of the kernel's stderr turns into a "Logging error" in the output.)"""

    def send(stream: Any, msg_or_type: Any, content: Any = None, *args: Any, **kw: Any) -> None:
        kind = msg_or_type
        if isinstance(msg_or_type, dict):
            kind = msg_or_type.get("header", {}).get("msg_type")
            content = msg_or_type.get("content")
        if kind == "error" and isinstance(content, dict):
            outputs.add(
                {
                    "output_type": "error",
                    "ename": str(content.get("ename", "")),
                    "evalue": str(content.get("evalue", "")),
                    "traceback": [str(line) for line in content.get("traceback") or []],
                }
            )

    seen: set[int] = set()
    kernel = getattr(shell, "kernel", None)
    for owner in (kernel, shell.displayhook, shell.display_pub):
        session = getattr(owner, "session", None)
        if session is not None and id(session) not in seen:
            seen.add(id(session))
            try:
                session.send = send
            except (AttributeError, TypeError):
                pass


def _serial_openmp() -> None:
    """GNU OpenMP's thread pool does not survive a fork: a parallel region in the child waits
    for the kernel's pool threads forever (scikit-learn's KMeans, which took 0.2 s in the kernel,
    hung the preview past its timeout once the kernel had run one). One thread runs the region
    in the calling thread. (threadpoolctl is loaded where such libraries are: scikit-learn
    imports it.)"""
    threadpoolctl = sys.modules.get("threadpoolctl")
    if threadpoolctl is None:
        return
    try:
        threadpoolctl.threadpool_limits(limits=1, user_api="openmp")
    except Exception:
        pass


#: modules that seed a random generator from the OS when first imported, each with the package
#: whose import makes it likely (None: always): numpy loads numpy.random only when first used
#: (numpy >= 2). Imported first in a preview, the preview's numbers would come from other entropy
#: than the real run's, which imports the module itself later (`KFold(shuffle=True)`,
#: `np.random.rand()` without a seed), so the kernel imports them before the fork.
SEEDED_ON_IMPORT = ((None, "random"), ("numpy", "numpy.random"))


def _import_seeded_modules() -> None:
    for package, module in SEEDED_ON_IMPORT:
        if module not in sys.modules and (package is None or package in sys.modules):
            with contextlib.suppress(Exception):
                importlib.import_module(module)


class _KernelState:
    """What the child must take over from the kernel as it was just before the fork."""

    def __init__(self) -> None:
        _import_seeded_modules()
        compiler = sys.modules.get("ipykernel.compiler")
        #: the kernel's folder of cell files (its name holds the kernel's pid)
        self.cell_dir = compiler.get_tmp_directory() if compiler is not None else None
        random = sys.modules.get("random")
        # (`random` reseeds itself in a forked child: the cell's numbers would not be the
        # kernel's)
        self.random = random.getstate() if random is not None else None
        self.flush_intervals = {}
        for name in ("stdout", "stderr"):
            interval = getattr(getattr(sys, name), "flush_interval", None)
            if isinstance(interval, (int, float)):
                self.flush_intervals[name] = float(interval)

    def restore(self) -> None:
        if self.random is not None:
            import random

            random.setstate(self.random)
        if self.cell_dir is not None:
            # The cell's file name is the kernel's (it holds the kernel's pid: in tracebacks and
            # warnings), not one with this process's pid (1).
            compiler = sys.modules.get("ipykernel.compiler")
            if compiler is not None:
                cell_dir = self.cell_dir
                compiler.get_tmp_directory = lambda: cell_dir  # type: ignore[attr-defined]


def _child(
    shell: Any,
    source: str,
    wfd: int,
    memory_mb: int,
    cpu_seconds: int,
    programs: dict,
    times: dict[str, float],
    kernel: _KernelState,
    direct: bool,
) -> None:
    """The preview's first process (PID 1 of its namespace): isolate, tell the kernel, run the
    cell, send the outputs back. Never returns."""
    reply: dict[str, Any] = {"outputs": [], "stopped": [], "sandbox": {}, "status": "ok"}
    stopped: list[str] = reply["stopped"]
    outputs = _Outputs(stopped, kernel.flush_intervals)
    try:
        started = time.perf_counter()
        gc.freeze()  # the kernel's objects: no collection here touches (copies) their pages
        try:
            signal.set_wakeup_fd(-1)  # the kernel's event loop owns the wakeup fd
        except Exception:
            pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _stop_at_cpu_bound(stopped, reply, cpu_seconds)
        kernel.restore()
        # (before isolation: the descriptors of the person's open files, looked up without
        # running any of the person's code)
        copy = sandbox.namespace_files(shell.user_ns)
        try:
            iso = sandbox.isolate(
                keep={wfd},
                copy=copy,
                memory_mb=memory_mb,
                cpu_seconds=cpu_seconds,
                programs=programs,
                direct=direct,
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
        sys.stdout = _Stream("stdout", outputs)
        sys.stderr = _Stream("stderr", outputs)
        pub = shell.display_pub

        def publish(
            data: Any, metadata: Any = None, transient: Any = None, update: bool = False, **kw: Any
        ) -> None:
            outputs.add(
                {
                    "output_type": "update_display_data" if update else "display_data",
                    "data": _jsonable(dict(data or {})),
                    "metadata": _jsonable(dict(metadata or {})),
                }
            )

        pub.publish = publish
        pub.clear_output = outputs.clear
        _capture_session(shell, outputs)
        sandbox.stub_handles(shell.user_ns, iso.stubbed, stopped)
        _waits_for_input(stopped)
        _serial_openmp()
        sandbox.install_audit_hook(stopped, iso.processes)
        started = time.perf_counter()
        try:
            _run_cell(shell, source, outputs)
            _flush_inline_figures()  # (after the result, as the inline backend's post_execute)
        except sandbox.PreviewStopped:
            pass
        except NotImplementedError as e:
            reply["status"] = "unsupported"
            reply["detail"] = str(e)
        except BaseException as e:  # the cell's own error is part of its output
            if isinstance(e, MemoryError):
                stopped.append(f"use more than {memory_mb} MB of memory")
            elif isinstance(e, OSError) and e.errno == errno.EBADF and iso.stubbed:
                # A handle on a descriptor the kernel holds (a stub here) was used.
                stopped.append(
                    "use a descriptor the kernel holds open (a socket, a pipe or a file open "
                    "for writing)"
                )
            try:
                outputs.add(_error_output(shell, e))
                _flush_inline_figures()  # (the inline backend shows them after an error too)
            except sandbox.PreviewStopped:
                pass
        reply["cell_time"] = time.perf_counter() - started
        times["ran"] = time.perf_counter()
    except BaseException as e:
        reply["status"] = "failed"
        reply["detail"] = f"{type(e).__name__}: {e}"
    try:
        reply["outputs"] = outputs.finish()
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


@contextlib.contextmanager
def _quiet_fork() -> Iterator[None]:
    """Python >= 3.12 warns (DeprecationWarning) when a process with threads forks: not the
    person's business. The filter goes into the list and out again in place — catch_warnings()
    would make every module forget the warnings it already showed, and the kernel would show
    them again."""
    if sys.version_info < (3, 12):
        yield
        return
    entry = ("ignore", None, DeprecationWarning, None, 0)
    warnings.filters.insert(0, entry)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)  # type: ignore[attr-defined]


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """An interrupt of the kernel (SIGINT) waits until the preview's processes are in the
    kernel's hands: one raised between the fork and that moment would leave them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if hits and callable(previous):
            previous(signal.SIGINT, hits[0])


class _Direct:
    """The kernel's hold on a preview forked straight into its namespaces: the first process is
    the kernel's own child (its pid is never another's before the kernel reaps it)."""

    def __init__(self, pid: int, sysv: int) -> None:
        self.pid: int | None = pid
        self.refused: str | None = None
        #: the CPU seconds the first process used, when `finish` saw how it ended
        self.cpu: float | None = None
        self._sysv = sysv

    def started(self, until: float) -> None:
        pass

    def sysv_shared_memory(self) -> int:
        os.lseek(self._sysv, 0, os.SEEK_SET)
        data = b""
        while block := os.read(self._sysv, 1 << 16):
            data += block
        return sandbox.sysv_total(data.decode(errors="replace"))

    def finish(self, complete: bool) -> int | None:
        """Kill the namespace (its first process), and say how that process ended unless the
        reply was whole (then it is reaped in the background)."""
        pid = self.pid
        assert pid is not None
        os.close(self._sysv)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if complete:
            threading.Thread(target=_reap, args=(pid,), daemon=True).start()
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
        try:
            if pidfd is not None:
                select.select([pidfd], [], [], 5.0)
            got, status, usage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if not got:
            threading.Thread(target=_reap, args=(pid,), daemon=True).start()
            return None
        self.cpu = usage.ru_utime + usage.ru_stime
        return status


class _Monitored:
    """The kernel's hold on a preview made by a monitor (a kernel that may not create namespaces
    itself): the monitor tells the first process's pid, answers questions about the IPC
    namespace's System V memory, kills the namespace when the kernel closes its end of the
    control socket, and says how the first process ended."""

    def __init__(self, monitor: int, ctl: socket.socket) -> None:
        self.monitor = monitor
        self.pid: int | None = None
        self.refused: str | None = None
        self.cpu: float | None = None
        self._sock = ctl
        self._ctl = ctl.fileno()
        self._buffer = b""

    def line(self, until: float) -> str | None:
        """The monitor's next line ("P pid", "E reason", "S status"); None at `until` or EOF."""
        while b"\n" not in self._buffer:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self._ctl], [], [], remaining)
            if ready:
                block = os.read(self._ctl, 4096)
                if not block:
                    return None
                self._buffer += block
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace")

    def started(self, until: float) -> None:
        first = self.line(until)
        if first is not None and first.startswith("E "):
            self.refused = first[2:]
        elif first is not None and first.startswith("P "):
            self.pid = int(first[2:])

    def sysv_shared_memory(self) -> int:
        os.write(self._ctl, b"M\n")
        line = self.line(time.monotonic() + 0.5)
        if line and line.startswith("M "):
            return int(line[2:])
        return 0

    def finish(self, complete: bool) -> int | None:
        if complete:
            # The reply is whole: the namespace's teardown (exits of processes holding the
            # kernel's memory, copy-on-write) is not worth waiting for.
            self._sock.close()
            threading.Thread(target=_reap, args=(self.monitor,), daemon=True).start()
            return None
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        status = None
        if self.pid is not None:
            until = time.monotonic() + 5
            while (line := self.line(until)) is not None:
                if line.startswith("S "):
                    status_text, _, cpu = line[2:].partition(" ")
                    status = int(status_text)
                    self.cpu = float(cpu) if cpu else None
                    break
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.monitor, signal.SIGKILL)
        _reap(self.monitor)
        self._sock.close()
        return status


def _monitor(ctl: int, wfd: int, child: Any) -> None:
    """The kernel's direct child where the kernel may not create namespaces: enters them,
    forks the preview's first process into them (`child` runs there), tells the kernel its pid,
    answers its questions about memory, and when the kernel closes its end of `ctl` (done,
    deadline, a bound passed, or the kernel itself gone) kills the whole namespace and reports
    how that process ended. Runs no user code. Never returns."""
    try:
        gc.freeze()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt is the kernel's
        sandbox.prctl(sandbox.PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            sandbox.enter_namespaces()
        except sandbox.Unavailable as e:
            os.write(ctl, f"E preview unavailable: this Linux lacks {e}\n".encode())
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            os.close(ctl)
            child()
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
        _, status, usage = os.wait4(pid, 0)
        os.write(ctl, f"S {status} {usage.ru_utime + usage.ru_stime}\n".encode())
    except BaseException as e:
        try:
            os.write(ctl, f"E preview failed: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    os._exit(0)


def _spawn(wfd: int, rfd: int, child: Any, times: dict[str, float]) -> _Direct | _Monitored:
    """Fork the preview: straight into its namespaces where the kernel may create them, else
    through a monitor. `child(direct)` runs in the preview's first process."""
    with _quiet_fork():
        try:
            pid, sysv = sandbox.fork_into_namespaces()
        except sandbox.Unavailable:
            pass
        else:
            if pid == 0:
                os.close(rfd)
                child(True)
            return _Direct(pid, sysv)
        ctl_sock, child_sock = socket.socketpair()
        child_ctl = child_sock.detach()
        try:
            pid = os.fork()
        except BaseException:
            os.close(child_ctl)
            ctl_sock.close()
            raise
    if pid == 0:
        times["monitor"] = time.perf_counter()
        os.close(rfd)
        ctl_sock.close()
        _monitor(child_ctl, wfd, lambda: child(False))
    os.close(child_ctl)
    return _Monitored(pid, ctl_sock)


class _Watch:
    """The kernel's side of one preview: reads the reply, bounded in bytes, time and the
    namespace's memory."""

    def __init__(
        self, rfd: int, deadline: float, memory_mb: int, spawned: Any, cancel: int | None = None
    ) -> None:
        self.rfd, self.deadline = rfd, deadline
        self.cancel = cancel
        self.memory = memory_mb * 2**20
        self.spawned = spawned
        self.reply = bytearray()
        self.header: dict[str, Any] | None = None
        self.killed: str | None = None
        self.complete = False
        self.available = sandbox.available_memory()

    def run(self) -> None:
        """Read the reply until the namespace closes it, or a bound is passed (`killed`)."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.killed = "timeout"
                return
            watched = [self.rfd] if self.cancel is None else [self.rfd, self.cancel]
            ready, _, _ = select.select(watched, [], [], min(remaining, MEMORY_POLL))
            if self.cancel is not None and self.cancel in ready:
                self.killed = "cancelled"
                return
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
            elif self.spawned.pid is not None:
                scratch = self.header.get("scratch_fd") if self.header else None
                if not isinstance(scratch, int):
                    scratch = None
                used = sandbox.namespace_memory(self.spawned.pid, scratch, self.deadline)
                if used is not None and scratch is not None:
                    used += self.spawned.sysv_shared_memory()
                if used is not None and used > self.memory:
                    self.killed = "memory"
                    return
                now = sandbox.available_memory()
                if self.available and now and self.available - now > self.memory + UNCOUNTED_SLACK:
                    self.killed = "memory"
                    return


_STATUSES = ("ok", "failed", "unsupported")
_DISPLAYS = ("display_data", "update_display_data", "execute_result")
# Characters that would start a new line or a terminal sequence where a text is logged or shown
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def _checked(raw: dict[str, Any]) -> dict[str, Any]:
    """The child's reply with only the fields the kernel expects, of the types it expects. The
    cell runs in that process and may write a reply of its own: the kernel passes on nothing of
    it unchecked (a field of another type would fail the kernel's own formatting of the reply,
    and show the person an error that is not theirs)."""
    out: dict[str, Any] = {"status": raw.get("status") if raw.get("status") in _STATUSES else "ok"}
    if isinstance(raw.get("detail"), str):
        out["detail"] = _CONTROL.sub(" ", raw["detail"])[:2000]
    outputs = raw.get("outputs")
    out["outputs"] = [o for o in outputs if _valid_output(o)] if isinstance(outputs, list) else []
    stopped = raw.get("stopped")
    out["stopped"] = [
        _CONTROL.sub(" ", s)[:500]
        for s in (stopped if isinstance(stopped, list) else [])[:20]
        if isinstance(s, str)
    ]
    state = raw.get("sandbox")
    out["sandbox"] = {
        str(k)[:100]: _CONTROL.sub(" ", v)[:500]
        for k, v in (state.items() if isinstance(state, dict) else ())
        if isinstance(v, str)
    }
    for key in ("setup_ms", "cell_time"):
        if type(raw.get(key)) in (int, float):
            out[key] = float(raw[key])
    if raw.get("truncated") is True:
        out["truncated"] = True
    if type(raw.get("cpu_bound")) is int:
        out["cpu_bound"] = raw["cpu_bound"]
    times = raw.get("times")
    if isinstance(times, dict) and all(type(v) is float for v in times.values()):
        out["times"] = times
    return out


def _valid_output(o: Any) -> bool:
    """Whether `o` is an output as the preview's child writes them (nbformat's shapes)."""
    if not isinstance(o, dict):
        return False
    kind = o.get("output_type")
    if kind == "stream":
        return o.get("name") in ("stdout", "stderr") and isinstance(o.get("text"), str)
    if kind in _DISPLAYS:
        data = o.get("data")
        return (
            isinstance(data, dict)
            and all(isinstance(v, (str, dict, list)) for v in data.values())
            and isinstance(o.get("metadata", {}), dict)
        )
    if kind == "error":
        tb = o.get("traceback")
        return (
            isinstance(o.get("ename"), str)
            and isinstance(o.get("evalue"), str)
            and isinstance(tb, list)
            and all(isinstance(line, str) for line in tb)
        )
    return False


def _describe_status(
    status: int | None,
    timeout: float,
    cpu_seconds: int,
    killed: str | None,
    memory_mb: int,
    garbled: bool = False,
    cpu: float | None = None,
) -> str:
    if killed == "memory":
        return f"use more than {memory_mb} MB of memory"
    if killed == "timeout":
        return f"run longer than {timeout:g} s"
    if killed == "reply":
        return f"show more than {MAX_REPLY >> 20} MB of output"
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # (the first process ignores the soft limit's SIGXCPU if the cell took its handler: the
        # hard limit's SIGKILL ends it a second later)
        if sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and cpu is not None and cpu >= cpu_seconds
        ):
            return cpu_bound(cpu_seconds)
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
    cancel: str | None = None,
) -> PreviewReply:
    """Preview `source` in an isolated fork of this kernel; the namespace stays untouched.

    The reply holds nbformat `outputs`, the side effects that `stopped` the preview (empty if
    none), each isolation layer's state, `status` ("ok", "unsupported", "failed",
    "cancelled"), timings, and `scrubbed_source` (the cell without the secrets the recorder
    knows: what a fallback model may see; None without a recorder). Whatever the cell does,
    the kernel waits at most `timeout` seconds, reads at most MAX_REPLY bytes, and kills the
    preview's namespace past `memory_mb`.
    `cancel`: a token; a datagram sent to the abstract unix socket CANCEL_PREFIX + token while
    the preview runs kills its namespace at once (see `cancel_preview`). An interrupt of the
    kernel (SIGINT) does so too, and the kernel's death ends it (PR_SET_PDEATHSIG).
    """
    if not isinstance(source, str):
        raise TypeError("source must be a str")
    if cancel is not None and not (
        isinstance(cancel, str) and 0 < len(cancel) <= 64 and cancel.isascii() and cancel.isalnum()
    ):
        raise ValueError("cancel must be a token of at most 64 ASCII letters and digits")
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("run_preview runs inside an IPython kernel")
    reply = _isolated(shell, source, timeout, memory_mb, cpu_seconds, cancel)
    # What a fallback model may be sent instead, in every reply (whatever the server falls
    # back on): the cell without the secret values this kernel knows, even those whose hashes
    # have not reached the store yet (it was locked).
    reply["scrubbed_source"] = _scrubbed(shell, source)
    return reply


def _isolated(
    shell: Any, source: str, timeout: float, memory_mb: int, cpu_seconds: int, cancel: str | None
) -> PreviewReply:
    """`run_preview`'s reply, all but its `scrubbed_source`."""
    if not sys.platform.startswith("linux"):
        return _unsupported("preview unavailable: the preview needs Linux")
    try:  # built once per kernel, before the fork: the child only loads them
        programs = {p: sandbox.seccomp_program(p) for p in (False, True)}
    except sandbox.Unavailable as e:
        return _unsupported(f"preview unavailable: this Linux lacks {e}")
    kernel = _KernelState()
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    listener = None
    if cancel is not None:
        # Bound before the fork: a cancel sent as soon as the server asked is not lost.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(f"\0{CANCEL_PREFIX}{cancel}")
        except OSError:
            listener.close()
            raise
    try:
        reply = _preview(
            shell, source, timeout, memory_mb, cpu_seconds, programs, kernel, t0, times, listener
        )
    finally:
        if listener is not None:
            listener.close()
    return reply


def _scrubbed(shell: Any, source: str) -> str | None:
    """`source` scrubbed by the recorder's secrets (None without a recorder)."""
    from . import get_recorder

    recorder = get_recorder(shell)
    if recorder is None:
        return None
    return recorder.secrets.scrub(source, literals=True)


def cancel_preview(token: str) -> bool:
    """Cancel the running preview started with `cancel=token` (from any process in the
    kernel's network namespace); False if none is running."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(b"cancel", f"\0{CANCEL_PREFIX}{token}")
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def _preview(
    shell: Any,
    source: str,
    timeout: float,
    memory_mb: int,
    cpu_seconds: int,
    programs: dict,
    kernel: _KernelState,
    t0: float,
    times: dict[str, float],
    listener: socket.socket | None,
) -> PreviewReply:
    rfd, wfd = os.pipe()

    def child(direct: bool) -> None:
        times["first process"] = time.perf_counter()
        _child(shell, source, wfd, memory_mb, cpu_seconds, programs, times, kernel, direct)

    spawned: _Direct | _Monitored | None = None
    watch: _Watch | None = None
    status: int | None = None
    try:
        try:
            with _interrupts_deferred():
                spawned = _spawn(wfd, rfd, child, times)
        finally:
            os.close(wfd)
        fork_ms = (time.perf_counter() - t0) * 1000
        cancel_fd = listener.fileno() if listener is not None else None
        watch = _Watch(rfd, time.monotonic() + timeout, memory_mb, spawned, cancel_fd)
        spawned.started(watch.deadline)
        if spawned.pid is not None:
            watch.run()
        elif spawned.refused is None:
            watch.killed = "timeout" if time.monotonic() >= watch.deadline else None
    finally:
        os.close(rfd)
        # Done, past a bound, or the kernel was interrupted while waiting: the namespace ends.
        if spawned is not None:
            complete = watch is not None and watch.complete and not watch.killed
            status = spawned.finish(complete)
    if spawned.refused is not None:
        return _unsupported(spawned.refused, fork_ms=fork_ms)
    if watch.killed == "cancelled":
        return PreviewReply(
            status="cancelled",
            detail="preview cancelled",
            outputs=[],
            stopped=[],
            sandbox={},
            fork_ms=fork_ms,
            elapsed_ms=(time.perf_counter() - t0) * 1000,
        )
    header = watch.header or {}
    if "unavailable" in header:
        return _unsupported(str(header["unavailable"]), fork_ms=fork_ms)
    reply: Any
    # The reply is the last line (JSON has no raw newline): whatever the cell itself wrote
    # into the pipe before it is not the reply.
    last = bytes(watch.reply).removesuffix(REPLY_END).rstrip().rpartition(b"\n")[2]
    try:
        # (NaN and infinities, which a display's metadata may hold, are not JSON: they would
        # fail the kernel's own message to the server)
        reply = json.loads(last, parse_constant=lambda _: None) if last else {}
    except (ValueError, RecursionError):
        reply = None
    garbled = not isinstance(reply, dict)
    if garbled:
        reply = {}
    elif reply:
        reply = _checked(reply)
    if not reply or watch.killed:
        partial = reply
        what = _describe_status(
            status, timeout, cpu_seconds, watch.killed, memory_mb, garbled, spawned.cpu
        )
        reply = {
            "outputs": partial.get("outputs", []),
            "sandbox": partial.get("sandbox", {}),
            "status": "ok",
            "stopped": [what],
        }
        if what == cpu_bound(cpu_seconds):
            reply["cpu_bound"] = cpu_seconds
    reply["fork_ms"] = fork_ms
    reply["elapsed_ms"] = (time.perf_counter() - t0) * 1000
    steps = reply.pop("times", None)
    if isinstance(steps, dict) and all(isinstance(v, float) for v in steps.values()):
        # How long each step took, from the fork on (ms).
        previous, timing = t0, {}
        for step in ("monitor", "first process", "isolated", "ran"):
            if step in steps:
                timing[step] = round((steps[step] - previous) * 1000, 2)
                previous = steps[step]
        timing["reply"] = round((time.perf_counter() - previous) * 1000, 2)
        reply["timing_ms"] = timing
        reply["path"] = "monitor" if "monitor" in steps else "direct"
    return PreviewReply(reply)
