"""Runaway digit guards on both engines (issue 39): under the default guards (15 integer,
10 fraction, 2 exponent digits) a matcher for ``integer`` / ``number`` refuses a 30-digit
integer, a 30-digit fraction and a huge exponent, and still takes ordinary numbers and
the numbers the schema itself demands. llguidance has no digit bounds of its own: the
guards are written into the schema (schema_options.number_guards). Checked on a
byte-level vocabulary (no model needed)."""

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from grammar_cache.compile import json_schema_ebnf
from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from worker.guided.backend import EngineRefused
from worker.guided.llguidance_backend import _llguidance_grammar
from worker.guided.schema_options import number_guards

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")
ENGINES = ("xgrammar", "llguidance")


def accepts(engine: str, spec: GrammarSpec, text: str) -> bool:
    if engine == "xgrammar":
        from grammar_cache.compile import _json_format
        ebnf = json_schema_ebnf(spec.source or '{"type": "object"}', **_json_format(spec))
        return _is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)
    m = llguidance.LLMatcher(BYTES, _llguidance_grammar(spec), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(BYTES.tokenize_str(text)) and m.is_accepting()


def obj(value_schema: dict) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {"v": value_schema},
                                    "required": ["v"]})


def doc(number: str) -> str:
    return '{"v": ' + number + '}'


RUNAWAYS = {"integer": ["1" * 30, "-" + "9" * 30],
            "number": ["1" * 30, "0." + "3" * 30, "1." + "0" * 30, "-" + "2" * 16 + ".5"]}
ORDINARY = {"integer": ["0", "7", "-42", "123456789012345", "-999999999999999"],
            "number": ["0", "3.25", "-0.5", "68000000", "123456789012345.1234567891",
                       "1.5"]}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["integer", "number"])
def test_runaway_numbers_are_refused(engine, kind):
    spec = obj({"type": kind})
    for text in RUNAWAYS[kind]:
        assert not accepts(engine, spec, doc(text)), (engine, kind, text)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["integer", "number"])
def test_ordinary_numbers_pass(engine, kind):
    spec = obj({"type": kind})
    for text in ORDINARY[kind]:
        assert accepts(engine, spec, doc(text)), (engine, kind, text)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_huge_exponent_is_refused(engine):
    spec = obj({"type": "number"})
    assert not accepts(engine, spec, doc("1e" + "9" * 30))
    assert not accepts(engine, spec, doc("1.5E+400"))


def test_exponents_on_each_engine():
    """xgrammar allows max_exp_digits of exponent; llguidance writes a bounded number
    without one (its ranges and steps have no exponent form): every value under the guards
    is still writable in plain digits."""
    spec = obj({"type": "number"})
    assert accepts("xgrammar", spec, doc("1.5e10"))
    assert not accepts("llguidance", spec, doc("1.5e10"))
    assert accepts("llguidance", spec, doc("15000000000"))


@pytest.mark.parametrize("engine", ENGINES)
def test_guards_are_off_at_zero(engine):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"v": {"type": "integer"}},
                                    "required": ["v"]}, max_int_digits=0, max_frac_digits=0,
                                   max_exp_digits=0)
    assert accepts(engine, spec, doc("1" * 30))


@pytest.mark.parametrize("engine", ENGINES)
def test_numbers_the_schema_demands_stay_satisfiable(engine):
    """A guard gives way to the schema: opposite a bound of more digits than the guard,
    the guard widens to that bound's digits; a side the schema bounds keeps its bound."""
    big = obj({"type": "number", "minimum": 1e16})
    assert accepts(engine, big, doc("10000000000000000"))
    assert accepts(engine, big, doc("12345678901234567.5"))
    assert not accepts(engine, big, doc("1" * 30))
    neg = obj({"type": "integer", "maximum": -10 ** 16})
    assert accepts(engine, neg, doc("-10000000000000000"))
    assert not accepts(engine, neg, doc("-" + "1" * 30))
    bounded = obj({"type": "integer", "minimum": 0, "maximum": 10 ** 17})
    assert accepts(engine, bounded, doc(str(10 ** 17)))


def llguidance_refuses(spec: GrammarSpec) -> bool:
    """What LLGuidanceBackend.compile decides: EngineRefused, or a matcher in error."""
    try:
        m = llguidance.LLMatcher(BYTES, _llguidance_grammar(spec), log_level=0)
    except EngineRefused:
        return True
    return m.is_error()


def test_a_demand_past_llguidance_ranges_goes_to_xgrammar():
    """``minimum: 1e20`` is past llguidance's ranges (64-bit integers; it would clamp an
    integer bound and allow 9223372036854775807): llguidance refuses the schema and
    ``auto`` serves it on xgrammar, where a number stays satisfiable and an integer is
    refused by name (xgrammar's integers are 64-bit too)."""
    number = obj({"type": "number", "minimum": 1e20})
    assert llguidance_refuses(number)
    assert accepts("xgrammar", number, doc("100000000000000000000"))
    for schema in ({"type": "integer", "minimum": 1e20},
                   {"type": "integer", "minimum": 0, "maximum": 1e20}):
        assert llguidance_refuses(obj(schema))
    with pytest.raises(RuntimeError, match="Integer exceeds maximum limit"):
        accepts("xgrammar", obj({"type": "integer", "minimum": 1e20}), doc("1" + "0" * 20))


@pytest.mark.parametrize("engine", ENGINES)
def test_json_object_values_are_guarded(engine):
    spec = GrammarSpec.json_object()
    assert accepts(engine, spec, '{"a": [1, {"b": 2.5, "c": null}], "d": "x"}')
    assert not accepts(engine, spec, '{"a": [{"b": ' + "1" * 30 + '}]}')
    assert not accepts(engine, spec, '{"a": 0.' + "3" * 30 + '}')


def test_a_type_list_and_nested_nodes_are_guarded():
    schema = {"type": "object", "properties": {
        "a": {"type": ["number", "null"]},
        "b": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "c": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "number"}}}
    spec = GrammarSpec.json_schema(schema, strict=False)
    assert accepts("llguidance", spec, '{"a": null, "b": [1, "x"], "c": 2.5}')
    for bad in ('{"a": ' + "1" * 30 + "}", '{"b": [' + "1" * 30 + "]}",
                '{"c": 0.' + "1" * 30 + "}"):
        assert not accepts("llguidance", spec, bad), bad


def test_guards_stay_out_of_negations():
    """Narrowing under ``not`` would widen the schema: it is left as written."""
    node = {"not": {"type": "number"}, "type": ["number", "string"]}
    guarded = number_guards(node, 15, 10)
    assert guarded["not"] == {"type": "number"}


def test_the_guards_are_part_of_the_grammar_key():
    a = obj({"type": "integer"})
    b = GrammarSpec.json_schema(json.loads(a.source), max_int_digits=5)
    assert a.key("fp") != b.key("fp")


def test_a_bound_llguidance_cannot_write_is_refused_by_name():
    spec = GrammarSpec.json_schema({"type": "number"}, max_frac_digits=20)
    with pytest.raises(EngineRefused) as err:
        _llguidance_grammar(spec)
    assert "max_frac_digits" in str(err.value) and err.value.kind == ErrorKind.INVALID_GRAMMAR
