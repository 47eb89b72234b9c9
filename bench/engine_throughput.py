"""Engine throughput against HF transformers generate(), same machine, same model, one run.

1. Batch 1, greedy, N new tokens: decode tokens/s of both, and the memory bandwidth that
   rate implies (weight bytes x tokens/s) next to this machine's measured copy bandwidth.
2. Mixed workload: requests with mixed prompt lengths and max_new_tokens arriving at once:
   our engine (continuous batching) vs HF generate in static batches of 8 with left padding,
   in arrival order (a batch runs until its longest request is done). Only the tokens each
   request asked for are counted, for both.
   The same workload sampled (temperature 0.8) on both sides, and the time to draw one
   step's tokens for that many rows, against the per-row exponential race used before.
3. Long-prompt prefill: the time to the first token of one long prompt (6,000 tokens;
   ``--quick`` 3,000), ours (chunked prefill through the paged KV cache) against one HF
   forward pass over the whole prompt (``generate`` with one new token).
4. The same with weight-only int8 Linear layers (``EngineConfig.dtype="int8"``): batch-1
   decode and the mixed workload against the same HF fp32 figures, and quality: top-1
   agreement of int8's greedy next token with fp32's, teacher-forced over a few thousand
   tokens of this repository's docs.
Rounds alternate between the two sides so machine noise hits both alike. ``--quick`` keeps
the mixed workload's shape (request count, length ranges, static batches of 8 for HF) scaled
down by QUICK_SCALE, so its ratio measures the same thing on less work.

    python bench/engine_throughput.py [--quick | --smoke] [--json] [--no-record] [--no-int8]

``--smoke``: both sides on the tiny random-weight model, a few short requests, no llama.cpp.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, table, tiny_model  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402
from core.request import GenerationRequest  # noqa: E402
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
    """Bytes a batch-1 step reads: parameters and buffers (int8 weights are buffers),
    without the tied embedding table when a separate logits projection exists (the lookup
    reads only the step's rows)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if getattr(model, "quantization", None):
        tensors = [t for t in tensors if t is not model.embed_tokens.weight]
    return sum(t.numel() * t.element_size() for t in tensors)


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


def ours_prefill(engine: LLMEngine, ids: list[int]) -> float:
    """Seconds to the first token of one prompt (every prefill chunk, then one token)."""
    engine.add_request(GenerationRequest(ids, SamplingParams(max_new_tokens=1, temperature=0,
                                                             ignore_eos=True)))
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t


@torch.no_grad()
def hf_prefill(hf, ids: list[int]) -> float:
    return _timed(lambda: hf.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False))


# --- mixed workload ----------------------------------------------------------------------------

def mixed_workload(token_pool: list[int], count: int, prompt_range, new_range, seed=0):
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        plen = rng.randint(*prompt_range)
        start = rng.randrange(0, len(token_pool) - plen)
        work.append((token_pool[start:start + plen], rng.randint(*new_range)))
    return work


def ours_mixed(engine: LLMEngine, work, temperature: float = 0.0) -> float:
    reqs = [GenerationRequest(ids, SamplingParams(max_new_tokens=n, temperature=temperature,
                                                  seed=i, ignore_eos=True))
            for i, (ids, n) in enumerate(work)]
    t = time.perf_counter()
    out = engine.generate(reqs)
    elapsed = time.perf_counter() - t
    assert sum(o.completion_tokens for o in out.values()) == sum(n for _, n in work)
    return elapsed


@torch.no_grad()
def hf_mixed(hf, pad_id: int, work, batch_size: int = 8, temperature: float = 0.0) -> float:
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
        if temperature else {"do_sample": False}
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
                    min_new_tokens=longest, pad_token_id=pad_id, **sample)
    return time.perf_counter() - t


def draw_ms(rows: int, vocab: int, reps: int = 20) -> tuple[float, float]:
    """ms per step to draw one token for each of ``rows`` sampled rows: the engine's
    inverse-CDF draw (sampling._draw) and the per-row exponential race it replaced (argmax
    p / E with E ~ Exp(1) drawn per vocabulary entry), on the same probabilities."""
    from worker.engine.sampling import _draw

    probs = torch.softmax(torch.randn(rows, vocab) / 0.8, dim=-1)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]

    def race():
        for j in range(rows):
            noise = torch.empty_like(probs[j]).exponential_(generator=gens[j])
            (probs[j] / noise.clamp_min_(1e-30)).argmax()

    def ours():  # each row's uniform from its own generator, as SamplingPlan.build draws it
        u = torch.tensor([torch.rand((), generator=g, dtype=torch.float64).item() for g in gens],
                         dtype=torch.float64)
        _draw(probs, u)

    out = []
    for fn in (ours, race):
        fn()
        out.append(min(_timed(fn) for _ in range(reps)) * 1e3)
    return out[0], out[1]


# The full mixed workload; --quick scales count and lengths by QUICK_SCALE (4 HF batches
# of 8 become 2, every length range halves), keeping the proportions that decide the ratio.
MIXED_COUNT, MIXED_PROMPTS, MIXED_NEW = 32, (32, 512), (16, 256)
PREFILL_TOKENS = 6000
QUICK_SCALE = 0.5
SMOKE_SCALE = 0.125
QUALITY_TOKENS = 3000
SAMPLED_TEMPERATURE = 0.8


def quality_ids(tok) -> list[int]:
    """A few thousand tokens of real text: this repository's README and docs."""
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join((root / f).read_text() for f in ("README.md", "docs/architecture.md"))
    return tok(text, add_special_tokens=False)["input_ids"][:QUALITY_TOKENS]


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 engine")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both sides (default: torch's); 1 on a busy machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    smoke = args.smoke
    quick = args.quick or smoke
    b1_tokens = 8 if smoke else 32 if quick else 128
    rounds = args.rounds or (1 if quick else 3)
    scale = SMOKE_SCALE if smoke else QUICK_SCALE if quick else 1.0
    mixed_count = int(MIXED_COUNT * scale)
    prompt_range = tuple(int(v * scale) for v in MIXED_PROMPTS)
    new_range = tuple(int(v * scale) for v in MIXED_NEW)

    from transformers import AutoModelForCausalLM

    model_dir = (tiny_model() if smoke
                 else resolve_model_dir(None, progress=False))
    # smoke: a small KV cache too (the default one takes seconds to allocate)
    model = {"model": str(model_dir), "num_kv_blocks": 256} if smoke else {}
    # the same prompts run again and again here: prefix caching (measured by
    # bench/prefix_cache.py) would turn their prefill into cache hits
    engine = LLMEngine(EngineConfig(progress=False, num_threads=args.threads,
                                    prefix_caching=False, **model))
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
    preemptions = engine.stats().preemptions
    # the same workload sampled (temperature 0.8, no top-k / top-p) on both sides
    ms_ours = ours_mixed(engine, work, SAMPLED_TEMPERATURE)
    ms_hf = hf_mixed(hf, tok.pad_token_id or 0, work, temperature=SAMPLED_TEMPERATURE)
    draw_new, draw_race = draw_ms(mixed_count, engine.model.config.vocab_size)
    long_ids = (pool * (1 + PREFILL_TOKENS // len(pool)))[:int(PREFILL_TOKENS * scale)]
    ours_prefill(engine, long_ids[:64])  # warm
    pf_ours = min(ours_prefill(engine, long_ids) for _ in range(1 if quick else 2))
    pf_hf = min(hf_prefill(hf, long_ids) for _ in range(1 if quick else 2))

    q = None
    if not args.no_int8:
        from worker.models.quant import top1_agreement

        fp32_model = engine.model
        del engine  # one engine's KV cache at a time
        qengine = LLMEngine(EngineConfig(progress=False, dtype="int8", prefix_caching=False,
                                         num_threads=args.threads, **model))
        qbytes = weight_bytes(qengine.model)
        ours_b1(qengine, prompt, 4)
        b1_q = [ours_b1(qengine, prompt, b1_tokens) for _ in range(rounds)]
        mixed_q = [ours_mixed(qengine, work) for _ in range(1 if quick else min(rounds, 2))]
        ids = quality_ids(tok)[: 64 if smoke else 512 if quick else QUALITY_TOKENS]
        agreement = top1_agreement(fp32_model, qengine.model, ids)
        s_q, m_q = statistics.median(b1_q), min(mixed_q)
        q = dict(s=s_q, m=m_q, bytes=qbytes, agreement=agreement, tokens=len(ids))
        from bench import llamacpp_side

        if llamacpp_side.available() and not smoke:  # same prompt, same thread count, side by side
            from worker.models.gguf_convert import default_gguf_path

            q4 = default_gguf_path()
            q8 = llamacpp_side.q8_0_from(q4, Path.home() / ".cache" / "rayguide" / "llamacpp")
            threads = torch.get_num_threads()
            q["llamacpp"] = {name: llamacpp_side.decode_s_per_token(path, prompt, b1_tokens,
                                                                    threads)
                             for name, path in (("q8_0", q8), ("q4_1", q4))}

    fig = {
        "b1_ours_tok_s": 1 / s_ours, "b1_hf_tok_s": 1 / s_hf,
        "b1_ours_ms_per_token": s_ours * 1e3, "b1_hf_ms_per_token": s_hf * 1e3,
        "b1_ours_gb_s": wbytes / s_ours / 1e9, "b1_hf_gb_s": wbytes / s_hf / 1e9,
        "copy_bandwidth_gb_s": bw, "weight_mb": wbytes / 1e6,
        "ratio_b1_vs_hf": s_hf / s_ours,
        "mixed_requests": mixed_count, "mixed_output_tokens": useful,
        "mixed_ours_tok_s": useful / m_ours, "mixed_hf_tok_s": useful / m_hf,
        "ratio_mixed_vs_hf": m_hf / m_ours,
        "preemptions": preemptions,
        "mixed_sampled_ours_tok_s": useful / ms_ours, "mixed_sampled_hf_tok_s": useful / ms_hf,
        "ratio_mixed_sampled_vs_hf": ms_hf / ms_ours,
        "prefill_tokens": len(long_ids), "prefill_ours_s": pf_ours, "prefill_hf_s": pf_hf,
        "ratio_prefill_vs_hf": pf_hf / pf_ours,
        "draw_ms_per_step": draw_new, "draw_ms_per_step_exponential_race": draw_race,
    }
    if q:
        fig.update({
            "quant_b1_tok_s": 1 / q["s"], "quant_b1_ms_per_token": q["s"] * 1e3,
            "quant_b1_gb_s": q["bytes"] / q["s"] / 1e9, "quant_weight_mb": q["bytes"] / 1e6,
            "ratio_quant_b1_vs_hf": s_hf / q["s"], "ratio_quant_b1_vs_fp32": s_ours / q["s"],
            "quant_mixed_tok_s": useful / q["m"], "ratio_quant_mixed_vs_hf": m_hf / q["m"],
            "quant_top1_agreement": q["agreement"], "quant_top1_tokens": q["tokens"],
        })
        for name, s_lc in q.get("llamacpp", {}).items():
            fig[f"llamacpp_{name}_b1_tok_s"] = 1 / s_lc
            # > 1: llama.cpp is faster; the goal is at most 1.25
            fig[f"llamacpp_{name}_vs_quant_b1"] = q["s"] / s_lc
    rows = [
        ["batch 1 decode", f"{b1_tokens} new tokens", fig["b1_ours_tok_s"], fig["b1_hf_tok_s"],
         fig["ratio_b1_vs_hf"]],
        ["mixed", f"{mixed_count} requests, prompts {prompt_range[0]}-{prompt_range[1]}, "
         f"new {new_range[0]}-{new_range[1]}", fig["mixed_ours_tok_s"], fig["mixed_hf_tok_s"],
         fig["ratio_mixed_vs_hf"]],
        [f"mixed, sampled (temperature {SAMPLED_TEMPERATURE:g})", "same as mixed",
         fig["mixed_sampled_ours_tok_s"], fig["mixed_sampled_hf_tok_s"],
         fig["ratio_mixed_sampled_vs_hf"]],
        ["long-prompt prefill (time to first token)", f"{len(long_ids)}-token prompt",
         len(long_ids) / pf_ours, len(long_ids) / pf_hf, fig["ratio_prefill_vs_hf"]],
    ]
    if q:
        rows += [
            ["batch 1 decode, int8 weights", f"{b1_tokens} new tokens", fig["quant_b1_tok_s"],
             fig["b1_hf_tok_s"], fig["ratio_quant_b1_vs_hf"]],
            ["mixed, int8 weights", "same as mixed", fig["quant_mixed_tok_s"],
             fig["mixed_hf_tok_s"], fig["ratio_quant_mixed_vs_hf"]],
        ]
        for name, s_lc in q.get("llamacpp", {}).items():
            rows.append([f"batch 1 decode, llama.cpp {name.upper()}", f"{b1_tokens} new tokens",
                         1 / s_lc, fig["b1_hf_tok_s"], fig["b1_hf_ms_per_token"] / 1e3 / s_lc])
    body = table(["workload", "shape", "rayguide tok/s", "HF generate (fp32) tok/s", "ratio"],
                 rows)
    body += (f"\n\nBatch 1: rayguide {fig['b1_ours_ms_per_token']:.1f} ms/token = "
             f"{fig['b1_ours_gb_s']:.1f} GB/s of weights read, HF "
             f"{fig['b1_hf_ms_per_token']:.1f} ms/token = {fig['b1_hf_gb_s']:.1f} GB/s; "
             f"weights {fig['weight_mb']:.0f} MB; measured copy bandwidth (read + write) "
             f"{bw:.1f} GB/s. HF mixed runs static batches of 8 with left padding. "
             f"Drawing {mixed_count} sampled rows' tokens: {draw_new:.2f} ms per step "
             f"(inverse CDF) against {draw_race:.2f} ms for the per-row exponential race "
             "the engine used before.")
    if q:
        body += (f" int8: {fig['quant_b1_ms_per_token']:.1f} ms/token = "
                 f"{fig['quant_b1_gb_s']:.1f} GB/s of {fig['quant_weight_mb']:.0f} MB read per "
                 f"step; top-1 agreement with fp32 {100 * q['agreement']:.2f}% over "
                 f"{q['tokens']} teacher-forced tokens of README + docs/architecture.md.")
    finish("engine_throughput", body, fig, args)


if __name__ == "__main__":
    main()
