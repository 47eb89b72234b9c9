"""Our model's logits equal transformers' own implementation for the same weights.

Tiny random-weight configs of every supported family (no download), through the paged
attention path: full prefill, chunked prefill, and token-by-token decode in a batch.
"""

import pytest
import torch
import transformers

from worker.models.loader import load_model

pytestmark = pytest.mark.unit

BLOCK = 4

FAMILIES = {
    "llama": dict(cls="LlamaConfig"),
    "llama3_rope": dict(cls="LlamaConfig", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_tied": dict(cls="LlamaConfig", tie_word_embeddings=True),
    "mistral": dict(cls="MistralConfig", sliding_window=None),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", head_dim=24),
}


def tiny_config(family: str):
    spec = dict(FAMILIES[family])
    cls = getattr(transformers, spec.pop("cls"))
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6)
    base.update(spec)
    return cls(**base)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    config = tiny_config(request.param)
    hf_cls = getattr(transformers, config.__class__.__name__.replace("Config", "ForCausalLM"))
    hf = hf_cls(config).eval()
    # random weights everywhere, including norms, so q/k norm and biases matter
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_model(path, progress=False)
    return hf, ours


def kv_caches(model, num_slots=256):
    shape = (num_slots, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run(model, caches, decodes, prefills, tokens, positions):
    from worker.models.paged_attention import AttentionBatch

    batch = AttentionBatch.build(decodes, prefills, BLOCK)
    with torch.no_grad():
        h = model(torch.tensor(tokens), torch.tensor(positions), caches, batch)
        return model.compute_logits(h)


PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 11, 12], [1, 2], list(range(20, 57))]


def test_prefill_matches(pair):
    hf, ours = pair
    for ids in PROMPTS:
        caches = kv_caches(ours)
        # non-contiguous blocks, in a shuffled order
        table = [(b * 5 + 3) % 60 for b in range(-(-len(ids) // BLOCK))]
        got = run(ours, caches, [], [(table, len(ids), len(ids))], ids, list(range(len(ids))))
        ref = hf_logits(hf, ids)
        assert (got - ref).abs().max() < 1e-4
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_and_batched_decode_match(pair):
    hf, ours = pair
    caches = kv_caches(ours)
    seqs = [PROMPTS[0], PROMPTS[2]]
    tables = [[9, 2, 30, 4], [11, 1, 5, 17, 23, 40, 41, 7, 8, 50]]
    # chunk 1: first 5 tokens of each; chunk 2: the rest of the prompts
    for lo, hi in [(0, 5), (5, None)]:
        prefill, tokens, positions = [], [], []
        for s, table in zip(seqs, tables):
            end = len(s) - 3 if hi is None else hi
            prefill.append((table, end, end - lo))
            tokens += s[lo:end]
            positions += list(range(lo, end))
        logits = run(ours, caches, [], prefill, tokens, positions)
    # the rest token by token, both sequences in one decode batch
    for step in range(3, 0, -1):
        decode, tokens, positions = [], [], []
        for s, table in zip(seqs, tables):
            n = len(s) - step + 1
            decode.append((table, n))
            tokens.append(s[n - 1])
            positions.append(n - 1)
        logits = run(ours, caches, decode, [], tokens, positions)
        for row, s in enumerate(seqs):
            ref = hf_logits(hf, s[: len(s) - step + 1])[-1]
            assert (logits[row] - ref).abs().max() < 1e-4
            assert logits[row].argmax() == ref.argmax()


@pytest.mark.integration
def test_default_model_logits_match_transformers(default_model_dir, default_model,
                                                  default_tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir,
                                                            dtype=torch.float32).eval()
    for text in ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]:
        ids = default_tokenizer(text)["input_ids"]
        caches = kv_caches(default_model)
        table = list(range(-(-len(ids) // BLOCK)))
        got = run(default_model, caches, [], [(table, len(ids), len(ids))], ids,
                  list(range(len(ids))))
        ref = hf_logits(hf, ids)
        assert (got - ref).abs().max() < 1e-3
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.cuda
def test_default_model_bf16_on_cuda(default_model_dir, default_tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.bfloat16).cuda().eval()
    ours = load_model(default_model_dir, device="cuda", progress=False)
    ids = default_tokenizer("The capital of France is")["input_ids"]
    shape = (256, ours.num_kv_heads, ours.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
               torch.zeros(shape, dtype=torch.bfloat16, device="cuda")) for _ in ours.layers]
    from worker.models.paged_attention import AttentionBatch

    batch = AttentionBatch.build([], [(list(range(4)), len(ids), len(ids))], BLOCK, "cuda")
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(ids, device="cuda"),
                                       torch.arange(len(ids), device="cuda"), caches, batch))
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max() < 0.5
