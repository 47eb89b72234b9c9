"""Overlap (engine.py, ``_step_overlapped``): a step launches its forward, then handles
the tokens the step before drew. Whatever the device, the output must be token for token
what the step without overlap gives: greedy and seeded rows, stop strings and ids, EOS,
logprobs, penalties, guided rows with jump-forward and the loop guard, a preemption, an
abort in flight, a session's second turn and a stream. Run on the CPU with overlap forced
on (it is on by default only on CUDA), with speculation off: the overlapped step's
steps with drafts are tests/engine/test_speculative_engine.py's."""

import asyncio

import pytest

from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "city": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "city", "age"], "additionalProperties": False}
LIST = {"type": "object", "properties": {"fruits": {"type": "array",
                                                    "items": {"type": "string"}}},
        "required": ["fruits"]}


def chat(text):
    return [{"role": "user", "content": text}]


def requests():
    g = lambda n, **kw: SamplingParams(max_new_tokens=n, temperature=0.0, **kw)  # noqa: E731
    return [
        GenerationRequest(chat("Tell me a story about a cat"), g(40), request_id="plain"),
        GenerationRequest(chat("Count from 1 to 20"), g(40, stop=("7",)), request_id="stop"),
        GenerationRequest(chat("Hi"), g(30, logprobs=2), request_id="logprobs"),
        GenerationRequest(chat("Write a poem"), SamplingParams(
            max_new_tokens=30, temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5),
            request_id="seeded"),
        GenerationRequest(chat("Describe a person as JSON"), g(60),
                          grammar=GrammarSpec.json_schema(PERSON), request_id="person"),
        GenerationRequest(chat("List many fruits as JSON"), g(120),
                          grammar=GrammarSpec.json_schema(LIST), request_id="list"),
        GenerationRequest(chat("Yes or no?"), g(8), grammar=GrammarSpec.choice(["yes", "no"]),
                          request_id="choice"),
    ]


def outputs(engine, reqs):
    out = engine.generate(reqs)
    return {rid: (o.token_ids, o.text, o.finish_reason, o.error, o.logprobs)
            for rid, o in out.items()}


def idle(engine):
    stats = engine.stats()
    return (stats.running, stats.waiting, stats.live_processors,
            stats.free_blocks + stats.session_blocks == stats.total_blocks)


@pytest.fixture(scope="module")
def reference(default_model_dir, default_model, default_tokenizer):
    """``requests()`` without overlap (``make_engine``'s engine), run once for the three
    tests that compare against it: (outputs, the engine's jump-forward tokens)."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    plain = LLMEngine(EngineConfig(progress=False, num_kv_blocks=256, overlap=False),
                      model=default_model, tokenizer=default_tokenizer,
                      model_dir=default_model_dir)
    assert not plain.overlap
    return outputs(plain, requests()), plain.stats().jump_forward_tokens


def test_overlap_gives_the_same_output(make_engine, reference):
    ref, jump_forward_tokens = reference
    over = make_engine(overlap=True, speculative=False)
    assert over.overlap
    got = outputs(over, requests())
    assert got.keys() == ref.keys()
    for rid in ref:
        assert got[rid] == ref[rid], rid
    assert ref["stop"][2] == "stop" and ref["person"][3] is None
    assert idle(over) == (0, 0, 0, True)
    # jump-forward ran: forced text went with the drawn tokens
    assert over.stats().jump_forward_tokens == jump_forward_tokens > 0


def test_overlap_through_a_preemption(make_tiny_engine):
    """A KV cache of 14 blocks for four rows that each need about 6: rows are preempted
    and recomputed (a row may be preempted with its drawn token still ahead). The tiny
    model's seeded draws: each token depends on the whole context and on the row's
    generator, so a row recomputed wrong, or a draw lost or repeated, changes them."""
    reqs = lambda: [GenerationRequest(chat(f"Story number {i} about a dog"), SamplingParams(  # noqa: E731
        max_new_tokens=48, temperature=0.8, seed=i), request_id=f"r{i}") for i in range(4)]
    plain = make_tiny_engine(overlap=False, num_kv_blocks=14)
    over = make_tiny_engine(overlap=True, num_kv_blocks=14, speculative=False)
    assert outputs(over, reqs()) == outputs(plain, reqs())
    assert over.scheduler.num_preemptions > 0
    assert idle(over) == (0, 0, 0, True)


def test_an_abort_in_flight_leaves_the_others_as_they_were(make_engine, reference):
    ref = reference[0]
    over = make_engine(overlap=True, speculative=False)
    reqs = requests()
    for r in reqs:
        over.add_request(r)
    merged = {r.request_id: [] for r in reqs}
    for _ in range(6):
        for out in over.step():
            merged[out.request_id].append(out)
    assert over._ahead is not None  # a draw is in flight
    over.abort("person")
    while over.has_work():
        for out in over.step():
            merged[out.request_id].append(out)
    for rid, chunks in merged.items():
        if rid == "person":
            continue
        assert [t for c in chunks for t in c.token_ids] == ref[rid][0], rid
        assert "".join(c.text for c in chunks) == ref[rid][1], rid
    assert idle(over) == (0, 0, 0, True)


def test_a_session_s_second_turn(make_tiny_engine):
    """The tiny model's seeded draws, as in the preemption test: the second turn's tokens
    depend on the KV the session kept."""
    def turns(engine):
        first = engine.generate([GenerationRequest(chat("Hi, I am Ann"), SamplingParams(
            max_new_tokens=12, temperature=0.8, seed=1), session_id="s",
            request_id="t1")])["t1"]
        prompt = chat("Hi, I am Ann") + [{"role": "assistant", "content": first.text},
                                          {"role": "user", "content": "Who am I?"}]
        second = engine.generate([GenerationRequest(prompt, SamplingParams(
            max_new_tokens=12, temperature=0.8, seed=2), session_id="s",
            request_id="t2")])["t2"]
        return first.token_ids, second.token_ids, second.cached_tokens

    ref = turns(make_tiny_engine(overlap=False))
    got = turns(make_tiny_engine(overlap=True, speculative=False))
    assert got == ref and got[2] > 0


def test_a_stream_with_overlap(make_engine, reference):
    from worker.engine.async_engine import AsyncEngine

    ref = reference[0]
    aengine = AsyncEngine(make_engine(overlap=True, speculative=False))

    async def stream(r):
        return [c async for c in aengine.generate(r)]

    async def main():
        return await asyncio.gather(*(stream(r) for r in requests()))

    try:
        for chunks in asyncio.run(main()):
            rid = chunks[0].request_id
            assert "".join(c.text for c in chunks) == ref[rid][1], rid
            assert chunks[-1].finished and chunks[-1].finish_reason == ref[rid][2]
    finally:
        aengine.shutdown()
