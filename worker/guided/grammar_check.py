"""The grammar check: what a grammar will do before any request uses it (``POST
/v1/grammars`` on a worker, ``rayguide grammar check`` locally).

    checker = GrammarChecker(guided)            # one per engine (the worker's manager)
    future, cached = checker.start(spec, client)  # the request path's own compile: same
                                                 # local LRU, shared cache and auto rule
    report = checker.report(spec, future, ...)   # on the thread that owns its closing
                                                 # search (a worker: check_reports.py)

A request for the spec afterwards finds the grammar compiled (``start`` is
``GuidedDecodingManager.get_grammar``, which every request calls), and what the report
predicts is what that request meets, because the report is read off the same objects:

- ``engine``: the engine that compiled the spec on the request path (``auto``'s choice);
  ``status``: "refused" (the compile raised a GrammarError: a request gets that error,
  ``error.code`` its ErrorKind), "exact", "approximated" (JSON kinds: the serving engine
  accepts outputs the schema forbids; validation flags them) or "compiled" (other kinds);
  ``approximated``: the list each response's ``guided.approximated`` will carry.
- ``engines``: per engine, its verdict and the keywords behind it with their JSON
  pointers: xgrammar's approximations (validation.approximated_keywords, node by node),
  llguidance's refusal (its message, and the keys it names).
- ``shortest_output``: ``at_least``, the structural lower bound the admission check
  refuses a budget below (shortest_bound.py, the OutputPolicy's formula, so
  ``max_tokens`` under it is refused as ``budget_too_small`` at any size); ``tokens``,
  the smallest budget the closing search (with the engine's time limit) finds a whole
  output for from the grammar's start, raised until admission's first, cheap search
  (its dive) finds one within it alone: a valid output of that many tokens exists, and
  a ``max_tokens`` of at least that is not refused as too small even when a busy engine
  cuts admission's exact search short; None when none was found in time.
- ``compile_ms``: how long this engine took to get the grammar the first time
  (llguidance: its compile; xgrammar: the compile or fetch through the shared cache);
  ``size_bytes``: what it counts against the worker's grammar cache; ``cached``: the
  grammar was compiled here before this check.
- ``id``: ``grammar_id(spec)``, stable across processes, models and restarts.

A compile that outlasts the check's wait (``pending``) is answered with ``status``
"compiling" and no verdict yet: the compile goes on (the check is no waiter that could
cancel it, see guided_process.py) and a later check of the spec reads the finished grammar.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

from core.grammar_spec import grammar_id
from core.errors import ErrorKind, GrammarError
from core.grammar_spec import GrammarSpec
from core.json_schema import pointer, walk
from worker.guided.backend import (LLGUIDANCE, LLGUIDANCE_KINDS, XGRAMMAR, CompiledGrammar,
                                   EngineRefused)
from worker.guided.closing import CLOCK, CompletionSearch
from worker.guided.output_policy import remember_start_path, start_witness
from worker.guided.shortest_bound import TokenCapacity
from worker.guided.validation import approximated_keywords, node_approximated, not_checked

JSON_KINDS = ("json_schema", "json_object")
# the closing search's reach from the grammar's start, in single-character steps (it
# re-encodes its answer into fewer tokens); the search's time limit is the engine's own
SEARCH_LIMIT = 4096
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")


@dataclass
class EngineVerdict:
    """One engine's verdict on a spec: "exact", "approximated", "compiled" (a non-JSON
    kind), "refused" or "not_tried". ``keywords``: ``{"path", "keyword"}`` of what it
    approximates or refuses; ``source``: "compile" (the engine compiled the spec, or
    refused to, in this check or on the request path) or "schema" (read off the schema:
    the other engine served it)."""

    verdict: str
    source: str = "schema"
    keywords: list[dict] = field(default_factory=list)
    message: str | None = None


@dataclass
class GrammarReport:
    id: str
    kind: str
    engine_asked: str
    engine: str | None
    status: str
    approximated: list[str]
    engines: dict[str, EngineVerdict]
    shortest_output: dict
    compile_ms: float | None
    size_bytes: int | None
    cached: bool
    error: dict | None = None

    def as_dict(self) -> dict:
        return {"id": self.id, "object": "grammar", **{
            k: v for k, v in asdict(self).items() if k != "id"}}


class GrammarChecker:
    """The check over one engine's GuidedDecodingManager (see the module doc). ``start``
    may run on any thread; ``report`` on the thread that owns ``closer`` (a
    ``CompletionSearch`` is not thread-safe): the manager's own by default (the command
    line), a search of the checker's own on a worker (check_reports.py: off the engine
    thread). ``budget_s``: the report's CPU time past which its shortest-output search is
    not refined further (None: no limit)."""

    def __init__(self, guided, closer: CompletionSearch | None = None,
                 budget_s: float | None = None):
        self.guided = guided
        self.closer = closer if closer is not None else guided.closer
        self.budget_s = budget_s
        self._began = 0.0
        self._capacity: TokenCapacity | None = None

    def start(self, spec: GrammarSpec, client: str | None = None) -> tuple[Future, bool, float]:
        """The compile a request would start: (its future, whether the grammar was
        compiled here already, when the check began)."""
        cached = self.guided.holds(spec)
        return self.guided.get_grammar(spec, client), cached, time.perf_counter()

    def check(self, spec: GrammarSpec, client: str | None = None) -> GrammarReport:
        """``start`` and ``report`` on this thread (the command line: no engine thread)."""
        future, cached, began = self.start(spec, client)
        try:
            future.result()
        except GrammarError:
            pass  # the report reads it off the future
        return self.report(spec, future, cached, time.perf_counter() - began)

    def report(self, spec: GrammarSpec, future: Future, cached: bool,
               waited_s: float) -> GrammarReport:
        """The report on ``spec`` once ``future`` (from ``start``) is done. A transient
        failure (the compile service is down: GrammarUnavailable) is raised, not
        reported: it says nothing of the grammar."""
        error = future.exception()
        if error is not None and not isinstance(error, GrammarError):
            raise error
        self._began = CLOCK()
        compiled: CompiledGrammar | None = None if error is not None else future.result()
        schema = _schema(spec)
        approximated = (approximated_keywords(schema)
                        if spec.kind == "json_schema" and compiled is not None else [])
        if compiled is not None and compiled.exact:
            approximated = not_checked(approximated)  # as the engine reports it (engine.py)
        engines = {XGRAMMAR: self._xgrammar(spec, schema, compiled, error),
                   LLGUIDANCE: self._llguidance(spec, schema, compiled, error)}
        if compiled is None:
            status = "refused"
        elif spec.kind not in JSON_KINDS:
            status = "compiled"
        else:
            status = "approximated" if approximated else "exact"
        return GrammarReport(
            id=grammar_id(spec), kind=spec.kind, engine_asked=spec.engine,
            engine=compiled.engine if compiled is not None else None, status=status,
            approximated=approximated, engines=engines,
            shortest_output=self._shortest(spec, compiled),
            compile_ms=round(1e3 * (compiled.compile_s if compiled is not None else waited_s),
                             3),
            size_bytes=self.guided.held_bytes(spec) if compiled is not None else None,
            cached=cached,
            error=None if error is None else {"message": str(error),
                                              "code": ErrorKind(error.kind).value})

    @staticmethod
    def pending(spec: GrammarSpec, waited_s: float) -> GrammarReport:
        """The report while ``spec``'s compile still runs after ``waited_s``: status
        "compiling", nothing known of the grammar yet; ``compile_ms`` is the wait so far."""
        return GrammarReport(
            id=grammar_id(spec), kind=spec.kind, engine_asked=spec.engine, engine=None,
            status="compiling", approximated=[], engines={}, shortest_output={},
            compile_ms=round(1e3 * waited_s, 3), size_bytes=None, cached=False)

    # per engine ---------------------------------------------------------------------------

    def _xgrammar(self, spec, schema, compiled, error) -> EngineVerdict:
        served = compiled is not None and compiled.engine == XGRAMMAR
        source = "compile" if served else "schema"
        if error is not None and getattr(error, "engine", XGRAMMAR) == XGRAMMAR:
            return EngineVerdict("refused", "compile", message=str(error))
        if spec.kind not in JSON_KINDS:
            return EngineVerdict("compiled" if served else "not_tried", source)
        found = approximated_paths(schema) if schema is not None else []
        return EngineVerdict("approximated" if found else "exact", source, found)

    def _llguidance(self, spec, schema, compiled, error) -> EngineVerdict:
        if spec.kind not in LLGUIDANCE_KINDS:
            return EngineVerdict("refused", message=f"llguidance does not take {spec.kind} "
                                 "grammars here; xgrammar serves them")
        if compiled is not None and compiled.engine == LLGUIDANCE:
            refusal = None
        elif isinstance(error, EngineRefused) and error.engine == LLGUIDANCE:
            refusal = error
        elif compiled is not None and LLGUIDANCE in compiled.facts.refusals:
            refusal = compiled.facts.refusals[LLGUIDANCE]  # auto asked it already
        else:
            refusal = self.guided.llguidance_refusal(spec)
        if refusal is not None:
            return EngineVerdict("refused", "compile", refused_paths(schema, str(refusal)),
                                 str(refusal))
        if spec.kind not in JSON_KINDS:
            return EngineVerdict("compiled", "compile")
        # a custom format constrains nothing, and nothing checks it (validation.py)
        unknown = [k for k in approximated_paths(schema) if k["keyword"].endswith(
            " (not checked)")] if schema is not None else []
        return EngineVerdict("approximated" if unknown else "exact", "compile", unknown)

    # the shortest output ------------------------------------------------------------------

    def _shortest(self, spec: GrammarSpec, compiled: CompiledGrammar | None) -> dict:
        at_least = self.bound(spec)
        if compiled is None:
            return {"tokens": None, "at_least": at_least, "exhausted": False}
        closer = self.closer
        matcher = self.guided.new_matcher(compiled)
        found = closer.shortest(matcher, SEARCH_LIMIT)  # the dive admission tries first
        exact = closer.shortest(matcher, SEARCH_LIMIT, exact=True)
        best = min((c.tokens for c in (found, exact) if c.tokens is not None),
                   key=len, default=None)
        # the schema's own short instance (schema_witness.py), which admission builds too:
        # where it is the shortest, a request at its length is admitted with it on any
        # worker, whatever time the searches get there
        facts = compiled.facts
        if not facts.witness_known:
            facts.witness_path = start_witness(spec, matcher, closer)
            facts.witness_known = True
        witness = facts.witness_path
        if witness is not None and (best is None or len(witness) <= len(best)):
            # (kept apart from "start_path", which sets how early closing begins for an
            # output sampled freely: the witness says nothing of that; o60179 at 256
            # tokens was cut unclosed when it did)
            compiled.facts.checked_budget = max(len(witness), at_least)
            return {"tokens": max(len(witness), at_least), "at_least": at_least,
                    "exhausted": exact.exhausted}
        if best is None:
            return {"tokens": None, "at_least": at_least, "exhausted": exact.exhausted}
        remember_start_path(compiled, best)  # a request at this budget is admitted with it
        # the budget admission's first, cheap search (a dive within 4 x budget + 16
        # steps: OutputPolicy._budget_search) takes by itself, so it is admitted also
        # when a busy engine cuts its exact search short
        budget = len(best)
        for _ in range(4):
            if self.budget_s is not None and CLOCK() - self._began > self.budget_s:
                break  # the report's CPU is spent: the budget found so far stands
            dive = closer.shortest(matcher, 4 * budget + 16)
            if dive.tokens is not None and len(dive.tokens) <= budget:
                break
            # none within its reach (or a longer one): admission would fall back on a
            # dive further out, and take what that finds
            longer = dive.tokens if dive.tokens is not None else found.tokens
            if longer is None or len(longer) <= budget:
                break
            budget = len(longer)
        if witness is not None:  # admitted with the witness on any worker
            budget = min(budget, len(witness))
        # a request whose max_tokens is the reported figure is admitted with ``best``
        compiled.facts.checked_budget = max(budget, at_least)
        return {"tokens": max(budget, at_least), "at_least": at_least,
                "exhausted": exact.exhausted}

    def bound(self, spec: GrammarSpec) -> int:
        """The admission check's lower bound on the tokens of ``spec``'s shortest output
        (OutputPolicy.shortest_bound: 0 for kinds other than json_schema)."""
        if spec.kind != "json_schema":
            return 0
        if self._capacity is None:
            self._capacity = TokenCapacity(self.closer.vocab)
        return self._capacity.bound(spec.parsed)


# keyword paths ------------------------------------------------------------------------------

def _schema(spec: GrammarSpec):
    return spec.parsed if spec.kind == "json_schema" else None


def _nodes(schema):
    """(path, node) of every schema node in ``schema`` (depth-first)."""
    for sub in walk(schema, max_depth=64, lenient=True):
        if isinstance(sub.node, dict):
            yield sub.path, sub.node


def approximated_paths(schema) -> list[dict]:
    """What xgrammar approximates in ``schema``, node by node: ``{"path", "keyword"}`` with
    the keyword as validation.approximated_keywords names it, at the JSON pointer of the
    node that holds it."""
    out = []
    for path, node in _nodes(schema):
        found: set[str] = set()
        node_approximated(node, found, schema)
        out += [{"path": pointer(path), "keyword": k} for k in sorted(found)]
    return out


def refused_paths(schema, message: str) -> list[dict]:
    """The keys llguidance's refusal names (``Unimplemented keys: [...]``), at each node
    of ``schema`` that holds one; [] when the message names none."""
    m = _UNIMPLEMENTED.search(message)
    if m is None or schema is None:
        return []
    try:
        keys = {k for k in json.loads(m.group(1)) if isinstance(k, str)}
    except ValueError:
        return []
    return [{"path": pointer(path), "keyword": k}
            for path, node in _nodes(schema) for k in node if k in keys]
