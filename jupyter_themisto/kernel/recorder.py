"""ThemistoRecorder: the IPython extension object that records every cell execution of a kernel.

Configure it like any IPython/ipykernel object, e.g. in `ipython_kernel_config.py`::

    c.InteractiveShellApp.extensions = ["jupyter_themisto"]
    c.ThemistoRecorder.snapshot_mode = "fork"        # fork | inline | off
    c.ThemistoRecorder.max_output_bytes = 65536

Every hook catches its own failures and reports them to the kernel's log (the terminal of the
process that started the kernel), never to the cell's output: the recorder must not change
what the person sees nor break a cell.
"""

from __future__ import annotations

import atexit
import os
import sys
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from traitlets import Bool, Enum, Float, Int, TraitError, Unicode, default, observe, validate
from traitlets.config import LoggingConfigurable

from .. import _clock as time
from ..redaction import DEFAULT_SECRET_PATTERN, KernelSecrets, compile_pattern, redact_source
from . import resources
from .outputs import OutputCapture, as_sent, drain_fd_pipes, error_output, finalize_outputs

NOTEBOOK_PATH_ENV = "THEMISTO_NOTEBOOK_PATH"
# Set by the server for the kernels it launches: "0" when the notebook opts out of recording.
RECORD_ENV = "THEMISTO_RECORD"
# Set by the server: its root directory, to turn JPY_SESSION_NAME into the notebook's API path.
SERVER_ROOT_ENV = "THEMISTO_SERVER_ROOT"


def _default_snapshot_mode() -> str:
    return "fork" if hasattr(os, "fork") and sys.platform != "win32" else "inline"


class ThemistoRecorder(LoggingConfigurable):
    """Records each execution (source, outputs, status, time, memory, snapshot) to the store."""

    enabled = Bool(
        help="Record executions (the %themisto on/off magic toggles it). Default: on, unless "
        "the environment variable THEMISTO_RECORD is 0 (the server sets it for a notebook "
        'whose metadata says "themisto": {"record": false}).'
    ).tag(config=True)
    store_path = Unicode(
        "",
        help="Trajectory store file; empty: $THEMISTO_STORE, else the Jupyter data directory.",
    ).tag(config=True)
    snapshot_mode = Enum(
        ["fork", "inline", "off"],
        help="How the namespace snapshot is taken after each execution: in a forked "
        "copy-on-write child (fork), in the kernel right after the cell (inline: the person "
        "waits), or not at all (off).",
    ).tag(config=True)
    max_output_bytes = Int(
        64 * 1024, help="Bytes kept of one output (text value); the rest is marked as truncated."
    ).tag(config=True)
    max_execution_output_bytes = Int(
        1024 * 1024, help="Bytes of inline outputs kept per execution; further outputs omitted."
    ).tag(config=True)
    blob_threshold_bytes = Int(
        1024, help="Binary MIME payloads (images) larger than this go to the blob store."
    ).tag(config=True)
    max_blob_bytes = Int(
        32 * 1024 * 1024, help="Binary payloads larger than this are not stored (marker only)."
    ).tag(config=True)
    max_variable_bytes = Int(
        64 * 1024 * 1024,
        help="Variables whose serialized size exceeds this are summarized, not serialized.",
    ).tag(config=True)
    max_variable_seconds = Float(
        5.0, help="Seconds one variable may take to serialize before it is only summarized."
    ).tag(config=True)
    max_snapshot_seconds = Float(
        300.0, help="Seconds a snapshot child may run before it is killed (status failed)."
    ).tag(config=True)
    small_snapshot_seconds = Float(
        0.01,
        help="In fork mode, a snapshot whose changed variables are small (scalars, short "
        "strings, small containers, arrays and frames under 1 MB, functions and classes of "
        "installed libraries) is taken by the kernel itself, while idle, if it fits in this "
        "many seconds: no child process, and the next cell pays no copy-on-write page faults "
        "(after a fork, 5-20 ms in the next cell of a kernel holding pandas or sklearn); larger "
        "ones, or one past this time, are forked (0: always fork).",
    ).tag(config=True)
    prefault_after_snapshot = Bool(
        True,
        help="Linux: once the last snapshot child has exited, make the kernel's pages writable "
        "again in a background thread (madvise MADV_POPULATE_WRITE on the pages present), so "
        "that the next cells do not pay a copy-on-write fault per page they write (False: "
        "they do).",
    ).tag(config=True)
    max_snapshot_children = Int(
        3,
        help="Concurrent snapshot children; when reached, the snapshot of that execution is "
        "skipped (status 'skipped', detail says why).",
    ).tag(config=True)
    snapshot_slot_wait = Float(
        0.0,
        help="Seconds to wait, after the reply, for a snapshot child to finish when "
        "max_snapshot_children are running, before skipping (0: skip at once; a large value "
        "snapshots every execution of a batch re-execution at the cost of pacing it).",
    ).tag(config=True)
    exit_wait_seconds = Float(
        1.0,
        help="Seconds a kernel shutting down waits for running snapshot children (they go "
        "on after it exits unless the kernel's process group is killed).",
    ).tag(config=True)
    max_repr_chars = Int(200, help="Length of the short repr kept in a variable summary.").tag(
        config=True
    )
    secret_pattern = Unicode(
        DEFAULT_SECRET_PATTERN,
        help="Case-insensitive regex: variables whose name matches are stored without value "
        "or repr, string literals assigned to them are redacted from the recorded source, and "
        "their string values are scrubbed from recorded outputs.",
    ).tag(config=True)
    redact_source = Bool(
        True, help="Redact string literals assigned to secret names in the recorded source."
    ).tag(config=True)
    defer_writes = Bool(
        True,
        help="Write the execution and start its snapshot just after the kernel has replied "
        "(the person does not wait for them); a cell sent meanwhile first completes them.",
    ).tag(config=True)

    snapshot_delay = Float(
        0.05,
        help="Seconds the kernel stays idle after a reply before it snapshots the namespace; "
        'a cell that starts meanwhile ("Run All", cells sent back to back) takes the '
        "snapshot's place: the earlier execution's snapshot is 'coalesced' (0: at once).",
    ).tag(config=True)
    snapshot_max_deferral = Float(
        10.0,
        help="While cells keep coming back to back, still snapshot right after a reply when "
        "the last snapshot is older than this (seconds).",
    ).tag(config=True)

    store_busy_seconds = Float(
        10.0,
        help="Seconds a write waits for a store locked by another process before the execution "
        "counts as lost; lost executions are written later, as status 'lost' in their place, "
        "once the store takes writes again.",
    ).tag(config=True)

    @default("enabled")
    def _enabled_default(self) -> bool:
        return os.environ.get(RECORD_ENV, "1").strip() != "0"

    @observe("enabled")
    def _enabled_changed(self, change: dict[str, Any]) -> None:
        """`%themisto off` / `on`: note the pause (or its end) in the store, after everything
        recorded before it, so that the server tells a paused recorder from a slow one."""
        # (Set from configuration, it changes before __init__ has set these.)
        tid = getattr(self, "trajectory_id", None)
        writer = getattr(self, "writer", None)
        if tid is None or writer is None or change["old"] == change["new"]:
            return
        paused = not change["new"]
        # The running cell's count: IPython counts a cell before running it, and ipykernel
        # replies with `execution_count - 1` likewise.
        following = getattr(getattr(self, "shell", None), "execution_count", None)
        count = following - 1 if isinstance(following, int) else None
        writer.submit(
            lambda store: store.note_recording(tid, paused=paused, execution_count=count),
            retried=True,
        )

    @default("snapshot_mode")
    def _snapshot_mode_default(self) -> str:
        return _default_snapshot_mode()

    # Validators raise TraitError: traitlets then keeps the value in use (a `%config` shows the
    # error); any other exception would leave the rejected value set.

    @validate("secret_pattern")
    def _check_pattern(self, proposal: Any) -> str:
        try:
            compile_pattern(proposal["value"])
        except ValueError as e:
            raise TraitError(f"ThemistoRecorder.secret_pattern: {e}") from e
        return proposal["value"]

    @validate("max_output_bytes", "max_execution_output_bytes")
    def _check_bound(self, proposal: Any) -> int:
        name, value = proposal["trait"].name, proposal["value"]
        if value < 1:
            raise TraitError(f"ThemistoRecorder.{name} must be at least 1 (bytes), not {value}")
        return value

    @validate("store_path")
    def _check_store_path(self, proposal: Any) -> str:
        # The store is fixed once the recorder opens it (as it starts recording). (Compared
        # with the value it was fixed from: while traitlets validates a `%config`, the trait
        # already holds the value proposed.)
        fixed = getattr(self, "_store_file", None)
        if fixed is not None and proposal["value"] != self._store_from:
            raise TraitError(
                "ThemistoRecorder.store_path takes effect only when the kernel starts: this "
                f"kernel records to {fixed} (set it in the kernel's configuration, or "
                "$THEMISTO_STORE, and restart the kernel)"
            )
        return proposal["value"]

    def __init__(self, shell: Any, **kwargs: Any) -> None:
        super().__init__(parent=shell, **kwargs)
        self.shell = shell
        self.pid = os.getpid()
        self.capture = OutputCapture(shell)
        self.peak = resources.PeakTracker()
        self.writer: Any = None
        self.trajectory_id: str | None = None
        # The next execution's place in the trajectory (the recorder numbers them itself).
        self.next_order = 0
        self.last_order: int | None = None
        self.errors = 0
        self.last_error: str | None = None
        self._current: dict[str, Any] | None = None
        # Cells running now: more than one while a cell runs code as a cell (`run_cell`).
        self._depth = 0
        self._registered = False
        # Seconds the person waited on the recorder per execution (pre + post hooks), for
        # benchmarks/recording_overhead.py and `%themisto status`.
        self.hook_seconds: deque[float] = deque(maxlen=100_000)
        # Seconds of kernel time spent after the reply per execution (handing the execution
        # to the writer thread, and a fork when one is taken right away).
        self.deferred_seconds: deque[float] = deque(maxlen=100_000)
        self._pending: dict[str, Any] | None = None
        # The values known secret (plaintext in this process only; the store gets keyed hashes).
        self.secrets = KernelSecrets(self.secret_pattern)
        self._handler_patch: tuple[Any, Any, Any] | None = None
        self.owner: str | None = None
        self._store_file: Path | None = None
        self._store_from = ""
        from .snapshot_manager import SnapshotManager

        self.snapshots = SnapshotManager(self)

    @property
    def store_file(self) -> Path:
        """The store's absolute path, fixed when first asked for (as the recorder starts): a
        cell that changes the working directory must not move the recording elsewhere."""
        if self._store_file is None:
            from ..store import resolve_store_path

            self._store_file = resolve_store_path(self.store_path or None)
            self._store_from = self.store_path
        return self._store_file

    @property
    def store(self) -> Any:
        """The writer thread's store (None until it could be opened)."""
        return self.writer.store if self.writer is not None else None

    # -- registration ------------------------------------------------------------------------

    def register(self) -> None:
        if self._registered:
            return
        from ..store.processes import process_identity
        from .writer import RecordWriter

        # Named with each pending snapshot: a sweep tells a snapshot left pending by a kernel
        # that died (store/processes.py).
        self.owner = process_identity("kernel")
        self.writer = RecordWriter(
            self._open_store,
            report=self._report,
            locked_retry_seconds=self.store_busy_seconds,
            on_open=self._sweep,
        )
        events = self.shell.events
        events.register("pre_execute", self.pre_execute)
        events.register("pre_run_cell", self.pre_run_cell)
        events.register("post_run_cell", self.post_run_cell)
        self.capture.install_hooks()
        self._install_deferral()
        atexit.register(self._at_exit)
        self._registered = True
        _warm_up()
        if self.enabled:
            self._ensure_trajectory()

    def unregister(self) -> None:
        if not self._registered:
            return
        events = self.shell.events
        for name, cb in (
            ("pre_execute", self.pre_execute),
            ("pre_run_cell", self.pre_run_cell),
            ("post_run_cell", self.post_run_cell),
        ):
            try:
                events.unregister(name, cb)
            except ValueError:
                pass
        self.capture.remove_hooks()
        self._remove_deferral()
        atexit.unregister(self._at_exit)
        self.flush_pending()
        self.snapshots.take_due()
        self.snapshots.close()
        self.writer.close(timeout=self.exit_wait_seconds + 5)
        self._report_unwritten()
        self._registered = False

    def _install_deferral(self) -> None:
        """Run flush_pending after ipykernel has sent the reply (its post_handler_hook)."""
        kernel: Any = getattr(self.shell, "kernel", None)
        original = getattr(kernel, "post_handler_hook", None)
        if not self.defer_writes or original is None:
            return
        recorder = self

        def post_handler_hook(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                if recorder._pending is not None:
                    # io_loop exists once the kernel has started (after extensions load).
                    loop: Any = getattr(kernel, "io_loop", None)
                    try:
                        loop.add_callback(recorder.flush_pending)
                    except Exception:
                        recorder.flush_pending()

        kernel.post_handler_hook = post_handler_hook
        self._handler_patch = (kernel, original, post_handler_hook)

    def _remove_deferral(self) -> None:
        if self._handler_patch is None:
            return
        kernel, original, wrapper = self._handler_patch
        if getattr(kernel, "post_handler_hook", None) is wrapper:
            kernel.post_handler_hook = original
        self._handler_patch = None

    def _at_exit(self) -> None:
        if os.getpid() != self.pid:
            return  # a fork of the kernel (e.g. the output preview sandbox) leaving
        # The last execution of a kernel shut down right after its reply: no fork at exit.
        self.snapshots.exiting = True
        self.flush_pending()
        self.snapshots.take_due()
        self.snapshots.flush_coalesced()
        if self.writer is not None:
            self.writer.wait_idle(self.exit_wait_seconds)
            self.writer.close(timeout=self.exit_wait_seconds)
            self._report_unwritten()
        self.snapshots.wait(self.exit_wait_seconds, hurry=True)

    def _report_unwritten(self) -> None:
        """Say what the kernel ends with that the store never took (it is lost with it)."""
        writer = self.writer
        if writer is None or not (writer.lost or writer.waiting()):
            return
        from .writer import Unwritable

        self._report(
            "the kernel is ending with writes the store never took",
            Unwritable(
                f"{len(writer.lost)} executions and {writer.waiting()} other writes (snapshots,"
                f" secrets' hashes) are lost with it: {writer.last_error or 'not writable'}"
            ),
        )

    def _keep_last(self) -> None:
        # Outputs emitted by other post_run_cell callbacks (registered after us, e.g. by a
        # plotting backend configured in a later cell) belong to the cell: run after them.
        callbacks = self.shell.events.callbacks.get("post_run_cell", [])
        if callbacks and callbacks[-1] != self.post_run_cell and self.post_run_cell in callbacks:
            callbacks.remove(self.post_run_cell)
            callbacks.append(self.post_run_cell)

    # -- the store ---------------------------------------------------------------------------

    def _open_store(self, timeout: float) -> Any:
        """Opened by the writer thread (retried by it while it fails)."""
        from ..store import TrajectoryStore

        return TrajectoryStore(self.store_file, timeout=timeout)

    def _sweep(self, store: Any) -> None:
        """Once the store is open (writer thread): snapshots that kernels or snapshot children
        which died left pending are marked failed, so that nobody waits on them."""
        try:
            swept = store.sweep_pending_snapshots()
        except Exception as e:
            self._report("sweeping stale pending snapshots failed", e)
            return
        if swept:
            self.log.info("themisto: %d snapshot(s) left pending by dead processes: failed", swept)

    def _ensure_trajectory(self) -> str | None:
        if self.trajectory_id is not None or self.writer is None:
            return self.trajectory_id
        if not self.enabled:
            return None
        kernel = getattr(self.shell, "kernel", None)
        session = getattr(getattr(kernel, "session", None), "session", None)
        self.trajectory_id = uuid.uuid4().hex
        self.next_order = 0
        fields = {
            "notebook_path": notebook_path(),
            "kernel_id": current_kernel_id(),
            "session_id": session,
            "python_version": resources.python_version(),
            "started_at": time.time(),
        }
        self.writer.create_trajectory(
            self.trajectory_id,
            lambda: {
                **fields,
                "packages": resources.package_versions(),
                "host": resources.host_info(),
            },
        )
        self.log.info(
            "themisto: recording to %s (trajectory %s)", self.store_file, self.trajectory_id
        )
        return self.trajectory_id

    def describe(self, error: BaseException) -> str:
        """`Type: message` of an error, without the secret values the kernel knows (an error
        of the person's objects, such as a `__reduce__` that fails, may quote one)."""
        from .writer import describe

        try:
            return self.secrets.scrub(describe(error))
        except Exception:
            return type(error).__name__

    def _report(self, what: str, error: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{what}: {self.describe(error)}"
        try:
            self.log.warning("themisto: %s", self.last_error)
        except Exception:
            pass

    # -- hooks -------------------------------------------------------------------------------

    def pre_execute(self) -> None:
        """Every execution, silent ones too: a silent one fires no cell hooks, so a snapshot
        still due is taken before it can change the namespace."""
        if self.snapshots.due is None or os.getpid() != self.pid:
            return
        try:
            kernel = getattr(self.shell, "kernel", None)
            parent = kernel.get_parent("shell") if kernel is not None else None
            if (parent or {}).get("content", {}).get("silent"):
                self.flush_pending()
                self.snapshots.silent_request()
        except BaseException as e:  # noqa: B036
            self._report("pre_execute failed", e)

    def pre_run_cell(self, info: Any) -> None:
        self._depth += 1
        if self._depth > 1:
            # A cell's own `run_cell` (`%rerun`, `get_ipython().run_cell(...)`): part of that
            # cell, as the person sees it (its source, all its output), not an execution.
            return
        # The previous execution's deferred work must finish before this cell changes anything
        # (its time counts in deferred_seconds, not here).
        self.flush_pending()
        entered = time.perf_counter()
        try:
            self._current = None
            if os.getpid() != self.pid:
                return
            self.snapshots.cell_starting()
            if not self.enabled:
                return
            self._keep_last()
            kernel = getattr(self.shell, "kernel", None)
            parent: dict[str, Any] = {}
            if kernel is not None and hasattr(kernel, "get_parent"):
                parent = kernel.get_parent("shell") or {}
            cell_id = getattr(info, "cell_id", None)
            if not cell_id:
                meta = parent.get("metadata") or {}
                cell_id = meta.get("cellId") or meta.get("cell_id")
            self._current = {
                "source": getattr(info, "raw_cell", "") or "",
                "cell_id": cell_id,
                "msg_id": (parent.get("header") or {}).get("msg_id"),
                "started_at": time.time(),
                "memory_before": resources.rss(),
            }
            self.peak.reset()
            self.capture.start()
            self._current["cpu0"] = time.process_time()
            self._current["t0"] = time.perf_counter()
            self._current["pre_cost"] = self._current["t0"] - entered
        except BaseException as e:  # noqa: B036 - a recorder must never break a cell
            self._current = None
            self._report("pre_run_cell failed", e)

    def post_run_cell(self, result: Any) -> None:
        # (never below 0: a cell that loads the recorder ends without having begun for it)
        depth, self._depth = self._depth, max(0, self._depth - 1)
        if depth > 1:
            return
        entered = time.perf_counter()
        current, self._current = self._current, None
        if current is None:
            return
        try:
            wall = entered - current["t0"]
            cpu = time.process_time() - current["cpu0"]
            drain_fd_pipes()
            raw_outputs = self.capture.stop()
            error = getattr(result, "error_before_exec", None) or getattr(
                result, "error_in_exec", None
            )
            # The cell's own traceback is recorded where it was shown (the capture's hook on
            # `_showtraceback`); one that was not is added to the outputs later.
            error_shown = self.capture.showed(error)
            self.capture.shown.clear()
            if error is not None and not error_shown and self.capture.clear_pending:
                # The error output (added to them later) is the cell's next output: a
                # `clear_output(wait=True)` before it clears the outputs before it.
                raw_outputs = []
            after = resources.rss()
            peak = self.peak.peak(current["memory_before"], after)
            self._pending = {
                "current": current,
                "result": result,
                "raw_outputs": raw_outputs,
                "error_shown": error_shown,
                "wall": wall,
                "cpu": cpu,
                "after": after,
                "peak": peak,
            }
            loop = getattr(getattr(self.shell, "kernel", None), "io_loop", None)
            if self._handler_patch is None or loop is None:
                self.flush_pending()
            else:
                # Safety net if no reply follows (e.g. a cell run outside a request).
                loop.call_later(1.0, self.flush_pending)
        except BaseException as e:  # noqa: B036
            self._report("recording the execution failed", e)
        finally:
            if self.capture.active:
                self.capture.stop()
            self.hook_seconds.append(current["pre_cost"] + time.perf_counter() - entered)

    def flush_pending(self) -> None:
        """Hand the last execution to the writer thread and schedule its snapshot."""
        pending, self._pending = self._pending, None
        if pending is None or os.getpid() != self.pid:
            return
        started = time.perf_counter()
        try:
            self._hand_over(**pending)
        except BaseException as e:  # noqa: B036
            self._report("recording the execution failed", e)
        self.deferred_seconds.append(time.perf_counter() - started)

    def _hand_over(
        self,
        current: dict[str, Any],
        result: Any,
        raw_outputs: list[dict[str, Any]],
        wall: float,
        cpu: float,
        after: int | None,
        peak: int | None,
        error_shown: bool = False,
    ) -> None:
        error = getattr(result, "error_before_exec", None) or getattr(result, "error_in_exec", None)
        count = getattr(result, "execution_count", None)
        if error is None:
            status = "ok"
        elif isinstance(error, KeyboardInterrupt):
            status = "interrupted"
        else:
            status = "error"
        if error is not None and not error_shown:
            raw_outputs = [*raw_outputs, error_output(self.shell, count, error)]
        if self._ensure_trajectory() is None:
            return
        # Learnt in the kernel (the namespace may change once the next cell runs).
        secrets = self.secrets
        secrets.pattern, secrets.output_limit = self.secret_pattern, self.max_output_bytes
        secrets.observe(self.shell.user_ns, current["source"])
        source = current["source"]
        if self.redact_source:
            source = redact_source(source, self.secret_pattern)
        source = secrets.scrub(source)
        followed = secrets.matcher  # (the hashes of other kernels' values known so far)
        # As the frontend got it back (`execute_input`): text a database can hold (a lone
        # surrogate would make the row unwritable).
        source = as_sent(source)
        snapshot_status = "pending" if self.snapshots.will_snapshot() else "off"
        record: dict[str, Any] = {
            "cell_id": current["cell_id"],
            "msg_id": current["msg_id"],
            "execution_count": count,
            "source": source,
            "status": status,
            "started_at": current["started_at"],
            "wall_time": wall,
            "cpu_time": cpu,
            "memory_before": current["memory_before"],
            "memory_after": after,
            "memory_peak": peak,
            "snapshot_status": snapshot_status,
        }
        if snapshot_status == "pending":
            record["snapshot_owner"] = self.owner
        limits = {
            "max_output_bytes": self.max_output_bytes,
            "max_execution_bytes": self.max_execution_output_bytes,
            "blob_threshold": self.blob_threshold_bytes,
            "max_blob_bytes": self.max_blob_bytes,
        }

        def prepare(put_blob: Any) -> dict[str, Any]:
            # On the writer thread: wire form, bounds, blobs.
            if secrets.matcher is not followed:
                # Hashes other kernels recorded, loaded since the source was scrubbed (this
                # kernel's first cell, or one run just after another kernel learnt a value).
                record["source"] = as_sent(secrets.scrub(record["source"]))
            full = dict(record)
            outputs = finalize_outputs(
                raw_outputs, put_blob=put_blob, scrub=secrets.scrub_output, **limits
            )
            # Again as a whole: a value learnt from a later output, JSON outputs.
            full["outputs"] = secrets.scrub_json(outputs)
            return full

        tid = self.trajectory_id

        def persist_secrets(store: Any) -> None:
            # New values: their keyed hashes to the store, earlier rows scrubbed of them. A
            # locked store goes back to the writer, which tries again (the values stay to
            # record until then: the server scrubs what it sends a model with these hashes).
            try:
                secrets.persist(store, tid)
            except Exception as e:
                from .writer import is_locked

                if is_locked(e):
                    raise
                self._report("recording secret digests failed", e)

        order = self.next_order
        self.next_order += 1
        self.last_order = order
        # Values other kernels recorded (by keyed hash) are followed too.
        self.writer.submit(secrets.load_digests)
        # The values learnt from the namespace and the source reach the store before the row
        # does: a server that waits for the row (`after_execution_count`) knows them by then.
        self.writer.submit(persist_secrets, retried=True)
        self.writer.add_execution(
            tid, order, prepare, fallback=record, direct=not _large(raw_outputs)
        )
        # Those learnt from its outputs after it (with the re-scrub of the rows before it).
        self.writer.submit(persist_secrets, retried=True)
        self.snapshots.execution_done(order, current["source"], wall)

    # -- status ------------------------------------------------------------------------------

    def settle(self, timeout: float = 60.0) -> bool:
        """Write everything recorded so far and take the due snapshot now (for `jupyter
        themisto record`, benchmarks, `%themisto status`); True once the writer is idle."""
        self.flush_pending()
        self.snapshots.take_due()
        self.snapshots.flush_coalesced()
        return self.writer.wait_idle(timeout) if self.writer is not None else True

    def timings(self) -> dict[str, list[float]]:
        """Seconds per execution by step, for benchmarks/recording_overhead.py."""
        return {
            "hooks": list(self.hook_seconds),
            "after_reply": list(self.deferred_seconds),
            "fork": list(self.snapshots.fork_seconds),
            "small": list(self.snapshots.small.seconds),
            "writer": list(self.writer.write_seconds) if self.writer is not None else [],
        }

    def status(self) -> dict[str, Any]:
        if self.writer is not None:
            self.writer.wait_idle(2.0)
        store = self.store
        return {
            "enabled": self.enabled,
            "store": str(store.path) if store is not None else None,
            "trajectory_id": self.trajectory_id,
            "snapshot_mode": self.snapshot_mode,
            "executions": self.next_order,
            "snapshots": dict(sorted(self.snapshots.counts.items())),
            "snapshot_children": self.snapshots.running(),
            "lost_waiting": len(self.writer.lost) if self.writer is not None else 0,
            "writes_waiting": self.writer.waiting() if self.writer is not None else 0,
            "writes_given_up": self.writer.kept_replaced + self.writer.kept_dropped
            if self.writer is not None
            else 0,
            "errors": self.errors,
            "last_error": self.last_error or (self.writer.last_error if self.writer else None),
            "last_overhead_ms": round(self.hook_seconds[-1] * 1000, 3)
            if self.hook_seconds
            else None,
        }


# Outputs past this many bytes are written by the writer thread, never on the kernel's own
# (see kernel/writer.py): decoding, hashing and compressing ~100 kB take about a millisecond.
_DIRECT_OUTPUT_BYTES = 100_000


def _large(raw_outputs: list[dict[str, Any]]) -> bool:
    """True if the captured outputs hold more than _DIRECT_OUTPUT_BYTES of text or data."""
    total = 0
    for out in raw_outputs:
        data = out.get("data")
        values = [
            *out.get("_parts", ()),
            *out.get("traceback", ()),
            out.get("text"),
            *(data.values() if isinstance(data, dict) else ()),
        ]
        total += sum(len(v) for v in values if isinstance(v, (str, bytes, bytearray)))
        if total > _DIRECT_OUTPUT_BYTES:
            return True
    return False


def _warm_up() -> None:
    """What the first snapshot needs, loaded as the kernel starts, not in a cell's time (about
    20 ms: xxhash, the change analysis, where the installed libraries live)."""
    try:
        import xxhash  # noqa: F401

        from ..references import library_reference
        from . import changes  # noqa: F401

        library_reference(len)
    except Exception:
        pass


def notebook_path() -> str | None:
    """THEMISTO_NOTEBOOK_PATH (set by `jupyter themisto record`), else JPY_SESSION_NAME (set by
    Jupyter Server: the notebook's OS path), relative to THEMISTO_SERVER_ROOT when under it."""
    explicit = os.environ.get(NOTEBOOK_PATH_ENV)
    if explicit:
        return explicit
    session = os.environ.get("JPY_SESSION_NAME")
    root = os.environ.get(SERVER_ROOT_ENV)
    if session and root:
        try:
            rel = os.path.relpath(os.path.abspath(session), os.path.abspath(root))
        except ValueError:
            rel = os.pardir
        if not rel.startswith(os.pardir):
            return rel.replace(os.sep, "/")
    return session or None


def current_kernel_id() -> str | None:
    try:
        from ipykernel.kernelapp import IPKernelApp

        if IPKernelApp.initialized():
            return resources.kernel_id_from_connection_file(IPKernelApp.instance().connection_file)
    except Exception:
        pass
    return None
