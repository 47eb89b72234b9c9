"""The Ray Data processor's rows (deploy/data.py) without Ray: a ray.data.llm row and a
batch line become the same request (one conversion, batch_input.parse_row), Arrow's
null-filled structs read as the rows they were, a result becomes the same columns whatever
its path (batch_output.columns_of), and an actor's batch logic (grouping, the in-flight cap,
order, error rows) over a fake runtime client."""

import asyncio
import json

import numpy as np
import pyarrow as pa
import pytest

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from core.request import RequestOutput
from deploy import data
from deploy.batch_account import OUTCOMES, outcome_of
from deploy.batch_input import parse_line, parse_row
from deploy.batch_output import COLUMNS, columns_of, error_row, result_row, row_of_columns

pytestmark = pytest.mark.unit

DEFAULTS = {"max_new_tokens": 256, "temperature": 0.0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MSGS = [{"role": "system", "content": "Extract."}, {"role": "user", "content": "a is 3"}]


def row_item(obj, line=1, default_grammar=None):
    return parse_row(obj, line, defaults=DEFAULTS, default_grammar=default_grammar,
                     request_id="r")


def line_item(obj, line=1):
    item = parse_line(json.dumps(obj), line, defaults=DEFAULTS, default_grammar=None,
                      run_tag="t")
    return item


@pytest.mark.parametrize("llm_row, batch_line", [
    ({"messages": MSGS, "sampling_params": {"max_tokens": 40, "temperature": 0.5,
                                            "structured_outputs": {"json": SCHEMA}}},
     {"messages": MSGS, "max_tokens": 40, "temperature": 0.5, "schema": SCHEMA}),
    ({"prompt": "x", "sampling_params": {"structured_outputs": {"regex": "a+"}, "seed": 3}},
     {"prompt": "x", "regex": "a+", "seed": 3}),
    ({"prompt": "x", "sampling_params": {"structured_outputs": {"choice": ["y", "n"]}}},
     {"prompt": "x", "choice": ["y", "n"]}),
    ({"prompt": "x", "sampling_params": {"guided_decoding": {"json": json.dumps(SCHEMA)}}},
     {"prompt": "x", "schema": SCHEMA}),
    ({"prompt": "x", "sampling_params": {"structured_outputs": {"json_object": True}}},
     {"prompt": "x", "response_format": {"type": "json_object"}}),
    ({"prompt": "x", "sampling_params": {"response_format": {"type": "json_object"},
                                         "stop": ["\n"]}},
     {"prompt": "x", "response_format": {"type": "json_object"}, "stop": ["\n"]}),
    ({"prompt": "x", "sampling_params": {"speculative": False}},
     {"prompt": "x", "speculative": False}),
])
def test_a_ray_data_llm_row_is_the_batch_line_it_says(llm_row, batch_line):
    a, b = row_item(llm_row), line_item(batch_line)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.request.prompt == b.request.prompt
    assert a.request.params == b.request.params
    assert a.request.grammar == b.request.grammar
    assert (a.is_json, a.grammar) == (b.is_json, b.grammar)


def test_speculative_reaches_the_request_from_a_row_and_a_line():
    # the per-request switch (core/params.py): a row or a line turns speculation off
    # for itself; absent, the engine's default (None)
    assert row_item({"prompt": "x", "sampling_params": {"speculative": False}}
                    ).request.params.speculative is False
    assert line_item({"prompt": "x", "speculative": True}).request.params.speculative is True
    assert line_item({"prompt": "x"}).request.params.speculative is None


def test_the_backend_and_the_other_grammar_kinds():
    item = row_item({"prompt": "x", "sampling_params": {"structured_outputs": {
        "grammar": 'root ::= "a"', "backend": "guidance"}}})
    assert item.error is None
    assert item.request.grammar == GrammarSpec.ebnf('root ::= "a"', engine="llguidance")
    assert line_item({"prompt": "x", "structured_outputs": {"regex": "b"}}).request.grammar \
        == GrammarSpec.regex("b")


@pytest.mark.parametrize("obj, says", [
    ({"prompt": "x", "max_tokens": 5, "sampling_params": {"max_tokens": 6}}, "max_tokens"),
    ({"prompt": "x", "sampling_params": {"n": 4}}, "n"),
    ({"prompt": "x", "sampling_params": "greedy"}, "sampling_params"),
    ({"prompt": "x", "sampling_params": {"structured_outputs": {"json": SCHEMA,
                                                                "regex": "a"}}}, "exactly one"),
    ({"prompt": "x", "sampling_params": {"structured_outputs": {"json": "{"}}}, "not valid JSON"),
    ({"prompt": "x", "schema": SCHEMA, "sampling_params": {"structured_outputs": {
        "regex": "a"}}}, "at most one format"),
    ({"sampling_params": {"max_tokens": 5}}, "no `prompt` or `messages`"),
    ({"prompt": "x", "sampling_params": {"temperature": -1.0}}, "temperature"),
    ({"prompt": "x", "sampling_params": {"speculative": "yes"}}, "speculative"),
])
def test_a_bad_row_says_what_is_wrong(obj, says):
    item = row_item(obj)
    assert item.request is None and says in item.error, item.error


def test_arrow_rows_read_as_the_rows_they_were():
    """Arrow gives every row every key any row has (as null), and Ray Data may hand numpy
    arrays over: ``plain`` undoes both, so the request is the original row's."""
    rows = [{"id": 1, "messages": MSGS, "sampling_params": {
                "max_tokens": 9, "structured_outputs": {"json": SCHEMA}}},
            {"id": 2, "prompt": "p", "sampling_params": {
                "temperature": 0.7, "structured_outputs": {"choice": ["a", "b"]}}},
            {"id": 3, "prompt": "q"}]
    through = pa.array(rows).to_pylist()  # one type inferred from every row, as Ray Data does
    assert through[1]["messages"] is None and through[2]["sampling_params"] is None
    for original, arrow in zip(rows, through):
        a, b = row_item(original), row_item(data.plain(arrow))
        assert b.error is None, b.error
        assert (a.request.prompt, a.request.params, a.request.grammar) == \
            (b.request.prompt, b.request.params, b.request.grammar)
    assert data.plain({"stop": np.array(["x", "y"]), "seed": np.int64(4), "n": None}) == \
        {"stop": ["x", "y"], "seed": 4}


def _out(**kw):
    return RequestOutput("r", **{"text": '{"a": 3}', "finish_reason": "stop",
                                 "prompt_tokens": 12, "completion_tokens": 5,
                                 "cached_tokens": 8, **kw})


def test_a_result_is_the_same_row_on_both_paths():
    item = row_item({"messages": MSGS, "schema": SCHEMA, "max_tokens": 16})
    row = result_row(item, _out(validation="valid", grammar_engine="xgrammar",
                                approximated=["format"], closed_early=False))
    cols = columns_of(row)
    assert set(cols) == set(COLUMNS)
    assert cols["generated_text"] == row["text"] == '{"a": 3}'
    assert (cols["num_input_tokens"], cols["num_generated_tokens"],
            cols["num_cached_tokens"]) == (12, 5, 8)
    assert cols["outcome"] == row["outcome"] == "valid"
    assert cols["guided"] == {"validation": "valid", "validation_error": None,
                              "closed_early": False, "loop_cuts": 0, "engine": "xgrammar",
                              "approximated": ["format"]}
    assert cols["grammar"] == item.grammar and cols["max_tokens"] == 16
    # closed at the budget, a loop cut: the JSONL row and the columns say it alike
    closed = columns_of(result_row(item, _out(finish_reason="length", closed_early=True)))
    assert closed["outcome"] == "closed_at_budget" and closed["guided"]["closed_early"]
    cut = columns_of(result_row(item, _out(loop_cuts=2)))
    assert cut["outcome"] == "loop_cut" and cut["guided"]["loop_cuts"] == 2
    plain_row = columns_of(result_row(row_item({"prompt": "x"}), _out()))
    assert plain_row["guided"] is None and plain_row["grammar"] is None


def test_an_error_row_and_the_account_read_back():
    bad = row_item({"prompt": "x", "sampling_params": {"n": 2}})
    cols = columns_of(error_row(bad, bad.error, kind=ErrorKind.BAD_REQUEST))
    assert cols["outcome"] == "refused" and cols["finish_reason"] == "error"
    assert "n" in cols["error"] and cols["error_kind"] == "bad_request"
    died = row_item({"prompt": "x"})
    infra = columns_of(error_row(died, "worker died", kind=ErrorKind.WORKER_DIED))
    assert infra["outcome"] == "infrastructure"
    for c in (cols, infra):
        assert outcome_of(row_of_columns(c)) == c["outcome"]
    assert set(OUTCOMES) >= {cols["outcome"], infra["outcome"]}


def test_the_columns_have_fixed_arrow_types():
    item = row_item({"prompt": "x", "schema": SCHEMA})
    results = [columns_of(result_row(item, _out())),
               columns_of(error_row(row_item({}), "no prompt", kind=ErrorKind.BAD_REQUEST))]
    table = data.with_columns(pa.table({"id": [1, 2], "generated_text": ["old", "old"]}),
                              results)
    assert table.column_names == ["id", *COLUMNS]
    assert table.schema.field("guided").type == data.OUTPUT_TYPES["guided"]
    assert table.column("generated_text").to_pylist() == ['{"a": 3}', ""]
    # a batch whose rows are all unguided and error-free has the same schema
    other = data.with_columns(pa.table({"id": [3]}), [columns_of(result_row(
        row_item({"prompt": "x"}), _out()))])
    assert other.schema == table.schema


def test_group_order_puts_one_instruction_together():
    long_a, long_b = "A" * 400, "B" * 400
    rows = [{"messages": [{"role": "system", "content": long_a if i % 2 else long_b},
                          {"role": "user", "content": str(i)}]} for i in range(6)]
    rows.insert(3, {})  # a bad row goes last
    items = [row_item(r, i) for i, r in enumerate(rows)]
    order = data.group_order(items)
    assert order == [0, 2, 5, 1, 4, 6, 3]


class SlowClient:
    def __init__(self):
        self.sent, self.in_flight, self.most = [], 0, 0

    async def complete(self, request):
        self.sent.append(request.prompt if isinstance(request.prompt, str)
                         else request.prompt[0]["content"])
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.001 * (len(self.sent) % 3))
        self.in_flight -= 1
        if request.prompt == "raise":
            raise RuntimeError("a bug")
        return _out(text="ok")


def test_an_actor_batch_keeps_order_caps_in_flight_and_never_raises():
    sender = data.RowSender.__new__(data.RowSender)  # its batch logic, without Ray
    sender.config = data.ProcessorConfig(max_in_flight=3)
    sender.defaults, sender.default_grammar = DEFAULTS, None
    sender.tag, sender.batches = "t", iter(range(10))
    sender.client = SlowClient()
    rows = [{"prompt": f"p{i % 2}" + "x" * 300} for i in range(8)] + [{"prompt": "raise"}, {}]

    async def go():
        sender.slots = asyncio.Semaphore(3)
        return await sender.run(rows)

    results = asyncio.run(go())
    assert len(results) == len(rows)
    assert [r["generated_text"] for r in results[:8]] == ["ok"] * 8
    assert results[8]["outcome"] == "refused" and "a bug" in results[8]["error"]
    assert results[9]["outcome"] == "refused"
    assert sender.client.most <= 3
    firsts = [p[:2] for p in sender.client.sent[:8]]
    assert firsts == ["p0"] * 4 + ["p1"] * 4  # one instruction's rows together


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_in_flight"):
        data.ProcessorConfig(max_in_flight=0)
    with pytest.raises(ValueError, match="batchsize"):
        data.ProcessorConfig(batchsize=3)
    assert data.build_processor({"concurrency": 2}).config.concurrency == 2
