"""After the last snapshot child has exited: take the kernel's copy-on-write faults off the cells.

A fork leaves every page of the kernel write-protected; the first write to each afterwards (a
reference count, a new object) faults, child or no child: 2,000-7,500 faults, 5-10 ms, in the
cell after a snapshot of a kernel holding pandas or scikit-learn (measured with getrusage's
minor faults). Once no child shares the pages, the watcher thread asks Linux to make the pages
that are present writable again (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+) in the
background, without the GIL: then the cell's writes do not fault. Only pages present now are
touched (read from /proc/self/pagemap: memory reserved but never used stays unallocated), in
chunks, and it stops as soon as another child is forked (its pages must stay shared). It
changes no byte of memory; any failure just leaves the faults to the cell.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable

_MADV_POPULATE_WRITE = 23
_CHUNK = 8 << 20
_PRESENT = re.compile(rb"\x01+")
# The high byte of each pagemap entry has bit 63 ("present") as its top bit.
_HIGH_BIT = bytes(1 if b & 0x80 else 0 for b in range(256))


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_MADVISE = _madvise()


def present_runs() -> list[tuple[int, int]]:
    """(address, bytes) of the runs of present pages in the private anonymous writable
    mappings (the heap, malloc's and Python's arenas, NumPy's buffers)."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb", buffering=0) as pm:
        for line in maps:
            parts = line.split()
            if len(parts) < 5 or parts[1] != "rw-p" or (len(parts) > 5 and parts[5] != "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            pm.seek(lo // page * 8)
            entries = pm.read((hi - lo) // page * 8)
            flags = entries[7::8].translate(_HIGH_BIT)
            for m in _PRESENT.finditer(flags):
                runs.append((lo + m.start() * page, (m.end() - m.start()) * page))
    return runs


def prefault(stop: Callable[[], bool]) -> int:
    """Make the present pages writable again; returns the bytes done. `stop()` is asked
    between chunks (a new snapshot child: its pages must stay shared)."""
    if _MADVISE is None or stop():
        return 0
    done = 0
    try:
        runs = present_runs()
    except OSError:
        return 0
    for address, size in runs:
        for start in range(address, address + size, _CHUNK):
            if stop():
                return done
            length = min(_CHUNK, address + size - start)
            if _MADVISE(start, length, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == 22:  # EINVAL: a kernel without it
                    return done
                break  # unmapped meanwhile (EFAULT, ENOMEM): the next run
            done += length
    return done
