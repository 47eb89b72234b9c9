"""The cache actor's hot lists and demand are bounded (grammar_cache/hot_list.py): a grammar
nobody asked for in ``hot_idle_s``, or past ``max_tracked_grammars``, is forgotten (spec,
request count, hot-list entry); configured hot grammars never are; the cursor never makes a
worker skip or repeat a grammar when entries are forgotten."""

import pytest

from grammar_cache.config import GrammarCacheConfig
from grammar_cache.hot_list import HotList
from core.grammar_spec import GrammarSpec

pytestmark = pytest.mark.unit

FP = "fp"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def spec(i: int) -> GrammarSpec:
    return GrammarSpec.regex(f"[a-z]{{{i}}}")


def hot_list(clock=None, **config) -> HotList:
    return HotList(GrammarCacheConfig(disk=False, **config), clock or Clock())


def ask_twice(hl: HotList, i: int) -> bool:
    s = spec(i)
    hl.seen(s.key(FP), s)
    hl.use(FP, s.key(FP), 1, s)
    return hl.use(FP, s.key(FP), 1, None)


def keys(pairs):
    return [k for k, _ in pairs]


def test_asked_twice_is_hot_and_sent_once_per_cursor():
    hl = hot_list()
    s = spec(1)
    assert not hl.use(FP, s.key(FP), 1, s)
    assert hl.use(FP, s.key(FP), 1, None)  # the spec was sent before
    cursor, new = hl.since(FP, 0)
    assert cursor == 1 and new == [(s.key(FP), s)]
    assert hl.since(FP, cursor) == (1, [])


def test_tracking_is_bounded_by_count_least_recent_forgotten_first():
    hl = hot_list(max_tracked_grammars=100)
    for i in range(1, 1001):  # a flood of distinct grammars, each asked twice
        ask_twice(hl, i)
    assert len(hl) == 100
    assert hl.hot_count(FP) == 100
    cursor, new = hl.since(FP, 0)
    assert cursor == 1000  # a sequence number: never goes back
    assert set(keys(new)) == {spec(i).key(FP) for i in range(901, 1001)}
    assert hl.spec(spec(1).key(FP)) is None and hl.requests(spec(1).key(FP)) == 0
    # a worker whose cursor was at 990 gets the ten added since, none skipped or repeated
    assert keys(hl.since(FP, 990)[1]) == [spec(i).key(FP) for i in range(991, 1001)]


def test_idle_grammars_age_out_and_start_from_zero():
    clock = Clock()
    hl = hot_list(clock, hot_idle_s=60)
    ask_twice(hl, 1)
    ask_twice(hl, 2)
    clock.t += 50
    hl.use(FP, spec(2).key(FP), 1, None)  # still in use: kept
    clock.t += 20  # grammar 1: nobody asked for 70 s
    cursor, new = hl.since(FP, 0)
    assert keys(new) == [spec(2).key(FP)] and cursor == 2
    assert len(hl) == 1
    # asked again: tracked from zero, hot again after the threshold, under a new cursor
    s1 = spec(1)
    assert not hl.use(FP, s1.key(FP), 1, s1)
    assert hl.use(FP, s1.key(FP), 1, None)
    assert hl.since(FP, cursor) == (3, [(s1.key(FP), s1)])


def test_configured_hot_grammars_are_never_forgotten():
    clock = Clock()
    hl = hot_list(clock, max_tracked_grammars=10, hot_idle_s=60)
    pinned = GrammarSpec.json_schema({"type": "object"})
    assert hl.pin(FP, pinned.key(FP), pinned)
    assert not hl.pin(FP, pinned.key(FP), pinned)  # a second worker's registration
    hl.use(FP, pinned.key(FP), 5, None)
    for i in range(1, 50):
        ask_twice(hl, i)
    clock.t += 3600
    _, new = hl.since(FP, 0)
    assert new == [(pinned.key(FP), pinned)]


def test_off_when_replication_is_off():
    hl = hot_list(replicate=False)
    assert not ask_twice(hl, 1)
    assert hl.since(FP, 0) == (0, [])


def test_config_checks_the_limits():
    with pytest.raises(ValueError, match="max_tracked_grammars"):
        GrammarCacheConfig(max_tracked_grammars=0)
    with pytest.raises(ValueError, match="hot_idle_s"):
        GrammarCacheConfig(hot_idle_s=float("inf"))
