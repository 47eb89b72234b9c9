"""Prompts that share a prefix, computed once (issue 59).

    python bench/prefix_cache.py [--quick | --smoke] [--json] [--no-record]

(a) The engine, in this process, with the default model: 64 requests sharing a
1,024-token prefix, each with 32 tokens of its own, submitted at once (16 greedy tokens
each), prefix caching on and off: the prompt tokens the forward computed (over the distinct
tokens of the prompts), the first token's time p50 / p99 from submission, and requests a
second.

(b) A runtime of 3 workers (the tiny model: the routing is measured, not the forward, and
each worker's KV holds about two of the prefixes), 4 distinct 512-token prefixes, 128
requests in a random order, 8 at a time: the hit rate (prompt tokens found cached over the
prefixes' tokens sent) with prefix-aware routing and with routing by load alone, and each
worker's share of the requests and of the tokens computed (prompt tokens not found cached,
and output), the most loaded over the mean. (Four prefixes over three workers: a routing
that kept each prefix on one worker would send one worker two of them, half the requests,
1.5x the mean; the work those requests cost is what the tokens computed measure.)

(c) The batch job's own loop (deploy/batch_job.process, a runtime of one worker, the
default model) on 200 rows of one shared 600-token instruction and a short document each,
in no particular order, with a JSON schema: its time with the cache on and off, the prompt
tokens computed and cached, and the valid share.

Keys: computed_over_unique_tokens, speedup_shared_prefix, ttft_p50_ratio,
cluster_hit_rate_routed, cluster_hit_rate_load_only, cluster_max_over_mean_routed,
cluster_computed_max_over_mean_routed (and ``_load_only`` for both), batch_job_speedup, batch_valid_share_on, batch_valid_share_off. ``--quick``: 16 requests in
(a), 64 in (b), 50 rows in (c); ``--smoke``: the tiny model everywhere, a few of each.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, table, tiny_model  # noqa: E402
from bench.report import percentile as pct  # noqa: E402
from core.params import SamplingParams  # noqa: E402
from core.request import GenerationRequest  # noqa: E402

RULES = [
    "Read the document below and extract every company it names, with its country and "
    "the year it was founded when the document says so.",
    "Write names exactly as the document spells them; never translate or expand them.",
    "When a country is given as a city, give the country the city is in.",
    "If the founding year is a range or uncertain, leave it out rather than guess.",
    "Ignore companies that are only mentioned as examples of a kind of business.",
    "A subsidiary is its own company: list it, and name its parent in the notes.",
    "Dates may be written in any calendar format; give years as four digits.",
    "Do not include people, products, places or events, only organisations.",
    "Answer in the JSON format the schema gives, with no text before or after it.",
]
SCHEMA = {"type": "object", "properties": {
    "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
    "topic": {"type": "string", "maxLength": 24}},
    "required": ["sentiment", "topic"], "additionalProperties": False}


def instruction(tokenizer, n_tokens: int, variant: int = 0) -> list[int]:
    """``n_tokens`` tokens of instructions (numbered rules, repeated with their numbers
    going on), different for each ``variant`` from the first token on."""
    text, i = f"Task {variant}: you are extraction assistant number {variant}.\n", 0
    while len(tokenizer(text)["input_ids"]) < n_tokens:
        text += f"Rule {i + 1}. {RULES[(i + variant) % len(RULES)]}\n"
        i += 1
    return tokenizer(text)["input_ids"][:n_tokens]


def document(rng: random.Random, n_words: int) -> str:
    words = ["Acme", "Globex", "Initech", "founded", "in", "Berlin", "1998", "the", "firm",
             "grew", "sold", "Umbrella", "Hooli", "Lyon", "2004", "merged", "with", "a"]
    return " ".join(rng.choice(words) for _ in range(n_words))


# (a) the engine ---------------------------------------------------------------------------

def engine_round(engine, prompts: list[list[int]], out_tok: int) -> dict:
    """All ``prompts`` submitted at once; per request the first token's time from then."""
    computed = [0]
    run = engine.runner.run

    def counting(scheduled):  # the prompt tokens each forward computes
        for s in scheduled:
            start = s.seq.num_computed
            computed[0] += max(0, min(start + s.num_tokens, s.seq.num_prompt) - start)
        return run(scheduled)

    engine.runner.run = counting
    try:
        t0 = time.perf_counter()
        reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=out_tok, temperature=0.0,
                                                    ignore_eos=True)) for p in prompts]
        for r in reqs:
            engine.add_request(r)
        first: dict[str, float] = {}
        cached = 0
        while engine.has_work():
            for out in engine.step():
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - t0
                if out.finished:
                    cached += out.cached_tokens
        wall = time.perf_counter() - t0
    finally:
        engine.runner.run = run
    ttft = list(first.values())
    return {"computed": computed[0], "cached": cached, "wall": wall,
            "req_s": len(prompts) / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99)}


def engine_part(args, model: str, figs: dict) -> str:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    n = 4 if args.smoke else 16 if args.quick else 64
    prefix_len, own_len, out_tok = (128, 16, 4) if args.smoke else (1024, 32, 16)
    rows, result = [], {}
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(model=model, progress=False, max_num_seqs=64,
                                        prefix_caching=caching,
                                        num_kv_blocks=n * (prefix_len + own_len + out_tok)
                                        // 16 + 64))
        tok = engine.tokenizer
        prefix = instruction(tok, prefix_len)
        rng = random.Random(0)
        prompts = [prefix + tok(f" Document {i}: " + document(rng, own_len))["input_ids"]
                   [:own_len] for i in range(n)]
        engine_round(engine, [tok("Warm up.")["input_ids"]], 2)  # first forward's costs
        r = result[caching] = engine_round(engine, prompts, out_tok)
        distinct = prefix_len + n * own_len
        rows.append(["on" if caching else "off", r["computed"], distinct,
                     round(r["computed"] / distinct, 3), r["cached"],
                     f"{r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f}",
                     round(r["req_s"], 2)])
    on, off = result[True], result[False]
    figs.update(computed_over_unique_tokens=round(on["computed"] / (prefix_len + n * own_len), 3),
                speedup_shared_prefix=round(on["req_s"] / off["req_s"], 2),
                ttft_p50_ratio=round(on["ttft_p50"] / off["ttft_p50"], 3))
    return (f"(a) the engine: {n} requests sharing a {prefix_len}-token prefix, {own_len} "
            f"tokens of their own, {out_tok} greedy tokens each, submitted at once:\n\n"
            + table(["prefix caching", "prompt tokens computed", "distinct prompt tokens",
                     "computed / distinct", "cached_tokens reported",
                     "first token p50 / p99 ms", "requests/s"], rows)
            + f"\n\nspeedup {figs['speedup_shared_prefix']}x, first token p50 "
              f"{figs['ttft_p50_ratio']}x of the cache off")


# (b) the cluster ------------------------------------------------------------------------

async def cluster_round(client, prompts: list[tuple[int, str]], prefix_tokens: int,
                        concurrency: int, out_tok: int) -> dict:
    slots = asyncio.Semaphore(concurrency)
    cached, per_worker, computed = [0], {}, {}

    async def one(prompt: str):
        async with slots:
            out = await client.complete(GenerationRequest(prompt, SamplingParams(
                max_new_tokens=out_tok, temperature=0.0, ignore_eos=True)))
        cached[0] += min(out.cached_tokens, prefix_tokens)
        per_worker[out.worker_id] = per_worker.get(out.worker_id, 0) + 1
        # the work it cost its worker: the prompt tokens computed (not found cached), and
        # its output
        computed[out.worker_id] = (computed.get(out.worker_id, 0) + out.prompt_tokens
                                   - out.cached_tokens + out.completion_tokens)

    await asyncio.gather(*(one(p) for _, p in prompts))
    loads, work = list(per_worker.values()), list(computed.values())
    return {"hit_rate": cached[0] / (prefix_tokens * len(prompts)),
            "max_over_mean": max(loads) / statistics.mean(loads), "per_worker": per_worker,
            "computed_max_over_mean": max(work) / statistics.mean(work)}


def cluster_part(args, model: str, figs: dict) -> str:
    import ray

    from cluster import launch
    from cluster.client import RuntimeClient
    from cluster.config import ClusterConfig
    from worker.models import loader

    tok = loader.load_tokenizer(model)
    n_req = 16 if args.smoke else 64 if args.quick else 128
    prefix_len, workers, n_prefixes = (128 if args.smoke else 512), 3, 4
    prefixes = [tok.decode(instruction(tok, prefix_len + 8, v)) for v in range(n_prefixes)]
    rng = random.Random(1)
    prompts = [(v, prefixes[v] + f" Document {i}: " + document(rng, 24))
               for i, v in enumerate(rng.choices(range(n_prefixes), k=n_req))]
    # KV for about two prefixes a worker, beside the requests running (8 at a time: their
    # own tokens; a prefix they share is held once)
    blocks = (2 * (prefix_len + 16) + 8 * 80) // 16
    rows = []
    for routed in (True, False):
        handles = launch.up(ClusterConfig(
            model=model, num_workers=workers, worker={"num_cpus": 0.1, "num_threads": 1},
            engine={"num_kv_blocks": blocks, "progress": False},
            scheduler={"prefix_margin_tokens": args.margin if routed else -1}))
        try:
            client = RuntimeClient(handles["scheduler"])
            r = asyncio.run(cluster_round(client, prompts, prefix_len, 8, 4))
        finally:
            del handles
            launch.down()
            ray.shutdown()
        key = "routed" if routed else "load_only"
        figs[f"cluster_hit_rate_{key}"] = round(r["hit_rate"], 3)
        figs[f"cluster_max_over_mean_{key}"] = round(r["max_over_mean"], 2)
        figs[f"cluster_computed_max_over_mean_{key}"] = round(r["computed_max_over_mean"], 2)
        rows.append(["prefix-aware" if routed else "by load alone", round(r["hit_rate"], 3),
                     round(r["max_over_mean"], 2), round(r["computed_max_over_mean"], 2),
                     " ".join(str(v) for _, v in sorted(r["per_worker"].items()))])
    return (f"(b) {workers} workers (tiny model, KV for about two prefixes each), "
            f"{n_prefixes} prefixes of {prefix_len} tokens, {n_req} requests in a random "
            "order, 8 at a time:\n\n"
            + table(["routing", "hit rate", "most requests / mean",
                     "most tokens computed / mean", "requests per worker"], rows)
            + "\n\n(tokens computed: a worker's prompt tokens not found cached, and its "
              "output)")


# (c) the batch job ----------------------------------------------------------------------

def batch_part(args, model: str | None, figs: dict) -> str:
    import ray

    from cluster import launch
    from cluster.client import RuntimeClient
    from cluster.config import ClusterConfig
    from deploy.batch_account import Account
    from deploy.batch_input import items, plan
    from deploy.batch_job import process
    from worker.models import loader

    n_rows = 8 if args.smoke else 50 if args.quick else 200
    tok = loader.load_tokenizer(model or loader.resolve_model_dir(None, progress=False))
    shared = tok.decode(instruction(tok, 128 if args.smoke else 600))
    rng = random.Random(2)
    folder = Path(tempfile.mkdtemp(prefix="rayguide-prefix-bench-"))
    src = folder / "in.jsonl"
    with src.open("w") as f:
        for i in range(n_rows):
            f.write(json.dumps({"id": i, "messages": [
                {"role": "system", "content": shared},
                {"role": "user", "content": "Document: " + document(rng, 30)}],
                "schema": SCHEMA, "max_tokens": 32}) + "\n")
    rows, result = [], {}
    for caching in (False, True):
        handles = launch.up(ClusterConfig(
            model=model, num_workers=1, worker={"num_cpus": 0.1},
            engine={"prefix_caching": caching, "progress": False}))
        out_path = folder / f"out-{caching}.jsonl"
        try:
            client = RuntimeClient(handles["scheduler"])
            work = plan(str(src), set())
            t0 = time.perf_counter()
            with out_path.open("w") as out:
                asyncio.run(process(items(str(src), work, defaults={"max_new_tokens": 32,
                                                                    "temperature": 0.0},
                                          default_grammar=None, run_tag="bench"),
                                    client, out, concurrency=32))
            wall = time.perf_counter() - t0
        finally:
            del handles
            launch.down()
            ray.shutdown()
        acc = Account()
        for line in out_path.read_text().splitlines():
            acc.add(json.loads(line))
        result[caching] = wall
        figs[f"batch_valid_share_{'on' if caching else 'off'}"] = round(acc.valid_share, 3)
        rows.append(["on" if caching else "off", round(wall, 1), acc.prompt_tokens,
                     acc.cached_tokens, acc.prompt_tokens - acc.cached_tokens,
                     round(acc.valid_share, 3)])
    figs["batch_job_speedup"] = round(result[False] / result[True], 2)
    return (f"(c) the batch job's loop, one worker ({'tiny' if model else 'default'} model), "
            f"{n_rows} rows: a shared instruction of {len(tok(shared)['input_ids'])} "
            "tokens and a document each, a JSON schema, 32 at a time:\n\n"
            + table(["prefix caching", "seconds", "prompt tokens", "cached", "computed",
                     "valid share"], rows)
            + f"\n\nspeedup {figs['batch_job_speedup']}x")


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="abc", help="which parts to run (a, b, c)")
    ap.add_argument("--margin", type=int, default=4096,
                    help="(b): the scheduler's prefix_margin_tokens with prefix routing")
    args = ap.parse_args()
    from worker.models import loader

    tiny = tiny_model()
    default = tiny if args.smoke else None
    figs: dict = {}
    bodies = []
    if "a" in args.parts:
        bodies.append(engine_part(args, default or str(loader.resolve_model_dir(
            None, progress=False)), figs))
    if "b" in args.parts:
        bodies.append(cluster_part(args, tiny, figs))
    if "c" in args.parts:
        bodies.append(batch_part(args, default, figs))
    finish("prefix_cache", "\n\n".join(bodies), figs, args)


if __name__ == "__main__":
    main()
