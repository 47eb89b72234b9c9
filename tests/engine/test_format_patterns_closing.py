"""Budget-aware closing inside the formats written as patterns (grammar_cache/
format_patterns.py), on both engines: from the start of the value and from inside it the
closing search finds as short a completion as it did over the engines' own format
grammars (probed before the rewrite). An e-mail's local part is a bounded run (at most 64
characters): the dive spelled it to its end, past its node budget, until it took the way out
of the run (the ``@``) before new places in it; from the end of the run too. The default
model's tokenizer, no model."""

import pytest
import xgrammar as xgr

from core.grammar_spec import GrammarSpec
from worker.guided.validation import validate_json

pytestmark = pytest.mark.integration

# (format, text already in the value, the completion's length in tokens at most)
CASES = [("email", "", 6), ("email", "ab", 5), ("email", "ab.c", 5), ("email", "ab@c", 1),
         ("hostname", "", 2), ("hostname", "ab.c", 1), ("date-time", "", 26),
         ("date-time", "2024-01-02T1", 14), ("date", "2024-0", 5), ("time", "12:3", 11),
         ("ipv4", "1.2", 5), ("ipv6", "fe80:", 2), ("idn-email", "ab", 5),
         ("email", "a" * 63, 5), ("email", "a" * 64, 4), ("email", "a" * 15 + ".b", 5),
         ("email", "ab@" + "c" * 62, 4), ("email", "123-456-7890000123123211231123-", 5)]


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    from worker.guided.llguidance_backend import LLGuidanceBackend
    from worker.guided.guided_process import GuidedDecodingManager

    tok = default_tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    manager = GuidedDecodingManager(
        info, encode=lambda s: tok(s, add_special_tokens=False)["input_ids"],
        llguidance=lambda: LLGuidanceBackend.from_huggingface(tok, len(tok),
                                                             [tok.eos_token_id]))
    # the answers are checked here, not the speed: the engine's 100 ms cap is reached on a
    # loaded machine (the node budget still bounds each search)
    manager.closer.time_limit_s = 2.0
    return manager


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("fmt, prefix, most", CASES)
def test_closing_inside_a_format(manager, default_tokenizer, engine, fmt, prefix, most):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {
        "e": {"type": "string", "format": fmt}}, "required": ["e"]}, engine=engine)
    compiled = manager.get_grammar(spec).result(timeout=60)
    assert compiled.engine == engine
    matcher = manager.new_matcher(compiled)
    text = '{"e": "' + prefix
    assert all(matcher.accept_token(t)
               for t in default_tokenizer(text, add_special_tokens=False)["input_ids"])
    found = manager.closer.shortest(matcher, 128)
    assert found.tokens is not None and len(found.tokens) <= most, (engine, fmt, prefix)
    whole = text + default_tokenizer.decode(found.tokens)
    assert validate_json({"properties": {"e": {"format": fmt}}}, whole) is None, whole


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("prefix", ["ab", "123-456-7890000123123211231123-4567890",
                                    "a" * 64, "ab@" + "c" * 40])
def test_closing_a_longer_document_from_inside_an_address(manager, default_tokenizer,
                                                           engine, prefix):
    # bounded runs (the local part, domain labels) left the dive no path here within its
    # node budget on both engines: it spelled a run to its end before taking its way out
    schema = {"type": "object", "properties": {
        "email": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"}, "day": {"type": "string",
                                                          "format": "date"}},
        "required": ["email", "id", "day"]}
    compiled = manager.get_grammar(GrammarSpec.json_schema(schema, engine=engine)).result(
        timeout=60)
    matcher = manager.new_matcher(compiled)
    text = '{"email": "' + prefix
    assert all(matcher.accept_token(t)
               for t in default_tokenizer(text, add_special_tokens=False)["input_ids"])
    found = manager.closer.shortest(matcher, 128)
    assert found.tokens is not None, engine
    assert validate_json(schema, text + default_tokenizer.decode(found.tokens)) is None
