"""Cost of guided decoding in the engine: guided (JSON schema) vs unguided, batch 1/8/32.

Same prompts, greedy, jump-forward off (decode steps only). Guided and unguided outputs differ in length, so decode steps are
compared pairwise at the same step index (same context length) while every sequence of
both runs is still decoding (equal batch occupancy). Rounds alternate between the two
sides. Per guided step: bitmask fill time (on its thread, overlapping the forward), how
long the step still waited for it after the forward, mask apply time and accept time. Each
grammar engine has its rows (the schema forced onto xgrammar, then llguidance); the unkeyed
``--json`` figures are the rows of the engine ``auto`` picks, keys with the engine's name
(``fill_us_xgrammar_b8``, ``ratio_guided_llguidance_b32``...) are each engine's.
Also, at batch 1: HF transformers generate() with xgrammar's HF logits processor on the
same schema, what a user would otherwise run.

    python bench/guided_overhead.py [--quick | --smoke] [--json] [--no-record]
                                    [--dtype int8] [--closing-window N]

``--quick``: 2 rounds instead of 8, same budget (24 tokens: the schema's shortest output
is about 20, a smaller budget is refused). ``--smoke``: the tiny random-weight model,
batches 1 and 2, one round; jump-forward's batches 8 and 32 on the key-heavy workload only.

``--dtype int8`` runs the engine with int8 weights: shorter steps, so the mask's share of a
step is larger there; its table is recorded as its own section (guided_overhead_int8).

Jump-forward (issue 31, ``--no-jump-bench`` skips it): three workloads, greedy, batch
1/8/32, each run guided with jumping, guided without, and unguided (as many tokens as
the guided outputs had, EOS ignored): a key-heavy flat object (12 keys, short values),
tool calls (20 tools, tool_choice required) and the conformance bench's schemas and
prompts. Output tokens per second from the step where every prompt is in (decoding; the
prefill is the same on every side) to the end, and decode steps per output token (sampled
tokens / output tokens, both counted from there).
``--json`` keys: jump_speedup_<w>_b<B> (guided with / without jumping), ratio_guided_jump_vs_
unguided_<w>_b<B>, forced_token_share_<w> (of the outputs with jumping, all batches),
steps_per_token_<w>_b<B>, and the quality check on the conformance workload:
jump_agree_share (greedy texts equal with and without jumping), jump_split_first_share
(equal, or where they first differ one splits the same bytes otherwise: a boundary
difference, not another choice of the model), jump_agree_canonical_share
(the same among outputs whose no-jump tokens are the tokenizer's own split of their text:
no boundary difference), valid_share_jump / _nojump, loop_share_jump / _nojump.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, smoke_model, table  # noqa: E402
from core.grammar_spec import GrammarSpec  # noqa: E402
from worker.guided import bitmask  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.guided.backend import LLGUIDANCE, XGRAMMAR  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402
from core.request import GenerationRequest, RequestOutput  # noqa: E402

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


def run_side(engine: LLMEngine, batch: int, new_tokens: int, guided: bool,
             grammar_engine: str = "auto"):
    """Returns per decode step (index -> seconds) while all ``batch`` sequences decode,
    and the guided timings of those steps."""
    spec = GrammarSpec.json_schema(SCHEMA, engine=grammar_engine) if guided else None
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


def auto_choice(engine: LLMEngine) -> str:
    """The engine ``auto`` picks for SCHEMA in this engine."""
    grammar = engine.guided.get_grammar(GrammarSpec.json_schema(SCHEMA)).result()
    return grammar.engine


def mask_cost(engine: LLMEngine, batch: int, new_tokens: int, rounds: int,
              grammar_engine: str) -> tuple[dict, list]:
    """Paired decode steps, guided on ``grammar_engine`` vs unguided: (figures, table row)."""
    run_side(engine, batch, new_tokens, True, grammar_engine)  # warm: compile, size buffers
    pairs, fill, wait, apply, accept = [], [], [], [], []
    for r in range(rounds):
        # alternate which side goes first, so drift within a round cancels out
        if r % 2 == 0:
            plain, _ = run_side(engine, batch, new_tokens, guided=False)
            guided, timings = run_side(engine, batch, new_tokens, True, grammar_engine)
        else:
            guided, timings = run_side(engine, batch, new_tokens, True, grammar_engine)
            plain, _ = run_side(engine, batch, new_tokens, guided=False)
        pairs += list(zip(plain, guided))
        fill += [t.fill_us for t in timings]
        wait += [t.fill_wait_us for t in timings]
        apply += [t.apply_us for t in timings]
        accept += [t.accept_us for t in timings]
    if not pairs:
        raise SystemExit(f"batch {batch} ({grammar_engine}): no decode step had every "
                         "sequence of both sides decoding (all outputs ended too early)")
    plain_s = statistics.median(p for p, _ in pairs)
    guided_s = statistics.median(g for _, g in pairs)
    hidden = 1 - statistics.mean(wait) / max(statistics.mean(fill), 1e-9)
    fig = {"ratio_guided": plain_s / guided_s, "unguided_tok_s": batch / plain_s,
           "guided_tok_s": batch / guided_s, "fill_us": statistics.mean(fill),
           "apply_us": statistics.mean(apply), "accept_us": statistics.mean(accept),
           "fill_hidden": hidden}
    return fig, [batch, len(pairs), batch / plain_s, batch / guided_s, plain_s / guided_s,
                 fig["fill_us"], statistics.mean(wait), f"{100 * hidden:.0f}%",
                 fig["apply_us"], fig["accept_us"]]


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
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the engine (default: torch's; 1 on a busy "
                         "machine, where 2 threads wait on each other)")
    ap.add_argument("--no-jump-bench", action="store_true",
                    help="skip the jump-forward workloads")
    ap.add_argument("--jump-only", action="store_true",
                    help="only the jump-forward workloads")
    ap.add_argument("--hold-back", default=None, choices=["mask", "space", "never"],
                    help="jump-forward's rule for a trailing forced token (default: mask)")
    args = ap.parse_args()
    batches = (1, 2) if args.smoke else (1, 8, 32)
    # many short rounds: this VM's speed drifts over minutes, so the sides alternate often
    new_tokens = 24
    rounds = 1 if args.smoke else 2 if args.quick else 8

    extra = {} if args.closing_window is None else {"closing_window": args.closing_window}
    if args.threads:
        extra["num_threads"] = args.threads
    if args.smoke:
        extra["model"] = smoke_model()
    # guided and unguided rounds run the same prompts: prefix caching (bench/prefix_cache.py)
    # off, so neither side's prefill is the other's cache hit
    engine = LLMEngine(EngineConfig(progress=False, dtype=args.dtype, prefix_caching=False,
                                    **extra))
    window = engine.config.closing_window
    bitmask.warmup()
    if args.hold_back:
        engine.guide.jumper.hold_back = args.hold_back
    jump_figures, jump_body = ({}, "") if args.no_jump_bench else jump_bench(engine, args)
    if args.jump_only:
        finish("guided_jump_forward", jump_body, jump_figures, args)
        return
    # the mask's cost per decode step: paired decode steps need rows that decode one
    # token a step, so this part runs without jumping (as it did before it existed)
    engine.config.jump_forward = False
    figures, rows = {}, []
    # the mask's cost on each engine; the unkeyed figures are auto's (what the server
    # runs: llguidance compiles this schema)
    served = auto_choice(engine)
    for grammar_engine in (XGRAMMAR, LLGUIDANCE):
        for batch in batches:
            fig, row = mask_cost(engine, batch, new_tokens, rounds, grammar_engine)
            rows.append([grammar_engine] + row)
            figures.update({f"{k}_{grammar_engine}_b{batch}": v for k, v in fig.items()})
            if grammar_engine == served:
                figures.update({f"{k}_b{batch}": v for k, v in fig.items()})
    figures["apply_us_per_row_b32"] = figures[f"apply_us_b{batches[-1]}"] / batches[-1]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        engine.model_dir, dtype=torch.float32).eval()
    hf_s = hf_guided_b1(hf, engine.tokenizer, engine, new_tokens)
    ours_b1 = 1 / figures["guided_tok_s_b1"]
    figures["hf_xgrammar_tok_s_b1"] = 1 / hf_s
    figures["ratio_guided_b1_vs_hf_xgrammar"] = hf_s / ours_b1

    body = table(["engine", "batch", "paired steps", "unguided tok/s", "guided tok/s", "ratio",
                  "fill us", "fill wait us", "fill hidden", "apply us", "accept us"], rows)
    body += (f"\n\n`auto` serves this schema with {served} (the unkeyed --json figures are "
             "its rows); fill us: the batch's bitmask fill per step (xgrammar's batch "
             "matcher, llguidance's parallel fill), on its thread beside the forward.")
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
    figures.update(jump_figures)
    if jump_body and not args.no_record and not args.quick and not args.smoke:
        from bench.report import record
        record("guided_jump_forward", jump_body)
    print(jump_body)
    finish(name, body, figures, args)


# jump-forward workloads ------------------------------------------------------------------

KEY_NAMES = ["name", "city", "country", "age", "height", "color", "animal", "food", "sport",
             "job", "car", "planet"]
KEYS_SCHEMA = {"type": "object", "properties": {
    k: {"type": "integer", "minimum": 0, "maximum": 999} if k in ("age", "height")
    else {"type": "string", "maxLength": 12} for k in KEY_NAMES},
    "required": KEY_NAMES, "additionalProperties": False}
TOOL_TOPICS = ["weather", "stock_price", "news", "flight", "hotel", "restaurant", "movie",
               "music", "translate", "calendar", "email", "reminder", "timer", "calculator",
               "currency", "recipe", "traffic", "sports_score", "dictionary", "wiki"]


def _tools():
    """20 functions with two or three parameters each (an enum, an integer)."""
    out = []
    for i, topic in enumerate(TOOL_TOPICS):
        props = {"query": {"type": "string", "maxLength": 24},
                 "limit": {"type": "integer", "minimum": 1, "maximum": 20}}
        if i % 2:
            props["unit"] = {"enum": ["metric", "imperial"]}
        out.append({"type": "function", "function": {
            "name": f"get_{topic}", "description": f"Look up {topic.replace('_', ' ')}.",
            "parameters": {"type": "object", "properties": props,
                           "required": sorted(props)}}})
    return out


def jump_workloads(smoke: bool):
    """name -> list of (prompt messages, GrammarSpec, budget), cycled to fill a batch."""
    from bench import conformance
    from deploy.tools import tool_grammar, with_tool_prompt

    keys = [([{"role": "user", "content": f"Describe {t} number {i} as a JSON object with "
               f"the keys {', '.join(KEY_NAMES)}."}], GrammarSpec.json_schema(KEYS_SCHEMA),
             24 if smoke else 128) for i, t in enumerate(TOPICS)]
    functions, mode, spec = tool_grammar(_tools()[:3] if smoke else _tools(), "required", None)
    asks = ["What is the weather in Oslo?", "Find me a hotel in Rome.", "Translate 'cat' "
            "to French.", "Any news about Mars?", "Price of ACME stock?", "Set a timer.",
            "Flights to Lima?", "A recipe for soup."]
    tools = [(with_tool_prompt([{"role": "user", "content": a}], functions, mode, "required"),
              spec, 24 if smoke else 96) for a in asks]
    schemas = ([conformance.SCHEMAS[k] for k in ("planet", "tags")] if smoke
               else list(conformance.SCHEMAS.values()))
    conf = [([{"role": "user", "content": f"{p} Schema: {json.dumps(schema)}"}],
             GrammarSpec.json_schema(schema), 24 if smoke else 96)
            for p in conformance.PROMPTS for schema in schemas]
    conf = conf[::5] + [c for i, c in enumerate(conf) if i % 5]  # schemas mixed early
    return {"keys": keys, "tools": tools, "conformance": conf}


def jump_side(engine: LLMEngine, cases, side: str, budget_of=None):
    """Runs ``cases`` at once, greedy, on one side (jump / nojump / unguided); returns
    (outputs, seconds, sampled tokens, forced tokens). Unguided rows generate as many
    tokens as ``budget_of[i]`` (the guided output's length), EOS ignored."""
    engine.config.jump_forward = side == "jump"
    reqs = []
    for i, (prompt, spec, budget) in enumerate(cases):
        if side == "unguided":
            params = SamplingParams(max_new_tokens=max(1, budget_of[i]), temperature=0.0,
                                    ignore_eos=True)
            spec = None
        else:
            params = SamplingParams(max_new_tokens=budget, temperature=0.0)
        reqs.append(GenerationRequest(prompt, params, grammar=spec))
    merged = {}
    for r in reqs:
        engine.add_request(r)
        merged[r.request_id] = RequestOutput(r.request_id, logprobs=[])
    seqs = [engine.seqs[r.request_id] for r in reqs]
    start = None
    while engine.has_work():
        if start is None and all(s.num_output or s.request_id not in engine.seqs
                                 for s in seqs):
            # every prompt is in: decoding from here (prefill is the same on every side)
            start = (time.perf_counter(), sum(s.num_output for s in seqs), engine.stats())
        for out in engine.step():
            merged[out.request_id].merge(out)
    wall = time.perf_counter() - start[0]
    after = engine.stats()
    engine.config.jump_forward = True
    outs = [merged[r.request_id] for r in reqs]
    for o in outs:
        if o.finish_reason == "error":
            raise SystemExit(f"a {side} request failed: {o.error}")
    produced = sum(o.completion_tokens for o in outs) - start[1]
    return (outs, wall, produced, after.sampled_tokens - start[2].sampled_tokens,
            after.jump_forward_tokens - start[2].jump_forward_tokens)


def jump_bench(engine: LLMEngine, args) -> tuple[dict, str]:
    """The jump-forward table and figures (see the module doc)."""
    batches = (1, 8, 32)
    b1_requests = 1 if args.smoke else 3 if args.quick else 8
    window = engine.config.closing_window
    if args.smoke:  # the tiny model's strings never end: closing would search every step
        engine.config.closing_window = 0
    try:
        return _jump_bench(engine, args, batches, b1_requests)
    finally:
        engine.config.closing_window = window


def _jump_bench(engine: LLMEngine, args, batches, b1_requests) -> tuple[dict, str]:
    from bench.report import repeated_span
    from worker.guided.validation import validate_json

    figures, rows = {}, []
    quality = {"agree": 0, "split_first": 0, "canon": 0, "canon_agree": 0, "n": 0, "valid_jump": 0,
               "valid_nojump": 0, "json": 0, "loop_jump": 0, "loop_nojump": 0}
    for name, pool in jump_workloads(args.smoke).items():
        forced_all = out_all = 0
        # --smoke: batches 8 and 32 on the key-heavy workload alone (the same code path;
        # the tool and conformance workloads at batch 1: their figures the smoke checks)
        for batch in batches if name == "keys" or not args.smoke else batches[:1]:
            groups = b1_requests if batch == 1 else 1
            tot = {s: [0.0, 0, 0, 0] for s in ("jump", "nojump", "unguided")}  # s, out, sampled, forced
            for g in range(groups):
                cases = [pool[(g * batch + i) % len(pool)] for i in range(batch)]
                if g == 0 and batch == batches[0]:
                    jump_side(engine, cases[:1], "jump")  # warm: compile the grammar
                order = ("nojump", "jump") if g % 2 == 0 else ("jump", "nojump")
                got = {}
                for side in order:
                    got[side] = jump_side(engine, cases, side)
                lengths = [o.completion_tokens for o in got["nojump"][0]]
                got["unguided"] = jump_side(engine, cases, "unguided", lengths)
                for side, (outs, wall, produced, sampled, forced) in got.items():
                    t = tot[side]
                    t[0] += wall
                    t[1] += produced
                    t[2] += sampled
                    t[3] += forced
                if name == "conformance":
                    for (prompt, spec, _), a, b in zip(cases, got["jump"][0], got["nojump"][0]):
                        _quality(quality, engine, spec, a, b, validate_json, repeated_span)
            tok_s = {s: t[1] / t[0] for s, t in tot.items()}
            steps = {s: t[2] / max(1, t[1]) for s, t in tot.items()}
            speedup = tok_s["jump"] / tok_s["nojump"]
            vs_plain = tok_s["jump"] / tok_s["unguided"]
            figures[f"jump_speedup_{name}_b{batch}"] = round(speedup, 3)
            figures[f"ratio_guided_jump_vs_unguided_{name}_b{batch}"] = round(vs_plain, 3)
            figures[f"ratio_guided_nojump_vs_unguided_{name}_b{batch}"] = round(
                tok_s["nojump"] / tok_s["unguided"], 3)
            figures[f"steps_per_token_{name}_b{batch}"] = round(steps["jump"], 3)
            figures[f"forced_token_share_{name}_b{batch}"] = round(
                tot["jump"][3] / max(1, tot["jump"][1]), 3)
            forced_all += tot["jump"][3]
            out_all += tot["jump"][1]
            rows.append([name, batch, f"{tok_s['jump']:.1f}", f"{tok_s['nojump']:.1f}",
                         f"{tok_s['unguided']:.1f}", f"{speedup:.2f}", f"{vs_plain:.2f}",
                         f"{steps['jump']:.2f}", f"{steps['nojump']:.2f}"])
        figures[f"forced_token_share_{name}"] = round(forced_all / max(1, out_all), 3)
    n = max(1, quality["n"])
    canon = quality["canon"]
    figures.update(
        jump_agree_share=round(quality["agree"] / n, 3),
        jump_split_first_share=round(quality["split_first"] / n, 3),
        jump_agree_canonical_share=round(quality["canon_agree"] / canon, 3) if canon else None,
        jump_canonical_outputs=canon, jump_quality_outputs=quality["n"],
        valid_share_jump=round(quality["valid_jump"] / max(1, quality["json"]), 3),
        valid_share_nojump=round(quality["valid_nojump"] / max(1, quality["json"]), 3),
        loop_share_jump=round(quality["loop_jump"] / n, 3),
        loop_share_nojump=round(quality["loop_nojump"] / n, 3),
        jump_hold_back=engine.guide.jumper.hold_back)
    body = table(["workload", "batch", "jump tok/s", "no-jump tok/s", "unguided tok/s",
                  "jump / no-jump", "jump / unguided", "steps/token jump",
                  "steps/token no-jump"], rows)
    body += (f"\n\nForced token share (with jumping, all batches): "
             + ", ".join(f"{w} {figures[f'forced_token_share_{w}']:.2f}"
                         for w in ("keys", "tools", "conformance"))
             + f". Quality on the conformance workload ({quality['n']} greedy outputs): "
             f"texts equal with and without jumping {figures['jump_agree_share']:.2f}, equal "
             f"or first different where the same bytes are split into other tokens "
             f"{figures['jump_split_first_share']:.2f}; among "
             f"the {canon} whose no-jump tokens are the tokenizer's own split of their text "
             f"(no boundary difference) "
             + (f"{figures['jump_agree_canonical_share']:.2f}" if canon else "n/a")
             + f"; valid {figures['valid_share_jump']:.2f} with, "
             f"{figures['valid_share_nojump']:.2f} without; loop share "
             f"{figures['loop_share_jump']:.2f} with, {figures['loop_share_nojump']:.2f} "
             f"without. Hold-back rule: {engine.guide.jumper.hold_back}. Batch 1 is "
             f"{b1_requests} requests one after another.")
    return figures, body


def _first_difference_is_a_split(engine: LLMEngine, a: list[int], b: list[int]) -> bool:
    """Whether two outputs are equal, or first differ where one splits the same bytes into
    other tokens (``{"`` against ``{`` ``"``): a boundary difference, not the model choosing
    other text from the same tokens."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return True
    vocab = engine.guided.closer.vocab
    x, y = vocab[a[i]], vocab[b[i]]
    return x.startswith(y) or y.startswith(x)


def _quality(q: dict, engine: LLMEngine, spec, with_jump, without, validate_json,
             repeated_span) -> None:
    q["n"] += 1
    q["agree"] += with_jump.text == without.text
    q["split_first"] += _first_difference_is_a_split(engine, with_jump.token_ids,
                                                     without.token_ids)
    canonical = engine.tokenizer(without.text, add_special_tokens=False)["input_ids"]
    ids = [t for t in without.token_ids if t not in engine.eos_ids]
    if canonical == ids:
        q["canon"] += 1
        q["canon_agree"] += with_jump.text == without.text
    if spec.kind == "json_schema":
        q["json"] += 1
        q["valid_jump"] += validate_json(spec.source, with_jump.text) is None
        q["valid_nojump"] += validate_json(spec.source, without.text) is None
    q["loop_jump"] += bool(repeated_span(with_jump.text))
    q["loop_nojump"] += bool(repeated_span(without.text))


if __name__ == "__main__":
    main()
