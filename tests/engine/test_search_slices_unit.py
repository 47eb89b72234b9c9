"""SearchSlices (worker/guided/search_slices.py): searches run in slices of the engine
thread's time, at most a step's budget each step, suspended where they check the clock.

A fake clock (``closing.CLOCK``) makes the budget exact: a search "costs" what it adds to
the clock, so each test says how many units a step may spend and checks it never spent
more than that plus one unit (a search yields only where it checks)."""

import pytest

from worker.guided import closing
from worker.guided.search_slices import SearchSlices

pytestmark = pytest.mark.unit

UNIT = 0.001  # one node of a fake search: 1 ms of the fake clock


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(closing, "CLOCK", lambda: now[0])
    return now


def search(slices, clock, nodes, value, log=None):
    """A search of ``nodes`` nodes that checks its clock after each (as closing.py's
    ``_late`` does), giving the time it was away back to its own limit."""
    def run():
        own_time = 0.0
        for i in range(nodes):
            clock[0] += UNIT
            own_time += UNIT
            if log is not None:
                log.append(i)
            slices.due()
        return value, own_time
    return run


def test_a_short_search_answers_at_once(clock):
    slices = SearchSlices(share=0.5, floor_ms=5.0)
    slices.begin_step()
    done = slices.run("k", "r1", search(slices, clock, 3, "path"))
    assert done is not None and done.value[0] == "path"
    assert not slices.pending and "k" not in slices


def test_a_long_search_goes_on_over_steps_within_each_step_s_budget(clock):
    slices = SearchSlices(share=0.5, floor_ms=5.0)
    slices.begin_step()
    log = []
    assert slices.run("k", "r1", search(slices, clock, 23, "path", log)) is None
    assert slices.pending and len(log) == 5  # the floor's 5 ms, then suspended
    steps, ended = 1, set()
    while not ended:
        slices.begin_step()
        ended = slices.advance()
        steps += 1
    assert ended == {"r1"} and steps == 5  # 5 + 5 + 5 + 5 + 3 nodes
    done = slices.run("k", "r1", None)
    # the search's own time counts only its nodes, not the steps between its slices
    assert done.value == ("path", pytest.approx(23 * UNIT))
    assert done.cpu_s == pytest.approx(23 * UNIT)
    assert slices.stats.search_step_max_ms <= 5 + 1
    assert slices.stats.searches_sliced == 1
    assert "k" not in slices  # handed over once


def test_the_budget_is_a_share_of_the_engine_s_own_step_time(clock):
    slices = SearchSlices(share=0.5, floor_ms=1.0)
    slices.begin_step()
    for _ in range(30):  # steps of 20 ms of the engine's own work
        clock[0] += 0.020
        slices.begin_step()
    assert slices.budget_s == pytest.approx(0.010, rel=0.05)
    log = []
    slices.run("k", "r1", search(slices, clock, 100, None, log))
    assert 9 <= len(log) <= 11
    # a step's searches are not the engine's own time: the share does not grow from them
    slices.begin_step()
    assert slices.budget_s == pytest.approx(0.010, rel=0.1)


def test_several_searches_share_one_step_s_budget_oldest_first(clock):
    slices = SearchSlices(share=0.5, floor_ms=4.0)
    slices.begin_step()
    logs = {k: [] for k in "abc"}
    for k in "abc":
        slices.run(k, "r-" + k, search(slices, clock, 6, k, logs[k]))
    assert [len(logs[k]) for k in "abc"] == [4, 0, 0]
    slices.begin_step()
    assert slices.advance() == {"r-a"}
    assert [len(logs[k]) for k in "abc"] == [6, 2, 0]


def test_owners_share_a_search_and_dropping_the_last_kills_it(clock):
    slices = SearchSlices(share=0.5, floor_ms=2.0)
    slices.begin_step()
    log = []
    assert slices.run("k", "r1", search(slices, clock, 50, None, log)) is None
    assert slices.run("k", "r2", None) is None  # the same search: not started twice
    slices.drop("r1")
    assert "k" in slices  # r2 still waits for it
    slices.drop("r2")
    assert "k" not in slices and not slices.pending
    before = len(log)
    slices.begin_step()
    slices.advance()
    assert len(log) == before  # killed where it was suspended: it never runs again


def test_a_search_that_raises_fails_its_owner_alone(clock):
    slices = SearchSlices(share=0.5, floor_ms=2.0)

    def broken():
        clock[0] += 3 * UNIT
        slices.due()
        raise RuntimeError("broken search")

    slices.begin_step()
    assert slices.run("bad", "r1", broken) is None
    slices.run("good", "r2", search(slices, clock, 1, "ok"))
    slices.begin_step()
    assert slices.advance() >= {"r1"}
    with pytest.raises(RuntimeError, match="broken search"):
        slices.run("bad", "r1", None)
    assert not slices.pending
