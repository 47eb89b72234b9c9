"""Sampler and SamplingParams on hand-made logits (no model)."""

import pytest
import torch

from worker.engine.sampling import Sampler, SamplingParams, SamplingRow

pytestmark = pytest.mark.unit


def row(seed=0, prompt=(), output=(), **kw):
    g = torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(**kw), g, list(prompt), list(output))


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]]).repeat(4, 1)
    rows = [row(temperature=0), row(top_k=1), row(top_p=0.01), row(min_p=0.99)]
    assert Sampler()(logits, rows).token_ids == [1, 1, 1, 1]


def test_top_k_and_top_p_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, -5.0]])
    seen_k, seen_p = set(), set()
    for seed in range(200):
        seen_k.add(Sampler()(logits.clone(), [row(seed, top_k=2)]).token_ids[0])
        seen_p.add(Sampler()(logits.clone(), [row(seed, top_p=0.5)]).token_ids[0])
    assert seen_k == {0, 1}
    assert seen_p <= {0, 1} and 0 in seen_p


def test_same_seed_same_token_different_batch():
    base = torch.randn(1, 50)
    a = Sampler()(base.clone(), [row(7)]).token_ids[0]
    batch = torch.cat([torch.randn(2, 50), base])
    b = Sampler()(batch, [row(1), row(2), row(7)]).token_ids[2]
    assert a == b


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    Sampler()(logits, [row(temperature=0, prompt=[0, 1], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.5]])
    Sampler()(logits, [row(temperature=0, output=[0, 0, 2], presence_penalty=0.5,
                           frequency_penalty=1.0)])
    assert logits.tolist() == [[-0.5, 1.0, -0.5, 0.5]]


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    res = Sampler()(logits.clone(), [row(temperature=0, logprobs=2, repetition_penalty=5.0,
                                         prompt=[2])])
    lp, top = res.logprobs[0]
    raw = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), -1)
    assert res.token_ids == [1]  # the penalty moved the choice...
    assert lp == pytest.approx(raw[1].item())  # ...but logprobs stay the model's
    assert [t for t, _ in top] == [2, 1]


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="###").stop == ("###",)


def test_draws_follow_the_distribution_and_never_a_masked_token():
    # probabilities 0.5 / 0.3 / 0.2 on three tokens, every other token masked (-inf),
    # spread over a real vocabulary's width: 4000 seeded draws land within 3.5 sigma
    vocab = 49152
    logits = torch.full((1, vocab), float("-inf"))
    support = {17: 0.5, 30000: 0.3, vocab - 1: 0.2}
    for tok, p in support.items():
        logits[0, tok] = torch.log(torch.tensor(p))
    counts = {}
    for seed in range(4000):
        t = Sampler()(logits.clone(), [row(seed, temperature=1.0)]).token_ids[0]
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(support)
    for tok, p in support.items():
        sigma = (4000 * p * (1 - p)) ** 0.5
        assert abs(counts.get(tok, 0) - 4000 * p) < 3.5 * sigma, counts


@pytest.mark.parametrize("peak", [0.2, 1.0, 5.0])  # temperature-like spread of the logits
def test_the_cpu_head_filter_equals_the_whole_sort(peak):
    from worker.engine.sampling import _filter_head, _filter_sorted

    g = torch.Generator().manual_seed(int(peak * 10))
    probs = torch.softmax(torch.randn(24, 3000, generator=g) / peak, dim=-1)
    knobs = []
    for i in range(24):
        top_k = [0, 1, 5, 40, 64, 65, 200][i % 7]
        top_p = [1.0, 0.9, 0.5, 0.99][i % 4]
        min_p = [0.0, 0.0, 0.05, 0.3][(i // 4) % 4]
        knobs.append((0.7, float(top_k), top_p, min_p, 0.5))
    knobs = torch.tensor(knobs, dtype=torch.float64)
    decided = 0
    for i in range(24):  # row by row: a batch falls back whole when one row cannot decide
        head = _filter_head(probs[i:i + 1], knobs[i:i + 1])
        if head is not None:
            decided += 1
            assert torch.equal(head > 0, _filter_sorted(probs[i:i + 1], knobs[i:i + 1]) > 0), i
    assert decided >= (12 if peak < 1 else 4)  # peaked rows decide from their head
