"""FusedLogitsProcessor: one step's logits processing for the whole sampling batch.

    proc = FusedLogitsProcessor(inputs, manager)
    proc.prepare()            # before the forward: releases ended sessions, starts filling
                              # the batch bitmask for the guided rows on a worker thread
    logits = model(...)       # the fill runs meanwhile (xgrammar releases the GIL)
    sampler(logits, rows, proc)   # proc(logits): penalties, join the fill, mask in place
    proc.accept_token(tokens)     # advances each guided row's matcher

One bitmask tensor serves the batch (the manager's, allocated once); bitmask row i is
logits row i, so nothing is re-sorted; unguided rows are left untouched.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker.engine.sampling import SamplingInputs, apply_penalties

_fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask-fill")


@dataclass
class StepTimings:
    fill_us: float = 0.0  # time the fill took on its thread
    fill_wait_us: float = 0.0  # time the step waited for it after the forward
    apply_us: float = 0.0
    accept_us: float = 0.0
    guided_rows: int = 0


@dataclass
class RowStatus:
    """After accept_token: the matcher finished (terminated), or rejected the token."""

    terminated: bool = False
    error: str | None = None


class FusedLogitsProcessor:
    def __init__(self, inputs: SamplingInputs, manager=None):
        self.inputs = inputs
        self.manager = manager
        self.timings = StepTimings()
        self._rows: list[int] = []
        self._matchers: list = []
        self._fill: Future | None = None

    def prepare(self) -> None:
        manager = self.manager
        if manager is None:
            return
        if self.inputs.session_to_cleanup:
            manager.remove_sessions(self.inputs.session_to_cleanup)
        for i, key in enumerate(self.inputs.session_ctx):
            if key is not None:
                self._rows.append(i)
                self._matchers.append(manager.processors[key])
        self.timings.guided_rows = len(self._rows)
        if self._rows:
            self._fill = _fill_pool.submit(self._fill_bitmask)

    def _fill_bitmask(self) -> None:
        t = time.perf_counter()
        self.manager.fill_bitmask(self._rows, self._matchers)
        self.timings.fill_us = (time.perf_counter() - t) * 1e6

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        apply_penalties(logits, self.inputs.rows)
        if self._fill is not None:
            t = time.perf_counter()
            self._fill.result()
            t1 = time.perf_counter()
            self.manager.apply_bitmask(logits, max(self._rows) + 1)
            self.timings.fill_wait_us = (t1 - t) * 1e6
            self.timings.apply_us = (time.perf_counter() - t1) * 1e6
        return logits

    def accept_token(self, tokens: list[int]) -> dict[int, RowStatus]:
        """Advances the guided rows' matchers; returns the rows whose matcher terminated
        or rejected its token (rejection should be impossible under the mask)."""
        out: dict[int, RowStatus] = {}
        t = time.perf_counter()
        for row, matcher in zip(self._rows, self._matchers):
            token = tokens[row]
            if not matcher.accept_token(token):
                out[row] = RowStatus(error=f"the grammar rejected token {token}")
            elif matcher.is_terminated():
                out[row] = RowStatus(terminated=True)
        self.timings.accept_us = (time.perf_counter() - t) * 1e6
        return out
