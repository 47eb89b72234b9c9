"""Guided decoding without a model: a tiny hand-made vocabulary, every grammar kind, the
batch mask against a reference, one matcher per request, a rejected token failing its
row only, stop ids where the grammar may end, the NaN guard, the byte-bounded grammar LRU,
shortest completions, the CPU mask kernel, bad grammars."""

import json

import pytest
import torch
import xgrammar as xgr

from grammar_cache.compile import GrammarError, choice_ebnf
from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from worker.guided.bitmask import apply_token_bitmask_inplace, reference_apply
from worker.guided.guided_process import GuidedDecodingManager
from worker.engine.logits_process import FusedLogitsProcessor
from worker.engine.sampling import SamplingInputs

pytestmark = pytest.mark.unit

VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", ",", " ", "1", "2", "true", "false", "[", "]",
         "yes", "no", "x", "\n", "ab", '{"', '":', "-", "0", "é"]
EOS = 0


@pytest.fixture(scope="module")
def manager():
    # vocab_size above the tokenizer's, as with padded embedding rows
    info = xgr.TokenizerInfo(VOCAB, vocab_size=40, stop_token_ids=[EOS])
    return GuidedDecodingManager(info, max_batch_size=8)


def compile(manager, spec):
    return manager.get_grammar(spec).result(timeout=30)


def accepts(manager, spec, text: str) -> bool:
    """Whether the grammar accepts exactly ``text`` followed by the stop token."""
    m = manager.new_matcher(compile(manager, spec))
    return m.accept_string(text) and m.accept_token(EOS) and m.is_terminated()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a", "b"]}

NUM = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}

# xgrammar 0.2.8 lets raw control characters into strings with maxLength; we do not
SHORT = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
         "required": ["s"]}
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"],
       "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema",
                                                             "json_schema": SHORT},
                 "end": "</f>"}]}}

CASES = [
    (GrammarSpec.json_schema(SHORT, whitespace="compact"), '{"s":"ab"}', True),
    (GrammarSpec.json_schema(SHORT, whitespace="compact"), '{"s":"a\x0fb"}', False),
    (GrammarSpec.json_schema(SHORT, whitespace="compact"), '{"s":"a\tb"}', False),
    (GrammarSpec.json_schema(SHORT, whitespace="compact"), '{"s":"abcdef"}', False),
    (GrammarSpec.structural_tag(TAG), 'x<f>{"s": "ab"}</f>', True),
    (GrammarSpec.structural_tag(TAG), 'x<f>{"s": "a\x01"}</f>', False),
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact"), '{"a":12,"b":true}', True),
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact"), '{"a":12}', False),
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact"), '{"a":1,"b":true,"x":1}', False),
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact"), '{"b":true,"a":1}', False),
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact", any_order=True),
     '{"b":true,"a":1}', True),
    (GrammarSpec.json_schema(SCHEMA), '{"a": 1, "b": false}', True),
    (GrammarSpec.json_schema(SCHEMA, whitespace="bounded", max_whitespace=2),
     '{"a":    1, "b": false}', False),
    (GrammarSpec.json_schema(SCHEMA, whitespace="bounded"), '{"a":\n 1 , "b": false}', True),
    (GrammarSpec.json_schema(SCHEMA), '{"a":\n 1, "b": false}', False),  # default: spaced
    (GrammarSpec.json_schema(SCHEMA), '{"a":1, "b": false}', False),
    (GrammarSpec.json_schema(SCHEMA, whitespace="indent", indent=1),
     '{\n "a": 1,\n "b": true\n}', True),
    # runaway guards on numbers: 15 integer digits, 10 fraction digits, 2 exponent digits
    # (every number a finite double: 402.00E488 overflowed with 3)
    (GrammarSpec.json_schema(NUM, whitespace="compact"), '{"n":123456789012345}', True),
    (GrammarSpec.json_schema(NUM, whitespace="compact"), '{"n":1234567890123456}', False),
    (GrammarSpec.json_schema(NUM, whitespace="compact", max_int_digits=0),
     '{"n":1234567890123456}', True),
    (GrammarSpec.json_schema(NUM, whitespace="compact"), '{"n":402.00E99}', True),
    (GrammarSpec.json_schema(NUM, whitespace="compact"), '{"n":402.00E488}', False),
    (GrammarSpec.json_schema(NUM, whitespace="compact"), '{"n":1.01234567890}', False),
    (GrammarSpec.json_object(), '{"n": 1e-308}', False),
    (GrammarSpec.json_object(), '{"ab": [1, 2]}', True),
    (GrammarSpec.json_object(), '[1]', False),
    (GrammarSpec.regex(r"(yes|no)-[0-9]+"), "yes-120", True),
    (GrammarSpec.regex(r"(yes|no)-[0-9]+"), "yes-", False),
    (GrammarSpec("regex_schema", "x+"), "xxx", True),
    (GrammarSpec.ebnf('root ::= "[" item ("," item)* "]"\nitem ::= "a" | "b"'), "[a,b,a]", True),
    (GrammarSpec.ebnf('root ::= "[" item ("," item)* "]"\nitem ::= "a" | "b"'), "[a,]", False),
    (GrammarSpec.lark('start: "x" NUM\nNUM: /[0-9]+/'), "x12", True),
    (GrammarSpec.lark('start: "x" NUM\nNUM: /[0-9]+/'), "x", False),
    (GrammarSpec.choice(["yes", "no", 'a"b\\é']), "no", True),
    (GrammarSpec.choice(["yes", "no", 'a"b\\é']), 'a"b\\é', True),
    (GrammarSpec.choice(["yes", "no"]), "yesno", False),
    (GrammarSpec.structural_tag({
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f>"]}), "ab<f>12</f>x", True),
    (GrammarSpec.structural_tag({
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f>"]}), "<f>true</f>", False),
]


@pytest.mark.parametrize("spec, text, ok", CASES, ids=[f"{c[0].kind}-{i}" for i, c in enumerate(CASES)])
def test_kinds_accept_and_reject(manager, spec, text, ok):
    assert accepts(manager, spec, text) is ok


def test_padded_vocab_rows_are_never_allowed(manager):
    m = manager.new_matcher(compile(manager, GrammarSpec.regex("x+")))
    mask = xgr.allocate_token_bitmask(1, 40)
    m.fill_next_token_bitmask(mask)
    logits = torch.zeros(1, 40)
    reference_apply(logits, mask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed == [VOCAB.index("x")]


def test_batch_mask_equals_reference_and_leaves_unguided_rows(manager):
    specs = {0: GrammarSpec.regex("(yes|no)"), 2: GrammarSpec.json_object(), 3: GrammarSpec.regex("ab?")}
    ctx = [None] * 5
    for row, spec in specs.items():
        ctx[row] = manager.add_matcher(compile(manager, spec))
    ctx[2].accept_string('{"a')
    inputs = SamplingInputs(rows=[_row() for _ in ctx], row_matchers=ctx)
    logits = torch.randn(5, 40)
    expected = logits.clone()
    for row, matcher in enumerate(ctx):
        if matcher is not None:
            mask = xgr.allocate_token_bitmask(1, 40)
            matcher.fill_next_token_bitmask(mask)
            reference_apply(expected[row:row + 1], mask)
    proc = FusedLogitsProcessor(inputs, manager.mask)
    proc.prepare()
    proc(logits)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[4]).all()
    for matcher in ctx:
        if matcher is not None:
            manager.remove_matcher(matcher)


def _row(**params):
    from worker.engine.sampling import SamplingParams, SamplingRow

    return SamplingRow(SamplingParams(**params), torch.Generator(), [1], [])


def test_a_rejected_token_fails_its_row_only(manager):
    compiled = compile(manager, GrammarSpec.regex("x+"))
    rows = [manager.add_matcher(compiled), None, manager.add_matcher(compiled)]
    proc = FusedLogitsProcessor(SamplingInputs([_row() for _ in rows], rows), manager.mask)
    proc.prepare()
    proc(torch.randn(3, 40))
    x = VOCAB.index("x")
    status = proc.accept_token([VOCAB.index("a"), 5, x])
    assert status[0].error_kind == ErrorKind.REJECTED
    assert 1 not in status and 2 not in status  # the others go on
    for matcher in (rows[0], rows[2]):
        manager.remove_matcher(matcher)


def test_each_request_gets_a_matcher_of_its_own(manager):
    compiled = compile(manager, GrammarSpec.regex("x"))
    first = manager.add_matcher(compiled)
    second = manager.add_matcher(compiled)  # the same grammar: never the same matcher
    assert manager.num_matchers == 2
    assert first.accept_string("x") and first.accept_token(EOS) and first.is_terminated()
    assert second is not first and not second.is_terminated() and second.accept_string("x")
    manager.remove_matcher(first)
    manager.remove_matcher(first)  # a second release changes nothing
    manager.remove_matcher(second)
    assert manager.num_matchers == 0


def test_stop_ids_are_allowed_only_where_the_grammar_may_end(manager):
    compiled = compile(manager, GrammarSpec.regex("ab?"))
    stop = VOCAB.index("yes")  # not in the grammar
    keys = [manager.add_matcher(compiled)]
    rows = [_row(stop_token_ids=(stop,))]

    def step(token):
        proc = FusedLogitsProcessor(SamplingInputs(rows, keys), manager.mask)
        proc.prepare()
        logits = torch.zeros(1, 40)
        proc(logits)
        return bool(torch.isfinite(logits[0, stop])), proc.accept_token([token])

    allowed, _ = step(VOCAB.index("a"))  # before "a" the grammar may not end
    assert not allowed
    allowed, status = step(stop)  # after "a" it may: the stop id ends the row
    assert allowed and status[0].stop and not status[0].error
    manager.remove_matcher(keys[0])


def test_nan_logits_never_sample_a_masked_token(manager):
    from worker.engine.sampling import Sampler

    compiled = compile(manager, GrammarSpec.regex("(yes|no)"))
    matcher = manager.add_matcher(compiled)
    keys = [matcher, matcher]
    for temperature in (0.0, 1.0, 1e-40):
        rows = [_row(temperature=temperature), _row(temperature=temperature)]
        logits = torch.full((2, 40), float("nan"))
        logits[1, VOCAB.index("x")] = float("inf")  # masked, and the largest
        proc = FusedLogitsProcessor(SamplingInputs(rows, keys[:2]), manager.mask)
        proc.prepare()
        tokens = Sampler()(logits, rows, proc).token_ids
        assert all(VOCAB[t] in ("yes", "no") for t in tokens), tokens
    manager.remove_matcher(matcher)


def test_tiny_temperature_is_greedy():
    from worker.engine.sampling import SamplingParams

    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_grammar_cache_is_bounded_by_bytes():
    info = xgr.TokenizerInfo(VOCAB, vocab_size=40, stop_token_ids=[EOS])
    probe = GuidedDecodingManager(info)
    size = compile(probe, GrammarSpec.regex("x+")).artifact.memory_size_bytes
    small = GuidedDecodingManager(info, cache_bytes=int(2.5 * size))
    for pattern in ("x+", "a+", "b+", "ab+"):
        compile(small, GrammarSpec.regex(pattern))
    assert small.cached_bytes <= 2.5 * size and small.stats.evictions >= 1
    compiles = small.stats.compiles
    compile(small, GrammarSpec.regex("ab+"))  # the newest stays
    assert small.stats.compiles == compiles
    compile(small, GrammarSpec.regex("x+"))  # the oldest was evicted: compiled again
    assert small.stats.compiles == compiles + 1


@pytest.mark.parametrize("spec, prefix, completion", [
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact"), '{"a":1', ',"b":true}'),
    (GrammarSpec.json_schema(SCHEMA, whitespace="compact"), '{"a', '":0,"b":true}'),
    (GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 3},
                             whitespace="compact"), "[", "0,0,0]"),
    (GrammarSpec.regex("a[0-9]{3}b"), "a1", "00b"),
    (GrammarSpec.choice(["yes", "no"]), "", "no"),
    (GrammarSpec.ebnf('root ::= "[" item ("," item)* "]"\nitem ::= "a" | "b"'), "[a,", "a]"),
])
def test_shortest_completion(manager, spec, prefix, completion):
    from worker.guided.closing import CompletionSearch

    search = CompletionSearch(manager.tokenizer_info, time_limit_s=60)  # node caps only
    m = manager.new_matcher(compile(manager, spec))
    assert m.accept_string(prefix)
    dived = search.shortest(m, 32)  # the greedy dive: valid, maybe a little longer
    probe = m.fork()
    assert all(probe.accept_token(t) for t in dived.tokens) and probe.is_completed()
    found = search.shortest(m, 32, exact=True)
    text = "".join(VOCAB[t] for t in found.tokens)
    # no longer than the known shortest completion, one token per character
    assert len(found.tokens) <= len(completion)
    assert m.accept_string(text) and m.is_completed()
    assert search.shortest(m, 32).tokens == []  # complete: nothing to add
    short = manager.new_matcher(compile(manager, spec))
    short.accept_string(prefix)
    tight = search.shortest(short, len(found.tokens) - 1, exact=True)  # one too few: none
    assert tight.tokens is None and tight.exhausted


def test_search_cut_short_by_the_clock_is_not_exhausted(manager):
    from worker.guided.closing import CompletionSearch

    search = CompletionSearch(manager.tokenizer_info, time_limit_s=0.0)
    m = manager.new_matcher(compile(manager, GrammarSpec.regex("a[0-9]{3}b")))
    for exact in (False, True):
        found = search.shortest(m, 32, exact=exact)
        assert found.tokens is None and not found.exhausted  # "do not know", never "none"
    assert search.stats["timeouts"] >= 2


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", '{"type": "nonsense"}'), "json_schema"),
    (GrammarSpec.regex("(ab"), "regex"),
    (GrammarSpec.ebnf('root ::= "a" | '), "ebnf"),
    (GrammarSpec.lark("start: ???"), "lark"),
    (GrammarSpec.json_schema({"type": "array", "prefixItems": [{"type": "integer"}],
                              "items": False, "minItems": 3}), "json_schema"),
])
def test_bad_grammars_fail_with_a_message_and_are_cached(manager, spec, message):
    with pytest.raises(GrammarError, match=f"invalid {message} grammar: .+"):
        compile(manager, spec)
    compiles = manager.stats.compiles
    fut = manager.get_grammar(spec)
    assert fut.done()  # the failure is cached: fails fast the second time
    with pytest.raises(GrammarError):
        fut.result()
    assert manager.stats.compiles == compiles


def test_same_spec_compiles_once(manager):
    spec = GrammarSpec.regex("b+a")
    futures = [manager.get_grammar(spec) for _ in range(5)]
    results = {id(f.result(timeout=30)) for f in futures}
    assert len(results) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="yaml", source="x"), "unknown grammar kind"),
    (dict(kind="json_schema", source="{not json"), "not valid JSON"),
    (dict(kind="regex", source=""), "empty"),
    (dict(kind="regex", source="a" * 300_000), "over the limit"),
    (dict(kind="choice", source="[]"), "non-empty list"),
    (dict(kind="choice", source='["a", 1]'), "non-empty string"),
    (dict(kind="json_schema", source="{}", whitespace="tabs"), "whitespace"),
])
def test_spec_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrammarSpec(**kwargs)


def test_spec_keys_and_shapes():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"x": {}, "y": {}}})
    b = GrammarSpec.json_schema('{"type":"object","properties":{"x":{},"y":{}}}')
    c = GrammarSpec.json_schema({"type": "object", "properties": {"y": {}, "x": {}}})
    assert a.key("tok") == b.key("tok")
    assert a.key("tok") != c.key("tok")  # property order is part of the grammar
    assert a.key("tok") != a.key("other-tokenizer")
    assert a.key() != GrammarSpec.json_schema(json.loads(a.source), whitespace="compact").key()
    # (API dialects such as response_format are the edge's: deploy/dialects.py)
    assert GrammarSpec("gbnf", "root ::= \"a\"").kind == "ebnf"
    assert GrammarSpec.from_dict(a.to_dict()) == a


def test_choice_ebnf_escapes(manager):
    choices = ['a"b', "c\\d", "é", "x\ny"]
    assert choice_ebnf(choices) == 'root ::= "a\\"b" | "c\\\\d" | "é" | "x\\u000ay"'
    for c in choices:
        assert accepts(manager, GrammarSpec.choice(choices), c)


def test_cpu_kernel_is_built():
    from worker.guided.bitmask import warmup

    assert warmup(), "the C bitmask kernel did not build (is a C compiler installed?)"


VOCABS = [1000, 49152, 50001]


@pytest.mark.parametrize("vocab", VOCABS)
def test_cpu_kernel_matches_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    batch = 7
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    bitmask[3, : words // 2] = 0
    logits = torch.randn(batch, vocab, generator=g)
    expected = logits.clone()
    reference_apply(expected, bitmask)
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all() and torch.isinf(logits[2]).all()
    # bit t of word w is token 32 * w + t
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5
    row = torch.zeros(1, vocab)
    apply_token_bitmask_inplace(row, bitmask)
    assert torch.isfinite(row[0]).nonzero().flatten().tolist() == [37]


@pytest.mark.cuda
def test_cuda_kernel_matches_reference():
    vocab, batch = 49152, 8
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, vocab // 32), dtype=torch.int32)
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
    expected = logits.float().cpu()
    reference_apply(expected, bitmask)
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(logits.float().cpu(), expected)


def test_failed_fetch_does_not_poison_the_spec():
    """A compile service failure (not the grammar's fault) fails that wait only: the next
    request for the same spec tries again."""
    info = xgr.TokenizerInfo(VOCAB, vocab_size=40, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    calls = []

    def flaky_fetch(spec, client):
        calls.append(spec)
        if len(calls) == 1:
            raise OSError("compile service unavailable")
        return compiler.compile_regex(spec.source)

    m = GuidedDecodingManager(info, max_batch_size=2, fetch=flaky_fetch)
    spec = GrammarSpec.regex("x+")
    with pytest.raises(OSError):
        m.get_grammar(spec).result(timeout=30)
    assert m.get_grammar(spec).result(timeout=30) is not None
    assert len(calls) == 2


def test_the_fetch_is_for_the_client_whose_request_started_the_compile():
    """The request's client (GenerationRequest.client) reaches the fetch, so the shared
    cache can share its compiles fairly; a request that joins a compile in flight adds no
    fetch of its own."""
    import threading

    info = xgr.TokenizerInfo(VOCAB, vocab_size=40, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    asked, release = [], threading.Event()

    def fetch(spec, client):
        asked.append((spec.source, client))
        release.wait(30)
        return compiler.compile_regex(spec.source)

    m = GuidedDecodingManager(info, max_batch_size=2, fetch=fetch)
    first = m.get_grammar(GrammarSpec.regex("a+"), "alice")
    joined = m.get_grammar(GrammarSpec.regex("a+"), "bob")
    release.set()
    assert first.result(timeout=30) is joined.result(timeout=30)
    m.get_grammar(GrammarSpec.regex("b+"), "bob").result(timeout=30)
    m.get_grammar(GrammarSpec.regex("x+")).result(timeout=30)  # no client: the shared line
    assert asked == [("a+", "alice"), ("b+", "bob"), ("x+", None)]



def test_a_grammar_s_own_error_is_remembered_past_a_minute():
    """A grammar refused for its own sake (here over the compile memory) stays refused
    from the cache for error_ttl_s (an hour by default): at 60 s, a schema checked by
    POST /v1/grammars and requested a minute later was compiled again, and on a busy
    machine that compile outlasted the request's grammar wait (503 where the check said
    422: the grammar_check bench, WashingtonPost/wp_1). Past the TTL it compiles again."""
    info = xgr.TokenizerInfo(VOCAB, vocab_size=40, stop_token_ids=[EOS])
    calls = []

    def fetch(spec, client):
        calls.append(spec)
        raise GrammarError("over the compile memory", ErrorKind.COMPILE_MEMORY)

    m = GuidedDecodingManager(info, max_batch_size=2, fetch=fetch)
    spec = GrammarSpec.regex("x+")
    key = spec.key(m.fingerprint)
    for age_s in (0, 120, 3000):  # seconds more since the refusal (3,120 in all)
        if calls:
            m._error_time[key] -= age_s
        with pytest.raises(GrammarError) as caught:
            m.get_grammar(spec).result(timeout=30)
        assert caught.value.kind == ErrorKind.COMPILE_MEMORY
        assert len(calls) == 1, age_s
    m._error_time[key] -= 3600
    with pytest.raises(GrammarError):
        m.get_grammar(spec).result(timeout=30)
    assert len(calls) == 2
