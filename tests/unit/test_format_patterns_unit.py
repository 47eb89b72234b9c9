"""String formats on both grammar engines generate only what the post-validation accepts
(issue 39): each engine's own grammar for ``email``, ``hostname``, ``date``, ``time``,
``date-time`` and ``ipv4`` took strings jsonschema-rs refuses (a 64-character domain label,
an ``xn--`` label, February 29th 2023, ``12:00:60Z``, ``01.2.3.4`` ...), so an answer could
come back ``invalid``; grammar_cache/format_patterns.py writes them as patterns of what it
accepts (an e-mail's local part over 64 characters too: a runaway at the budget). Checked on a byte-level vocabulary (no model needed): the strings each engine
took before, ordinary strings it must still take, and strings sampled at random from the
grammar (runs to their length bounds) that the validator must accept."""

import functools
import json
import random

import pytest

from grammar_cache.format_patterns import format_patterns, format_patterns_text, pattern_for
from core.grammar_spec import GrammarSpec
from tests.engine.test_llguidance_guards_unit import BYTES, ENGINES, accepts, llguidance
from worker.guided.llguidance_backend import _llguidance_grammar
from worker.guided.validation import approximated_keywords, validate_json

pytestmark = pytest.mark.unit

L63, L64 = "b" * 63, "b" * 64
# strings an engine's own format grammar took (probed) that the validator refuses
REFUSED = {
    "email": ["a@xn--abc.com", "a@ab--cd.com", "a@b.xn--c", "a" * 65 + "@b.co",
              "a" * 31 + "." + "b" * 33 + "@b.co", f"a@{L64}.com",
              "a@" + ".".join([L63] * 4 + ["b"])],
    "idn-email": ["a@xn--abc.com"],
    "hostname": [f"{L64}.com", "xn--abc.com", "ab--cd.com", ".".join([L63] * 3 + ["b" * 62])],
    "idn-hostname": ["xn--abc.com", L64],
    "date": ["2023-02-29", "2024-02-30", "2024-04-31", "2100-02-29"],
    "date-time": ["2023-02-29T00:00:00Z", "2024-04-31T00:00:00Z", "2024-01-01T12:00:60Z",
                  "2024-01-01T12:00:0012Z"],  # (an optional group's "." left out: "?")
    "time": ["12:00:60Z", "23:59:60+01:00", "12:00:0012Z"],
    "ipv4": ["01.2.3.4", "1.2.3.04"],
    "ipv6": ["::8.90.02.8"],
}
ACCEPTED = {
    "email": ["a@b.co", "a.b@c.d", "john.smith+tag@mail.example.com", "a" * 64 + "@b.co",
              "a" * 31 + "." + "b" * 32 + "@b.co", "a.b.c.d@e.f",
              f"a@{L63}.co", "a@b", "A@B.CO", "x@a--b.com", "o'brien@x.ie"],
    "idn-email": ["a@b.co"],
    "hostname": ["example.com", "a", "1.2.3.4", f"{L63}.com", "a-b.c-d.com",
                 ".".join([L63] * 3 + ["b" * 61])],
    "idn-hostname": ["example.com"],
    "date": ["2024-02-29", "2000-02-29", "0400-02-29", "0001-01-01", "2023-12-31",
             "2024-04-30", "9999-12-31"],
    "date-time": ["2024-01-02T03:04:05Z", "2024-01-02T03:04:05.123+05:30",
                  "2024-02-29t23:59:59z"],
    "time": ["03:04:05Z", "23:59:59-08:00", "00:00:00.5Z"],
    "ipv4": ["1.2.3.4", "0.0.0.0", "255.255.255.255", "10.0.0.1"],
    "ipv6": ["::1", "::", "fe80::1", "1:2:3:4:5:6:7:8", "2001:db8::8a2e:370:7334",
             "1:2:3:4:5:6:7::", "1::8"],
    "json-pointer": ["", "/a/b", "/a~1b/~0c", "/a b"],
    "relative-json-pointer": ["0", "1/a", "12#"],
}


def spec(fmt: str) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {
        "v": {"type": "string", "format": fmt}}, "required": ["v"]})


def valid(fmt: str, text: str) -> bool:
    return validate_json({"format": fmt}, json.dumps(text)) is None


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", sorted(REFUSED))
def test_formats_refuse_what_the_validator_refuses(engine, fmt):
    for text in REFUSED[fmt]:
        assert not valid(fmt, text), text  # (the validator's verdict: the reason for the test)
        assert not accepts(engine, spec(fmt), json.dumps({"v": text})), (engine, fmt, text)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", sorted(ACCEPTED))
def test_formats_still_take_ordinary_values(engine, fmt):
    for text in ACCEPTED[fmt]:
        assert valid(fmt, text), text
        assert accepts(engine, spec(fmt), json.dumps({"v": text})), (engine, fmt, text)


def allowed_bytes(mask_row) -> list[int]:
    words = mask_row.tolist()
    return [t for t in range(len(words) * 32) if (words[t // 32] >> (t % 32)) & 1]


def sample(step, stop: int, rng: random.Random, p_stop: float, limit: int = 300) -> str:
    """A random string a matcher takes: a random allowed ASCII byte each step, ending with
    probability ``p_stop`` where it may end (0: only where nothing else is allowed);
    past ``limit`` bytes it ends as soon as it may, or closes the string.
    ``step(token)``: feeds a byte (None: none yet) and returns the allowed ones."""
    out, allowed = [], step(None)
    while len(out) < limit + 64:
        more = [t for t in allowed if t != stop and t < 128]
        if not more or (stop in allowed and (len(out) >= limit or rng.random() < p_stop)):
            break
        out.append(ord('"') if len(out) >= limit and ord('"') in more else rng.choice(more))
        allowed = step(out[-1])
    return bytes(out).decode()


def llguidance_stepper(spec: GrammarSpec):
    import llguidance.torch

    matcher = llguidance.LLMatcher(BYTES, _llguidance_grammar(spec), log_level=0)
    mask = llguidance.torch.allocate_token_bitmask(1, BYTES.vocab_size)

    def step(token):
        if token is not None:
            assert matcher.consume_token(token)
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        return allowed_bytes(mask[0])
    return step, BYTES.eos_token


@functools.lru_cache(maxsize=4)
def xgrammar_compiled(spec: GrammarSpec):
    import xgrammar as xgr

    from grammar_cache.compile import _json_format, json_schema_ebnf

    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return info, xgr.GrammarCompiler(info).compile_grammar(
        json_schema_ebnf(spec.source, **_json_format(spec)))


def xgrammar_stepper(spec: GrammarSpec):
    import xgrammar as xgr

    info, compiled = xgrammar_compiled(spec)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def step(token):
        if token is not None:
            assert matcher.accept_token(token)
        matcher.fill_next_token_bitmask(mask)
        return allowed_bytes(mask[0])
    return step, 256


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", sorted({*REFUSED, "uuid", "duration", "uri", "uri-reference",
                                        "uri-template", "json-pointer",
                                        "relative-json-pointer"}))
def test_random_values_at_their_bounds_validate(engine, fmt):
    spec = GrammarSpec.json_schema({"type": "string", "format": fmt})
    if engine == "llguidance" and fmt in ("uri-reference", "uri-template"):
        pytest.skip("llguidance refuses the format (auto serves it on xgrammar)")
    stepper = xgrammar_stepper if engine == "xgrammar" else llguidance_stepper
    rng = random.Random(fmt)
    ended = 0
    for p_stop in (0.0, 0.02, 0.3):
        for _ in range(30):
            text = sample(*stepper(spec), rng, p_stop)
            if not text.endswith('"') or len(text) < 2:
                continue  # (a walk that could not close in time: no output)
            ended += 1
            value = json.loads(text)
            local, _, domain = value.partition("@")
            if fmt.endswith("email") and (len(local) > 64 or len(domain) > 253 or any(
                    len(label) > 63 for label in domain.split("."))):
                continue  # (left possible, for the closing search: format_patterns._LOCAL)
            assert valid(fmt, value), (engine, fmt, text)
    assert ended >= 45


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", ["json-pointer", "relative-json-pointer"])
def test_json_pointers_hold_no_raw_control_character(engine, fmt):
    # (xgrammar's own json-pointer grammar took them: the output was not JSON)
    text = "0/a{}b" if fmt == "relative-json-pointer" else "/a{}b"
    assert not accepts(engine, spec(fmt), '{"v": "%s"}' % text.format("\x11"))
    assert accepts(engine, spec(fmt), '{"v": "%s"}' % text.format(" "))


def test_a_node_with_a_pattern_keeps_its_format():
    node = {"type": "string", "format": "email", "pattern": "@x[.]org$"}
    assert format_patterns(node) is node


def test_values_and_property_names_are_not_rewritten():
    schema = {"properties": {"format": {"type": "string"}},
              "enum": [{"format": "email"}], "default": {"format": "date"}}
    assert format_patterns(schema) is schema
    assert format_patterns_text(json.dumps(schema)) == json.dumps(schema)


def test_a_schema_with_a_number_past_a_double_is_left_as_written():
    text = '{"properties": {"e": {"format": "email"}, "n": {"maximum": 1e400}}}'
    assert format_patterns_text(text) == text
    assert "pattern" in format_patterns_text(text.replace("1e400", "10"))


def test_a_time_fraction_keeps_the_digit_guard():
    assert "[0-9]{1,10}" in pattern_for("time", 10)


@pytest.mark.parametrize("fmt", ["idn-email", "idn-hostname", "host-name", "ip-address"])
def test_formats_written_as_patterns_are_enforced(fmt):
    assert approximated_keywords({"type": "string", "format": fmt}) == []
    assert not llguidance.LLMatcher(BYTES, _llguidance_grammar(spec(fmt)), log_level=0).is_error()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt, text", [("date", "0000-01-01"), ("date", "0000-02-29"),
                                       ("date-time", "0000-01-01T00:00:00Z")])
def test_year_zero_is_not_written(engine, fmt, text):
    # the validator takes year 0000 (RFC 3339); Python's date, and so a pydantic client's
    # `date` field, refuses it (bench/clients.py: an Event's date came back "0000-...")
    assert valid(fmt, text)
    assert not accepts(engine, spec(fmt), json.dumps({"v": text})), (engine, fmt, text)


# --- xgrammar: a pattern beside a format, propertyNames, patternProperties ---------------

@pytest.mark.parametrize("pattern, anything", [
    (".*", True), ("^.*$", True), ("", True), ("^.*", True), ("^$", False), ("a", False),
    ("^https://", False), ("\\$", False)])
def test_takes_any_string(pattern, anything):
    from grammar_cache.format_patterns import takes_any_string

    assert takes_any_string(pattern) == anything


def test_the_xgrammar_compile_enforces_a_prefix_pattern_beside_a_uri_format():
    # JSONSchemaStore's schema-catalog (JSONSchemaBench): xgrammar read the uri format
    # and left "^https://" out, and the answer's "url" failed the pattern at its budget
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from grammar_cache.compile import json_schema_ebnf

    node = {"type": "string", "format": "uri", "pattern": "^https://"}
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(node)))
    # xgrammar matches the whole string: "https://" alone (a subset of what the pattern
    # takes, so valid; the format is left to the post-validation)
    assert _is_grammar_accept_string(grammar, json.dumps("https://"))
    assert not _is_grammar_accept_string(grammar, json.dumps("http://example.com/a.json"))
    # a pattern that takes anything leaves the format's grammar in place
    loose = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(
        {"type": "string", "format": "date", "pattern": ".*"})))
    assert _is_grammar_accept_string(loose, json.dumps("2024-01-02"))
    assert not _is_grammar_accept_string(loose, json.dumps("not a date"))


def test_property_names_of_an_enum_are_written_as_properties_for_xgrammar():
    # Github_hard o12460 (JSONSchemaBench): xgrammar leaves propertyNames out, and a
    # "description" key passed where only pipette names may be (invalid at its budget)
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from grammar_cache.compile import json_schema_ebnf

    schema = {"definitions": {"name": {"type": "string", "enum": ["p10", "p50"]}},
              "type": "object", "properties": {"rates": {
                  "type": "object", "propertyNames": {"$ref": "#/definitions/name"},
                  "patternProperties": {".*": {"type": "number"}},
                  "additionalProperties": False}}}
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(schema)))
    take = lambda v: _is_grammar_accept_string(grammar, json.dumps({"rates": v}))  # noqa: E731
    assert take({"p10": 1.5}) and take({"p10": 1, "p50": 2}) and take({})
    assert not take({"description": 1.0}) and not take({"p10": "x"})
    assert approximated_keywords(schema) == []
    # names that are not a plain list stay approximated (and listed)
    loose = {"type": "object", "propertyNames": {"pattern": "^p.*$"}}
    assert approximated_keywords(loose) == ["propertyNames"]
    # an untyped node with patternProperties only: xgrammar took a string for its values
    labware = {"type": "object", "properties": {"labware": {
        "patternProperties": {".+": {"type": "object", "required": ["slot"],
                                     "properties": {"slot": {"type": "string"}}}}}}}
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(labware)))
    assert not _is_grammar_accept_string(grammar, json.dumps({"labware": {"mount": "right"}}))
    assert _is_grammar_accept_string(grammar, json.dumps({"labware": {"a": {"slot": "1"}}}))
