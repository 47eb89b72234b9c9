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
object that stays open over the whole repetition; numbers and literals are never cut
(``1000000`` is not a loop). The cut is the earliest token boundary after one whole copy
(and after what was already streamed) that lies directly in that value and where the
grammar accepts the value's closer (``"``, ``]`` or ``}``): a string is closed, an array
ends once its ``minItems`` allow, an object once its required keys are in. A repetition
the grammar demands (``[5, 5, 5, 5, 5]`` with ``minItems: 5``, ``"aaaa"`` for ``a{4}``)
has no such boundary before the grammar is satisfied, so it is never shortened.

This module knows no engine: ``LoopGuard`` is fed tokens and answers with a ``LoopCut``;
the output policy (output_policy.py) rolls the matcher and the output back and forces the
closer.
"""

from __future__ import annotations

from dataclasses import dataclass

# scanner state after a byte: (container stack of "o"/"a" + "s" while in a string,
# in_escape, in_number)
_State = tuple[str, bool, bool]
_START: _State = ("", False, False)
_NUMBER = frozenset(b"-0123456789.eE+")
_CLOSER = {"s": b'"', "a": b"]", "o": b"}"}


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

    def __post_init__(self):
        for name, low in (("min_repeats", 2), ("long_span", 1), ("min_chars", 1),
                          ("max_period", 1), ("hold_tokens", 0), ("max_cuts", 0),
                          ("progression_repeats", 0)):
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
    progression: bool = False  # the copies differ in their digits / single letters


class LoopGuard:
    """One request's loop detector over its output tokens (see the module doc).
    ``vocab`` is the tokenizer's bytes per token id; ``closers`` maps "s"/"a"/"o" to the
    token id of that single closing byte."""

    def __init__(self, params: LoopGuardParams, vocab: list[bytes], closers: dict[str, int],
                 shapes: list[int] | None = None):
        self.params = params
        self.vocab = vocab
        self.closers = closers
        self.shapes = shapes if params.progression_repeats else None  # token_shapes(vocab)
        self.tokens: list[int] = []
        self.states: list[_State] = []  # scanner state after each token
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
        """Records one more output token."""
        i = len(self.tokens)
        toks, run = self.tokens, self._run
        toks.append(token)
        self.states.append(_scan(self.states[-1] if self.states else _START,
                                 self.vocab[token]))
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
        if self.states and self.states[-1][2]:  # inside a number: never a loop
            return None
        prm, run, n = self.params, self._run, len(self.tokens)
        for p in range(1, len(run)):
            copies = prm.min_repeats if p < prm.long_span else 2
            if run[p] < (copies - 1) * p:
                continue
            start = n - run[p] - p  # first token of the first copy
            if sum(len(self.vocab[t]) for t in self.tokens[start:]) < prm.min_chars:
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
            if sum(len(self.vocab[t]) for t in self.tokens[start:]) < prm.min_chars:
                continue
            cut = self._cut(start, n - p, may_close)
            if cut is None:
                self._retry_at, self._scan_from = n + 1, n
                return None
            return LoopCut(cut[0], cut[1], p, (srun[p] + p) // p, progression=True)
        return None

    def _in_string(self, start: int) -> bool:
        """Whether the value open over the whole repetition from ``start`` is a string."""
        before = self.states[start - 1] if start > 0 else _START
        depth = min(_depth(s) for s in [before] + self.states[start:])
        return depth > 0 and before[0][depth - 1] == "s"

    def _cut(self, start: int, first: int, may_close) -> tuple[int, tuple[int, ...]] | None:
        """The earliest place from ``first`` on to end the value open over the whole
        repetition (which began at ``start``)."""
        before = self.states[start - 1] if start > 0 else _START
        region = [before] + self.states[start:]
        depth = min(_depth(s) for s in region)
        if depth == 0:
            return None
        # the value open over the whole repetition: the first `depth` levels of every
        # state in it are the same (deeper levels close and reopen within)
        outer = before[0][:depth]
        if outer[-1] not in self.closers:
            return None
        for keep in range(max(first, self._scan_from), len(self.tokens) + 1):
            forced = self._closing(keep, depth, outer)
            if forced is not None and may_close(keep, forced):
                return keep, forced
        return None

    def _closing(self, keep: int, depth: int, outer: str) -> tuple[int, ...] | None:
        """The closer tokens that end the loop's value after the first ``keep`` tokens,
        or None where it cannot end there: directly inside it, or inside a child that the
        next token itself was closing (``},`` ends an array item and goes on: its ``}``
        is kept, then the array's ``]``)."""
        state = self.states[keep - 1]
        if state[0][:depth] != outer or state[1]:
            return None
        levels = state[0]
        if len(levels) > depth:
            if keep == len(self.tokens):
                return None
            # the next token must close the deeper levels before anything else
            inner = _scan_closing(state, self.vocab[self.tokens[keep]], depth)
            if inner is None:
                return None
        elif state[2] and (keep == len(self.tokens) or self.states[keep][2]):
            return None  # a number ends only where the next token does not go on with it
        closers = [self.closers.get(k) for k in reversed(levels[depth - 1:])]
        return None if None in closers else tuple(closers)

    def cut(self, keep: int, closers: tuple[int, ...]) -> None:
        """The output was cut to ``keep`` tokens and ``closers`` appended: follow it, and
        count no repetition across the cut."""
        del self.tokens[keep:]
        del self.states[keep:]
        self.floor = keep
        self._run = [0] * len(self._run)
        self._shape_run = [0] * len(self._shape_run)
        self._scan_from = 0
        self.cuts += 1
        for t in closers:
            self.push(t)


def closer_ids(vocab: list[bytes]) -> dict[str, int]:
    """The token ids of the single bytes ``"``, ``]`` and ``}`` (kinds "s", "a", "o")."""
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


def _scan_closing(state: _State, data: bytes, depth: int) -> bool | None:
    """True when ``data``, read from ``state``, closes down to ``depth`` levels with its
    first bytes, before anything else; else None."""
    stack = state[0]
    for b in data:
        if len(stack) <= depth:
            return True
        if stack.endswith("s"):
            if b != 0x22:
                return None
        elif b not in (0x7D, 0x5D):
            return None
        stack = stack[:-1]
    return True if len(stack) <= depth else None


def _depth(state: _State) -> int:
    return len(state[0])


def _scan(state: _State, data: bytes) -> _State:
    stack, esc, num = state
    for b in data:
        if stack.endswith("s"):
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:  # quote
                stack = stack[:-1]
            continue
        if b == 0x22:
            stack += "s"
            num = False
        elif b in (0x7B, 0x5B):  # { [
            stack += "o" if b == 0x7B else "a"
            num = False
        elif b in (0x7D, 0x5D):  # } ]
            stack = stack[:-1]
            num = False
        elif b in _NUMBER and (num or b not in b"eE+"):
            num = True
        else:
            num = False
    return stack, esc, num
