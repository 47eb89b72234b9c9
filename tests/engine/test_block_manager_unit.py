"""Block manager and scheduler bookkeeping without a model."""

import pytest
import torch

from worker.engine.block_manager import BlockManager
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler
from core.request import GenerationRequest
from worker.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def seq(n_prompt, session=None):
    req = GenerationRequest(list(range(1, n_prompt + 1)), SamplingParams(), session_id=session)
    return Sequence(req, list(range(1, n_prompt + 1)), None, torch.Generator())


def test_grow_and_free():
    bm = BlockManager(4, 4)
    table = []
    assert bm.grow(table, 9) and len(table) == 3 and bm.num_free == 1
    assert not bm.grow(table, 17) and len(table) == 3  # nothing changes on failure
    bm.free(table)
    assert table == [] and bm.num_free == 4


def test_session_handoff_keeps_common_prefix():
    bm = BlockManager(8, 4)
    table = []
    bm.grow(table, 10)
    bm.keep_session("s", list(range(10)), table)
    assert bm.num_free == 5 and bm.num_session_blocks == 3
    prompt = list(range(6)) + [99, 100, 101]
    new_table, reused = bm.take_session("s", prompt)
    assert reused == 6 and len(new_table) == 2 and bm.num_free == 6
    assert bm.sessions == {}
    # never the whole prompt: one token is left to compute
    bm.keep_session("t", list(range(9)), new_table + [bm._free.popleft()])
    _, reused = bm.take_session("t", list(range(9)))
    assert reused == 8


def test_idle_sessions_are_evicted_lru_to_make_room():
    bm = BlockManager(4, 4)
    for sid in ("old", "new"):
        t = []
        bm.grow(t, 8)
        bm.keep_session(sid, list(range(8)), t)
    assert bm.num_free == 0
    table = []
    assert bm.grow(table, 4)
    assert list(bm.sessions) == ["new"]


def test_scheduler_budget_chunks_and_preemption():
    bm = BlockManager(6, 4)  # 24 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(8), seq(8)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in first] == [(a, 8), (b, 2)]  # b's prompt is chunked
    for s in first:
        s.seq.num_computed += s.num_tokens
    a.token_ids.append(0)
    second = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in second] == [(a, 1), (b, 6)]
    assert second[0].is_decode and second[0].samples and second[1].samples
    for s in second:
        s.seq.num_computed += s.num_tokens
    # grow a to fill the cache: b (newest) is preempted and requeued for recompute
    a.token_ids.extend([0] * 8)
    b.token_ids.append(0)
    third = sched.schedule()
    assert sched.num_preemptions == 1 and b.num_computed == 0 and sched.waiting[0] is b
    assert [s.seq for s in third] == [a]
