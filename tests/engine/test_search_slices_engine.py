"""A slow closing search costs its own row, never the batch (worker/guided/
search_slices.py, issue 56).

Every node of every closing search is made to cost 10 ms of a fake clock (the searches'
and the slices' ``closing.CLOCK``), which is a grammar whose searches are arbitrarily slow
as the engine sees it. The guided row's closing then needs searches of seconds; the plain
rows beside it must still get a token every step, no step may spend more than its search
budget (plus the node under way when it ran out), and the guided row must still end
closed and valid: it waits, parked, for its searches instead of giving up."""

import json

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams
from core.request import GenerationRequest
from tests.engine.test_loop_guard import LONG_CLOSE, scripted
from worker.engine.sampling import SamplingParams
from worker.guided import closing

pytestmark = pytest.mark.integration

NODE_S = 0.010  # what one node of a search costs on the fake clock
FLOOR_MS = 5.0


@pytest.fixture
def slow_searches(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(closing, "CLOCK", lambda: now[0])
    fill = closing.CompletionSearch._fill

    def slow_fill(self, m):
        now[0] += NODE_S
        return fill(self, m)

    monkeypatch.setattr(closing.CompletionSearch, "_fill", slow_fill)
    return now


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_slow_search_holds_its_own_row_and_never_the_batch(make_tiny_engine, slow_searches,
                                                            engine_name):
    engine = make_tiny_engine(closing_probe_ms=60_000.0, search_step_floor_ms=FLOOR_MS,
                              schema_closing=False)  # (a JSON schema closes unsearched)
    scripted(engine, '{"titles": [' + '{"title": "Titles"}, ' * 60)
    guided = GenerationRequest([{"role": "user", "content": "go"}],
                               SamplingParams(max_new_tokens=160, temperature=0.0),
                               grammar=GrammarSpec.json_schema(LONG_CLOSE, engine=engine_name),
                               loop_guard=LoopGuardParams(enabled=False))
    plain = [GenerationRequest([{"role": "user", "content": f"plain {i}"}],
                               SamplingParams(max_new_tokens=150, temperature=0.0,
                                              ignore_eos=True)) for i in range(2)]
    for r in [guided] + plain:
        engine.add_request(r)
    chunks = {r.request_id: [] for r in [guided] + plain}
    got_at = {r.request_id: [] for r in plain}  # the steps a plain row got tokens in
    step_costs = []
    n = 0
    while engine.has_work():
        before = slow_searches[0]
        outs = engine.step()
        step_costs.append(slow_searches[0] - before)
        n += 1
        for o in outs:
            chunks[o.request_id].append(o)
            if o.request_id in got_at and o.token_ids:
                got_at[o.request_id].append(n)
    # no step paid for more search than its budget and the node under way (the root's
    # fill and one more at most): seconds of searching were spread over many steps
    assert sum(step_costs) > 20 * NODE_S  # (the searches really were slow)
    assert max(step_costs) <= FLOOR_MS / 1000 + 2 * NODE_S + 1e-9, max(step_costs)
    for r in plain:  # a token every step from its first to its last: never held up
        steps = got_at[r.request_id]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
        assert sum(len(o.token_ids) for o in chunks[r.request_id]) == 150
    final = chunks[guided.request_id][-1]
    text = "".join(c.text for c in chunks[guided.request_id])
    jsonschema.validate(json.loads(text), LONG_CLOSE)
    assert final.finish_reason == "length" and final.closed_early
    stats = engine.stats()
    assert stats.closing_waits >= 1 and stats.searches_sliced >= 1
    assert stats.runaway == 0
    assert stats.search_step_max_ms <= FLOOR_MS + 2 * NODE_S * 1000
