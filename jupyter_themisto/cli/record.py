"""`jupyter themisto record NOTEBOOK…`: re-execute notebooks headlessly with the recorder loaded.

Each notebook runs top to bottom in a fresh kernel (nbclient), producing one trajectory exactly
as a live session would: nbclient sends each cell's id in the execute request's metadata, and
the recorder (the `jupyter_themisto` IPython extension) is loaded by a *silent* execute before
the first cell, so loading it is not recorded. The kernel learns the store and the notebook
path from THEMISTO_STORE and THEMISTO_NOTEBOOK_PATH. The notebook file itself is never written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..console import CliError, Terminated, progress
from ..dump.schema import notebook_cell_id
from ..kernel_client import (
    RECORDER,
    ExpressionFailed,
    KernelNoReply,
    expression_value,
    silent_execute,
)
from ._common import one_line, open_store, store_path

# Silent executes fire no pre/post_run_cell, so none of this is recorded; the expressions bind
# no names, so nothing of ours shows up in the person's namespace or its snapshots.
_LOAD = "get_ipython().run_line_magic('load_ext', 'jupyter_themisto')"
_SET_MODE = f"{RECORDER}.snapshot_mode = {{mode!r}}"
_FLUSH = f"{RECORDER}.settle({{timeout}})"
_REAP = f"{RECORDER}.snapshots.reap()"
_TRAJECTORY = f"{RECORDER}.trajectory_id"
_STATUS = f"{RECORDER}.status()"


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "record",
        help="re-execute notebooks headlessly, recording their trajectories",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("notebooks", nargs="+", metavar="NOTEBOOK", help=".ipynb files to run")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one cell may run; a cell still running then is"
        " interrupted (recorded as interrupted) and the notebook stops there",
    )
    p.add_argument(
        "--kernel", metavar="NAME", default=None, help="kernel name (default: the notebook's)"
    )
    p.add_argument(
        "--allow-errors",
        action="store_true",
        help="go on after a cell raises (recorded with status error); default: stop the notebook",
    )
    p.add_argument(
        "--snapshot-mode",
        choices=["inline", "fork", "off"],
        default="inline",
        help="how the recorder snapshots the namespace (default inline: nobody waits on a "
        "headless run, and no snapshot is skipped because too many children are running)",
    )
    p.set_defaults(func=cmd_record)


def _read(path: Path) -> Any:
    import nbformat

    if not path.is_file():
        raise CliError(f"no such notebook: {path}")
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # nbformat raises many kinds for a file that is not a notebook
        raise CliError(f"{path} is not a Jupyter notebook: {type(e).__name__}: {e}") from e
    # nbformat reads a cell whose source is no text (a number, null, an object) without a word;
    # nbclient then fails on it mid-notebook, after the cells above it ran.
    for index, cell in enumerate(nb.get("cells", [])):
        source = cell.get("source") if isinstance(cell, dict) else None
        if not isinstance(source, str):
            raise CliError(
                f"{path} is not a Jupyter notebook: cell {index}'s source is "
                f"{type(source).__name__}, not text"
            )
    return nb


def _send_cell_ids(kc: Any, current: dict[str, Any]) -> None:
    """Make the kernel client put the running cell's id in each execute request's metadata
    (`cellId`, as JupyterLab does): ipykernel hands it to IPython as `ExecutionInfo.cell_id`.
    nbclient does not send it, and jupyter_client's `execute` takes no metadata."""
    plain = kc.execute

    def execute(
        code: str,
        silent: bool = False,
        store_history: bool = True,
        user_expressions: dict[str, Any] | None = None,
        allow_stdin: bool | None = None,
        stop_on_error: bool = True,
    ) -> str:
        if silent or not current.get("cell_id"):
            return plain(
                code,
                silent=silent,
                store_history=store_history,
                user_expressions=user_expressions,
                allow_stdin=allow_stdin,
                stop_on_error=stop_on_error,
            )
        content = {
            "code": code,
            "silent": silent,
            "store_history": store_history,
            "user_expressions": user_expressions or {},
            "allow_stdin": kc.allow_stdin if allow_stdin is None else allow_stdin,
            "stop_on_error": stop_on_error,
        }
        msg = kc.session.msg("execute_request", content, metadata={"cellId": current["cell_id"]})
        kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    kc.execute = execute


async def _execute_silent(
    client: Any,
    code: str,
    timeout: float = 60.0,
    what: str = "loading the recorder",
    **request: Any,
) -> dict[str, Any]:
    """A silent execute (no run_cell hooks, no history); returns the reply content."""
    try:
        return await silent_execute(client.kc, code, timeout=timeout, what=what, **request)
    except KernelNoReply as e:
        raise CliError(str(e)) from e


async def _query(client: Any, expression: str, timeout: float = 60.0) -> Any:
    """Evaluate an expression silently (a user_expression of a silent execute): its value."""
    content = await _execute_silent(
        client, "", timeout, "asking the recorder", user_expressions={"v": expression}
    )
    try:
        return expression_value(content, "v")
    except ExpressionFailed as e:
        raise CliError(f"the recorder did not load in the kernel: {e}") from e


def record_notebook(
    path: Path,
    store: Path,
    *,
    timeout: float,
    kernel: str | None,
    allow_errors: bool,
    snapshot_mode: str,
) -> dict[str, Any]:
    """Run one notebook with the recorder; returns {"trajectory_id", "cells", "error"}."""
    import zmq
    from jupyter_client.kernelspec import NoSuchKernel
    from jupyter_core.utils import ensure_async
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from traitlets.config import Config

    nb = _read(path)
    kwargs: dict[str, Any] = {"timeout": timeout, "allow_errors": allow_errors}
    if kernel:
        kwargs["kernel_name"] = kernel
    # The kernel runs in the notebook's own folder, as Jupyter runs it, so relative paths to
    # the data files beside a notebook work wherever `record` was started from.
    folder = str(path.resolve().parent)
    # The kernel's messages carry the person's code, outputs and secrets: encrypted (CurveZMQ)
    # when its kernelspec supports it, as ipykernel's does (else it warns of plain TCP), and
    # this pyzmq can (else jupyter_client refuses the setting).
    config = Config()
    if zmq.has("curve"):
        config.KernelManager.transport_encryption = "auto"
    client = NotebookClient(nb, resources={"metadata": {"path": folder}}, config=config, **kwargs)
    env = dict(os.environ)
    env["THEMISTO_STORE"] = str(store)
    env["THEMISTO_NOTEBOOK_PATH"] = str(path.resolve())
    code_cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    error: str | None = None
    bar = progress(len(code_cells), path.name, unit="cell")
    trajectory_id: str | None = None
    status: dict[str, Any] = {}
    current: dict[str, Any] = {"cell_id": None}
    # After the cells: the last snapshot (inline, as long as a cell may take) and the writer.
    flush_timeout = timeout
    stopped: list[int] = []  # Ctrl-C or SIGTERM while the notebook ran

    def stop(signum: int) -> None:
        """Ctrl-C (SIGINT) or SIGTERM: the running cell is interrupted and recorded, no cell
        starts after it, and the recording is written; a second one stops at once."""
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signum)
        print(
            f"\n{path.name}: stopping: the running cell is interrupted and the recording "
            "written (again to stop at once)",
            file=sys.stderr,
        )
        if current.get("running") and client.km is not None:
            current["interrupt"] = asyncio.ensure_future(ensure_async(client.km.interrupt_kernel()))

    async def run() -> None:
        nonlocal error, trajectory_id, status
        try:
            async with client.async_setup_kernel(env=env):
                # (in place of nbclient's handlers, which shut the kernel down at once)
                _on_stop_signals(stop)
                _send_cell_ids(client.kc, current)
                await _execute_silent(client, _LOAD)
                await _execute_silent(client, _SET_MODE.format(mode=snapshot_mode))
                tid = await _query(client, _TRAJECTORY)
                trajectory_id = tid if isinstance(tid, str) else None
                for index, cell in code_cells:
                    if stopped:
                        error = f"{signal.Signals(stopped[0]).name} before cell {index}"
                        break
                    current["cell_id"] = notebook_cell_id(cell, index)
                    current["running"] = True
                    try:
                        await client.async_execute_cell(cell, index)
                    except CellTimeoutError:
                        error = f"cell {index} timed out after {timeout:.0f} s"
                        # Interrupted, the cell ends with KeyboardInterrupt and is recorded
                        # with what it printed; the recording is then written after it.
                        if client.km is not None:
                            await ensure_async(client.km.interrupt_kernel())
                        break
                    except CellExecutionError as e:
                        first = str(e).strip().splitlines()
                        error = f"cell {index} raised " + (first[-1] if first else "an error")
                        break
                    except DeadKernelError:
                        error = f"the kernel died in cell {index}"
                        return
                    except Exception as e:
                        # nbclient failing on what the cell sent back (an output nbformat
                        # rejects, say): this notebook stops there, with what was recorded up
                        # to it written, and the other notebooks still run.
                        said = (str(e).strip().splitlines() or [""])[0]
                        error = f"cell {index}: nbclient failed: " + one_line(
                            f"{type(e).__name__}: {said}", 200
                        )
                        break
                    finally:
                        current["running"] = False
                        if stopped:  # (the cell ran to its end or was interrupted: recorded)
                            error = f"{signal.Signals(stopped[0]).name} in cell {index}"
                    if stopped:
                        break
                    bar.update(1)
                # The last execution is written after its reply and snapshots may still run:
                # wait for both before the kernel goes away. (Should this give up, the
                # kernel is shut down: a snapshot it had not written is then swept to
                # 'failed' by the next recorder or server that reads the store.)
                try:
                    status = await _finish(client, flush_timeout)
                except CliError as e:
                    error = f"{error}; {e}" if error else str(e)
        except CliError:
            raise
        except NoSuchKernel as e:
            raise CliError(f"{path}: no such kernel {e.name!r} (pass --kernel NAME)") from e
        except (RuntimeError, OSError) as e:
            raise CliError(f"cannot run {path}: {type(e).__name__}: {e}") from e

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(run())
    finally:
        bar.close()
        if threading.current_thread() is threading.main_thread():
            for signum, handler in handlers.items():  # (nbclient leaves the defaults)
                if handler is not None:
                    signal.signal(signum, handler)
    recorded, lost = _count_recorded(store, trajectory_id)
    return {
        "stopped": stopped[0] if stopped else None,
        "trajectory_id": trajectory_id,
        "cells": recorded,
        "lost": lost,
        "error": error,
        "notebook": str(path),
        "recorder_errors": status.get("errors", 0),
        "last_recorder_error": status.get("last_error"),
    }


def _on_stop_signals(stop: Callable[[int], None]) -> None:
    """Call `stop(signum)` on SIGINT and SIGTERM while the event loop runs (in the main thread;
    elsewhere signals keep their handlers)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, stop, signum)
        except (RuntimeError, NotImplementedError, ValueError):
            return


async def _finish(client: Any, timeout: float) -> dict[str, Any]:
    """Until the recorder has written everything and no snapshot child runs (or timeout): the
    recorder's status then."""
    deadline = time.monotonic() + timeout
    what = "writing the recording"
    await _execute_silent(client, _FLUSH.format(timeout=timeout), timeout + 10, what)
    while True:
        await _execute_silent(client, _REAP, 60.0, what)
        found = await _query(client, _STATUS)
        status = found if isinstance(found, dict) else {}
        running = status.get("snapshot_children")
        # Executions and other writes the store has not taken yet (locked by another
        # process?): the writer tries again every few seconds; what still waits when the
        # kernel ends is gone.
        waiting = status.get("lost_waiting", 0) + status.get("writes_waiting", 0)
        if not running and not waiting:
            return status
        if time.monotonic() > deadline:
            if waiting:
                raise CliError(
                    f"{what}: {waiting} executions or snapshots still wait for the store after"
                    f" {timeout:.0f} s (is another process holding it locked?); they end with"
                    " the kernel"
                )
            raise CliError(f"{what}: snapshot processes still running after {timeout:.0f} s")
        await asyncio.sleep(0.1)


def _count_recorded(store: Path, trajectory_id: str | None) -> tuple[int, int]:
    """(executions recorded, of which lost) in the store: empty cells run nothing and are not
    counted; an execution the store could not take when it ran counts as lost."""
    if trajectory_id is None:
        return 0, 0
    from ..store import TrajectoryStore

    try:
        with TrajectoryStore(store, readonly=True) as s:
            rows = (
                s._conn()
                .execute(
                    "SELECT count(*), sum(status = 'lost') FROM executions WHERE trajectory_id = ?",
                    (trajectory_id,),
                )
                .fetchone()
            )
    except Exception:
        return 0, 0
    return int(rows[0] or 0), int(rows[1] or 0)


def cmd_record(args: argparse.Namespace) -> int:
    paths = [Path(p).expanduser() for p in args.notebooks]
    for p in paths:  # all inputs checked before any kernel starts
        _read(p)
    if args.kernel:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

        ksm = KernelSpecManager()
        try:
            ksm.get_kernel_spec(args.kernel)
        except NoSuchKernel:
            known = ", ".join(sorted(ksm.find_kernel_specs())) or "none"
            raise CliError(f"unknown kernel {args.kernel!r}; installed kernels: {known}") from None
    store = store_path(args)
    if store.exists():  # (a file that is no store is said before any notebook runs)
        open_store(args).close()
    failed = 0
    for p in paths:
        result = record_notebook(
            p,
            store,
            timeout=args.timeout,
            kernel=args.kernel,
            allow_errors=args.allow_errors,
            snapshot_mode=args.snapshot_mode,
        )
        line = f"{p}: trajectory {result['trajectory_id']}, {result['cells']} cells recorded"
        if result["lost"]:
            line += f" ({result['lost']} of them lost: status 'lost', the reason in 'detail')"
        if result["recorder_errors"]:
            line += (
                f"; the recorder reported {result['recorder_errors']} error(s), the last: "
                f"{result['last_recorder_error']}"
            )
        if result["error"]:
            failed += 1
            print(f"{line}; stopped: {result['error']}", file=sys.stderr)
        elif result["lost"]:
            failed += 1  # (the recording is not whole: a script must not take it for one)
            print(line, file=sys.stderr)
        else:
            print(line)
        if result["stopped"] == signal.SIGTERM:
            raise Terminated  # (the notebooks after it are not run)
        if result["stopped"] is not None:
            raise KeyboardInterrupt
    return 1 if failed else 0
