"""Speculative decoding (worker/engine/speculative.py, engine.py "Speculation"): a row's
draft is computed in its forward and kept only as far as the tokens drawn equal it, each
drawn exactly as a plain step draws it. So outputs with drafts are token for token those
without: greedy and seeded rows, both grammar engines, closing at a tight budget, loop
cuts, stop strings and ids, logprobs, penalties, n > 1 samples, a preemption, a
continuation, a stream. Every test also checks that drafts were computed and accepted
(a test where no draft ever ran would prove nothing), and that nothing is left behind.
"""

import asyncio
import collections
import math

import pytest

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams, SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

DOC = ("Invoice 4471 was issued by Northwind Traders, 12 Harbor Street, Portland, on March "
       "3, 2024 to Contoso Ltd. The total amount due is 1,284.50 USD, payable within 30 "
       "days. Contact: Maria Alvarez, maria.alvarez@northwind.example, phone +1 503 555 0142.")
INVOICE = {"type": "object", "properties": {
    k: {"type": "string"} for k in ("invoice_number", "vendor", "address", "date", "customer",
                                    "total", "contact_name", "email", "phone")},
    "required": ["invoice_number", "vendor", "address", "date", "customer", "total",
                 "contact_name", "email", "phone"], "additionalProperties": False}
LIST = {"type": "object", "properties": {"fruits": {"type": "array", "maxItems": 30,
                                                    "items": {"type": "string"}}},
        "required": ["fruits"]}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "minItems": 6,
                                                  "items": {"type": "string",
                                                            "minLength": 8}}},
        "required": ["tags"]}
GUARD = LoopGuardParams(min_repeats=3, max_cuts=4)


@pytest.fixture(autouse=True)
def untimed(monkeypatch):
    """Drafts as long as allowed, whatever the machine's speed: the forward-time fit
    (``StepCost``) is left unfed, so which drafts run does not depend on timings (on a
    loaded CI machine a fit can make every draft short) and the tests' counts hold."""
    from worker.engine.speculative import StepCost

    monkeypatch.setattr(StepCost, "add", lambda self, tokens, seconds: None)


def chat(text):
    return [{"role": "user", "content": text}]


def requests(engine_name="auto"):
    g = lambda n, **kw: SamplingParams(max_new_tokens=n, temperature=0.0, **kw)  # noqa: E731
    spec = lambda s: GrammarSpec.json_schema(s, engine=engine_name)  # noqa: E731
    extract = chat("Extract the invoice's fields as JSON.\n\n" + DOC)
    return [
        GenerationRequest(extract, g(160), grammar=spec(INVOICE), request_id="extract"),
        GenerationRequest(extract, g(72), grammar=spec(INVOICE), request_id="tight"),
        GenerationRequest(chat("List many fruits as JSON"), g(120), grammar=spec(LIST),
                          loop_guard=GUARD, request_id="loop"),
        GenerationRequest(chat("Tags for a blog post, as JSON"), g(40), grammar=spec(TAGS),
                          request_id="long-answer"),
        GenerationRequest(chat("Repeat after me: " + DOC), g(60), request_id="copy"),
        GenerationRequest(chat("Count from 1 to 40"), g(80, stop=("12.",)), request_id="stop"),
        GenerationRequest(chat("Repeat: the cat sat on the mat. " * 3), g(40, logprobs=2),
                          request_id="logprobs"),
        GenerationRequest(chat("Repeat: the cat sat on the mat. " * 3), SamplingParams(
            max_new_tokens=40, temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.3),
            request_id="seeded"),
        GenerationRequest(chat("Yes or no?"), g(8), grammar=GrammarSpec.choice(["yes", "no"]),
                          request_id="choice"),
    ]


def outputs(engine, reqs):
    """Per request what must not change, logprobs apart (see ``same``)."""
    out = engine.generate(reqs)
    return {rid: (o.token_ids, o.text, o.finish_reason, o.error, o.loop_cuts,
                  o.closed_early, Close(o.logprobs)) for rid, o in out.items()}


class Close:
    """Logprobs equal to 1e-3: a draft's logits come from a forward of several tokens a
    row, whose sums run in another order (the same tokens; logprobs about 1e-6 apart)."""

    def __init__(self, logprobs):
        self.logprobs = logprobs or []

    def __eq__(self, other):
        if len(self.logprobs) != len(other.logprobs):
            return False
        for (a, top_a), (b, top_b) in zip(self.logprobs, other.logprobs):
            if abs(a - b) > 1e-3 or [t for t, _ in top_a] != [t for t, _ in top_b]:
                return False
            if any(abs(x - y) > 1e-3 for (_, x), (_, y) in zip(top_a, top_b)):
                return False
        return True

    def __repr__(self):
        return f"Close({len(self.logprobs)} logprobs)"


def idle(engine):
    """Nothing runs, no drafter state is left, no block is referenced (free or cached)."""
    s = engine.stats()
    engine.blocks.check([])
    return (s.running, s.waiting, s.live_processors, s.drafting_rows,
            s.free_blocks + s.session_blocks == s.total_blocks)


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_drafts_change_no_token(make_engine, engine_name):
    off = outputs(make_engine(speculative=False), requests(engine_name))
    engine = make_engine(speculative=True)
    on = outputs(engine, requests(engine_name))
    assert on.keys() == off.keys()
    for rid in off:
        assert on[rid] == off[rid], rid
    stats = engine.stats()
    assert stats.accepted_draft_tokens > 20 and stats.draft_tokens > stats.accepted_draft_tokens
    assert engine.num_steps < sum(len(o[0]) for o in on.values())  # fewer forwards than tokens
    # the cases did what they are here for
    assert off["tight"][5] and off["stop"][2] == "stop" and off["loop"][4] > 0
    assert idle(engine) == (0, 0, 0, 0, True)


def plain_steps(engine, monkeypatch):
    """Counts the overlapped engine's steps that ran without overlap (with drafts)."""
    count = collections.Counter()
    step = engine._step_plain

    def counted():
        count["plain"] += 1
        return step()

    monkeypatch.setattr(engine, "_step_plain", counted)
    return count


def test_drafts_under_overlap_change_no_token(make_engine, monkeypatch):
    """The overlapped step (the GPU's default) runs a step with drafts where drafts pay
    (``_drafts_pay``: here always, the fit unfed), the others overlapped: the same tokens
    as one token a step without overlap."""
    reqs = requests("auto")
    off = outputs(make_engine(speculative=False, overlap=False), reqs)
    engine = make_engine(speculative=True, overlap=True)
    count = plain_steps(engine, monkeypatch)
    on = outputs(engine, requests("auto"))
    for rid in off:
        assert on[rid] == off[rid], rid
    stats = engine.stats()
    assert stats.accepted_draft_tokens > 20
    assert 0 < count["plain"] < engine.num_steps  # steps of both kinds ran
    assert idle(engine) == (0, 0, 0, 0, True)


def test_overlap_keeps_its_steps_where_drafts_do_not_pay(make_engine, monkeypatch):
    """A fitted forward cost, and hooks (measured) that take longer than the drafts would
    save: no step gives up its overlap, and no draft is computed."""
    engine = make_engine(speculative=True, overlap=True)
    # a forward of a microsecond: a kept token saves less than any step's hooks take
    engine.drafter.cost.a, engine.drafter.cost.b = 1e-6, 1e-9
    engine.drafter.cost.fitted = True
    count = plain_steps(engine, monkeypatch)
    reqs = [GenerationRequest(chat("Repeat after me: " + DOC), SamplingParams(
        max_new_tokens=40, temperature=0.0), request_id="copy")]
    engine.generate(reqs)
    assert count["plain"] == 0 and engine.stats().draft_tokens == 0


def test_a_request_may_turn_drafts_off(make_engine):
    engine = make_engine(speculative=True)
    reqs = [GenerationRequest(chat("Repeat after me: " + DOC), SamplingParams(
        max_new_tokens=40, temperature=0.0, speculative=False), request_id="no")]
    engine.generate(reqs)
    assert engine.stats().draft_tokens == 0
    reqs = [GenerationRequest(chat("Repeat after me: " + DOC), SamplingParams(
        max_new_tokens=40, temperature=0.0, speculative=True), request_id="yes")]
    off = make_engine(speculative=False)
    assert outputs(off, reqs) == outputs(off, reqs)
    off.generate(reqs)
    assert off.stats().accepted_draft_tokens > 0  # a request can turn them on, too


def test_samples_of_one_prompt_and_a_continuation(make_engine):
    """n > 1 (samples sharing a session) and a failover's continuation (the tokens it
    streamed before are given back: drafts start from them)."""
    def run(engine):
        samples = [GenerationRequest(chat("Repeat after me: " + DOC), SamplingParams(
            max_new_tokens=40, temperature=0.8, seed=3 + i), session_id="n", seq_id=i,
            request_id=f"s{i}") for i in range(3)]
        got = outputs(engine, samples)
        full = engine.generate([GenerationRequest(
            chat("Extract the invoice's fields as JSON.\n\n" + DOC),
            SamplingParams(max_new_tokens=80, temperature=0.0),
            grammar=GrammarSpec.json_schema(INVOICE), request_id="full")])["full"]
        cont = engine.generate([GenerationRequest(
            chat("Extract the invoice's fields as JSON.\n\n" + DOC),
            SamplingParams(max_new_tokens=80, temperature=0.0),
            grammar=GrammarSpec.json_schema(INVOICE), resume_token_ids=full.token_ids[:9],
            request_id="cont")])["cont"]
        engine.end_session("n")
        return got, full.token_ids, cont.token_ids

    engine = make_engine(speculative=True)
    on = run(engine)
    off = run(make_engine(speculative=False))
    assert on == off
    assert on[2] == on[1][9:]
    assert engine.stats().accepted_draft_tokens > 0
    assert idle(engine) == (0, 0, 0, 0, True)


def test_a_reasoning_row(make_engine):
    """A thought (no mask, its budget forcing the end marker), then a guided answer: the
    phase switch sees the tokens one at a time with drafts as without."""
    def run(engine):
        reqs = [GenerationRequest(
            "Question: extract the invoice as JSON.\n\n" + DOC + "\n<think>\n",
            SamplingParams(max_new_tokens=120, temperature=0.0), thinking_token_budget=t,
            grammar=GrammarSpec.json_schema(INVOICE), request_id=f"t{t}") for t in (12, 40)]
        out = engine.generate(reqs)
        return {k: (o.token_ids, o.text, o.reasoning, o.finish_reason, o.error)
                for k, o in out.items()}

    markers = {"start": "<think>", "end": "</think>"}
    engine = make_engine(reasoning=markers, speculative=True)
    on = run(engine)
    assert on == run(make_engine(reasoning=markers, speculative=False))
    assert all(o[2] and o[4] is None for o in on.values())  # each thought, then an answer
    assert engine.stats().accepted_draft_tokens > 0
    assert idle(engine) == (0, 0, 0, 0, True)


def test_drafts_through_a_preemption(make_tiny_engine):
    """A KV cache of 14 blocks for four rows that each need about 6: rows are preempted
    (a draft's blocks taken with them) and recomputed. The tiny model's seeded draws
    depend on the whole context and on each row's generator: a wrong KV, or a draw lost
    or repeated, changes them."""
    reqs = lambda: [GenerationRequest(chat(f"Story number {i} about a dog"), SamplingParams(  # noqa: E731
        max_new_tokens=48, temperature=0.8, top_k=3, seed=i), request_id=f"r{i}")
        for i in range(4)]
    on = make_tiny_engine(speculative=True, num_kv_blocks=14)
    assert outputs(on, reqs()) == outputs(make_tiny_engine(speculative=False,
                                                           num_kv_blocks=14), reqs())
    assert on.scheduler.num_preemptions > 0 and on.stats().accepted_draft_tokens > 0
    assert idle(on) == (0, 0, 0, 0, True)


def test_a_stream_with_drafts(make_engine):
    from worker.engine.async_engine import AsyncEngine

    ref = outputs(make_engine(speculative=False), requests())
    aengine = AsyncEngine(make_engine(speculative=True))

    async def stream(r):
        return [c async for c in aengine.generate(r)]

    async def main():
        return await asyncio.gather(*(stream(r) for r in requests()))

    try:
        for chunks in asyncio.run(main()):
            rid = chunks[0].request_id
            assert [t for c in chunks for t in c.token_ids] == ref[rid][0], rid
            assert "".join(c.text for c in chunks) == ref[rid][1], rid
            assert chunks[-1].finished and chunks[-1].finish_reason == ref[rid][2]
    finally:
        aengine.shutdown()


def test_sampled_tokens_keep_the_target_distribution(make_tiny_engine):
    """Unseeded sampling from a small vocabulary (top_k 4 on the tiny model, a prompt that
    repeats itself, so drafts are proposed from the first step and often drawn): the
    token each of 384 independent requests draws at its 6th position, with drafts and
    without, are two samples of one distribution (that position's draw depends on every
    draw before it, so a bias in what a draft makes the engine keep shows there). The
    engines' seeds differ, so the draws are independent; a chi-squared test of
    homogeneity at p >= 0.001 (a draw that kept the draft whenever it was among the top
    k, say, fails it by far)."""
    def counts(engine):
        reqs = [GenerationRequest("one two three four " * 6, SamplingParams(
            max_new_tokens=6, temperature=1.0, top_k=4, ignore_eos=True),
            request_id=f"r{i}") for i in range(384)]
        out = engine.generate(reqs)
        assert all(len(o.token_ids) == 6 for o in out.values())
        return collections.Counter(o.token_ids[5] for o in out.values())

    on = make_tiny_engine(speculative=True, seed=1, max_num_seqs=128)
    a = counts(on)
    b = counts(make_tiny_engine(speculative=False, seed=2, max_num_seqs=128))
    assert on.stats().accepted_draft_tokens > 100
    # cells of at least 10 draws; the rarer tokens pooled in one cell
    tokens = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    cells = [(a[t], b[t]) for t in tokens]
    cells.append((384 - sum(x for x, _ in cells), 384 - sum(y for _, y in cells)))
    chi2 = 0.0
    for x, y in cells:
        for got in (x, y):
            want = (x + y) / 2
            chi2 += (got - want) ** 2 / want
    dof = len(cells) - 1
    assert dof >= 3
    # Wilson-Hilferty: the chi-squared quantile at p = 0.001 (z = 3.09)
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_draft_is_cut_at_the_first_token_its_grammar_refuses(make_engine, engine_name):
    """The drafter walks a draft on the row's own matcher and rolls it back: the draft
    it returns is the longest prefix the grammar accepts from where the row stands, and
    the matcher is left where it was."""
    from worker.engine.speculative import Drafter

    engine = make_engine()
    tok = engine.tokenizer
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    compiled = engine.guided.get_grammar(
        GrammarSpec.regex("[a-z ]+: [0-9]+;", engine=engine_name)).result(timeout=60)
    head, body, tail = ids("x apples"), ids(": 12; pears: 7;"), ids(" apples")
    assert head[-1:] == tail
    allowed = len(ids(": 12;"))
    assert body[:allowed] == ids(": 12;") and allowed < len(body)

    class Row:  # what the drafter reads of a sequence
        request_id = "r"
        token_ids = head + body + tail
        guide = type("Guide", (), {})()

    row = Row()
    row.guide.mask_matcher = matcher = engine.guided.new_matcher(compiled)
    assert matcher.accept_tokens(head)
    key = matcher.state_key()
    # the context ends with " apples", which was followed by ": 12; pears: 7;" before;
    # the grammar takes ": 12;" and then only its end
    assert Drafter(8, set()).propose(row, 8) == body[:allowed]
    assert matcher.state_key() == key
    assert Drafter(8, set()).propose(row, 2) == body[:2]  # the row's room
    # ungrammatical at once: an empty draft
    row.guide.mask_matcher = done = engine.guided.new_matcher(compiled)
    assert done.accept_tokens(head + body[:allowed])
    row.token_ids = head + body[:allowed] + ids(" x apples") + body[:allowed]
    assert Drafter(8, set()).propose(row, 8) == []
    # without a grammar the draft is what the lookup found
    row.guide = None
    assert Drafter(8, set()).propose(row, 8)[:1] == ids(" x")[:1]
