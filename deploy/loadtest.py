"""A load generator for the OpenAI endpoint: N concurrent clients (asyncio + the ``openai``
client) send a mix of unguided, JSON-schema, regex, choice and tool-call requests,
streaming and not, some as multi-turn sessions that end with ``DELETE /v1/sessions/{id}``.

Every guided output is checked (JSON parses and validates, regex full-matches, choice is
one of the options, tool-call arguments validate against the tool's schema), and after the
run the workers' live grammar matchers, sessions, running requests and used KV blocks
(read from ``GET /metrics``) must come back to zero. Every loop is bounded: by the request
count, by the duration, and by a per-request timeout (a request that hangs counts as an
error of kind ``timeout``).

    rayguide loadtest --url http://127.0.0.1:8000 --clients 64 --requests 500 [--json]
    python bench/load.py ...                                   # the same

The report: requests/s, output tokens/s, TTFT and inter-token latency p50/p99 (streamed
requests), errors by kind, the valid share of finished guided outputs, the leak check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import ConfigDict, Field

from core.config import ConfigModel
from core.percentile import percentile

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "email": {"type": "string", "maxLength": 40}}, "required": ["name", "age"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"]}},
        "status": {"enum": ["new", "paid", "shipped"]}}, "required": ["id", "items", "status"]},
    "review": {"type": "object", "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "summary": {"type": "string", "maxLength": 60}},
        "required": ["stars", "sentiment", "summary"]},
}
REGEXES = {"date": r"\d{4}-\d{2}-\d{2}", "phone": r"\(\d{3}\) \d{3}-\d{4}",
           "code": r"[A-Z]{3}-[0-9]{4}"}
CHOICES = [["positive", "neutral", "negative"], ["yes", "no"], ["red", "green", "blue"]]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
         "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search", "description": "web search",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string", "maxLength": 40}}, "required": ["query"]}}},
]
PROMPTS = ["Tell me about {x}.", "Describe {x} briefly.", "What do you know about {x}?",
           "Write one line on {x}."]
TOPICS = ["the Moon", "a customer order", "a book review", "Paris", "a new phone", "tea"]
KINDS = ("unguided", "json_schema", "regex", "choice", "tools")


class LoadConfig(ConfigModel):
    model_config = ConfigDict(validate_assignment=True)

    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str | None = None  # default: the first of /v1/models
    clients: int = 16
    requests: int = 200
    duration_s: float = 120.0
    max_tokens: int = 48
    temperature: float = 0.8
    stream_share: float = 0.5
    session_share: float = 0.2  # the share of work units that are multi-turn sessions
    turns: int = 2
    mix: dict[str, float] = Field(default_factory=lambda: {
        "unguided": 0.2, "json_schema": 0.35, "regex": 0.15, "choice": 0.15, "tools": 0.15})
    request_timeout_s: float = 120.0
    check_leaks: bool = True
    leak_timeout_s: float = 30.0
    seed: int = 0


@dataclass
class Result:
    kind: str
    stream: bool
    ok: bool = False
    error: str | None = None  # the error's kind: http_429, timeout, stream_error, ...
    message: str = ""
    finish_reason: str | None = None
    valid: bool | None = None  # guided and finished with stop/tool_calls: did it validate?
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output: str = ""  # kept for invalid outputs, to show what failed
    session: str = ""  # "<session id> turn <n>" for a session's turn
    sent_at: float = 0.0  # seconds from the run's start

    def describe(self) -> str:
        return (f"{self.kind}, {'stream' if self.stream else 'no stream'}"
                f"{', session ' + self.session if self.session else ''}, sent at "
                f"{self.sent_at:.1f} s, latency {self.latency:.1f} s, first token "
                f"{'at %.1f s' % self.ttft if self.ttft is not None else 'not seen'}, "
                f"{self.output_tokens} tokens")


def build(kind: str, rng: random.Random, cfg: LoadConfig) -> tuple[dict, Callable]:
    """(request kwargs, validator(message) -> bool) for one request of this kind."""
    import jsonschema
    prompt = rng.choice(PROMPTS).format(x=rng.choice(TOPICS))
    kw: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}],
                          "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    if kind == "unguided":
        return kw, lambda m: True
    if kind == "json_schema":
        name = rng.choice(list(SCHEMAS))
        schema = SCHEMAS[name]
        kw["max_tokens"] = max(cfg.max_tokens, 96)
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema}}

        def check_json(m):
            try:
                jsonschema.validate(json.loads(m["content"]), schema)
                return True
            except Exception:
                return False
        return kw, check_json
    if kind == "regex":
        pattern = REGEXES[rng.choice(list(REGEXES))]
        kw["extra_body"] = {"guided_regex": pattern}
        return kw, lambda m: re.fullmatch(pattern, m["content"] or "") is not None
    if kind == "choice":
        options = rng.choice(CHOICES)
        kw["extra_body"] = {"guided_choice": options}
        return kw, lambda m: m["content"] in options
    if kind == "tools":
        kw["tools"] = TOOLS
        kw["tool_choice"] = "required"
        kw["max_tokens"] = max(cfg.max_tokens, 96)
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

        def check_calls(m):
            calls = m.get("tool_calls") or []
            try:
                for c in calls:
                    jsonschema.validate(json.loads(c["function"]["arguments"]),
                                        params[c["function"]["name"]])
                return bool(calls)
            except Exception:
                return False
        return kw, check_calls
    raise ValueError(f"unknown workload kind {kind!r}; use {KINDS}")


async def one_request(client, model: str, kind: str, kw: dict, check, stream: bool,
                      cfg: LoadConfig, started: float = 0.0,
                      session: str = "") -> tuple[Result, dict | None]:
    import openai
    res = Result(kind, stream, session=session)
    res.sent_at = time.monotonic() - started
    t0 = time.perf_counter()
    message: dict | None = None

    async def send() -> dict:
        if stream:
            return await _streamed(client, model, kw, res, t0)
        r = await client.chat.completions.create(model=model, **kw)
        c = r.choices[0]
        res.finish_reason = c.finish_reason
        res.output_tokens = r.usage.completion_tokens
        return c.message.model_dump()

    try:
        message = await asyncio.wait_for(send(), cfg.request_timeout_s)
        res.ok = True
    except TimeoutError:
        res.error, res.latency = "timeout", time.perf_counter() - t0
        res.message = f"no answer in {cfg.request_timeout_s:g} s ({res.describe()})"
    except openai.APIStatusError as exc:
        res.error, res.message = f"http_{exc.status_code}", str(exc)[:300]
    except openai.APIError as exc:  # an error event in the stream, a broken connection
        res.error, res.message = type(exc).__name__, str(exc)[:300]
    except Exception as exc:
        res.error, res.message = type(exc).__name__, str(exc)[:300]
    res.latency = time.perf_counter() - t0
    if res.ok and res.finish_reason is None:  # a stream that ended without finishing
        res.ok, res.error = False, "truncated"
    if res.ok and kind != "unguided" and res.finish_reason in ("stop", "tool_calls"):
        res.valid = bool(check(message))
        if not res.valid:
            res.output = json.dumps(message)[:400]
    return res, message


async def _streamed(client, model: str, kw: dict, res: Result, t0: float) -> dict:
    content, calls = [], []
    last = None
    stream = await client.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **kw)
    async for chunk in stream:
        if chunk.usage is not None:
            res.output_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        d = c.delta
        if d.content or d.tool_calls:
            now = time.perf_counter()
            if res.ttft is None:
                res.ttft = now - t0
            elif last is not None:
                res.itl.append(now - last)
            last = now
        if d.content:
            content.append(d.content)
        for tc in d.tool_calls or []:
            calls.append({"id": tc.id, "type": "function",
                          "function": {"name": tc.function.name,
                                       "arguments": tc.function.arguments}})
        if c.finish_reason:
            res.finish_reason = c.finish_reason
    return {"role": "assistant", "content": "".join(content) or None, "tool_calls": calls}


class LoadTest:
    def __init__(self, cfg: LoadConfig):
        self.cfg = cfg
        self.results: list[Result] = []
        self.sessions = 0
        self.session_errors = 0
        self._issued = 0

    def _take(self) -> bool:
        if self._issued >= self.cfg.requests or time.monotonic() > self._deadline:
            return False
        self._issued += 1
        return True

    async def run(self) -> dict:
        import httpx2 as httpx
        import openai
        cfg = self.cfg
        client = openai.AsyncOpenAI(base_url=cfg.url.rstrip("/") + "/v1",
                                    api_key=cfg.api_key or "none", max_retries=0,
                                    timeout=cfg.request_timeout_s,
                                    http_client=httpx.AsyncClient(
                                        limits=httpx.Limits(max_connections=cfg.clients * 2),
                                        timeout=cfg.request_timeout_s))
        model = cfg.model or (await client.models.list()).data[0].id
        self._started = time.monotonic()
        self._deadline = self._started + cfg.duration_s
        started = time.perf_counter()
        await asyncio.gather(*(self._client(client, model, i) for i in range(cfg.clients)))
        elapsed = time.perf_counter() - started
        leaks = await self.leak_check() if cfg.check_leaks else None
        await client.close()
        return self.report(elapsed, leaks)

    async def _client(self, client, model: str, index: int) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1000 + index)
        kinds = list(cfg.mix)
        weights = [cfg.mix[k] for k in kinds]
        while self._take():
            kind = rng.choices(kinds, weights)[0]
            stream = rng.random() < cfg.stream_share
            if rng.random() < cfg.session_share:
                await self._session(client, model, kind, stream, rng)
                continue
            kw, check = build(kind, rng, cfg)
            res, _ = await one_request(client, model, kind, kw, check, stream, cfg,
                                       self._started)
            self.results.append(res)

    async def _session(self, client, model: str, kind: str, stream: bool,
                       rng: random.Random) -> None:
        """A conversation of cfg.turns turns on one session, then an explicit end."""
        sid = f"load-{uuid.uuid4().hex[:12]}"
        kw, check = build(kind, rng, self.cfg)
        kw.setdefault("extra_body", {})["session_id"] = sid
        self.sessions += 1
        for turn in range(self.cfg.turns):
            if turn and not self._take():
                break
            res, msg = await one_request(client, model, kind, kw, check, stream, self.cfg,
                                         self._started, f"{sid} turn {turn + 1}")
            self.results.append(res)
            if not res.ok:
                break
            reply = (msg or {}).get("content") or json.dumps(
                [c["function"] for c in (msg or {}).get("tool_calls") or []])
            kw["messages"] = kw["messages"] + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": rng.choice(["Another one.", "Again, please."])}]
        try:
            # cast_to=object: the JSON as it came (openai 3.3's cast to dict raises)
            r = await client.delete(f"/sessions/{sid}", cast_to=object)
            assert r.get("deleted") is True
        except Exception:
            self.session_errors += 1

    async def leak_check(self) -> dict:
        """Waits until every worker is back to zero; returns the last readings."""
        deadline = time.monotonic() + self.cfg.leak_timeout_s
        while True:
            totals = await read_worker_gauges(self.cfg.url, self.cfg.api_key)
            if totals.get("workers", 0) and all(
                    totals[k] == 0 for k in ("live_processors", "live_sessions", "running",
                                             "waiting", "used_blocks")):
                return {**totals, "leak_free": True}
            if time.monotonic() > deadline:
                return {**totals, "leak_free": False}
            await asyncio.sleep(0.5)

    def report(self, elapsed: float, leaks: dict | None) -> dict:
        rs = self.results
        ok = [r for r in rs if r.ok]
        errors: dict[str, int] = {}
        for r in rs:
            if r.error:
                errors[r.error] = errors.get(r.error, 0) + 1
        guided = [r for r in ok if r.valid is not None]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        itl = [x for r in ok for x in r.itl]
        tokens = sum(r.output_tokens for r in ok)
        by_kind = {k: sum(1 for r in ok if r.kind == k) for k in KINDS}
        return {
            "requests": len(rs), "completed": len(ok), "failed": len(rs) - len(ok),
            "errors": errors, "seconds": round(elapsed, 2),
            "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else 0.0,
            "output_tokens_per_s": round(tokens / elapsed, 2) if elapsed else 0.0,
            "output_tokens": tokens,
            "latency_p50_s": _pct([r.latency for r in ok], 50),
            "latency_max_s": round(max((r.latency for r in ok), default=0.0), 3),
            "slowest": [r.describe() for r in sorted(ok, key=lambda r: -r.latency)[:3]],
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
            # the longest wait between two chunks any client saw (a failover's pause)
            "longest_pause_s": round(max(itl), 4) if itl else None,
            "guided_checked": len(guided), "guided_valid": sum(r.valid for r in guided),
            "valid_share": (round(sum(r.valid for r in guided) / len(guided), 4)
                            if guided else None),
            "length_truncated": sum(1 for r in ok if r.finish_reason == "length"),
            "completed_by_kind": by_kind, "sessions": self.sessions,
            "session_end_errors": self.session_errors,
            "leaks": leaks,
            "error_examples": sorted({f"{r.error}: {r.message[:160]}" for r in rs
                                      if r.error})[:5],
            "invalid_examples": [f"{r.kind} stream={r.stream} {r.finish_reason}: {r.output}"
                                 for r in guided if not r.valid][:5],
        }


async def read_worker_gauges(url: str, api_key: str | None = None) -> dict:
    """Sums the per-worker gauges of GET /metrics (which follows the API key)."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=10, headers=headers) as http:
        text = (await http.get(url.rstrip("/") + "/metrics")).text
    per: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("rayguide_worker_") and "worker" in s.labels:
                per.setdefault(s.labels["worker"], {})[s.name[len("rayguide_worker_"):]] = \
                    s.value
    totals = {"workers": len(per)}
    for name in ("live_processors", "live_sessions", "running", "waiting"):
        totals[name] = int(sum(w.get(name, 0) for w in per.values()))
    totals["used_blocks"] = int(sum(w.get("total_blocks", 0) - w.get("free_blocks", 0)
                                    for w in per.values()))
    return totals


def _pct(values: list[float], p: float) -> float | None:
    """The p-th percentile to 0.1 ms (core.percentile), None without samples."""
    value = percentile(values, p)
    return None if value is None else round(value, 4)


def format_report(r: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f} ms"
    lines = [
        "| figure | value |", "|---|---|",
        f"| requests (completed / failed) | {r['completed']} / {r['failed']} |",
        f"| requests/s | {r['requests_per_s']:.2f} |",
        f"| output tokens/s | {r['output_tokens_per_s']:.1f} |",
        f"| TTFT p50 / p99 | {ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])} |",
        f"| inter-token p50 / p99 / longest | {ms(r['itl_p50_s'])} / {ms(r['itl_p99_s'])} / "
        f"{ms(r['longest_pause_s'])} |",
        f"| guided outputs valid | {r['guided_valid']} / {r['guided_checked']} |",
        f"| finished by length | {r['length_truncated']} |",
        f"| errors by kind | {json.dumps(r['errors']) if r['errors'] else 'none'} |",
        f"| sessions (end errors) | {r['sessions']} ({r['session_end_errors']}) |",
    ]
    if r["leaks"] is not None:
        lk = r["leaks"]
        lines.append(f"| after the run: matchers / sessions / running / used KV blocks | "
                     f"{lk['live_processors']} / {lk['live_sessions']} / {lk['running']} / "
                     f"{lk['used_blocks']} ({'clean' if lk['leak_free'] else 'LEAK'}) |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    d = LoadConfig()
    p.add_argument("--url", default=d.url, help="the endpoint (loopback)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--requests", type=int, default=d.requests, help="total request budget")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds, at most")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--stream-share", type=float, default=d.stream_share)
    p.add_argument("--session-share", type=float, default=d.session_share)
    p.add_argument("--mix", default=None,
                   help="weights, e.g. unguided=1,json_schema=2,regex=1,choice=1,tools=1")
    p.add_argument("--timeout", type=float, default=d.request_timeout_s,
                   help="per request, seconds")
    p.add_argument("--no-leak-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="the report as one JSON line at the end")


def config_from_args(a) -> LoadConfig:
    cfg = LoadConfig(url=a.url, api_key=a.api_key, model=a.model, clients=a.clients,
                     requests=a.requests, duration_s=a.duration, max_tokens=a.max_tokens,
                     stream_share=a.stream_share, session_share=a.session_share,
                     request_timeout_s=a.timeout, check_leaks=not a.no_leak_check,
                     seed=a.seed)
    if a.mix:
        mix = {}
        for part in a.mix.split(","):
            name, _, w = part.partition("=")
            if name not in KINDS:
                raise ValueError(f"--mix: unknown kind {name!r}; use {', '.join(KINDS)}")
            mix[name] = float(w or 1)
        cfg.mix = mix
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rayguide loadtest", description=__doc__.split("\n\n")[0])
    add_args(p)
    a = p.parse_args(argv)
    return run_cli(a)


def run_cli(a) -> int:
    try:
        cfg = config_from_args(a)
    except ValueError as exc:
        print(f"rayguide loadtest: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(LoadTest(cfg).run())
    print(format_report(report))
    if a.json:
        print(json.dumps(report, sort_keys=True))
    clean = report["failed"] == 0 and (report["valid_share"] in (None, 1.0)) and (
        report["leaks"] is None or report["leaks"]["leak_free"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
