"""Real client libraries against `rayguide serve` at server defaults (issue 27): openai's
``chat.completions.parse()``, instructor in ``JSON_SCHEMA`` mode and langchain's
``with_structured_output(method="json_schema")``, each asked for ordinary pydantic models
(a city, a book with its author, a shopping list, a ticket with an enum and optionals, a
product with constraints, an event with a uuid and dates) x several prompts, plus the raw
endpoint with the same schemas.

    python -m bench.clients [--quick | --smoke] [--json] [--no-record]
    python -m bench.clients --sweep [--quick | --smoke] [--json]   # the loop guard's settings

Nothing is set that a new user would not set: no temperature, no max_tokens (the server's
defaults: the model's recommended sampling, the default budget, the loop guard on), and no
client retries (``max_retries=0`` everywhere: a retry would hide a failed answer). Every
HTTP response is recorded under the clients (an httpx transport), so the output figures
cover all four paths. ``--json`` keys: parsed_share_openai, parsed_share_instructor,
parsed_share_langchain (the client returned an object), parsed_share_raw (the raw answer
validates against the model), loop_share (answers whose text still holds a repeated
span, see ``report.repeated_span``), loop_cut_share (answers the loop guard cut),
length_share (answers that ended at the budget), mean_output_tokens, requests, failures (per path: the
exceptions' types), wall_s. ``--smoke`` runs the tiny random-weight model (figures
meaningless) on one model and one prompt.

``--sweep`` is how the loop guard's defaults were chosen: the same models and prompts (the
schema as openai's ``parse()`` sends it), in-process at the default model's recommended
sampling (0.2 / 0.9), two seeds, a 512-token budget, once per loop-guard setting (off, the
defaults, and one knob moved at a time): length share, loop share, cut share, mean output
tokens. ``--json`` keys: sweep (one row per setting).

The client libraries are bench and test dependencies (``pip install -e '.[clients]'``),
never runtime ones.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a file: the repository's packages, not bench/'s
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from bench import report  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"  # replaced by what the server's /v1/models lists


# --- the models a user would write ---------------------------------------------------------

class City(BaseModel):
    name: str
    country: str
    population: int


class Author(BaseModel):
    first_name: str
    last_name: str
    born: Optional[int] = None


class Book(BaseModel):
    title: str
    author: Author
    year: int


class Item(BaseModel):
    name: str
    quantity: int
    price: float


class ShoppingList(BaseModel):
    store: str
    items: list[Item]


class Priority(str, enum.Enum):
    low = "low"
    medium = "medium"
    high = "high"
    urgent = "urgent"


class Ticket(BaseModel):
    title: str
    priority: Priority
    assignee: Optional[str] = None
    tags: list[str] = []


class Product(BaseModel):
    name: str = Field(min_length=1, max_length=60)
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    price: float = Field(gt=0, lt=100000)
    in_stock: bool


class Event(BaseModel):
    id: uuid.UUID
    title: str
    starts_at: dt.datetime
    day: dt.date


PROMPTS = {
    City: ["Tell me about Paris.", "Describe the capital of Japan.",
           "Which city hosts the Golden Gate Bridge? Describe it.",
           "Give me the details of a large city in Brazil.", "Describe Nairobi."],
    Book: ["Describe the novel Dune.", "Tell me about a famous book by Jane Austen.",
           "Give me the details of a classic science fiction book.",
           "What is a good book about the history of Rome?", "Describe Moby-Dick."],
    ShoppingList: ["I need ingredients for pancakes.", "Make a shopping list for a picnic.",
                   "What should I buy for a week of breakfasts?",
                   "Make a hardware store list to fix a leaking tap.",
                   "A shopping list for a birthday party for ten children."],
    Ticket: ["The login page is down, it is urgent, assign it to Alice.",
             "A user reports a typo on the pricing page.",
             "The nightly backup failed twice this week.",
             "Customers cannot download invoices since the last release; high priority.",
             "Please update the docs for the new API version."],
    Product: ["A wireless mouse that costs 25 dollars and is in stock.",
              "Describe a stainless steel water bottle we sell.",
              "A 4K monitor, currently out of stock, priced at 399.",
              "Add our new ergonomic office chair to the catalog.",
              "A pack of AA batteries."],
    Event: ["Team meeting next Monday at 10am.", "A concert on 2025-07-14 at 8pm in Lyon.",
            "Schedule a dentist appointment for March 3rd at 9:30.",
            "The product launch on the first of December at noon UTC.",
            "A webinar about Ray on 2025-02-20 at 15:00."],
}
PATHS = ("openai", "instructor", "langchain", "raw")


def cases(quick: bool, smoke: bool) -> list[tuple[type[BaseModel], str]]:
    models = [City] if smoke else list(PROMPTS)
    n = 1 if smoke else 2 if quick else 5
    return [(m, p) for m in models for p in PROMPTS[m][:n]]


# --- what the figures are made of ----------------------------------------------------------

class _Recorder(httpx.BaseTransport):
    """An httpx transport that keeps every chat completion the clients receive."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        if request.url.path.endswith("/chat/completions") and response.status_code == 200:
            response.read()
            with self.lock:
                self.bodies.append(json.loads(response.content))
        return response

    def close(self):
        self.inner.close()


def _system(model: type[BaseModel]) -> str:
    return f"Answer with a JSON object: a {model.__name__}."


def _ask(path: str, model: type[BaseModel], prompt: str, base_url: str,
         http_client: httpx.Client):
    """One request through ``path``; returns the parsed object, or raises what the client
    raised."""
    messages = [{"role": "system", "content": _system(model)},
                {"role": "user", "content": prompt}]
    if path == "langchain":
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="none", max_retries=0,
                         http_client=http_client, timeout=900)
        return llm.with_structured_output(model, method="json_schema").invoke(
            [(m["role"], m["content"]) for m in messages])
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0,
                           http_client=http_client, timeout=900)
    if path == "openai":
        r = client.chat.completions.parse(model=MODEL_NAME, messages=messages,
                                          response_format=model)
        parsed = r.choices[0].message.parsed
        if parsed is None:
            raise ValueError("parse() returned no object")
        return parsed
    if path == "instructor":
        import instructor

        ic = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
        return ic.chat.completions.create(model=MODEL_NAME, messages=messages,
                                          response_model=model, max_retries=0)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": model.__name__,
                                           "schema": model.model_json_schema()}})
    return model.model_validate_json(r.choices[0].message.content or "")


def run(base_url: str, items, *, concurrency: int = 8) -> dict:
    """Sends every (model, prompt) through each path, ``concurrency`` requests at once;
    returns the figures."""
    recorder = _Recorder()
    http_client = httpx.Client(transport=recorder, timeout=900)
    jobs = [(path, m, p) for m, p in items for path in PATHS]
    results: dict[str, list] = {path: [] for path in PATHS}

    def one(job):
        path, model, prompt = job
        try:
            _ask(path, model, prompt, base_url, http_client)
            return path, None
        except Exception as exc:  # what the client raised is the figure
            return path, f"{type(exc).__name__}: {str(exc)[:160]}"

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for path, error in pool.map(one, jobs):
            results[path].append(error)
    wall = time.perf_counter() - t0
    http_client.close()

    answers = [(c, b) for b in recorder.bodies for c in b.get("choices", [])]
    n = max(1, len(answers))
    texts = [c["message"].get("content") or "" for c, _ in answers]
    loops = [t for t in texts if report.repeated_span(t)]
    guided = [c.get("guided") or b.get("guided") or {} for c, b in answers]
    figures = {f"parsed_share_{path}": round(
        sum(e is None for e in errs) / max(1, len(errs)), 4) for path, errs in results.items()}
    figures.update(
        requests=len(jobs), answers=len(answers),
        loop_share=round(len(loops) / n, 4),
        loop_cut_share=round(sum(bool(g.get("loop_cut")) for g in guided) / n, 4),
        length_share=round(sum(c.get("finish_reason") == "length" for c, _ in answers) / n, 4),
        mean_output_tokens=round(statistics.mean(
            b["usage"]["completion_tokens"] for b in recorder.bodies), 1)
        if recorder.bodies else 0.0,
        wall_s=round(wall, 1),
        failures={path: sorted({e.split(":")[0] for e in errs if e})
                  for path, errs in results.items()},
        failure_examples=[e for errs in results.values() for e in errs if e][:6],
        loop_examples=[report.repeated_span(t) for t in loops][:6],
        length_examples=[t[-100:] for (c, _), t in zip(answers, texts)
                         if c.get("finish_reason") == "length"][:6],
    )
    return figures


SWEEP = {
    "off": {"enabled": False},
    "defaults": {},
    "min_repeats 2": {"min_repeats": 2},
    "min_repeats 4": {"min_repeats": 4},
    "min_chars 32": {"min_chars": 32},
    "progressions off": {"progression_repeats": 0},
    "progressions 5": {"progression_repeats": 5},
    "progressions 12": {"progression_repeats": 12},
}


def sweep(engine, items, settings: dict, *, seeds: int = 2, budget: int = 512) -> list[dict]:
    """One row of figures per loop-guard setting, in-process (see the module doc)."""
    from openai.lib._pydantic import to_strict_json_schema

    from grammar_cache.spec import GrammarSpec
    from worker.engine.loop_guard import LoopGuardParams
    from worker.engine.sampling import SamplingParams
    from worker.engine.sequence import GenerationRequest

    rows = []
    for name, fields in settings.items():
        reqs = [GenerationRequest(
            [{"role": "system", "content": _system(model)}, {"role": "user", "content": p}],
            SamplingParams(max_new_tokens=budget, temperature=0.2, top_p=0.9, seed=seed),
            grammar=GrammarSpec.json_schema(to_strict_json_schema(model)),
            loop_guard=LoopGuardParams(**fields))
            for model, p in items for seed in range(seeds)]
        outs = engine.generate(reqs)
        got = [outs[r.request_id] for r in reqs]
        n = len(got)
        rows.append(dict(
            setting=name, requests=n,
            length_share=round(sum(o.finish_reason == "length" for o in got) / n, 4),
            loop_share=round(sum(bool(report.repeated_span(o.text)) for o in got) / n, 4),
            cut_share=round(sum(bool(o.loop_cuts) for o in got) / n, 4),
            mean_output_tokens=round(statistics.mean(o.completion_tokens for o in got), 1)))
    return rows


def main_sweep(args) -> None:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    cfg = dict(progress=False, num_threads=args.threads, seed=0)
    settings = SWEEP
    if args.smoke:
        cfg["model"] = report.smoke_model()
        settings = {k: SWEEP[k] for k in ("off", "defaults")}
    engine = LLMEngine(EngineConfig(**cfg))
    rows = sweep(engine, cases(args.quick, args.smoke), settings,
                 seeds=1 if args.smoke else 2, budget=16 if args.smoke else 512)
    keys = ["setting", "requests", "length_share", "loop_share", "cut_share",
            "mean_output_tokens"]
    body = report.table(keys, [[r[k] for k in keys] for r in rows])
    report.finish("clients_sweep", body, {"sweep": rows}, args)


def main(argv=None) -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sweep", action="store_true",
                    help="in-process, per loop-guard setting (how the defaults were chosen)")
    args = ap.parse_args(argv)
    if args.sweep:
        main_sweep(args)
        return

    global MODEL_NAME
    with report.served(args) as (url, MODEL_NAME):
        figures = run(url + "/v1", cases(args.quick, args.smoke), concurrency=args.concurrency)
    rows = [[path, figures[f"parsed_share_{path}"], ", ".join(figures["failures"][path]) or "-"]
            for path in PATHS]
    body = (report.table(["path", "parsed share", "what the failures raised"], rows) + "\n\n"
            + report.table(["answers", "loop share", "loop cut share", "length share",
                            "mean output tokens", "wall s"],
                           [[figures["answers"], figures["loop_share"],
                             figures["loop_cut_share"], figures["length_share"],
                             figures["mean_output_tokens"], figures["wall_s"]]]))
    report.finish("clients", body, figures, args)


if __name__ == "__main__":
    main()
