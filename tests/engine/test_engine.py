"""The engine with the real default model: correctness against transformers, continuous
batching, chunked prefill, preemption, sampling parameters, sessions, aborts, bad input."""

import pytest
import torch

from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash map is in one sentence, then give an example in Python code.",
]


def chat(text):
    return [{"role": "user", "content": text}]


def greedy(n=24, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def run(engine, prompts, params):
    reqs = [GenerationRequest(p, params) for p in prompts]
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


def test_greedy_matches_transformers_generate(make_engine, default_model_dir, default_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    engine = make_engine()
    for text in CHATS[:2]:
        ids = engine.encode_prompt(chat(text))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                              eos_token_id=sorted(engine.eos_ids), pad_token_id=0)[0, len(ids):]
        ref = [t for t in ref.tolist()]
        [ours] = run(engine, [ids], greedy(20))
        got = ours.token_ids
        n = min(len(got), len(ref))
        assert got[:n] == ref[:n] and n > 0


def test_batched_chunked_and_preempted_equal_solo(make_engine):
    solo_engine = make_engine()
    solo = [run(solo_engine, [chat(t)], greedy(32))[0] for t in CHATS]
    # small token budget: prompts are prefilled in chunks while others decode;
    # a tiny cache: sequences get preempted and recomputed.
    engine = make_engine(max_num_batched_tokens=24, num_kv_blocks=14, block_size=8)
    batched = run(engine, [chat(t) for t in CHATS], greedy(32))
    assert engine.stats().preemptions > 0
    for s, b in zip(solo, batched):
        assert b.token_ids == s.token_ids
        assert b.text == s.text
        assert b.finish_reason == s.finish_reason
    st = engine.stats()
    assert st.free_blocks == st.total_blocks and st.running == st.waiting == 0


def test_seed_reproducible(make_engine):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    a = run(engine, [chat(CHATS[1])], params)[0]
    # same seed, now sharing its batch with others
    b = run(engine, [chat(CHATS[1]), chat(CHATS[0]), chat(CHATS[2])], params)[0]
    c = run(engine, [chat(CHATS[1])], SamplingParams(max_new_tokens=24, temperature=1.0,
                                                     top_p=0.95, seed=99))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_max_tokens_gives_length(make_engine):
    [out] = run(make_engine(), [chat(CHATS[3])], greedy(5))
    assert out.finish_reason == "length" and out.completion_tokens == 5
    assert len(out.token_ids) == 5


def test_eos_gives_stop_and_ignore_eos_runs_on(make_engine):
    engine = make_engine()
    [out] = run(engine, [chat(CHATS[0])], greedy(64))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.eos_ids
    assert "<|im_end|>" not in out.text
    [longer] = run(engine, [chat(CHATS[0])], greedy(len(out.token_ids) + 4, ignore_eos=True))
    assert longer.finish_reason == "length"
    assert longer.token_ids[: len(out.token_ids)] == out.token_ids


def test_stop_strings_and_stop_token_ids(make_engine):
    engine = make_engine()
    [full] = run(engine, [chat(CHATS[0])], greedy(32))
    assert "Paris" in full.text
    [cut] = run(engine, [chat(CHATS[0])], greedy(32, stop=("Paris",)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("Paris")]
    stop_id = full.token_ids[2]
    [by_id] = run(engine, [chat(CHATS[0])], greedy(32, stop_token_ids=(stop_id,)))
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:3]


def test_logprobs(make_engine):
    [out] = run(make_engine(), [chat(CHATS[0])], greedy(6, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids)
    for token, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely token
        assert lp == pytest.approx(top[0][1]) and lp <= 0
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_penalties_change_output(make_engine):
    engine = make_engine()
    prompt = "Repeat the word cat ten times:"
    [plain] = run(engine, [prompt], greedy(24))
    [pen] = run(engine, [prompt], greedy(24, frequency_penalty=2.0))
    [rep] = run(engine, [prompt], greedy(24, repetition_penalty=1.8))

    def distinct(o):
        return len(set(o.token_ids)) / len(o.token_ids)

    assert distinct(pen) > distinct(plain)
    assert rep.token_ids != plain.token_ids


def test_session_reuses_kv_and_matches_fresh_prefill(make_engine):
    engine = make_engine()
    turn1 = chat("My name is Ada. Remember it.")
    [a] = run_session(engine, turn1, "s1")
    assert engine.stats().live_sessions == 1
    turn2 = turn1 + [{"role": "assistant", "content": a.text},
                     {"role": "user", "content": "What is my name?"}]
    [b] = run_session(engine, turn2, "s1")
    assert b.cached_tokens > len(engine.encode_prompt(turn1)) // 2
    fresh = make_engine()
    [c] = run(fresh, [turn2], greedy(16))
    assert b.token_ids == c.token_ids
    engine.end_session("s1")
    st = engine.stats()
    assert st.live_sessions == 0 and st.free_blocks == st.total_blocks


def run_session(engine, messages, sid):
    req = GenerationRequest(messages, greedy(16), session_id=sid)
    return [engine.generate([req])[req.request_id]]


def test_idle_sessions_evicted_under_pressure(make_engine):
    engine = make_engine(num_kv_blocks=12, block_size=8)  # 96 tokens
    for i in range(4):
        # each its own 30-odd tokens (the chat template's system prompt they share is
        # cached once): four sessions do not fit
        words = " ".join(f"{i}{j}" for j in range(12))
        req = GenerationRequest(chat(f"Say hello to {words}."), greedy(8), session_id=f"s{i}")
        engine.generate([req])
    st = engine.stats()
    assert st.live_sessions < 4  # older sessions made room for newer requests
    assert st.free_blocks + st.session_blocks == st.total_blocks


def test_abort_frees_blocks(make_engine):
    engine = make_engine()
    seq = engine.add_request(GenerationRequest(chat(CHATS[3]), greedy(100)))
    for _ in range(3):
        engine.step()
    final = engine.abort(seq.request_id)
    assert final.finished and final.finish_reason == "abort"
    st = engine.stats()
    assert st.free_blocks == st.total_blocks and not engine.has_work()


@pytest.mark.parametrize("prompt, params, message", [
    ("", greedy(), "prompt is empty"),
    ([], greedy(), "prompt must be"),
    ("x " * 5000, greedy(), "shorten the prompt"),
    ([10**9], greedy(), "outside the vocabulary"),
    ([{"content": "no role"}], greedy(), "'role'"),
])
def test_bad_requests_fail_alone(make_engine, prompt, params, message):
    engine = make_engine(max_model_len=2048)
    good = engine.add_request(GenerationRequest(chat(CHATS[0]), greedy(8)))
    with pytest.raises(ValueError, match=message):
        engine.add_request(GenerationRequest(prompt, params))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[-1].request_id == good.request_id and outs[-1].finished


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(logprobs=50), "logprobs"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_sampling_param():
    with pytest.raises(ValueError, match=r"sampling\.foo: unknown key; known keys: .*max_new_tokens"):
        SamplingParams.from_dict({"foo": 1})
