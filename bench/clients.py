"""Real client libraries against `rayguide serve` at server defaults (issue 27): openai's
``chat.completions.parse()`` and ``responses.parse()`` (issue 61: POST /v1/responses),
instructor in ``JSON_SCHEMA`` mode and langchain's
``with_structured_output(method="json_schema")``, each asked for ordinary pydantic models
(a city, a book with its author, a shopping list, a ticket with an enum and optionals, a
product with constraints, an event with a uuid and dates) x several prompts, plus the raw
endpoint with the same schemas.

    python -m bench.clients [--quick | --smoke] [--json] [--no-record]
    python -m bench.clients --sweep [--quick | --smoke] [--json]   # the loop guard's settings
    python -m bench.clients --quick --json --engine auto,xgrammar  # each grammar engine

``--engine`` (default ``auto``, the server's default) sets the workers' grammar engine;
comma-separated, each runs in turn and ``--json`` prints one object per engine. Every run
also splits its figures by the engine that served each answer: answers_<engine>,
parsed_share_<path>_<engine>, length_share_<engine>, loop_cut_share_<engine>.

Nothing is set that a new user would not set: no temperature, no max_tokens (the server's
defaults: the model's recommended sampling, the default budget, the loop guard on), and no
client retries (``max_retries=0`` everywhere: a retry would hide a failed answer). Every
HTTP response is recorded under the clients (an httpx transport; a Response object is read
as the chat answer it is), so the output figures cover all five paths. ``--json`` keys:
parsed_share_openai, parsed_share_responses, parsed_share_instructor,
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

import contextlib
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


class OrderLine(BaseModel):
    item: str
    quantity: int
    unit_price: float


class Order(BaseModel):  # prompts that invite one line per unit: near repeats
    customer: str
    lines: list[OrderLine]


class CityFacts(BaseModel):  # number-heavy
    name: str
    population: int
    area_km2: float
    latitude: float
    longitude: float
    elevation_m: float
    founded: int


class Statistics(BaseModel):  # number-heavy
    count: int
    mean: float
    median: float
    std_dev: float
    minimum: float
    maximum: float


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
    Order: ["Order 12 tacos for the office party, one line per taco.",
            "Twenty bottles of water for the team, each bottle on its own line.",
            "Restock the shelf: 8 cans of tomato soup, each listed separately.",
            "A catering order: tacos, burritos and nachos for 30 people.",
            "Order 10 notebooks and 10 pens, one line per unit."],
    CityFacts: ["Give the facts of Tokyo.", "Describe Lagos with its numbers.",
                "Facts about Reykjavik.", "The figures of New York City.",
                "Describe Sydney with numbers."],
    Statistics: ["Summarize the numbers 3, 7, 7, 19, 24, 31.",
                 "Statistics of the heights 1.62, 1.75, 1.80, 1.68 and 1.91 m.",
                 "Describe the dataset 100, 200, 300, 400.",
                 "Summarize the test scores 55, 67, 72, 88, 90, 94, 99.",
                 "Statistics of 0.001, 0.002, 0.0035, 0.004."],
}
PATHS = ("openai", "responses", "instructor", "langchain", "raw")


def cases(quick: bool, smoke: bool) -> list[tuple[type[BaseModel], str]]:
    models = [City] if smoke else list(PROMPTS)
    n = 1 if smoke else 2 if quick else 5
    return [(m, p) for m in models for p in PROMPTS[m][:n]]


# --- what the figures are made of ----------------------------------------------------------

def _as_chat(response: dict) -> dict:
    """A Response object (POST /v1/responses) as the chat completion the figures read:
    its text, its finish (the budget: "length"), its guided report and its usage."""
    text = "".join(part.get("text", "") for item in response.get("output", [])
                   if item.get("type") == "message" for part in item.get("content", []))
    reason = "length" if (response.get("incomplete_details") or {}).get(
        "reason") == "max_output_tokens" else "stop"
    return {"choices": [{"message": {"content": text}, "finish_reason": reason,
                         "guided": response.get("guided")}],
            "usage": {"completion_tokens": (response.get("usage") or {}).get(
                "output_tokens", 0)}}


class _Recorder(httpx.BaseTransport):
    """An httpx transport that keeps every chat completion (and Response, read as one:
    ``_as_chat``) the clients receive, and per job (``local.job``, set by the thread that
    runs it: the clients are synchronous) the last one it received."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.bodies: list[dict] = []
        self.by_job: dict[int, dict] = {}
        self.local = threading.local()
        self.lock = threading.Lock()

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        path = request.url.path
        if path.endswith(("/chat/completions", "/responses")) and response.status_code == 200:
            response.read()
            body = json.loads(response.content)
            if path.endswith("/responses"):
                body = _as_chat(body)
            with self.lock:
                self.bodies.append(body)
                job = getattr(self.local, "job", None)
                if job is not None:
                    self.by_job[job] = body
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
    if path == "responses":
        r = client.responses.parse(model=MODEL_NAME, instructions=_system(model),
                                   input=prompt, text_format=model)
        if r.output_parsed is None:
            raise ValueError("responses.parse() returned no object")
        return r.output_parsed
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

    def one(indexed):
        index, (path, model, prompt) = indexed
        recorder.local.job = index
        try:
            _ask(path, model, prompt, base_url, http_client)
            return path, None
        except Exception as exc:  # what the client raised is the figure
            return path, f"{type(exc).__name__}: {str(exc)[:160]}"

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        errors = list(pool.map(one, enumerate(jobs)))
    for path, error in errors:
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
        # each with the server's verdict on it (validation, closed early, loop cuts)
        length_examples=[f"{_verdict(g)}: {t[-100:]}" for (c, _), t, g
                         in zip(answers, texts, guided)
                         if c.get("finish_reason") == "length"][:6],
    )
    figures.update(_by_engine(jobs, errors, recorder.by_job))
    for (c, _), t, g in zip(answers, texts, guided):  # whole, to read why (stderr)
        if c.get("finish_reason") == "length":
            print(f"clients: an answer at its budget ({_verdict(g)}):\n{t}", file=sys.stderr)
    return figures


def _verdict(guided: dict) -> str:
    return (f"validation={guided.get('validation')}, closed_early={guided.get('closed_early')}"
            f", loop_cuts={guided.get('loop_cuts')}")


def _served_by(body: dict | None) -> str:
    choice = (body or {}).get("choices", [{}])[0]
    return (choice.get("guided") or (body or {}).get("guided") or {}).get("engine") or "none"


def _by_engine(jobs, errors, by_job: dict[int, dict]) -> dict:
    """The figures per grammar engine that served the answer (``auto`` picks one per
    grammar): answers_<engine>, parsed_share_<path>_<engine>, length_share_<engine>,
    loop_cut_share_<engine> (a job with no answer counts under "none")."""
    out: dict = {}
    engines = sorted({_served_by(by_job.get(i)) for i in range(len(jobs))})
    for name in engines:
        mine = [i for i in range(len(jobs)) if _served_by(by_job.get(i)) == name]
        bodies = [by_job[i] for i in mine if i in by_job]
        out[f"answers_{name}"] = len(mine)
        for path in PATHS:
            ok = [errors[i][1] is None for i in mine if jobs[i][0] == path]
            if ok:
                out[f"parsed_share_{path}_{name}"] = round(sum(ok) / len(ok), 4)
        if bodies:
            choices = [b["choices"][0] for b in bodies]
            out[f"length_share_{name}"] = round(
                sum(c.get("finish_reason") == "length" for c in choices) / len(choices), 4)
            out[f"loop_cut_share_{name}"] = round(
                sum(bool((c.get("guided") or {}).get("loop_cut")) for c in choices)
                / len(choices), 4)
    return out


SWEEP = {
    "off": {"enabled": False},
    "defaults": {},
    "min_repeats 2": {"min_repeats": 2},
    "min_repeats 4": {"min_repeats": 4},
    "min_chars 32": {"min_chars": 32},
    "progressions off": {"progression_repeats": 0},
    "progressions 5": {"progression_repeats": 5},
    "progressions 12": {"progression_repeats": 12},
    "near off": {"near_repeats": 0, "sentence_repeats": 0},
    "near items 5": {"near_repeats": 5},
    "near items 12": {"near_repeats": 12},
    "sentences off": {"sentence_repeats": 0},
    "sentences 3": {"sentence_repeats": 3},
    "sentences 6": {"sentence_repeats": 6},
    "numbers off": {"number_digits": 0},
    "progressions and near off": {"progression_repeats": 0, "near_repeats": 0,
                                  "sentence_repeats": 0},
}


def sweep(engine, items, settings: dict, *, seeds: int = 2, budget: int = 512,
          grammar_engine: str = "auto") -> list[dict]:
    """One row of figures per loop-guard setting, in-process (see the module doc)."""
    from openai.lib._pydantic import to_strict_json_schema

    from core.grammar_spec import GrammarSpec
    from core.params import LoopGuardParams
    from worker.engine.sampling import SamplingParams
    from core.request import GenerationRequest

    rows = []
    for name, fields in settings.items():
        reqs = [GenerationRequest(
            [{"role": "system", "content": _system(model)}, {"role": "user", "content": p}],
            SamplingParams(max_new_tokens=budget, temperature=0.2, top_p=0.9, seed=seed),
            grammar=GrammarSpec.json_schema(to_strict_json_schema(model),
                                            engine=grammar_engine),
            loop_guard=LoopGuardParams(**fields))
            for model, p in items for seed in range(seeds)]
        outs = engine.generate(reqs)
        got = [outs[r.request_id] for r in reqs]
        n = len(got)
        rows.append(dict(
            setting=name, engine=grammar_engine, requests=n,
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
    if args.settings:
        settings = {k: SWEEP[k] for k in args.settings.split(",")}
    engine = LLMEngine(EngineConfig(**cfg))
    rows = []
    for name in args.engine.split(","):
        rows += sweep(engine, cases(args.quick, args.smoke), settings,
                      seeds=1 if args.smoke else 2, budget=16 if args.smoke else 512,
                      grammar_engine=name)
    keys = ["setting", "engine", "requests", "length_share", "loop_share", "cut_share",
            "mean_output_tokens"]
    body = report.table(keys, [[r[k] for k in keys] for r in rows])
    report.finish("clients_sweep", body, {"sweep": rows}, args)


def main(argv=None) -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sweep", action="store_true",
                    help="in-process, per loop-guard setting (how the defaults were chosen)")
    ap.add_argument("--settings", default="",
                    help="--sweep: the SWEEP rows to run, comma-separated (default all)")
    ap.add_argument("--engine", default="auto",
                    help="the server's grammar engine: auto (the default), xgrammar or "
                         "llguidance; comma-separated runs each in turn")
    args = ap.parse_args(argv)
    if args.sweep:
        main_sweep(args)
        return

    global MODEL_NAME
    runs = {}
    for name in args.engine.split(","):
        with _served(args, name) as (url, MODEL_NAME):
            runs[name] = run(url + "/v1", cases(args.quick, args.smoke),
                             concurrency=args.concurrency)
    rows = [[name, path, f[f"parsed_share_{path}"], ", ".join(f["failures"][path]) or "-"]
            for name, f in runs.items() for path in PATHS]
    served_by = sorted({k.split("_", 1)[1] for f in runs.values() for k in f
                        if k.startswith("answers_")})
    body = (report.table(["engine", "path", "parsed share", "what the failures raised"], rows)
            + "\n\n" + report.table(
                ["engine", "answers", "loop share", "loop cut share", "length share",
                 "mean output tokens", "wall s", "served by"],
                [[name, f["answers"], f["loop_share"], f["loop_cut_share"], f["length_share"],
                  f["mean_output_tokens"], f["wall_s"],
                  ", ".join(f"{e} {f[f'answers_{e}']}" for e in served_by
                            if f"answers_{e}" in f)] for name, f in runs.items()]))
    # one engine: its figures at the top level (as before); several: one object per engine
    figures = runs[next(iter(runs))] if len(runs) == 1 else dict(runs)
    if len(runs) == 1:
        figures["engine"] = next(iter(runs))
    report.finish("clients", body, figures, args)


@contextlib.contextmanager
def _served(args, engine: str):
    """report.served with the workers' grammar engine set (``auto``: the server's
    default, nothing set)."""
    if engine == "auto":
        with report.served(args) as served:
            yield served
        return

    from cluster.config import ClusterConfig
    from cluster.launch import free_port
    from deploy import service

    port = free_port()  # outside the range of outgoing connections
    svc = service.start(ClusterConfig(model=report.smoke_model() if args.smoke else None,
                                      num_workers=1, worker={"num_threads": args.threads},
                                      engine={"grammar_engine": engine}), port=port,
                        app_args=report.smoke_app_args(args))
    try:
        yield svc.url, httpx.get(svc.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    finally:
        service.stop(svc)


if __name__ == "__main__":
    main()
