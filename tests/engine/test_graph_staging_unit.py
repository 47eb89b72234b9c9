"""The CUDA graph runner's host side without a GPU (worker/engine/cuda_graphs.py): its
one host-to-device copy a step runs late, as a GPU runs it, and a replay that raises.

``LateStream`` is a device queue that runs nothing until it must: a queued copy reads its
host buffer when it runs (a GPU's non-blocking copy from pinned memory does the same),
and a queued forward records the static inputs it would read then. A step's forward must
see the inputs the host wrote for that step, however late the queue runs; with one host
buffer rewritten by the next step (the overlapped step that returns before anything
synchronises) it saw the next step's. No model: the forward is a stub."""

from types import SimpleNamespace

import pytest
import torch

from worker.engine.cuda_graphs import DecodeGraphs, HostStaging
from worker.engine.scheduler import ScheduledSeq

pytestmark = pytest.mark.unit

BLOCK = 4
VOCAB = 8


class LateStream:
    """Copies and forwards queue up; they run when a fence is waited on, or at ``drain``."""

    def __init__(self):
        self.queue: list = []
        self.done = 0
        self.waits = 0

    def host_buffer(self, n):
        return torch.zeros(n, dtype=torch.int32)

    def copy(self, dst, src):
        self.queue.append(lambda: dst.copy_(src))  # reads src when it runs

    def fence(self):
        stream, upto = self, len(self.queue)

        class Event:
            def synchronize(self):
                stream.waits += 1
                stream.run(upto)
        return Event()

    def run(self, upto):
        while self.done < upto:
            self.queue[self.done]()
            self.done += 1

    def drain(self):
        self.run(len(self.queue))


def graphs_on(stream):
    model = torch.nn.Linear(1, 1)  # only its device is read
    g = DecodeGraphs(model, kv_caches=[], block_size=BLOCK, max_rows=4, max_blocks=8,
                     scratch_slot=99, capture=False, stream=stream)
    seen = []

    def forward(size):  # queued behind the step's copy, as on a device
        n = g._off["slots"] + size
        stream.queue.append(lambda: seen.append(g.static[:n].clone()))
        return torch.zeros(size, VOCAB)
    g._forward = forward
    return g, seen


def step(tokens, computed):
    """A decode step of rows whose last token is ``tokens[i]``."""
    out = []
    for i, tok in enumerate(tokens):
        seq = SimpleNamespace(token_ids=[0] * computed + [tok], num_computed=computed,
                              block_table=[10 * i + b for b in range(8)])
        out.append(ScheduledSeq(seq, 1))
    return out


def expected(g, scheduled):
    """The inputs the step should have: its tokens, positions and slots."""
    t = len(scheduled)
    size = next(b for b in g.sizes if b >= t)
    toks = [s.seq.token_ids[-1] for s in scheduled] + [0] * (size - t)
    pos = [s.seq.num_computed for s in scheduled] + [0] * (size - t)
    return toks, pos


def test_a_late_copy_reads_the_inputs_of_its_own_step():
    stream = LateStream()
    g, seen = graphs_on(stream)
    steps = [step([11 + k, 21 + k, 31 + k], computed=5 + k) for k in range(6)]
    for scheduled in steps:
        g.run(scheduled)  # nothing read back: the overlapped step with no sampling row
    stream.drain()
    assert len(seen) == len(steps)
    o = g._off
    for k, (scheduled, got) in enumerate(zip(steps, seen)):
        toks, pos = expected(g, scheduled)
        size = len(toks)
        assert got[o["tokens"]:o["tokens"] + size].tolist() == toks, k
        assert got[o["positions"]:o["positions"] + size].tolist() == pos, k
    # the host waited only for copies two steps old
    assert stream.waits == len(steps) - 2


def test_a_buffer_is_handed_out_again_only_after_its_copy_ran():
    stream = LateStream()
    staging = HostStaging(4, stream)
    dst = torch.zeros(4, dtype=torch.int32)
    first = staging.take()
    first[:] = 1
    staging.upload(dst, 4)
    second = staging.take()
    assert second is not first and stream.done == 0  # nothing waited for
    second[:] = 2
    staging.upload(dst, 4)
    again = staging.take()
    assert again is first and stream.done >= 1  # the copy that read it ran first
    stream.drain()
    assert dst.tolist() == [2, 2, 2, 2]


class BrokenGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1
        raise RuntimeError("CUDA error: an illegal launch")


def test_a_replay_that_raises_runs_the_step_eagerly_and_turns_the_graphs_off(caplog):
    stream = LateStream()
    g, seen = graphs_on(stream)
    broken = BrokenGraph()
    g.graphs = {size: (broken, torch.zeros(size, VOCAB)) for size in g.sizes}
    scheduled = step([5, 6], computed=3)
    assert g.fits(scheduled)
    logits, rows = g.run(scheduled)  # no error: this step ran eagerly
    assert broken.replays == 1 and rows == [0, 1] and logits.shape == (2, VOCAB)
    stream.drain()
    assert len(seen) == 1  # the eager forward on the same inputs
    assert "CUDA graphs off" in caplog.text
    # and from here the runner's eager path: no replay, no failed batch
    assert not g.fits(scheduled) and not g.graphs
