"""`python -m jupyter_themisto.cli`: the same as `jupyter themisto`."""

from __future__ import annotations

from . import run

run()
