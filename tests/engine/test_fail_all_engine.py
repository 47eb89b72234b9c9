"""``LLMEngine.fail_all`` (after a step raised): every request ends with an INTERNAL error,
and its KV blocks and grammar matcher go back whatever its own end raises
(``LLMEngine._finish`` releases them in a ``finally``). The tiny random-weight model; a
hook of the request's end is made to raise."""

import pytest

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"], "additionalProperties": False}


def running(engine, n=2, steps=3):
    """``n`` requests (guided and plain) mid-output, each holding blocks; guided ones a
    matcher."""
    seqs = []
    for i in range(n):
        grammar = GrammarSpec.json_schema(PERSON) if i % 2 == 0 else None
        seqs.append(engine.add_request(GenerationRequest(
            [{"role": "user", "content": f"name {i}"}],
            SamplingParams(max_new_tokens=64, temperature=0.0), grammar=grammar)))
    for _ in range(50):
        engine.step()
        if all(s.num_output >= steps for s in seqs):
            break
    assert all(s.block_table for s in seqs)
    assert engine.stats().live_processors == (n + 1) // 2
    return seqs


def released(engine):
    st = engine.stats()
    return (st.free_blocks == st.total_blocks and st.live_processors == 0
            and st.running == st.waiting == 0 and not engine.seqs and not engine.has_work())


def boom(*args, **kwargs):
    raise RuntimeError("broken state")


@pytest.mark.parametrize("where", ["releasable", "flush"])
def test_fail_all_frees_blocks_and_matchers_when_the_finish_raises(make_tiny_engine,
                                                                  where):
    engine = make_tiny_engine(max_num_seqs=4)
    seqs = running(engine)
    for seq in seqs:
        if where == "flush":  # the detokenizer's last text
            seq.detokenizer.flush = boom
        elif seq.guide is not None:  # the guided part's hook: what the stream may have
            seq.guide.releasable = boom
        else:
            seq.stream = boom
    outs = engine.fail_all("the step failed")
    assert sorted(o.request_id for o in outs) == sorted(s.request_id for s in seqs)
    assert all(o.finished and o.finish_reason == "error"
               and o.error_kind is ErrorKind.INTERNAL for o in outs)
    assert released(engine), engine.stats()


def test_a_finish_that_raises_still_releases_the_request(make_tiny_engine):
    # the error goes on to the caller (fail_all, the step's handler); what the request
    # held is back all the same
    engine = make_tiny_engine(max_num_seqs=4)
    seqs = running(engine, n=1)
    seqs[0].guide.releasable = boom
    with pytest.raises(RuntimeError, match="broken state"):
        engine._finish(seqs[0], "stop")
    assert released(engine), engine.stats()


def test_a_session_keeps_no_kv_of_a_finish_that_raised(make_tiny_engine):
    engine = make_tiny_engine(max_num_seqs=4)
    seq = engine.add_request(GenerationRequest(
        [{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=64, temperature=0.0),
        session_id="s1"))
    for _ in range(5):
        engine.step()
    assert seq.block_table
    seq.stream = boom
    with pytest.raises(RuntimeError, match="broken state"):
        engine._finish(seq, "stop")
    assert released(engine) and not engine.blocks.sessions, engine.stats()
