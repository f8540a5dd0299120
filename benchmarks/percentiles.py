"""The percentile the benchmark scripts print (one definition for all of them)."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (0.9: the 90th percentile), interpolated within the values
    measured: `statistics.quantiles`' default method extrapolates past the largest of a few.
    NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]
