"""The scheduler's limits without Ray: a session's request is refused (429) when its own
worker is over its queue limit, and live sessions are capped per worker and in total."""

import pytest

from deploy.errors import for_exception
from scheduler.actor import SchedulerConfig
from core.errors import Overloaded, TooManySessions
from scheduler.routing import RoutingTable

pytestmark = pytest.mark.unit


def table(n=2, **kw):
    t = RoutingTable(**kw)
    for i in range(n):
        t.add_worker(f"w{i}", handle=f"h{i}")
    return t


def test_a_session_over_its_workers_queue_limit_gets_a_429():
    t = table(2, max_queued_tokens=1000)
    w = t.route("s", expected_tokens=600).worker_id
    other = next(x for x in t.workers if x != w)
    with pytest.raises(Overloaded, match="session_id 's'.*retry later"):
        t.route("s", expected_tokens=600)  # sticky, yet its worker is full
    assert t.sessions["s"][0] == w  # the session stays where its KV is
    assert t.route(None, expected_tokens=600).worker_id == other  # others are served
    t.update_load(w, {"running_tokens": 0, "waiting_tokens": 0})
    assert t.route("s", expected_tokens=600).worker_id == w  # served once it drains


def test_one_session_cannot_queue_unbounded_work():
    t = table(1, max_queued_tokens=2000)
    routed = 0
    with pytest.raises(Overloaded):
        for _ in range(100):
            t.route("flood", expected_tokens=256)
            routed += 1
    assert routed * 256 <= 2000


def test_an_idle_worker_takes_a_sessions_large_request():
    t = table(1, max_queued_tokens=1000)
    t.route("s", expected_tokens=10)
    t.update_load("w0", {"running_tokens": 0, "waiting_tokens": 0})
    assert t.route("s", expected_tokens=50_000).worker_id == "w0"


def test_sessions_per_worker_are_capped():
    t = table(2, max_sessions_per_worker=2)
    placed = [t.route(f"s{i}").worker_id for i in range(4)]
    assert sorted(placed) == ["w0", "w0", "w1", "w1"]
    with pytest.raises(TooManySessions, match="session_id 'new'.*2 live sessions"):
        t.route("new")
    assert t.route("s0").worker_id == placed[0]  # live sessions go on
    assert t.route(None) is not None  # so do requests without a session
    t.end_session("s1")
    assert t.route("new").worker_id == placed[1]  # an ended session frees its slot


def test_a_full_worker_is_skipped_for_new_sessions():
    t = table(2, max_sessions_per_worker=1)
    t.update_load("w1", {"running_tokens": 5000, "waiting_tokens": 0})
    assert t.route("a").worker_id == "w0"
    assert t.route("b").worker_id == "w1"  # w0 is less loaded but holds its cap


def test_live_sessions_are_capped_in_total():
    t = table(3, max_sessions=2)
    t.route("a")
    t.route("b")
    with pytest.raises(TooManySessions, match="session_id 'c'.*limit is 2"):
        t.route("c")
    t.route("a")  # existing sessions are not new
    t.end_session("a")
    t.route("c")


def test_counts_follow_ends_drops_moves_and_restores():
    t = table(2, max_sessions_per_worker=5)
    for s in ("a", "b", "c"):
        t.route(s)
    w = t.sessions["a"][0]
    t.suspect(w)
    moved = t.route("a").worker_id  # moves off a slow worker: counted once, where it is
    assert moved != w and sum(t.sessions_on.values()) == len(t.sessions) == 3
    t.drop_worker(moved)
    assert sum(t.sessions_on.values()) == len(t.sessions)
    t.restore_sessions("w9", ["x", "y"])
    t.restore_sessions("w9", ["x"])
    assert t.sessions_on["w9"] == 2
    for s in list(t.sessions):
        t.end_session(s)
    assert not t.sessions and not +t.sessions_on


def test_too_many_sessions_is_a_429_naming_session_id():
    t = table(1, max_sessions=1)
    t.route("a")
    with pytest.raises(TooManySessions) as refused:
        t.route("b")
    err = for_exception(refused.value)
    assert err.status == 429 and "session_id 'b'" in err.message
    assert err.headers.get("Retry-After")


@pytest.mark.parametrize("field", ["max_sessions_per_worker", "max_sessions",
                                   "max_queued_tokens"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "10", True])
def test_config_refuses_a_cap_that_is_not_a_positive_integer(field, value):
    with pytest.raises(ValueError, match=f"scheduler.{field}"):
        SchedulerConfig(**{field: value})
