"""The guard inside the closing window (OutputPolicy._keep_closable) with a stop token
sampled where the grammar may end: the output ends there, and nothing is fed to the
matcher after it (xgrammar logged "The matcher has terminated after accepting the stop
token, but is trying to accept new token" 8 times in a conformance run: the guard tried
the closing path on a probe that had accepted the stop token)."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from core.request import GenerationRequest
from tests.engine.test_budget_bound_engine import scripted
from worker.engine.sampling import SamplingParams
from worker.guided import xgrammar_backend
from worker.guided.output_policy import OutputPolicy, _closes

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


FREE = {"type": "string", "minLength": 24, "description": "a line"}
BOUNDED = [{"type": "string", "minLength": 24, "maxLength": 60},
           {"type": "string", "pattern": "^[A-Za-z ,.]+$"},
           {"anyOf": [{"type": "string", "minLength": 24}, {"type": "string", "maxLength": 80}]}]


def lines_schema(item) -> dict:
    return {"type": "object", "properties": {"lines": {"type": "array", "minItems": 4,
                                                       "items": item}},
            "required": ["lines"]}


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("item", [FREE, *BOUNDED], ids=["free", "max", "pattern", "anyof"])
def test_a_free_strings_tokens_keep_the_path_as_its_whole_replay_says(
        make_tiny_engine, monkeypatch, engine_name, item):
    """Inside the closing window, a token that writes more of a free string keeps the
    closing path after replaying only the path's part up to its quote
    (OutputPolicy._string_goes_on): each of its verdicts is checked here against the
    whole path's replay, and it takes none where the string's text is bounded (a
    maxLength, a pattern, two string options to choose between)."""
    verdicts = []
    plain = OutputPolicy._string_goes_on

    def checked(self, seq, probe, token, path):
        quick = plain(self, seq, probe, token, path)
        verdicts.append((quick, _closes(probe, list(path))))
        return quick
    monkeypatch.setattr(OutputPolicy, "_string_goes_on", checked)
    engine = make_tiny_engine()
    lines = ["The museum opens at nine every morning", "Tickets are sold at the north gate",
             "Guided tours leave from the main hall", "The cafe closes an hour before"]
    answer = json.dumps({"lines": lines})
    scripted(engine, answer)
    spec = GrammarSpec.json_schema(lines_schema(item), engine=engine_name)
    budget = len(engine.tokenizer(answer, add_special_tokens=False)["input_ids"]) + 16
    req = GenerationRequest([{"role": "user", "content": "Four lines, please."}],
                            SamplingParams(max_new_tokens=budget, temperature=0.0), grammar=spec)
    out = engine.generate([req])[req.request_id]
    assert out.validation == "valid", out.text
    assert not [v for v in verdicts if v == (True, False)], verdicts
    taken = sum(1 for quick, _ in verdicts if quick)
    print(f"{len(verdicts)} asked, {taken} kept the path")
    assert len(verdicts) >= 5  # (the lines' words within the window)
    if item is FREE:
        assert out.text == answer
        assert taken >= 5, verdicts
    else:
        assert taken == 0, verdicts
