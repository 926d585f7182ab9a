"""The one percentile definition every report and benchmark of the project uses.

Nearest rank (the smallest value such that at least q% of the samples are at or below it):
it always returns an observed sample, never an interpolation between two, so a p99 is a
latency that really happened and numbers from different reports compare directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank `q`-th percentile (`q` in [0, 100]) of `values`; NaN when there are none."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


__all__ = ["percentile"]
