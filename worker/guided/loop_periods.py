"""The loop guard's repetition counts (worker/guided/loop_guard.py), per period, as arrays.

For every period p from 1 to ``max_period`` the guard needs ``run[p]``: how many tokens in
a row equal the token p places before them (over token ids, and again over token shapes
for progressions). Kept as numpy arrays, a token costs a fixed number of array operations
whatever ``max_period`` (at most 256 entries each), and the periods that may hold a loop
are picked by array tests too, so the guard's Python work per token does not grow with
``max_period``, nor with how many periods repeat at once (a string of digits repeats in
shape at every period).

    PeriodRuns.push(label)   run[p] = run[p] + 1 where window[p] == label, else 0
    window[p]                the label p places before the newest (NONE: before the floor)

(one row per kind of label: token ids, and token shapes for progressions)
"""

from __future__ import annotations

import numpy as np

NONE = np.iinfo(np.int64).min  # a label no token has: before the floor (the last cut)


class PeriodRuns:
    """``run`` and ``window`` over ``rows`` kinds of integer labels at once (token ids, and
    their shapes); index p - 1 is period p."""

    __slots__ = ("periods", "window", "run", "_labels")

    def __init__(self, max_period: int, rows: int = 1):
        self.periods = np.arange(1, max_period + 1, dtype=np.int64)  # [P]: p per index
        self.window = np.full((rows, max_period), NONE, dtype=np.int64)  # [rows, P]
        self.run = np.zeros((rows, max_period), dtype=np.int64)  # [rows, P]
        self._labels = np.zeros((rows, 1), dtype=np.int64)  # [rows, 1]: the newest token's

    def push(self, *labels: int) -> None:
        """One more token, of ``labels`` (one per row)."""
        lab = self._labels
        for k, label in enumerate(labels):
            lab[k, 0] = label
        run, window = self.run, self.window
        run += 1
        run *= window == lab
        window[:, 1:] = window[:, :-1]  # (numpy copies overlapping slices correctly)
        window[:, :1] = lab

    def reset(self) -> None:
        """Nothing before here counts (a cut)."""
        self.window.fill(NONE)
        self.run.fill(0)


class Prefix:
    """A growing int64 sequence (the output's bytes before each token) that is also an
    array, for lookups at many positions at once; ``truncate`` keeps the first n."""

    __slots__ = ("array", "size")

    def __init__(self, first: int = 0):
        self.array = np.zeros(64, dtype=np.int64)
        self.array[0] = first
        self.size = 1

    def append(self, value: int) -> None:
        if self.size == len(self.array):
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self.array[self.size] = value
        self.size += 1

    def truncate(self, n: int) -> None:
        self.size = n

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.array[positions]
