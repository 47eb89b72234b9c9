"""Every llguidance compile is bounded (issue 39): the schema rewrites run in the worker's
Python beside the engine thread, so hostile schemas (allOf s that reference each other, a
``not`` over a chain of definitions, hundreds of enum nodes sharing one definition) must
answer, or fail with a clear error naming the grammar, within a second or two, and never
hold up a simple grammar compiled beside them. Checked on a byte-level vocabulary."""

import json
import time

import pytest
import xgrammar as xgr

from core.errors import ErrorKind, GrammarError
from core.grammar_spec import GrammarSpec
from worker.guided.backend import LLGUIDANCE, XGRAMMAR, EngineRefused
from worker.guided.llguidance_backend import LLGuidanceBackend, _llguidance_grammar
from worker.guided.guided_process import GuidedDecodingManager
from worker.guided.schema_budget import RewriteBudget, SchemaTooComplex
from worker.guided.schema_options import number_guards
from worker.guided.schema_rewrites import exact_rewrites

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")


def allof_web(k: int) -> dict:
    """k definitions, each the allOf of all the others; a oneOf over them."""
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{j}"} for j in range(k) if j != i]}
            for i in range(k)}
    return {"$defs": defs, "oneOf": [{"$ref": f"#/$defs/d{i}"} for i in range(k)]}


def not_chain(levels: int) -> dict:
    """``not`` over a chain of definitions, each with four properties of the next: its
    negation written out is 4**levels branches."""
    defs = {}
    for i in range(levels):
        nxt = {"$ref": f"#/$defs/c{i + 1}"} if i + 1 < levels else {"type": "string"}
        defs[f"c{i}"] = {"properties": {"a": nxt, "b": nxt, "c": nxt, "d": nxt}}
    return {"$defs": defs, "type": "object",
            "properties": {"x": {"not": {"$ref": "#/$defs/c0"}}}}


def enum_web(nodes: int, width: int = 300) -> dict:
    """``nodes`` enum nodes, each referencing one large definition with ``not`` s in it."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "not": {"const": "z"}}
                                            for i in range(width)}}
    return {"$defs": {"big": big}, "type": "object", "properties": {
        f"e{i}": {"$ref": "#/$defs/big", "enum": [{"p0": "a"}, {"p1": "b"}]}
        for i in range(nodes)}}


def units_spent(schema) -> int:
    budget = RewriteBudget(units=10 ** 9, seconds=1e9)
    exact_rewrites(schema, budget=budget)
    return budget.units - budget.left


def test_references_that_reach_a_schema_many_ways_are_read_once():
    """oneOf's disjointness facts read each schema once: linear in the schema, where they
    followed every path of references (2 s at k=6, 10 s at k=7, growing ~k^8)."""
    assert units_spent(allof_web(6)) < 2000
    assert units_spent(allof_web(12)) < 20000


@pytest.mark.parametrize("schema, strict", [(not_chain(7), False), (not_chain(5), False),
                                            (enum_web(500), True), (enum_web(100), True)])
def test_a_schema_whose_rewrite_multiplies_is_refused_by_name_at_once(schema, strict):
    spec = GrammarSpec.json_schema(schema, strict=strict)
    t = time.thread_time()  # this thread's CPU: what a loaded machine does not inflate
    with pytest.raises(EngineRefused) as err:
        _llguidance_grammar(spec)
    assert time.thread_time() - t < 2.0  # generous: ~0.05 s here
    assert err.value.kind == ErrorKind.GRAMMAR_TOO_LARGE
    assert "for llguidance" in str(err.value)


def test_the_budget_counts_steps_and_time():
    budget = RewriteBudget(units=10, seconds=60)
    budget.spend(10)
    with pytest.raises(SchemaTooComplex, match="10 steps"):
        budget.spend()
    slow = RewriteBudget(units=10 ** 6, seconds=0)
    with pytest.raises(SchemaTooComplex, match="took over"):
        for _ in range(1024):
            slow.spend()
    with pytest.raises(SchemaTooComplex):  # the guards share the budget
        number_guards(not_chain(3), 15, 10, budget=RewriteBudget(units=5))


def test_an_ordinary_large_schema_fits_the_budget():
    props = {f"p{i}": {"type": "object", "required": ["q0"], "properties": {
        f"q{j}": {"type": "string", "pattern": "^[a-z]+$"} for j in range(20)}}
        for i in range(200)}
    schema = {"type": "object", "properties": props}
    assert len(json.dumps(schema)) > 200_000
    assert units_spent(schema) < 10_000
    json.loads(_llguidance_grammar(GrammarSpec.json_schema(schema)))


def byte_manager(**kwargs) -> GuidedDecodingManager:
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)]
                             + [f"<s{i}>".encode() for i in range(6)],
                             stop_token_ids=list(BYTES.eos_tokens))
    return GuidedDecodingManager(info, llguidance=lambda: LLGuidanceBackend(BYTES), **kwargs)


def test_hostile_schemas_answer_at_once_beside_a_simple_one():
    """On one manager (one compile thread): the hostile schemas answer (auto: xgrammar
    takes what llguidance refuses) or fail naming the grammar, within a couple of
    seconds, and a simple schema asked for after them is not held up."""
    manager = byte_manager()
    try:
        t = time.monotonic()
        hostile = [GrammarSpec.json_schema(allof_web(7)),
                   GrammarSpec.json_schema(not_chain(7), strict=False),
                   GrammarSpec.json_schema(enum_web(500)),
                   GrammarSpec.json_schema(not_chain(7), strict=False, engine=LLGUIDANCE)]
        futures = [manager.get_grammar(spec) for spec in hostile]
        simple = manager.get_grammar(GrammarSpec.json_schema(
            {"type": "object", "properties": {"a": {"type": "integer"}}}))
        assert simple.result(timeout=5).engine == LLGUIDANCE
        simple_s = time.monotonic() - t
        outcomes = []
        for fut in futures:
            try:
                outcomes.append(fut.result(timeout=5).engine)
            except GrammarError as exc:
                outcomes.append(exc.kind)
        total_s = time.monotonic() - t
    finally:
        manager.shutdown()
    assert outcomes[1:3] == [XGRAMMAR, XGRAMMAR]  # refused by llguidance, served by xgrammar
    assert outcomes[3] == ErrorKind.GRAMMAR_TOO_LARGE  # llguidance forced: its refusal
    assert simple_s < 2.0 and total_s < 3.0  # generous bounds (about 0.2 s here)
