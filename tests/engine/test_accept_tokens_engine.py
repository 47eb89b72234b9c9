"""GrammarMatcher.accept_tokens: a list accepted in one call (llguidance consumes it at
once) is the same as accepting its tokens one by one: the same verdict, the same state
after, the same rollback, a stop token where the grammar may end included."""

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.guided_process import GuidedDecodingManager

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    tok = default_tokenizer
    return GuidedDecodingManager.from_tokenizer(tok, vocab_size=len(tok),
                                                stop_token_ids=[tok.eos_token_id]), tok


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_list_is_accepted_as_its_tokens_one_by_one(manager, engine):
    guided, tok = manager
    spec = GrammarSpec.json_schema({"type": "object", "properties": {
        "name": {"type": "string"}}, "required": ["name"]}, engine=engine)
    compiled = guided.get_grammar(spec).result(timeout=60)
    good = tok('{"name": "Ada"}', add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    for tokens, ok in [(good, True), (good + [eos], True), (good[:3], True),
                       (good[:2] + good[:2], False), (good[:-1] + [eos], False)]:
        one, many = guided.new_matcher(compiled), guided.new_matcher(compiled)
        assert all(one.accept_token(t) for t in tokens) is ok
        assert many.accept_tokens(tokens) is ok, tokens
        assert many.is_completed() == one.is_completed()
        assert many.is_terminated() == one.is_terminated()
        if ok:
            assert many.state_key() == one.state_key()
            many.rollback(len(tokens))
            assert many.accept_tokens(tokens) and many.is_completed() == one.is_completed()


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_allows_says_what_the_mask_says_and_changes_nothing(manager, engine):
    import torch
    guided, tok = manager
    spec = GrammarSpec.json_schema({"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]},
        engine=engine)
    compiled = guided.get_grammar(spec).result(timeout=60)
    for prefix in ('{"n": ', '{"n": 12, "s": "a', '{"n": 1, "s": "x"}'):
        m = guided.new_matcher(compiled)
        assert m.accept_tokens(tok(prefix, add_special_tokens=False)["input_ids"])
        mask = torch.zeros((1, (len(tok) + 31) // 32), dtype=torch.int32)
        m.fill_bitmask(mask)
        words = mask[0].tolist()
        key = m.state_key()
        for t in list(range(0, len(tok), 97)) + [tok.eos_token_id]:
            assert m.allows(t) == bool((words[t >> 5] >> (t & 31)) & 1), (prefix, t)
        assert m.state_key() == key  # nothing accepted, nothing left behind
