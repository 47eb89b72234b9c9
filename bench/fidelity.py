"""Grammar fidelity per engine (issue 30): does a JSON-schema grammar accept exactly the
schema's instances? Over MaskBench's real-world schemas, each with valid and invalid test
instances, on xgrammar, llguidance and ``auto`` (worker/guided/backend.py: llguidance
where it compiles the schema, xgrammar elsewhere).

    python -m bench.fidelity [--schemas DIR] [--quick | --smoke] [--json] [--no-record]

``--schemas DIR``: MaskBench's data folder (files ``<Split>---<name>.json``, BFCL and JME
files ``<Split>_<name>.json``, each ``{"schema", "tests": [{"data", "valid"}]}``), from
https://github.com/guidance-ai/jsonschemabench, folder maskbench/data; not vendored here
(it carries no licence file). N schemas per split are sampled with a fixed seed (25;
``--quick`` 5). Without ``--schemas``, and with ``--smoke``, a handful of built-in schemas
with hand-written instances.

Both backends compile through worker/guided, so with the served options: a
``GrammarSpec.json_schema(schema)`` at its defaults (strict, the "spaced" layout, the digit
guards; ``--lax``: strict off), xgrammar through grammar_cache/compile.py's path. Each
instance is fed as ``json.dumps(data, ensure_ascii=False)`` (the spaced layout: ", " and
": "), token by token with the default model's tokenizer, then the stop token: accepted
means every token and the stop were. It is fed with its keys as given and, where that
differs, in the schema's order (the order the server generates, ``any_order`` being
off; ``in_schema_order``): accepted if either is (the two are one JSON value). Under
strict mode a valid instance with a property or item the schema does not declare is
expected rejected (``strict_excludes``; ``strict_excluded_instances``). A compile runs
in a child process with a time limit (``--compile-limit-s``, 10 s): one over it counts as not
compiled. ``auto``'s compile time is llguidance's attempt plus xgrammar's compile where
it falls back.

Per engine: compiled, pass (compiled and every instance judged right), valid rejected,
invalid accepted, compile p50 / p99 / max. ``--json`` keys: pass_share_auto,
pass_share_xgrammar, pass_share_llguidance, invalid_accepted_auto,
invalid_accepted_llguidance_served (invalid instances accepted on the schemas ``auto``
sends to llguidance), compile_p99_ms_llguidance_served, compile_p99_ms_auto,
compile_p99_ms_xgrammar, schemas.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's packages, not bench/'s
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report  # noqa: E402
from core.grammar_spec import GrammarSpec  # noqa: E402
from core.json_schema import is_local, resolve_or_none  # noqa: E402
from worker.guided.backend import (AUTO, BACKENDS, LLGUIDANCE, XGRAMMAR,  # noqa: E402
                                   EngineRefused, auto_backend, backends_for)
from worker.guided.schema_options import strict_schema  # noqa: E402
from worker.guided.validation import validate_json  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}
# (name, schema, [(instance, valid)]): the smoke size and the fallback without --schemas
BUILTIN = [
    ("person", PERSON, [({"name": "Ada", "age": 36}, True), ({"name": "Ada"}, False),
                        ({"name": "Ada", "age": -1}, False), ({"name": 1, "age": 1}, False)]),
    ("enum-list", {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
     [(["red"], True), ([], True), (["blue"], False), (["red", "red", "red"], False)]),
    ("not", {"type": "object", "properties": {"s": {"type": "string", "not": {"const": "x"}}},
             "required": ["s"]},
     [({"s": "y"}, True), ({"s": "x"}, False)]),
    ("unique", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [([1, 2], True), ([1, 1], False)]),
    ("one-of", {"oneOf": [{"type": "string"}, {"type": "integer"}]},
     [("a", True), (3, True), (True, False)]),
]


@dataclass
class Outcome:
    """One engine on one schema."""

    compiled: bool
    compile_ms: float
    refusal: str = ""
    valid_rejected: int = 0
    invalid_accepted: int = 0

    @property
    def passed(self) -> bool:
        return self.compiled and not self.valid_rejected and not self.invalid_accepted


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def row(self, name: str) -> list:
        done = [o for o in self.outcomes if o.compiled]
        ms = [o.compile_ms for o in self.outcomes]
        return [name, len(done), sum(o.passed for o in self.outcomes),
                sum(o.valid_rejected for o in done), sum(o.invalid_accepted for o in done),
                report.percentile(ms, 50), report.percentile(ms, 99), max(ms, default=0.0)]

    def pass_share(self) -> float:
        return sum(o.passed for o in self.outcomes) / max(1, len(self.outcomes))


# --- the child process: compiles and feeds; the parent only waits -------------------------

_STATE: dict = {}


def _child(conn, engines, tokenizer, eos: int) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        name, spec, texts = job
        start = time.perf_counter()
        try:
            compiled = engines[name].compile(spec)
        except EngineRefused as exc:
            conn.send(("refused", (time.perf_counter() - start) * 1e3, str(exc)))
            continue
        conn.send(("compiled", compiled.compile_s * 1e3, ""))
        verdicts = []
        for layouts in texts:  # one instance's layouts: accepted if any is
            accepted = False
            for text in layouts:
                m = engines[name].matcher(compiled)
                tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
                accepted = all(m.accept_token(t) for t in tokens) and m.accept_token(eos)
                if accepted:
                    break
            verdicts.append(accepted)
        conn.send(verdicts)


class Compiler:
    """A forked child holding both engines; killed and forked again when a compile runs
    past the limit (an xgrammar compile cannot be interrupted in-process)."""

    def __init__(self, engines, tokenizer, eos: int, limit_s: float):
        self.args, self.limit_s, self.proc = (engines, tokenizer, eos), limit_s, None

    def _start(self):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, *self.args), daemon=True)
        self.proc.start()

    def run(self, name: str, spec: GrammarSpec,
            instances: list[tuple[tuple[str, ...], bool]]) -> Outcome:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send((name, spec, [text for text, _ in instances]))
        if not self.conn.poll(self.limit_s):
            self.close()
            return Outcome(False, self.limit_s * 1e3, f"compile over {self.limit_s:g} s")
        status, ms, why = self.conn.recv()
        if status == "refused":
            return Outcome(False, ms, why)
        if not self.conn.poll(max(60.0, self.limit_s)):
            self.close()
            return Outcome(False, ms, "feeding the instances hung")
        verdicts = self.conn.recv()
        out = Outcome(True, ms)
        for accepted, (_, valid) in zip(verdicts, instances):
            out.valid_rejected += valid and not accepted
            out.invalid_accepted += accepted and not valid
        return out

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.proc = None


# --- what the served grammar should accept -----------------------------------------------

def strict_excludes(schema, data) -> bool:
    """A valid instance that strict mode forbids by design (a property or item the schema
    does not declare): valid against ``schema`` and invalid against ``strict_schema(schema)``
    (both checked by jsonschema-rs, the post-validation's validator). A strict grammar
    is right to reject it."""
    text = json.dumps(data)
    return validate_json(schema, text) is None and validate_json(
        strict_schema(schema), text) is not None


def in_schema_order(data, schema, root=None, depth: int = 0):
    """``data`` with each object's keys in the order its schema declares them (the order
    the served grammar generates: ``any_order`` is off by default), undeclared keys after,
    as given. Best effort: a local ``$ref`` is followed; the properties of allOf members
    count in the order met, and of an anyOf / oneOf the branch that fits the object best
    (its required keys present, the most of its keys declared); an undeclared key's value
    is ordered by the first ``patternProperties`` schema its name matches, else
    ``additionalProperties``."""
    root = schema if root is None else root
    if depth > 32 or not isinstance(schema, dict):
        return data
    nodes = _members(schema, root, depth, data)
    if isinstance(data, dict):
        props: dict = {}
        for node in nodes:
            for name, sub in (node.get("properties") or {}).items():
                props.setdefault(name, sub)
        keys = [k for k in props if k in data] + [k for k in data if k not in props]
        return {k: in_schema_order(data[k], props[k] if k in props else _other_property(
            nodes, k), root, depth + 1) for k in keys}
    if isinstance(data, list):
        out = []
        for i, item in enumerate(data):
            sub = next((n["prefixItems"][i] for n in nodes
                        if isinstance(n.get("prefixItems"), list) and i < len(n["prefixItems"])),
                       next((n["items"] for n in nodes if isinstance(n.get("items"), dict)),
                            None))
            out.append(in_schema_order(item, sub, root, depth + 1))
        return out
    return data


def _other_property(nodes: list[dict], name: str):
    """The schema of an undeclared property ``name``: the first ``patternProperties``
    pattern it matches (Python's regex reading), else ``additionalProperties``."""
    for node in nodes:
        for pattern, sub in (node.get("patternProperties") or {}).items():
            try:
                if re.search(pattern, name):
                    return sub
            except re.error:
                continue
    return next((n["additionalProperties"] for n in nodes
                 if isinstance(n.get("additionalProperties"), dict)), None)


def _members(schema: dict, root, depth: int, data=None) -> list[dict]:
    """``schema`` and the schemas merged into it ($ref, allOf / anyOf / oneOf), in order;
    for an object ``data``, of an anyOf / oneOf only the branch that fits it best."""
    out, todo = [], [schema]
    while todo and len(out) < 64:
        node = todo.pop(0)
        if not isinstance(node, dict):
            continue
        out.append(node)
        ref = node.get("$ref")
        if is_local(ref):
            todo.append(resolve_or_none(root, ref))
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                branches = node[key]
                if key != "allOf" and isinstance(data, dict) and len(branches) > 1 and (
                        depth < 16):
                    branches = [max(branches, key=lambda b: _fit(b, root, depth, data))]
                todo.extend(branches)
    return out


def _fit(branch, root, depth: int, data: dict) -> tuple[bool, int, int]:
    """How well an anyOf / oneOf branch fits an object: its required keys all present,
    then how many of the object's values its ``const`` / ``enum`` properties match (a
    discriminator), then how many of the object's keys it declares."""
    if not isinstance(branch, dict):
        return (False, 0, 0)
    nodes = _members(branch, root, depth + 1, data)
    required = {n for node in nodes for n in node.get("required", ()) if isinstance(n, str)}
    props = [(n, sub) for node in nodes for n, sub in (node.get("properties") or {}).items()]
    matched = sum(1 for n, sub in props if n in data and isinstance(sub, dict) and (
        sub.get("const", object()) == data[n] or data[n] in (sub.get("enum") or ())))
    return (required <= set(data), matched, len({n for n, _ in props} & set(data)))


def instances_for(schema, tests, strict: bool) -> tuple[list[tuple[tuple[str, ...], bool]],
                                                        int]:
    """Per instance its layouts to feed (keys as given, and in the schema's order where
    that differs) with whether the served grammar should accept it, and how many valid
    instances strict mode forbids."""
    out, excluded = [], 0
    for data, valid in tests:
        try:
            ordered = in_schema_order(data, schema)
        except (TypeError, AttributeError, IndexError, KeyError):  # a schema too odd to follow
            ordered = data
        if valid and strict and strict_excludes(schema, data):
            valid, excluded = False, excluded + 1
        texts = dict.fromkeys(json.dumps(d, ensure_ascii=False) for d in (data, ordered))
        out.append((tuple(texts), valid))
    return out, excluded


# --- schemas ------------------------------------------------------------------------------

def split_of(path: Path) -> str:
    name = path.stem
    return name.split("---")[0] if "---" in name else name.split("_")[0]


def load_maskbench(folder: Path, per_split: int, seed: int) -> list[tuple[str, dict, list]]:
    by_split: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        by_split[split_of(path)].append(path)
    rng = random.Random(seed)
    cases = []
    for split in sorted(by_split):
        paths = by_split[split]
        for path in rng.sample(paths, min(per_split, len(paths))):
            doc = json.loads(path.read_text())
            cases.append((path.stem, doc["schema"],
                          [(t["data"], bool(t["valid"])) for t in doc.get("tests", [])]))
    return cases


def main() -> None:
    ap = report.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=Path, help="MaskBench's data folder (see the docstring)")
    ap.add_argument("--per-split", type=int, help="schemas sampled per split (25; --quick 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-limit-s", type=float, default=10.0)
    ap.add_argument("--lax", action="store_true", help="strict mode off (the schema's letter)")
    args = ap.parse_args()

    from worker.models.gguf_convert import ensure_converted
    from worker.models.loader import load_tokenizer

    tokenizer = load_tokenizer(ensure_converted(None, progress=False))
    eos = tokenizer.eos_token_id
    engines = backends_for(tokenizer, len(tokenizer), [eos])
    if args.schemas and not args.smoke:
        per_split = args.per_split or (5 if args.quick else 25)
        cases = load_maskbench(args.schemas, per_split, args.seed)
        source = f"MaskBench ({args.schemas}), {per_split} per split, seed {args.seed}"
    else:
        cases, source = BUILTIN, "built-in schemas"

    tallies = {name: Tally() for name in (*BACKENDS, AUTO)}
    served = Tally()  # auto's outcomes on the schemas it sends to llguidance
    reasons: Counter = Counter()
    strict_excluded = [0, 0]  # valid instances strict mode forbids, and on how many schemas
    compiler = Compiler(engines, tokenizer, eos, args.compile_limit_s)
    start = time.perf_counter()
    try:
        for name, schema, tests in cases:
            try:
                spec = GrammarSpec.json_schema(schema, strict=not args.lax)
            except ValueError as exc:  # refused before any engine sees it
                for tally in tallies.values():
                    tally.outcomes.append(Outcome(False, 0.0, str(exc)))
                continue
            instances, excluded = instances_for(schema, tests, not args.lax)
            strict_excluded[0] += excluded
            strict_excluded[1] += bool(excluded)
            got = {engine: compiler.run(engine, spec, instances) for engine in BACKENDS}
            for engine, outcome in got.items():
                tallies[engine].outcomes.append(outcome)
            ll = got[LLGUIDANCE]
            if not ll.compiled:
                reasons[ll.refusal.split(": ", 1)[-1][:60]] += 1
            pick = auto_backend(spec, None if ll.compiled else EngineRefused(LLGUIDANCE, ""))
            auto = got[pick]
            if pick == XGRAMMAR:
                auto = Outcome(auto.compiled, ll.compile_ms + auto.compile_ms, auto.refusal,
                               auto.valid_rejected, auto.invalid_accepted)
            else:
                served.outcomes.append(auto)
            tallies[AUTO].outcomes.append(auto)
    finally:
        compiler.close()

    headers = ["engine", "compiled", "pass", "valid rejected", "invalid accepted",
               "compile p50 ms", "compile p99 ms", "compile max ms"]
    rows = [tallies[n].row(n) for n in (XGRAMMAR, LLGUIDANCE, AUTO)]
    rows.append(served.row("auto, served by llguidance"))
    top = ", ".join(f"{why} ({n})" for why, n in reasons.most_common(6))
    body = (f"{len(cases)} schemas: {source}; {'lax' if args.lax else 'strict'} specs, "
            f"compile limit {args.compile_limit_s:g} s, {time.perf_counter() - start:.0f} s "
            f"in all; {strict_excluded[0]} valid instances on {strict_excluded[1]} schemas "
            f"carry a property or item the schema does not declare, which strict mode "
            f"forbids: expected rejected.\n\n{report.table(headers, rows)}\n\nllguidance's refusals, most "
            f"common: {top or 'none'}\n")
    ll_served = [o.compile_ms for o in served.outcomes]
    figures = {
        "pass_share_auto": tallies[AUTO].pass_share(),
        "pass_share_xgrammar": tallies[XGRAMMAR].pass_share(),
        "pass_share_llguidance": tallies[LLGUIDANCE].pass_share(),
        "invalid_accepted_auto": sum(o.invalid_accepted for o in tallies[AUTO].outcomes),
        "invalid_accepted_llguidance_served": sum(o.invalid_accepted for o in served.outcomes),
        "compile_p99_ms_llguidance_served": report.percentile(ll_served, 99),
        "compile_p99_ms_auto": report.percentile(
            [o.compile_ms for o in tallies[AUTO].outcomes], 99),
        "compile_p99_ms_xgrammar": report.percentile(
            [o.compile_ms for o in tallies[XGRAMMAR].outcomes], 99),
        "schemas": len(cases),
        "strict_excluded_instances": strict_excluded[0],
    }
    report.finish("fidelity", body, figures, args)


if __name__ == "__main__":
    main()
