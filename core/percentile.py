"""percentile: the one percentile helper of the tree (the cache's compile times, a front
end's failover pauses, the load tool, the benches)."""

from __future__ import annotations

import math
from typing import Iterable, TypeVar

D = TypeVar("D")


def percentile(values: Iterable[float], p: float, default: D = None) -> float | D:
    """The ``p``-th percentile (0-100) of ``values``, interpolated linearly between the two
    closest ranks (numpy's default, ``statistics.quantiles(method="inclusive")``):
    ``xs = sorted(values); k = (len(xs) - 1) * p / 100`` gives
    ``xs[floor(k)] + (xs[ceil(k)] - xs[floor(k)]) * (k - floor(k))``. ``p`` is clamped to
    [0, 100]; ``default`` when there are no values."""
    xs = sorted(values)
    if not xs:
        return default
    k = (len(xs) - 1) * min(max(p, 0.0), 100.0) / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
