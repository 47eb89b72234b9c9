"""How the loop guard (loop_guard.py) compares array items and sentences for near repeats:
an item as its text with every number made ``#`` and its numbers (``item_shape``), how its
numbers stepped (``steps``), a copied item that slips a word (``variant``), a sentence
that restarts the one before (``near_sentence``), and one open array's run of near copies
(``ItemRun``). Pure functions of the texts: the guard reads each item and sentence once,
when it ends, and keeps the state."""

from __future__ import annotations

import datetime
import re

ITEM_BYTES = 4096  # longer array items are not compared (bounds the work per item)
# array items that cycle: A, B, C, A, B, C ... (each compared with up to 6 before: a
# round of 4 short items, 80 tokens, is past the exact detector's 48)
MAX_CYCLE = 6
VARIANT_BYTES = 12  # a variant item's edit, at most (see variant)
VARIANT_KEPT = 16  # and the text of its string kept around it, at least
SENTENCE_CYCLE = 2  # sentences: each compared with the 2 before
SENTENCE_BYTES = 1024
COUNTER = re.compile(rb"[0-9]+(?:\.[0-9]+)?")
SPACE = re.compile(rb"\s+")
ASCII_LETTER = re.compile(rb"[A-Za-z]")
DATE_SHAPE = b'"#-#-#"'  # an ISO date as a string item ("2022-01-31")


def near_rounds(prm, c: int) -> int:
    """How many rounds of near copies end an array whose items cycle every ``c``:
    ``near_repeats`` items in a row (c = 1); a longer cycle ``near_repeats`` items in all
    and one round more, but at least ``min_repeats`` + 1 rounds (2 items: 5 rounds, 3 or
    more: 4). Eight rounds of three order lines (24 items, ~450 tokens) ran past the
    clients bench's budget of 512 before they were ended."""
    if c == 1:
        return prm.near_repeats
    return max(prm.min_repeats + 1, -(-prm.near_repeats // c) + 1)


def real_date(counters: list[float]) -> bool:
    """Whether a date item's numbers (year, month, day) name a day of the calendar."""
    try:
        datetime.date(*(int(x) for x in counters))
    except (TypeError, ValueError, OverflowError):
        return False
    return all(x == int(x) for x in counters)


def item_shape(item: bytes) -> tuple[bytes, list[float]]:
    """An array item as its text with every run of digits (a number, or digits in a
    string) one ``#`` and no whitespace, and those numbers in order."""
    return SPACE.sub(b"", COUNTER.sub(b"#", item)), numbers(item)


def numbers(text: bytes) -> list[float]:
    """The numbers in ``text`` (each run of digits, with a fraction), in order."""
    return [float(m) for m in COUNTER.findall(text)]


def variant(a: bytes, b: bytes) -> bool:
    """Whether item shape ``b`` is ``a`` with one small edit (up to VARIANT_BYTES, a third
    of what is kept) inside one string whose kept text is VARIANT_KEPT bytes or more
    (``"... Smoked Paprika Croutons,"`` -> ``"... Smoked Paprika Crouton Croutons,"``): a
    model copying its item and slipping a word. Distinct names (``"Alice"``, ``"Bob"``)
    keep nothing of their string; an edit across a quote changes the item's structure."""
    n = min(len(a), len(b))
    p = 0
    while p < n and a[p] == b[p]:
        p += 1
    s = 0
    while s < n - p and a[-1 - s] == b[-1 - s]:
        s += 1
    edit_a, edit_b = a[p:len(a) - s], b[p:len(b) - s]
    edit = max(len(edit_a), len(edit_b))
    if not edit or b'"' in edit_a or b'"' in edit_b:
        return False
    head = a[:p]
    if (head.count(b'"') - head.count(b'\\"')) % 2 == 0:  # the edit is not in a string
        return False
    opened = head.rfind(b'"')
    closed = a.find(b'"', len(a) - s)
    if closed < 0:
        return False
    kept = (p - opened - 1) + (closed - (len(a) - s))
    return edit <= VARIANT_BYTES and kept >= VARIANT_KEPT and 3 * edit <= kept


def steps(a: list[float], b: list[float]) -> list[float]:
    return [y - x for x, y in zip(a, b)]


def same_steps(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))


def near_sentence(a: list[bytes], b: list[bytes]) -> bool:
    """Whether sentence ``b`` restarts ``a`` with a changed word: both of 3 words or more,
    and one word changed (or none), or the same first 4 words."""
    if min(len(a), len(b)) < 3:
        return False
    if len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 1:
        return True
    return len(a) >= 4 and len(b) >= 4 and a[:4] == b[:4]


class ItemRun:
    """One open array's near repeats: its newest items (up to MAX_CYCLE: text shape,
    numbers, and per cycle length how it stepped from the item that many before), and per
    cycle length how many items in a row are near copies of the item that many before."""

    __slots__ = ("items", "ends", "counts", "end", "past")

    def __init__(self):
        self.end = 0  # where the newest item ended (byte offset, exclusive)
        self.past = None  # counting dates: the boundary before the first past the calendar
        self.items: list[tuple[bytes, list[float], list]] = []
        self.ends: list[int] = []  # where each of those items ended (byte offset)
        self.counts = [0] * (MAX_CYCLE + 1)
