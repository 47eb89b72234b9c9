"""``engine.grammar_fill_threads``: the batch's grammar masks filled on several threads
(worker/guided/mask_stage.py) give every guided row the tokens one thread gives."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def outputs(model_dir, threads: int) -> list[tuple[str, str]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), progress=False, num_kv_blocks=128,
                                    grammar_fill_threads=threads, speculative=False))
    try:
        assert engine.mask.fill_threads == threads
        reqs = [GenerationRequest(f"Item {i}:", SamplingParams(
            max_new_tokens=40, temperature=0.0), grammar=spec)
            for i, spec in enumerate([GrammarSpec.json_schema(SCHEMA, engine="llguidance"),
                                      GrammarSpec.json_schema(SCHEMA, engine="xgrammar"),
                                      GrammarSpec.regex("[a-z]{3}-[0-9]{2}"),
                                      GrammarSpec.json_schema(SCHEMA)])]
        done = engine.generate(reqs)
        return [(done[r.request_id].text, done[r.request_id].finish_reason) for r in reqs]
    finally:
        engine.guided.shutdown()


def test_masks_filled_on_two_threads_give_the_tokens_of_one(tiny_model_dir):
    one, two = outputs(tiny_model_dir, 1), outputs(tiny_model_dir, 2)
    assert one == two
    for text, _ in (one[0], one[1], one[3]):
        assert set(json.loads(text)) == {"name", "n"}


def test_no_thread_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="grammar_fill_threads"):
        EngineConfig(grammar_fill_threads=0)
