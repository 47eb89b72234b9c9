"""Every request path through the engine on each device: on the CPU here, on CUDA where
there is one (``-m cuda``; on a CUDA machine the model is bf16 and takes the device
kernels). A tiny random-weight model with the default model's tokenizer: what is checked
is that each path runs and keeps its contract on that device, not what the model says.

On a GPU machine without the default model's GGUF, set ``RAYGUIDE_TOKENIZER_DIR`` to a
folder with its tokenizer files (tokenizer.json, tokenizer_config.json, ...).
"""

import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch

from core.grammar_spec import GrammarSpec
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from core.params import SamplingParams
from core.request import GenerationRequest
from worker.models import triton_kernels

pytestmark = pytest.mark.integration

# "cpu-tiled": the CPU with the GPU's runner path (one packed copy, RoPE writing the cache,
# attention from the cache) through Triton's interpreter
DEVICES = ["cpu", "cpu-tiled", pytest.param("cuda", marks=pytest.mark.cuda)]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from worker.models.tiny_model import build_tiny_model

    tok = os.environ.get("RAYGUIDE_TOKENIZER_DIR")
    if tok is None:
        from worker.models.gguf_convert import ensure_converted

        tok = ensure_converted(None, progress=False)
    return build_tiny_model(tmp_path_factory.mktemp("device-tiny"), Path(tok))


@pytest.fixture(scope="module", params=DEVICES)
def engine_factory(request, model_dir):
    device = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tiled = device == "cpu-tiled"
    if tiled and not triton_kernels.available():
        pytest.skip("needs triton")

    def build(**kw):
        kw.setdefault("progress", False)
        kw.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(EngineConfig(model=str(model_dir), device=device.removesuffix(
            "-tiled"), **kw))
        if tiled:
            engine.runner.tiled = True
        return engine

    build.device = device
    return build


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory()


# Prompts are plain text (a token or a few) where the chat template is not what a test
# covers: it adds ~30 tokens to each, and on "cpu-tiled" every token costs the interpreter.
# The continuation in test_n_samples_and_a_continuation goes through it on each device.
def chat(text):
    return [{"role": "user", "content": text}]


def run(engine, reqs):
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


def sampled(n=12, **kw):
    kw.setdefault("temperature", 0.8)
    return SamplingParams(max_new_tokens=n, **kw)


def test_the_model_runs_on_the_device(engine, engine_factory):
    assert engine.runner.device.type == engine_factory.device.removesuffix("-tiled")
    if engine_factory.device != "cpu":
        assert engine.runner.tiled  # the device kernels, not the gather path
    if engine_factory.device == "cuda":  # the mask crosses to the GPU without a host wait
        assert engine.mask.bitmask.is_pinned()


@pytest.mark.parametrize("knobs", [dict(), dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1),
                                   dict(top_k=8, top_p=0.8, min_p=0.05, temperature=0.2)])
def test_sampling_with_every_filter(engine, knobs):
    [out] = run(engine, [GenerationRequest("Hi", sampled(**knobs))])
    assert out.error is None and out.finish_reason in ("stop", "length")
    assert len(out.token_ids) >= 1


def test_a_seed_gives_the_same_tokens_whatever_the_batch(engine):
    alone = run(engine, [GenerationRequest("Hi", sampled(seed=7, top_p=0.9))])[0]
    crowd = run(engine, [GenerationRequest("Yo", sampled(seed=1)),
                         GenerationRequest("Hi", sampled(seed=7, top_p=0.9)),
                         GenerationRequest("Hey", sampled(seed=3, top_k=4))])[1]
    assert crowd.token_ids == alone.token_ids


def test_penalties(engine):
    base = run(engine, [GenerationRequest("Hi", sampled(seed=5, temperature=0))])[0]
    [pen] = run(engine, [GenerationRequest("Hi", sampled(
        seed=5, temperature=0, repetition_penalty=1.5, presence_penalty=1.0,
        frequency_penalty=1.0))])
    assert pen.error is None and len(pen.token_ids) >= 1
    assert len(set(pen.token_ids)) >= len(set(base.token_ids))
    if len(set(base.token_ids)) < len(base.token_ids):  # greedy repeated itself (it does
        # here: the tiny model's "Hi" is one token over and over): penalties must vary it
        assert len(set(pen.token_ids)) > len(set(base.token_ids)), (base.token_ids, pen.token_ids)


def test_logprobs_and_top_logprobs(engine):
    for params in (sampled(logprobs=4, temperature=0), sampled(logprobs=3, top_p=0.9)):
        [out] = run(engine, [GenerationRequest("Hi", params)])
        assert len(out.logprobs) == len(out.token_ids)
        for token, (lp, top) in zip(out.token_ids, out.logprobs):
            assert len(top) == params.logprobs and lp <= 0
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            if params.greedy:
                assert top[0][0] == token and lp == pytest.approx(top[0][1], abs=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("jump_forward", [True, False])
def test_guided_json_validates_at_any_budget(engine_factory, temperature, jump_forward):
    engine = engine_factory(jump_forward=jump_forward)
    # greedy on the CPU this prompt's age runs long: cut at 14 and 24, ended by itself at 60
    reqs = [GenerationRequest("A person as JSON:", SamplingParams(
        max_new_tokens=n, temperature=temperature, seed=n),
        grammar=GrammarSpec.json_schema(PERSON)) for n in (14, 24, 60)]
    for out in run(engine, reqs):
        assert out.error is None, out.error
        jsonschema.validate(json.loads(out.text), PERSON)
    assert engine.stats().live_processors == 0


def test_the_guard_picks_an_allowed_token_when_every_logit_is_masked(engine):
    mgr = engine.mask
    mgr.bitmask[0].zero_()
    mgr.allow(0, 123)
    mgr.allow(0, 456)
    row = torch.full((engine.model.config.vocab_size,), float("nan"),
                     device=engine.runner.device)
    row[456] = 1.0
    assert mgr.best_allowed(0, row) == 456


def test_n_samples_and_a_continuation(engine):
    reqs = [GenerationRequest("Hi", sampled(seed=10 + i), session_id="n3", seq_id=i,
                              grammar=GrammarSpec.choice(["yes", "no", "maybe"]))
            for i in range(3)]
    for out in run(engine, reqs):
        assert out.text in ("yes", "no", "maybe"), out.error
    # through the chat template (the only requests here that do, on each device): the resumed
    # prompt, 34 tokens, spans three prefill tiles and three KV blocks
    [full] = run(engine, [GenerationRequest(chat("Hi"), sampled(16, temperature=0))])
    if len(full.token_ids) > 4:
        [cont] = run(engine, [GenerationRequest(chat("Hi"), sampled(16, temperature=0),
                                                resume_token_ids=full.token_ids[:3])])
        assert full.token_ids[:3] + cont.token_ids == full.token_ids


def test_reasoning_thinks_then_answers_in_the_grammar(engine_factory):
    engine = engine_factory(reasoning={"start": "<think>", "end": "</think>"},
                            thinking_token_budget=6)
    # the prompt opens the thought (a request starts in one only then)
    [out] = run(engine, [GenerationRequest("A person.\n<think>\n", SamplingParams(
        max_new_tokens=60, temperature=0.5, seed=1), grammar=GrammarSpec.json_schema(PERSON))])
    assert out.error is None and out.reasoning_tokens
    jsonschema.validate(json.loads(out.text), PERSON)
