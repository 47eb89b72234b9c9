"""The vocabulary's tables a guided request needs (the shortest bound's cover tables, the
loop guard's closers and shapes, jump-forward's sorted vocabulary) are built beside the
engine at its start (``GuidedPath.prepare`` on a thread), not on the engine thread by the
first guided request: a new grammar's admission stalled the whole batch for half a second
(bench/guided_host.py's longest step)."""

import threading

import pytest

from core.grammar_spec import GrammarSpec
from core.request import GenerationRequest
from worker.engine.sampling import SamplingParams
from worker.guided import output_policy

pytestmark = pytest.mark.integration


def test_the_tables_are_ready_before_the_first_guided_request(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    for thread in threading.enumerate():
        if thread.name == "guided-prepare":
            thread.join(timeout=60)
    policy, jumper = engine.guide.policy, engine.guide._jumper
    assert policy._capacity is not None and policy._capacity._tokens is not None
    assert policy._closers is not None and policy._shapes
    assert jumper is not None and jumper._sorted is not None
    # the first guided request builds none of them again
    built = []
    monkeypatch.setattr(output_policy, "token_shapes",
                        lambda vocab: built.append("shapes") or [])
    monkeypatch.setattr(output_policy.TokenCapacity, "prepare",
                        lambda self: built.append("cover"))
    req = GenerationRequest([{"role": "user", "content": "A person"}],
                            SamplingParams(max_new_tokens=24, temperature=0.0),
                            grammar=GrammarSpec.json_schema({
                                "type": "object", "properties": {"name": {"type": "string"}},
                                "required": ["name"]}))
    out = engine.generate([req])[req.request_id]
    assert out.error is None, out.error
    assert built == []
