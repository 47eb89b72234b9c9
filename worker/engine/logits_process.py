"""FusedLogitsProcessor: one step's logits processing for the whole sampling batch.

    proc = FusedLogitsProcessor(inputs, mask)   # mask: the grammar store's MaskStage
    proc.prepare()            # before the forward: starts filling the batch bitmask on a
                              # worker thread, each masked row through its request's matcher
    logits = model(...)       # the fill runs meanwhile (xgrammar releases the GIL)
    sampler(logits, rows, proc)   # proc(logits): penalties, join the fill, mask in place
                                  # (and no byte UTF-8 forbids mid-character), NaN -> -inf;
                                  # proc.guard(tokens): never a masked token
    proc.accept_token(tokens)     # advances each guided row's matcher

One bitmask tensor serves the batch (the mask stage's, worker/guided/mask_stage.py,
allocated once); bitmask row i is
logits row i, so nothing is re-sorted; unguided rows are left untouched.

Everything that can go wrong is per row: a token the matcher refuses fails its row alone
(REJECTED; GRAMMAR_TOO_LARGE for a matcher over its limits) and touches no other row of
the batch.

Stop token ids on a guided row: they are allowed (unmasked) exactly where the grammar may
end, i.e. where the row's mask allows an EOS token, and end the row there like EOS; where
the grammar may not end they are ordinary tokens (allowed only if the grammar allows them).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from core.errors import ErrorKind
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
    """After accept_token: the matcher finished (terminated: EOS accepted), the row
    sampled one of its stop token ids where its grammar may end (stop), or the row
    failed (error, error_kind)."""

    terminated: bool = False
    stop: bool = False
    error: str | None = None
    error_kind: ErrorKind | None = None


class FusedLogitsProcessor:
    def __init__(self, inputs: SamplingInputs, mask=None):
        self.inputs = inputs
        self.mask = mask  # MaskStage (None: no grammar engine)
        self.timings = StepTimings()
        self._rows: list[int] = []
        self._matchers: list = []
        self._may_end: dict[int, bool] = {}  # rows with stop ids: may the grammar end here
        self._fill: Future | None = None

    def prepare(self) -> None:
        """Starts the bitmask fill of the masked rows (those with a matcher) on the fill
        thread."""
        if self.mask is None:
            return
        for i, matcher in enumerate(self.inputs.row_matchers):
            if matcher is not None:
                self._rows.append(i)
                self._matchers.append(matcher)
        self.timings.guided_rows = len(self._rows)
        if self._rows:
            self._fill = _fill_pool.submit(self._fill_bitmask)

    def _fill_bitmask(self) -> None:
        t = time.perf_counter()
        self.mask.fill_bitmask(self._rows, self._matchers)
        self.timings.fill_us = (time.perf_counter() - t) * 1e6

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        apply_penalties(logits, self.inputs.rows)
        # a NaN must never win an argmax (it would pick whatever token holds it): NaN is
        # "not allowed", +inf the largest finite logit
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
        if self._fill is not None:
            t = time.perf_counter()
            self._fill.result()
            t1 = time.perf_counter()
            self._allow_stop_ids()
            self._ban_invalid_utf8()
            self.mask.apply_bitmask(logits, max(self._rows) + 1)
            self.timings.fill_wait_us = (t1 - t) * 1e6
            self.timings.apply_us = (time.perf_counter() - t1) * 1e6
        return logits

    def _ban_invalid_utf8(self) -> None:
        """Rows in the middle of a character: no byte UTF-8 forbids there (the grammar's
        mask allows any continuation byte; see MaskStage.utf8_bans), cleared in
        the host bitmask before it is applied."""
        for row in self._rows:
            self.mask.ban_utf8(row, self.inputs.rows[row].output_ids)

    def _allow_stop_ids(self) -> None:
        """Unmasks each guided row's stop token ids where its grammar may end."""
        mgr = self.mask
        for row in self._rows:
            stop_ids = self.inputs.rows[row].params.stop_token_ids
            if not stop_ids:
                continue
            may_end = any(mgr.allowed(row, t) for t in mgr.stop_token_ids)
            self._may_end[row] = may_end
            if may_end:
                for t in stop_ids:
                    mgr.allow(row, t)

    def guard(self, tokens: list[int], logits: torch.Tensor) -> list[int]:
        """Replaces a sampled token that the row's mask forbids (only possible when a
        row's logits were all -inf or NaN) with the row's best allowed token."""
        for row in self._rows:
            if not self.mask.allowed(row, tokens[row]):
                tokens[row] = self.mask.best_allowed(row, logits[row])
        return tokens

    def accept_token(self, tokens: list[int], skip=()) -> dict[int, RowStatus]:
        """Advances the guided rows' matchers (but the rows in ``skip``: ended since they
        sampled); returns the rows whose matcher terminated, that ended on a stop token
        id, or that failed (a rejected token: impossible under the mask, or a matcher over
        its limits)."""
        out: dict[int, RowStatus] = {}
        t = time.perf_counter()
        for row, matcher in zip(self._rows, self._matchers):
            if row in skip:
                continue
            token = tokens[row]
            if self._may_end.get(row) and token in self.inputs.rows[row].params.stop_token_ids:
                out[row] = RowStatus(stop=True)  # a stop id where the grammar may end
            elif not matcher.accept_token(token):
                failure = matcher.failure()  # a matcher over its limits, not a bug
                out[row] = RowStatus(
                    error=failure or f"the grammar rejected token {token}",
                    error_kind=ErrorKind.GRAMMAR_TOO_LARGE if failure else ErrorKind.REJECTED)
            elif matcher.is_terminated():
                out[row] = RowStatus(terminated=True)
        self.timings.accept_us = (time.perf_counter() - t) * 1e6
        return out
