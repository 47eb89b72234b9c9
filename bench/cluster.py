"""What the runtime itself costs, and what it buys, through the whole stack.

1. Overhead (tiny random-weight model, so the model costs almost nothing), with 1, 2 and
   4 workers: the scheduler's route() round trip (added to every request), the Ray hop per
   streamed token (a request streamed from a worker actor vs the same engine in this
   process, rounds interleaved), and the session-end broadcast at 1,000 ends/s (messages
   sent, time until every worker released its real sessions).
2. Guided vs unguided through the stack (default model, HTTP, 16 concurrent clients):
   output tokens/s with JSON-schema guidance vs none. The prompt asks for forty people,
   more than the token budget holds, and the schema's shortest output (an empty list)
   fits the budget, so guided requests are admitted and closed near the budget (the
   unguided side ignores EOS and generates max_tokens; the guided side ends up to
   ``closing_margin`` tokens early: the table shows both lengths). Each round runs three
   guided / unguided pairs, the sides alternating; the ratio is of the medians.
3. Against the baseline a user would write in an afternoon, in the same run and Ray
   instance: a Ray Serve deployment whose replicas call HF transformers generate() with
   xgrammar's HF logits processor, one request at a time (as many replicas as we have
   workers, one torch thread each, like our workers). Same model, same requests (a JSON
   schema that completes), 16 concurrent clients. Throughput and validity on both sides.
4. A worker killed under load (tiny model, 2 workers, 32 clients, 60% streaming): requests
   failed (mid-stream ones continue on the other worker), the longest pause a client saw,
   and how soon a new request succeeds. ``--quick`` runs the same with fewer requests;
   ``--smoke`` every part in the fewest requests, the tiny model in part 2 and 3 as well
   (and one worker and one baseline replica there).

    python bench/cluster.py [--quick | --smoke] [--json] [--no-record]

JSON keys: ratio_vs_baseline_16_clients, ratio_guided_stack, failed_requests_worker_kill,
longest_pause_worker_kill_s, recovery_worker_kill_s, plus the overhead figures.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from bench.report import finish, parser, table, tiny_model  # noqa: E402
from bench.report import percentile as pct  # noqa: E402
from cluster import launch  # noqa: E402
from cluster.client import RuntimeClient  # noqa: E402
from core.params import SamplingParams  # noqa: E402
from core.request import GenerationRequest  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402

CLIENTS = 16
ANSWER_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]}
# the guided side's schema: no minItems, so its shortest output ({"people": []}) fits
# every budget the bench uses (with minItems 40 it needs 135 tokens or more: a budget of
# 8, 24 or 48 is refused at admission, budget_too_small)
PEOPLE_SCHEMA = {"type": "object", "properties": {"people": {
    "type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "biography": {"type": "string"}},
        "required": ["name", "biography"]}}}, "required": ["people"]}
TOPICS = ["a sailor", "a chemist", "a painter", "a pilot", "a baker", "a poet", "a judge",
          "a miner", "a nurse", "a farmer", "a singer", "a tailor"]


# 1. overhead ----------------------------------------------------------------------------

def stream_request(n_tokens: int, session: str | None = None) -> GenerationRequest:
    return GenerationRequest([{"role": "user", "content": "Hello"}],
                             SamplingParams(max_new_tokens=n_tokens, temperature=0.0,
                                            ignore_eos=True), session_id=session)


async def per_token_via_ray(client: RuntimeClient, n: int) -> float:
    times, last = [], None
    async for _ in client.generate(stream_request(n)):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return statistics.median(times)


def per_token_local(engine, n: int) -> float:
    engine.add_request(GenerationRequest([{"role": "user", "content": "Hello"}],
                                         SamplingParams(max_new_tokens=n, temperature=0.0,
                                                        ignore_eos=True)))
    times = []
    engine.step()  # prefill
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def broadcast(client: RuntimeClient, handles: dict, n_real: int, n_total: int) -> dict:
    """n_real real sessions (KV on the workers), then n_total ends at 1,000/s."""
    await asyncio.gather(*(client.complete(stream_request(2, f"b{i}")) for i in range(n_real)))
    sched = handles["scheduler"]
    before = (await sched.stats.remote())["broadcast_messages"]
    ids = [f"b{i}" for i in range(n_total)]
    t0 = time.perf_counter()
    for k in range(0, n_total, 10):  # 10 ends per ms-scale tick: 1,000 per second
        await sched.end_sessions.remote(ids[k:k + 10])
        await asyncio.sleep(max(0.0, t0 + (k + 10) / 1000 - time.perf_counter()))
    sent = time.perf_counter()
    while True:
        loads = await asyncio.gather(*(w.load.remote() for w in handles["workers"]))
        if all(ld["live_sessions"] == 0 for ld in loads):
            break
        await asyncio.sleep(0.005)
    released = time.perf_counter()
    msgs = (await sched.stats.remote())["broadcast_messages"] - before
    return {"messages": msgs, "release_after_last_s": released - sent,
            "send_s": sent - t0}


def overhead(quick: bool, model: str, smoke: bool = False) -> tuple[list, dict]:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    local = LLMEngine(EngineConfig(model=model, num_threads=1, progress=False,
                                   num_kv_blocks=128))
    rows, figs = [], {}
    n_tok = 8 if smoke else 64 if quick else 128
    for workers in ((2,) if quick or smoke else (1, 2, 4)):
        handles = launch.up(ClusterConfig(
            model=model, num_workers=workers, worker={"num_cpus": 0.1, "num_threads": 1},
            engine={"num_kv_blocks": 1024, "max_num_seqs": 256}))
        client = RuntimeClient()
        sched = handles["scheduler"]

        async def measure():
            route = []
            for _ in range(10 if smoke else 100 if quick else 300):
                t = time.perf_counter()
                await sched.route.remote(None, 16)
                route.append(time.perf_counter() - t)
            ray_tok, local_tok = [], []
            for _ in range(2 if quick else 4):  # interleaved rounds
                ray_tok.append(await per_token_via_ray(client, n_tok))
                local_tok.append(per_token_local(local, n_tok))
            b = await (broadcast(client, handles, 4, 100) if smoke else
                       broadcast(client, handles, 50 if quick else 300, 1000))
            return route, ray_tok, local_tok, b

        route, ray_tok, local_tok, b = asyncio.run(measure())
        hop = statistics.median(ray_tok) - statistics.median(local_tok)
        rows.append([workers, f"{pct(route, 50) * 1e3:.2f} / {pct(route, 99) * 1e3:.2f}",
                     f"{statistics.median(ray_tok) * 1e3:.2f}",
                     f"{statistics.median(local_tok) * 1e3:.2f}", f"{hop * 1e3:.2f}",
                     b["messages"], f"{b['release_after_last_s'] * 1e3:.0f}"])
        figs.update({f"route_ms_p50_{workers}w": round(pct(route, 50) * 1e3, 3),
                     f"route_ms_p99_{workers}w": round(pct(route, 99) * 1e3, 3),
                     f"ray_hop_ms_per_token_{workers}w": round(hop * 1e3, 3),
                     f"broadcast_messages_1000_ends_{workers}w": b["messages"],
                     f"broadcast_release_ms_{workers}w":
                         round(b["release_after_last_s"] * 1e3, 1)})
        del handles, client, sched
        launch.down()
        _wait_gone()
    return rows, figs


def _wait_gone(timeout=60):
    deadline = time.monotonic() + timeout
    while any(a["namespace"] == "rayguide" for a in ray.util.list_named_actors(True)):
        if time.monotonic() > deadline:
            raise TimeoutError("rayguide actors did not go away")
        time.sleep(0.2)


# 2 and 3. the stack and the baseline ----------------------------------------------------

@serve.deployment(max_ongoing_requests=1, ray_actor_options={"num_cpus": 0.1})
class HFBaseline:
    """What a user writes in an afternoon: HF generate() + xgrammar's logits processor, one
    request at a time per replica."""

    def __init__(self, model_dir: str):
        import torch
        import transformers
        import xgrammar as xgr
        torch.set_num_threads(1)
        self.torch, self.xgr = torch, xgr
        self.tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=torch.float32).eval()
        info = xgr.TokenizerInfo.from_huggingface(self.tok,
                                                  vocab_size=self.model.config.vocab_size)
        self.compiler = xgr.GrammarCompiler(info)

    async def __call__(self, request):
        body = await request.json()
        ids = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
        procs = []
        if body.get("schema"):
            compiled = self.compiler.compile_json_schema(json.dumps(body["schema"]))
            procs = [self.xgr.contrib.hf.LogitsProcessor(compiled)]
        with self.torch.inference_mode():
            out = self.model.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False,
                                      logits_processor=procs,
                                      pad_token_id=self.tok.eos_token_id)
        new = out[0, ids.shape[1]:]
        n = int(len(new))
        if n and int(new[-1]) == self.tok.eos_token_id:
            new = new[:-1]
        return {"text": self.tok.decode(new, skip_special_tokens=True), "tokens": n}


def messages(i: int, long: bool = False):
    ask = ("Describe forty people as JSON with long biographies." if long else
           f"Describe {TOPICS[i % len(TOPICS)]} as JSON with name, age and city.")
    return [{"role": "user", "content": ask}]


async def run_clients(fn, n_requests: int, clients: int = CLIENTS) -> tuple[float, list]:
    """``clients`` concurrent clients share n_requests calls of fn(i); returns (seconds,
    results)."""
    queue = list(range(n_requests))
    results = []

    async def worker():
        while queue:
            results.append(await fn(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - t0, results


def stack(quick: bool, smoke_model: str | None = None) -> tuple[str, dict]:
    """``smoke_model``: a --smoke run's tiny model on both sides, with the fewest requests."""
    import httpx2 as httpx
    import openai

    from deploy import service
    from worker.models.loader import resolve_model_dir

    smoke = smoke_model is not None
    workers = 1 if smoke else 2  # a smoke checks the path: one worker, one baseline replica
    port = 8000 + int(time.time()) % 1000
    svc = service.start(ClusterConfig(model=smoke_model, num_workers=workers,
                                      worker={"num_cpus": 0.1, "num_threads": 1},
                                      engine={"num_kv_blocks": 1024}),
                        port=port)
    serve.run(HFBaseline.options(num_replicas=workers).bind(
        smoke_model or str(resolve_model_dir(None))),
              name="baseline", route_prefix="/baseline")
    oai = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key="none", max_retries=0,
                             timeout=600, http_client=httpx.AsyncClient(timeout=600))
    http = httpx.AsyncClient(timeout=600)
    model = openai.OpenAI(base_url=svc.url + "/v1", api_key="none").models.list().data[0].id
    rounds = 1 if quick or smoke else 3
    pairs = 1 if smoke else 3  # guided / unguided pairs per round, sides alternating
    clients = 4 if smoke else CLIENTS
    n_cmp = 4 if smoke else 16 if quick else 32  # at least one request per client
    n_tok = 8 if smoke else 24 if quick else 48

    async def ours_guided_long(i):
        r = await oai.chat.completions.create(
            model=model, messages=messages(i, long=True), max_tokens=n_tok, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "p", "schema": PEOPLE_SCHEMA}})
        return r.usage.completion_tokens

    async def ours_unguided(i):
        r = await oai.chat.completions.create(
            model=model, messages=messages(i, long=True), max_tokens=n_tok, temperature=0,
            extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    async def ours_answer(i):
        r = await oai.chat.completions.create(
            model=model, messages=messages(i), max_tokens=96, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}})
        c = r.choices[0]
        return c.message.content, c.finish_reason, r.usage.completion_tokens

    async def baseline_answer(i):
        resp = await http.post(svc.url + "/baseline", json={
            "messages": messages(i), "schema": ANSWER_SCHEMA, "max_tokens": 96})
        d = resp.json()
        return d["text"], None, d["tokens"]

    def valid(text):
        try:
            jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
            return True
        except Exception:
            return False

    async def main():
        # warm-up: grammars compiled, both sides loaded
        await ours_guided_long(0), await ours_unguided(0), await ours_answer(0)
        await baseline_answer(0)
        g_rates, u_rates = [], []
        lengths = {"g": [], "u": []}  # output tokens per request, per side
        ours, base = {"s": 0.0, "n": 0, "valid": 0, "tok": 0}, {"s": 0.0, "n": 0, "valid": 0,
                                                                 "tok": 0}
        n_gu = clients * (1 if quick or smoke else 2)
        for r in range(rounds):
            order = [("g", ours_guided_long), ("u", ours_unguided)]
            for p in range(pairs):  # one side's single run swings by a third: several pairs
                for name, fn in (order if (r + p) % 2 == 0 else order[::-1]):
                    secs, toks = await run_clients(fn, n_gu, clients)
                    (g_rates if name == "g" else u_rates).append(sum(toks) / secs)
                    lengths[name] += toks
            sides = [("ours", ours_answer, ours), ("base", baseline_answer, base)]
            for name, fn, acc in (sides if r % 2 == 0 else sides[::-1]):
                secs, res = await run_clients(fn, n_cmp, clients)
                acc["s"] += secs
                acc["n"] += len(res)
                acc["valid"] += sum(valid(t) for t, _, _ in res)
                acc["tok"] += sum(k for _, _, k in res)
        return g_rates, u_rates, lengths, ours, base

    try:
        g_rates, u_rates, lengths, ours, base = asyncio.run(main())
    finally:
        serve.delete("baseline")
        service.stop(svc)
    ratio_guided = statistics.median(g_rates) / statistics.median(u_rates)
    ours_rps, base_rps = ours["n"] / ours["s"], base["n"] / base["s"]
    body = table([f"through the stack ({'tiny' if smoke else 'default'} model, {clients} "
                  "clients)", "value"], [
        ["guided (JSON schema) output tok/s, per round",
         ", ".join(f"{x:.1f}" for x in g_rates)],
        ["unguided output tok/s, per round", ", ".join(f"{x:.1f}" for x in u_rates)],
        ["guided / unguided (medians)", f"{ratio_guided:.3f}"],
        [f"output tokens per request, guided / unguided (max_tokens {n_tok})",
         f"{statistics.mean(lengths['g']):.1f} / {statistics.mean(lengths['u']):.1f}"],
        ["rayguide: requests/s, valid", f"{ours_rps:.3f}, {ours['valid']}/{ours['n']}"],
        ["HF generate + xgrammar on Serve: requests/s, valid",
         f"{base_rps:.3f}, {base['valid']}/{base['n']}"],
        ["rayguide / baseline throughput", f"{ours_rps / base_rps:.2f}"],
        ["output tokens per request (rayguide / baseline)",
         f"{ours['tok'] / ours['n']:.1f} / {base['tok'] / base['n']:.1f}"],
    ])
    figs = {"ratio_guided_stack": round(ratio_guided, 4),
            "ratio_vs_baseline_16_clients": round(ours_rps / base_rps, 3),
            "rayguide_rps_16_clients": round(ours_rps, 4),
            "baseline_rps_16_clients": round(base_rps, 4),
            "rayguide_valid_share": round(ours["valid"] / ours["n"], 4),
            "baseline_valid_share": round(base["valid"] / base["n"], 4)}
    return body, figs


# 4. a worker killed under load --------------------------------------------------------

def fault(quick: bool, model: str, smoke: bool = False) -> tuple[str, dict]:
    """32 clients (streaming and not, guided) against 2 workers with the tiny model; worker
    0 is killed 2 s in. Mid-stream requests continue on the other worker (failover)."""
    import threading

    import openai

    from deploy import service
    from deploy.loadtest import LoadConfig, LoadTest

    port = 8000 + (int(time.time()) + 500) % 1000
    svc = service.start(ClusterConfig(model=model, num_workers=2,
                                      worker={"num_cpus": 0.1, "num_threads": 1},
                                      engine={"num_kv_blocks": 1024},
                                      scheduler={"load_poll_interval_s": 0.5}), port=port)
    try:
        box: dict = {}
        cfg = LoadConfig(url=svc.url, clients=8 if smoke else 32,
                         requests=16 if smoke else 64 if quick else 192,
                         duration_s=300, max_tokens=16 if smoke else 48, stream_share=0.6, session_share=0.2,
                         request_timeout_s=60.0, leak_timeout_s=30.0)
        th = threading.Thread(target=lambda: box.update(r=asyncio.run(LoadTest(cfg).run())))
        th.start()
        time.sleep(2.0)
        ray.kill(launch.handles()["workers"][0], no_restart=False)
        killed_at = time.monotonic()
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key="none", max_retries=0,
                               timeout=30)
        while True:  # until a new request succeeds
            try:
                client.chat.completions.create(
                    model=client.models.list().data[0].id, max_tokens=4,
                    messages=[{"role": "user", "content": "hi"}],
                    extra_body={"guided_choice": ["a", "b"]})
                break
            except openai.APIError:
                time.sleep(0.2)
        recovery = time.monotonic() - killed_at
        th.join()
        r = box["r"]
    finally:
        service.stop(svc)
        # Serve stays up in a Ray instance the service did not start, with this section's
        # proxy port: the next section's service.start would print another port
        serve.shutdown()
    body = table(["a worker killed at 32 clients (tiny model, 2 workers)", "value"], [
        ["requests failed / total", f"{r['failed']} / {r['requests']}"],
        ["errors by kind (examples)", (json.dumps(r["errors"]) + " "
                                       + "; ".join(r["error_examples"])[:300])
         if r["errors"] else "none"],
        ["guided outputs valid", f"{r['guided_valid']} / {r['guided_checked']}"],
        ["longest pause a client saw in its stream", f"{r['longest_pause_s'] * 1e3:.0f} ms"
         if r["longest_pause_s"] is not None else "-"],
        ["a new request succeeded after", f"{recovery:.2f} s"],
        ["leak-free afterwards", str(bool(r["leaks"] and r["leaks"]["leak_free"]))]])
    return body, {"failed_requests_worker_kill": r["failed"],
                  "longest_pause_worker_kill_s": r["longest_pause_s"],
                  "recovery_worker_kill_s": round(recovery, 3),
                  "valid_share_worker_kill": r["valid_share"]}


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    launch.fast_death_notice()  # as rayguide serve / up set it for the Ray they start
    ray.init(address="local", namespace="rayguide", num_cpus=8, include_dashboard=False,
             log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny-llama")
        rows, figs = overhead(args.quick, model, args.smoke)
        fault_body, fault_figs = fault(args.quick, model, args.smoke)
        figs.update(fault_figs)
        stack_body, stack_figs = stack(args.quick, model if args.smoke else None)
    body = table(["workers", "route() p50 / p99 ms", "per token via Ray ms",
                  "per token in-process ms", "Ray hop per token ms",
                  "broadcast msgs / 1,000 ends", "release after last end ms"], rows)
    figs.update(stack_figs)
    ray.shutdown()
    body = ("Runtime overhead (tiny random-weight model):\n\n" + body +
            "\n\nThrough the whole stack (HTTP, Serve, scheduler, 2 workers, default model):"
            "\n\n" + stack_body + "\n\nA worker killed under load (mid-stream failover):\n\n"
            + fault_body)
    finish("cluster", body, figs, args)


if __name__ == "__main__":
    main()
