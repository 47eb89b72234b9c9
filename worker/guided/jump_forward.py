"""Jump-forward decoding: text the grammar forces costs no decode step.

After a guided row's sampled token is accepted, its matcher may allow exactly one
continuation (``find_jump_forward_string``: the rest of a key, ``", "``, the
``<tool_call>{"name": "`` wrapper). ``JumpForward.extend`` appends that text's tokens to
the row at once; their KV is computed in the next step as a short chunk of the row
(pending tokens, as the closing paths and the loop guard's closers already are), and the
row samples again after them. So a key of five tokens costs one step, not five.

    jump = jumper.extend(matcher, last_token, budget)   # matcher has accepted last_token
    # jump.tokens: what replaces last_token (jump.replaces_last) or follows it; every one
    # accepted by the matcher

The boundary, so that the output is tokenized as the model would write it:

- the last sampled token and the forced text are tokenized together; where that splits
  differently (``{`` sampled, ``"name": "`` forced: ``{"`` ``name`` ``":`` `` "``) the
  sampled token, whose KV is not computed yet, is replaced (matcher rolled back one);
- the last forced token is held back when the grammar also allows a longer token that
  begins with it (`` "`` before a string value: `` "$``, `` "B`` ...; the space of
  ``": `` before a number: `` 1``): the model, not the tokenizer, chooses that split;
- every token is accepted by the matcher, and the jump stops at the first one refused; it
  never goes past ``budget`` (the tokens the request may still generate).

Forced tokens carry no logprob (None: rendered as 0.0 with no alternatives, as closing's).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


_MERGE_TRIES = 16  # longer tokens _may_merge tries one by one before it fills a mask


@dataclass
class Jump:
    """Forced tokens, already accepted by the matcher. ``replaces_last``: they replace the
    row's last (sampled) token instead of following it."""

    tokens: list[int]
    replaces_last: bool = False

    @property
    def added(self) -> int:
        """Output tokens this jump adds to the row."""
        return len(self.tokens) - self.replaces_last


@dataclass
class JumpStats:
    """Counters of jump-forward decoding (exported through EngineStats)."""

    jump_forward_tokens: int = 0  # output tokens appended without a decode step
    jump_forward_jumps: int = 0  # steps whose row jumped
    jump_forward_retokenized: int = 0  # ... replacing the sampled token (boundary split)
    jump_forward_held_back: int = 0  # trailing forced tokens left for the model to write

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class JumpForward:
    """Finds and applies forced continuations. ``vocab``: bytes per token id;
    ``encode``: text -> token ids (no special tokens)."""

    vocab: list[bytes]
    encode: Callable[[str], list[int]]
    # when the last forced token is held back: "mask" (the grammar allows a longer token
    # that begins with it), "space" (it ends in whitespace), "never" (bench comparisons)
    hold_back: str = "mask"
    stats: JumpStats = field(default_factory=JumpStats)

    def __post_init__(self):
        self._sorted: list[tuple[bytes, int]] | None = None  # vocab by bytes (first use)
        self._sorted_ids: np.ndarray | None = None  # ... its ids and lengths in that order
        self._sorted_lens: np.ndarray | None = None
        self._longer: dict[int, np.ndarray] = {}  # token -> ids that begin with it, longer
        self._mask: torch.Tensor | None = None  # one bitmask row, [1, ceil(V / 32)] int32

    def extend(self, matcher, last: int, budget: int) -> Jump | None:
        """The forced continuation after ``last`` (just accepted by ``matcher``), applied
        to the matcher; None when there is none (or the budget is spent)."""
        if budget <= 0:
            return None
        forced_text = matcher.find_jump_forward_string()
        if not forced_text:
            return None
        try:
            forced = forced_text.encode("utf-8")
        except UnicodeEncodeError:
            return None
        split = self._split(self.vocab[last], forced)
        if split is None:
            return None
        tokens, replaces = split
        tokens = tokens[:budget + replaces]
        if replaces:
            matcher.rollback(1)
        accepted: list[int] = []
        for i, t in enumerate(tokens):
            last_of_forced = i == len(tokens) - 1 and len(tokens) == len(split[0])
            if last_of_forced and self._may_merge(matcher, t):
                self.stats.jump_forward_held_back += 1
                break
            if not matcher.accept_token(t):
                break
            accepted.append(t)
        if replaces and not accepted:  # nothing replaces the sampled token: keep it
            matcher.accept_token(last)
            return None
        jump = Jump(accepted, replaces)
        if jump.added <= 0 and not replaces:
            return None
        self.stats.jump_forward_jumps += 1
        self.stats.jump_forward_tokens += max(jump.added, 0)
        self.stats.jump_forward_retokenized += replaces
        return jump

    def _split(self, last: bytes, forced: bytes) -> tuple[list[int], bool] | None:
        """The forced bytes as tokens: the sampled token's bytes and the forced ones
        tokenized together when that round-trips (and replaces the sampled token where the
        split differs), else the forced bytes alone; None when neither round-trips (a
        tokenizer that adds a prefix space, an unfinished character)."""
        try:
            ids = self.encode((last + forced).decode("utf-8"))
        except UnicodeDecodeError:
            ids = None
        if ids and self._bytes(ids) == last + forced:
            if self.vocab[ids[0]] == last:
                return (ids[1:], False) if len(ids) > 1 else None
            return ids, True
        try:
            ids = self.encode(forced.decode("utf-8"))
        except UnicodeDecodeError:
            return None
        if ids and self._bytes(ids) == forced:
            return ids, False
        return None

    def _bytes(self, ids: list[int]) -> bytes:
        vocab = self.vocab
        return b"".join(vocab[t] if 0 <= t < len(vocab) else b"\x00?" for t in ids)

    def _may_merge(self, matcher, token: int) -> bool:
        """Whether the grammar, where ``token`` comes next, also allows a longer token
        that begins with ``token``'s bytes (the model may write the two as one)."""
        if self.hold_back == "never":
            return False
        if self.hold_back == "space":
            return self.vocab[token][-1:].isspace()
        longer = self._longer_than(token)
        if longer.size == 0:
            return False
        # a few candidates tried first (microseconds each): inside a string nearly any
        # of them is allowed; a whole-vocabulary mask only where none of them is
        for candidate in longer[:_MERGE_TRIES].tolist():
            if matcher.allows(candidate):
                return True
        if longer.size <= _MERGE_TRIES:
            return False
        if self._mask is None:
            self._mask = torch.zeros((1, (len(self.vocab) + 31) // 32), dtype=torch.int32)
            self._words = self._mask.numpy()[0]  # the same memory: host-side reads
        matcher.fill_next_token_bitmask(self._mask)
        # numpy, not torch: a few small operations a forced token, on every guided row
        return bool(((self._words[longer >> 5] >> (longer & 31)) & 1).any())

    def prepare(self) -> None:
        """The vocabulary sorted by bytes, with its ids and lengths in that order as
        arrays (``_longer_than`` reads them), built once."""
        if self._sorted is None:  # (published last: GuidedPath.prepare builds it on a
            # thread while the engine's first request may read it)
            ordered = sorted((b, i) for i, b in enumerate(self.vocab) if b)
            self._sorted_ids = np.array([i for _, i in ordered], dtype=np.int64)
            self._sorted_lens = np.array([len(b) for b, _ in ordered], dtype=np.int64)
            self._sorted = ordered

    def _longer_than(self, token: int) -> np.ndarray:
        """The ids of the tokens that begin with ``token``'s bytes and are longer, in
        the order of their bytes. They are one run of the sorted vocabulary, found by two
        bisections and cut out as arrays: a token such as a space or a quote begins
        thousands of others, and walking them took milliseconds at a forced token's first
        merge check (the longest step of bench/guided_host.py's batch of 64)."""
        got = self._longer.get(token)
        if got is None:
            self.prepare()
            head = self.vocab[token]
            got = np.zeros(0, dtype=np.int64)
            if head:
                start = bisect.bisect_left(self._sorted, (head, -1))
                after = _past_prefix(head)
                end = (len(self._sorted) if after is None
                       else bisect.bisect_left(self._sorted, (after, -1)))
                longer = self._sorted_lens[start:end] > len(head)
                got = self._sorted_ids[start:end][longer]
            self._longer[token] = got
        return got


def _past_prefix(head: bytes) -> bytes | None:
    """The least bytes that sort after every bytes beginning with ``head`` (None: there
    are none, ``head`` being all 0xff)."""
    stem = head.rstrip(b"\xff")
    if not stem:
        return None
    return stem[:-1] + bytes([stem[-1] + 1])
