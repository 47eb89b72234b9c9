"""A restarted scheduler finds its workers by name. One too busy to answer the rebuild must
still be found once it answers: it registered with the scheduler that died and will not
register again (CI: a worker missing for good after the scheduler was killed under load)."""

import asyncio

import pytest

from scheduler.actor import SchedulerActor, SchedulerConfig

pytestmark = pytest.mark.unit


class SlowWorker:
    """A worker handle whose first ``slow`` load reports take longer than the timeout."""

    def __init__(self, worker_id: str, slow: int, sessions=()):
        self.worker_id, self.slow, self.sessions, self.asked = worker_id, slow, sessions, 0
        self.load = self

    def remote(self):
        self.asked += 1
        late = self.asked <= self.slow

        async def report():
            if late:
                await asyncio.sleep(1.0)
            return {"worker_id": self.worker_id, "node_id": "n", "running_tokens": 0,
                    "waiting_tokens": 0, "session_ids": list(self.sessions)}
        return report()


def scheduler(workers: dict):
    s = SchedulerActor.__ray_actor_class__(SchedulerConfig(rpc_timeout_s=0.05))

    def handle(name):
        if name not in workers:
            raise ValueError(name)
        return workers[name]
    # the instance's own finders (the class's module globals are not the test module's
    # once Ray has loaded the actor class in this process)
    s._names, s._lookup = lambda: sorted(workers), handle
    return s


def test_a_worker_too_busy_for_the_rebuild_is_found_at_a_later_poll():
    workers = {"rayguide_worker_0": SlowWorker("w0", slow=0),
               "rayguide_worker_1": SlowWorker("w1", slow=2, sessions=["s1"])}
    s = scheduler(workers)

    async def run():
        await s._find_workers()
        assert set(s.table.workers) == {"w0"}  # w1 did not answer in time
        await s._poll_once()  # still busy
        assert set(s.table.workers) == {"w0"}
        await s._poll_once()  # answers now
        assert set(s.table.workers) == {"w0", "w1"}
        assert s.table.sessions["s1"][0] == "w1"  # its sessions are restored with it
        assert not s._unfound
        asked = workers["rayguide_worker_1"].asked
        await s._poll_once()  # polled as a registered worker from now on, once per poll
        assert workers["rayguide_worker_1"].asked == asked + 1
    asyncio.run(run())


def test_a_busy_worker_that_disappears_is_forgotten():
    workers = {"rayguide_worker_0": SlowWorker("w0", slow=5)}
    s = scheduler(workers)

    async def run():
        await s._find_workers()
        assert s._unfound == {"rayguide_worker_0"}
        workers.clear()  # the actor is gone (no name any more)
        await s._poll_once()
        assert not s._unfound and not s.table.workers
    asyncio.run(run())


class DiesLate:
    """A killed worker's old handle: a call to it fails with ActorDiedError, once
    ``gate`` opens."""

    def __init__(self, gate: asyncio.Event):
        self.gate, self.load = gate, self

    def remote(self):
        from ray.exceptions import ActorDiedError

        async def report():
            await self.gate.wait()
            raise ActorDiedError()
        return report()


def test_a_late_death_notice_of_a_restarted_worker_leaves_its_new_registration():
    """A load poll (or a caller's worker_failed) of the dead worker ends in ActorDiedError
    after the restarted worker registered under the same id: the new entry stays, and so
    do the sessions pinned to it (CI: test_restarted_worker_registers_again saw its
    session moved to another worker)."""
    s = scheduler({})

    async def run():
        for check in ("poll", "worker_failed"):
            gate = asyncio.Event()
            s.table.add_worker("w0", DiesLate(gate), "n")
            old = s.table.workers["w0"]
            asking = asyncio.ensure_future(
                s._poll_one(old) if check == "poll" else s.worker_failed("w0"))
            await asyncio.sleep(0.01)
            s.table.add_worker("w0", SlowWorker("w0", slow=0), "n")  # registered again
            new = s.table.workers["w0"]
            s.table.sessions["s1"] = ("w0", 0.0)
            gate.set()
            assert not await asking or check == "poll"
            assert s.table.workers.get("w0") is new, check
            assert s.table.sessions["s1"][0] == "w0", check
            # the entry asked about is still the registered one: dropped
            s.table.workers["w0"] = old
            old.handle.gate = asyncio.Event()
            old.handle.gate.set()
            await s._poll_one(old)
            assert "w0" not in s.table.workers, check
            s.table.sessions.pop("s1", None)

    asyncio.run(run())
