"""Loop guard: find a guided JSON output cycling inside one value, and where to end it.

A small model under a grammar often falls into a loop inside a free-form value
(``"bacon, eggs, bacon, eggs, ..."``, the same array item again and again, the same free
key) and runs to its budget. The output still parses once closed, but it is useless, and
its ``length`` finish makes client libraries refuse it. The guard ends such a value where
the repetition began, and the rest of the document goes on.

Detection works on token ids, per request, in O(max_period) per token:

    run[p]  = how many tokens in a row equal the token p places before them
    a loop  = the smallest period p with run[p] >= (copies(p) - 1) * p, where
              copies(p) = min_repeats (3) for short spans, 2 from long_span (8) tokens up,
              and the repeated text is at least min_chars (16) characters long

A **progression** is the same loop with counters in it (``"v2.0", "v3.0", "v4.0", ...``,
``"b", "c", "d", ...``, ``{"name": "A", "quantity": 1}, {"name": "B", "quantity": 2}, ...``):
the same run over token *shapes*, where every all-digit token is one shape and every
single-letter token another. A progression needs ``progression_repeats`` (8) copies, and
outside a string the repeated text must hold a letter (so ``[90, 85, 77, ...]`` and lists
of dates are never progressions; a string counting ``"49, 50, 51, ..."`` is one), and it is ended where it was found (the copies seen are
kept, the value closed at the first place it can close from the start of the newest copy):
an enumeration the user asked for loses its tail, not its head.

A JSON scanner follows the output byte by byte (strings, escapes, numbers, nesting), so
each token boundary knows its nesting. The loop's value is the innermost string, array or
object that stays open over the whole repetition; a repetition of tokens inside a number
or literal is never cut (``1000000`` is not a loop). The cut is the earliest token boundary after one whole copy
(and after what was already streamed) that lies directly in that value and where the
grammar accepts the value's closer (``"``, ``]`` or ``}``): a string is closed, an array
ends once its ``minItems`` allow, an object once its required keys are in. A repetition
the grammar demands (``[5, 5, 5, 5, 5]`` with ``minItems: 5``, ``"aaaa"`` for ``a{4}``)
has no such boundary before the grammar is satisfied, so it is never shortened.

A **number** loops when its digits repeat one group of up to 4 digits over
``number_digits`` (20) digits within one part of it (``1111...``, ``0.3333...``,
``1212...``; xgrammar's grammar bounds a number's digits itself, llguidance's may not): it
ends at the newest token, and the value around it is closed, or (the schema wants more) a
comma lets the object or array go on. A double prints at most 17 significant digits, an
int64 19, and round numbers people write (``602214076000000000000000``) repeat under 20.

Cost: O(max_period) work and a few small objects per token, also where a loop cannot be
cut (a ``minLength`` string of one character: each token looks at the newest boundary
only, and the repetition's length and lowest depth come from running sums, not rescans);
a state refers to its innermost nesting level, shared, never to a copy of the stack.
Nothing is recorded while the guard is off or its cuts are spent.

This module knows no engine: ``LoopGuard`` is fed tokens and answers with a ``LoopCut``;
the output policy (output_policy.py) rolls the matcher and the output back and forces the
closer.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# an open nesting level: (kind "o"/"a"/"s", the level it is in or None, its depth from 1);
# a state's innermost level leads to all of them, so a state never copies its stack
_Level = tuple
# scanner state after a token: (innermost open level or None, in_escape, in_number)
_State = tuple
_START: _State = (None, False, False)
_NUMBER = frozenset(b"-0123456789.eE+")
_CLOSER = {"s": b'"', "a": b"]", "o": b"}", ",": b","}


@dataclass(frozen=True)
class LoopGuardParams:
    """How a request's loop guard decides (per request; the server's default otherwise).
    ``hold_tokens``: how many of the newest tokens are held back from the stream, so that a
    cut can still remove them (0: a loop found after its text was sent ends where it is)."""

    enabled: bool = True
    min_repeats: int = 3
    long_span: int = 8
    min_chars: int = 16
    max_period: int = 48
    hold_tokens: int = 16
    max_cuts: int = 8
    progression_repeats: int = 8  # 0: progressions are not looked for
    number_digits: int = 20  # a number's digits repeating this long end it (0: never)

    def __post_init__(self):
        for name, low in (("min_repeats", 2), ("long_span", 1), ("min_chars", 1),
                          ("max_period", 1), ("hold_tokens", 0), ("max_cuts", 0),
                          ("progression_repeats", 0), ("number_digits", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"invalid loop_guard.{name}={value!r}: must be an integer "
                                 f">= {low}")
        if self.max_period > 256 or self.hold_tokens > 256:
            raise ValueError("loop_guard.max_period and loop_guard.hold_tokens must be <= 256")
        if self.progression_repeats == 1:
            raise ValueError("loop_guard.progression_repeats must be 0 (off) or >= 2")

    @classmethod
    def from_value(cls, value) -> "LoopGuardParams":
        """A request's ``loop_guard``: true / false, or an object of these fields."""
        if isinstance(value, bool):
            return cls(enabled=value)
        if isinstance(value, dict):
            known = {f for f in cls.__dataclass_fields__}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown loop_guard field(s) {unknown}; known: "
                                 f"{sorted(known)}")
            return cls(**value)
        raise ValueError("loop_guard must be true, false or an object of its fields")


@dataclass(frozen=True)
class LoopCut:
    """Keep the first ``keep`` output tokens, then force ``closers``."""

    keep: int
    closers: tuple[int, ...]  # token ids forced after the kept tokens: the value's closer,
    # after those of values inside it that the next token was closing
    period: int  # the repeated span, in tokens
    repeats: int  # whole copies seen when it was found
    # "repeat": exact copies; "progression": copies that differ in their digits / single
    # letters; "number": a number's digits repeating (period and repeats count digits)
    kind: str = "repeat"

    @property
    def progression(self) -> bool:
        return self.kind == "progression"


class LoopGuard:
    """One request's loop detector over its output tokens (see the module doc).
    ``vocab`` is the tokenizer's bytes per token id; ``closers`` maps "s"/"a"/"o" (and
    "," where the vocabulary has it) to the token id of that single byte.

    Cost: O(max_period) per token, whatever the output; what it keeps is a few small
    objects per token (a nesting level is one shared node, never a copy of the stack)."""

    def __init__(self, params: LoopGuardParams, vocab: list[bytes], closers: dict[str, int],
                 shapes: list[int] | None = None):
        self.params = params
        self.vocab = vocab
        self.closers = closers
        self.shapes = shapes if params.progression_repeats else None  # token_shapes(vocab)
        self.tokens: list[int] = []
        self.states: list[_State] = []  # scanner state after each token
        self._chars = [0]  # bytes of tokens[:i], per i
        self._path: list[_Level] = []  # the levels open after the newest token, outermost first
        # suffix minima of the states' depths: indices rising, depths strictly rising; the
        # lowest depth from state i on is that of the first entry at or after i
        self._min_at: list[int] = []
        self._min_depth: list[int] = []
        self._digits = _DigitRuns()
        self.floor = 0  # no repetition is counted from before here (the last cut)
        self.cuts = 0
        self._run = [0] * (params.max_period + 1)
        self._shape_run = [0] * (params.max_period + 1)  # the same, over shapes
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
        toks, run = self.tokens, self._run
        toks.append(token)
        data = self.vocab[token]
        self._chars.append(self._chars[-1] + len(data))
        state = _scan(self.states[-1] if self.states else _START, data, self._path,
                      self._digits)
        self.states.append(state)
        depth = _depth(state)
        while self._min_depth and self._min_depth[-1] >= depth:
            self._min_at.pop()
            self._min_depth.pop()
        self._min_at.append(i)
        self._min_depth.append(depth)
        for p in range(1, len(run)):
            j = i - p
            run[p] = run[p] + 1 if j >= self.floor and toks[j] == token else 0
        shapes = self.shapes
        if shapes is not None:
            srun, shape = self._shape_run, shapes[token]
            for p in range(1, len(srun)):
                j = i - p
                srun[p] = srun[p] + 1 if j >= self.floor and shapes[toks[j]] == shape else 0

    def find(self, may_close) -> LoopCut | None:
        """A cut for a loop that ends at the newest token, or None. ``may_close(keep,
        closers)`` says whether the grammar accepts ``closers`` after the first ``keep``
        output tokens (and that ``keep`` is not before what was already streamed)."""
        if not self.active or len(self.tokens) < self._retry_at:
            return None
        if self.states and self.states[-1][2]:  # inside a number: only its digits loop
            return self._number(may_close)
        prm, run, n = self.params, self._run, len(self.tokens)
        for p in range(1, len(run)):
            copies = prm.min_repeats if p < prm.long_span else 2
            if run[p] < (copies - 1) * p:
                continue
            start = n - run[p] - p  # first token of the first copy
            if self._chars[n] - self._chars[start] < prm.min_chars:
                continue
            cut = self._cut(start, start + p, may_close)
            if cut is None:
                # no place yet (or the places were streamed already): look at the next
                # token's boundary only (a whole copy later would stay in phase with the
                # boundaries it keeps missing)
                self._retry_at, self._scan_from = n + 1, n
                return None
            return LoopCut(cut[0], cut[1], p, (run[p] + p) // p)
        return self._progression(may_close) if self.shapes is not None else None

    def _number(self, may_close) -> LoopCut | None:
        """A number whose digits repeat one group of up to 4 digits over ``number_digits``
        digits (``1111...``, ``0.3333...``, ``1212...``) ends at the newest token: the
        value around it is closed, or where that cannot be, a comma lets it go on."""
        prm, n = self.params, len(self.tokens)
        span, period = self._digits.longest()
        if not prm.number_digits or span < prm.number_digits or not self._path:
            return None
        options = [self.closers.get(self._path[-1][0]), self.closers.get(",")]
        for closer in options:
            if closer is not None and may_close(n, (closer,)):
                return LoopCut(n, (closer,), period, span // period, kind="number")
        self._retry_at = n + 1
        return None

    def _progression(self, may_close) -> LoopCut | None:
        prm, srun, n = self.params, self._shape_run, len(self.tokens)
        shapes = self.shapes
        for p in range(1, len(srun)):
            if srun[p] < (prm.progression_repeats - 1) * p:
                continue
            start = n - srun[p] - p
            span = self.tokens[n - p:]
            # a letter in it, or inside a string: runs of numbers and dates are data,
            # not a loop (a string counting "49, 50, 51, ..." is one)
            if not (self._in_string(start) or any(
                    shapes[t] == LETTER or any(chr(b).isalpha() for b in self.vocab[t])
                    for t in span)):
                continue
            if self._chars[n] - self._chars[start] < prm.min_chars:
                continue
            cut = self._cut(start, n - p, may_close)
            if cut is None:
                self._retry_at, self._scan_from = n + 1, n
                return None
            return LoopCut(cut[0], cut[1], p, (srun[p] + p) // p, kind="progression")
        return None

    def _region_depth(self, start: int) -> int:
        """The lowest depth from before token ``start`` to the newest token: the levels
        down to it stayed open over the whole region."""
        if start == 0:
            return 0
        k = bisect_left(self._min_at, start - 1)
        return self._min_depth[k]

    def _in_string(self, start: int) -> bool:
        """Whether the value open over the whole repetition from ``start`` is a string."""
        depth = self._region_depth(start)
        return depth > 0 and self._path[depth - 1][0] == "s"

    def _cut(self, start: int, first: int, may_close) -> tuple[int, tuple[int, ...]] | None:
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
        for keep in range(max(first, self._scan_from), len(self.tokens) + 1):
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
        if deeper and not _closes_first(kinds, data):
            return None
        closers = [self.closers.get(k) for k in kinds + [outer[0]]]
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
        # no repetition is counted from before the cut: one state's minimum is enough
        self._min_at = [keep - 1] if keep else []
        self._min_depth = [_depth(self.states[-1])] if keep else []
        self._digits = _DigitRuns()
        self.floor = keep
        self._run = [0] * len(self._run)
        self._shape_run = [0] * len(self._shape_run)
        self._scan_from = 0
        self._retry_at = 0
        for t in closers:
            self.push(t)


def closer_ids(vocab: list[bytes]) -> dict[str, int]:
    """The token ids of the single bytes ``"``, ``]``, ``}`` and ``,`` (kinds "s", "a",
    "o", ",")."""
    found = {}
    for tid, raw in enumerate(vocab):
        for kind, byte in _CLOSER.items():
            if raw == byte and kind not in found:
                found[kind] = tid
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


class _DigitRuns:
    """The digits of the number being read: per period p (1-4) how many digits in a row
    equal the digit p before them, within one part of it (integer, fraction, exponent)."""

    __slots__ = ("last", "run")

    def __init__(self):
        self.last: list[int] = []  # the part's newest digits (4 at most)
        self.run = [0] * 5

    def reset(self) -> None:
        self.last.clear()
        self.run = [0] * 5

    def add(self, digit: int) -> None:
        last, run = self.last, self.run
        for p in range(1, 5):
            run[p] = run[p] + 1 if len(last) >= p and last[-p] == digit else 0
        last.append(digit)
        if len(last) > 4:
            del last[0]

    def longest(self) -> tuple[int, int]:
        """(digits covered by the longest repetition ending at the newest digit, its
        period)."""
        p = max(range(1, 5), key=lambda q: (self.run[q] + q if self.run[q] else 0, -q))
        return (self.run[p] + p if self.run[p] else 0), p


def _scan(state: _State, data: bytes, path: list, digits: _DigitRuns) -> _State:
    """The state after ``data``; ``path`` (the open levels) and ``digits`` follow it."""
    level, esc, num = state
    for b in data:
        if level is not None and level[0] == "s":
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:  # quote
                level = level[1]
                path.pop()
            continue
        if b == 0x22 or b == 0x7B or b == 0x5B:  # " { [
            level = ("s" if b == 0x22 else "o" if b == 0x7B else "a", level,
                     len(path) + 1)
            path.append(level)
            num = False
        elif b in (0x7D, 0x5D):  # } ]
            if level is not None:
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
