"""The per-step sampling inputs and the batch sampler. ``SamplingParams`` lives in
params.py (no torch there, for front ends) and is re-exported here.

``ARSamplingStrategy`` builds each step's ``SamplingInputs``: one row per sampling sequence and its ``matcher_keys`` (the grammar
matcher key of a guided row, None for an unguided one). ``Sampler`` turns the rows'
logits into tokens: the logits processor (penalties, grammar mask) first, then greedy rows
by argmax, then temperature, top-k, min-p and top-p, then one draw per row from the row's
own generator (so a seeded request gives the same tokens whatever shares its batch), by
inverting the row's cumulative distribution (``_draw``).

A temperature below ``TEMPERATURE_FLOOR`` is greedy: dividing logits by 1e-40 overflows
them to inf and the softmax to NaN, which can pick any token, a masked one included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.params import MAX_LOGPROBS, TEMPERATURE_FLOOR, SamplingParams

__all__ = ["MAX_LOGPROBS", "TEMPERATURE_FLOOR", "SamplingParams", "SamplingRow",
           "SamplingInputs", "ARSamplingStrategy", "SampleResult", "Sampler", "apply_penalties"]


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
    # per row: the grammar matcher's key (Sequence.matcher_key) if guided, else None
    matcher_keys: list[tuple[str, int] | None]


class ARSamplingStrategy:
    """Builds SamplingInputs for autoregressive decoding."""

    def make_sampling_inputs(self, seqs) -> SamplingInputs:
        """One row per sequence, in order; guided rows carry their matcher key."""
        rows = [SamplingRow(s.params, s.generator, s.prompt_ids, s.output_ids) for s in seqs]
        keys = [s.matcher_key if s.guided_now else None for s in seqs]
        return SamplingInputs(rows, keys)


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: None, or (chosen token's logprob, [(token_id, logprob)] top-n)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 processor=None) -> SampleResult:
        """logits: [R, V] fp32, one row per entry of ``rows``; modified in place.
        ``processor(logits)`` (penalties, grammar mask) runs after the raw logprobs are
        taken; without one, penalties alone are applied. Logprobs are of the model's raw
        distribution."""
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if processor is not None:
            processor(logits)
        else:
            apply_penalties(logits, rows)
            torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            sub = logits[idx]
            temps = torch.tensor([rows[i].params.temperature for i in random_rows])
            sub = _filter(sub / temps[:, None], [rows[i].params for i in random_rows])
            tokens[idx] = _draw(torch.softmax(sub, dim=-1),
                                [rows[i].generator for i in random_rows])
        token_ids = tokens.tolist()
        if processor is not None and hasattr(processor, "guard"):
            token_ids = processor.guard(token_ids, logits)
        logprobs = [None] * len(rows)
        for i, r in enumerate(rows):
            if want_lp[i]:
                lp = raw_logprobs[i]
                top = []
                if r.params.logprobs:
                    vals, ids = lp.topk(r.params.logprobs)
                    top = list(zip(ids.tolist(), vals.tolist()))
                logprobs[i] = (float(lp[token_ids[i]]), top)
        return SampleResult(token_ids, logprobs)


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V], drawn by inverting the row's cumulative
    distribution at one uniform number from the row's own generator. The cumulative sums
    run in float64 over the whole batch at once, and each row costs one random number,
    not the V of an exponential race (argmax p / E), whose per-row draws dominated a
    sampled step on CPU (figures in docs/benchmarks.md). A token of
    zero probability (masked, filtered) is never drawn: its cumulative sum equals its
    predecessor's, and the search takes the first sum strictly above u, where u lies in
    [0, total)."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    total = cdf[:, -1]
    # u * total can round up to total itself: keep the point strictly below it
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, point[:, None], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)  # a NaN row: the guard catches it


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        if r.params.has_penalties:
            _apply_penalties(logits[i], r)


def _apply_penalties(row: torch.Tensor, r: SamplingRow) -> None:
    p = r.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if r.output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(r.output_ids).unique(return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Applies top-k, top-p and min-p per row (rows that set none are left as they are)."""
    need = [p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    if not any(need):
        return logits
    neg_inf = torch.finfo(logits.dtype).min
    for i, p in enumerate(params):
        if not need[i]:
            continue
        row = logits[i]
        if p.top_k > 0 and p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row.masked_fill_(row < kth, neg_inf)
        if p.min_p > 0.0:
            probs = torch.softmax(row, dim=-1)
            row.masked_fill_(probs < p.min_p * probs.max(), neg_inf)
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
            row[order[drop]] = neg_inf
    return logits
