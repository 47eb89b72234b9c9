"""Cost of guided decoding in the engine: guided (JSON schema) vs unguided, batch 1/8/32.

Same prompts, greedy. Guided and unguided outputs differ in length, so decode steps are
compared pairwise at the same step index (same context length) while every sequence of
both runs is still decoding (equal batch occupancy). Rounds alternate between the two
sides. Per guided step: bitmask fill time (on its thread, overlapping the forward), how
long the step still waited for it after the forward, mask apply time and accept time.
Also, at batch 1: HF transformers generate() with xgrammar's HF logits processor on the
same schema, what a user would otherwise run.

    python bench/guided_overhead.py [--quick | --smoke] [--json] [--no-record]
                                    [--dtype int8] [--closing-window N]

``--quick``: 2 rounds instead of 8, same budget (24 tokens: the schema's shortest output
is about 20, a smaller budget is refused). ``--smoke``: the tiny random-weight model,
batches 1 and 2, one round.

``--dtype int8`` runs the engine with int8 weights: shorter steps, so the mask's share of a
step is larger there; its table is recorded as its own section (guided_overhead_int8).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, table  # noqa: E402
from worker.models.tiny_model import build_tiny_model  # noqa: E402
from grammar_cache.spec import GrammarSpec  # noqa: E402
from worker.engine import bitmask  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402
from worker.engine.sequence import GenerationRequest  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "occupation": {"type": "string"},
        "biography": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "occupation", "biography", "skills"],
}
TOPICS = ["a sailor", "a chemist", "a painter", "a pilot", "a baker", "a poet", "a judge",
          "a miner"]


def prompts(n: int):
    return [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} number {i} "
              "as a JSON object with a long biography."}] for i in range(n)]


def run_side(engine: LLMEngine, batch: int, new_tokens: int, guided: bool):
    """Returns per decode step (index -> seconds) while all ``batch`` sequences decode,
    and the guided timings of those steps."""
    spec = GrammarSpec.json_schema(SCHEMA) if guided else None
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=not guided)
    for p in prompts(batch):
        engine.add_request(GenerationRequest(p, params, grammar=spec))
    running = engine.scheduler.running

    def all_decoding():
        return len(running) == batch and all(s.num_pending == 1 for s in running)

    def step():
        for out in engine.step():
            if out.finish_reason == "error":  # e.g. a budget below the schema's shortest
                raise SystemExit(f"a {'guided' if guided else 'plain'} request failed: "
                                 f"{out.error}")

    while engine.has_work() and not all_decoding():  # grammar compile + prefill
        step()
    steps, timings = [], []
    while engine.has_work():
        full = all_decoding()
        t = time.perf_counter()
        step()
        if full:
            steps.append(time.perf_counter() - t)
            timings.append(engine.last_timings)
        else:
            break
    while engine.has_work():
        step()
    return steps, timings


@torch.no_grad()
def hf_guided_b1(hf, tokenizer, engine: LLMEngine, new_tokens: int) -> float:
    """Seconds per decode token of HF generate() + xgrammar's HF logits processor."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf.config.vocab_size,
                                              stop_token_ids=sorted(engine.eos_ids))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA)
    ids = torch.tensor([engine.encode_prompt(prompts(1)[0])])

    def gen(n):
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, do_sample=False,
                          logits_processor=[LogitsProcessor(compiled)],
                          eos_token_id=sorted(engine.eos_ids), pad_token_id=0)
        return time.perf_counter() - t, out.shape[1] - ids.shape[1]

    prefill, _ = gen(1)
    total, produced = gen(new_tokens)
    return (total - prefill) / max(1, produced - 1)


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--dtype", default=None, choices=["fp32", "int8"],
                    help="engine weights (default fp32)")
    ap.add_argument("--closing-window", type=int, default=None,
                    help="the engine's closing_window (default: the engine's, 48). At the "
                         "bench's budget every guided step is inside the window, so the "
                         "closing search's steering is measured with the mask; 0 measures "
                         "the mask alone")
    args = ap.parse_args()
    batches = (1, 2) if args.smoke else (1, 8, 32)
    # many short rounds: this VM's speed drifts over minutes, so the sides alternate often
    new_tokens = 24
    rounds = 1 if args.smoke else 2 if args.quick else 8

    extra = {} if args.closing_window is None else {"closing_window": args.closing_window}
    if args.smoke:
        extra["model"] = str(build_tiny_model(tempfile.mkdtemp(prefix="rayguide-smoke-")))
    engine = LLMEngine(EngineConfig(progress=False, dtype=args.dtype, **extra))
    window = engine.config.closing_window
    bitmask.warmup()
    figures, rows = {}, []
    for batch in batches:
        run_side(engine, batch, new_tokens, guided=True)  # warm: compile, size buffers
        pairs, fill, wait, apply, accept = [], [], [], [], []
        for r in range(rounds):
            # alternate which side goes first, so drift within a round cancels out
            if r % 2 == 0:
                plain, _ = run_side(engine, batch, new_tokens, guided=False)
                guided, timings = run_side(engine, batch, new_tokens, guided=True)
            else:
                guided, timings = run_side(engine, batch, new_tokens, guided=True)
                plain, _ = run_side(engine, batch, new_tokens, guided=False)
            pairs += list(zip(plain, guided))
            fill += [t.fill_us for t in timings]
            wait += [t.fill_wait_us for t in timings]
            apply += [t.apply_us for t in timings]
            accept += [t.accept_us for t in timings]
        if not pairs:
            raise SystemExit(f"batch {batch}: no decode step had every sequence of both "
                             "sides decoding (all outputs ended too early to compare)")
        plain_s = statistics.median(p for p, _ in pairs)
        guided_s = statistics.median(g for _, g in pairs)
        ratio = plain_s / guided_s
        hidden = 1 - statistics.mean(wait) / max(statistics.mean(fill), 1e-9)
        figures[f"ratio_guided_b{batch}"] = ratio
        figures[f"unguided_tok_s_b{batch}"] = batch / plain_s
        figures[f"guided_tok_s_b{batch}"] = batch / guided_s
        figures[f"fill_us_b{batch}"] = statistics.mean(fill)
        figures[f"apply_us_b{batch}"] = statistics.mean(apply)
        figures[f"accept_us_b{batch}"] = statistics.mean(accept)
        figures[f"fill_hidden_b{batch}"] = hidden
        rows.append([batch, len(pairs), batch / plain_s, batch / guided_s, ratio,
                     statistics.mean(fill), statistics.mean(wait), f"{100 * hidden:.0f}%",
                     statistics.mean(apply), statistics.mean(accept)])
    figures["apply_us_per_row_b32"] = figures[f"apply_us_b{batches[-1]}"] / batches[-1]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        engine.model_dir, dtype=torch.float32).eval()
    hf_s = hf_guided_b1(hf, engine.tokenizer, engine, new_tokens)
    ours_b1 = 1 / figures["guided_tok_s_b1"]
    figures["hf_xgrammar_tok_s_b1"] = 1 / hf_s
    figures["ratio_guided_b1_vs_hf_xgrammar"] = hf_s / ours_b1

    body = table(["batch", "paired steps", "unguided tok/s", "guided tok/s", "ratio",
                  "fill us", "fill wait us", "fill hidden", "apply us", "accept us"], rows)
    body += (f"\n\nBatch 1 guided vs HF generate() + xgrammar HF logits processor (same schema):"
             f" rayguide {1 / ours_b1:.1f} tok/s, HF {1 / hf_s:.1f} tok/s, ratio "
             f"{figures['ratio_guided_b1_vs_hf_xgrammar']:.2f}. Mask apply at batch "
             f"{batches[-1]}: {figures['apply_us_per_row_b32']:.1f} us per row (vocab 49152). Step times are "
             f"medians of decode steps paired by step index at full occupancy; "
             f"{new_tokens} new tokens, {rounds} rounds; closing_window {window}"
             + (" (every guided step within it: the closing search steers each step)"
                if window >= new_tokens else "") + ".")
    name = "guided_overhead" if args.dtype in (None, "fp32") else f"guided_overhead_{args.dtype}"
    if args.closing_window is not None:
        name += f"_closing{args.closing_window}"
    figures["dtype"] = args.dtype or "fp32"
    figures["closing_window"] = window
    finish(name, body, figures, args)


if __name__ == "__main__":
    main()
