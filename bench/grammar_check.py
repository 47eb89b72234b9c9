"""Real-world schemas through POST /v1/grammars (issue 42), and requests that test its
predictions: every schema is checked (concurrently, timed), then sent once as a request at
``max_tokens`` = the predicted shortest output (and, with ``--budget``, once more at that
budget). What must hold: a schema called refused is refused (same error code), one called
exact never answers invalid, a budget of the predicted shortest output is never refused
as too small, and no answer is shorter than the predicted lower bound.

    python -m bench.grammar_check --schemas DIR [--per-split N] [--quick | --smoke] [--json]

``DIR``: JSONSchemaBench's ``data/`` (one sub-folder per split; see bench/realworld.py),
``--per-split`` schemas drawn from each with a fixed seed (``--quick``: 2, default 10);
without it (and in ``--smoke``) the conformance bench's schemas. Each check waits for its
compile the server's ``grammar_check_wait_s``; one answered 202 "compiling" is read back
by GET. ``--json`` keys: schemas, check_wall_s (every check answered, concurrently),
compiling (answered 202), ready_wall_s (every report whole), check_ms_p50, check_ms_max,
exact,
approximated, refused, llguidance, xgrammar (schemas each engine serves), compile_ms_p50,
compile_ms_p99, requests, refused_mismatch (refusals not predicted, or predicted and not
met), exact_invalid (answers invalid under a schema called exact), budget_refused (a
request at the predicted shortest output, or over it, refused as too small),
budget_refused_as_predicted (a ``--budget`` under the predicted shortest output refused as
too small: what the check predicts), below_bound (answers
shorter than ``at_least``), unpredicted_budget_refused (schemas whose shortest output the
check did not find in time, refused at twice the bound: no prediction was made),
exact_cut_unpredicted (answers of such schemas cut unclosed at that budget), unpredicted
(schemas checked, not refused, with no shortest output found), shorter_than_predicted
(valid answers shorter than the predicted shortest output: an estimate above what a
request needed), mismatch_examples.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's packages, not bench/'s
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report  # noqa: E402
from bench.realworld import sample  # noqa: E402


def check_all(url: str, items, concurrency: int) -> tuple[list[dict], float, float]:
    """Every schema checked at once (the server's default wait); those answered 202
    "compiling" are then read back by GET until their report is whole. Returns the
    reports, the wall time until every POST was answered, and until every report was
    whole."""
    import httpx

    def one(item):
        name, schema = item
        body = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema}}}
        start = time.perf_counter()
        r = httpx.post(url + "/v1/grammars", json=body, timeout=600)
        while r.status_code == 429:  # a client's checks have a few compiles at a time:
            # asked again after Retry-After, as a client should (the wait is counted)
            time.sleep(float(r.headers.get("retry-after", "1")))
            r = httpx.post(url + "/v1/grammars", json=body, timeout=600)
        elapsed = time.perf_counter() - start
        if r.status_code not in (200, 202):  # a body the edge refuses (not JSON-schema ...)
            return {"name": name, "schema": schema, "status": "rejected",
                    "http": r.status_code, "code": r.json()["error"]["code"],
                    "check_s": elapsed}
        return {"name": name, "schema": schema, **r.json(), "check_s": elapsed,
                "answered_compiling": r.status_code == 202}

    def whole(rep):
        while rep["status"] == "compiling":
            time.sleep(0.5)
            r = httpx.get(url + f"/v1/grammars/{rep['id']}", timeout=600)
            r.raise_for_status()
            rep = {**rep, **r.json()}
        return rep

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        reports = list(pool.map(one, items))
        answered = time.perf_counter() - t0
        reports = list(pool.map(whole, reports))
    return reports, answered, time.perf_counter() - t0


def verify(url: str, model: str, reports: list[dict], *, budget: int | None,
           concurrency: int) -> dict:
    import openai

    from worker.guided.validation import validate_json

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    mismatches: list[str] = []
    counts = {"requests": 0, "refused_mismatch": 0, "exact_invalid": 0, "budget_refused": 0,
              "below_bound": 0, "unpredicted_budget_refused": 0,
              "budget_refused_as_predicted": 0,
              "exact_cut_unpredicted": 0, "shorter_than_predicted": 0}

    def ask(rep, max_tokens):
        try:
            r = client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": "Answer with JSON."}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": rep["schema"]}})
            return r, None
        except openai.APIStatusError as exc:
            return None, (exc.status_code, (exc.body or {}).get("code"))

    def one(rep):
        out = []
        if rep["status"] == "rejected":
            return out
        short = rep["shortest_output"]
        # no shortest output found in time: a budget well over the bound, not a prediction
        budgets = [short["tokens"] or max(64, 2 * short["at_least"])] + (
            [budget] if budget else [])
        for max_tokens in budgets:
            r, err = ask(rep, max_tokens)
            out.append((rep, max_tokens, r, err))
            if rep["status"] == "refused":
                break  # one refusal is the check
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        results = [x for batch in pool.map(one, reports) for x in batch]
    for rep, max_tokens, r, err in results:
        counts["requests"] += 1
        name, short = rep["name"], rep["shortest_output"]
        if rep["status"] == "refused":
            if err is None or err[1] != rep["error"]["code"]:
                counts["refused_mismatch"] += 1
                mismatches.append(f"{name}: called refused ({rep['error']['code']}), "
                                  f"request got {err or 'an answer'}")
            continue
        if err is not None:
            if err[1] == "budget_too_small" and short["tokens"] is None:
                counts["unpredicted_budget_refused"] += 1  # no shortest output was claimed
                continue
            if err[1] == "budget_too_small" and max_tokens < short["tokens"]:
                # (--budget under the predicted shortest output: the refusal the check
                # predicts)
                counts["budget_refused_as_predicted"] += 1
                continue
            if err[1] == "budget_too_small":
                counts["budget_refused"] += 1
                mismatches.append(f"{name}: max_tokens {max_tokens} (predicted shortest "
                                  f"{short['tokens']}) refused as too small")
            else:
                counts["refused_mismatch"] += 1
                mismatches.append(f"{name}: called {rep['status']}, request refused {err}")
            continue
        choice = r.choices[0]
        if r.usage.completion_tokens < short["at_least"]:
            counts["below_bound"] += 1
            mismatches.append(f"{name}: {r.usage.completion_tokens} tokens, under the "
                              f"bound {short['at_least']}")
        answer_ok = validate_json(rep["schema"], choice.message.content or "") is None
        if (answer_ok and short["tokens"] is not None
                and r.usage.completion_tokens < short["tokens"]):
            # a valid answer shorter than the predicted shortest output: the estimate was
            # above what a request needed
            counts["shorter_than_predicted"] += 1
            mismatches.append(f"{name}: valid in {r.usage.completion_tokens} tokens, under "
                              f"the predicted shortest {short['tokens']}")
        if rep["status"] == "exact" and not answer_ok:
            if short["tokens"] is None and choice.finish_reason == "length":
                # cut at a budget the check made no claim for (it found no shortest output)
                counts["exact_cut_unpredicted"] += 1
                mismatches.append(f"{name}: (no shortest output found) cut unclosed at "
                                  f"max_tokens {max_tokens}")
                continue
            counts["exact_invalid"] += 1
            mismatches.append(f"{name}: called exact, answer invalid at max_tokens "
                              f"{max_tokens}: {(choice.message.content or '')[-100:]!r}")
    return {**counts, "mismatch_examples": mismatches[:8]}


def figures_of(reports: list[dict], wall: float, ready_wall: float) -> dict:
    checked = [r for r in reports if r["status"] != "rejected"]
    compile_ms = sorted(r["compile_ms"] for r in checked if r.get("compile_ms") is not None)
    check_ms = sorted(1e3 * r["check_s"] for r in reports)
    by = lambda key, value: sum(1 for r in checked if r.get(key) == value)  # noqa: E731
    return dict(
        schemas=len(reports), check_wall_s=round(wall, 2), ready_wall_s=round(ready_wall, 2),
        compiling=sum(1 for r in checked if r.get("answered_compiling")),
        check_ms_p50=round(statistics.median(check_ms), 1) if check_ms else 0.0,
        check_ms_max=round(check_ms[-1], 1) if check_ms else 0.0,
        exact=by("status", "exact"), approximated=by("status", "approximated"),
        unpredicted=sum(1 for r in checked if r["status"] != "refused"
                        and not (r.get("shortest_output") or {}).get("tokens")),
        refused=by("status", "refused"), rejected=len(reports) - len(checked),
        llguidance=by("engine", "llguidance"), xgrammar=by("engine", "xgrammar"),
        compile_ms_p50=round(report.percentile(compile_ms, 50), 2) if compile_ms else 0.0,
        compile_ms_p99=round(report.percentile(compile_ms, 99), 2) if compile_ms else 0.0)


def main(argv=None) -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=Path, default=None,
                    help="a folder with one sub-folder of schema files per split "
                         "(JSONSchemaBench's data/)")
    ap.add_argument("--per-split", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None,
                    help="also send each schema at this max_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    per_split = args.per_split or (2 if args.quick else 10)
    items = sample(None if args.smoke else args.schemas, per_split)
    if args.smoke:
        items = items[:3]
    with report.served(args) as (url, name):
        reports, wall, ready_wall = check_all(url, items, args.concurrency)
        figures = figures_of(reports, wall, ready_wall)
        figures.update(verify(url, name, reports, budget=args.budget,
                              concurrency=args.concurrency))
    figures["schemas_from"] = (str(args.schemas) if args.schemas and not args.smoke
                               else "built-in")
    body = report.table(
        ["schemas", "answered in s (all)", "202 compiling / all reports whole in s",
         "check ms p50 / max", "exact / approximated / "
         "refused", "llguidance / xgrammar", "compile ms p50 / p99", "requests",
         "refusals mispredicted", "exact but invalid", "shortest refused", "below bound"],
        [[f'{figures["schemas"]} ({figures["schemas_from"]})', figures["check_wall_s"],
          f'{figures["compiling"]} / {figures["ready_wall_s"]}',
          f'{figures["check_ms_p50"]} / {figures["check_ms_max"]}',
          f'{figures["exact"]} / {figures["approximated"]} / {figures["refused"]}',
          f'{figures["llguidance"]} / {figures["xgrammar"]}',
          f'{figures["compile_ms_p50"]} / {figures["compile_ms_p99"]}', figures["requests"],
          figures["refused_mismatch"], figures["exact_invalid"], figures["budget_refused"],
          figures["below_bound"]]])
    if figures["mismatch_examples"]:
        body += "\n\nMismatches: " + "; ".join(figures["mismatch_examples"])
    report.finish("grammar_check", body, figures, args)


if __name__ == "__main__":
    main()
