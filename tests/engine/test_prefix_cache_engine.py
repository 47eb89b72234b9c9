"""Automatic prefix caching (worker/engine/block_manager.py) in the engine: greedy outputs
are token for token those of the cache off (guided on both grammar engines, n > 1 samples,
a preemption under KV pressure, a session's turns, a continuation after a worker died, the
overlapped step, and on CUDA with graphs), prompts that share a prefix compute it once and
report it in ``cached_tokens``, tenants' scopes never share, and after random admissions,
aborts, preemptions and evictions every block is free or cached with no reference."""

import json
import random

import pytest
import torch

from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

SYSTEM = ("You extract facts from documents for a research team. Read the user's text "
          "carefully, keep names exactly as written, never invent a value, and answer in "
          "the format you are asked for, with nothing before or after it. ") * 3
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "city": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "city", "age"], "additionalProperties": False}
DOCS = ["Ada Lovelace lived in London and was 36.", "Alan Turing worked in Manchester.",
        "Grace Hopper, 85, was born in New York.", "Linus lives in Portland, aged 54."]


def chat(doc, system=SYSTEM):
    return [{"role": "system", "content": system}, {"role": "user", "content": doc}]


def greedy(n=24, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def requests(tag=""):
    reqs = []
    for i, doc in enumerate(DOCS):
        reqs.append(GenerationRequest(chat(doc), greedy(40), request_id=f"json{i}{tag}",
                                      grammar=GrammarSpec.json_schema(PERSON)))
        reqs.append(GenerationRequest(chat(doc), greedy(16), request_id=f"plain{i}{tag}"))
    reqs.append(GenerationRequest(chat(DOCS[0]), greedy(12), request_id=f"regex{tag}",
                                  grammar=GrammarSpec.regex("[A-Z][a-z]+ (lives|lived) in [A-Z][a-z]+")))
    return reqs


def outputs(engine, reqs):
    out = engine.generate(reqs)
    return {r.request_id: (out[r.request_id].token_ids, out[r.request_id].text,
                           out[r.request_id].finish_reason, out[r.request_id].error)
            for r in reqs}, out


def settled(engine):
    """Nothing runs and no block is referenced: each is free or cached."""
    st = engine.stats()
    engine.blocks.check([])
    return (st.running == st.waiting == st.live_processors == 0
            and st.free_blocks + st.session_blocks == st.total_blocks)


@pytest.mark.parametrize("grammar_engine", ["xgrammar", "llguidance"])
def test_greedy_outputs_equal_with_the_cache_on_and_off(make_engine, grammar_engine):
    off = make_engine(prefix_caching=False, grammar_engine=grammar_engine)
    on = make_engine(grammar_engine=grammar_engine)
    want, _ = outputs(off, requests())
    first, out1 = outputs(on, requests())
    again, out2 = outputs(on, requests("-again"))  # every prompt cached now
    assert first == want
    assert {k.removesuffix("-again"): v for k, v in again.items()} == want
    for rid, (_, text, reason, error) in want.items():
        if rid.startswith("json") and reason == "stop":
            assert set(json.loads(text)) == {"name", "city", "age"}
    n_prompt = len(on.encode_prompt(chat(DOCS[0])))
    assert all(o.cached_tokens >= n_prompt // 2 for o in out2.values())
    assert sum(o.cached_tokens for o in out1.values()) > 0  # shared system prompt
    st = off.stats()
    assert st.prefix_cache_hit_tokens == 0 and on.stats().prefix_cache_hit_tokens > 0
    assert settled(on) and settled(off)


def test_n_samples_of_one_prompt_compute_it_once_and_equal_the_cache_off(make_engine):
    def samples(engine):
        reqs = [GenerationRequest(chat(DOCS[1]), SamplingParams(
            max_new_tokens=16, temperature=0.8, seed=11 + i), session_id="n4", seq_id=i)
            for i in range(4)]
        outs, raw = outputs(engine, reqs)
        engine.end_session("n4")
        return [outs[r.request_id] for r in reqs], [raw[r.request_id] for r in reqs]

    want, _ = samples(make_engine(prefix_caching=False))
    on = make_engine()
    got, raw = samples(on)
    assert got == want
    n_prompt = raw[0].prompt_tokens
    # the first sample computes the prompt; the others wait a step and start after it
    assert sorted(o.cached_tokens for o in raw)[1:] == [n_prompt // 16 * 16] * 3
    assert settled(on)


def test_a_preemption_under_kv_pressure_changes_no_token(make_engine):
    want, _ = outputs(make_engine(prefix_caching=False), requests())
    # drafts off: with them the rows finish in fewer steps and this cache is not tight
    # enough to preempt (test_speculative_engine.py preempts with drafts)
    tight = make_engine(num_kv_blocks=26, max_num_batched_tokens=64, speculative=False)
    got, _ = outputs(tight, requests())
    assert got == want
    assert tight.stats().preemptions > 0
    assert settled(tight)


def test_a_sessions_turns_equal_the_cache_off_and_its_blocks_go_when_it_ends(make_engine):
    def turns(engine):
        msgs, texts, cached = chat(DOCS[2]), [], []
        for ask in ("Who is it?", "Where was she born?", "How old?"):
            msgs = msgs + [{"role": "user", "content": ask}]
            req = GenerationRequest(msgs, greedy(12), session_id="talk")
            out = engine.generate([req])[req.request_id]
            texts.append(out.token_ids)
            cached.append(out.cached_tokens)
            msgs = msgs + [{"role": "assistant", "content": out.text}]
        return texts, cached

    off, on = make_engine(prefix_caching=False), make_engine()
    want, cached_off = turns(off)
    got, cached_on = turns(on)
    assert got == want
    assert cached_off[1:] == cached_on[1:] and min(cached_on[1:]) > 40  # sessions reuse KV
    assert on.stats().live_sessions == 1 and on.stats().session_blocks > 0
    on.end_session("talk")
    st = on.stats()
    assert st.live_sessions == 0 and st.session_blocks == 0 and settled(on)


def test_a_continuation_after_a_worker_died_equals_the_cache_off(make_engine):
    def run(engine):
        req = GenerationRequest(chat(DOCS[3]), greedy(24), grammar=GrammarSpec.json_schema(PERSON))
        full = engine.generate([req])[req.request_id]
        cont_req = GenerationRequest(chat(DOCS[3]), greedy(24),
                                     grammar=GrammarSpec.json_schema(PERSON),
                                     resume_token_ids=full.token_ids[:5])
        cont = engine.generate([cont_req])[cont_req.request_id]
        return full, cont

    full_off, cont_off = run(make_engine(prefix_caching=False))
    on = make_engine()
    full_on, cont_on = run(on)
    assert full_on.token_ids == full_off.token_ids
    assert cont_on.token_ids == cont_off.token_ids == full_off.token_ids[5:]
    assert cont_on.cached_tokens > 0  # its prompt (and what it streamed) were cached
    assert settled(on)


def test_the_overlapped_step_with_the_cache_equals_the_plain_step_without(make_engine):
    want, _ = outputs(make_engine(prefix_caching=False, overlap=False), requests())
    over = make_engine(overlap=True)
    first, _ = outputs(over, requests())
    again, out = outputs(over, requests("-again"))
    assert first == want
    assert {k.removesuffix("-again"): v for k, v in again.items()} == want
    assert all(o.cached_tokens > 0 for o in out.values())
    assert settled(over)


def test_tenants_scopes_never_share_a_block(make_engine):
    engine = make_engine()

    def one(scope):
        req = GenerationRequest(chat(DOCS[0]), greedy(4), cache_scope=scope)
        return engine.generate([req])[req.request_id].cached_tokens

    assert one("t-acme") == 0
    assert one("t-acme") > 0
    assert one("t-globex") == 0 and one(None) == 0
    assert settled(engine)


def test_random_admissions_aborts_preemptions_and_evictions_leak_nothing(make_tiny_engine):
    """The tiny model, a cache that preempts and evicts, prompts sharing prefixes, sessions
    and aborts at random: after every step each block is free, cached with no reference,
    or referenced as often as the live sequences' tables and the sessions hold it."""
    engine = make_tiny_engine(num_kv_blocks=30, block_size=8, max_num_batched_tokens=96)
    rng = random.Random(3)
    tok = engine.tokenizer
    prefixes = [tok(SYSTEM[:n])["input_ids"] for n in (80, 160, 240)]
    for step in range(300):
        if rng.random() < 0.35 and len(engine.seqs) < 10:
            prompt = rng.choice(prefixes) + [rng.randrange(100, 5000)
                                             for _ in range(rng.randrange(1, 20))]
            engine.add_request(GenerationRequest(
                prompt, greedy(rng.randrange(4, 48), ignore_eos=True),
                session_id=rng.choice([None, None, "s1", "s2"])))
        if engine.seqs and rng.random() < 0.05:
            engine.abort(rng.choice(list(engine.seqs)))
        if engine.seqs and rng.random() < 0.02:
            engine.end_session(rng.choice(["s1", "s2"]))
        engine.step()
        engine.blocks.check([s.block_table for s in engine.seqs.values()])
    while engine.has_work():
        engine.step()
    for sid in ("s1", "s2"):
        engine.end_session(sid)
    st = engine.stats()
    assert st.preemptions > 0 and st.prefix_cache_evictions > 0
    assert st.prefix_cache_hit_tokens > 0
    assert settled(engine) and st.free_blocks == st.total_blocks


@pytest.mark.cuda
def test_cuda_prefix_cache_with_graphs_equals_the_cache_off(default_model_dir):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def engine(caching):
        return LLMEngine(EngineConfig(model=str(default_model_dir), device="cuda",
                                      progress=False, num_kv_blocks=512,
                                      prefix_caching=caching))

    want, _ = outputs(engine(False), requests())
    on = engine(True)
    first, _ = outputs(on, requests())
    again, out = outputs(on, requests("-again"))
    assert first == want
    assert {k.removesuffix("-again"): v for k, v in again.items()} == want
    assert all(o.cached_tokens > 0 for o in out.values()) and settled(on)


def test_the_start_warm_up_leaves_nothing_behind(make_tiny_engine):
    """``warmup`` (on by default on CUDA, forced here): its throwaway prompts leave no
    block referenced or cached, no counter moved, and change no later output."""
    cold, warm = make_tiny_engine(), make_tiny_engine(warmup=True)
    st = warm.stats()
    assert st.free_blocks == st.total_blocks and st.cached_blocks == 0
    assert (st.steps, st.sampled_tokens, st.preemptions, st.prefix_cache_query_tokens) == (0,) * 4
    assert not warm.seqs and not warm.has_work()
    reqs = lambda: [GenerationRequest(chat(d), greedy(8)) for d in DOCS]  # noqa: E731
    assert ([o.token_ids for o in outputs(warm, reqs())[1].values()]
            == [o.token_ids for o in outputs(cold, reqs())[1].values()])
