"""deploy/refusals.py: a client refused with a Retry-After is answered at the edge until it
passes, other clients are not, and the memory stays bounded."""

import pytest

from deploy.refusals import Refusals

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_refused_client_waits_out_its_retry_after_and_no_other_does():
    clock = Clock()
    r = Refusals(clock=clock)
    assert r.wait_left("flood") == 0
    r.refused("flood", "1")
    assert r.wait_left("flood") == pytest.approx(1.0)
    assert r.wait_left("polite") == 0 and r.wait_left(None) == 0
    clock.now += 0.6
    assert r.wait_left("flood") == pytest.approx(0.4)
    clock.now += 0.5
    assert r.wait_left("flood") == 0  # past it: asked again (and forgotten)
    assert r.answered == 2


def test_odd_retry_afters_and_many_clients():
    clock = Clock()
    r = Refusals(max_clients=3, clock=clock)
    for bad in (None, "", "soon", "0", "-4"):
        r.refused("c", bad)
    assert r.wait_left("c") == 0
    r.refused(None, "1")  # no client: nothing to key
    r.refused("c", "3600")
    assert r.wait_left("c") == pytest.approx(60.0)  # capped
    for i in range(5):
        r.refused(f"other{i}", "1")
    assert r.wait_left("c") == 0  # the oldest was let go: asked again, never refused wrongly
    assert len(r._until) == 3
