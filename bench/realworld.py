"""Real-world schemas through `rayguide serve` (issue 27): each schema sent as the prompt
and as the response format, greedy, a 512-token budget, at the server's defaults (loop
guard on). What must hold: every answer that runs to its budget is valid JSON that
validates, or the request was refused before generating.

    python -m bench.realworld --schemas DIR [--per-split N] [--only NAME,...] [--quick | --smoke] [--json]

``DIR`` is a folder of schema files, one sub-folder per split: JSONSchemaBench's ``data/``
(``git clone https://github.com/guidance-ai/jsonschemabench``; not vendored here: no
licence file in it). ``--per-split`` schemas are drawn from each split with a fixed seed
(``--quick``: 2, default 5). Without ``--schemas`` (and in ``--smoke``) the conformance
bench's own schemas are used, so the bench always runs. ``--json`` keys: requests,
answered, refused (a 4xx before generating: budget, context, a schema the server
refuses), length_share, invalid (answers that do not validate, whatever ended them),
invalid_at_length (those that ran to the budget), loop_share, loop_cut_share,
mean_output_tokens, wall_s, invalid_examples; compliance (answers that validate over
answers), valid_share_all (over requests: a refusal counts as a failure), compliance_<engine> and requests_<engine> per grammar engine that served
(the response's ``guided.engine``; refusals count under ``refused``), latency_p50_s,
latency_max_s (the slowest request, refusals included). ``--engine`` forces the server's
grammar engine (default: the server's default, ``auto``). ``--only`` keeps, of the
sample, the schemas named (``split/stem``, as the progress lines and ``invalid_examples``
name them): a run's failures again, without the rest of its sample.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's packages, not bench/'s
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report  # noqa: E402


def sample(root: Path | None, per_split: int, seed: int = 0) -> list[tuple[str, dict]]:
    """(name, schema) pairs: ``per_split`` from each sub-folder of ``root`` (schemas that
    do not parse as JSON objects are skipped), or the conformance bench's schemas."""
    if root is None:
        from bench.conformance import SCHEMAS
        return list(SCHEMAS.items())
    rng, picked = random.Random(seed), []
    for split in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(split.glob("*.json"))
        rng.shuffle(files)
        taken = 0
        for f in files:
            if taken == per_split:
                break
            try:
                schema = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(schema, dict) and "schema" in schema and "tests" in schema:
                schema = schema["schema"]  # a file holding its schema and test instances
            if isinstance(schema, dict):
                picked.append((f"{split.name}/{f.stem}", schema))
                taken += 1
    return picked


def run(base_url: str, model: str, items, *, max_tokens: int, concurrency: int,
        progress: bool = False) -> dict:
    import openai

    from worker.guided.validation import validate_json

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1800)

    def one(item):
        name, schema = item
        text = json.dumps(schema)
        row = dict(name=name, refused=None, reason=None, valid=False, text="", tokens=0,
                   loop_cut=False, engine=None, latency=0.0)
        start = time.perf_counter()
        try:
            r = client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": f"Write a JSON instance of this "
                                                      f"schema:\n{text}"}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": schema}})
        except openai.APIStatusError as exc:
            row["latency"] = time.perf_counter() - start
            if 400 <= exc.status_code < 500:
                row["refused"] = f"{exc.status_code}: {str(exc)[:120]}"
            else:
                row["reason"], row["text"] = f"http {exc.status_code}", str(exc)[:200]
            if progress:
                print(f'{name}: {row["latency"]:.1f} s, {row["refused"] or row["reason"]}',
                      file=sys.stderr, flush=True)
            return row
        row["latency"] = time.perf_counter() - start
        c = r.choices[0]
        guided = (c.model_extra or {}).get("guided") or {}
        row.update(reason=c.finish_reason, text=c.message.content or "",
                   tokens=r.usage.completion_tokens, loop_cut=bool(guided.get("loop_cut")),
                   engine=guided.get("engine"))
        row["valid"] = validate_json(schema, row["text"]) is None
        if progress:
            print(f'{name}: {row["latency"]:.1f} s, {row["tokens"]} tokens, {row["reason"]}, '
                  f'{row["engine"]}, valid={row["valid"]}', file=sys.stderr, flush=True)
        return row

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, items))
    wall = time.perf_counter() - t0
    answered = [r for r in rows if r["refused"] is None]
    n = max(1, len(answered))
    length = [r for r in answered if r["reason"] == "length"]
    invalid = [r for r in answered if not r["valid"]]
    per_engine = {}
    for r in answered:
        per_engine.setdefault(r["engine"] or "none", []).append(r["valid"])
    latencies = sorted(r["latency"] for r in rows)
    return dict(
        compliance=round(sum(r["valid"] for r in answered) / max(1, len(answered)), 4),
        valid_share_all=round(sum(r["valid"] for r in answered) / max(1, len(rows)), 4),
        **{f"compliance_{e}": round(sum(v) / len(v), 4) for e, v in sorted(per_engine.items())},
        **{f"requests_{e}": len(v) for e, v in sorted(per_engine.items())},
        latency_p50_s=round(statistics.median(latencies), 2) if latencies else 0.0,
        latency_max_s=round(latencies[-1], 2) if latencies else 0.0,
        slowest=[f'{r["name"]}: {r["latency"]:.1f} s, {r["tokens"]} tokens'
                 for r in sorted(rows, key=lambda r: -r["latency"])[:3]],
        requests=len(rows), answered=len(answered),
        refused=len(rows) - len(answered),
        refused_examples=[r["refused"] for r in rows if r["refused"]][:4],
        length_share=round(len(length) / n, 4),
        invalid=len(invalid), invalid_at_length=sum(not r["valid"] for r in length),
        loop_share=round(sum(bool(report.repeated_span(r["text"])) for r in answered) / n, 4),
        loop_cut_share=round(sum(r["loop_cut"] for r in answered) / n, 4),
        mean_output_tokens=round(statistics.mean(r["tokens"] for r in answered), 1)
        if answered else 0.0,
        wall_s=round(wall, 1),
        invalid_examples=[f'{r["name"]} ({r["reason"]}): {r["text"][-120:]}'
                          for r in invalid][:6],
        loop_examples=[f'{r["name"]}: {report.repeated_span(r["text"])!r}' for r in answered
                       if report.repeated_span(r["text"])][:6],
    )


def main(argv=None) -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=Path, default=None,
                    help="a folder with one sub-folder of schema files per split "
                         "(JSONSchemaBench's data/)")
    ap.add_argument("--per-split", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--engine", choices=["auto", "xgrammar", "llguidance"], default=None,
                    help="force the server's grammar engine")
    ap.add_argument("--only", default=None,
                    help="comma-separated schema names (split/stem) to keep of the sample")
    ap.add_argument("--progress", action="store_true",
                    help="one line on stderr per request as it ends")
    args = ap.parse_args(argv)
    if args.engine:  # the engine default of this process and the Ray processes it starts
        os.environ["RAYGUIDE_GRAMMAR_ENGINE"] = args.engine
    per_split = args.per_split or (2 if args.quick else 5)
    items = sample(None if args.smoke else args.schemas, per_split)
    if args.smoke:
        items = items[:2]
    if args.only:
        wanted = set(args.only.split(","))
        items = [item for item in items if item[0] in wanted]
        missing = wanted - {name for name, _ in items}
        if missing:
            ap.error(f"not in the sample: {', '.join(sorted(missing))}")

    with report.served(args) as (url, name):
        figures = run(url + "/v1", name, items, max_tokens=8 if args.smoke else args.max_tokens,
                      concurrency=args.concurrency, progress=args.progress)
    figures["schemas"] = str(args.schemas) if args.schemas and not args.smoke else "built-in"
    figures["engine"] = args.engine or "default"
    body = report.table(
        ["schemas", "engine", "requests", "refused", "compliance", "length share", "invalid",
         "invalid at budget", "loop share", "loop cut share", "mean output tokens",
         "latency p50 / max s", "wall s"],
        [[figures["schemas"], figures["engine"], figures["requests"], figures["refused"],
          figures["compliance"], figures["length_share"], figures["invalid"],
          figures["invalid_at_length"], figures["loop_share"], figures["loop_cut_share"],
          figures["mean_output_tokens"],
          f'{figures["latency_p50_s"]} / {figures["latency_max_s"]}', figures["wall_s"]]])
    per = [k.removeprefix("compliance_") for k in figures if k.startswith("compliance_")]
    if per:
        body += "\n\nBy the engine that served: " + ", ".join(
            f'{e} {figures["compliance_" + e]} of {figures["requests_" + e]}' for e in per)
    report.finish("realworld", body, figures, args)


if __name__ == "__main__":
    main()
