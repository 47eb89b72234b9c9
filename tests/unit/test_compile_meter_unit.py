"""CompileMeter (worker/guided/compile_meter.py): a client's grammar checks take at most
their share of a worker's compile time; a clock of the test's own, so nothing is timed."""

import pytest

from worker.guided.compile_meter import MAX_RUNNING, CompileMeter

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_debt_drains_at_the_share_and_the_wait_says_when():
    clock = Clock()
    meter = CompileMeter(share=0.1, burst_s=1.0, clock=clock)
    assert meter.wait_s("a") == 0
    meter.begin("a")
    meter.end("a", 3.0)  # three seconds owed; its next compile is expected to cost 1.5,
    # more than the burst alone: it starts once nothing is owed (drained at 0.1 s a second)
    assert meter.wait_s("a") == pytest.approx(30.0)
    assert meter.wait_s("b") == 0  # another client is not charged
    clock.now += 10
    assert meter.wait_s("a") == pytest.approx(20.0)
    clock.now += 20
    assert meter.wait_s("a") == 0
    assert meter.refusals == 2


def test_compiles_still_running_count_so_a_burst_of_asks_cannot_start_many():
    clock = Clock()
    meter = CompileMeter(share=0.1, burst_s=1.0, clock=clock)
    started = 0
    for _ in range(10):  # ten asks at once, before any compile ends or is charged
        if meter.wait_s("flood") == 0:
            meter.begin("flood")
            started += 1
    assert started == 2
    # nothing is owed yet; the two running are counted at half the burst each, and the
    # third fits once they have drained to half the burst
    assert meter.wait_s("flood") == pytest.approx(5.0)
    for _ in range(2):
        meter.end("flood", 0.001)  # cheap: next to nothing owed
    assert meter.wait_s("flood") == 0


def test_a_long_running_compile_counts_for_its_time_so_far():
    clock = Clock()
    meter = CompileMeter(share=0.1, burst_s=1.0, clock=clock)
    meter.begin("a")
    assert meter.wait_s("a") == 0
    clock.now += 1.5  # still running: 1.5 s counted, over the burst
    assert meter.wait_s("a") == pytest.approx(10.0)  # (1.5 + 0.5 - 1) / 0.1
    assert meter.wait_s("a") >= 1.0


def test_report_cpu_is_charged_and_clients_are_bounded():
    clock = Clock()
    meter = CompileMeter(share=0.5, burst_s=0.0, max_clients=2, clock=clock)
    meter.charge("a", 1.0)
    assert meter.wait_s("a") == pytest.approx(2.0)
    meter.charge("b", 0.0)
    meter.charge("c", 0.0)  # "a", the longest idle, is forgotten
    assert meter.debt_s("a") == 0 and len(meter._accounts) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="share"):
        CompileMeter(share=0)


def test_an_idle_worker_slows_nobody_but_caps_the_compiles_running():
    clock = Clock()
    meter = CompileMeter(share=0.1, burst_s=1.0, clock=clock)
    meter.begin("a")
    meter.end("a", 30.0)  # far over its share
    assert meter.wait_s("a", busy=False) == 0  # nobody else is served: idle CPU is its
    assert meter.wait_s("a", busy=True) == pytest.approx(300.0)
    for _ in range(MAX_RUNNING):
        meter.begin("a")
    assert meter.wait_s("a", busy=False) == 1.0  # at most MAX_RUNNING at once


def test_a_clients_known_mean_cost_sizes_its_next_compile():
    """Cheap compiles (a client checking small grammars between its requests) leave room
    for more at once; the half-burst estimate is only for a client whose cost is unknown."""
    clock = Clock()
    meter = CompileMeter(share=0.1, burst_s=1.0, clock=clock)
    meter.begin("a")
    meter.end("a", 0.01)
    meter.charge("a", 0.5)  # a report's CPU
    started = 0
    for _ in range(5):
        if meter.wait_s("a") == 0:
            meter.begin("a")
            started += 1
    assert started == MAX_RUNNING  # 0.51 owed + 0.01 each: within the burst


def test_a_worker_serves_others_while_another_clients_request_is_recent():
    from collections import OrderedDict

    from worker.actor import arrived_since

    arrivals = OrderedDict([("polite", 10.0), ("flood", 12.0)])  # the newest last
    assert arrived_since(arrivals, "flood", since=8.0)  # polite's request is recent
    assert not arrived_since(arrivals, "flood", since=11.0)  # only its own since
    assert not arrived_since(arrivals, "polite", since=12.0)
    assert arrived_since(arrivals, "polite", since=11.0)


def test_an_open_request_of_another_client_counts():
    import asyncio

    from worker.engine.async_engine import AsyncEngine, _Stream

    loop = asyncio.new_event_loop()
    try:
        engine = AsyncEngine.__new__(AsyncEngine)  # only its open streams are read
        engine._streams = {"r1": _Stream(loop, "polite")}
        assert engine.serves_other_than("flood")
        assert not engine.serves_other_than("polite")
    finally:
        loop.close()
