"""MaskStage: the batch's grammar mask, the guided path's per-step part of the grammar
engines (the grammar store, guided_process.py ``GuidedDecodingManager``, compiles and
hands out matchers; this fills and applies their masks).

One token bitmask serves the batch (``[max_batch_size, ceil(vocab / 32)]`` int32, allocated
once; row i masks logits row i). Each step the engine's logits processor
(worker/engine/logits_process.py) asks it to:

- ``fill_bitmask``: the guided rows' masks, each backend's rows by its library's batch fill
  (xgrammar's ``BatchGrammarMatcher``, llguidance's parallel fill) on ``fill_threads``
  threads, while the forward runs (both libraries release the GIL);
- ``allowed`` / ``allow``: read and set one bit (stop ids where the grammar may end);
- ``ban_utf8``: clear the bytes UTF-8 forbids after a row's unfinished character;
- ``apply_bitmask``: mask the logits in place (a kernel on a GPU);
- ``best_allowed``: the rare row whose logits were all -inf or NaN.

It knows no engine and no compile: the backends are looked up by name through the store
(``backend``), and the closing search's vocabulary tables (``closer``) are the store's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import xgrammar as xgr

from worker.guided.bitmask import apply_token_bitmask_inplace
from worker.guided.closing import NEXT_BYTE

if TYPE_CHECKING:
    from worker.guided.backend import GrammarBackend, GrammarMatcher
    from worker.guided.closing import CompletionSearch


class MaskStage:
    """The batch's token bitmask and what a step does with it (see the module doc)."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int], max_batch_size: int, *,
                 backend: Callable[[str], "GrammarBackend"],
                 closer: Callable[[], "CompletionSearch"], fill_threads: int = 1):
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # [max_batch_size, ceil(vocab / 32)] int32, reused every step (on the host: pinned
        # beside a GPU, ``bitmask`` replaced by its pinned copy)
        self.bitmask = xgr.allocate_token_bitmask(max_batch_size, vocab_size)
        self.fill_threads = max(1, fill_threads)
        self._backend = backend
        self._closer = closer
        self._utf8_bans: dict[bytes, torch.Tensor] = {}
        self._utf8_words: dict[int, tuple] = {}  # id(bans) -> (word index, bits to keep)

    @property
    def bitmask(self) -> torch.Tensor:
        return self._bitmask

    @bitmask.setter
    def bitmask(self, tensor: torch.Tensor) -> None:
        self._bitmask = tensor
        # the same memory as numpy words: one bit read or set costs an index, not a
        # tensor's (the step reads one a guided row: ``allowed`` in the sampler's guard)
        self._words = tensor.numpy().view(np.uint32)

    def fill_bitmask(self, rows: list[int], matchers: list["GrammarMatcher"]) -> None:
        """Fills bitmask row ``rows[i]`` for ``matchers[i]``; every other row up to the
        largest one is reset to all-allowed, so unguided rows stay untouched by apply.
        Rows are grouped per backend, each filled by its backend's batch fill
        (``GrammarBackend.fill_rows``, on ``fill_threads`` threads) into the same bitmask."""
        n = max(rows) + 1
        if len(rows) != n:
            self.bitmask[:n].fill_(-1)
        groups: dict[str, tuple[list[int], list]] = {}
        for row, m in zip(rows, matchers):
            group = groups.setdefault(m.engine, ([], []))
            group[0].append(row)
            group[1].append(m)
        for name, (group_rows, group) in groups.items():
            self._backend(name).fill_rows(self.bitmask, group_rows, group, self.fill_threads)

    def apply_bitmask(self, logits: torch.Tensor, num_rows: int) -> None:
        """Masks logits[:num_rows] in place with bitmask[:num_rows]."""
        apply_token_bitmask_inplace(logits[:num_rows], self.bitmask[:num_rows])

    def allowed(self, row: int, token: int) -> bool:
        """Whether bitmask row ``row`` allows ``token``."""
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self._words[row, token >> 5]) >> (token & 31)) & 1)

    def allow(self, row: int, token: int) -> None:
        """Sets ``token``'s bit in bitmask row ``row``."""
        if 0 <= token < self.vocab_size:
            self._words[row, token >> 5] |= np.uint32(1 << (token & 31))

    def best_allowed(self, row: int, logits_row: torch.Tensor) -> int:
        """The allowed token of bitmask row ``row`` with the largest logit (NaN counts as
        -inf); the first allowed token when none is finite."""
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((self.bitmask[row].unsqueeze(-1) >> shifts) & 1).flatten()[:self.vocab_size]
        allowed = bits.bool()
        if not allowed.any():
            raise RuntimeError("the grammar allows no token here")
        # on the host (the bitmask is there): a rare path, one row
        scores = torch.nan_to_num(logits_row[:self.vocab_size].float().cpu(), nan=float("-inf"))
        scores = scores.masked_fill(~allowed, float("-inf"))
        if torch.isfinite(scores).any():
            return int(scores.argmax())
        return int(allowed.nonzero()[0])

    def only_stop_allowed(self, matcher) -> bool:
        """Whether ``matcher`` allows nothing but a stop token next (its output is
        complete and cannot grow)."""
        mask = self._closer()._mask
        matcher.fill_bitmask(mask)
        bits = sum(bin(w & 0xFFFFFFFF).count("1") for w in mask[0].tolist())
        stops = sum(1 for t in self.stop_token_ids
                    if (int(mask[0, t >> 5]) >> (t & 31)) & 1)
        return bits == stops

    def utf8_bans(self, output_ids: list[int]) -> torch.Tensor | None:
        """Token ids that would continue the output's unfinished character with a byte
        UTF-8 forbids there, or None. xgrammar accepts any continuation byte after a lead
        byte, but E0 80 is overlong, ED A0 a surrogate, F0 80 and F4 90 out of range: the
        text would carry U+FFFD where the grammar counted one character."""
        if not output_ids:
            return None
        closer = self._closer()
        pending = closer.pending_bytes(output_ids)
        if pending not in NEXT_BYTE:
            return None
        bans = self._utf8_bans.get(pending)
        if bans is None:
            lo, hi = NEXT_BYTE[pending]
            bans = self._utf8_bans[pending] = torch.tensor(
                [t for t, raw in enumerate(closer.vocab)
                 if raw and 0x80 <= raw[0] <= 0xBF and not lo <= raw[0] <= hi],
                dtype=torch.long)
        return bans

    def ban_utf8(self, row: int, output_ids: list[int]) -> None:
        """Clears the tokens ``utf8_bans`` names in bitmask row ``row``, on the host: the
        row's mask crosses to the device with them (no launch per row on a GPU)."""
        bans = self.utf8_bans(output_ids)
        if bans is None:
            return
        key = id(bans)
        words = self._utf8_words.get(key)
        if words is None:
            bits: dict[int, int] = {}
            for t in bans.tolist():
                bits[t >> 5] = bits.get(t >> 5, 0) | (1 << (t & 31))
            words = self._utf8_words[key] = (
                np.array(list(bits), dtype=np.int64),
                np.array([~b & 0xFFFFFFFF for b in bits.values()], dtype=np.uint32))
        index, keep = words
        self._words[row, index] &= keep
