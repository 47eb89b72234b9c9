"""Loop guard: find a guided JSON output cycling inside one value, and where to end it.

A small model under a grammar often falls into a loop inside a free-form value
(``"bacon, eggs, bacon, eggs, ..."``, the same array item again and again, the same free
key) and runs to its budget. The output still parses once closed, but it is useless, and
its ``length`` finish makes client libraries refuse it. The guard ends such a value where
the repetition began, and the rest of the document goes on.

Detection works on token ids, per request, with the same work per token whatever
``max_period`` and whatever the text (the counts per period are arrays, loop_periods.py):

    run[p]  = how many tokens in a row equal the token p places before them
    a loop  = the smallest period p with run[p] >= (copies(p) - 1) * p, where
              copies(p) = min_repeats (3) for short spans, 2 from long_span (8) tokens up
              (inside a string, or holding a letter: outside strings, digits and
              punctuation repeat by chance in data, one token per digit),
              and the repeated text is at least min_chars (16) characters long

A **progression** is the same loop with counters in it (``"v2.0", "v3.0", "v4.0", ...``,
``"b", "c", "d", ...``, ``{"name": "A", "quantity": 1}, {"name": "B", "quantity": 2}, ...``):
the same run over token *shapes* (compared at the first 4 periods whose shapes repeat:
a string of digits repeats in shape at every period), where every all-digit token is one
shape and every
single-letter token another. A progression needs ``progression_repeats`` (8) copies, and
outside a string the repeated text must hold a letter (so ``[90, 85, 77, ...]`` and lists
of dates are never progressions; a string counting ``"49, 50, 51, ..."`` is one), and it is ended where it was found (the copies seen are
kept, the value closed at the first place it can close from the start of the newest copy):
an enumeration the user asked for loses its tail, not its head.

A JSON scanner follows the output byte by byte (strings, escapes, numbers, nesting), so
each token boundary knows its nesting. The loop's value is the innermost string, array or
object that stays open over the whole repetition; a repetition of tokens inside a number
or literal is never cut (``1000000`` is not a loop). The cut is the earliest token
boundary after one whole copy (an array's: after its first item, whose opening token may
differ from the copies'; and after what was already streamed) that lies directly
in that value and where the grammar accepts the value's closer (``"``, ``]`` or ``}``): a
string is closed, an array ends once its ``minItems`` allow, an object once its required
keys are in. A repetition
the grammar demands (``[5, 5, 5, 5, 5]`` with ``minItems: 5``, ``"aaaa"`` for ``a{4}``)
has no such boundary before the grammar is satisfied, so it is never shortened.

A progression's copies must also count: the numbers in each copy step by the same amount
as in the copy before (points with varying coordinates and one label share their token
shapes, but they are data).

**Near repeats** are read from the JSON, not the tokens, so a copy may be longer than
``max_period`` or change its token count (``9`` -> ``10``): an array item (object, array
or string) is compared with the one before it as its text with each number (in a string
too) made ``#``: the same text, with every number stepping as it stepped last time
(``{"name": "Tacos", "quantity": 1}, {"name": "Tacos", "quantity": 2}, ...``), is a near
copy; in a counting run, so is an item whose copied text slips a word (``variant``: one
small edit inside a string mostly kept) and whose numbers step as before.
``near_repeats`` (8) items in a row end the array after the newest one, the copies
kept (``min_repeats`` where nothing steps: exact copies, ended after the first where the
grammar allows: duplicates say nothing more, and break ``uniqueItems``); items need a letter (a list of
numbers is data), but for dates counting past the calendar (``"2022-01-30", "2022-01-31",
"2022-01-32", ...``: every day of a month is data, its 32nd is not), which end before
the first day that is not one. Items that cycle are compared the same way with the item 2 to 6 before
(A1, B1, A2, B2, ...: 5 rounds of 2 items, 4 of 3 to 6 (``near_rounds``), or
``min_repeats`` rounds of exact copies).
In a string, a sentence or clause (ended by ``. ! ? , ;``) of 3 words or more that changes
at most one word of the one before (or of the one 2 before: a pair of sentences that
cycles), or keeps its first 4 words, restarts it; ``sentence_repeats`` (4) in a row (or
rounds) end the string there. Each item and sentence is read
once, when it ends (items over 4 KiB are not compared).

A **number** loops when its digits repeat one group of up to 16 digits over
``number_digits`` (20) digits and two whole groups within one part of it (``1111...``,
``0.3333...``, ``9001234567890012...``; xgrammar's grammar bounds a number's digits
itself, llguidance's may not): it ends at the newest token, and the value around it is closed, or (the schema wants more) a
comma lets the object or array go on. A double prints at most 17 significant digits, an
int64 19, and round numbers people write (``602214076000000000000000``) repeat under 20.

Cost: a bounded amount of work and a few small objects per token, on any text and at any
``max_period``, also where a loop cannot be cut (a ``minLength`` string of one character:
each token looks at the newest boundary only, and the repetition's length and lowest
depth come from running sums, not rescans). The counts per period are numpy arrays (at
most 256 entries: a few array operations a token), the periods that may hold a loop are
picked by array tests (copies, ``min_chars``, in a string or holding a letter), so only
the shortest is looked at, and a progression's copies are read at 4 periods at most; a
state refers to its innermost nesting level, shared, never to a copy of the stack.
Nothing is recorded while the guard is off or its cuts are spent.
tests/engine/test_loop_guard_cost_unit.py counts the lines it runs per token.

This module knows no engine: ``LoopGuard`` is fed tokens and answers with a ``LoopCut``;
the output policy (output_policy.py) rolls the matcher and the output back and forces the
closer.

Why one module over 500 lines: the detector, the JSON scanner it runs on and the search for
where a loop may end read one per-request state token by token; the scanner is its only user.
What reads no state of its own is apart: the per-period counts (loop_periods.py) and how
array items and sentences compare (loop_near.py).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from core.params import LoopGuardParams
from worker.guided import loop_near
from worker.guided.loop_periods import PeriodRuns, Prefix

# an open nesting level: (kind "o"/"a"/"s", the level it is in or None, its depth from 1,
# the output byte it opened at);
# a state's innermost level leads to all of them, so a state never copies its stack
_Level = tuple
# scanner state after a token: (innermost open level or None, in_escape, in_number)
_State = tuple
_START: _State = (None, False, False)
_NUMBER = frozenset(b"-0123456789.eE+")
_CLOSER = {"s": b'"', "a": b"]", "o": b"}", ",": b","}


@dataclass(frozen=True)
class LoopCut:
    """Keep the first ``keep`` output tokens, then force ``closers``."""

    keep: int
    closers: tuple[int, ...]  # token ids forced after the kept tokens: the value's closer,
    # after those of values inside it that the next token was closing
    period: int  # the repeated span, in tokens
    repeats: int  # whole copies seen when it was found
    # "repeat": exact copies; "progression": copies that differ in their digits / single
    # letters; "number": a number's digits repeating (period and repeats count digits);
    # "near": array items equal but for stepping numbers; "sentences": sentences that
    # restart with a changed word (period 0 for these two)
    kind: str = "repeat"

    @property
    def progression(self) -> bool:
        return self.kind == "progression"


class LoopGuard:
    """One request's loop detector over its output tokens (see the module doc).
    ``vocab`` is the tokenizer's bytes per token id; ``closers`` maps "s"/"a"/"o" (and
    "," where the vocabulary has it) to the token id of that single byte.

    Cost: bounded per token, whatever the output and max_period; what it keeps is a few
    small objects per token (a nesting level is one shared node, never a copy of the stack)."""

    def __init__(self, params: LoopGuardParams, vocab: list[bytes], closers: dict[str, int],
                 shapes: list[int] | None = None):
        self.params = params
        self.vocab = vocab
        self.closers = closers
        self.shapes = shapes if params.progression_repeats else None  # token_shapes(vocab)
        self.tokens: list[int] = []
        self.states: list[_State] = []  # scanner state after each token
        self._chars = [0]  # bytes of tokens[:i], per i
        self._char_at = Prefix()  # the same, as an array (loop_periods.py)
        self._letter_at: list[int] = []  # the tokens that hold a letter (indices, rising)
        self._path: list[_Level] = []  # the levels open after the newest token, outermost first
        # suffix minima of the states' depths: indices rising, depths strictly rising; the
        # lowest depth from state i on is that of the first entry at or after i
        self._min_at: list[int] = []
        self._min_depth: list[int] = []
        self._digits = _DigitRuns()
        self._bytes = bytearray()  # the output's bytes (array items and sentences are read
        # back from it once each)
        self._items: dict[int, loop_near.ItemRun] = {}  # open arrays' near repeats, by
        # start byte
        self._sentence: tuple | None = None  # (string level, sentence start, its words,
        # how many sentences in a row restart the one before)
        self._near: tuple | None = None  # (level to end, copies, kind, tokens up to the
        # one that ended the newest copy): found, to cut
        self.floor = 0  # no repetition is counted from before here (the last cut)
        self.cuts = 0
        # row 0 over token ids, row 1 over shapes (progressions)
        self._runs = PeriodRuns(params.max_period, 1 if self.shapes is None else 2)
        periods = self._runs.periods
        self._long = periods >= params.long_span  # [P] long spans
        self._three = (params.min_repeats - 1) * periods  # [P] run for min_repeats copies
        self._counted = (params.progression_repeats - 1) * periods  # [P] for a progression
        self._retry_at = 0  # after a loop with no place to cut: look again from here
        self._scan_from = 0  # boundaries before here were refused already (the last one
        # may wait for the token after it)

    @property
    def active(self) -> bool:
        return self.params.enabled and self.cuts < self.params.max_cuts

    def push(self, token: int) -> None:
        """Records one more output token (nothing while the guard is off or spent)."""
        if not self.active:
            return
        i = len(self.tokens)
        self.tokens.append(token)
        data = self.vocab[token]
        base = self._chars[-1]
        self._chars.append(base + len(data))
        self._char_at.append(base + len(data))
        if _ALPHA.search(data) is not None:
            self._letter_at.append(i)
        self._bytes += data
        events: list = []
        state = _scan(self.states[-1] if self.states else _START, data, self._path,
                      self._digits, base, events)
        self.states.append(state)
        if events:
            self._near_events(events)
        depth = _depth(state)
        while self._min_depth and self._min_depth[-1] >= depth:
            self._min_at.pop()
            self._min_depth.pop()
        self._min_at.append(i)
        self._min_depth.append(depth)
        if self.shapes is None:
            self._runs.push(token)
        else:
            self._runs.push(token, self.shapes[token])

    def find(self, may_close) -> LoopCut | None:
        """A cut for a loop that ends at the newest token, or None. ``may_close(keep,
        closers)`` says whether the grammar accepts ``closers`` after the first ``keep``
        output tokens (and that ``keep`` is not before what was already streamed)."""
        if not self.active or len(self.tokens) < self._retry_at:
            return None
        if self.states and self.states[-1][2]:  # inside a number: only its digits loop
            return self._number(may_close)
        n = len(self.tokens)
        run, periods = self._runs.run[0], self._runs.periods
        found = run >= periods  # [P] a whole copy repeated, at least
        if found.any():
            starts = n - run - periods  # [P] first token of the first copy
            # two copies of a long span, or three of a short one; outside a string, a long
            # span without a letter is data (digits are one token each: two dates of a
            # list may share 12 tokens) and needs three copies too
            found &= run >= np.where(self._long & self._loose(starts, n), periods,
                                     self._three)
            found &= self._long_enough(starts, n)
            hits = found.nonzero()[0]
            if len(hits):  # the shortest period
                p = int(hits[0]) + 1
                r = int(run[p - 1])
                start = n - r - p
                cut = self._cut(start, start + p, may_close, exact=True)
                if cut is None:
                    # no place yet (or the places were streamed already): look at the next
                    # token's boundary only (a whole copy later would stay in phase with
                    # the boundaries it keeps missing)
                    self._retry_at, self._scan_from = n + 1, n
                    return None
                return LoopCut(cut[0], cut[1], p, (r + p) // p)
        cut = self._progression(may_close) if self.shapes is not None else None
        return cut if cut is not None else self._near_cut(may_close)

    def _loose(self, starts: np.ndarray, n: int) -> np.ndarray:
        """[P] whether the repetition of period p from ``starts[p]`` may be taken on two
        copies: it lies inside one string (a string is always the innermost level, so the
        string open now, open since before the repetition's start: deeper than every state
        from then on), or its newest copy (the last p tokens) holds a letter."""
        periods = self._runs.periods
        last = self._letter_at[-1] if self._letter_at else -n - 1
        loose = periods >= n - last
        if self._path and self._path[-1][0] == "s":
            # the newest state of a lower depth than now (-1: none): the string opened after it
            lower = self._min_at[-2] if len(self._min_at) >= 2 else -1
            loose |= starts - 1 > lower
        return loose

    def _long_enough(self, starts: np.ndarray, n: int) -> np.ndarray:
        """[P] whether the text from ``starts[p]`` to the newest token is ``min_chars``
        bytes or more."""
        return self._chars[n] - self._char_at.at(np.maximum(starts, 0)) >= self.params.min_chars

    # near repeats -------------------------------------------------------------------------

    def _near_events(self, events: list) -> None:
        prm = self.params
        for level, start, end in events:
            if level[0] == "s":
                if prm.sentence_repeats:
                    self._sentence_end(level, end)
            elif start is None:  # the array closed
                self._items.pop(level[3], None)
            elif prm.near_repeats:
                self._item_end(level, start, end)

    def _item_end(self, array: _Level, start: int, end: int) -> None:
        """An item of ``array`` ended: is it a near copy of the one ``c`` items before (the
        same text but for its numbers, which all step as they stepped a cycle before), for
        a cycle of ``c`` = 1 to MAX_CYCLE items (A, B, A, B ...; A1, B1, A2, B2 ...)?"""
        if end - start > loop_near.ITEM_BYTES:
            self._items.pop(array[3], None)
            return
        run = self._items.get(array[3])
        if run is None:
            run = self._items[array[3]] = loop_near.ItemRun()
        shape, counters = loop_near.item_shape(bytes(self._bytes[start:end]))
        lettered = loop_near.ASCII_LETTER.search(shape) is not None
        # a list of dates is data, until it counts past the calendar ("2022-01-32"): that
        # item is where the loop began, and the array ends before it
        dated = not lettered and shape == loop_near.DATE_SHAPE
        past = dated and not loop_near.real_date(counters)
        here = bisect_left(self._chars, run.end) if past else None  # the boundary before it
        steps_at: list = [None] * (loop_near.MAX_CYCLE + 1)
        prm = self.params
        for c in range(1, min(loop_near.MAX_CYCLE, len(run.items)) + 1):
            before_shape, before_counters, before_steps = run.items[-c]
            last = before_steps[c]  # (how the item c before stepped from its own c before)
            if shape != before_shape or not (lettered or dated):
                # a variant (one small edit inside a string mostly kept) goes on a counting
                # run whose numbers step as before; anything else ends the run
                steps = (loop_near.steps(before_counters, counters) if c == 1 and lettered
                         and last is not None and len(counters) == len(before_counters)
                         else None)
                if (steps is None or not any(steps) or not loop_near.same_steps(last, steps)
                        or not loop_near.variant(before_shape, shape)):
                    run.counts[c] = 0
                    continue
                steps_at[c] = steps
                run.counts[c] += 1
            else:
                steps = steps_at[c] = loop_near.steps(before_counters, counters)
                run.counts[c] = (run.counts[c] + 1
                                 if last is None or loop_near.same_steps(last, steps) else 1)
            # exact copies (nothing steps) as the exact detector counts them; counting
            # copies as progressions do (an enumeration of up to near_repeats - 1 items
            # is kept) (over min_chars together, as there: three short enum answers are
            # not a loop)
            exact = not any(steps) and (end - start) * c * prm.min_repeats >= prm.min_chars
            cycles = (run.counts[c] + c) // c
            if self._near is not None or cycles < (
                    prm.min_repeats if exact else loop_near.near_rounds(prm, c)):
                continue
            if lettered:
                n = len(self.tokens)  # tokens jumped forward may follow the copy
                places = (n, n - 1)
                if exact and c == 1:
                    # exact copies say nothing the first did not (and break uniqueItems):
                    # ended after the first where the grammar allows, as the exact
                    # detector ends them (or one or two tokens before: inside the
                    # item's closing token)
                    k = bisect_left(self._chars, run.ends[-min(run.counts[1], len(run.ends))])
                    places = (k, k - 1, k - 2) + places
                self._near = (array, cycles, "near", places)
            elif past:
                # before the first item of this run past the calendar: the first token
                # boundary at or past the end of the item before it (or one or two before,
                # inside that item's closing token)
                keep = here if run.past is None else run.past
                self._near = (array, cycles, "near", (keep, keep - 1, keep - 2))
        if not run.counts[1]:
            run.past = None
        elif past and run.past is None:
            run.past = here
        run.end = end
        run.items.append((shape, counters, steps_at))
        run.ends.append(end)
        if len(run.items) > loop_near.MAX_CYCLE:
            del run.items[0], run.ends[0]

    def _sentence_end(self, string: _Level, end: int) -> None:
        """A sentence (or clause) of ``string`` ended at byte ``end``: does it restart the
        one ``c`` sentences before with a changed word (``c`` = 1 or 2: a pair of
        sentences that cycle)?"""
        cur = self._sentence
        if cur is None or cur[0] is not string:
            start, recent, counts = string[3] + 1, [], [0] * (loop_near.SENTENCE_CYCLE + 1)
        else:
            _, start, recent, counts = cur
        words = (bytes(self._bytes[start:end - 1]).split()
                 if end - start <= loop_near.SENTENCE_BYTES else [])
        if not words:
            if end - start > 2:
                recent, counts = [], [0] * (loop_near.SENTENCE_CYCLE + 1)
            self._sentence = (string, end, recent, counts)
            return
        for c in range(1, loop_near.SENTENCE_CYCLE + 1):
            near = len(recent) >= c and loop_near.near_sentence(recent[-c], words)
            counts[c] = counts[c] + 1 if near else 0
            cycles = (counts[c] + c) // c
            if near and self._near is None and cycles >= self.params.sentence_repeats:
                n = len(self.tokens)
                self._near = (string, cycles, "sentences", (n, n - 1))
        recent = (recent + [words])[-loop_near.SENTENCE_CYCLE:]
        self._sentence = (string, end, recent, counts)

    def _near_cut(self, may_close) -> LoopCut | None:
        """Ends the value a near repeat was found in, after its newest copy (the copies
        seen are kept: an enumeration loses its tail, not its head); where that cannot be
        (minItems, streamed), the next copy tries again."""
        if self._near is None:
            return None
        outer, copies, kind, n = self._near  # n: the places to try, the newest first
        self._near = None
        for keep in n:
            forced = self._closing(keep, outer) if keep > 0 else None
            if forced is not None and may_close(keep, forced):
                return LoopCut(keep, forced, 0, copies, kind=kind)
        return None

    def _number(self, may_close) -> LoopCut | None:
        """A number whose digits repeat one group of up to 16 digits over ``number_digits``
        digits and two groups (``1111...``, ``0.3333...``, ``900123456789001234...``) ends
        at the newest token: the
        value around it is closed, or where that cannot be, a comma lets it go on."""
        prm, n = self.params, len(self.tokens)
        found = self._digits.repeat(prm.number_digits) if prm.number_digits else None
        if found is None or not self._path:
            return None
        span, period = found
        options = [self.closers.get(self._path[-1][0]), self.closers.get(",")]
        for closer in options:
            if closer is not None and may_close(n, (closer,)):
                return LoopCut(n, (closer,), period, span // period, kind="number")
        self._retry_at = n + 1
        return None

    def _progression(self, may_close) -> LoopCut | None:
        """A progression at the shortest period whose copies count (of the first
        _COUNT_LOOKS periods whose shapes repeat: a string of digits repeats in shape at
        every period, and each look reads its copies)."""
        n = len(self.tokens)
        run, periods = self._runs.run[1], self._runs.periods
        found = run >= self._counted
        if not found.any():
            return None
        starts = n - run - periods
        # a letter in it, or inside a string: runs of numbers and dates are data, not a
        # loop (a string counting "49, 50, 51, ..." is one)
        found &= self._loose(starts, n)
        found &= self._long_enough(starts, n)
        for at in found.nonzero()[0][:_COUNT_LOOKS].tolist():
            p = at + 1
            if not self._counts(n, p):
                continue
            r = int(run[at])
            start = n - r - p
            cut = self._cut(start, n - p, may_close)
            if cut is None:
                self._retry_at, self._scan_from = n + 1, n
                return None
            return LoopCut(cut[0], cut[1], p, (r + p) // p, kind="progression")
        return None

    def _counts(self, n: int, p: int) -> bool:
        """Whether the numbers of the newest ``progression_repeats`` copies of ``p`` tokens
        step alike (each by the same amount from one copy to the next): a counter, not
        data (points with differing coordinates have the same token shapes)."""
        chars, before, steps = self._chars, None, None
        for k in range(self.params.progression_repeats, 0, -1):
            a, b = n - k * p, n - (k - 1) * p
            counters = loop_near.numbers(bytes(self._bytes[chars[a]:chars[b]]))
            if before is not None:
                if len(counters) != len(before):
                    return False
                step = loop_near.steps(before, counters)
                if steps is not None and not loop_near.same_steps(steps, step):
                    return False
                steps = step
            before = counters
        return True

    def _region_depth(self, start: int) -> int:
        """The lowest depth from before token ``start`` to the newest token: the levels
        down to it stayed open over the whole region."""
        if start == 0:
            return 0
        k = bisect_left(self._min_at, start - 1)
        return self._min_depth[k]

    def _cut(self, start: int, first: int, may_close,
             exact: bool = False) -> tuple[int, tuple[int, ...]] | None:
        """The earliest place from ``first`` on to end the value open over the whole
        repetition (which began at ``start``)."""
        depth = self._region_depth(start)
        if depth == 0:
            return None
        # the value open over the whole repetition: every state in it lies inside this
        # level (deeper levels close and reopen within)
        outer = self._path[depth - 1]
        if outer[0] not in self.closers:
            return None
        items = exact and outer[0] == "a"
        if items:
            # an array's exact copies are whole items: ended after the first (the copies
            # say nothing more, and break uniqueItems), never before it (the token period
            # may begin inside the first item, its opening token being another)
            first = start
        for keep in range(max(first, self._scan_from), len(self.tokens) + 1):
            if items and not bytes(
                    self._bytes[outer[3] + 1:self._chars[keep]]).strip():
                continue  # nothing of the array kept
            forced = self._closing(keep, outer)
            if forced is not None and may_close(keep, forced):
                return keep, forced
        return None

    def _closing(self, keep: int, outer: _Level) -> tuple[int, ...] | None:
        """The closer tokens that end the loop's value ``outer`` after the first ``keep``
        tokens, or None where it cannot end there: directly inside it, or inside a child
        that the next token itself was closing (``},`` ends an array item and goes on: its
        ``}`` is kept, then the array's ``]``). Its work is bounded by the next token's
        length (it can close no more levels than it has bytes)."""
        level, esc, num = self.states[keep - 1]
        if esc or level is None:
            return None
        deeper = level[2] - outer[2]
        if deeper < 0:
            return None
        if deeper:
            if keep == len(self.tokens):
                return None
            data = self.vocab[self.tokens[keep]]
            if deeper > len(data):
                return None
        elif num and (keep == len(self.tokens) or self.states[keep][2]):
            return None  # a number ends only where the next token does not go on with it
        kinds = []
        while level is not outer:
            if level is None or level[2] <= outer[2]:
                return None  # not inside the loop's value (it closed and reopened)
            kinds.append(level[0])
            level = level[1]
        head: list = []
        if deeper and not _closes_first(kinds, data):
            # a string the next token ends after a few plain characters ('.",' after
            # '"TinyTech Inc'): those characters are written first, one token each, so the
            # kept copy ends as the model wrote it
            tail = _plain_before_quote(data) if kinds[0] == "s" else None
            if tail is None or not _closes_first(kinds, data[len(tail):]):
                return None
            head = [self.closers.get(tail[i:i + 1]) for i in range(len(tail))]
        closers = head + [self.closers.get(k) for k in kinds + [outer[0]]]
        return None if None in closers else tuple(closers)

    def cut(self, keep: int, closers: tuple[int, ...]) -> None:
        """The output was cut to ``keep`` tokens and ``closers`` appended: follow it, and
        count no repetition across the cut."""
        self.cuts += 1
        if not self.active:
            return  # spent: it records nothing more
        del self.tokens[keep:]
        del self.states[keep:]
        del self._chars[keep + 1:]
        self._char_at.truncate(keep + 1)
        while self._letter_at and self._letter_at[-1] >= keep:
            self._letter_at.pop()
        del self._bytes[self._chars[keep]:]
        self._sentence, self._near = None, None
        # the levels open after token keep - 1: the path's head is shared, the rest is
        # walked back from that state's innermost level
        level = self.states[-1][0] if self.states else None
        tail = []
        while level is not None and not (len(self._path) >= level[2]
                                         and self._path[level[2] - 1] is level):
            tail.append(level)
            level = level[1]
        del self._path[level[2] if level is not None else 0:]
        self._path.extend(reversed(tail))
        # the item runs of the arrays still open, whose items all ended before the cut, go
        # on: a cut inside each item (its list of tags) no longer hides items that repeat
        # whole (JSONSchemaStore's cv: six equal courses to the budget, five cuts inside)
        kept_at, open_arrays = self._chars[keep], {lvl[3] for lvl in self._path
                                                   if lvl[0] == "a"}
        self._items = {at: run for at, run in self._items.items()
                       if at in open_arrays and run.end <= kept_at}
        # no repetition is counted from before the cut: one state's minimum is enough
        self._min_at = [keep - 1] if keep else []
        self._min_depth = [_depth(self.states[-1])] if keep else []
        self._digits = _DigitRuns()
        self.floor = keep
        self._runs.reset()
        self._scan_from = 0
        self._retry_at = 0
        for t in closers:
            self.push(t)


def closer_ids(vocab: list[bytes]) -> dict:
    """The token ids of the single bytes ``"``, ``]``, ``}`` and ``,`` (kinds "s", "a",
    "o", ","), and of every printable ASCII byte (keyed by the byte itself: the characters
    a string's closing token carries before its quote, see ``LoopGuard._closing``)."""
    found: dict = {}
    for tid, raw in enumerate(vocab):
        if len(raw) != 1:
            continue
        for kind, byte in _CLOSER.items():
            if raw == byte and kind not in found:
                found[kind] = tid
        if 0x20 <= raw[0] < 0x7F and raw not in found:
            found[raw] = tid
    return found


DIGITS, LETTER = -1, -2  # the shapes of an all-digit token and of a single-letter token


def token_shapes(vocab: list[bytes]) -> list[int]:
    """Per token id its shape for progressions: DIGITS for a token of ASCII digits only,
    LETTER for a single ASCII letter (either after one leading space), else the id itself."""
    shapes = []
    for tid, raw in enumerate(vocab):
        core = raw[1:] if raw[:1] == b" " else raw
        shapes.append(DIGITS if core and core.isdigit() and core.isascii() else
                      LETTER if len(core) == 1 and core.isalpha() and core.isascii() else tid)
    return shapes


def _plain_before_quote(data: bytes) -> bytes | None:
    """The bytes of ``data`` before its first ``"`` when they are a few printable ASCII
    characters with no escape (what a string's closing token such as ``.",`` carries
    before its quote), else None."""
    i = data.find(b'"')
    if i <= 0 or i > 4:
        return None
    head = data[:i]
    return head if all(0x20 <= b < 0x7F and b != 0x5C for b in head) else None


def _closes_first(kinds: list[str], data: bytes) -> bool:
    """Whether ``data`` closes the levels ``kinds`` (innermost first) with its first bytes,
    before anything else."""
    if len(data) < len(kinds):
        return False
    for kind, b in zip(kinds, data):
        if (b != 0x22) if kind == "s" else (b not in (0x7D, 0x5D)):
            return False
    return True


def _depth(state: _State) -> int:
    return state[0][2] if state[0] is not None else 0


_DIGIT_PERIOD = 16  # the longest group of digits a number's repetition is looked for in


class _DigitRuns:
    """The digits of the number being read: per period p (1-16) how many digits in a row
    equal the digit p before them, within one part of it (integer, fraction, exponent)."""

    __slots__ = ("last", "run")

    def __init__(self):
        self.last: list[int] = []  # the part's newest digits (_DIGIT_PERIOD at most)
        self.run = [0] * (_DIGIT_PERIOD + 1)

    def reset(self) -> None:
        self.last.clear()
        self.run = [0] * (_DIGIT_PERIOD + 1)

    def add(self, digit: int) -> None:
        last, run = self.last, self.run
        for p in range(1, _DIGIT_PERIOD + 1):
            run[p] = run[p] + 1 if len(last) >= p and last[-p] == digit else 0
        last.append(digit)
        if len(last) > _DIGIT_PERIOD:
            del last[0]

    def repeat(self, least: int) -> tuple[int, int] | None:
        """(digits covered, period) of the shortest-period repetition ending at the newest
        digit that covers ``least`` digits and two whole groups at least, or None."""
        for p in range(1, _DIGIT_PERIOD + 1):
            r = self.run[p]
            if r >= p and r + p >= least:
                return r + p, p
        return None


def _scan(state: _State, data: bytes, path: list, digits: _DigitRuns, base: int,
          events: list) -> _State:
    """The state after ``data`` (whose first byte is output byte ``base``); ``path`` (the
    open levels) and ``digits`` follow it. ``events`` gets, per array item (string, object
    or array) that closes, ``(array level, item start, item end)``, per array that closes
    ``(array level, None, None)``, and per sentence end in a string (``.``, ``!``, ``?``,
    ``,``, ``;``) ``(string level, None, end)``: byte offsets, end exclusive."""
    level, esc, num = state
    for at, b in enumerate(data, base):
        if level is not None and level[0] == "s":
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:  # quote
                if level[1] is not None and level[1][0] == "a":
                    events.append((level[1], level[3], at + 1))
                level = level[1]
                path.pop()
            elif b in _SENTENCE_END:
                events.append((level, None, at + 1))
            continue
        if b == 0x22 or b == 0x7B or b == 0x5B:  # " { [
            level = ("s" if b == 0x22 else "o" if b == 0x7B else "a", level,
                     len(path) + 1, at)
            path.append(level)
            num = False
        elif b in (0x7D, 0x5D):  # } ]
            if level is not None:
                if level[0] == "a":
                    events.append((level, None, None))
                if level[1] is not None and level[1][0] == "a":
                    events.append((level[1], level[3], at + 1))
                level = level[1]
                path.pop()
            num = False
        elif b in _NUMBER and (num or b not in b"eE+"):
            if not num:
                digits.reset()
            num = True
            if 0x30 <= b <= 0x39:
                digits.add(b)
            else:
                digits.reset()  # a new part: fraction or exponent
        else:
            num = False
    return level, esc, num


_SENTENCE_END = frozenset(b".!?,;")
# a byte that is a letter read as Latin-1 (what makes a token "hold a letter")
_ALPHA = re.compile(b"[" + re.escape(bytes(b for b in range(256) if chr(b).isalpha())) + b"]")
# progressions: the periods whose copies are compared per token, at most (the shortest)
_COUNT_LOOKS = 4
