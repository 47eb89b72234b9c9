"""The batch job's account (deploy/batch_account.py): each row's outcome, which rows
--retry-failed runs again and how, and the summary (counts that add up to the input).
A fake runtime client answers by the prompt and the request's budget / grammar backend."""

import asyncio
import json

import pytest

from core.errors import ErrorKind
from core.request import RequestOutput
from deploy import batch_account, batch_job

pytestmark = pytest.mark.unit

DEFAULTS = {"max_new_tokens": 32, "temperature": 0.0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("row, outcome", [
    ({"finish_reason": "stop", "text": "{}"}, "valid"),
    ({"finish_reason": "stop", "validation": "valid"}, "valid"),
    ({"finish_reason": "length"}, "closed_at_budget"),
    ({"finish_reason": "stop", "loop_cuts": 1}, "loop_cut"),
    ({"finish_reason": "length", "loop_cuts": 2}, "loop_cut"),
    ({"finish_reason": "stop", "validation": "invalid"}, "invalid"),
    ({"error": "line 3 is not valid JSON"}, "refused"),
    ({"error": "too small", "error_kind": "budget_too_small"}, "refused"),
    ({"error": "bad", "error_kind": "bad_request"}, "refused"),
    ({"error": "x", "error_kind": "invalid_grammar"}, "grammar_error"),
    ({"error": "x", "error_kind": "compile_timeout"}, "grammar_error"),
    ({"error": "x", "error_kind": "grammar_too_large"}, "grammar_error"),
    ({"error": "x", "error_kind": "worker_died", "transient": True}, "infrastructure"),
    ({"error": "x", "error_kind": "grammar_unavailable"}, "infrastructure"),
    ({"error": "x", "error_kind": "internal"}, "infrastructure"),
])
def test_outcome_of(row, outcome):
    assert batch_account.outcome_of(row) == outcome


def test_retry_for():
    retry = batch_account.retry_for
    assert retry({"finish_reason": "stop"}) is None  # valid: never again
    assert retry({"finish_reason": "length", "max_tokens": 32}) == {"max_tokens": 64}
    assert retry({"finish_reason": "length", "max_tokens": 3000}, 4096) == {"max_tokens": 4096}
    assert retry({"finish_reason": "length", "max_tokens": 4096}, 4096) is None  # at the cap
    assert retry({"error": "the json_schema grammar's shortest output needs at least 224 "
                           "tokens, but max_tokens allows 64", "error_kind": "budget_too_small",
                  "max_tokens": 64}) == {"max_tokens": 896}  # a structural lower bound: x4
    assert retry({"error": "the json_schema grammar's shortest output needs about 75 tokens, "
                           "but max_tokens allows 44", "error_kind": "budget_too_small",
                  "max_tokens": 44}) == {"max_tokens": 150}
    assert retry({"error": "needs at least 9000 tokens", "error_kind": "budget_too_small",
                  "max_tokens": 64}, 4096) is None  # more than the cap allows
    # invalid: the engine that served it (pinned), with twice the budget
    assert retry({"validation": "invalid", "grammar_engine": "xgrammar", "max_tokens": 32}) == {
        "engine": "xgrammar", "max_tokens": 64}
    assert retry({"validation": "invalid", "grammar_engine": "llguidance",
                  "max_tokens": 32}) == {"engine": "llguidance", "max_tokens": 64}
    assert retry({"validation": "invalid", "grammar_engine": "xgrammar",
                  "max_tokens": 4096}, 4096) is None  # no more room to give
    assert retry({"finish_reason": "length", "max_tokens": 32, "attempt": 1,
                  "attempts": batch_account.MAX_ATTEMPTS}) is None  # counted on disk
    assert retry({"error": "x", "error_kind": "worker_died", "transient": True}) == {}
    assert retry({"finish_reason": "stop", "loop_cuts": 1}) is None
    assert retry({"error": "x", "error_kind": "invalid_grammar"}) is None
    assert retry({"error": "not JSON"}) is None
    assert retry({"finish_reason": "length", "max_tokens": 32,
                  "attempt": batch_account.MAX_ATTEMPTS}) is None  # retried enough


class Client:
    """``long``: runs to any budget under 100 tokens; ``approx``: invalid on xgrammar,
    valid on llguidance; ``loop``: a loop cut; ``budget``: refused under 40 tokens;
    ``broken``: an internal error (the runtime's failure); ``bad-grammar``: refused."""

    def __init__(self):
        self.calls = []

    async def complete(self, request):
        p, g = request.params, request.grammar
        self.calls.append((request.prompt, p.max_new_tokens, g.engine if g else None))
        engine = (g.engine if g.engine != "auto" else "xgrammar") if g else None

        def ok(**kw):
            kw = {"validation": "valid" if g else None, **kw}
            return RequestOutput(request.request_id, '{"a": 1}', finish_reason="stop",
                                 prompt_tokens=3, completion_tokens=5, grammar_engine=engine,
                                 **kw)

        if request.prompt == "long" and p.max_new_tokens < 100:
            return RequestOutput(request.request_id, '{"a": 1}', finish_reason="length",
                                 completion_tokens=p.max_new_tokens, grammar_engine=engine)
        if request.prompt == "approx" and engine == "xgrammar":
            return ok(validation="invalid", validation_error="at /a: oneOf")
        if request.prompt == "loop":
            return ok(loop_cuts=1)
        if request.prompt == "budget" and p.max_new_tokens < 40:
            return RequestOutput(request.request_id, "", finish_reason="error",
                                 error_kind=ErrorKind.BUDGET_TOO_SMALL,
                                 error="the json_schema grammar's shortest output needs at "
                                       f"least 40 tokens, but max_tokens allows "
                                       f"{p.max_new_tokens}")
        if request.prompt == "broken":
            return RequestOutput(request.request_id, "", finish_reason="error",
                                 error_kind=ErrorKind.INTERNAL, error="model step failed")
        if request.prompt == "bad-grammar":
            return RequestOutput(request.request_id, "", finish_reason="error",
                                 error_kind=ErrorKind.INVALID_GRAMMAR, error="invalid schema")
        return ok()


def run(tmp_path, lines, client, *, retry_failed=False):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                           for x in lines))
    retries = {}
    skip, dropped = batch_job.scan_output(str(out), False, retry_failed=retry_failed,
                                          retries=retries)
    work = batch_job.plan(str(inp), skip, retries)
    with open(out, "a") as f:
        asyncio.run(batch_job.process(batch_job.items(
            str(inp), work, defaults=DEFAULTS, default_grammar=None, run_tag="t"), client, f))
    batch_job.settle_output(str(out))  # as the job does at its end
    return [json.loads(x) for x in out.read_text().splitlines()], work, dropped


LINES = [{"id": f"ok{i}", "prompt": "fine", "schema": SCHEMA} for i in range(5)] + [
    {"id": "long", "prompt": "long", "schema": SCHEMA},
    {"id": "approx", "prompt": "approx", "schema": SCHEMA},
    {"id": "loop", "prompt": "loop", "schema": SCHEMA},
    {"id": "budget", "prompt": "budget", "schema": SCHEMA},
    {"id": "broken", "prompt": "broken"},
    {"id": "bad", "prompt": "bad-grammar", "schema": SCHEMA},
    "not json {",
    {"id": "text", "prompt": "plain text"},
]


def test_every_row_has_an_outcome_and_the_account_adds_up(tmp_path):
    rows, work, _ = run(tmp_path, LINES, Client())
    outcomes = {r["id"]: r["outcome"] for r in rows}
    assert outcomes == {**{f"ok{i}": "valid" for i in range(5)}, "long": "closed_at_budget",
                        "approx": "invalid", "loop": "loop_cut", "budget": "refused",
                        "broken": "infrastructure", "bad": "grammar_error", 12: "refused",
                        "text": "valid"}
    grammar = rows[0]["grammar"]
    assert grammar.startswith("grammar-") and all(
        r.get("grammar") == grammar for r in rows if r["id"] not in ("broken", 12, "text"))
    assert rows[6]["grammar_engine"] == "xgrammar" and rows[7]["loop_cuts"] == 1
    acc = batch_account.account_of(str(tmp_path / "out.jsonl"))
    assert acc.rows == work.lines == len(LINES)
    assert sum(acc.summary()["outcomes"].values()) == len(LINES)
    assert acc.summary()["by_grammar"][grammar] == {
        "valid": 5, "closed_at_budget": 1, "invalid": 1, "loop_cut": 1, "refused": 1,
        "grammar_error": 1}
    assert acc.retryable == 4  # long, approx, budget, broken
    table = acc.table()
    assert "closed_at_budget" in table and "raise max_tokens" in table
    assert f"{grammar}: valid 5" in table


def test_retry_failed_redoes_only_what_a_retry_can_help(tmp_path):
    rows, _, _ = run(tmp_path, LINES, Client())
    before = (tmp_path / "out.jsonl").read_text().splitlines()
    valid_before = batch_account.account_of(str(tmp_path / "out.jsonl")).valid_share
    client = Client()
    rows, work, again = run(tmp_path, LINES, client, retry_failed=True)
    assert again == 4
    # the retried lines only, with a larger budget (invalid: on the engine that served it)
    assert sorted(client.calls) == sorted([("long", 64, "auto"), ("approx", 64, "xgrammar"),
                                           ("budget", 160, "auto"), ("broken", 32, None)])
    after = (tmp_path / "out.jsonl").read_text().splitlines()
    kept = [x for x in before if json.loads(x)["id"] not in ("long", "approx", "budget",
                                                             "broken")]
    assert [x for x in after if x in kept] == kept  # every other row byte for byte, in order
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == len(LINES) == len(by_id)  # one row per line
    assert by_id["long"]["outcome"] == "closed_at_budget" and by_id["long"]["attempt"] == 2
    assert by_id["approx"]["outcome"] == "invalid" and by_id["approx"]["attempt"] == 2
    assert by_id["approx"]["grammar_engine"] == "xgrammar" and by_id["approx"]["max_tokens"] == 64
    assert by_id["approx"]["grammar"] == rows[0]["grammar"]  # the line's grammar, not the retry's
    assert by_id["budget"]["outcome"] == "valid" and by_id["budget"]["max_tokens"] == 160
    acc = batch_account.account_of(str(tmp_path / "out.jsonl"))
    assert acc.rows == len(LINES) and acc.valid_share > valid_before
    # the budget doubles again, up to the cap; then the line is left alone
    client = Client()
    rows, _, _ = run(tmp_path, LINES, client, retry_failed=True)
    assert sorted(client.calls) == [("approx", 128, "xgrammar"), ("broken", 32, None),
                                    ("long", 128, "auto")]
    assert {r["id"]: r["outcome"] for r in rows}["long"] == "valid"
    client = Client()
    run(tmp_path, LINES, client, retry_failed=True)
    assert client.calls == []  # approx, broken: attempt 3 of 3; everything else is settled


class AutoClient(Client):
    """``refuses-llg``: llguidance refuses the schema (so ``auto`` serves it with
    xgrammar), and xgrammar's answer validates only with 64 tokens or more; ``worse``: an
    invalid answer whose retry fails with an internal error."""

    def __init__(self):
        super().__init__()
        self.tries = 0

    async def complete(self, request):
        p, g = request.params, request.grammar
        self.calls.append((request.prompt, p.max_new_tokens, g.engine))
        if request.prompt == "worse" and self.tries:
            return RequestOutput(request.request_id, "", finish_reason="error",
                                 error_kind=ErrorKind.INTERNAL, error="model step failed")
        self.tries += request.prompt == "worse"
        if g.engine == "llguidance":
            return RequestOutput(request.request_id, "", finish_reason="error",
                                 error_kind=ErrorKind.INVALID_GRAMMAR,
                                 error="llguidance refuses the schema")
        valid = request.prompt == "refuses-llg" and p.max_new_tokens >= 64
        return RequestOutput(request.request_id, '{"a": 1}', finish_reason="stop",
                             completion_tokens=5, grammar_engine="xgrammar",
                             validation="valid" if valid else "invalid",
                             validation_error=None if valid else "at /a: oneOf")


def test_an_invalid_row_is_retried_where_it_can_pass_and_never_made_worse(tmp_path):
    """Under ``auto`` an invalid answer came from xgrammar because llguidance refused the
    schema: a retry forced onto llguidance was refused again and the row became a
    grammar_error. The retry stays on the engine that served it, with more room; and a
    retry that goes worse keeps the row it retried (with its attempts counted)."""
    lines = [{"id": "a", "prompt": "refuses-llg", "schema": SCHEMA},
             {"id": "w", "prompt": "worse", "schema": SCHEMA}]
    rows, _, _ = run(tmp_path, lines, AutoClient())
    assert [r["outcome"] for r in rows] == ["invalid", "invalid"]
    client = AutoClient()
    client.tries = 1
    rows, _, again = run(tmp_path, lines, client, retry_failed=True)
    assert again == 2 and sorted(client.calls) == [("refuses-llg", 64, "xgrammar"),
                                                   ("worse", 64, "xgrammar")]
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == 2
    assert by_id["a"]["outcome"] == "valid" and by_id["a"]["attempt"] == 2
    assert by_id["w"]["outcome"] == "invalid" and by_id["w"]["max_tokens"] == 32  # the first
    assert "attempt" not in by_id["w"] and by_id["w"]["attempts"] == 2  # its retry counted


def test_summary_file(tmp_path):
    run(tmp_path, LINES, Client())
    out = str(tmp_path / "out.jsonl")
    acc = batch_account.account_of(out)
    path = batch_account.write_summary(out, acc.summary(input_lines=len(LINES), missing=0))
    data = json.loads(open(path).read())
    assert path == out + ".summary.json"
    assert data["rows"] == len(LINES) == sum(data["outcomes"].values())
    assert data["valid_share"] == round(6 / len(LINES), 4)


def test_the_summary_counts_prompt_tokens_cached_and_computed():
    acc = batch_account.Account()
    for prompt, cached in ((600, 0), (610, 592), (605, 592)):
        acc.add({"id": 1, "finish_reason": "stop", "text": "x",
                 "usage": {"prompt_tokens": prompt, "cached_tokens": cached,
                           "completion_tokens": 3}})
    acc.add({"id": 2, "finish_reason": "error", "error": "bad", "usage": {}})
    assert acc.summary()["prompt_tokens"] == {"total": 1815, "cached": 1184, "computed": 631}
    assert "prompt tokens: 1815 (1184 cached, 631 computed)" in acc.table()
