"""String formats on both grammar engines generate only what the post-validation accepts
(issue 39): each engine's own grammar for ``email``, ``hostname``, ``date``, ``time``,
``date-time`` and ``ipv4`` took strings jsonschema-rs refuses (a 65-character local part,
an ``xn--`` label, February 29th 2023, ``12:00:60Z``, ``01.2.3.4`` ...), so an answer could
come back ``invalid``; grammar_cache/format_patterns.py writes them as patterns of what it
accepts. Checked on a byte-level vocabulary (no model needed): the strings each engine
took before, ordinary strings it must still take, and strings sampled at random from the
grammar (runs to their length bounds) that the validator must accept."""

import json
import random

import pytest

from grammar_cache.format_patterns import format_patterns, format_patterns_text, pattern_for
from grammar_cache.spec import GrammarSpec
from tests.test_llguidance_guards_unit import BYTES, ENGINES, accepts, llguidance
from worker.engine.grammar_engines import _llguidance_grammar
from worker.engine.validation import approximated_keywords, validate_json

pytestmark = pytest.mark.unit

L63, L64 = "b" * 63, "b" * 64
# strings an engine's own format grammar took (probed) that the validator refuses
REFUSED = {
    "email": ["a" * 65 + "@b.co", f"a@{L64}.co", "a@xn--abc.com", "a@ab--cd.com",
              "a@" + ".".join([L63] * 4), "a@" + L64 * 4],
    "idn-email": ["a" * 65 + "@b.co", "a@xn--abc.com"],
    "hostname": [f"{L64}.com", "xn--abc.com", "ab--cd.com", ".".join([L63] * 3 + ["b" * 62])],
    "idn-hostname": ["xn--abc.com", L64],
    "date": ["2023-02-29", "2024-02-30", "2024-04-31", "2100-02-29"],
    "date-time": ["2023-02-29T00:00:00Z", "2024-04-31T00:00:00Z", "2024-01-01T12:00:60Z"],
    "time": ["12:00:60Z", "23:59:60+01:00"],
    "ipv4": ["01.2.3.4", "1.2.3.04"],
}
ACCEPTED = {
    "email": ["a@b.co", "a.b@c.d", "john.smith+tag@mail.example.com", "a" * 64 + "@b.co",
              f"a@{L63}.co", "a@b", "A@B.CO", "x@a--b.com", "o'brien@x.ie"],
    "idn-email": ["a@b.co"],
    "hostname": ["example.com", "a", "1.2.3.4", f"{L63}.com", "a-b.c-d.com",
                 ".".join([L63] * 3 + ["b" * 61])],
    "idn-hostname": ["example.com"],
    "date": ["2024-02-29", "2000-02-29", "0000-02-29", "2023-12-31", "2024-04-30"],
    "date-time": ["2024-01-02T03:04:05Z", "2024-01-02T03:04:05.123+05:30",
                  "2024-02-29t23:59:59z"],
    "time": ["03:04:05Z", "23:59:59-08:00", "00:00:00.5Z"],
    "ipv4": ["1.2.3.4", "0.0.0.0", "255.255.255.255", "10.0.0.1"],
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


def sample(grammar: str, rng: random.Random, p_stop: float) -> str:
    """A random string the grammar takes: a random allowed byte each step, ending with
    probability ``p_stop`` where it may end (0: only where nothing else is allowed)."""
    import llguidance.torch

    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    mask = llguidance.torch.allocate_token_bitmask(1, BYTES.vocab_size)
    out = []
    for _ in range(400):
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        words = mask[0].tolist()
        allowed = [t for t in range(BYTES.vocab_size) if (words[t // 32] >> (t % 32)) & 1]
        more = [t for t in allowed if t != BYTES.eos_token]
        if not more or (len(more) < len(allowed) and rng.random() < p_stop):
            break
        out.append(rng.choice(more))
        assert matcher.consume_token(out[-1])
    return BYTES.decode_str(out)


@pytest.mark.parametrize("fmt", sorted(REFUSED))
def test_random_values_at_their_bounds_validate(fmt):
    grammar = _llguidance_grammar(GrammarSpec.json_schema({"type": "string", "format": fmt}))
    rng = random.Random(fmt)
    for p_stop in (0.0, 0.02, 0.3):
        for _ in range(40):
            text = json.loads(sample(grammar, rng, p_stop))
            assert valid(fmt, text), (fmt, text)


def test_a_node_with_a_pattern_keeps_its_format():
    node = {"type": "string", "format": "email", "pattern": "@x[.]org$"}
    assert format_patterns(node) is node


def test_values_and_property_names_are_not_rewritten():
    schema = {"properties": {"format": {"type": "string"}},
              "enum": [{"format": "email"}], "default": {"format": "date"}}
    assert format_patterns(schema) is schema
    assert format_patterns_text(json.dumps(schema)) == json.dumps(schema)


def test_a_time_fraction_keeps_the_digit_guard():
    assert "[0-9]{1,10}" in pattern_for("time", 10)


@pytest.mark.parametrize("fmt", ["idn-email", "idn-hostname", "host-name", "ip-address"])
def test_formats_written_as_patterns_are_enforced(fmt):
    assert approximated_keywords({"type": "string", "format": fmt}) == []
    assert not llguidance.LLMatcher(BYTES, _llguidance_grammar(spec(fmt)), log_level=0).is_error()
