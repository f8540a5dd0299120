"""What the command-line tools show a person: the one-line error (CliError) and progress bars.

The CLI (`jupyter themisto …`) and the dump package it writes and reads with report bad input
and failures a person can act on as a CliError: one line on stderr and a non-zero exit, no
traceback.
"""

from __future__ import annotations

import sys
from typing import Any


class CliError(Exception):
    """Bad input or a failure the person can act on: one line on stderr, non-zero exit."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a job scheduler's stop), handled as Ctrl-C is: what runs is
    stopped and its temporary files and kernels go, instead of the process vanishing at once."""


def progress(total: int | None, desc: str, unit: str = "it", disable: bool = False) -> Any:
    """A tqdm bar on stderr (`disable` hides it)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable, leave=False)
