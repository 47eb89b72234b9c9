"""Engine throughput against HF transformers generate(), same machine, same model, one run.

1. Batch 1, greedy, N new tokens: decode tokens/s of both, and the memory bandwidth that
   rate implies (weight bytes x tokens/s) next to this machine's measured copy bandwidth.
2. Mixed workload: requests with mixed prompt lengths and max_new_tokens arriving at once:
   our engine (continuous batching) vs HF generate in static batches of 8 with left padding,
   in arrival order (a batch runs until its longest request is done). Only the tokens each
   request asked for are counted, for both.
Rounds alternate between the two sides so machine noise hits both alike.

    python bench/engine_throughput.py [--quick] [--json] [--no-record]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, table  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402
from worker.engine.sequence import GenerationRequest  # noqa: E402
from worker.models.loader import resolve_model_dir  # noqa: E402

TEXT = (
    "The river wound through the valley, past orchards and stone bridges, carrying the "
    "spring melt down from the mountains toward the sea. Farmers along its banks had "
    "learned to read its moods: the color of the water in April, the height of the reeds "
    "in June, the way the fog settled in the mornings of late autumn. Engineers came later "
    "with surveys and concrete, promising dams and canals, power for the towns and water "
    "for the fields. Some of those promises were kept. "
)


def copy_bandwidth_gbs(mb: int = 256, reps: int = 5) -> float:
    """Read + write bytes per second of a large tensor copy (the machine's practical ceiling)."""
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- batch 1 -------------------------------------------------------------------------------

def ours_b1(engine: LLMEngine, ids: list[int], n: int) -> float:
    """Decode seconds per token (the prefill step excluded)."""
    engine.add_request(GenerationRequest(ids, SamplingParams(max_new_tokens=n, temperature=0,
                                                             ignore_eos=True)))
    engine.step()  # prefill + first token
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return (time.perf_counter() - t) / (n - 1)


@torch.no_grad()
def hf_b1(hf, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    prefill = _timed(lambda: hf.generate(x, max_new_tokens=1, do_sample=False))
    total = _timed(lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False))
    return (total - prefill) / (n - 1)


# --- mixed workload ----------------------------------------------------------------------------

def mixed_workload(token_pool: list[int], count: int, prompt_range, new_range, seed=0):
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        plen = rng.randint(*prompt_range)
        start = rng.randrange(0, len(token_pool) - plen)
        work.append((token_pool[start:start + plen], rng.randint(*new_range)))
    return work


def ours_mixed(engine: LLMEngine, work) -> float:
    reqs = [GenerationRequest(ids, SamplingParams(max_new_tokens=n, temperature=0,
                                                  ignore_eos=True)) for ids, n in work]
    t = time.perf_counter()
    out = engine.generate(reqs)
    elapsed = time.perf_counter() - t
    assert sum(o.completion_tokens for o in out.values()) == sum(n for _, n in work)
    return elapsed


@torch.no_grad()
def hf_mixed(hf, pad_id: int, work, batch_size: int = 8) -> float:
    t = time.perf_counter()
    for i in range(0, len(work), batch_size):
        chunk = work[i:i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (ids, _) in enumerate(chunk):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        longest = max(n for _, n in chunk)
        hf.generate(input_ids, attention_mask=mask, max_new_tokens=longest,
                    min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    quick = args.quick
    b1_tokens = 32 if quick else 128
    rounds = args.rounds or (1 if quick else 3)
    mixed_count, prompt_range, new_range = (8, (32, 256), (16, 64)) if quick else (
        32, (32, 512), (16, 256))

    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(None, progress=False)
    engine = LLMEngine(EngineConfig(progress=False))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = engine.tokenizer
    pool = tok(TEXT * 40, add_special_tokens=False)["input_ids"]
    prompt = engine.encode_prompt([{"role": "user", "content": "Tell me a story about a dragon."}])
    bw = copy_bandwidth_gbs()
    wbytes = weight_bytes(engine.model)

    # warm both sides (first calls allocate)
    ours_b1(engine, prompt, 4)
    hf_b1(hf, prompt, 4)
    b1_ours, b1_hf = [], []
    for _ in range(rounds):
        b1_ours.append(ours_b1(engine, prompt, b1_tokens))
        b1_hf.append(hf_b1(hf, prompt, b1_tokens))
    s_ours, s_hf = statistics.median(b1_ours), statistics.median(b1_hf)

    work = mixed_workload(pool, mixed_count, prompt_range, new_range)
    useful = sum(n for _, n in work)
    mixed_ours, mixed_hf = [], []
    for _ in range(1 if quick else min(rounds, 2)):
        mixed_ours.append(ours_mixed(engine, work))
        mixed_hf.append(hf_mixed(hf, tok.pad_token_id or 0, work))
    m_ours, m_hf = min(mixed_ours), min(mixed_hf)

    fig = {
        "b1_ours_tok_s": 1 / s_ours, "b1_hf_tok_s": 1 / s_hf,
        "b1_ours_ms_per_token": s_ours * 1e3, "b1_hf_ms_per_token": s_hf * 1e3,
        "b1_ours_gb_s": wbytes / s_ours / 1e9, "b1_hf_gb_s": wbytes / s_hf / 1e9,
        "copy_bandwidth_gb_s": bw, "weight_mb": wbytes / 1e6,
        "ratio_b1_vs_hf": s_hf / s_ours,
        "mixed_requests": mixed_count, "mixed_output_tokens": useful,
        "mixed_ours_tok_s": useful / m_ours, "mixed_hf_tok_s": useful / m_hf,
        "ratio_mixed_vs_hf": m_hf / m_ours,
        "preemptions": engine.stats().preemptions,
    }
    rows = [
        ["batch 1 decode", f"{b1_tokens} new tokens", fig["b1_ours_tok_s"], fig["b1_hf_tok_s"],
         fig["ratio_b1_vs_hf"]],
        ["mixed", f"{mixed_count} requests, prompts {prompt_range[0]}-{prompt_range[1]}, "
         f"new {new_range[0]}-{new_range[1]}", fig["mixed_ours_tok_s"], fig["mixed_hf_tok_s"],
         fig["ratio_mixed_vs_hf"]],
    ]
    body = table(["workload", "shape", "rayguide tok/s", "HF generate tok/s", "ratio"], rows)
    body += (f"\n\nBatch 1: rayguide {fig['b1_ours_ms_per_token']:.1f} ms/token = "
             f"{fig['b1_ours_gb_s']:.1f} GB/s of weights read, HF "
             f"{fig['b1_hf_ms_per_token']:.1f} ms/token = {fig['b1_hf_gb_s']:.1f} GB/s; "
             f"weights {fig['weight_mb']:.0f} MB; measured copy bandwidth (read + write) "
             f"{bw:.1f} GB/s. HF mixed runs static batches of 8 with left padding.")
    finish("engine_throughput", body, fig, args)


if __name__ == "__main__":
    main()
