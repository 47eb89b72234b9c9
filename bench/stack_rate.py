"""How much of one worker's engine rate reaches the clients (issue 57).

The tiny random-weight model, whose forward is nearly free, so the engine stands in for a
fast GPU; one worker of one torch thread; 64 and 256 concurrent requests of 256 tokens
(greedy, ``ignore_eos``). Each concurrency is measured four ways, one after the other:
the engine alone in this process (``LLMEngine.step`` in a loop), through Ray
(``RuntimeClient`` in this process, one worker actor), and through HTTP (the Serve app:
its ingress, one replica, the same worker), not streamed and streamed. Each ingress
(``--ingress``, default both: HAProxy, rayguide's default, then Serve's Python proxy)
gets a runtime and a pass of its own, its ratios against its own engine rounds; the
first one's figures carry the plain keys, every one's also ``_<ingress>``. Per way:
delivered output tokens a second (all tokens / the wall time of the round) and each request's time
per output token after its first (``(last - first) / (tokens - 1)``), p50 / p99 over the
requests. Then a single streamed request, the latency-bound case: its time per token and
its chunks' gaps through HTTP next to the engine's step time at batch 1.

    python bench/stack_rate.py [--quick | --smoke] [--json] [--no-record]
    python bench/stack_rate.py --model default [--ingress haproxy] [--sizes ""]

``--model default`` serves the runtime's default model (SmolLM2-135M-Instruct) instead,
a real forward beside the same hops: its sizes default to none (the single streamed
request only; a few hundred tokens a second on 2 cores make the throughput rounds long),
its figures carry ``_default`` (``engine_step_ms_1_default``,
``tpot_ms_http_stream_1_default``, ...) and a JSON key ``model``.

``--quick``: one round of each (a full run takes the median of three). ``--smoke``: 4
requests of 8 tokens. JSON keys: engine_tok_s_{64,256}, ray_over_engine_{64,256},
http_over_engine_{64,256}, http_stream_over_engine_{64,256}, tpot_p99_ms_http_stream_64,
engine_step_ms_1, tpot_ms_http_stream_1, gap_p50_ms_http_stream_1 (and each with
``_haproxy`` / ``_proxy``). Speculation is off: see ``engine_config``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

from bench.report import finish, parser, table, tiny_model  # noqa: E402
from bench.report import percentile as pct  # noqa: E402
from cluster.client import RuntimeClient  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from core.params import SamplingParams  # noqa: E402
from core.request import GenerationRequest  # noqa: E402

PROMPT = [{"role": "user", "content": "Hello"}]
MAX_SEQS = 256


def engine_config(model: str | None, max_seqs: int = MAX_SEQS) -> dict:
    """The worker's engine, here and in the runtime: room for ``max_seqs`` requests of 256
    tokens (``model`` None: the default model). Speculation off: the tiny random model's
    greedy text repeats, so drafts would change the engine's own rate and its chunks from
    run to run (this measures the hops)."""
    return {"model": model, "num_threads": 1, "progress": False, "max_num_seqs": max_seqs,
            "num_kv_blocks": max_seqs * 24, "speculative": False}


def request(n_tok: int) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_new_tokens=n_tok, temperature=0.0,
                                                    ignore_eos=True))


class Round:
    """One way's round: per request, when its tokens came (first, last, count)."""

    def __init__(self):
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.tokens: dict[int, int] = {}
        self.chunks: dict[int, int] = {}
        self.gaps: list[float] = []
        self.t0 = time.perf_counter()
        self.t1 = self.t0

    def got(self, i: int, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = now or time.perf_counter()
        if i in self.last:
            self.gaps.append((now - self.last[i]) / n)
        self.first.setdefault(i, now)
        self.last[i] = now
        self.tokens[i] = self.tokens.get(i, 0) + n
        self.chunks[i] = self.chunks.get(i, 0) + 1

    def done(self) -> "Round":
        self.t1 = time.perf_counter()
        return self

    @property
    def tok_s(self) -> float:
        return sum(self.tokens.values()) / (self.t1 - self.t0)

    def tpot(self) -> list[float]:
        return [(self.last[i] - self.first[i]) / (self.tokens[i] - 1)
                for i in self.tokens if self.tokens[i] > 1]

    @property
    def tokens_per_chunk(self) -> float:
        return sum(self.tokens.values()) / max(1, sum(self.chunks.values()))


def engine_round(engine, n_req: int, n_tok: int) -> Round:
    ids = {}
    for i in range(n_req):
        r = request(n_tok)
        ids[r.request_id] = i
        engine.add_request(r)
    rnd = Round()
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rnd.got(ids[out.request_id], len(out.token_ids), now)
    return rnd.done()


def engine_step_ms(engine, n_tok: int) -> float:
    engine.add_request(request(n_tok))
    engine.step()  # prefill
    times = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def ray_round(client: RuntimeClient, n_req: int, n_tok: int) -> Round:
    rnd = Round()

    async def one(i):
        async for chunk in client.generate(request(n_tok)):
            rnd.got(i, len(chunk.token_ids))

    await asyncio.gather(*(one(i) for i in range(n_req)))
    return rnd.done()


async def http_round(session: aiohttp.ClientSession, url: str, model: str, n_req: int,
                     n_tok: int, stream: bool) -> Round:
    """Streamed: each event's tokens are counted from the usage chunk at the end (an event
    carries text, not a token count), spread over the request's content events by their
    share of its text. Not streamed: one arrival per request."""
    body = {"model": model, "messages": PROMPT, "max_tokens": n_tok, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    rnd = Round()

    async def one(i):
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            if not stream:
                data = await resp.json()
                rnd.got(i, data["usage"]["completion_tokens"])
                return
            events, total = [], None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    total = data["usage"]["completion_tokens"]
                for choice in data["choices"]:
                    text = choice.get("delta", {}).get("content")
                    if text:
                        events.append((time.perf_counter(), len(text)))
            chars = sum(n for _, n in events) or 1
            for when, n in events:
                rnd.got(i, max(1, round(total * n / chars)), when)

    await asyncio.gather(*(one(i) for i in range(n_req)))
    return rnd.done()


def row(name: str, rounds: list[Round], engine_rate: float) -> tuple[list, float]:
    rate = statistics.median(r.tok_s for r in rounds)
    tpot = [t for r in rounds for t in r.tpot() if r.tokens_per_chunk < max(r.tokens.values())]
    per_chunk = statistics.median(r.tokens_per_chunk for r in rounds)
    return [name, f"{rate:.0f}", f"{rate / engine_rate:.2f}" if engine_rate else "1.00",
            f"{pct(tpot, 50) * 1e3:.1f} / {pct(tpot, 99) * 1e3:.1f}" if tpot else "-",
            f"{per_chunk:.1f}"], rate


def measure_ingress(ingress: str, model: str | None, engine, sizes, rounds: int, n_tok: int
                    ) -> tuple[list, dict, list]:
    """One ingress's pass: a runtime of its own in front of which ``ingress`` takes HTTP;
    per size, the engine alone (in this process) then the three ways through the runtime,
    one after the other; then a single streamed request. Rows, figures, the single
    request's rounds."""
    import ray

    from cluster.launch import free_port
    from deploy import service

    cfg = engine_config(model, max(sizes, default=8))
    cfg.pop("model"), cfg.pop("num_threads"), cfg.pop("progress")
    svc = service.start(ClusterConfig(model=model, num_workers=1,
                                      worker={"num_cpus": 0.1, "num_threads": 1},
                                      engine=cfg,
                                      # 256 requests of 256 tokens and their prompts
                                      scheduler={"max_queued_tokens": max(
                                          sizes, default=8) * 1024}),
                        port=free_port(), ingress=ingress)
    rows, figs = [], {}
    try:
        client = RuntimeClient()

        async def measure():
            conn = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=1800)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
                async with session.get(svc.url + "/v1/models") as resp:
                    name = (await resp.json())["data"][0]["id"]
                await ray_round(client, 2, 4)  # warm-up: every path once
                await http_round(session, svc.url, name, 2, 4, True)
                await http_round(session, svc.url, name, 2, 4, False)
                for n in sizes:
                    ways = {"engine": [], "ray": [], "http": [], "http_stream": []}
                    for _ in range(rounds):
                        ways["engine"].append(engine_round(engine, n, n_tok))
                        ways["ray"].append(await ray_round(client, n, n_tok))
                        ways["http"].append(await http_round(session, svc.url, name, n,
                                                             n_tok, False))
                        ways["http_stream"].append(await http_round(
                            session, svc.url, name, n, n_tok, True))
                    base = None
                    for way, label in (("engine", "engine alone, in process"),
                                       ("ray", "through Ray (RuntimeClient)"),
                                       ("http", "through HTTP, not streamed"),
                                       ("http_stream", "through HTTP, streamed")):
                        cells, rate = row(label, ways[way], base)
                        if base is None:
                            base = rate
                            figs[f"engine_tok_s_{n}"] = round(rate, 1)
                        else:
                            figs[f"{way}_over_engine_{n}"] = round(rate / base, 3)
                        rows.append([n, svc.ingress or ingress] + cells)
                    tpot = [t for r in ways["http_stream"] for t in r.tpot()]
                    figs[f"tpot_p99_ms_http_stream_{n}"] = round(pct(tpot, 99) * 1e3, 2)
                return [await http_round(session, svc.url, name, 1, n_tok, True)
                        for _ in range(rounds)]

        single = asyncio.run(measure())
    finally:
        service.stop(svc)
        if ray.is_initialized():
            ray.shutdown()
    if svc.ingress != ingress:
        raise RuntimeError(f"asked for the {ingress} ingress, got {svc.ingress}")
    figs.update(tpot_ms_http_stream_1=round(statistics.median(r.tpot()[0] for r in single)
                                            * 1e3, 3),
                gap_p50_ms_http_stream_1=round(statistics.median(
                    statistics.median(r.gaps) for r in single) * 1e3, 3),
                tokens_per_event_http_stream_1=round(
                    statistics.median(r.tokens_per_chunk for r in single), 2))
    return rows, figs, single


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None,
                    help="concurrent requests, comma-separated (default 64,256; none with "
                         "--model default)")
    ap.add_argument("--ingress", default="haproxy,proxy",
                    help="what takes HTTP, comma-separated, each in a runtime of its own: "
                         "haproxy, proxy (Serve's Python proxy); the first one's figures "
                         "carry the unsuffixed keys")
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny",
                    help="tiny: the random-weight model (a nearly free forward); default: "
                         "SmolLM2-135M-Instruct (sizes default to none: the lone stream)")
    args = ap.parse_args()
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    real = args.model == "default" and not args.smoke
    model = None if real else tiny_model()
    n_tok = 8 if args.smoke else 256
    sizes_arg = args.sizes if args.sizes is not None else ("" if real else "64,256")
    sizes = (4,) if args.smoke else tuple(int(n) for n in sizes_arg.split(",") if n)
    rounds = 1 if args.quick or args.smoke else 3
    ingresses = args.ingress.split(",")
    engine = LLMEngine(EngineConfig(**engine_config(model, max(sizes, default=8))))
    rows, figs, singles = [], {}, []
    for ingress in ingresses:
        got, f, single = measure_ingress(ingress, model, engine, sizes, rounds, n_tok)
        rows += got
        singles.append((ingress, f))
        if not figs:
            figs.update(f)
        figs.update({f"{k}_{ingress}": v for k, v in f.items()
                     if not k.startswith("engine_tok_s")})
    step = statistics.median(engine_step_ms(engine, n_tok) for _ in range(rounds))
    figs["engine_step_ms_1"] = round(step, 3)
    if args.smoke:  # every promised key, whatever sizes a smoke runs
        for n in (64, 256):
            for key in ("engine_tok_s", "ray_over_engine", "http_over_engine",
                        "http_stream_over_engine", "tpot_p99_ms_http_stream"):
                figs.setdefault(f"{key}_{n}", figs.get(f"{key}_4"))
    if real:  # its own keys: the tiny model's figures keep theirs
        figs = {f"{k}_default": v for k, v in figs.items()}
    figs["model"] = "default" if real else "tiny"
    body = table(["concurrent requests", "ingress", "way", "output tok/s",
                  "of the engine alone", "time per token p50 / p99 ms", "tokens per chunk"],
                 rows) if rows else ""
    single_rows = [["engine step, in process", f"{step:.2f}"]]
    for ingress, f in singles:
        single_rows += [
            [f"{ingress}: time per token through HTTP, streamed",
             f"{f['tpot_ms_http_stream_1']:.2f}"],
            [f"{ingress}: gap between its events, per token, p50",
             f"{f['gap_p50_ms_http_stream_1']:.2f}"],
            [f"{ingress}: tokens per event", f"{f['tokens_per_event_http_stream_1']:.2f}"],
            [f"{ingress}: time per token over the engine step (bar 1.2)",
             f"{f['tpot_ms_http_stream_1'] / step:.2f}"]]
        figs[f"tpot_over_step_1_{ingress}" + ("_default" if real else "")] = round(
            f["tpot_ms_http_stream_1"] / step, 3)
    body += ("\n\n" if body else "") + table(["one streamed request (batch 1)", "ms"],
                                              single_rows)
    words = "the default model" if real else "tiny model"
    finish("stack_rate" + ("_default" if real else ""),
           f"{n_tok} tokens a request, one worker ({words}, 1 thread), "
           f"median of {rounds} round(s); each ingress in a runtime of its own, its "
           "ratios against the engine rounds of its own pass:\n\n" + body, figs, args)


if __name__ == "__main__":
    main()
