"""Pages made writable again after a snapshot child (kernel/prefault.py): nothing allocated
that the kernel had not touched, no byte changed, in a real kernel."""

from __future__ import annotations

import time

import numpy as np
import psutil

from jupyter_themisto.kernel.prefault import prefault, present_runs

from .recorder_kernel import RecordingKernel


def test_only_present_pages_are_touched_and_stop_is_honoured():
    reserved = np.empty(256 << 20, dtype=np.uint8)  # never written: no pages behind it
    start = reserved.__array_interface__["data"][0]
    runs = present_runs()
    inside = sum(
        min(a + n, start + reserved.nbytes) - max(a, start)
        for a, n in runs
        if a < start + reserved.nbytes and a + n > start
    )
    assert inside < 1 << 20
    # The resident size now, not ru_maxrss: a peak never falls, and a process's peak carries
    # over from the one that forked it (a kernel launched by a large pytest started above 2 GB).
    before = psutil.Process().memory_info().rss
    assert prefault(lambda: False) > 0
    assert psutil.Process().memory_info().rss - before < 64 << 20
    assert prefault(lambda: True) == 0
    del reserved


def test_after_a_snapshot_child_the_kernel_memory_is_as_it_was(tmp_path):
    k = RecordingKernel(
        tmp_path / "prefault.sqlite",
        ["--ThemistoRecorder.snapshot_delay=0", "--ThemistoRecorder.small_snapshot_seconds=0"],
    )
    recorder = "__import__('jupyter_themisto.kernel', fromlist=['x']).get_recorder()"
    try:
        k.run(
            "import numpy as np, psutil\n"
            "data = np.arange(8_000_000, dtype=np.int64)\n"  # 64 MB, written
            "reserved = np.empty(512 << 20, dtype=np.uint8)"  # 512 MB, never written
        )
        k.settle()
        deadline = time.monotonic() + 120
        while not k.value(f"{recorder}.snapshots.counts.get('prefaulted', 0)"):
            assert time.monotonic() < deadline, k.value(f"{recorder}.snapshots.counts")
            time.sleep(0.1)
        rss = k.value("psutil.Process().memory_info().rss")
        assert 64 << 20 < rss < 400 << 20  # data resident; the reserved 512 MB not allocated
        assert k.value("int(data.sum())") == 8_000_000 * 7_999_999 // 2
        assert k.value("int(data[123_457])") == 123_457
    finally:
        k.shutdown()
