"""Conformance of guided outputs (issue 12): realistic schemas x prompts, at temperature
1.0 and 0, at several token budgets, through the engine (LLMEngine in-process).

    python -m bench.conformance --quick --json          # a few minutes on 2 cores
    python -m bench.conformance --closing-window 0 --no-guards --whitespace bounded
                                                       # "before": no closing, no guards
    python -m bench.conformance --http --quick --json   # the same through HTTP and Serve
    python -m bench.conformance --smoke --json          # seconds: tiny model, 4 requests

Reports the share valid (parses and passes full-schema validation) overall, among "stop"
and among "length"; the share closed early; the runaway share (ended at the budget without
closing); mean output tokens; validation time per request. ``--json`` keys:
valid_share_all, valid_share_stop, valid_share_length, runaway_share, closed_early_share,
mean_output_tokens, validation_us_p50, wall_s, requests, refused, loop_share (outputs
whose text still holds a repeated span: ``report.repeated_span``) (budget below the
grammar's shortest output: a 400 naming it, left out of the shares); per grammar engine
that served the request (``auto`` picks one per grammar): requests_<engine>,
valid_share_all_<engine>, runaway_share_<engine>, loop_share_<engine>.
``--engine auto|xgrammar|llguidance`` (default auto) sets the engine every request asks
for; comma-separated runs each in turn and prints one object per engine.

``run(engine, cases)`` is importable, and ``cases()`` can be sent through any other path
(an HTTP run uses the same schemas and prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's packages, not bench/'s
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STR = {"type": "string"}
SCHEMAS = {
    "planet": {"type": "object", "properties": {"name": STR, "moons": {"type": "integer"}},
               "required": ["name", "moons"]},
    "nested": {"type": "object", "properties": {
        "title": STR, "author": {"type": "object", "properties": {
            "first": STR, "last": STR, "born": {"type": "integer"}},
            "required": ["first", "last"]}}, "required": ["title", "author"]},
    "list_of_objects": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"name": STR, "price": {"type": "number"}},
        "required": ["name", "price"]}}}, "required": ["items"]},
    "enum_optional": {"type": "object", "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "note": {"anyOf": [STR, {"type": "null"}]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["status", "note", "priority"]},
    "numbers": {"type": "object", "properties": {
        "lat": {"type": "number"}, "lon": {"type": "number"},
        "population": {"type": "integer", "minimum": 0}, "ratio": {"type": "number",
                                                                   "minimum": 0, "maximum": 1}},
        "required": ["lat", "lon", "population", "ratio"]},
    "formats": {"type": "object", "properties": {
        "email": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "day": {"type": "string", "format": "date"}},
        "required": ["email", "id", "zip", "day"]},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
            "city": STR, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": STR,
                                                       "minItems": 1}},
             "required": ["tags"]},
}
PROMPTS = [
    "Reply in JSON: describe Saturn.",
    "Write a detailed JSON record for a library book and its author.",
    "Give me JSON for a grocery list with prices.",
    "Answer with JSON only: a support ticket about a broken laptop.",
    "JSON please: the location and population of Paris.",
    "Create a JSON user profile.",
]


def cases(quick: bool, smoke: bool = False):
    """(name, schema, prompt, temperature, budget) for every combination."""
    names = list(SCHEMAS)[:4] + ["numbers", "tags"] if quick else list(SCHEMAS)
    names = ["planet", "tags"] if smoke else list(dict.fromkeys(names))
    prompts = PROMPTS[:1] if smoke else PROMPTS[:2] if quick else PROMPTS
    budgets = (32,) if smoke else (32, 128) if quick else (32, 64, 128, 256)
    for name in names:
        for p in prompts:
            for t in (1.0, 0.0):
                for b in budgets:
                    yield name, SCHEMAS[name], f"{p} Schema: {json.dumps(SCHEMAS[name])}", t, b


def run(engine, items, *, spec_options: dict | None = None, seed: int = 0) -> dict:
    """Sends ``items`` (from ``cases``) through ``engine`` at once; returns the figures."""
    from core.grammar_spec import GrammarSpec
    from worker.engine.sampling import SamplingParams
    from core.request import GenerationRequest
    from worker.guided.validation import validate_json
    from core.errors import ErrorKind

    reqs, meta = [], []
    for i, (name, schema, prompt, temp, budget) in enumerate(items):
        spec = GrammarSpec.json_schema(schema, **(spec_options or {}))
        reqs.append(GenerationRequest([{"role": "user", "content": prompt}],
                                      SamplingParams(max_new_tokens=budget, temperature=temp,
                                                     seed=seed + i), grammar=spec))
        meta.append((name, schema, temp, budget))
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t0
    rows, val_us = [], []
    for r, (name, schema, temp, budget) in zip(reqs, meta):
        out = outs[r.request_id]
        t = time.perf_counter()
        error = validate_json(schema, out.text)
        val_us.append((time.perf_counter() - t) * 1e6)
        refused = out.error_kind == ErrorKind.BUDGET_TOO_SMALL
        rows.append(dict(name=name, temp=temp, budget=budget, reason=out.finish_reason,
                         valid=error is None, closed=bool(out.closed_early),
                         tokens=out.completion_tokens, text=out.text, refused=refused,
                         error=out.error, engine=out.grammar_engine or "none"))
    return summarize(rows, wall, val_us)


def summarize(rows: list[dict], wall: float, val_us: list[float]) -> dict:
    """The bench's figures from one row per request (name, budget, reason, valid, closed,
    tokens, text, refused). A request refused before generating because its budget is
    below the grammar's shortest output (a 400 naming the minimum) is the right answer,
    not an invalid one: it is counted apart and left out of the valid shares."""
    from bench.report import repeated_span

    refused = [r for r in rows if r["refused"]]
    rows = [r for r in rows if not r["refused"]]
    stop = [r for r in rows if r["reason"] == "stop"]
    length = [r for r in rows if r["reason"] == "length"]

    def share(xs, key="valid"):
        return round(sum(1 for x in xs if x[key]) / len(xs), 4) if xs else None

    by_engine = {}
    for name in sorted({r.get("engine") or "none" for r in rows}):
        mine = [r for r in rows if (r.get("engine") or "none") == name]
        by_engine.update({
            f"requests_{name}": len(mine), f"valid_share_all_{name}": share(mine),
            f"runaway_share_{name}": round(sum(
                1 for r in mine if r["reason"] == "length" and not r["closed"]) / len(mine), 4),
            f"loop_share_{name}": round(sum(
                1 for r in mine if repeated_span(r["text"])) / len(mine), 4)})
    return dict(
        **by_engine,
        requests=len(rows) + len(refused), wall_s=round(wall, 1),
        refused=len(refused), refused_examples=sorted({r["error"] for r in refused})[:3],
        valid_share_all=share(rows), valid_share_stop=share(stop),
        valid_share_length=share(length),
        runaway_share=round(sum(1 for r in length if not r["closed"]) / len(rows), 4),
        closed_early_share=share(rows, "closed"),
        loop_share=round(sum(1 for r in rows if repeated_span(r["text"])) / len(rows), 4)
        if rows else None,
        errors=sum(1 for r in rows if r["reason"] == "error"),  # counted invalid too
        mean_output_tokens=round(statistics.mean(r["tokens"] for r in rows), 1),
        validation_us_p50=round(statistics.median(val_us), 1),
        by_budget={b: share([r for r in rows if r["budget"] == b])
                   for b in sorted({r["budget"] for r in rows})},
        invalid_examples=[r["text"][:120] for r in rows if not r["valid"]][:5],
    )


def run_http(items, *, concurrency: int = 16, threads: int = 2,
             grammar_engine: str = "auto") -> dict:
    """The same cases through the whole stack: `rayguide serve`'s service (Ray, Serve, the
    scheduler, one worker with the default model, the server's defaults for the layout and
    guards), the real `openai` client, ``concurrency`` requests in flight. A 400 naming
    the budget is a refusal (see ``summarize``); any other error counts as invalid."""
    import asyncio

    import openai

    from cluster.config import ClusterConfig
    from cluster.launch import free_port
    from deploy import service
    from worker.guided.validation import validate_json

    port = free_port()  # outside the range of outgoing connections
    engine = {} if grammar_engine == "auto" else {"grammar_engine": grammar_engine}
    svc = service.start(ClusterConfig(num_workers=1, worker={"num_threads": threads},
                                      engine=engine), port=port)
    try:
        client = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key="none",
                                    max_retries=0, timeout=900)
        gate = asyncio.Semaphore(concurrency)
        val_us: list[float] = []

        async def one(i, item):
            name, schema, prompt, temp, budget = item
            row = dict(name=name, temp=temp, budget=budget, refused=False, error=None,
                       closed=False, tokens=0, text="", valid=False, reason="error",
                       engine="none")
            async with gate:
                try:
                    r = await client.chat.completions.create(
                        model="SmolLM2-135M-Instruct", max_tokens=budget, temperature=temp,
                        seed=i, messages=[{"role": "user", "content": prompt}],
                        response_format={"type": "json_schema", "json_schema": {
                            "name": name, "schema": schema}})
                except openai.BadRequestError as exc:
                    row.update(refused="max_tokens" in str(exc), error=str(exc)[:200])
                    return row
                except openai.APIError as exc:
                    row.update(error=str(exc)[:200])
                    return row
            c = r.choices[0]
            text = c.message.content or ""
            t = time.perf_counter()
            error = validate_json(schema, text)
            val_us.append((time.perf_counter() - t) * 1e6)
            guided = (r.model_extra or {}).get("guided") or (
                c.model_extra or {}).get("guided") or {}
            row.update(reason=c.finish_reason, valid=error is None, text=text,
                       closed=bool(guided.get("closed_early")),
                       engine=guided.get("engine") or "none",
                       tokens=r.usage.completion_tokens)
            return row

        async def all_of():
            return await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))

        t0 = time.perf_counter()
        rows = asyncio.run(all_of())
        wall = time.perf_counter() - t0
    finally:
        service.stop(svc)
    return summarize(rows, wall, val_us or [0.0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: the tiny random-weight model, 4 requests (checks it runs)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--closing-window", type=int, default=None,
                    help="EngineConfig.closing_window (0: no budget-aware closing)")
    ap.add_argument("--no-guards", action="store_true", help="numbers unbounded")
    ap.add_argument("--whitespace", default=None, help="GrammarSpec whitespace layout")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--http", action="store_true",
                    help="through the whole stack (rayguide serve's service, openai client)")
    ap.add_argument("--engine", default="auto",
                    help="grammar engine: auto (the default: per grammar), xgrammar or "
                         "llguidance; comma-separated runs each in turn (figures per engine)")
    args = ap.parse_args(argv)
    engines = args.engine.split(",")
    if args.http:
        runs = {}
        for name in engines:
            runs[name] = run_http(list(cases(args.quick, args.smoke)), threads=args.threads,
                                  grammar_engine=name)
            runs[name]["config"] = {"path": "http", "engine": name}
        figures = runs[engines[0]] if len(runs) == 1 else runs
        print(json.dumps(figures) if args.json else figures)
        return

    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    cfg = dict(progress=False, num_threads=args.threads, seed=0)
    if args.smoke:
        from bench.report import smoke_model
        cfg["model"] = smoke_model()
    if args.closing_window is not None:
        cfg["closing_window"] = args.closing_window
    engine = LLMEngine(EngineConfig(**cfg))
    opts = {}
    if args.no_guards:
        opts.update(max_int_digits=0, max_frac_digits=0, max_exp_digits=0)
    if args.whitespace:
        opts["whitespace"] = args.whitespace
    runs = {}
    for name in engines:
        runs[name] = run(engine, list(cases(args.quick, args.smoke)),
                         spec_options=dict(opts, engine=name))
        runs[name]["config"] = dict(closing_window=engine.config.closing_window, **opts,
                                    engine=name)
    # one engine: its figures at the top level; several: one object per engine
    figures = runs[engines[0]] if len(runs) == 1 else runs
    if args.json:
        print(json.dumps(figures))  # one object, the last line
        return
    for k, v in figures.items():
        print(f"{k:22s} {v}")


if __name__ == "__main__":
    main()
