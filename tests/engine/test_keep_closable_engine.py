"""The guard inside the closing window (OutputPolicy._keep_closable) with a stop token
sampled where the grammar may end: the output ends there, and nothing is fed to the
matcher after it (xgrammar logged "The matcher has terminated after accepting the stop
token, but is trying to accept new token" 8 times in a conformance run: the guard tried
the closing path on a probe that had accepted the stop token)."""

import pytest

from core.grammar_spec import GrammarSpec
from core.request import GenerationRequest
from tests.engine.test_budget_bound_engine import scripted
from worker.engine.sampling import SamplingParams
from worker.guided import xgrammar_backend

pytestmark = pytest.mark.integration


def test_a_stop_token_where_the_grammar_may_end_feeds_nothing_after_it(make_tiny_engine,
                                                                      monkeypatch):
    fed_after_end = []
    accept = xgrammar_backend.XGrammarMatcher.accept_token

    def watched(self, token):
        if self.inner.is_terminated():
            fed_after_end.append(token)
        return accept(self, token)
    monkeypatch.setattr(xgrammar_backend.XGrammarMatcher, "accept_token", watched)
    engine = make_tiny_engine()
    # one digit, then the stop token: the path kept from the step before ("0" after the
    # digit) is longer than what the grammar needs there (nothing)
    scripted(engine, "1")
    spec = GrammarSpec.regex("[0-9]{1,8}", engine="xgrammar")  # (its matcher is watched)
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=20, temperature=0.0), grammar=spec)
    out = engine.generate([req])[req.request_id]
    assert out.text == "1" and out.finish_reason == "stop", (out.text, out.finish_reason)
    assert fed_after_end == []


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_fixed_width_pattern_is_kept_closable_without_a_search_per_token(
        make_tiny_engine, engine_name):
    """A phone number's digits inside the closing window: each sampled digit takes the
    place of the closing path's first one, so the guard keeps the path's rest (no
    search); it searched at every digit (72 searches for 8 such rows in
    bench/guided_host.py)."""
    engine = make_tiny_engine()
    answer = "(555) 123-9876"
    scripted(engine, answer)
    spec = GrammarSpec.regex(r"\(\d{3}\) \d{3}-\d{4}", engine=engine_name)
    req = GenerationRequest([{"role": "user", "content": "A phone number?"}],
                            SamplingParams(max_new_tokens=20, temperature=0.0), grammar=spec)
    stats = engine.guide.policy.stats
    before = stats.closing_searches
    out = engine.generate([req])[req.request_id]
    assert out.text == answer and out.finish_reason == "stop", (out.text, out.finish_reason)
    assert stats.closing_searches == before
