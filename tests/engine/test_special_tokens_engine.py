"""A tokenizer's special tokens (``<|endoftext|>``, ``<|im_start|>``, ...) are never text of a
guided answer, on either grammar library: the output's text skips them, so a grammar that
took them as their names' characters let a string's ``minLength`` be met by tokens that
write nothing (xgrammar: ``"note": ""`` for a minLength of 12). The stop token still ends an
answer where the grammar may end."""

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
def test_no_special_token_is_allowed_as_text(manager, engine):
    import torch
    guided, tok = manager
    specials = sorted(i for i, t in tok.added_tokens_decoder.items()
                      if t.special and i != tok.eos_token_id)
    assert len(specials) >= 3  # (the default tokenizer has 16 besides its EOS)
    spec = GrammarSpec.json_schema({"type": "object", "properties": {
        "note": {"type": "string", "minLength": 12}}, "required": ["note"]}, engine=engine)
    compiled = guided.get_grammar(spec).result(timeout=60)
    for prefix, eos_allowed in (('{"note": "', False), ('{"note": "abcdefghijklm', False),
                                ('{"note": "abcdefghijklm"}', True)):
        m = guided.new_matcher(compiled)
        assert m.accept_tokens(tok(prefix, add_special_tokens=False)["input_ids"])
        mask = torch.zeros((1, (len(tok) + 31) // 32), dtype=torch.int32)
        m.fill_bitmask(mask)
        words = mask[0].tolist()
        allowed = [t for t in specials if (words[t >> 5] >> (t & 31)) & 1]
        assert allowed == [], (prefix, [tok.convert_ids_to_tokens(t) for t in allowed])
        eos = tok.eos_token_id
        assert bool((words[eos >> 5] >> (eos & 31)) & 1) is eos_allowed, prefix
