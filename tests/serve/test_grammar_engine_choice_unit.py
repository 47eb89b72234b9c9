"""Which grammar engine a request asks for (issue 30), at the edge: the request fields that
force one, the 400s, and the response's ``guided.engine``."""

import pytest

from core.request import RequestOutput
from deploy import openai_api as api
from deploy import responses
from deploy.errors import APIError
from deploy.settings import Limits

pytestmark = pytest.mark.unit

LIMITS = Limits()
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), LIMITS)


def engine_of(plan):
    return plan.requests[0].grammar.engine


@pytest.mark.parametrize("fields, want", [
    ({"guided_json": SCHEMA}, "auto"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "llguidance"}, "llguidance"),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "xgrammar"),
    ({"guided_choice": ["x", "y"], "guided_decoding_backend": "guidance"}, "llguidance"),
    ({"structured_outputs": {"json": SCHEMA, "backend": "llguidance"}}, "llguidance"),
    ({"structured_outputs": {"regex": "a+", "backend": "auto"}}, "auto"),
    ({"response_format": {"type": "json_object"}, "guided_decoding_backend": "xgrammar"},
     "xgrammar"),
])
def test_the_request_field_selects_the_engine(fields, want):
    assert engine_of(chat(**fields)) == want


def test_the_engine_is_part_of_the_grammar_key():
    auto = chat(guided_json=SCHEMA).requests[0].grammar
    forced = chat(guided_json=SCHEMA, guided_decoding_backend="llguidance").requests[0].grammar
    assert auto.key("fp") != forced.key("fp")


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": 3}, "guided_decoding_backend"),
    ({"structured_outputs": {"json": SCHEMA, "backend": "nope"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"json": SCHEMA, "backend": "xgrammar"},
      "guided_decoding_backend": "llguidance"}, "structured_outputs.backend"),
])
def test_an_unknown_or_conflicting_engine_is_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as err:
        chat(**fields)
    assert err.value.status == 400 and err.value.param == param


def test_a_backend_without_a_grammar_changes_nothing():
    assert chat(guided_decoding_backend="xgrammar").requests[0].grammar is None


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_the_response_names_the_engine(engine):
    plan = chat(guided_json=SCHEMA)
    out = RequestOutput(plan.requests[0].request_id, text='{"a": 1}', finished=True,
                        finish_reason="stop", validation="valid", grammar_engine=engine)
    merged = RequestOutput(plan.requests[0].request_id).merge(out)  # the final field survives
    body = responses.response_body(plan, [merged], "m")
    assert body["choices"][0]["guided"]["engine"] == engine


def test_metrics_count_grammars_and_requests_per_engine():
    from deploy.metrics import Metrics
    from worker.guided.guided_process import GuidedStats

    stats = GuidedStats(xgrammar_grammars=2, llguidance_grammars=3, xgrammar_requests=5,
                        llguidance_requests=7)
    status = {"sessions": 0, "workers": {"w0": {"grammar_cache": stats.as_dict()}}}
    text = Metrics().render(status)
    for name, value in (("xgrammar_grammars", 2), ("llguidance_grammars", 3),
                        ("xgrammar_requests", 5), ("llguidance_requests", 7)):
        assert f'rayguide_worker_grammar_local_{name}{{worker="w0"}} {value}.0' in text, name


def test_the_family_is_the_same_for_every_engine():
    from core.grammar_spec import GrammarSpec

    specs = [GrammarSpec.json_schema(SCHEMA, engine=e) for e in ("auto", "xgrammar", "llguidance")]
    assert len({s.family for s in specs}) == 1
    assert len({s.key("fp") for s in specs}) == 3
    assert GrammarSpec.regex("a+").family != specs[0].family


# --- bench/fidelity.py's judging: the layout the server generates, strict mode's verdicts --

def test_fidelity_feeds_an_instance_in_the_schema_order_too():
    from bench.fidelity import in_schema_order, instances_for

    schema = {"$defs": {"p": {"properties": {"x": {}, "y": {}}}},
              "properties": {"b": {"$ref": "#/$defs/p"}, "a": {"type": "array",
                                                             "items": {"$ref": "#/$defs/p"}}},
              "allOf": [{"properties": {"c": {}}}]}
    data = {"z": 0, "a": [{"y": 1, "x": 2}], "c": 3, "b": {"y": 1, "x": 2}}
    ordered = in_schema_order(data, schema)
    assert list(ordered) == ["b", "a", "c", "z"]  # declared first, in order; the rest after
    assert list(ordered["b"]) == list(ordered["a"][0]) == ["x", "y"]
    (texts, valid), = instances_for(schema, [(data, True)], strict=False)[0]
    assert valid and len(texts) == 2 and texts[1].startswith('{"b": {"x": 2')
    (texts, _), = instances_for(schema, [(ordered, True)], strict=False)[0]
    assert len(texts) == 1  # already in order: fed once



def test_fidelity_orders_values_under_pattern_and_additional_properties():
    from bench.fidelity import in_schema_order

    item = {"properties": {"x": {}, "y": {}}}
    schema = {"properties": {"m": {"patternProperties": {"^n": item},
                                   "additionalProperties": {"properties": {"q": {}, "p": {}}}}}}
    data = {"m": {"n1": {"y": 1, "x": 2}, "o": {"p": 1, "q": 2}}}
    ordered = in_schema_order(data, schema)
    assert list(ordered["m"]["n1"]) == ["x", "y"]  # the pattern's schema orders it
    assert list(ordered["m"]["o"]) == ["q", "p"]  # else additionalProperties' does


def test_fidelity_orders_an_object_by_the_union_branch_it_fits():
    from bench.fidelity import in_schema_order

    schema = {"items": {"anyOf": [
        {"properties": {"text": {}, "type": {}}, "required": ["text"]},
        {"properties": {"data": {}, "mime": {}, "type": {}}, "required": ["data"]}]}}
    data = [{"type": "t", "text": "x"}, {"type": "i", "mime": "m", "data": "d"}]
    ordered = in_schema_order(data, schema)
    assert list(ordered[0]) == ["text", "type"]
    assert list(ordered[1]) == ["data", "mime", "type"]  # its branch's order, not the first's
    tagged = {"anyOf": [  # both fit by keys: the discriminator decides
        {"properties": {"method": {"const": "ping"}, "params": {"properties": {"a": {}}}}},
        {"properties": {"method": {"const": "call"},
                        "params": {"properties": {"b": {}, "a": {}}}}}]}
    ordered = in_schema_order({"method": "call", "params": {"a": 1, "b": 2}}, tagged)
    assert list(ordered["params"]) == ["b", "a"]

def test_fidelity_expects_strict_mode_to_reject_undeclared_properties():
    from bench.fidelity import instances_for, strict_excludes

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert strict_excludes(schema, {"a": 1, "extra": 2})
    assert not strict_excludes(schema, {"a": 1})
    assert not strict_excludes(schema, {"a": "x"})  # invalid anyway: not strict's doing
    tests = [({"a": 1, "extra": 2}, True), ({"a": 1}, True)]
    assert [v for _, v in instances_for(schema, tests, strict=True)[0]] == [False, True]
    assert instances_for(schema, tests, strict=True)[1] == 1
    assert [v for _, v in instances_for(schema, tests, strict=False)[0]] == [True, True]
