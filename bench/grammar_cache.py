"""Time to a usable compiled grammar: cold compile vs grammar-cache actor hit vs local hit.

With the default model's tokenizer (vocab 49152), for a small, a medium and a large JSON
schema and a tool-calling structural tag with 50 tools:
- cold compile: xgrammar compile in this process (what every worker would pay without the
  shared cache);
- actor hit: the compiled grammar already in the cache actor: RPC + transfer +
  deserialization (GrammarCacheClient.fetch);
- local hit: the worker's own LRU of deserialized grammars (GuidedDecodingManager);
- child round trip: compile in a child process + serialize + pipe + deserialize (what a
  compile-locally verdict would cost if it were compiled in the killable fallback process
  instead of in-process: the reason verdicts compile in-process under a watchdog).

The client's counters are checked: a run where the worker fell back to compiling by itself
(the cache actor silently skipped) fails.

Then a cluster run (issue 14): 4 workers with a tiny random-weight model (the default
model's tokenizer, so grammars cost what they cost in production), 32 clients, a Zipf mix
over 100 grammars (small, medium and large schemas, 10- to 50-tool structural tags), run
twice in the same process: with the shared cache + grammar-affinity routing + warm
replication (a fresh disk tier), and with per-worker local compiles (no actor, no
affinity). Then a new worker joins the warm cluster and serves known grammars. The full
run sends 256 requests; ``--quick`` sends 40 (smaller large schemas and tool tags, 5 known
grammars for the new worker), about three minutes in all. ``--smoke`` runs every part in
seconds: two grammars in the per-grammar table, then 2 workers, 4 clients, 8 requests.

The per-grammar table runs with the disk tier off: a grammar this node's disk already
holds would be served from there, and the actor would be neither asked nor measured.

JSON keys of the cluster run: grammar_wait_share (requests that waited for a compile or a
deserialize after their grammar's first compile in the cluster was done), its _local
counterpart, compiles_per_distinct_grammar, ttft_p99_ratio_vs_local,
warm_worker_first_hit_ms_p50, and the TTFT percentiles of both sides.

``--worker-first-compile`` turns on the shared side's leases (a grammar's first compile in
the worker that asked for it; README, grammar cache); off by default, as in the config.

    python bench/grammar_cache.py [--quick | --smoke] [--json] [--no-record] [--no-cluster]
                                  [--no-micro] [--worker-first-compile]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, percentile, table, tiny_model  # noqa: E402

STR = {"type": "string", "maxLength": 64}


def small_schema():
    return {"type": "object", "properties": {"name": STR, "age": {"type": "integer"}},
            "required": ["name", "age"]}


def medium_schema():
    address = {"type": "object", "properties": {
        "street": STR, "city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["US", "CA", "MX", "FR", "DE", "JP"]}},
        "required": ["street", "city", "country"]}
    item = {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "name": STR,
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "price": {"type": "number", "minimum": 0}, "tags": {"type": "array", "items": STR,
                                                            "maxItems": 5}},
        "required": ["sku", "quantity", "price"]}
    return {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
        "customer": {"type": "object", "properties": {
            "name": STR, "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "phone": STR, "vip": {"type": "boolean"}}, "required": ["name", "email"]},
        "shipping": address, "billing": address,
        "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 20},
        "status": {"enum": ["new", "paid", "shipped", "delivered", "cancelled"]},
        "notes": {"type": "string", "maxLength": 500},
        "created": {"type": "string", "format": "date-time"}},
        "required": ["order_id", "customer", "items", "status"]}


def large_schema(entities: int = 40):
    defs = {}
    for i in range(entities):
        defs[f"entity{i}"] = {"type": "object", "properties": {
            f"id{i}": {"type": "string", "pattern": f"^E{i}-[0-9]{{6}}$"},
            f"label{i}": {"type": "string", "maxLength": 120},
            f"kind{i}": {"enum": [f"k{i}_{j}" for j in range(12)]},
            f"score{i}": {"type": "number", "minimum": 0, "maximum": 1},
            f"when{i}": {"type": "string", "format": "date"},
            f"refs{i}": {"type": "array", "items": {"type": "integer"}, "maxItems": 8}},
            "required": [f"id{i}", f"kind{i}"]}
    return {"$defs": defs, "type": "object", "properties": {
        f"field{i}": {"$ref": f"#/$defs/entity{i}"} for i in range(entities)},
        "required": [f"field{i}" for i in range(0, entities, 4)]}


def tools_tag(n: int, salt: str = ""):
    """n tools in one structural tag; ``salt`` in the tool names makes tags of equal size
    distinct (an extra trigger no tag begins with is invalid: xgrammar rejects it)."""
    structures = []
    for i in range(n):
        params = {"type": "object", "properties": {
            "query": STR, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            f"option{i}": {"enum": ["a", "b", "c"]}}, "required": ["query"]}
        structures.append({"begin": f'<tool_call>{{"name": "tool_{i}{salt}", "arguments": ',
                           "schema": params, "end": "}</tool_call>"})
    return {"structures": structures, "triggers": ["<tool_call>"]}


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--no-cluster", action="store_true", help="skip the cluster run")
    ap.add_argument("--no-micro", action="store_true", help="skip the per-grammar table")
    ap.add_argument("--worker-first-compile", action="store_true",
                    help="shared side: first compiles in the asking worker (leases)")
    args = ap.parse_args()
    body, figures = ("", {}) if args.no_micro else micro(args)
    if not args.no_cluster:
        size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
        cbody, cfigures = cluster_run(size, args.worker_first_compile)
        body = (body + "\n\n" + cbody).strip()
        figures.update(cfigures)
    # the cluster run alone records a section of its own (the per-grammar table stays)
    finish("grammar_cache_cluster" if args.no_micro else "grammar_cache", body, figures, args)


def micro(args) -> tuple[str, dict]:
    reps = 1 if args.quick or args.smoke else 5

    import ray
    import xgrammar as xgr

    from grammar_cache import envelope
    from grammar_cache.actor import GrammarCacheConfig, get_or_create_actor, wait_ready
    from grammar_cache.client import GrammarCacheClient
    from grammar_cache.compile import compile_spec
    from core.grammar_spec import GrammarSpec
    from worker.guided.guided_process import GuidedDecodingManager
    from worker.models.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None, progress=False))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    cases = [("small schema", GrammarSpec.json_schema(small_schema())),
             ("medium schema", GrammarSpec.json_schema(medium_schema())),
             ("large schema", GrammarSpec.json_schema(large_schema())),
             ("50-tool structural tag", GrammarSpec.structural_tag(tools_tag(50)))]
    if args.quick:  # smaller large schema and tool set, so the run stays under a minute
        cases = cases[:2] + [
            ("large schema (8 entities)", GrammarSpec.json_schema(large_schema(8))),
            ("10-tool structural tag", GrammarSpec.structural_tag(tools_tag(10)))]
    if args.smoke:
        cases = [cases[0], ("2-tool structural tag", GrammarSpec.structural_tag(tools_tag(2)))]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    name = f"bench-{uuid.uuid4().hex[:6]}"
    config = GrammarCacheConfig(compile_timeout_s=120, compile_memory_mb=16384, disk=False)
    actor = get_or_create_actor(config, name=name)
    t = time.perf_counter()
    wait_ready(actor)  # a fresh actor starts its compile processes first
    ready_s = time.perf_counter() - t
    client = GrammarCacheClient(info, config, name=name)
    manager = GuidedDecodingManager(info, fetch=client.fetch)
    rows, figures = [], {}
    for label, spec in cases:
        def cold():
            compile_spec(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), spec)

        cold_s = timed(cold, max(1, reps // 2))
        client.fetch(spec)  # the actor compiles and keeps it
        actor_s = timed(lambda: client.fetch(spec), reps)
        manager.get_grammar(spec).result()
        local_s = timed(lambda: manager.get_grammar(spec).result(), reps * 20)
        data = ray.get(actor.get.remote(spec, client.fingerprint))
        if not data:
            raise SystemExit("the cache actor does not know this tokenizer after a fetch")
        header = envelope.read_header(data)
        t = time.perf_counter()
        client._compile_in_child(spec, spec.key(client.fingerprint))
        child_s = time.perf_counter() - t
        served = "compile-locally verdict" if header.get("local") else "serialized grammar"
        size = len(data)
        short = label.split()[0] if "schema" in label else "tools"
        figures[f"cold_ms_{short}"] = cold_s * 1e3
        figures[f"actor_hit_ms_{short}"] = actor_s * 1e3
        figures[f"local_hit_us_{short}"] = local_s * 1e6
        figures[f"speedup_actor_hit_{short}"] = cold_s / actor_s
        figures[f"child_roundtrip_ms_{short}"] = child_s * 1e3
        rows.append([label, served, f"{size / 1e6:.2f}", cold_s * 1e3, actor_s * 1e3,
                     local_s * 1e6, cold_s / actor_s, child_s * 1e3])
    stats = ray.get(actor.stats.remote())
    client_stats = client.stats()
    ray.shutdown()
    client.close()
    figures["actor_ready_s"] = ready_s
    for k in ("local_fallbacks", "actor_failures", "registration_retries", "verdicts",
              "actor_hits"):
        figures[f"client_{k}"] = client_stats[k]
    if client_stats["local_fallbacks"] or client_stats["actor_failures"]:
        raise SystemExit(f"the worker compiled without the cache actor: {client_stats}")

    body = table(["grammar", "actor sends", "envelope MB", "cold compile ms", "actor hit ms",
                  "local hit us", "speedup actor hit", "child round trip ms"], rows)
    body += (f"\n\nMedians of {reps} runs (cold compile: {max(1, reps // 2)}; local hit: "
             f"{reps * 20}). Actor: {stats['compiles']} "
             f"compiles, {stats['hits']} hits; compile p50 {stats['compile_p50_s'] * 1e3:.0f} ms "
             "(in its child process). An actor hit of a serialized grammar is dominated by "
             "xgrammar's JSON deserialization (about 25 ms per MB here); where that costs more "
             "than compiling, the actor sends a compile-locally verdict and the hit is an "
             "in-process compile of a grammar proven safe. Child round trip: the same grammar "
             "compiled in the fallback child process and handed back serialized (why verdicts "
             f"compile in-process). Actor ready after {ready_s:.1f} s; client: "
             f"{client_stats['actor_hits']} actor hits, {client_stats['verdicts']} verdicts, "
             f"{client_stats['local_fallbacks']} local fallbacks.")
    return body, figures


# the cluster run ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ClusterSize:
    workers: int
    clients: int
    requests: int
    known: int  # the most requested grammars the joining worker is asked for
    small_mix: bool  # fewer and smaller large schemas and tool tags


SIZES = {"full": ClusterSize(4, 32, 256, 30, False), "quick": ClusterSize(4, 32, 40, 5, True),
         "smoke": ClusterSize(2, 4, 8, 2, True)}


def small_variant(i: int) -> dict:
    return {"type": "object", "properties": {f"name{i}": STR, f"age{i}": {"type": "integer"},
                                             "ok": {"type": "boolean"}},
            "required": [f"name{i}", f"age{i}"]}


def medium_variant(i: int) -> dict:
    schema = medium_schema()
    schema["properties"][f"extra{i}"] = {"enum": [f"v{i}_{j}" for j in range(8)]}
    return schema


def grammar_mix(quick: bool) -> list[tuple[str, object]]:
    """100 grammars: (kind, GrammarSpec). Quick: fewer and smaller large ones."""
    from core.grammar_spec import GrammarSpec
    # distinct large schemas: entity count and a marker field
    large = []
    for i in range(2 if quick else 5):
        schema = large_schema(6 + i if quick else 12 + 2 * i)
        schema["properties"]["marker"] = {"const": i}
        large.append(("large", GrammarSpec.json_schema(schema)))
    tools = [("tools", GrammarSpec.structural_tag(tools_tag(n)))
             for n in ((10, 12, 14, 16, 18, 20, 11, 13, 15, 17, 19, 10, 12, 14, 16) if quick
                       else (10, 13, 16, 19, 22, 25, 28, 31, 34, 37, 40, 43, 46, 49, 50))]
    # equal tool counts differ in their tools' names
    tools = [(k, sp) if j < 11 else ("tools", GrammarSpec.structural_tag(
        tools_tag(int(10 + j), salt=f"_v{j}")))
             for j, (k, sp) in enumerate(tools)]
    medium = [("medium", GrammarSpec.json_schema(medium_variant(i))) for i in range(25)]
    small = [("small", GrammarSpec.json_schema(small_variant(i)))
             for i in range(100 - len(large) - len(tools) - len(medium))]
    mix = small + medium + large + tools
    assert len({sp.key("") for _, sp in mix}) == 100, "grammars must be distinct"
    return mix


def zipf_schedule(mix, n: int, seed: int = 14) -> list[int]:
    """n grammar indices, Zipf (s = 1.1) over a random ranking of the 100 grammars."""
    rng = random.Random(seed)
    ranking = list(range(len(mix)))
    rng.shuffle(ranking)
    # the large schemas ranked where they are drawn a few times (a random rank would often
    # leave them out of a short run)
    for rank, i in zip((4, 11, 19, 29, 41), [i for i, (k, _) in enumerate(mix) if k == "large"]):
        j = ranking.index(i)
        ranking[rank], ranking[j] = ranking[j], ranking[rank]
    weights = [1 / (r + 1) ** 1.1 for r in range(len(mix))]
    return [ranking[rng.choices(range(len(mix)), weights)[0]] for _ in range(n)]


def cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) so far of this machine's processes, by kind: the
    workers, the cache actor, its compile processes, the scheduler, Ray's own."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        for label, needle in (("workers", "WorkerActor"), ("cache actor", "GrammarCacheActor"),
                              ("compile processes", "grammar_cache.compile_worker"),
                              ("scheduler", "Scheduler"), ("ray", "ray")):
            if needle in cmd:
                out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / tick
                break
    return out


def run_side(model: str, mix, schedule, shared: bool, disk_dir: str, size: ClusterSize,
             leases: bool = False) -> dict:
    """One side of the comparison on a fresh runtime: TTFT per request, the workers'
    per-request grammar log, the cache's stats; with ``shared``, a new worker joins at the
    end and serves known grammars."""
    import ray

    from cluster import launch
    from cluster.client import RuntimeClient
    from core.params import SamplingParams
    from core.request import GenerationRequest
    from cluster.config import ClusterConfig
    cache_config = {"compile_timeout_s": 120, "compile_memory_mb": 16384,
                    "disk": shared, "disk_dir": disk_dir, "shared": shared, "replicate": shared,
                    "worker_first_compile": leases}
    config = ClusterConfig(
        model=model, num_workers=size.workers, worker={"num_cpus": 0.25, "num_threads": 1},
        # closing_window 0: no closing search (the tiny model's output is noise; what is
        # measured is the wait for grammars)
        engine={"num_kv_blocks": 512, "max_num_seqs": 64, "closing_window": 0,
                "grammar_timeout_s": 300},
        grammar_cache=cache_config,
        # the local side routes on load alone (a negative margin: no worker qualifies)
        scheduler={"load_poll_interval_s": 0.25,
                   "affinity_margin_tokens": 2048 if shared else -1})
    t = time.perf_counter()
    handles = launch.up(config)
    print(f"{'shared' if shared else 'local'} side up in {time.perf_counter() - t:.1f} s",
          file=sys.stderr, flush=True)
    client = RuntimeClient()
    ttft: list[float] = []
    errors: list[str] = []
    queue = list(schedule)

    by_kind: dict[str, list[float]] = {}

    async def one(kind, spec):
        request = GenerationRequest([{"role": "user", "content": "Answer in JSON."}],
                                    SamplingParams(max_new_tokens=4, temperature=0.0),
                                    grammar=spec)
        t = time.perf_counter()
        first = None
        async for chunk in client.generate(request):
            if first is None:
                first = time.perf_counter() - t
            if chunk.error:
                errors.append(f"{chunk.error_kind}: {chunk.error}"[:160])
        ttft.append(first)
        by_kind.setdefault(kind, []).append(first)
        timeline.append((request.request_id, kind, t - t0, first))

    async def worker_loop():
        while queue:
            await one(*mix[queue.pop()])

    async def clients():
        await asyncio.wait_for(asyncio.gather(*(worker_loop() for _ in range(size.clients))),
                               timeout=1500)

    timeline: list[tuple] = []  # (request id, kind, sent at (s into the run), TTFT)
    cpu0 = cpu_by_process()
    t0 = time.perf_counter()
    asyncio.run(clients())
    wall = time.perf_counter() - t0
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_by_process().items()}
    print(f"{'shared' if shared else 'local'} side: {len(ttft)} requests in {wall:.1f} s; "
          "TTFT p50 / max s by grammar kind: " + ", ".join(
              f"{k} {percentile(v, 50):.1f} / {max(v):.1f} ({len(v)})"
              for k, v in sorted(by_kind.items())) + "; CPU s by process: " + ", ".join(
              f"{k} {v:.0f}" for k, v in sorted(cpu.items())), file=sys.stderr, flush=True)
    logs = [e for w in handles["workers"] for e in ray.get(w.grammar_requests.remote())]
    waits = {e[0]: (e[3], e[4]) for e in logs}
    print("slowest requests (kind, sent at s, TTFT s, waited for its grammar s): " + ", ".join(
        f"{kind} {sent:.1f} {first:.1f} {waits.get(rid, (False, 0.0))[1]:.1f}"
        for rid, kind, sent, first in sorted(timeline, key=lambda e: -e[3])[:8]),
        file=sys.stderr, flush=True)
    loads = ray.get([w.load.remote() for w in handles["workers"]])
    out = {"ttft": ttft, "errors": errors, "logs": logs, "wall_s": wall, "loads": loads,
           "cpu": cpu, "by_kind": by_kind,
           "cache": ray.get(handles["cache"].stats.remote()) if shared else None}
    if shared:
        try:
            out["warm"] = warm_worker(config, handles, mix, schedule, size)
        except ray.exceptions.RayError as exc:  # e.g. Ray's memory monitor killed it
            print(f"WARNING: the new worker failed: {exc}", file=sys.stderr)
            out["warm"] = {"first_hit_s": [], "waited": -1, "known": 0, "prefetches": 0,
                           "started_s": 0.0, "replicated_s": 0.0, "hot": 0,
                           "error": f"{type(exc).__name__}"}
    del client, handles
    launch.down()
    deadline = time.monotonic() + 60
    while any(a["namespace"] == "rayguide" for a in ray.util.list_named_actors(True)):
        if time.monotonic() > deadline:
            raise SystemExit("rayguide actors did not go away")
        time.sleep(0.2)
    return out


def warm_worker(config, handles, mix, schedule, size: ClusterSize) -> dict:
    """A new worker joins the warm cluster: once its background replication is done, its
    first request for each known (hot) grammar, time to the first chunk."""
    import ray

    from core.params import SamplingParams
    from core.request import GenerationRequest
    from grammar_cache.actor import ACTOR_NAME
    from scheduler.actor import NAMESPACE, SCHEDULER_NAME, WORKER_PREFIX
    from worker.actor import WorkerActor
    t0 = time.perf_counter()
    new = WorkerActor.options(name=f"{WORKER_PREFIX}{size.workers}", namespace=NAMESPACE,
                              num_cpus=0.25).remote(
        config.engine, f"w{size.workers}", (SCHEDULER_NAME, NAMESPACE),
        (ACTOR_NAME, NAMESPACE, config.grammar_cache))
    ray.get(new.health.remote())
    started = time.perf_counter() - t0
    hot = ray.get(handles["cache"].stats.remote())["hot"]
    counts: dict[int, int] = {}
    for i in schedule:
        counts[i] = counts.get(i, 0) + 1
    # known grammars: requested at least twice in the run (so hot), the most requested first
    known = [i for i, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n >= 2]
    known = known[:size.known]
    want = {mix[i][1].family for i in known}
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:  # its background replication has fetched them
        load = ray.get(new.load.remote())  # held, or cheap: llguidance's (compiled here)
        if want <= set(load["grammar_families"]) | set(load.get("cheap_grammar_families", ())):
            break
        time.sleep(0.5)
    replicated = time.perf_counter() - t0
    stats = ray.get(new.load.remote())["grammar_client"]
    times, waited = [], 0
    for i in known:
        request = GenerationRequest([{"role": "user", "content": "Answer in JSON."}],
                                    SamplingParams(max_new_tokens=2, temperature=0.0),
                                    grammar=mix[i][1])
        t = time.perf_counter()
        gen = new.generate.remote(request)
        ray.get(next(gen))
        times.append(time.perf_counter() - t)
        for ref in gen:
            ray.get(ref)
    after = ray.get(new.load.remote())["grammar_client"]
    waited = after["grammar_request_waits"] - stats["grammar_request_waits"]
    ray.kill(new, no_restart=True)
    return {"first_hit_s": times, "waited": waited, "known": len(known),
            "prefetches": stats.get("prefetches", 0), "started_s": started,
            "replicated_s": replicated, "hot": hot}


def wait_share(logs) -> tuple[float, int, int]:
    """(share, waits, requests): requests that waited for their grammar although it had
    been ready somewhere in the cluster before they arrived (its first compile was done)."""
    ready: dict[str, float] = {}
    for _, family, arrived, waited, wait_s in logs:
        done = arrived + (wait_s if waited else 0.0)
        ready[family] = min(ready.get(family, done), done)
    late = sum(1 for _, family, arrived, waited, _ in logs
               if waited and arrived > ready[family])
    return (late / len(logs) if logs else 0.0), late, len(logs)


def cluster_run(size: ClusterSize, leases: bool = False) -> tuple[str, dict]:
    import ray
    mix = grammar_mix(size.small_mix)
    n = size.requests
    schedule = zipf_schedule(mix, n)
    tmp = Path(tempfile.mkdtemp(prefix="rayguide-bench-"))
    try:
        model = tiny_model(tmp / "tiny-llama")
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 namespace="rayguide")
        local = run_side(model, mix, list(schedule), False, str(tmp / "disk-local"), size)
        shared = run_side(model, mix, list(schedule), True, str(tmp / "disk"), size, leases)
        ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    share, late, total = wait_share(shared["logs"])
    share_local, late_local, _ = wait_share(local["logs"])
    cache = shared["cache"]
    distinct = len(set(schedule))
    local_compiles = sum(ld["grammar_cache"].get("compiles", 0) for ld in local["loads"])
    p99 = percentile(shared["ttft"], 99)
    p99_local = percentile(local["ttft"], 99)
    warm = shared["warm"]
    kinds: dict[str, int] = {}
    for i in set(schedule):
        kinds[mix[i][0]] = kinds.get(mix[i][0], 0) + 1
    clients = [ld["grammar_client"] for ld in shared["loads"]]
    csum = {k: sum(c.get(k, 0) for c in clients) for k in (
        "prefetches", "actor_hits", "verdicts", "disk_hits", "local_fallbacks",
        "actor_failures", "worker_compiles", "worker_compile_timeouts", "lease_releases",
        "publishes", "publish_failures", "publish_s")}
    csum["publish_max_s"] = max(c.get("publish_max_s", 0.0) for c in clients)
    figures = {
        "grammar_wait_share": round(share, 4),
        "grammar_wait_share_local": round(share_local, 4),
        "compiles_per_distinct_grammar": round(cache["compiles_per_distinct_grammar"], 3),
        # a compile-locally verdict is compiled again in each worker that uses it: counted
        "compiles_per_distinct_grammar_with_verdicts": round(
            (cache["compiles"] + csum["verdicts"]) / max(1, cache["distinct_grammars"]), 3),
        "compiles_per_distinct_grammar_local": round(local_compiles / distinct, 3),
        "ttft_p99_ratio_vs_local": round(p99 / p99_local, 3),
        "ttft_p50_ms": round(percentile(shared["ttft"], 50) * 1e3, 1),
        "ttft_p99_ms": round(p99 * 1e3, 1),
        "ttft_p50_ms_local": round(percentile(local["ttft"], 50) * 1e3, 1),
        "ttft_p99_ms_local": round(p99_local * 1e3, 1),
        "warm_worker_first_hit_ms_p50": round(percentile(warm["first_hit_s"], 50) * 1e3, 1),
        "warm_worker_first_hit_waits": warm["waited"],
        "cluster_requests": total, "cluster_errors": len(shared["errors"]),
        "cluster_errors_local": len(local["errors"]),
        "cluster_joined": cache["joined"],
        **{f"cluster_{k}": v for k, v in csum.items()}}
    if csum["local_fallbacks"] or csum["actor_failures"]:
        # reported, not fatal: on an overloaded machine the client's 2 s ping can time out
        # (each failure skips the actor for 5 s); the table says so
        print(f"WARNING: workers compiled without the cache actor: {csum}", file=sys.stderr)
    rows = [["shared cache + affinity + replication" + (" + leases" if leases else ""),
             total, late, f"{share:.3f}",
             f"{cache['compiles']} / {cache['distinct_grammars']}",
             f"{figures['ttft_p50_ms']:.0f}", f"{figures['ttft_p99_ms']:.0f}",
             f"{shared['wall_s']:.1f}", len(shared["errors"])],
            ["local compiles per worker", len(local["logs"]), late_local,
             f"{share_local:.3f}", f"{local_compiles} / {distinct}",
             f"{figures['ttft_p50_ms_local']:.0f}", f"{figures['ttft_p99_ms_local']:.0f}",
             f"{local['wall_s']:.1f}", len(local["errors"])]]
    kinds_seen = sorted({e.split(":", 1)[0] for side in (shared, local)
                         for e in side["errors"]})
    body = ("#### Cluster run\n\n" + table(
        ["side", "requests", "waited after first compile", "wait share",
         "compiles / distinct grammars", "TTFT p50 ms", "TTFT p99 ms", "wall s", "errors"],
        rows))
    body += (f"\n\n{size.workers} workers (tiny random-weight model, default tokenizer), "
             f"{size.clients} clients, {total} requests, Zipf (s=1.1) over 100 grammars "
             f"({distinct} distinct ones drawn: "
             + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) +
             f"). Error kinds (both sides): {', '.join(kinds_seen) or 'none'}. "
             f"TTFT p99 ratio (shared / local): {figures['ttft_p99_ratio_vs_local']:.2f}. "
             f"Shared side: {csum['prefetches']} prefetches, {csum['actor_hits']} actor hits, "
             f"{csum['verdicts']} compile-locally verdicts (each compiled in the worker: "
             f"{figures['compiles_per_distinct_grammar_with_verdicts']:.2f} compiles per distinct "
             f"grammar counting them), {csum['disk_hits']} disk hits, "
             f"{cache['hot']} hot grammars, {cache['disk_hits']} actor disk hits, "
             f"{csum['local_fallbacks']} local fallbacks after {csum['actor_failures']} "
             "actor failures (ping or RPC timeouts); the actor: "
             f"{cache['joined']} asks joined a compile in flight, {cache.get('leases', 0)} "
             f"leases ({cache.get('lease_lapses', 0)} lapsed, {csum['lease_releases']} given "
             f"back), publications {csum['publish_s'] / max(1, csum['publishes']):.1f} s on "
             f"average, at most {csum['publish_max_s']:.1f} s. "
             f"New worker: started in {warm['started_s']:.1f} s, replicated {warm['prefetches']}"
             f" grammars in {warm['replicated_s']:.1f} s; its first request for each of "
             f"{warm['known']} known grammars: time to first chunk p50 "
             f"{figures['warm_worker_first_hit_ms_p50']:.0f} ms, {warm['waited']} waited for "
             "a grammar.")
    for name, side in (("shared", shared), ("local", local)):
        body += (f"\n\n{name.capitalize()} side, TTFT p50 / max s by grammar kind: " + ", ".join(
            f"{k} {percentile(v, 50):.1f} / {max(v):.1f} (n={len(v)})"
            for k, v in sorted(side["by_kind"].items())) + "; CPU seconds during the run: "
            + ", ".join(f"{k} {v:.0f}" for k, v in sorted(side["cpu"].items()) if v >= 0.5)
            + ".")
    return body, figures


if __name__ == "__main__":
    main()
