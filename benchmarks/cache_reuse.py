"""Does `cache_reuse_tokens` serve a long notebook's prompts, cut anew at each cell? Prints,
per setting, the first chunk's latency and how much of each prompt came from the engine's cache.

A long corpus notebook (over the prompt budget, so each prompt's beginning moves) is run cell
by cell, cells 10-25, one suggestion after each, as `local_model_latency.py --long` does. Each
setting runs in a process of its own: a loaded model and its cache are shared by every backend
of one process, so settings run one after the other in one process would serve each other's
prompts.

    .venv/bin/python benchmarks/cache_reuse.py                  # 2,0 2,256 1,0 1,256
    .venv/bin/python benchmarks/cache_reuse.py 1,256 1,64        # PARALLEL,CACHE_REUSE_TOKENS
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT = ("2,0", "2,256", "1,0", "1,256")
CACHE_LINE = re.compile(r"prompt (\d+) tokens, (\d+) of them from the cache")


class CacheLines(logging.Handler):
    """The llamacpp backend's debug line per answer: prompt tokens, and how many were cached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.rows: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = CACHE_LINE.search(record.getMessage())
        if m:
            self.rows.append((int(m[1]), int(m[2])))


async def one(parallel: int, reuse: int) -> None:
    sys.path.insert(0, str(HERE))
    import local_model_latency as bench

    from jupyter_themisto.backends.base import BackendEnv
    from jupyter_themisto.backends.llamacpp import LlamaCppPredictor

    log = logging.getLogger("cache_reuse")
    log.setLevel(logging.DEBUG)
    lines = CacheLines()
    log.addHandler(lines)
    backend = LlamaCppPredictor({"parallel": parallel, "cache_reuse_tokens": reuse})
    backend.env = BackendEnv(log=log)
    await asyncio.to_thread(backend.shared)
    path = bench.long_notebooks(1, 40)[0]
    cells = bench.notebook_cells(path, 40)
    mark = f"# {uuid.uuid4()}"

    def context(k: int) -> Any:
        # (as the server's contexts: the notebook named, which the engine slot is chosen by)
        return dataclasses.replace(bench.context(cells[:k], mark), notebook_path=path.name)

    await bench.timed(backend, context(9))
    lines.rows.clear()
    firsts = [(await bench.timed(backend, context(k)))[0] for k in range(10, 26)]
    shares = [cached / total for total, cached in lines.rows if total]
    print(
        f"parallel {parallel}, cache_reuse_tokens {reuse:4d}: first chunk median "
        f"{statistics.median(firsts) * 1000:5.0f} ms, max {max(firsts) * 1000:5.0f} ms; "
        f"answers that finished their prompt within the time: {len(shares)}, cached share "
        f"median {statistics.median(shares) * 100 if shares else 0:.0f} %",
        flush=True,
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        parallel, reuse = map(int, sys.argv[2].split(","))
        asyncio.run(one(parallel, reuse))
        return
    for setting in sys.argv[1:] or DEFAULT:
        subprocess.run([sys.executable, __file__, "--one", setting], check=True)


if __name__ == "__main__":
    main()
