"""Speculative decoding (prompt-lookup drafts) in the engine: speed with and without.

    python bench/speculative.py [--quick | --smoke] [--json] [--no-record]

A decoding row's draft is what followed, earlier in its own prompt and output, the n-gram
its context ends with (worker/engine/speculative.py); the forward computes the draft beside
the pending token and the row keeps it while the tokens drawn equal it. So what drafting
buys depends on how much of an output repeats its context. Three prompt sets, greedy, on
the default model on the CPU (engine in process):

- extract: documents (invoices, job postings, listings, notes, notices...) and a JSON
  schema of the fields they hold: the answer copies names, dates, ids and amounts from the
  prompt, the case drafting is for;
- json: a free JSON object (``GrammarSpec.json_object()``) describing something, with no
  document to copy from (what repeats: keys, punctuation, the model's own phrases);
- prose: no grammar, a short story or explanation (little to copy: what drafts that miss
  cost).

Each set at batch 1 (requests one after another, one ``generate`` each) and batch 8 (eight
requests in one ``generate``; extract: eight different documents). Two engines share one
model (its weights loaded once): speculative on and off, prefix caching off (each side's
prefill its own), grammars compiled and the forward warmed before any timing. Rounds
alternate which side goes first (off then on, then on then off: this VM's speed drifts);
tok/s is all rounds' output tokens over all rounds' wall time (the mean rate).

Figures per set and batch: tok/s off and on, speedup (on / off); acceptance (the on
engine's accepted draft tokens / draft tokens), accepted tokens per draft (a verification
step that had a draft), output tokens per forward step (engine steps, prefill's included)
off and on; and whether the greedy outputs are token for token the same on and off (they
must be: a draft changes how many forwards a request takes, never its tokens).

Keys: speedup_<set>_b<B>, tok_s_<set>_b<B>_on / _off, tokens_per_step_<set>_b<B>_on / _off
(set: extract, json, prose; B: 1 and 8, 1 and 2 in --smoke), acceptance_<set>,
accepted_per_draft_<set>, identical_<set> (requests equal on and off, all rounds),
compared_<set>, identical_share. --quick: batch 1 on 3 prompts a set, batch 8 once, one
round; --smoke: the tiny random-weight model, one prompt a set at batch 1, batch 2, 24
tokens (48 for extract, whose schemas' shortest answers are longer). --threads: torch's
CPU threads (default: torch's). --overlap: both engines overlapped (the GPU's default
step; on the CPU a forward does not run beside the host, so this measures the overlapped
step's choice of when to draft, engine.py ``_drafts_pay``, not what overlap hides);
recorded as "speculative-overlap", key overlap = 1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, smoke_model, table  # noqa: E402
from core.grammar_spec import GrammarSpec  # noqa: E402
from core.request import GenerationRequest  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402

# (document, its fields: "name" a string, "name:number" a number; all required)
DOCUMENTS = [
    ("INVOICE #INV-2024-0831\n\nNorthwind Office Supply, 4410 Harbor Blvd, Suite 12, Long "
     "Beach, CA 90802. Billed to: Greenleaf Dental Group, attn. Maria Okafor, 77 Elm Street, "
     "Pasadena, CA 91101.\n\nIssued on March 4, 2024; payment due by April 3, 2024. Items: 12 "
     "boxes of nitrile gloves at $18.50, 3 ergonomic chairs at $249.00, one label printer at "
     "$129.99. Subtotal $1,098.99, sales tax $104.40, total due $1,203.39.\n\nPay by bank "
     "transfer to account 0042-7781-93 quoting the invoice number.",
     "invoice_number vendor customer contact_name issue_date due_date total:number "
     "account_number"),
    ("Senior Data Engineer - Riverbend Analytics (job ID RB-4471)\n\nRiverbend Analytics is "
     "hiring a Senior Data Engineer for its Denver office at 1600 Wynkoop Street. The role "
     "reports to Priya Raman, Head of Platform, and is hybrid with three days on site.\n\n"
     "You will build streaming pipelines in Kafka and Spark and own our Snowflake warehouse. "
     "We ask for six years of experience. The salary range is $145,000 to $175,000 plus "
     "equity.\n\nApply by June 30, 2024 at careers.riverbend.io/RB-4471.",
     "job_id title company office_address manager min_salary:number max_salary:number "
     "years_experience:number deadline"),
    ("Aurora Trail 2 Tent - SKU AT2-GRN-0193\n\nThe Aurora Trail 2 by Summit Peak Outfitters "
     "is a two-person backpacking tent weighing 1.6 kg packed. Its floor measures 215 by 130 "
     "cm and the peak height is 105 cm.\n\nColor: forest green. Price: $289.95, on sale for "
     "$239.00 until August 15. Ships from the Portland, Oregon warehouse within 2 business "
     "days. Rated 4.7 out of 5 by 312 reviewers.",
     "sku product_name brand color weight_kg:number price:number sale_price:number "
     "rating:number review_count:number"),
    ("Meeting notes - Project Halcyon steering committee, Tuesday May 14, 2024, 10:00, Room "
     "4B.\n\nPresent: Tomasz Wierzbicki (chair), Aiko Tanaka, Daniel Mensah, Sofia Alvarez. "
     "Notes taken by Aiko Tanaka.\n\nThe committee approved the revised budget of EUR 2.4 "
     "million. Migration of the billing system moves to September 9, 2024. Daniel Mensah "
     "will send the vendor shortlist by May 21.\n\nNext meeting: June 11, 2024 in Room 4B.",
     "project date chair note_taker approved_budget_eur_million:number migration_date "
     "action_owner action_due next_meeting"),
    ("Your order has shipped!\n\nHello Jonas Becker, your order #DE-558120 from Lindqvist "
     "Home was handed to DHL Express on 2024-02-19. Tracking number: JD014600006281937452.\n\n"
     "Delivery address: Jonas Becker, Kastanienallee 38, 10435 Berlin, Germany. Estimated "
     "delivery: 2024-02-22 between 9:00 and 13:00. Package: 2 parcels, total weight 7.4 kg."
     "\n\nQuestions? Contact support@lindqvisthome.se and quote your order number.",
     "order_number customer carrier ship_date tracking_number street city postal_code "
     "delivery_date weight_kg:number"),
    ("For rent: bright 2-bedroom apartment at 512 Maple Avenue, Unit 3C, Toronto, ON M4K "
     "1N5.\n\n850 square feet on the third floor, available from October 1, 2024. Rent is "
     "CAD 2,650 per month, utilities not included; a deposit of CAD 2,650 is required. "
     "Listing ID TOR-88213.\n\nContact the landlord, Henry Liu, at (416) 555-0182 to arrange "
     "a viewing. Pets allowed with approval.",
     "listing_id street_address city postal_code bedrooms:number square_feet:number "
     "monthly_rent:number available_from landlord phone"),
    ("Registration confirmed: PyData Lisbon 2024\n\nDear Chloe Martin, thank you for "
     "registering for PyData Lisbon 2024, held October 17-19, 2024 at the Centro de "
     "Congressos, Praca das Industrias 1, 1300-307 Lisbon. Your registration code is "
     "PDL24-7Q2K9.\n\nTicket type: Full Conference with workshops. Amount paid: EUR 385.00 "
     "by Visa ending 4417, on August 2, 2024.\n\nBadge pickup opens at 8:00 on October 17.",
     "event attendee start_date end_date venue registration_code ticket_type "
     "amount_paid:number payment_date"),
    ("Support ticket #SR-20931 - priority high\n\nOpened on January 8, 2024 by Rahul Desai "
     "(rahul.desai@kestrelbank.com) of Kestrel Bank. The nightly export job on server "
     "db-prod-07 failed three times with error code E4012, and the 02:00 reports were not "
     "delivered.\n\nAssigned to Lena Fischer, Tier 2 support. Target resolution: January 9, "
     "2024, 18:00 UTC. Affected users: about 240.",
     "ticket_id priority opened_on reporter email company server error_code assignee "
     "affected_users:number"),
    ("Booking reference QX7T2M\n\nPassenger: Ms. Ingrid Solberg. Flight SK 1467 from Oslo "
     "Gardermoen (OSL) to Amsterdam Schiphol (AMS) on 12 July 2024, departing 07:35, "
     "arriving 09:40. Seat 14C, economy class, one checked bag of 23 kg.\n\nReturn flight "
     "KL 1147 on 19 July 2024 departing 18:20. Total fare NOK 3,412 including taxes, paid "
     "with Mastercard.",
     "booking_reference passenger flight_number origin destination departure_date "
     "departure_time seat return_flight fare_nok:number"),
]
JSON_TOPICS = ["a fictional seaside hotel: its name, address, rooms and amenities",
               "a used car for sale: make, model, year, mileage, price and features",
               "a hiking trail: its name, length, elevation gain, difficulty and highlights",
               "a small bakery: its owner, opening hours, best sellers and prices",
               "a music festival: its dates, location, headliners and ticket prices",
               "a laptop: its brand, processor, memory, storage, screen and price",
               "a city library: its branches, opening hours, services and events",
               "a recipe for lentil soup: ingredients with amounts and the steps"]
PROSE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain how a refrigerator keeps food cold, in simple terms.",
         "Write a short story about a robot learning to bake bread.",
         "Explain why the sky is blue to a ten-year-old.",
         "Describe a walk through a busy market in the morning.",
         "Explain how vaccines train the immune system.",
         "Write a short fable about a fox and a crow, with a moral.",
         "Explain what a compiler does and why programmers use one."]


def schema(fields: str) -> dict:
    """``"a b:number"`` -> an object schema of those properties, all required."""
    props = {}
    for f in fields.split():
        name, _, kind = f.partition(":")
        props[name] = {"type": kind or "string"}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def prompt_sets(smoke: bool) -> dict[str, list[tuple[list, GrammarSpec | None, int]]]:
    """set -> its cases: (chat messages, grammar, max_new_tokens)."""
    extract = []
    for doc, fields in DOCUMENTS:
        names = ", ".join(f.partition(":")[0] for f in fields.split())
        extract.append(([{"role": "user", "content": f"Extract the following fields from "
                          f"the document as JSON: {names}.\n\n{doc}"}],
                        GrammarSpec.json_schema(schema(fields)), 48 if smoke else 200))
    anything = GrammarSpec.json_object()
    free = [([{"role": "user", "content": f"Describe {t} as a JSON object."}], anything,
             24 if smoke else 150) for t in JSON_TOPICS]
    prose = [([{"role": "user", "content": p}], None, 24 if smoke else 150) for p in PROSE]
    return {"extract": extract, "json": free, "prose": prose}


def counters(engine: LLMEngine) -> tuple[int, int, int, int]:
    """(forward steps, draft tokens, accepted draft tokens, drafts): cumulative."""
    s = engine.stats()
    drafts = engine.drafter.drafts if engine.drafter is not None else 0
    return engine.num_steps, s.draft_tokens, s.accepted_draft_tokens, drafts


def measure(engine: LLMEngine, cases, batch: int):
    """Runs ``cases`` in groups of ``batch`` (one ``generate`` a group): (each request's
    token ids, output tokens, wall seconds, counters' deltas)."""
    before, ids, produced = counters(engine), [], 0
    t = time.perf_counter()
    for i in range(0, len(cases), batch):
        reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=n, temperature=0.0),
                                  grammar=g) for p, g, n in cases[i:i + batch]]
        got = engine.generate(reqs)
        for r in reqs:
            out = got[r.request_id]
            if out.finish_reason == "error":
                raise SystemExit(f"a request failed: {out.error}")
            ids.append(out.token_ids)
            produced += out.completion_tokens
    wall = time.perf_counter() - t
    return ids, produced, wall, [a - b for a, b in zip(counters(engine), before)]


def differs(engine: LLMEngine, name: str, batch: int, k: int, off: list, on: list) -> None:
    """The loud line of an output that drafting changed (a bug: it must not)."""
    at = next((i for i, (a, b) in enumerate(zip(off, on)) if a != b), min(len(off), len(on)))
    dec = engine.tokenizer.decode
    print(f"!!! WARNING: {name} batch {batch} request {k}: outputs differ with speculation "
          f"(from token {at} of {len(off)} off / {len(on)} on)\n    off: "
          f"{dec(off[max(0, at - 8):at + 16])!r}\n    on:  {dec(on[max(0, at - 8):at + 16])!r}",
          flush=True)


def main(argv=None) -> None:
    ap = parser(__doc__.split("\n")[0])
    # torch's own thread count by default, as a worker runs; on a busy 2-core VM its two
    # threads wait on each other and steps ran 5-20 times slower at random, on either side
    # (--threads 1 there; run it on a quiet machine)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's)")
    ap.add_argument("--overlap", action="store_true",
                    help="both engines with the overlapped step (the GPU's default)")
    args = ap.parse_args(argv)
    model = {"model": smoke_model()} if args.smoke else {}
    common = dict(progress=False, prefix_caching=False, kv_cache_gb=0.5, max_num_seqs=8,
                  num_threads=args.threads, overlap=args.overlap)
    e_on = LLMEngine(EngineConfig(speculative=True, **common, **model))
    e_off = LLMEngine(EngineConfig(speculative=False, **common, **model), model=e_on.model,
                      tokenizer=e_on.tokenizer, model_dir=e_on.model_dir)
    engines = {"off": e_off, "on": e_on}
    sets = prompt_sets(args.smoke)
    big = 2 if args.smoke else 8
    b1_requests = 1 if args.smoke else 3 if args.quick else 8
    big_groups = 1 if args.smoke or args.quick else 2
    rounds = 1 if args.smoke or args.quick else 2
    # warm: every grammar compiled on both engines, a first forward of each shape run
    for engine in engines.values():
        for cases in sets.values():
            for _, spec, _ in cases:
                if spec is not None:
                    engine.guided.get_grammar(spec).result(timeout=600)
        measure(engine, [(c[0], c[1], 4) for c in sets["prose"][:2]], 2)
    figures, rows, compared, identical = {}, [], {}, {}
    for name, pool in sets.items():
        drafted = [0, 0, 0]  # the on engine's draft tokens, accepted, drafts: both batches
        compared[name] = identical[name] = 0
        for batch in (1, big):
            n = b1_requests if batch == 1 else batch * big_groups
            cases = [pool[i % len(pool)] for i in range(n)]  # extract: n different documents
            tot = {side: [0, 0.0, 0] for side in engines}  # output tokens, seconds, steps
            acc, same = [0, 0, 0], 0  # the on engine's counters; outputs equal on and off
            for r in range(rounds):
                got = {}
                for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    ids, produced, wall, (steps, dt, at, dr) = measure(engines[side], cases,
                                                                       batch)
                    got[side] = ids
                    t = tot[side]
                    t[0], t[1], t[2] = t[0] + produced, t[1] + wall, t[2] + steps
                    if side == "on":
                        acc = [acc[0] + dt, acc[1] + at, acc[2] + dr]
                for k, (off, on) in enumerate(zip(got["off"], got["on"])):
                    same += off == on
                    if off != on:
                        differs(e_on, name, batch, k, off, on)
            compared[name] += rounds * len(cases)
            identical[name] += same
            drafted = [a + b for a, b in zip(drafted, acc)]
            tok_s = {side: t[0] / t[1] for side, t in tot.items()}
            per_step = {side: t[0] / max(1, t[2]) for side, t in tot.items()}
            key = f"{name}_b{batch}"
            figures.update({f"tok_s_{key}_off": round(tok_s["off"], 2),
                            f"tok_s_{key}_on": round(tok_s["on"], 2),
                            f"speedup_{key}": round(tok_s["on"] / tok_s["off"], 3),
                            f"tokens_per_step_{key}_off": round(per_step["off"], 3),
                            f"tokens_per_step_{key}_on": round(per_step["on"], 3)})
            rows.append([name, batch, len(cases), f"{tok_s['off']:.1f}", f"{tok_s['on']:.1f}",
                         tok_s["on"] / tok_s["off"], acc[1] / max(1, acc[0]),
                         acc[1] / max(1, acc[2]), per_step["off"], per_step["on"],
                         f"{tot['on'][0] / (rounds * len(cases)):.0f}",
                         f"{same}/{rounds * len(cases)}"])
        figures[f"acceptance_{name}"] = round(drafted[1] / max(1, drafted[0]), 3)
        figures[f"accepted_per_draft_{name}"] = round(drafted[1] / max(1, drafted[2]), 3)
        figures[f"identical_{name}"] = identical[name]
        figures[f"compared_{name}"] = compared[name]
    figures["overlap"] = int(args.overlap)
    figures["identical_share"] = round(sum(identical.values()) / max(1, sum(compared.values())),
                                       3)
    if figures["identical_share"] < 1:
        print(f"!!! WARNING: {sum(compared.values()) - sum(identical.values())} of "
              f"{sum(compared.values())} greedy outputs differ with speculation on "
              "(they must not: see the lines above)", flush=True)
    body = (table(["set", "batch", "requests", "tok/s off", "tok/s on", "speedup",
                   "acceptance", "accepted/draft", "tok/step off", "tok/step on",
                   "mean tokens", "identical"], rows)
            + f"\n\nGreedy; {'the tiny random model' if args.smoke else 'the default model'}"
            f", {args.threads or 'the default'} torch thread(s), "
            f"{'the overlapped step, ' if args.overlap else ''}drafts of up to "
            f"{e_on.config.speculative_tokens} tokens; {rounds} round(s) "
            "alternating which side goes first, tok/s over all of them (the mean rate). "
            "acceptance: draft tokens the draws kept / draft tokens; accepted/draft: kept "
            "tokens per step that had a draft; tok/step: output tokens per forward step, "
            "all the batch's rows (prefill's steps included; jump-forward's forced tokens "
            "count on both sides: the ratio on/off is what drafting saved); mean tokens: "
            "output tokens a request; identical: greedy outputs token for token equal on "
            "and off (all rounds).")
    finish("speculative-overlap" if args.overlap else "speculative", body, figures, args)


if __name__ == "__main__":
    main()
