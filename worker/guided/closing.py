"""Budget-aware closing: the shortest way, in tokens, to finish what a grammar has started.

A guided request that runs out of tokens mid-output returns text its grammar does not
accept (an unclosed string, a missing required property). The engine avoids that by
measuring, near the end of the budget, how many tokens the grammar still needs, and by
emitting that completion once the budget is down to it (output_policy.py,
``OutputPolicy._maybe_close``).

The search works for every grammar kind because it only uses the matcher:

    state   = a forked GrammarMatcher (fork copies the parse state; the real one is untouched)
    goal    = matcher.is_completed()          (the grammar may end here)
    edges   = candidate tokens the mask allows, cost 1 each, plus one "jump-forward" edge:
              the string the grammar forces from here, tokenized by the real tokenizer
    search  = uniform-cost (Dijkstra) up to ``limit`` tokens and ``max_expansions`` nodes

Every search is bounded twice: by ``max_expansions`` nodes and by ``time_limit_s`` of the
searching thread's CPU time (``CLOCK``), since a mask fill that is cheap in most states is
costly deep inside free-form JSON, so a node cap alone does not bound the time. CPU time,
not wall time: the same search gets the same answer however busy the machine is (with a
wall-clock limit, a starved engine thread searched less and closed outputs differently).
The engine runs each search in slices (search_slices.py): where ``_late`` checks the
clock, a search whose slice of the step is spent is suspended until the next step, and
the time it was away does not count against its limit. A search cut short answers
"not found, not exhausted", which the output policy treats as "do not know" (it retries a
few tokens later, a few times).

Two reductions keep a search small. Candidates are the single-byte tokens, the short
structural tokens of JSON (``"}``, ``", "``, ``": ``...) and JSON's literals; where many of
one class are allowed, each is tried on one scratch matcher and rolled back
(microseconds) and one token is kept per distinct next parser state
(inside free text every letter leads to the same state; an e-mail's local part needs its
``@``). And states are merged by a key: the next-token mask, the matcher's state key
(``matcher.state_key()``, worker/guided: the forced text and how many of a few probe
characters may come in a row, which tells the places of a run such as ``[0-9a-f]{8}``
apart, on either backend: no parser internals are read), the
mask before the current run of equal masks, and (for a closing edge, where nesting
repeats mask and state at every level) the depth. That merge is a heuristic, so a found
path is always replayed on the real matcher token by token before it is emitted, and "no
path" is only ever taken as "cannot close", never as a reason to emit anything.

Order: a greedy dive first (closers first; in text, where letters may come, only a quote
closes and characters leading to new states go first), then the uniform-cost search
without blank-only tokens, then with them. ``fitting`` is what the output policy calls:
the dive, and where its answer does not fit the budget, the exact search's when shorter.

The token count is that of the path found; the path's text is also re-encoded with the
tokenizer and the shorter accepted version kept, so free text ("aaaa") is not charged one
token per character.

Why one module over 500 lines: the search, its candidate tokens and its state keys are one
algorithm; the keys come from the backends (worker/guided), the policy that calls it
from output_policy.py.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import xgrammar as xgr

from worker.guided.backend import GrammarMatcher
from worker.guided.xgrammar_backend import as_matcher

# the searches' clock: the calling thread's CPU time (see the module docstring)
CLOCK = time.thread_time

_JSON_PUNCT = set(b'{}[]",: ')
_REPEATS = 3
_CLOSERS = set(b'"}])')
_FEW_WORDS = 4  # masks with at most this many non-zero 32-bit words: try every token
_LITERALS = (b"null", b"true", b"false", b" null", b" true", b" false")


@dataclass
class Completion:
    tokens: list[int]  # the shortest completion found (empty: the grammar may end now)
    exhausted: bool  # the search saw every state within the limit (no path: none exists)


class CompletionSearch:
    """Shortest grammar completion over one tokenizer (see module doc). Not thread-safe,
    and one search at a time: searches suspended in turn each run on a ``clone``."""

    def __init__(self, tokenizer_info: "xgr.TokenizerInfo",
                 encode: Callable[[str], list[int]] | None = None, *,
                 max_expansions: int = 400, reps_per_class: int = 2,
                 time_limit_s: float = 0.1):
        self.info = tokenizer_info
        self.encode = encode
        self.max_expansions = max_expansions
        self.time_limit_s = time_limit_s
        self._deadline = float("inf")
        self._first_byte = (0x80, 0xBF)
        self.reps = reps_per_class
        vocab = self.vocab = list(tokenizer_info.decoded_vocab)  # (slow property: once)
        stop = self.stop = (set(tokenizer_info.stop_token_ids)
                            | set(tokenizer_info.special_token_ids))
        ids, classes = [], []
        for tid, raw in enumerate(vocab):
            if tid in stop or not raw:
                continue
            cls = _class_of(raw)
            if cls is None:
                continue
            ids.append(tid)
            classes.append(cls)
        # structural tokens first: they close things, so ties resolve towards closing
        order = sorted(range(len(ids)), key=lambda i: (classes[i] != 0, ids[i]))
        self.cand = torch.tensor([ids[i] for i in order], dtype=torch.long)
        self.cand_class = [classes[i] for i in order]
        self._word = self.cand >> 5
        self._bit = (self.cand & 31).to(torch.int32)
        self._mask = xgr.allocate_token_bitmask(1, tokenizer_info.vocab_size)
        self._scratch = xgr.allocate_token_bitmask(1, tokenizer_info.vocab_size)
        single = torch.tensor([t for t, raw in enumerate(vocab)
                               if len(raw) == 1 and t not in stop], dtype=torch.long)
        self._byte_word, self._byte_bit = single >> 5, (single & 31).to(torch.int32)
        letters = self.cand[[i for i, c in enumerate(self.cand_class) if c == 2]]
        self._letter_word, self._letter_bit = letters >> 5, (letters & 31).to(torch.int32)
        closers = [t for t in self.cand.tolist() if self._closing_rank([t]) == 1]
        self._closer_ids = torch.tensor(closers, dtype=torch.long)
        self._closer_word = self._closer_ids >> 5
        self._closer_bit = (self._closer_ids & 31).to(torch.int32)
        self.stats = {"searches": 0, "expansions": 0, "timeouts": 0}
        self._reps_memo: dict = {}  # per search: (mask, parser state, tokens) -> distinct
        # where a search may be suspended (search_slices.py): returns the CPU time it was
        # away, which its time limit does not count
        self._due: Callable[[], float] | None = None

    def clone(self, due: Callable[[], float] | None = None) -> "CompletionSearch":
        """A search of its own over the same vocabulary tables: its scratch masks, clock,
        memo and counters (``stats``), so searches suspended in turn (``due``) do not
        share them."""
        c = copy.copy(self)
        c._mask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        c._scratch = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        c._reps_memo, c._deadline, c._due = {}, float("inf"), due
        c.stats = dict.fromkeys(self.stats, 0)
        return c

    # the search ---------------------------------------------------------------------------

    def pending_bytes(self, token_ids: list[int]) -> bytes:
        """The unfinished UTF-8 character at the end of these tokens' bytes (b"" if none):
        what ``shortest(pending=...)`` needs to finish it with valid bytes."""
        return _unfinished_char(b"".join(self.vocab[t] for t in token_ids[-4:]))

    def shortest(self, matcher: GrammarMatcher, limit: int, *,
                 exact: bool = False, pending: bytes = b"") -> Completion:
        """The shortest completion of ``matcher``'s output within ``limit`` tokens:
        ``Completion(tokens, ...)``, or ``Completion(None, exhausted)`` when none was found
        (``exhausted``: the search covered every state it considers within the limit).
        Not ``exact``: a greedy dive (closers first) answers when it finds a completion;
        it may be a little longer than the shortest."""
        self.stats["searches"] += 1
        matcher = as_matcher(matcher, self.info.vocab_size)
        if matcher.is_completed():
            return Completion([], True)
        # xgrammar accepts any continuation byte after a lead byte; UTF-8 does not (E0 80
        # is overlong, ED A0 a surrogate): the first byte the search adds must fit
        self._first_byte = NEXT_BYTE.get(pending, (0x80, 0xBF)) if len(pending) == 1 else (
            0x80, 0xBF)
        self._deadline = CLOCK() + self.time_limit_s
        self._reps_memo = {}
        if not exact:  # a greedy dive first: milliseconds, and usually (near) the shortest
            dived = self._dive(matcher, limit)
            if dived is not None:  # re-encoded like the search's: its steps are often
                return Completion(self._compact(matcher, dived), False)  # single characters
        # then the uniform-cost search, states told apart by mask and parser state: first
        # without blank-only tokens where anything else is allowed (a JSON layout's blanks
        # multiply the states twelvefold per place and never help to close), then with them
        found = self._search(matcher, limit, "no_blanks")
        if found.tokens is None and CLOCK() < self._deadline:
            found = self._search(matcher, limit, "all")
        if found.tokens is None and found.exhausted and not matcher.has_parser_state():
            # equal keys may be different places (llguidance): the mask and the depth
            found = self._search(matcher, limit, "by_depth")
        return found

    def estimate(self, matcher: GrammarMatcher, limit: int, *, pending: bytes = b"",
                 scale: int = 1, time_limit_s: float | None = None,
                 max_expansions: int | None = None) -> list[int] | None:
        """The greedy dive alone (milliseconds): a completion, maybe longer than the
        shortest, or None. What tells the engine, before the closing window, that this
        output needs more room than the window to close. ``scale``: times the usual time
        and nodes (a dive once per grammar, from its start); ``time_limit_s`` and
        ``max_expansions`` replace them (the closing probe's: a large grammar's dive
        takes longer)."""
        matcher = as_matcher(matcher, self.info.vocab_size)
        if matcher.is_completed():
            return []
        self._first_byte = NEXT_BYTE.get(pending, (0x80, 0xBF)) if len(pending) == 1 else (
            0x80, 0xBF)
        self._deadline = CLOCK() + (
            scale * self.time_limit_s if time_limit_s is None else time_limit_s)
        self._reps_memo = {}
        nodes = (scale * self.max_expansions if max_expansions is None
                 else max_expansions) // 2
        dived = self._dive(matcher, limit, nodes)
        return None if dived is None else self._compact(matcher, dived)

    def fitting(self, matcher: GrammarMatcher, budget: int, *,
                pending: bytes = b"") -> Completion:
        """A completion for a budget of ``budget`` tokens: the dive's, and where that does
        not fit, the exact search's when it is shorter. The search counts single-character
        steps before re-encoding its answer, so it looks further than the budget (the
        caller compares the final length). ``exhausted`` is the exact search's: a
        completion that does not fit is certain only then."""
        # the dive may look further still: a path of single characters (a uuid of 36)
        # often re-encodes to far fewer tokens, and a dive is cheap
        found = self.shortest(matcher, 4 * budget + 16, pending=pending)
        if found.tokens is None or len(found.tokens) <= budget:
            return found
        exact = self.shortest(matcher, 2 * budget + 8, exact=True, pending=pending)
        if exact.tokens is not None and len(exact.tokens) < len(found.tokens):
            return exact
        return Completion(found.tokens, exact.exhausted)

    def _search(self, matcher, limit: int, mode: str) -> Completion:
        tie = itertools.count()
        by_depth = mode == "by_depth"
        pruned = False  # a blank-only edge was left out: "none found" is not "none exists"
        root = matcher.fork()
        h, row = self._fill(root)
        # a node: (cost, tie, matcher, path, masks on the path, mask before this run, mask)
        heap = [(0, next(tie), root, (), (h,), None, row)]
        seen = {self._key(root, h, (), None, 0, by_depth)}
        expansions = 0
        while heap:
            cost, _, m, path, hist, ctx, row = heapq.heappop(heap)
            if m.is_completed():
                return Completion(self._compact(matcher, list(path)), True)
            if expansions >= self.max_expansions or self._late():
                return Completion(None, False)
            expansions += 1
            self.stats["expansions"] += 1
            edges = self._edges(m, row, first=not path)
            if mode == "no_blanks":
                kept = [e for e in edges if not self._blank(e)]
                if kept and len(kept) < len(edges):
                    edges, pruned = kept, True
            for tokens in edges:
                c = cost + len(tokens)
                if c > limit:
                    continue
                if self._late():
                    break
                child = m.fork()
                if not child.accept_tokens(tokens):
                    continue
                h, child_row = self._fill(child)
                child_ctx = ctx if h == hist[-1] else hist[-1]
                # as in the dive: a closing edge keeps its depth (nesting closed level by level)
                key = self._key(child, h, hist, child_ctx, c,
                                by_depth or self._closes(m, row, child, tokens))
                if key in seen:
                    continue
                seen.add(key)
                heapq.heappush(heap, (c, next(tie), child, path + tuple(tokens), hist + (h,),
                                      child_ctx, child_row))
        # cut short by the clock, or blanks left out: not exhausted
        return Completion(None, not self._late() and not pruned)

    def _blank(self, tokens: list[int]) -> bool:
        return len(tokens) == 1 and self.vocab[tokens[0]].isspace()

    def _dive(self, matcher, limit: int, nodes: int | None = None) -> list[int] | None:
        """Depth-first, closing edges first (the forced string, then tokens made of
        closing characters, then literals and digits, then the rest), states merged by mask
        and depth, with a node cap. A completion, or None."""
        seen: set = set()
        # (half the search's nodes: a completion of 20 required keys takes 100 and more)
        budget = [self.max_expansions // 2 if nodes is None else nodes]

        def go(m, row, path, hist, ctx, states):
            if m.is_completed():
                return path
            if len(path) >= limit or budget[0] <= 0 or self._late():
                return None
            budget[0] -= 1
            text = self._in_text(row)
            if text:  # (the place, and the characters that may come next)
                states = states | {m.state_key(), self._char_state(m, row)}
            tried: set = set()
            # the closing edges first, on their own: they are what a dive takes at almost
            # every node, and listing every edge (a scratch matcher per candidate, to keep
            # one per next state) costs most of a node; the rest only if none leads on
            for edges in (self._closing_edges(m, row, text), None):
                if edges is None:
                    edges = [ts for ts in self._edges(m, row, first=not path)
                             if tuple(ts) not in tried]
                if text:  # in text, a character that leads somewhere new first: to a
                    # new set of next characters (the "@" of an address) before a new
                    # place in a run (a bounded run has a new place after every letter:
                    # spelled to its end, a 64-character local part took a dive past its
                    # node budget)
                    fresh, new_step = self._fresh(m, edges, states)
                    def order(ts, fresh=fresh, new_step=new_step):
                        rank = self._closing_rank(ts, True)
                        return (rank > 1, ts not in new_step, ts not in fresh, rank)
                else:
                    order = self._closing_rank
                for tokens in sorted(edges, key=order):
                    tried.add(tuple(tokens))
                    if len(path) + len(tokens) > limit:
                        continue
                    if self._late():
                        return None
                    child = m.fork()
                    if not child.accept_tokens(tokens):
                        continue
                    h, child_row = self._fill(child)
                    child_ctx = ctx if h == hist[-1] else hist[-1]
                    # a closing edge keeps its depth in the state's key: the mask repeats
                    # at every level of a nesting being closed ("}" after "}"), and merging
                    # by mask alone would cut the dive off after three levels; other edges
                    # merge by mask (the fast pass's rule), or a dive would spell letters
                    # to its limit
                    key = self._key(child, h, hist, child_ctx, len(path) + len(tokens),
                                    self._closes(m, row, child, tokens))
                    if key in seen:
                        continue
                    seen.add(key)
                    found = go(child, child_row, path + tokens, hist + (h,), child_ctx,
                               states)
                    if found is not None:
                        return found
            return None

        root = matcher.fork()
        h, row = self._fill(root)
        return go(root, row, [], (h,), None, frozenset())

    def _closing_edges(self, m, row: torch.Tensor, text: bool) -> list[list[int]]:
        """The edges a dive tries first (rank 0 and 1 of ``_closing_rank``), without
        listing the others: the jump-forward string and the allowed tokens made of closing
        characters (in text, only those with a quote)."""
        edges = []
        if self.encode is not None:
            forced = m.forced_continuation()
            toks = self.encode(forced) if forced else None
            if toks and len(toks) > 1:
                edges.append(toks)
            elif toks:  # one token: ranked like any other token
                self._closer_edge(toks[0], text) and edges.append(toks)
        allowed = ((row[self._closer_word] >> self._closer_bit) & 1).bool()
        for t in self._closer_ids[allowed].tolist():
            if self._closer_edge(t, text) and [t] not in edges:
                edges.append([t])
        return edges

    def _closer_edge(self, token: int, text: bool) -> bool:
        return self._closing_rank([token], text) <= 1

    def _fresh(self, m, edges: list[list[int]],
               states: frozenset) -> tuple[list[list[int]], list[list[int]]]:
        """The single-token edges that lead to a parser state not in ``states``, and the
        punctuation among them whose next characters (``_char_state``) are not in it
        either: the ways out of a run (tried on one scratch matcher and rolled back)."""
        probe, fresh, new_chars = m.fork(), [], []
        for tokens in edges:
            if len(tokens) == 1 and probe.accept_token(tokens[0]):
                if probe.state_key() not in states:
                    fresh.append(tokens)
                    raw = self.vocab[tokens[0]]
                    if len(raw) == 1 and not raw.isalnum() and \
                            self._char_state(probe) not in states:
                        new_chars.append(tokens)
                probe.rollback(1)
        return fresh, new_chars

    def _char_state(self, m, row: torch.Tensor | None = None) -> tuple:
        """What may come next, character by character: whether the grammar may end, the
        forced text and the single-byte tokens allowed (``row``: ``m``'s mask, where
        known). Unlike the mask, the same at every place of a run (``[a-z]{1,64}``) but its
        last: a token of 16 letters is allowed only where 16 places are left."""
        if row is None:
            m.fill_bitmask(self._scratch)
            row = self._scratch[0]
        bits = ((row[self._byte_word] >> self._byte_bit) & 1).numpy().tobytes()
        return ("chars", m.is_completed(), m.forced_continuation(), bits)

    def _late(self) -> bool:
        if self._due is not None and self._deadline != -1.0:
            self._deadline += self._due()
        if CLOCK() < self._deadline:
            return False
        if self._deadline != -1.0:
            self.stats["timeouts"] += 1
            self._deadline = -1.0  # counted once; late from now on
        return True

    def _closes(self, parent, parent_row: torch.Tensor, child, tokens: list[int]) -> bool:
        """Whether ``tokens`` closed something: a closing edge taken where no letter could
        come instead (a ``"}"`` inside a string or an e-mail address is only a character)
        and after which the outermost open rule began earlier than before."""
        if self._closing_rank(tokens) > 1 or self._in_text(parent_row):
            return False
        before, after = parent.rule_start(), child.rule_start()
        return before is None or after is None or after < before  # unknown: keep the depth

    def _in_text(self, row: torch.Tensor) -> bool:
        """Whether letters may come next (inside a string or free text): more than the
        few a JSON value allows (``e`` after a number; ``t``, ``f``, ``n`` of literals)."""
        return int(((row[self._letter_word] >> self._letter_bit) & 1).sum()) > 3

    def _closing_rank(self, tokens: list[int], text: bool = False) -> int:
        """The dive's order: the forced string, closers, literals, other text, digits,
        blanks and '-'. In ``text`` (a letter may come next) only a quote closes: a
        bracket there is a character like any other, and punctuation comes after letters
        (``ab@c``, not ``ab}}}.}@c``)."""
        if len(tokens) > 1:
            return 0  # the forced string
        raw = self.vocab[tokens[0]]
        if raw and all(b in _CLOSERS for b in raw) and (not text or b'"' in raw):
            return 1
        if text and len(raw) == 1 and not raw.isalnum() and not raw.isspace():
            return 4 if raw not in b"-." else 5  # (a separator asks for more text)
        if raw in _LITERALS and not text:
            return 2
        if raw[:1].isdigit():  # a value, but never worth continuing a number with
            return 4
        if raw.isspace() or raw == b"-":  # never close anything: last, or a dive pads
            return 5  # values with blanks and signs
        return 3

    def _fill(self, m: GrammarMatcher) -> tuple[int, torch.Tensor]:
        """The next-token mask of ``m`` (a copy: one fill per node, the costly part) and
        its hash."""
        m.fill_bitmask(self._mask)
        row = self._mask[0].clone()
        return hash(row.numpy().tobytes()), row

    def _key(self, m, h: int, hist: tuple, ctx, cost: int, with_depth: bool) -> tuple:
        """Which states count as one: the next-token mask, the parser state (where in
        which rules; see ``GrammarMatcher.state_key``), the mask in force before the current run of
        equal masks (inside a string every character keeps the mask; the string's place in
        the grammar is told by what came before it), and how often (up to ``_REPEATS``) the
        mask occurred on the path (a counter such as minItems: ``[`` and ``["", `` expect
        the same next token). ``with_depth``: the cost too (nesting being closed repeats
        mask and parser state at every level)."""
        key = (m.is_completed(), h, m.state_key(), ctx, min(hist.count(h), _REPEATS))
        return key + (cost,) if with_depth else key

    def rest_after(self, path: list[int], token: int) -> list[int] | None:
        """The tokenizer's encoding of the path's text after ``token``'s text, where the
        path's text begins with it (None otherwise): the path's rest once a token that
        spells its beginning differently was taken. Not checked against the grammar."""
        if self.encode is None:
            return None
        text, head = b"".join(self.vocab[t] for t in path), self.vocab[token]
        if not head or not text.startswith(head):
            return None
        try:
            rest = text[len(head):].decode("utf-8")
        except UnicodeDecodeError:
            return None
        return self.encode(rest) if rest else []

    @staticmethod
    def same_place(before: GrammarMatcher, after: GrammarMatcher) -> bool:
        """Whether the parser stands where it stood (another word inside a string): the
        same parser states at the last step, positions aside. The searches take such
        states as one, so a shortest completion found from one serves the other. False
        where equal keys may be different places (``has_parser_state``: llguidance)."""
        before, after = as_matcher(before), as_matcher(after)
        return before.has_parser_state() and before.state_key() == after.state_key()

    def min_tokens(self, matcher: GrammarMatcher, limit: int) -> int | None:
        """Length of the shortest completion within ``limit``, None if none was found."""
        c = self.shortest(matcher, limit)
        return None if c.tokens is None else len(c.tokens)

    # helpers ------------------------------------------------------------------------------

    def _edges(self, m: GrammarMatcher, row: torch.Tensor,
               first: bool = False) -> list[list[int]]:
        """Token paths to try from ``m``: the jump-forward string (tokenized) first, then
        the allowed candidates (a few per class when many are allowed). ``first``: ``m``
        is the search's root (its unfinished character's next byte has a narrower range)."""
        allowed = ((row[self._word] >> self._bit) & 1).bool()
        per_class: dict[int, list[int]] = {}
        for i in allowed.nonzero().flatten().tolist():
            per_class.setdefault(self.cand_class[i], []).append(int(self.cand[i]))
        edges = []
        words = (row != 0).nonzero().flatten().tolist()
        if len(words) <= _FEW_WORDS:  # few tokens allowed (a choice, a keyword): try them all
            listed = {t for ts in per_class.values() for t in ts}
            extra = [w * 32 + b for w in words for b in range(32)
                     if (int(row[w]) >> b) & 1 and w * 32 + b < len(self.vocab)
                     and w * 32 + b not in listed and w * 32 + b not in self.stop]
            edges.extend([t] for t in extra)
        if self.encode is not None:
            forced = m.forced_continuation()
            if forced:
                toks = self.encode(forced)
                if toks:
                    edges.append(toks)
        mid_char = set(per_class) == {5}  # only high bytes: inside a multi-byte character
        if mid_char:
            lo, hi = self._first_byte if first else (0x80, 0xBF)
            per_class[5] = [t for t in per_class[5] if lo <= self.vocab[t][0] <= hi]
        for cls, toks in per_class.items():
            if cls == 5 and len(toks) > 4:  # a multi-byte character's first byte only when
                # nothing else is allowed (its continuations cost tokens); then any will do
                toks = toks[:self.reps] if mid_char else []
            elif cls >= 1 and len(toks) > self.reps:  # many allowed: one per next state
                toks = self._distinct(m, row, toks)
            edges.extend([t] for t in toks)
        return edges

    def _distinct(self, m: GrammarMatcher, row: torch.Tensor,
                  toks: list[int]) -> list[int]:
        """One token for each parser state that ``toks`` lead to from ``m`` (inside a free
        string every letter leads to the same state; an e-mail's local part needs "@" and
        a regex ``[a-z]*q`` needs "q", which sampling a class would miss). Each token is
        tried on one scratch matcher and rolled back (far cheaper than a fork per token),
        and the answer is remembered per (mask, parser state) for the search."""
        key = (hash(row.numpy().tobytes()), m.state_key(), tuple(toks))
        got = self._reps_memo.get(key)
        if got is not None:
            return got
        probe, states, keep = m.fork(), set(), []
        for t in toks:
            if not probe.accept_token(t):
                continue
            state = probe.step_state()
            probe.rollback(1)
            if state not in states:
                states.add(state)
                keep.append(t)
        self._reps_memo[key] = keep
        return keep

    def _compact(self, matcher: GrammarMatcher, path: list[int]) -> list[int]:
        """The path, or the tokenizer's own encoding of its text when that is shorter and
        the grammar accepts it."""
        if self.encode is None or len(path) < 2:
            return path
        try:
            text = b"".join(self.vocab[t] for t in path)
            again = self.encode(text.decode("utf-8"))
        except UnicodeDecodeError:
            return path
        if not again or len(again) >= len(path):
            return path
        probe = matcher.fork()
        if probe.accept_tokens(again) and probe.is_completed():
            return again
        return path


# the allowed range of the byte after a lead byte, where it is narrower than 80..BF
NEXT_BYTE = {b"\xe0": (0xA0, 0xBF), b"\xed": (0x80, 0x9F), b"\xf0": (0x90, 0xBF),
              b"\xf4": (0x80, 0x8F)}


def _unfinished_char(data: bytes) -> bytes:
    """The trailing bytes of ``data`` that begin a UTF-8 character not yet complete."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 \
            else 1
        return data[-back:] if back < need else b""
    return b""


def _class_of(raw: bytes) -> int | None:
    """0: JSON structural text or a literal; 1: other single bytes (punctuation, blanks);
    2-5: single letters / digits / high bytes by class; None: not a candidate."""
    if raw in _LITERALS:
        return 0
    if len(raw) == 1:
        b = raw[0]
        if b in _JSON_PUNCT:
            return 0
        if 0x61 <= b <= 0x7A:
            return 2
        if 0x41 <= b <= 0x5A:
            return 3
        if 0x30 <= b <= 0x39:
            return 4
        if b >= 0x80:
            return 5
        return 1
    if 2 <= len(raw) <= 4 and all(b in _JSON_PUNCT for b in raw):
        return 0
    return None
