"""`jupyter themisto …`: record notebooks headlessly, list and show trajectories, export
benchmark dumps and evaluate backends on them.

Every subcommand reports bad input as one line on stderr (`jupyter-themisto: error: …`) and
exits non-zero; files are written to a temporary path and renamed into place, so an error or
an interruption never leaves a half-written result behind.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .._version import __version__
from ..console import CliError, Terminated

__all__ = ["CliError", "main"]

PROG = "jupyter-themisto"
# What the `eval` extra brings (export to Parquet, evaluate's metrics and plot).
EVAL_MODULES = ("sacrebleu", "rouge_score", "pandas", "pyarrow", "matplotlib")


def build_parser() -> argparse.ArgumentParser:
    from . import evaluate, export, listing, model, record

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Record notebook trajectories, export benchmark dumps, evaluate backends.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    store_help = "trajectory store file (default: $THEMISTO_STORE, else the Jupyter data directory)"
    parser.add_argument("--store", metavar="PATH", help=store_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (record, export, evaluate, listing, model):
        module.add_parsers(sub)
    for command in sub.choices.values():
        # `jupyter themisto record nb.ipynb --store S` works as well as `--store S record …`.
        command.add_argument("--store", metavar="PATH", default=argparse.SUPPRESS, help=store_help)
    return parser


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[list[int]]:
    """SIGTERM does what Ctrl-C does at that moment (in asyncio.run: the running task is
    cancelled first), and is remembered (the list it yields) so that the exit says which."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen  # only the main thread may set signal handlers
        return

    def terminate(signum: int, frame: Any) -> None:
        seen.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):
            raise Terminated
        handler(signal.SIGINT, frame)

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    terminated: list[int] = []
    try:
        with _sigterm_as_interrupt() as terminated:
            return int(args.func(args) or 0)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.status
    except ModuleNotFoundError as e:
        # The research tools' packages are an extra, kept out of kernel environments.
        if (e.name or "").split(".")[0] not in EVAL_MODULES:
            raise
        print(
            f"{PROG}: error: `{args.command}` needs {e.name}, which comes with the eval extra: "
            "pip install 'jupyter-themisto[eval]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as e:
        if isinstance(e, Terminated) or terminated:
            print(f"{PROG}: terminated", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def run() -> None:
    sys.exit(main())
