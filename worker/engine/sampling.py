"""The per-step sampling inputs and the batch sampler. ``SamplingParams`` lives in
params.py (no torch there, for front ends) and is re-exported here.

``ARSamplingStrategy`` builds each step's ``SamplingInputs``: one row per sampling
sequence, and its ``row_matchers`` (the matcher that masks the row this step, from the
request's guided part; None for a row not masked). ``Sampler`` turns the rows' logits
into tokens: the logits processor (penalties, grammar mask) first, then greedy rows
by argmax, then temperature, top-k, min-p and top-p, then one draw per row from the row's
own generator (so a seeded request gives the same tokens whatever shares its batch), by
inverting the row's cumulative distribution (``_draw``). Every tensor stays on the logits'
device: the host's per-row choices go there as one tensor, and the step's results come
back in one copy (``sample_on_device`` is the device part, tested for device mixing on the
meta device by tests/engine/test_device_step_unit.py).

A temperature below ``TEMPERATURE_FLOOR`` is greedy: dividing logits by 1e-40 overflows
them to inf and the softmax to NaN, which can pick any token, a masked one included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.params import MAX_LOGPROBS, TEMPERATURE_FLOOR, SamplingParams

__all__ = ["MAX_LOGPROBS", "TEMPERATURE_FLOOR", "SamplingParams", "SamplingRow",
           "SamplingInputs", "ARSamplingStrategy", "SampleResult", "Sampler", "SamplingPlan",
           "sample_on_device", "apply_penalties"]


@dataclass
class SamplingRow:
    """What the sampler needs of one sampling sequence."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class SamplingInputs:
    rows: list[SamplingRow]
    # per row: the matcher that masks it this step (GuidedRequest.mask_matcher), else None
    row_matchers: list


class ARSamplingStrategy:
    """Builds SamplingInputs for autoregressive decoding."""

    def make_sampling_inputs(self, seqs) -> SamplingInputs:
        """One row per sequence, in order; a row its grammar masks carries the matcher."""
        rows = [SamplingRow(s.params, s.generator, s.prompt_ids,
                            s.token_ids[s.num_prompt:len(s.token_ids) - s.draft])
                for s in seqs]  # a draft in place (speculation) is not output yet
        matchers = [s.guide.mask_matcher if s.guide is not None else None for s in seqs]
        return SamplingInputs(rows, matchers)


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: None, or (chosen token's logprob, [(token_id, logprob)] top-n)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)


class Sampler:
    """Turns a step's logits into tokens with every tensor on the logits' device and one
    device-to-host copy of the step's results (tokens, chosen logprobs, top logprobs).

    What the host prepares per row (temperature, top-k, top-p, min-p and the row's uniform
    number from its own CPU generator) travels to the device as one tensor; greedy rows
    take an argmax, sampled rows are filtered and drawn together (``sample_on_device``)."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 processor=None) -> SampleResult:
        """logits: [R, V] fp32, one row per entry of ``rows``; modified in place.
        ``processor(logits)`` (penalties, grammar mask) runs after the raw logprobs are
        taken; without one, penalties alone are applied. Logprobs are of the model's raw
        distribution."""
        plan = SamplingPlan.build(rows, logits.device)
        packed = sample_on_device(logits, plan, processor)
        host = packed.cpu().tolist()  # the step's one device-to-host copy
        token_ids = [int(r[0]) for r in host]
        if processor is not None and hasattr(processor, "guard"):
            token_ids = processor.guard(token_ids, logits)
        logprobs: list = [None] * len(rows)
        k = plan.top_logprobs
        for i in plan.logprob_rows:
            r = host[i]
            n = rows[i].params.logprobs
            chosen = r[1]
            if token_ids[i] != int(r[0]):  # the guard replaced the token: its own logprob
                chosen = float(plan.raw_logprobs[i, token_ids[i]])
            top = [(int(r[2 + j]), r[2 + k + j]) for j in range(n)]
            logprobs[i] = (chosen, top)
        return SampleResult(token_ids, logprobs)


@dataclass
class SamplingPlan:
    """One step's sampling choices as tensors on the logits' device.

    random_idx: [S] int64, the rows that sample (the others are greedy);
    knobs: [S, 5] float64 per sampling row: temperature, top_k (0: off), top_p, min_p,
        and u, the row's uniform number in [0, 1) from its own CPU generator;
    filters: whether any sampling row sets top-k, top-p or min-p (host-known);
    logprob_rows: rows that asked for logprobs; top_logprobs: the most any asked for."""

    random_idx: torch.Tensor | None
    knobs: torch.Tensor | None
    filters: bool
    logprob_rows: list[int]
    top_logprobs: int
    rows: list[SamplingRow]
    raw_logprobs: torch.Tensor | None = None  # [R, V], set by sample_on_device

    @classmethod
    def build(cls, rows: list[SamplingRow], device) -> "SamplingPlan":
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        idx = knobs = None
        filters = False
        if random_rows:
            table = []
            for i in random_rows:
                p = rows[i].params
                u = torch.rand((), generator=rows[i].generator, dtype=torch.float64).item()
                top_k = p.top_k if p.top_k > 0 else 0
                filters = filters or top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
                table.append((float(i), p.temperature, float(top_k), p.top_p, p.min_p, u))
            host = torch.tensor(table, dtype=torch.float64)
            if device.type == "cuda":
                host = host.pin_memory()
            on_device = host.to(device, non_blocking=True)  # the step's one host-to-device copy
            idx = on_device[:, 0].long()
            knobs = on_device[:, 1:]
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        top = max((rows[i].params.logprobs for i in want), default=0)
        return cls(idx, knobs, filters, want, top, rows)


def sample_on_device(logits: torch.Tensor, plan: SamplingPlan, processor=None) -> torch.Tensor:
    """The device part of a step's sampling: no host sync, no tensor from another device.

    Returns packed [R, 2 + 2K] float64 (K = plan.top_logprobs): per row the token id, its
    raw logprob, the top-K ids, then their logprobs (token ids are exact in float64)."""
    rows = plan.rows
    if plan.logprob_rows:
        plan.raw_logprobs = torch.log_softmax(logits, dim=-1)
    if processor is not None:
        processor(logits)
    else:
        apply_penalties(logits, rows)
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    tokens = logits.argmax(dim=-1)  # [R]
    if plan.random_idx is not None:
        sub = logits.index_select(0, plan.random_idx)  # [S, V]
        knobs = plan.knobs
        sub = sub / knobs[:, 0:1].to(sub.dtype)
        probs = torch.softmax(sub, dim=-1)
        if plan.filters:
            probs = _filter(probs, knobs)
        tokens.index_copy_(0, plan.random_idx, _draw(probs, knobs[:, 4]))
    k = plan.top_logprobs
    packed = torch.zeros(logits.shape[0], 2 + 2 * k, dtype=torch.float64, device=logits.device)
    packed[:, 0] = tokens.to(torch.float64)
    if plan.raw_logprobs is not None:
        lp = plan.raw_logprobs
        packed[:, 1] = lp.gather(1, tokens[:, None]).squeeze(1).to(torch.float64)
        if k:
            vals, ids = lp.topk(k, dim=-1)
            packed[:, 2:2 + k] = ids.to(torch.float64)
            packed[:, 2 + k:] = vals.to(torch.float64)
    return packed


def _filter(probs: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """Top-k, min-p, then top-p over [S, V] probabilities, each row by its own knobs (a
    row that sets none keeps everything). Returns the kept probabilities (unnormalized).

    In each row's descending order: top-k keeps the tokens at least as likely as the k-th
    (ties kept); min-p keeps those at least min_p times the most likely; top-p drops a
    token when the kept mass before it already reaches top_p of the kept total (so at
    least one token stays)."""
    if probs.device.type == "cpu":  # the host can look before it sorts
        kept = _filter_head(probs, knobs)
        if kept is not None:
            return kept
    return _filter_sorted(probs, knobs)


def _filter_sorted(probs: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """``_filter`` over each whole row's descending order (no host sync: the device's way)."""
    top_k, top_p, min_p = knobs[:, 1], knobs[:, 2], knobs[:, 3]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    kth = torch.where(top_k > 0, top_k, float(vocab)).clamp(max=vocab).long() - 1
    keep = sorted_p >= sorted_p.gather(1, kth[:, None])
    keep &= sorted_p >= (min_p[:, None] * sorted_p[:, :1]).to(sorted_p.dtype)
    kept = sorted_p * keep
    before = kept.cumsum(dim=-1) - kept
    nucleus = before < (top_p[:, None] * kept.sum(dim=-1, keepdim=True)).to(kept.dtype)
    keep &= nucleus | (top_p >= 1.0)[:, None]  # summation order never drops a tail token
    keep_unsorted = torch.empty_like(keep).scatter_(1, order, keep)
    return probs * keep_unsorted


# the most likely tokens the CPU looks at before sorting a whole row
HEAD = 64


def _filter_head(probs: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor | None:
    """``_filter`` from each row's ``HEAD`` most likely tokens, where that decides it: the
    kept tokens are a prefix of the descending order, so when every row's prefix ends
    inside its head, the rest of the row is dropped whatever it holds (a sort of 49,152
    probabilities costs milliseconds on a CPU core; the head, tens of microseconds). The
    nucleus needs the kept total: the whole row's sum when neither top-k nor min-p cut,
    else the head's kept sum. None where a row's prefix may reach past its head."""
    vocab = probs.shape[-1]
    if vocab <= HEAD:
        return None
    top_k, top_p, min_p = knobs[:, 1], knobs[:, 2], knobs[:, 3]
    head, order = probs.topk(HEAD, dim=-1)  # descending
    kth = torch.where((top_k > 0) & (top_k <= HEAD), top_k, float(HEAD)).long() - 1
    keep = head >= head.gather(1, kth[:, None])
    keep &= head >= (min_p[:, None] * head[:, :1]).to(head.dtype)
    cut = ~keep[:, -1] | ((top_k > 0) & (top_k < HEAD))
    if ((min_p > 0) & ~cut).any() or ((top_k > HEAD) & (top_p < 1.0)).any():
        return None  # a kept total that reaches past the head
    kept = head * keep
    total = torch.where(cut, kept.sum(dim=-1), probs.sum(dim=-1))
    before = kept.cumsum(dim=-1) - kept
    nucleus = before < (top_p * total).to(kept.dtype)[:, None]
    keep &= nucleus | (top_p >= 1.0)[:, None]
    if keep[:, -1].any():
        return None
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, keep)
    return probs * mask


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [S, V], by inverting the row's cumulative
    distribution at ``u`` [S] (uniform in [0, 1), drawn on the host from the row's own
    generator: a seeded request gets the same token whatever its batch or device). The
    sums run in float64; a token of zero probability is never drawn (its cumulative sum
    equals its predecessor's and the search takes the first sum strictly above the point,
    which lies in [0, total))."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1]
    point = torch.minimum(u.to(torch.float64) * total,
                          torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, point[:, None], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)  # a NaN row: the guard catches it


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (HF: over prompt and output), presence and frequency (OpenAI: over the
    output) penalties for the rows that set them, in a few batched ops on the logits'
    device (index tensors built on the host)."""
    rep_rows, rep_ids, rep_vals = [], [], []
    sub_rows, sub_ids, sub_vals = [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = set(r.prompt_ids) | set(r.output_ids)
            rep_rows += [i] * len(seen)
            rep_ids += seen
            rep_vals += [p.repetition_penalty] * len(seen)
        if r.output_ids and (p.presence_penalty or p.frequency_penalty):
            counts: dict[int, int] = {}
            for t in r.output_ids:
                counts[t] = counts.get(t, 0) + 1
            sub_rows += [i] * len(counts)
            sub_ids += counts
            sub_vals += [p.presence_penalty + p.frequency_penalty * c for c in counts.values()]
    dev = logits.device
    if rep_rows:
        at = (torch.tensor(rep_rows, device=dev), torch.tensor(rep_ids, device=dev))
        vals = logits[at]
        pen = torch.tensor(rep_vals, dtype=logits.dtype, device=dev)
        logits[at] = torch.where(vals > 0, vals / pen, vals * pen)
    if sub_rows:
        at = (torch.tensor(sub_rows, device=dev), torch.tensor(sub_ids, device=dev))
        logits.index_put_(at, -torch.tensor(sub_vals, dtype=logits.dtype, device=dev),
                          accumulate=True)
