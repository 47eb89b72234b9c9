"""The guided stage's host cost, on what users send (issue 56).

    python bench/guided_host.py [--quick | --smoke] [--json] [--no-record]

(b) first, since it records what (a) replays: the default model, greedy, rows cycling
through one mix of grammars (the client bench's models, a tool call's arguments, a regex,
a choice, and two schemas with long required answers at budgets near their shortest
output), guided against unguided (the same prompts, no grammar, EOS ignored, each row as
many tokens as its guided answer had), at batch 8 and 32: output tokens a second, and the
longest step over the median step. Every guided answer's validity is counted.

(a) the tiny random-weight model at batch 64 and 256, speculation off (a step of one
token a row; its script steers one row of logits a sequence), 4 requests a row of the batch
(the batch stays full as rows end), each replaying one of (b)'s
recorded answers (its logits lean on the recorded token; where the output leaves the
record, the model's own choice): host microseconds per row per decode step (the step's
time less its forward's, which is not free even for the tiny model on a CPU: its output
layer is the real vocabulary's; rows parked on a search count as rows of the batch),
less the draw's tensor work over the vocabulary (nan_to_num, the grammar mask's apply,
argmax: kernels on a GPU, the CPU's own work here, reported apart as ``draw``),
guided and unguided (the same tokens, no grammar), the guided mask's parts per row (fill, apply, accept: ``StepTimings``), the
searches' share (``search_cpu_ms``), and the longest step over the median.

Keys: host_us_per_row_b64_guided, host_us_per_row_b64_unguided, host_us_per_row_b256_guided,
host_us_per_row_b256_unguided, host_us_per_row_b64_<fill|apply|accept|search>,
host_us_per_row_b64_<closing_guard|closing|loop_guard|jump_forward|stream> (a guided
row's host work by feature, means, timed in a replay of its own),
max_step_over_median_b64, ratio_guided_unguided_cpu_b8, ratio_guided_unguided_cpu_b32,
ratio_long_answers_cpu_b8, max_step_over_median_cpu_b8, valid_share_cpu,
draw_us_per_row_b<64|256>_<guided|unguided>.
--quick: batch 8 only in (b) and 64 only in (a); --smoke: the tiny model for both, small.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.clients import PROMPTS, Book, City, Order, Ticket  # noqa: E402
from bench.report import finish, parser, smoke_model, table  # noqa: E402
from core.grammar_spec import GrammarSpec  # noqa: E402
from core.request import GenerationRequest, RequestOutput  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine import sampling  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402
from worker.guided.loop_guard import LoopGuard  # noqa: E402
from worker.guided.output_policy import OutputPolicy, start_witness  # noqa: E402
from worker.guided.request import GuidedRequest  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
LONG_OBJECTS = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 12, "items": {
        "type": "object", "properties": {k: {"type": "string", "minLength": 24}
                                         for k in ("name", "detail", "source")},
        "required": ["name", "detail", "source"]}}}, "required": ["items"]}
LONG_STRINGS = {"type": "object", "properties": {"lines": {
    "type": "array", "minItems": 16, "items": {"type": "string", "minLength": 24}}},
    "required": ["lines"]}
LONG = ("long_objects", "long_strings")
ROUNDS = 4  # (a): requests per row of the batch
plain_draw = sampling.sample_on_device


def mix() -> list[tuple[str, GrammarSpec, str, int | None]]:
    """(name, grammar, prompt, budget: None = 160, or near the shortest output)."""
    rows = [(m.__name__.lower(), GrammarSpec.json_schema(m.model_json_schema()),
             PROMPTS[m][0], None) for m in (City, Book, Ticket, Order)]
    rows += [
        ("tool_args", GrammarSpec.json_schema(WEATHER), "What is the weather in Oslo?", None),
        ("regex", GrammarSpec.regex(r"\(\d{3}\) \d{3}-\d{4}"), "A phone number?", None),
        ("choice", GrammarSpec.choice(["positive", "negative", "neutral"]),
         "Is 'I love it' positive, negative or neutral?", None),
        ("long_objects", GrammarSpec.json_schema(LONG_OBJECTS),
         "List twelve museums with a detail and a source each.", 0),
        ("long_strings", GrammarSpec.json_schema(LONG_STRINGS),
         "Write sixteen lines about the sea.", 0)]
    return rows


def engine_of(model_dir, **cfg) -> LLMEngine:
    # guided and unguided rows run the same prompts: prefix caching (bench/prefix_cache.py)
    # off, so neither side's prefill is the other's cache hit
    # (the model named in the config: LLMEngine's model_dir argument only describes a
    # model passed in, and alone it loaded the default model, so (a) measured that)
    return LLMEngine(EngineConfig(progress=False, prefix_caching=False, model=str(model_dir),
                                  **cfg))


def budgets(engine, rows, default: int) -> list[int]:
    """Each row's budget: ``default``, or for the long answers a fifth over the shortest
    output known from the grammar's start (the schema's witness)."""
    out = []
    for name, spec, _, budget in rows:
        if budget is None:
            out.append(default)
            continue
        compiled = engine.guided.get_grammar(spec).result(timeout=600)
        short = start_witness(spec, engine.guided.new_matcher(compiled), engine.guided.closer)
        out.append(int(len(short) * 1.2) + 8 if short else default)
    return out


def run(engine, requests) -> tuple[dict, list[float], float]:
    """Runs requests to the end: (outputs by id, decode step times, wall seconds)."""
    for r in requests:
        engine.add_request(r)
    merged = {r.request_id: RequestOutput(r.request_id, logprobs=[]) for r in requests}
    steps, began = [], time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        for o in outs:
            merged[o.request_id].merge(o)
    return merged, steps, time.perf_counter() - began


def real_model(model_dir, batch: int, rows, record: dict, default: int = 160) -> dict:
    """(b): guided, then unguided with each row's guided length; records the answers."""
    engine = engine_of(model_dir, max_num_seqs=batch, num_kv_blocks=4096)
    limits = budgets(engine, rows, default)
    picks = [i % len(rows) for i in range(batch)]
    guided = [GenerationRequest([{"role": "user", "content": rows[k][2]}],
                                SamplingParams(max_new_tokens=limits[k], temperature=0.0),
                                grammar=rows[k][1]) for k in picks]
    outs, steps, wall = run(engine, guided)
    for k, r in zip(picks, guided):
        record.setdefault(rows[k][0], outs[r.request_id].token_ids)
    valid = [outs[r.request_id].validation for r in guided
             if outs[r.request_id].validation is not None]
    lengths = [len(outs[r.request_id].token_ids) for r in guided]
    plain = [GenerationRequest([{"role": "user", "content": rows[k][2]}],
                               SamplingParams(max_new_tokens=max(n, 1), temperature=0.0,
                                              ignore_eos=True))
             for k, n in zip(picks, lengths)]
    _, psteps, pwall = run(engine, plain)
    long_rows = [i for i, k in enumerate(picks) if rows[k][0] in LONG]
    return {"guided_tok_s": sum(lengths) / wall, "plain_tok_s": sum(lengths) / pwall,
            "max_over_median": max(steps) / statistics.median(steps),
            "max_step_ms": max(steps) * 1000, "valid": valid.count("valid"),
            "judged": len(valid), "long_tokens": sum(lengths[i] for i in long_rows),
            "search_ms": engine.stats().search_cpu_ms}


# a guided row's host work by feature: (key, class, method), timed in a pass of its own
# (each call's timing adds a little to the step; the pass's total is not reported)
FEATURES = (("closing_guard", OutputPolicy, "steer"), ("closing", OutputPolicy, "close"),
            ("loop_guard", LoopGuard, "push"), ("loop_guard", LoopGuard, "find"),
            ("jump_forward", GuidedRequest, "_jump"), ("stream", GuidedRequest, "_release"))


@contextmanager
def timed_features(spent: dict):
    """FEATURES' methods timed into ``spent`` (key -> seconds) while inside."""
    plain = [(cls, attr, getattr(cls, attr)) for _, cls, attr in FEATURES]
    for (name, cls, attr), (_, _, fn) in zip(FEATURES, plain):
        def timed(*args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0
        setattr(cls, attr, timed)
    try:
        yield
    finally:
        for cls, attr, fn in plain:
            setattr(cls, attr, fn)


def replay(model_dir, batch: int, rows, record: dict, guided: bool,
           spent: dict | None = None) -> dict:
    """(a): the tiny model at ``batch`` rows replaying recorded answers; ``spent``: the
    features' seconds (``timed_features``), read per step into ``features``."""
    # room for every row's whole answer (the long ones run to about 500 tokens): a
    # preempted row would leave the batch this measures
    # without speculation: the script below steers one row of logits a sequence (a draft
    # gives a row several), and this measures the host's cost of a step of one token a row
    # (with drafts on, the script steered the wrong rows and the answers left the record)
    engine = engine_of(model_dir, max_num_seqs=batch, num_kv_blocks=40 * batch + 256,
                       max_num_batched_tokens=max(2048, 8 * batch), speculative=False)
    names = [n for n, *_ in rows if record.get(n)]
    by_name = {n: (spec, prompt) for n, spec, prompt, _ in rows}
    script: dict[str, list[int]] = {}
    reqs = []
    # ROUNDS times the batch's rows, so the batch stays full as rows end (the mix's answers
    # run from 2 to about 500 tokens: a batch of its rows alone was full for its first few
    # steps only, which held every grammar's first-use costs)
    for i in range(batch * ROUNDS):
        name = names[i % len(names)]
        spec, prompt = by_name[name]
        tokens = record[name]
        r = GenerationRequest([{"role": "user", "content": prompt}],
                              SamplingParams(max_new_tokens=len(tokens) + (8 if guided else 0),
                                             temperature=0.0, ignore_eos=not guided),
                              grammar=spec if guided else None)
        script[r.request_id] = tokens
        reqs.append(r)
    forward = engine.runner.run

    fwd = [0.0]  # this step's forward time (the tiny model's is not free on a CPU: its
    # 49,152-word output layer alone is about 150 us a row), taken out of the host time

    def scripted(scheduled):
        t0 = time.perf_counter()
        logits, rows_ = forward(scheduled)
        fwd[0] += time.perf_counter() - t0
        idx, want = [], []
        for i, s in enumerate([s for s in scheduled if s.samples]):
            rec, out = script[s.seq.request_id], s.seq.output_ids
            if len(out) < len(rec) and out == rec[:len(out)]:
                idx.append(i)
                want.append(rec[len(out)])
        if idx:
            with torch.inference_mode():  # (the logits are an inference tensor)
                logits[torch.tensor(idx), torch.tensor(want)] += 1e4
        return logits, rows_

    engine.runner.run = scripted
    # the draw's tensor work over the whole vocabulary (nan_to_num, the mask's apply,
    # argmax: kernels on a GPU, where the host only launches them), taken out of the host
    # time like the forward and reported apart; the processor's host parts (the wait for
    # the fill, stop ids and UTF-8 bans on the host bitmask) stay in the host's
    device, applied = [0.0], [0.0]
    plain_apply = engine.mask.apply_bitmask

    def timed_apply(logits, num_rows):
        t0 = time.perf_counter()
        plain_apply(logits, num_rows)
        applied[0] += time.perf_counter() - t0

    def timed_draw(logits, plan, processor=None):
        applied[0] = 0.0
        t0 = time.perf_counter()
        packed = plain_draw(logits, plan, processor)
        took = time.perf_counter() - t0
        tm = getattr(processor, "timings", None)
        if tm is not None and tm.guided_rows:
            took -= (tm.fill_wait_us + tm.apply_us) * 1e-6 - applied[0]
        device[0] += took
        return packed

    engine.mask.apply_bitmask = timed_apply
    sampling.sample_on_device = timed_draw
    # as a worker does after its start (worker/actor.py): the start's objects out of the
    # cyclic collector's full passes (one took 0.2 s, in a step of this loop)
    gc.collect()
    gc.freeze()
    for r in reqs:
        engine.add_request(r)
    per_row, parts, steps, draws = [], {"fill": [], "apply": [], "accept": []}, [], []
    features: dict[str, list[float]] = {name: [] for name, *_ in FEATURES}
    try:
        while engine.has_work():
            fwd[0] = device[0] = 0.0
            if spent is not None:
                spent.clear()
            t = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t - fwd[0] - device[0]  # the host's part
            # rows in the batch: running, and parked while their search runs (sliced)
            n = len(engine.scheduler.running) + len(engine.scheduler.parked)
            if n >= batch * 3 // 4 and engine.num_steps > 2:  # decode steps of a full batch
                per_row.append(took / n * 1e6)
                draws.append(device[0] / n * 1e6)
                steps.append(took)
                tm = engine.last_timings
                if tm is not None and tm.guided_rows:
                    parts["fill"].append(tm.fill_wait_us / n)
                    parts["apply"].append(tm.apply_us / n)
                    parts["accept"].append(tm.accept_us / n)
                if spent is not None:
                    for name in features:
                        features[name].append(spent.get(name, 0.0) / n * 1e6)
    finally:
        sampling.sample_on_device = plain_draw
    gc.unfreeze()  # (this engine's objects collectable again once it is dropped)
    stats = engine.stats()
    out = {"us_per_row": statistics.median(per_row) if per_row else 0.0,
           "draw_us_per_row": statistics.median(draws) if draws else 0.0,
           "max_over_median": max(steps) / statistics.median(steps) if steps else 0.0,
           "search_us_per_row": stats.search_cpu_ms * 1000 / max(1, sum(
               len(v) for v in script.values()))}
    out.update({k: statistics.median(v) if v else 0.0 for k, v in parts.items()})
    out["features"] = {k: statistics.mean(v) if v else 0.0 for k, v in features.items()}
    return out


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    torch.set_num_threads(1)
    from worker.models.gguf_convert import ensure_converted
    tiny = smoke_model()
    real = tiny if args.smoke else ensure_converted(None, progress=False)
    rows = mix()
    record: dict[str, list[int]] = {}
    figures, lines = {}, []
    for b in ([4] if args.smoke else [8] if args.quick else [8, 32]):
        res = real_model(real, b, rows, record, 48 if args.smoke else 160)
        figures[f"ratio_guided_unguided_cpu_b{b}"] = res["guided_tok_s"] / res["plain_tok_s"]
        figures[f"max_step_over_median_cpu_b{b}"] = res["max_over_median"]
        lines.append([f"(b) batch {b}", f"{res['guided_tok_s']:.1f}", f"{res['plain_tok_s']:.1f}",
                      res["guided_tok_s"] / res["plain_tok_s"], res["max_over_median"],
                      f"{res['max_step_ms']:.0f}", f"{res['valid']}/{res['judged']}",
                      res["search_ms"]])
        figures.setdefault("valid_share_cpu", res["valid"] / max(1, res["judged"]))
    if not args.smoke:  # the long answers alone, batch 8
        longs = [r for r in rows if r[0] in LONG]
        res = real_model(real, 8, longs, record)
        figures["ratio_long_answers_cpu_b8"] = res["guided_tok_s"] / res["plain_tok_s"]
        lines.append(["(b) long answers, batch 8", f"{res['guided_tok_s']:.1f}",
                      f"{res['plain_tok_s']:.1f}", res["guided_tok_s"] / res["plain_tok_s"],
                      res["max_over_median"], f"{res['max_step_ms']:.0f}",
                      f"{res['valid']}/{res['judged']}", res["search_ms"]])
    host, by_feature = [], []
    for b in ([16] if args.smoke else [64] if args.quick else [64, 256]):
        g = replay(tiny, b, rows, record, guided=True)
        u = replay(tiny, b, rows, record, guided=False)
        figures[f"host_us_per_row_b{b}_guided"] = g["us_per_row"]
        figures[f"host_us_per_row_b{b}_unguided"] = u["us_per_row"]
        figures[f"draw_us_per_row_b{b}_guided"] = g["draw_us_per_row"]
        figures[f"draw_us_per_row_b{b}_unguided"] = u["draw_us_per_row"]
        if b == 64 or args.smoke:
            figures[f"max_step_over_median_b{b}"] = g["max_over_median"]
            for part in ("fill", "apply", "accept"):
                figures[f"host_us_per_row_b{b}_{part}"] = g[part]
            figures[f"host_us_per_row_b{b}_search"] = g["search_us_per_row"]
        if b == 64 or args.smoke:  # the guided row's host work by feature, a pass of its own
            spent: dict = {}
            with timed_features(spent):
                feats = replay(tiny, b, rows, record, guided=True, spent=spent)["features"]
            for name, us in feats.items():
                figures[f"host_us_per_row_b{b}_{name}"] = us
            by_feature.append([f"(a) batch {b}", *feats.values()])
        host.append([f"(a) batch {b}", g["us_per_row"], u["us_per_row"], g["fill"],
                     g["apply"], g["accept"], g["search_us_per_row"], g["max_over_median"],
                     f"{g['draw_us_per_row']:.1f} / {u['draw_us_per_row']:.1f}"])
    body = ("(b) the default model (tiny in --smoke), greedy, guided vs unguided:\n\n"
            + table(["run", "guided tok/s", "unguided tok/s", "ratio", "max/median step",
                     "max step ms", "valid", "search ms"], lines)
            + "\n\n(a) the tiny model replaying (b)'s answers, host us per row per decode "
            "step, the forward and the draw's tensor work left out (fill: the wait for the "
            "mask after the forward; search: the searches' CPU per output token; draw: "
            "nan_to_num, the mask's apply and argmax over the vocabulary, guided / unguided, "
            "kernels on a GPU):\n\n"
            + table(["run", "guided", "unguided", "fill", "apply", "accept", "search",
                     "max/median step", "draw (device)"], host)
            + "\n\n(a) a guided row's host us a step by feature, means over the same steps "
            "(a pass of its own, each feature's calls timed: closing_guard, the sampled "
            "token's check against the closing path, OutputPolicy.steer; closing, the "
            "estimate and the path's emission, OutputPolicy.close; loop_guard, LoopGuard."
            "push and find; jump_forward, GuidedRequest._jump; stream, the release of held "
            "tokens and their text, GuidedRequest._release):\n\n"
            + table(["run", *dict.fromkeys(name for name, *_ in FEATURES)], by_feature))
    finish("guided_host", body, figures, args)


if __name__ == "__main__":
    main()
