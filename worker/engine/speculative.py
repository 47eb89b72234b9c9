"""Speculative decoding's drafts: prompt lookup, cut where the grammar refuses, sized by
how well a row's drafts have fared.

A decoding row's draft is what followed, earlier in its own prompt and output, the
longest recent n-gram its context ends with (prompt-lookup decoding): structured
extraction copies names, dates and phrases from the document in the prompt, and a looping
model repeats itself, so the lookup is often right. The engine (engine.py, "Speculation")
computes the draft's tokens in the row's forward beside its pending token, then draws each
position's token exactly as a plain step would, in order, keeping the draft's KV for as
long as the drawn tokens equal it; the first token that differs ends the row's step. So a
draft changes how many forwards a request takes, never which tokens it gets: greedy and
seeded outputs are token for token those without drafts, and every guided feature (closing,
the loop guard, jump-forward, stop strings) sees the tokens one at a time as before.

Here: the n-gram index of each row (``Lookup``: built once over the prompt, then one
entry per n-gram size a token), the grammar's cut of a draft (a draft is walked on the
row's matcher and rolled back, so text the grammar refuses is never computed), and each
draft's length, from what a draft token costs and how likely it is to be kept:

- a forward's time is fitted as ``a + b * tokens`` over recent steps without a prompt's
  prefill (``StepCost``; a prompt's long chunks cost less a token). A token drawn one a
  step costs the batch ``a / rows + b``; a draft token costs ``b`` whether kept or not.
  On a GPU at small batches ``b`` is next to nothing and drafts pay almost always; on a
  CPU, whose matmuls are bound by compute (the default model on 2 cores: a = 38 ms,
  b = 3.7 ms), a batch of 8 rows pays for a draft token only when it is kept about half
  the time, a batch of 1 when it is kept one time in ten.
- a draft token is kept with a probability ``p`` learned from recent drafts (the chance
  that a draft token is kept given the one before it was): the lower of the row's own
  rate and the rate of all rows' drafts found by an n-gram as long. The i-th draft token
  is worth computing while ``p ** i * (a / rows + b) > b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# n-gram sizes looked up, longest first: a longer match predicts better
MAX_NGRAM = 3
MIN_NGRAM = 1
# a row's draft-token keep rate: a prior of one kept in two, then recent drafts count
# most (each older one DECAY times less)
DECAY = 0.8
# ... and the keep rate of drafts by the length of the n-gram that found them, all rows
ORDER_DECAY = 0.98
# the forward time's fit: each older step counts FIT_DECAY times less; until FIT_STEPS
# steps of different sizes were seen, drafts are as long as allowed (b taken as 0)
FIT_DECAY = 0.98
FIT_STEPS = 8


@dataclass
class Lookup:
    """A row's n-gram index: for each size n, the n-gram ending at each position maps to
    the position after it (the most recent occurrence wins). Entries past a rollback stay
    and are checked when read."""

    ngrams: dict = field(default_factory=dict)  # (n, tokens) -> position after it
    indexed: int = 0  # positions below this are indexed
    kept: float = 0.0  # recent draft tokens kept (decayed)
    tried: float = 0.0  # recent draft tokens whose keeping was decided (decayed)
    matched: int = 0  # the n-gram length the last draft was found by

    @property
    def keep_rate(self) -> float:
        """The chance a draft token is kept given the one before it was."""
        return (self.kept + 1) / (self.tried + 2)

    def index(self, tokens: list[int]) -> None:
        """Indexes the n-grams that end before the last token (the last one's follower is
        not known yet)."""
        end = len(tokens) - 1
        start = min(self.indexed, end)
        ngrams = self.ngrams
        for pos in range(max(start, MIN_NGRAM), end + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, pos) + 1):
                ngrams[(n, tuple(tokens[pos - n:pos]))] = pos
        self.indexed = end + 1

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram the tokens end with, at its
        most recent earlier occurrence."""
        last = len(tokens)
        for n in range(min(MAX_NGRAM, last - 1), MIN_NGRAM - 1, -1):
            suffix = tuple(tokens[last - n:])
            pos = self.ngrams.get((n, suffix))
            # the suffix itself is not indexed yet; an entry a rollback made stale is skipped
            if pos is None or pos >= last or tuple(tokens[pos - n:pos]) != suffix:
                continue
            self.matched = n
            return tokens[pos:pos + k]
        return []


class StepCost:
    """A forward's seconds as ``a + b * tokens``, a least-squares fit over recent steps
    (decayed sums: a handful of floats)."""

    def __init__(self):
        self.n = self.t = self.y = self.tt = self.ty = 0.0
        self.a, self.b = 0.0, 0.0
        self.fitted = False

    def add(self, tokens: int, seconds: float) -> None:
        d = FIT_DECAY
        self.n = d * self.n + 1
        self.t = d * self.t + tokens
        self.y = d * self.y + seconds
        self.tt = d * self.tt + tokens * tokens
        self.ty = d * self.ty + tokens * seconds
        var = self.tt / self.n - (self.t / self.n) ** 2
        if self.n < FIT_STEPS or var < 0.25:  # too few steps, or all of one size
            return
        b = (self.ty / self.n - self.t * self.y / self.n ** 2) / var
        self.b = max(b, 0.0)
        self.a = max(self.y / self.n - self.b * self.t / self.n, 0.0)
        self.fitted = True


class Drafter:
    """Proposes each decoding row's draft and learns from how it fared."""

    def __init__(self, max_tokens: int, stop_ids: set[int]):
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.rows: dict[str, Lookup] = {}
        self.cost = StepCost()
        # per n-gram length: recent draft tokens kept and decided, all rows (decayed)
        self.by_order: dict[int, tuple[float, float]] = {}
        # counters (the engine's stats): drafts proposed, their tokens, tokens accepted
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def keep_rate(self, row: Lookup, n: int) -> float:
        """How likely a draft token found by an n-gram of ``n`` is kept on ``row``: the
        lower of the row's own rate and the rate of drafts found by n-grams that long
        (a 1-token match predicts far worse than a 3-token one: 0.15-0.28 against
        0.42-0.65 a token on the default model's extraction, JSON and prose)."""
        kept, tried = self.by_order.get(n, (0.0, 0.0))
        return min(row.keep_rate, (kept + 1) / (tried + 2))

    def length(self, row: Lookup, batch: int, p: float | None = None) -> int:
        """The draft length worth computing for ``row`` in a batch of ``batch`` rows, its
        tokens kept at the rate ``p`` (None: the row's own)."""
        if not self.cost.fitted or self.cost.b <= 0:
            return self.max_tokens
        worth = self.cost.a / batch + self.cost.b  # a token drawn one a step
        p = row.keep_rate if p is None else p
        if p * worth <= self.cost.b:
            return 0
        if p >= 1:
            return self.max_tokens
        return min(self.max_tokens, int(math.log(self.cost.b / worth) / math.log(p)))

    def propose(self, seq, room: int, batch: int = 1) -> list[int]:
        """The draft for ``seq`` (a row whose pending tokens all run this step), at most
        ``room`` tokens, cut before an end-of-sequence token and at the first token its
        grammar refuses; ``batch``: the rows that sample this step."""
        row = self.rows.get(seq.request_id)
        if row is None:
            row = self.rows[seq.request_id] = Lookup()
        k = min(self.length(row, batch), room)
        if k <= 0:
            return []
        tokens = seq.token_ids
        row.index(tokens)
        draft = row.propose(tokens, k)
        if draft:  # as long as its n-gram's keep rate makes it worth
            draft = draft[:self.length(row, batch, self.keep_rate(row, row.matched))]
        for i, t in enumerate(draft):
            if t in self.stop_ids:
                draft = draft[:i]
                break
        matcher = seq.guide.mask_matcher if seq.guide is not None else None
        if draft and matcher is not None:
            draft = draft[:_allowed_prefix(matcher, draft)]
        return draft

    def expected(self, seq, batch: int) -> float:
        """The draft tokens ``seq`` is expected to keep if it drafted now (its lookup and
        keep rates, not its grammar: the overlapped step's question whether to draft)."""
        row = self.rows.get(seq.request_id)
        if row is None:
            row = self.rows[seq.request_id] = Lookup()
        k = self.length(row, batch)
        if k <= 0:
            return 0.0
        row.index(seq.token_ids)
        draft = row.propose(seq.token_ids, k)
        if not draft:
            return 0.0
        p = self.keep_rate(row, row.matched)
        k = min(len(draft), self.length(row, batch, p))
        return k if p >= 1 else p * (1 - p ** k) / (1 - p)  # p + p^2 + ... + p^k

    def settle(self, request_id: str, proposed: int, accepted: int) -> None:
        """A row's draft of ``proposed`` tokens had ``accepted`` of them drawn."""
        row = self.rows.get(request_id)
        if row is None or not proposed:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        decided = accepted + (accepted < proposed)
        row.kept = DECAY * row.kept + accepted
        row.tried = DECAY * row.tried + decided
        kept, tried = self.by_order.get(row.matched, (0.0, 0.0))
        self.by_order[row.matched] = (ORDER_DECAY * kept + accepted,
                                      ORDER_DECAY * tried + decided)

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)


def _allowed_prefix(matcher, draft: list[int]) -> int:
    """How many of the draft's first tokens the grammar accepts in turn, walked on the
    row's own matcher and rolled back (it is where the row's next token will be drawn)."""
    n = 0
    try:
        for t in draft:
            if not matcher.accept_token(t):
                break
            n += 1
    finally:
        if n:
            matcher.rollback(n)
    return n
