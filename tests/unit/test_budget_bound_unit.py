"""The lower bound on a JSON-schema grammar's shortest output (worker/guided/shortest_bound.py).

The bound must never exceed what an accepted output holds: each schema below comes with
its shortest instance, written by hand in both layouts the grammar may use, and the
schema's counts must stay at or under the instance's, count by count; with a tiny
hand-made vocabulary, no tokenization of the instance may be shorter than the bound.
Whether xgrammar's grammar accepts those instances is checked in
test_budget_bound_engine.py (it needs the real tokenizer)."""

import gc
import json
import time

import jsonschema
import pytest

from worker.guided.shortest_bound import ANY, TokenCapacity, literal, schema_counts

pytestmark = pytest.mark.unit

ITEM = {"type": "object", "properties": {"name": {"type": "string"},
                                         "biography": {"type": "string"}},
        "required": ["name", "biography"]}
LONG = {"type": "object", "properties": {"people": {"type": "array", "minItems": 40,
                                                    "items": ITEM}},
        "required": ["people"]}

# (name, schema, its shortest instance as a value)
SHORTEST = [
    ("long", LONG, {"people": [{"name": "", "biography": ""}] * 40}),
    ("person", {"type": "object", "properties": {"name": {"type": "string"},
                                                 "age": {"type": "integer"},
                                                 "note": {"type": "string"}},
                "required": ["name", "age"]}, {"name": "", "age": 0}),
    ("ints", {"type": "array", "items": {"type": "integer"}, "minItems": 12}, [0] * 12),
    ("formats", {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}, "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"}},
        "required": ["id", "day", "at"]},
     {"id": "a" * 8 + "-aaaa-aaaa-aaaa-" + "a" * 12, "day": "2020-01-01",
      "at": "2020-01-01T00:00:00Z"}),
    ("min-length", {"type": "object", "properties": {"s": {"type": "string", "minLength": 7}},
                    "required": ["s"]}, {"s": "aaaaaaa"}),
    ("pattern", {"type": "object", "properties": {"s": {"type": "string",
                                                        "pattern": "^a{24}$"}},
                 "required": ["s"]}, {"s": "a" * 24}),
    ("any-of", {"anyOf": [{"type": "array", "items": {"type": "integer"}, "minItems": 9},
                          {"type": "null"}]}, None),
    ("enum", {"enum": ["long enough", [1, 2], {"k": "v"}]}, [1, 2]),
    ("ref", {"$defs": {"P": ITEM}, "type": "array", "items": {"$ref": "#/$defs/P"},
             "minItems": 2}, [{"name": "", "biography": ""}] * 2),
    ("recursive", {"$defs": {"T": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}, "minItems": 1}},
        "required": []}}, "$ref": "#/$defs/T"}, {}),
    ("no-type", {"properties": {"a": {"type": "boolean"}}, "required": ["a"]}, {"a": True}),
    # properties without a type bind objects only: any other value is an instance (and
    # llguidance, which serves such a schema under auto, writes one)
    ("no-type-any", {"properties": {"a": {"type": "boolean"}}, "required": ["a"]}, 0),
    ("prefix", {"type": "array", "prefixItems": [{"type": "string", "minLength": 3}],
                "items": {"type": "integer"}, "minItems": 3}, ["aaa", 0, 0]),
    ("type-list", {"type": ["string", "integer"], "minLength": 5}, 0),
    ("nested", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "minItems": 3, "items": {"type": "object", "properties": {
            "d": {"type": "boolean"}}, "required": ["d"]}}}, "required": ["b"]}},
        "required": ["a"]}, {"a": {"b": [{"d": True}] * 3}}),
]


def text_counts(text: str) -> tuple[int, ...]:
    """What a text holds, in the layout of shortest_bound.Counts."""
    raw = text.encode()
    return (len(raw), *(raw.count(c) for c in b'{}[]":,'),
            sum(0x30 <= b <= 0x39 for b in raw), 0)


def layouts(value):
    """The instance as the grammar may write it: compact, and json.dumps' one line."""
    return [json.dumps(value, separators=(",", ":")), json.dumps(value)]


@pytest.mark.parametrize("name, schema, instance", SHORTEST, ids=[r[0] for r in SHORTEST])
def test_the_counts_never_exceed_an_accepted_instance(name, schema, instance):
    jsonschema.validate(instance, schema)  # the instance is the schema's
    counts = schema_counts(json.dumps(schema))
    for text in layouts(instance):
        held = text_counts(text)
        assert all(c <= h for c, h in zip(counts, held)), (text, counts, held)


def test_the_structure_of_a_long_schema_is_counted_exactly():
    # 40 objects of two required empty strings: every brace, quote, colon and comma
    compact = json.dumps(SHORTEST[0][2], separators=(",", ":"))
    assert schema_counts(LONG) == text_counts(compact)


# a tiny vocabulary: single characters, and merges that hold several counted characters
VOCAB = ([bytes([b]) for b in range(32, 127)]
         + [b'""', b'"}', b'"}]', b'", "', b'": "', b'{"', b'":', b'", ', b"  " * 20,
            b"name", b"biography", b"people", b",,,,", b'"""'])


def fewest_tokens(text: str, vocab=VOCAB) -> int:
    """The shortest tokenization of ``text`` over ``vocab`` (dynamic programming)."""
    raw = text.encode()
    best = [0] + [1 << 30] * len(raw)
    for i in range(1, len(raw) + 1):
        for t in vocab:
            if len(t) <= i and raw[i - len(t):i] == t:
                best[i] = min(best[i], best[i - len(t)] + 1)
    return best[-1]


def test_capacity_counts_what_one_token_holds():
    cap = TokenCapacity(VOCAB)
    assert cap.caps[0] == 40  # bytes: the blank run
    assert cap.caps[5] == 3  # quotes: '"""'
    assert cap.caps[7] == 4  # commas: ',,,,'
    assert cap.caps[8] == 1  # digits: one a token


MANY_NAMES = {"type": "object", "properties": {
    f"propertyNumber{i}": {"enum": ["Service provider assertion", "Independent validation"]}
    for i in range(12)}, "required": [f"propertyNumber{i}" for i in range(12)]}
SHORTEST_AND_NAMES = SHORTEST + [
    ("names", MANY_NAMES, {f"propertyNumber{i}": "Independent validation" for i in range(12)})]


@pytest.mark.parametrize("name, schema, instance", SHORTEST_AND_NAMES,
                         ids=[r[0] for r in SHORTEST_AND_NAMES])
def test_no_tokenization_is_shorter_than_the_bound(name, schema, instance):
    # both bounds: the characters', and the literal texts' (cover)
    cap = TokenCapacity(VOCAB)
    bound = cap.bound(schema)
    assert bound >= cap.min_tokens(schema_counts(schema))
    for text in layouts(instance):
        assert bound <= fewest_tokens(text), (text, bound)


@pytest.mark.parametrize("text", ['"name"', '"biography"', '"people"', '"a"', '"nameless"',
                                  '"Service provider assertion"', '""'])
def test_a_cover_counts_the_tokens_starting_inside_a_text(text):
    # against brute force: every placement of the text inside a longer output, the fewest
    # tokens starting inside it in any tokenization (some bytes of context either side)
    cap = TokenCapacity(VOCAB)
    raw = text.encode()
    least = min(_starting_inside(b + raw + a, len(b), len(b) + len(raw))
                for b in (b"", b"{", b", ", b'{"', b"x") for a in (b"", b":", b'": "', b"}"))
    assert cap.cover(text) <= least
    assert cap.cover(text) == least or text == '""'  # (two quotes: one token ends both)


def _starting_inside(raw: bytes, start: int, end: int) -> int:
    """The fewest tokens, over every tokenization of ``raw`` by VOCAB, whose first byte
    lies in ``raw[start:end]``."""
    best = [0] + [1 << 30] * len(raw)
    for i in range(1, len(raw) + 1):
        for t in VOCAB:
            if len(t) <= i and raw[i - len(t):i] == t:
                begins = i - len(t)
                best[i] = min(best[i], best[begins] + (start <= begins < end))
    return best[-1]


def test_names_bound_a_schema_the_characters_do_not():
    # 12 required names of 16 characters each, not in the vocabulary: spelt in pieces
    # (here one character a token), where the characters alone count a few quotes a token
    cap = TokenCapacity(VOCAB)
    chars = cap.min_tokens(schema_counts(MANY_NAMES))
    assert cap.bound(MANY_NAMES) > 2 * chars
    assert schema_counts(MANY_NAMES)[9] == 0  # without a cover, nothing counted there


def test_a_long_schema_is_bounded_far_above_a_small_budget():
    # the bench's old guided schema: 322 quotes and 82 braces, where one token holds at
    # most 3 of '{}"': at least 135 tokens, far over max_tokens 24 or 48
    cap = TokenCapacity(VOCAB)
    assert cap.min_tokens(schema_counts(LONG)) >= -(-(322 + 82) // 3) == 135


def test_readings_take_the_least():
    # const beside a type, $ref beside a type, anyOf beside properties: xgrammar reads one
    # of them; the bound is the least of all
    obj = {"type": "object", "properties": {"a": {"type": "string", "minLength": 30}},
           "required": ["a"]}
    assert schema_counts({**obj, "const": "x"}) == literal("x")
    short = {"type": "string", "minLength": 3}
    assert schema_counts({**obj, "anyOf": [short]}) == schema_counts(short)
    assert schema_counts({"$defs": {"N": {"type": "null"}}, **obj,
                          "$ref": "#/$defs/N"}) == literal(None)
    # format over pattern over length: the least of those present
    assert schema_counts({"type": "string", "format": "uuid", "minLength": 2})[0] == 4


@pytest.mark.parametrize("schema, reads_as", [
    ("not json", True), (True, True), (False, True), ({}, True), ({"type": "frob"}, True),
    ({"$ref": "http://example.com/s.json"}, True), ({"$ref": "#/nowhere"}, True),
    ({"type": "string", "pattern": "[^]\\p{L}("}, {"type": "string"}),
    ({"type": "array", "minItems": "3", "items": {"type": "integer"}}, {"type": "array"}),
    ({"type": "object", "properties": {"a": {}}, "required": "a"}, {"type": "object"}),
], ids=repr)
def test_what_cannot_be_read_counts_for_nothing(schema, reads_as):
    counts = schema_counts(schema if schema == "not json" else json.dumps(schema))
    assert counts == (ANY if reads_as is True else schema_counts(reads_as))


def test_deep_and_wide_schemas_stay_cheap():
    deep = {"type": "integer"}
    for _ in range(500):
        deep = {"type": "array", "items": deep, "minItems": 2}
    wide = {"type": "object", "properties": {f"k{i}": ITEM for i in range(2000)},
            "required": [f"k{i}" for i in range(2000)]}
    huge = {"type": "array", "items": ITEM, "minItems": 10**12}
    for schema in (deep, wide, huge, LONG):
        text = json.dumps(schema)
        gc.collect()  # (a full collection of the suite's objects is not the schema's)
        t = time.thread_time()  # CPU, not wall: a loaded machine does not inflate it
        counts = schema_counts(text)
        # about 0.1 s each alone; 0.58 was seen beside other tests: a bound 20x a read
        # still fails a read that grows past linear in the schema
        assert time.thread_time() - t < 2.0
        assert counts[0] >= 1
    assert schema_counts(huge)[5] == 8 * 10**12  # 8 quotes an item, none outside


def test_the_bound_is_fast_enough_for_admission():
    text = json.dumps(LONG)
    cap = TokenCapacity(VOCAB)
    t = time.thread_time()
    for _ in range(100):
        cap.min_tokens(schema_counts(text))
    assert (time.thread_time() - t) / 100 < 0.005  # measured ~50 us of CPU
