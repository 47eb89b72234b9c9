"""backoff: the one exponential backoff of the tree (the worker's tokenizer registration,
the front end's scheduler calls, watch and re-routes after a worker died, the batch job's
retries)."""

from __future__ import annotations

import math
from typing import Iterator


def backoff(first: float, cap: float = math.inf, factor: float = 2.0) -> Iterator[float]:
    """The delays to sleep between attempts, forever: ``first``, ``first * factor``, ...,
    each at most ``cap``. A loop takes ``next()`` of it before each sleep and starts a new
    one where it should start over (after a success)."""
    delay = first
    while True:
        yield min(delay, cap)
        delay = min(delay * factor, cap)
