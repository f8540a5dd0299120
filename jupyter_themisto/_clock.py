"""The clocks of the recorder and the store, taken when jupyter_themisto is imported.

A cell may patch the `time` module (`time.time = lambda: 0.0`, freezegun's `freeze_time`): that
changes the person's clock, not what the recorder records (`started_at`, wall and CPU times,
snapshot times) nor its own waits. Modules import this one as `time`
(`from .. import _clock as time`), so their calls read `time.time()` as before.
"""

from __future__ import annotations

import time as _time

time = _time.time
monotonic = _time.monotonic
perf_counter = _time.perf_counter
process_time = _time.process_time
sleep = _time.sleep
