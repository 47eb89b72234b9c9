"""Closing where every search is cut short (output_policy.py ``_fallback``).

On a large grammar (hundreds of properties on llguidance) a completion search does not
finish within ``closing_search_ms`` on any step, and the output used to run to its budget
unclosed. The closing probe's dive gets ``closing_probe_ms`` and keeps its path; when the
searches give up and that path still closes the output within the budget, it becomes the
closing path: replayed on the next steps and emitted when the budget is down to it. Here
every search is cut short at once (``closing_search_ms=0``), which is what a slow grammar
on a busy machine looks like to the policy."""

import json

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams
from core.request import GenerationRequest
from tests.engine.test_loop_guard import LONG_CLOSE, scripted
from worker.engine.sampling import SamplingParams

pytestmark = pytest.mark.integration


def generate(engine, schema, max_tokens, engine_name="auto"):
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema, engine=engine_name),
                            loop_guard=LoopGuardParams(enabled=False))
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    assert chunks[-1].finished
    return chunks, chunks[-1]


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_an_output_closes_on_the_probe_s_path_when_every_search_is_cut_short(
        make_tiny_engine, engine_name):
    engine = make_tiny_engine(closing_search_ms=0.0, closing_probe_ms=30_000.0,
                              schema_closing=False)  # the searches themselves
    scripted(engine, '{"titles": [' + '{"title": "Titles"}, ' * 60)
    chunks, final = generate(engine, LONG_CLOSE, 160, engine_name)
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), LONG_CLOSE)
    assert final.finish_reason == "length" and final.closed_early
    assert final.grammar_engine == engine_name
    stats = engine.stats()
    assert stats.closing_fallbacks >= 1 and stats.closing_giveups == 0
    assert stats.runaway == 0
    # closed at its budget's end, not where the first search gave up
    assert final.completion_tokens >= 160 - 3 - 12, final.completion_tokens


def test_without_a_probe_the_cut_short_searches_leave_it_unclosed(make_tiny_engine):
    """The same request with the probe's long time off: the searches alone give up and
    the output runs to its budget (what the fallback is for; flagged, never labelled
    valid)."""
    engine = make_tiny_engine(closing_search_ms=0.0, closing_probe_ms=0.0, schema_closing=False)
    scripted(engine, '{"titles": [' + '{"title": "Titles"}, ' * 60)
    _, final = generate(engine, LONG_CLOSE, 160)
    assert final.finish_reason == "length" and not final.closed_early
    assert final.validation == "invalid" and engine.stats().runaway == 1
