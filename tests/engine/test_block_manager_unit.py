"""Block manager and scheduler bookkeeping without a model."""

import pytest
import torch

from worker.engine.block_manager import BlockManager
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler
from core.request import GenerationRequest
from worker.engine.sequence import Sequence, SeqStatus

pytestmark = pytest.mark.unit


def seq(n_prompt, session=None, start=1):
    prompt = list(range(start, start + n_prompt))
    req = GenerationRequest(prompt, SamplingParams(), session_id=session)
    return Sequence(req, prompt, None, torch.Generator())


def test_grow_and_free():
    bm = BlockManager(4, 4)
    table = []
    assert bm.grow(table, 9) and len(table) == 3 and bm.num_free == 1
    assert not bm.grow(table, 17) and len(table) == 3  # nothing changes on failure
    bm.free(table)
    assert table == [] and bm.num_free == 4


def computed(bm, tokens, scope=None):
    """A sequence that computed ``tokens`` and ended: its full blocks registered, then
    given back (cached). Returns its keys."""
    table, keys = [], []
    assert bm.grow(table, len(tokens))
    bm.register(table, keys, tokens, len(tokens), scope)
    bm.free(table)
    return keys


def test_a_prompt_starts_after_the_cached_blocks_it_begins_with():
    bm = BlockManager(8, 4)
    computed(bm, list(range(10)))  # two full blocks registered, the partial one freed
    assert bm.num_cached == 2 and bm.num_free == 8
    blocks, keys, _ = bm.lookup(list(range(8)) + [50, 51], None)
    assert len(blocks) == 2 and [bm.refs(b) for b in blocks] == [1, 1]
    assert bm.num_cached == 0 and bm.num_free == 6
    # a prompt that differs inside the second block finds the first only
    other, _, missed = bm.lookup([0, 1, 2, 3, 4, 99, 6, 7, 8], None)
    assert missed is not None and missed not in keys
    assert other == blocks[:1] and bm.refs(blocks[0]) == 2
    bm.free(other)
    bm.free(blocks)
    assert bm.num_cached == 2
    bm.check([])


def test_the_last_token_is_always_computed():
    bm = BlockManager(8, 4)
    computed(bm, list(range(8)))
    blocks, _, _ = bm.lookup(list(range(8)), None)  # all of it cached: the last block is not
    assert len(blocks) == 1
    bm.free(blocks)
    blocks, _, _ = bm.lookup(list(range(9)), None)
    assert len(blocks) == 2


def test_scopes_never_share_blocks():
    bm = BlockManager(8, 4)
    computed(bm, list(range(9)), scope="tenant-a")
    assert bm.lookup(list(range(9)), "tenant-b")[:2] == ([], [])
    assert bm.lookup(list(range(9)), None)[:2] == ([], [])
    blocks, _, _ = bm.lookup(list(range(9)), "tenant-a")
    assert len(blocks) == 2


def test_off_only_sessions_look_up():
    bm = BlockManager(8, 4, prefix_caching=False)
    computed(bm, list(range(9)))
    assert bm.lookup(list(range(9)), None)[:2] == ([], [])
    assert len(bm.lookup(list(range(9)), None, session=True)[0]) == 2


def test_cached_blocks_are_taken_lru_only_when_nothing_is_free():
    bm = BlockManager(4, 4)
    old = computed(bm, [1] * 4 + [2])   # caches 1 block
    new = computed(bm, [3] * 4 + [4])   # caches another
    assert bm.num_cached == 2 and bm.num_free == 4
    table = []
    assert bm.grow(table, 8)  # the two free blocks: both cached blocks stay
    assert bm.num_cached == 2 and bm.evictions == 0
    assert bm.grow(table, 12)  # one more: the least recently used cached block goes
    assert bm.evictions == 1
    assert bm.lookup([1] * 4 + [2], None)[:2] == ([], [])
    assert len(bm.lookup([3] * 4 + [4], None)[0]) == 1
    assert old != new


def test_a_duplicate_block_stays_its_sequences_own():
    bm = BlockManager(8, 4)
    a, b, ka, kb = [], [], [], []
    bm.grow(a, 5)
    bm.grow(b, 5)
    bm.register(a, ka, [7] * 5, 5, None)
    bm.register(b, kb, [7] * 5, 5, None)  # the same KV computed twice in one step
    assert ka == kb
    bm.free(b)  # b's block is not registered: free, not cached
    bm.free(a)
    assert bm.num_cached == 1 and len(bm._free) == 7
    bm.check([])


def test_a_session_pins_its_blocks_and_its_next_turn_finds_them():
    bm = BlockManager(8, 4)
    table, keys = [], []
    bm.grow(table, 10)
    bm.register(table, keys, list(range(10)), 10, "t")
    bm.keep_session("s", keys)
    bm.free(table)
    assert bm.num_session_blocks == 2 and bm.num_cached == 0 and bm.num_free == 6
    bm.check([])
    blocks, _, _ = bm.lookup(list(range(8)) + [99, 100], "t", session=True)
    assert len(blocks) == 2
    bm.free(blocks)
    bm.drop_session("s")
    assert bm.num_cached == 2 and bm.num_free == 8 and not bm.sessions
    bm.check([])


def test_idle_sessions_are_unpinned_lru_to_make_room():
    bm = BlockManager(4, 4)
    for sid, token in (("old", 1), ("new", 2)):
        table, keys = [], []
        bm.grow(table, 8)
        bm.register(table, keys, [token] * 8, 8, None)
        bm.keep_session(sid, keys)
        bm.free(table)
    assert bm.num_free == 0
    table = []
    assert bm.grow(table, 4)
    assert list(bm.sessions) == ["new"]
    bm.check([table])


def test_random_admissions_aborts_preemptions_and_evictions_keep_the_counts():
    """The scheduler and block manager driven at random (prompts sharing prefixes,
    sessions, aborts, a cache small enough to preempt and evict); after every step each
    block is free, cached with no reference, or referenced as the tables hold it, and at
    the end everything is free or cached."""
    import random

    rng = random.Random(7)
    bm = BlockManager(24, 4)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live, hits = [], 0
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 10:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50)
                                             for _ in range(rng.randrange(1, 10))]
            req = GenerationRequest(prompt, SamplingParams(),
                                    session_id=rng.choice([None, None, "s1", "s2"]))
            s = Sequence(req, prompt, None, torch.Generator())
            sched.add(s)
            live.append(s)
        for sch in sched.schedule():
            s = sch.seq
            s.num_computed += sch.num_tokens
            bm.register(s.block_table, s.block_keys, s.token_ids,
                        min(s.num_computed, s.num_prompt), s.cache_scope)
            if sch.samples:
                s.token_ids.append(rng.randrange(1, 50))
        for s in list(live):
            if s.status is SeqStatus.RUNNING and (
                    s.num_output >= 6 or rng.random() < 0.05):  # ends, or is aborted
                aborted = s.num_output < 6
                sched.remove(s)
                live.remove(s)
                hits += s.cached_tokens
                bm.register(s.block_table, s.block_keys, s.token_ids, s.num_computed,
                            s.cache_scope)
                if s.session_id is not None and not aborted:
                    bm.keep_session(s.session_id, s.block_keys)
                bm.free(s.block_table)
        bm.check([s.block_table for s in live])
        assert all(not s.block_table for s in sched.waiting)
    for s in live:
        sched.remove(s)
        bm.free(s.block_table)
    for sid in list(bm.sessions):
        bm.drop_session(sid)
    bm.check([])
    assert bm.num_free == bm.num_blocks
    assert sched.num_preemptions > 0 and bm.evictions > 0 and hits > 0


def test_scheduler_budget_chunks_and_preemption():
    bm = BlockManager(6, 4)  # 24 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(8), seq(8, start=100)
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


def test_a_prompt_waits_a_step_for_the_prefix_another_is_computing():
    """Two prompts with one 12-token prefix, queued together: the second is not computed
    beside the first; it waits one step and starts after the first's cached blocks."""
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(14), seq(14)
    b.token_ids[-2:] = b.prompt_ids[-2:] = [90, 91]  # its own last two tokens
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [s.seq for s in first] == [a] and sched.waiting[0] is b and not b.block_table
    for s in first:
        s.seq.num_computed += s.num_tokens
        bm.register(a.block_table, a.block_keys, a.token_ids, a.num_computed, None)
    a.token_ids.append(7)
    second = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in second] == [(a, 1), (b, 2)]
    assert b.cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert (bm.query_tokens, bm.hit_tokens) == (28, 12)
    bm.check([a.block_table, b.block_table])
