"""CUDA graphs for decode steps (worker/engine/cuda_graphs.py).

Here, without a GPU, the graph runner's static buffers, padding rows and bucket choice run
eagerly through the tiled path (Triton's interpreter): its logits equal the eager tiled
runner's for the same steps, and greedy output is the same with and without it. With CUDA
(``-m cuda``) the graphs are recorded and replayed: greedy output equals the eager path's,
and n > 1, a continuation and streaming work with graphs on.
"""

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.cuda_graphs import bucket_sizes
from worker.engine.engine import LLMEngine
from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest
from worker.models import triton_kernels

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from worker.models.tiny_model import build_tiny_model

    tok = os.environ.get("RAYGUIDE_TOKENIZER_DIR")
    if tok is None:
        from worker.models.gguf_convert import ensure_converted

        tok = ensure_converted(None, progress=False)
    return build_tiny_model(tmp_path_factory.mktemp("graphs-tiny"), Path(tok))


def chat(text):
    return [{"role": "user", "content": text}]


def greedy(n=10):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


PROMPTS = ["Hi", "Tell me a story about a cat", "1 2 3", "What is the capital of France?",
           "Yo"]
# The CPU tests send them as plain text, 22 tokens in all (the chat template adds ~32 to
# each, and every token costs the interpreter): still more than a graph step holds (16
# tokens), so the prompts' step is eager and the graph steps read the keys it wrote


def run(engine, reqs):
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(160) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160]


def _cpu_engine(model_dir, graphs: bool, **kw):
    if not triton_kernels.available():
        pytest.skip("needs triton")
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", progress=False,
                                    num_kv_blocks=64, max_num_seqs=8, max_model_len=256, **kw))
    engine.runner.tiled = True
    if graphs:
        engine.runner.enable_graphs(8, engine.max_model_len, capture=False)
    return engine


def test_the_graph_runner_gives_the_eager_logits(model_dir):
    """Every decode step, through the graph runner and again through the eager tiled
    runner (which writes the same keys and values to the same slots): logits equal. Five
    rows take bucket 8's static buffers with three padding rows; as rows finish, smaller
    buckets; guided rows bring several tokens to a graph step. The prompts' step is
    eager."""
    engine = _cpu_engine(model_dir, True)
    runner, graphs = engine.runner, engine.runner.graphs
    orig, compared, widest, eager = runner.run, [], [], []

    def both(scheduled):
        fits = graphs.fits(scheduled)
        if not fits:
            eager.append(len(scheduled))
        before = runner.kv_caches[0][0].clone() if fits else None
        logits, rows = orig(scheduled)
        if fits:  # the step wrote its rows' slots and the scratch block, nothing else
            bs = runner.block_size
            changed = set((runner.kv_caches[0][0] != before).flatten(1).any(1)
                          .nonzero().flatten().tolist())
            own = {s.seq.block_table[p // bs] * bs + p % bs for s in scheduled
                   for p in range(s.seq.num_computed, s.seq.num_computed + s.num_tokens)}
            assert changed - own <= set(range(runner.scratch_slot, runner.scratch_slot + bs))
            logits = logits.clone()
            runner.graphs = None
            try:
                ref, ref_rows = orig(scheduled)
            finally:
                runner.graphs = graphs
            assert rows == ref_rows
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
            compared.append(len(scheduled))
            widest.append(max(s.num_tokens for s in scheduled))
        return logits, rows

    runner.run = both
    reqs = [GenerationRequest(p, greedy(4 + 2 * i)) for i, p in enumerate(PROMPTS)]
    for out in run(engine, reqs):
        assert out.error is None and out.token_ids
    assert len(PROMPTS) in compared and min(compared) < len(PROMPTS) and eager
    # guided rows: jump-forward's forced text rides on the sampled token (rows of several
    # tokens in one graph step, each token its own one-token tile)
    del compared[:], widest[:], eager[:]
    reqs = [GenerationRequest(p, greedy(20), grammar=GrammarSpec.json_schema(PERSON))
            for p in PROMPTS]
    for out in run(engine, reqs):
        assert out.error is None and json.loads(out.text).keys() == PERSON["properties"].keys()
    assert compared and max(widest) > 1 and eager


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "city": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "city", "age"], "additionalProperties": False}


def test_jump_forward_steps_take_the_graph_runner_and_give_the_eager_output(model_dir):
    """Guided rows whose forced text (``", "city": "``) goes with their sampled token: the
    step's rows bring several tokens each and still fit a graph; output equals the eager
    runner's token for token."""
    reqs = lambda: [GenerationRequest(p, greedy(20),  # noqa: E731
                                      grammar=GrammarSpec.json_schema(PERSON))
                    for p in PROMPTS]
    eager = [o.token_ids for o in run(_cpu_engine(model_dir, False), reqs())]
    engine = _cpu_engine(model_dir, True)
    tokens = []
    real = engine.runner.graphs.run
    engine.runner.graphs.run = lambda s: tokens.append([x.num_tokens for x in s]) or real(s)
    outs = run(engine, reqs())
    assert [o.token_ids for o in outs] == eager
    for o in outs:
        assert set(json.loads(o.text)) == {"name", "city", "age"}
    assert any(max(t) > 1 for t in tokens)  # forced text went through a graph step
    assert engine.stats().live_processors == 0
    # and with overlap, as on CUDA: the forced text goes in the step after the draw's
    over = _cpu_engine(model_dir, True, overlap=True)
    assert [o.token_ids for o in run(over, reqs())] == eager
    assert over.stats().live_processors == 0


def test_greedy_output_is_the_same_with_graphs(model_dir):
    reqs = lambda: [GenerationRequest(p, greedy(8)) for p in PROMPTS]  # noqa: E731
    eager = [o.token_ids for o in run(_cpu_engine(model_dir, False), reqs())]
    engine = _cpu_engine(model_dir, True)
    calls = []
    real = engine.runner.graphs.run
    engine.runner.graphs.run = lambda s: calls.append(len(s)) or real(s)
    with_graphs = [o.token_ids for o in run(engine, reqs())]
    assert with_graphs == eager
    assert calls and max(calls) == len(PROMPTS)  # decode steps took the graph runner
    assert engine.stats().live_processors == 0


# --- CUDA: the recorded graphs ------------------------------------------------------------

def _cuda_engine(model_dir, graphs: bool, **kw):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return LLMEngine(EngineConfig(model=str(model_dir), device="cuda", progress=False,
                                  num_kv_blocks=256, max_num_seqs=16, cuda_graphs=graphs,
                                  **kw))


@pytest.mark.cuda
def test_cuda_greedy_output_equals_the_eager_path(model_dir):
    eager = _cuda_engine(model_dir, False)
    graphs = _cuda_engine(model_dir, True)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs
    assert eager.runner.graphs is None
    for batch in (PROMPTS[:1], PROMPTS, PROMPTS * 3):
        a = [o.token_ids for o in run(eager, [GenerationRequest(chat(p), greedy(12))
                                               for p in batch])]
        b = [o.token_ids for o in run(graphs, [GenerationRequest(chat(p), greedy(12))
                                                for p in batch])]
        assert a == b


@pytest.mark.cuda
def test_cuda_graphs_serve_n_samples_a_continuation_and_streams(model_dir):
    from core.grammar_spec import GrammarSpec
    from worker.engine.async_engine import AsyncEngine

    engine = _cuda_engine(model_dir, True)
    reqs = [GenerationRequest(chat("Hi"), SamplingParams(max_new_tokens=8, temperature=0.8,
                                                         seed=i),
                              session_id="n3", seq_id=i,
                              grammar=GrammarSpec.choice(["yes", "no", "maybe"]))
            for i in range(3)]
    for out in run(engine, reqs):
        assert out.text in ("yes", "no", "maybe"), out.error
    [full] = run(engine, [GenerationRequest(chat("Hi"), greedy(16))])
    [cont] = run(engine, [GenerationRequest(chat("Hi"), greedy(16),
                                            resume_token_ids=full.token_ids[:3])])
    assert full.token_ids[:3] + cont.token_ids == full.token_ids

    aengine = AsyncEngine(engine)
    try:
        async def stream(p):
            return [c async for c in aengine.generate(GenerationRequest(chat(p), greedy(8)))]

        async def all_streams():
            return await asyncio.gather(*(stream(p) for p in PROMPTS))

        for chunks in asyncio.run(all_streams()):
            assert chunks and chunks[-1].finish_reason in ("stop", "length")
    finally:
        aengine.shutdown()


@pytest.mark.cuda
def test_cuda_guided_rows_with_jump_forward_and_overlap(model_dir):
    """Guided rows whose forced text rides on a graph step, with overlap on (the default
    on CUDA) and off, graphs on and off: every answer valid; overlap and graphs change no
    token against the eager step without overlap."""
    def answers(**kw):
        engine = _cuda_engine(model_dir, **kw)
        reqs = [GenerationRequest(chat(p), greedy(40), grammar=GrammarSpec.json_schema(PERSON))
                for p in PROMPTS * 3]
        outs = run(engine, reqs)
        for o in outs:
            assert o.error is None and set(json.loads(o.text)) == {"name", "city", "age"}
        assert engine.stats().live_processors == 0
        return [o.token_ids for o in outs]

    ref = answers(graphs=False, overlap=False)
    assert answers(graphs=True, overlap=True) == ref
    assert answers(graphs=True, overlap=False) == ref
    assert answers(graphs=False, overlap=True) == ref


def test_draft_rows_take_the_graph_runner_and_give_the_output_without_drafts(model_dir,
                                                                           monkeypatch):
    """Speculation: a row brings its pending token and a draft, and needs the logits after
    each (``ScheduledSeq.num_logits``); such steps still fit a graph, and the output is the
    eager runner's without drafts, token for token (the tiny model repeats itself, so its
    drafts are often right)."""
    from worker.engine.speculative import StepCost

    monkeypatch.setattr(StepCost, "add", lambda self, tokens, seconds: None)  # no timings
    reqs = lambda: [GenerationRequest(p + " " + p, greedy(24)) for p in PROMPTS]  # noqa: E731
    plain = [o.token_ids for o in run(_cpu_engine(model_dir, False, speculative=False),
                                      reqs())]
    engine = _cpu_engine(model_dir, True, speculative=True)
    logits_rows = []
    real = engine.runner.graphs.run
    engine.runner.graphs.run = lambda s: logits_rows.append(
        sum(x.num_logits for x in s if x.samples)) or real(s)
    assert [o.token_ids for o in run(engine, reqs())] == plain
    assert engine.stats().accepted_draft_tokens > 0
    assert max(logits_rows) > len(PROMPTS)  # graph steps gave a draft's logits


@pytest.mark.cuda
def test_cuda_drafts_with_graphs_give_the_output_without(model_dir):
    reqs = lambda: [GenerationRequest(chat(p + " " + p), greedy(32))  # noqa: E731
                    for p in PROMPTS * 2]
    plain = [o.token_ids for o in run(_cuda_engine(model_dir, True, overlap=False,
                                                   speculative=False), reqs())]
    engine = _cuda_engine(model_dir, True, overlap=False, speculative=True)
    assert [o.token_ids for o in run(engine, reqs())] == plain
    assert engine.stats().accepted_draft_tokens > 0
