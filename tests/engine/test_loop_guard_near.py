"""The loop guard's near repeats (issue 39): array items equal but for numbers that step
(``{"name": "Tacos", "quantity": 1}, {"name": "Tacos", "quantity": 2}, ...``, also past
the 48 tokens the exact detector sees, and where ``9 -> 10`` changes the token count), and
sentences that restart with a changed word. Ended after ``near_repeats`` (8) items or
``sentence_repeats`` (4) sentences in a row, the copies seen kept; never what the schema
demands (minItems, a pattern) nor a list of distinct items. Detector on the real
tokenizer (xgrammar matcher); the engine on both grammar engines, with the scripted
tiny model as tests/engine/test_loop_guard.py does."""

import json

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from tests.engine.test_loop_guard import STORE, detect, scripted, vocab  # noqa: F401 (a fixture)
from core.params import LoopGuardParams
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

ENGINES = ["xgrammar", "llguidance"]
LINE = {"type": "object", "properties": {
    "name": {"type": "string"}, "note": {"type": "string"}, "quantity": {"type": "integer"},
    "price": {"type": "number"}}, "required": ["name", "note", "quantity", "price"],
    "additionalProperties": False}
ORDER = {"type": "object", "properties": {"items": {"type": "array", "items": LINE}},
         "required": ["items"], "additionalProperties": False}
ORDER_12 = {"type": "object", "properties": {"items": {"type": "array", "items": LINE,
                                                       "minItems": 12}},
            "required": ["items"], "additionalProperties": False}
POINTS = {"type": "object", "properties": {"points": {"type": "array", "items": {
    "type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"},
                                     "label": {"type": "string"}},
    "required": ["lat", "lon", "label"], "additionalProperties": False}}},
    "required": ["points"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"], "additionalProperties": False}
SAW = {"type": "object", "properties": {"s": {"type": "string",
                                              "pattern": "^(I saw a [a-z]+\\. ){6}$"}},
       "required": ["s"], "additionalProperties": False}
NOTE = ("two soft corn tortillas with grilled chicken, red onions, lime, a green salsa and "
        "fresh cilantro, wrapped in paper")


def line(q, name="Tacos", note=NOTE):  # 50 tokens and more: past the exact detector
    return (f'{{"name": "{name}", "note": "{note} (serves {q})", "quantity": {q}, '
            f'"price": {q * 3.5}}}')


def order(qs, **kw):
    return '{"items": [' + ", ".join(line(q, **kw) for q in qs)


@pytest.mark.parametrize("text, kept", [
    # counting items longer than the exact detector's 48 tokens, through 9 -> 10
    (order(range(5, 20)), order(range(5, 13)) + "]"),
    # exact copies of a long item: found after 3 copies, ended after the first (the
    # copies say nothing more, and break uniqueItems)
    (order([4] * 10), order([4]) + "]"),
    # in a string item too
    ('{"tags": [' + ", ".join(f'"Chapter {i}: {NOTE}"' for i in range(1, 14)),
     '{"tags": [' + ", ".join(f'"Chapter {i}: {NOTE}"' for i in range(1, 9)) + "]"),
])
def test_near_copies_of_an_item_are_ended_after_their_copies(default_tokenizer, vocab, text,
                                                              kept):
    schema = TAGS if text.startswith('{"tags"') else ORDER
    assert detect(default_tokenizer, vocab, schema, text) == kept


DATES = {"type": "object", "properties": {"days": {"type": "array", "items": {"type": "string"}}},
         "required": ["days"], "additionalProperties": False}


def days(first, last, month=1):
    return '{"days": [' + ", ".join(f'"2022-{month:02d}-{d:02d}"' for d in range(first, last + 1))


@pytest.mark.parametrize("text, kept", [
    # counting past the month's end (the clients bench's instructor answer): ended before
    # the first day that is not one
    (days(20, 45), days(20, 31) + "]"),
    (days(1, 40, month=2), days(1, 28, month=2) + "]"),
])
def test_dates_counting_past_the_calendar_are_ended_before_it(default_tokenizer, vocab, text,
                                                               kept):
    assert detect(default_tokenizer, vocab, DATES, text) == kept


def test_a_long_run_of_digits_repeats_at_two_copies_inside_a_string_only(default_tokenizer,
                                                                          vocab):
    # one token per digit: 12 tokens, a long span. Inside one string two copies are a loop
    # (Github_medium/o43994's "1234567890, 1234567890, ..."); across a list's items it
    # takes three (two dates of a list crossing a month share 12 tokens: see above)
    got = detect(default_tokenizer, vocab, TAGS, '{"tags": ["1234567890, 1234567890, 1234')
    assert got == '{"tags": ["1234567890, "', got


def test_minitems_near_copies_are_ended_only_after_the_minimum(default_tokenizer, vocab):
    got = detect(default_tokenizer, vocab, ORDER_12, order(range(1, 16)))
    assert got == order(range(1, 13)) + "]", got


FRUITS = ("apple banana cherry grape lemon mango melon orange peach pear plum kiwi lime fig "
          "date").split()


@pytest.mark.parametrize("schema, text", [
    # distinct items, counting quantities: names differ
    (ORDER, order([]) + ", ".join(line(q, name=f) for q, f in enumerate(FRUITS, 1))),
    # data: numbers that do not step alike
    (POINTS, '{"points": [' + ", ".join(
        f'{{"lat": {48 + (i * 37 % 11) / 10}, "lon": {2 + (i * 53 % 7) / 10}, "label": "stop"}}'
        for i in range(14))),
    # dates are data: every day of a month, and a date that is wrong once, not counting
    (DATES, days(1, 31) + ", " + days(1, 28, month=2)[len('{"days": ['):]),
    (DATES, '{"days": ["2022-01-04", "2022-02-31", "2022-03-04", "2022-05-01"'),
    # an enumeration of 7 items (up to near_repeats - 1 are kept whole)
    (ORDER, order(range(1, 8))),
    # three short equal answers: under min_chars together, as the exact detector counts
    (TAGS, '{"tags": ["A", "A", "A"'),
    # the pattern demands six sentences that restart
    (SAW, '{"s": "' + "".join(f"I saw a {w}. " for w in FRUITS[:6])),
    # three sentences of the same opening is writing, four is the threshold
    (STORE, '{"store": "The city has parks. The city has museums. The city has beaches. '
            'It is known for its food and its long history'),
    (STORE, '{"store": "Preheat the oven to 180 degrees. Mix the flour, sugar and eggs in a '
            'bowl. Pour the batter into a greased tin. Bake for 35 minutes, until golden. '
            'Let it cool before serving.'),
])
def test_what_is_not_a_near_repeat_is_kept(default_tokenizer, vocab, schema, text):
    assert detect(default_tokenizer, vocab, schema, text) is None


def test_sentences_that_restart_with_a_changed_word_are_ended(default_tokenizer, vocab):
    places = ["store", "park", "beach", "mall", "zoo", "lake", "gym", "bank"]
    text = '{"store": "' + " ".join(f"I went to the {p}." for p in places)
    got = detect(default_tokenizer, vocab, STORE, text)
    assert got == '{"store": "' + " ".join(f"I went to the {p}." for p in places[:4]) + '"'


def test_near_repeats_can_be_turned_off(default_tokenizer, vocab):
    off = LoopGuardParams(near_repeats=0, sentence_repeats=0)
    assert detect(default_tokenizer, vocab, ORDER, order(range(5, 20)), off) is None
    with pytest.raises(ValueError, match="near_repeats"):
        LoopGuardParams(near_repeats=1)


def generate(engine, schema, name, max_tokens):
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema, engine=name))
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    assert chunks[-1].finished
    return "".join(c.text for c in chunks), chunks[-1]


@pytest.mark.parametrize("name", ENGINES)
def test_engine_ends_counting_items_on_each_engine(make_tiny_engine, name):
    engine = make_tiny_engine()
    scripted(engine, order(range(5, 40)))
    text, final = generate(engine, ORDER, name, 1000)
    assert final.grammar_engine == name
    assert final.finish_reason == "stop" and final.loop_cuts == 1, text
    answer = json.loads(text)
    jsonschema.validate(answer, ORDER)
    assert [i["quantity"] for i in answer["items"]] == list(range(5, 13))


@pytest.mark.parametrize("name", ENGINES)
def test_engine_ends_dates_past_the_calendar_on_each_engine(make_tiny_engine, name):
    engine = make_tiny_engine()
    scripted(engine, days(25, 60))
    text, final = generate(engine, DATES, name, 1000)
    assert final.grammar_engine == name
    assert final.finish_reason == "stop" and final.loop_cuts == 1, text
    assert json.loads(text)["days"] == [f"2022-01-{d}" for d in range(25, 32)]


@pytest.mark.parametrize("name", ENGINES)
def test_engine_ends_restarting_sentences_on_each_engine(make_tiny_engine, name):
    engine = make_tiny_engine()
    words = ["store", "park", "beach", "mall", "zoo", "lake", "gym", "bank"] * 8
    scripted(engine, '{"store": "' + " ".join(f"I went to the {w}." for w in words))
    text, final = generate(engine, STORE, name, 400)
    assert final.grammar_engine == name
    assert final.finish_reason == "stop" and final.loop_cuts == 1, text
    assert json.loads(text)["store"] == " ".join(f"I went to the {w}." for w in words[:4])


# --- items and sentences that cycle (A, B, A, B ...) ------------------------------------------

SHOP = '{"items": [{"name": "Pizza", "note": "", "quantity": 10, "price": 1.5}, '
BASKET = [f'{{"name": "{n}", "note": "", "quantity": 1, "price": 1.5}}'
          for n in ("Lemonade", "Coffee", "Burgers", "Soda")]


def cycle(qs, names=("Tacos", "Burrito")):
    """Items that cycle through ``names``, each round counting ``q`` (A1, B1, A2, B2 ...)."""
    return '{"items": [' + ", ".join(line(q, name=n) for q in qs for n in names)


LINES = '{"items": ['
MENU = ("Tacos", "Burritos", "Nachos")


def priced(i):
    """Line ``i`` of an order cycling through MENU, its price counting up a line at a time."""
    return f'{{"name": "{MENU[i % 3]}", "note": "", "quantity": 30, "price": {i + 1.5}}}'


@pytest.mark.parametrize("text, kept", [
    # A1, B1, A2, B2 ...: each item a near copy of the one two before; 5 rounds kept
    (cycle(range(1, 14)), cycle(range(1, 6)) + "]"),
    # exact A, B rounds of long items (past the exact detector's 48 tokens): 3 rounds
    (cycle([3] * 10), cycle([3] * 3) + "]"),
    # three items a round: 4 rounds kept
    (cycle(range(1, 12), ("Tacos", "Burrito", "Nachos")),
     cycle(range(1, 5), ("Tacos", "Burrito", "Nachos")) + "]"),
    # the clients bench's order (xgrammar, openai, at its budget of 512 after 19 lines):
    # three lines a round, the price counting by one from line to line; 4 rounds kept
    (LINES + ", ".join(priced(i) for i in range(19)),
     LINES + ", ".join(priced(i) for i in range(12)) + "]"),
    # the clients bench's shopping list (auto, langchain, at its budget): rounds of four
    # short items, 80 tokens a round, past the exact detector's 48; 3 rounds kept
    (SHOP + ", ".join(BASKET * 6), SHOP + ", ".join(BASKET * 3) + "]"),
])
def test_items_that_cycle_are_ended_after_their_rounds(default_tokenizer, vocab, text, kept):
    assert detect(default_tokenizer, vocab, ORDER, text) == kept


def test_sentences_that_cycle_are_ended(default_tokenizer, vocab):
    # a pair of sentences, the first restarting with a changed word each round
    places = ["store", "park", "beach", "mall", "zoo", "lake", "gym", "bank"]
    pair = "I went to the {}. We ate some very nice food there with all of our friends."
    text = '{"store": "' + " ".join(pair.format(p) for p in places)
    got = detect(default_tokenizer, vocab, STORE, text)
    assert got == '{"store": "' + " ".join(pair.format(p) for p in places[:4]) + '"', got


SCORES = {"type": "object", "properties": {"rounds": {"type": "array", "items": {
    "type": "object", "properties": {"team": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["team", "score"], "additionalProperties": False}}},
    "required": ["rounds"], "additionalProperties": False}
SHIFTS = {"type": "object", "properties": {"shifts": {"type": "array", "items": {
    "type": "string", "enum": ["early shift", "late shift", "night shift"]},
    "minItems": 21}}, "required": ["shifts"], "additionalProperties": False}


@pytest.mark.parametrize("schema, text", [
    # two teams' scores alternating: data (the scores do not step alike)
    (SCORES, '{"rounds": [' + ", ".join(
        f'{{"team": "{t}", "score": {s}}}' for i in range(12)
        for t, s in (("Red", 3 + i * i % 7), ("Blue", 5 + i * 3 % 4)))),
    # distinct items in a round: days and meals (the words differ)
    (TAGS, '{"tags": [' + ", ".join(
        f'"{d}: {m} with friends and family at the old house by the lake"'
        for d in ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
        for m in ("breakfast", "dinner"))),
    # four rounds of two counting items: one short of five
    (ORDER, cycle(range(1, 5)) + ", "),
    # the schema demands 21 shifts (an enum): the rounds stay until minItems allow an end
    (SHIFTS, '{"shifts": [' + ", ".join(['"early shift", "late shift", "night shift"'] * 6)),
])
def test_what_cycles_but_is_not_a_loop_is_kept(default_tokenizer, vocab, schema, text):
    assert detect(default_tokenizer, vocab, schema, text) is None


@pytest.mark.parametrize("name", ENGINES)
def test_engine_ends_items_that_cycle_on_each_engine(make_tiny_engine, name):
    engine = make_tiny_engine()
    scripted(engine, cycle(range(1, 30)))
    text, final = generate(engine, ORDER, name, 2500)
    assert final.grammar_engine == name
    assert final.finish_reason == "stop" and final.loop_cuts == 1, text
    answer = json.loads(text)
    jsonschema.validate(answer, ORDER)
    assert [i["quantity"] for i in answer["items"]] == [q for q in range(1, 6) for _ in "AB"]


def test_copies_whose_closing_token_carries_their_last_characters_are_ended(default_tokenizer,
                                                                            vocab):
    # '"TinyTech Inc.", ' is '"', 'T', 'iny', 'Tech', ' Inc', '.",' ...: no token boundary
    # falls between the item's text and its quote, so the copies were never ended (the
    # clients bench's Ticket tags ran to the budget). The kept copy ends as written.
    text = '{"tags": [' + ", ".join(['"TinyTech Inc."'] * 12)
    got = detect(default_tokenizer, vocab, TAGS, text)
    assert got is not None, "not cut"
    tags = json.loads(got + "}")["tags"]  # (the array is closed; the document goes on)
    assert set(tags) == {"TinyTech Inc."} and 1 <= len(tags) <= 3, got


COURSES = {"type": "object", "properties": {"courses": {"type": "array", "items": {
    "type": "object", "properties": {"title": {"type": "string"}, "subjects": {
        "type": "array", "items": {"type": "string"}}, "place": {"type": "string"}},
    "required": ["title", "subjects", "place"], "additionalProperties": False}}},
    "required": ["courses"], "additionalProperties": False}


def test_items_that_repeat_whole_are_ended_after_cuts_inside_each(default_tokenizer, vocab):
    # JSONSchemaStore's cv schema on xgrammar: every course held a list of subjects that
    # repeated (cut each time), and the courses themselves repeated whole to the budget:
    # each cut forgot the courses seen before it
    import xgrammar as xgr

    from core.params import LoopGuardParams as Params
    from worker.guided.loop_guard import LoopGuard, closer_ids, token_shapes

    tok, (vocab_list, info) = default_tokenizer, vocab
    m = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(COURSES)))
    guard = LoopGuard(Params(), vocab_list, closer_ids(vocab_list), token_shapes(vocab_list))
    out: list[int] = []

    def may(keep, closers):  # as OutputPolicy._may_cut
        probe = m.fork()
        probe.rollback(len(out) - keep)
        return all(probe.accept_token(c) for c in closers)

    course = ['{"title": "Courses in the old town", "subjects": [',
              ", ".join(['"Courses of the school"'] * 6) + "]",
              ', "place": "Prague"}', ", "]
    cuts = 0
    for piece in ['{"courses": ['] + course * 8:
        if not m.is_terminated():
            for t in tok(piece, add_special_tokens=False)["input_ids"]:
                if not m.accept_token(t):
                    break  # the array this piece goes on was ended: the model follows
                out.append(t)
                guard.push(t)
                cut = guard.find(may)
                if cut is not None:
                    cuts += 1
                    m.rollback(len(out) - cut.keep)
                    guard.cut(cut.keep, cut.closers)
                    del out[cut.keep:]
                    for c in cut.closers:
                        assert m.accept_token(c)
                        out.append(c)
                    break  # the rest of this piece is what the cut removed
    text = tok.decode(out)
    closed = text if text.endswith("]") else text.rstrip(", ") + "]"  # (never cut: all 8)
    courses = json.loads(closed + "}")["courses"]
    assert len(courses) == 1, text  # ended after its first exact copy (was: all 8)
    assert courses[0]["subjects"] == ["Courses of the school"], text
    assert 2 <= cuts <= 4, text  # a cut in each course's subjects seen, one of courses


RECEIPT = {"type": "object", "properties": {"store": {"type": "string"}, "items": {
    "type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "quantity": {"type": "integer"},
                                         "price": {"type": "number"}},
        "required": ["name", "quantity", "price"], "additionalProperties": False}}},
    "required": ["store", "items"], "additionalProperties": False}
LAMB = "Lemon-Crusted Lamb Chops with Roasted Garlic and Smoked Paprika Crouton"
CREAMY = "Lemon-Lemon-Cinnamon-Creamy-{}Beverage-Lemon-Lemon-Cinnamon-"


def receipt(names, quantity=lambda i: 2, price=lambda i: f"{i + 1}.99"):
    return '{"store": "Bakery", "items": [' + ", ".join(
        f'{{"name": "{n}", "quantity": {quantity(i)}, "price": {price(i)}}}'
        for i, n in enumerate(names))


@pytest.mark.parametrize("names, quantity, kept", [
    # the clients bench (auto, openai, at its budget of 512): a counting run whose copied
    # name slips a word twice ("Croutons," -> "Crouton Croutons," -> "Crouton"); each slip
    # restarted the count, and 8 more lines ran past the budget. Ended after 8 lines
    ([LAMB + "s,"] * 3 + [LAMB + " Croutons,"] + [LAMB] * 8, lambda i: 2, 8),
    # the same (xgrammar, instructor): "Creamy-Creamy-" -> "Creamy-" after two lines
    ([CREAMY.format("Creamy-")] * 2 + [CREAMY.format("")] * 10, lambda i: i + 1, 8),
])
def test_counting_items_whose_copied_text_slips_a_word_are_ended(default_tokenizer, vocab,
                                                                 names, quantity, kept):
    got = detect(default_tokenizer, vocab, RECEIPT, receipt(names, quantity))
    assert got == receipt(names[:kept], quantity) + "]", got


@pytest.mark.parametrize("names", [
    # distinct names that share nothing, with counting ids and prices
    ["Alice Smith", "Bob Smith", "Carol Smith", "Dave Smith", "Erin Smith", "Frank Smith",
     "Grace Smith", "Heidi Smith", "Ivan Smith", "Judy Smith"],
    # a menu of one dish with different sides: the edit is a whole word each time, and
    # more than a third of the name
    [f"Chicken with {s}" for s in ("fries", "salad", "soup", "rice", "beans", "corn",
                                   "slaw", "chips", "bread", "pasta")],
])
def test_distinct_items_with_counting_fields_are_kept(default_tokenizer, vocab, names):
    assert detect(default_tokenizer, vocab, RECEIPT,
                  receipt(names, lambda i: i + 1)) is None


UNIQUE = {"type": "object", "properties": {"subjects": {
    "type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    "required": ["subjects"], "additionalProperties": False}
UNIQUE_3 = {"type": "object", "properties": {"subjects": {
    "type": "array", "items": {"type": "string"}, "minItems": 3}},
    "required": ["subjects"], "additionalProperties": False}
SUBJECT = "Courses of the school in the old town"


@pytest.mark.parametrize("schema, kept", [
    # JSONSchemaStore's cv on xgrammar (uniqueItems approximated): three equal subjects
    # were kept, and the answer was invalid
    (UNIQUE, 1),
    # where the schema wants more, as many as it wants
    (UNIQUE_3, 3),
])
def test_exact_copies_of_an_item_keep_one_where_the_schema_allows(default_tokenizer, vocab,
                                                                  schema, kept):
    got = detect(default_tokenizer, vocab, schema,
                 '{"subjects": [' + ", ".join([f'"{SUBJECT}"'] * 8))
    assert got is not None
    subjects = json.loads(got + "}")["subjects"]
    assert subjects == [SUBJECT] * kept, got
    if schema is UNIQUE:
        jsonschema.validate({"subjects": subjects}, schema)
