"""llguidance behind the grammar backends' protocol (backend.py).

State keys (closing.py): llguidance exposes no parser state. ``state_key()`` is what it
does expose that is a function of the state: whether it may end, its forced bytes, and for
each of a few probe characters (``0``, ``a``, ``A``) how many may come in a row from here
(``validate_tokens``, which consumes nothing) and, for a bounded run, the bytes forced
right after it. The runs stand in for xgrammar's unrolled positions: inside a uuid's
``[0-9a-f]{12}`` mask and forced bytes repeat at every place, and without them the search
merged the places and could not close a uuid or a date (it then neither refused a budget
too small for such a schema nor closed the output). For each separator that may come next
(``/``, ``-``, ``:`` ...), it also holds how many (separator, probe) pairs may follow: the
fields of a pattern such as ``[a-z]+/[a-z]+/[0-9]+-[0-9]+-[0-9]+`` look alike from inside,
and merged, the search found no way out of a field the loop guard had cut (an answer came
back unterminated where xgrammar closed it). ``step_state()`` adds the next-token mask (so
two tokens count as one next state only where everything that may follow them is the
same); ``rule_start()`` is None (unknown: a closing edge always keeps its depth, which
merges less). ``has_parser_state()`` is False, so a search that finds nothing searches
again with states told apart by depth too before it calls a grammar unclosable.
(xgrammar's key, xgrammar_backend.py, is built the same way from public calls.)

xgrammar and llguidance differ in what they enforce for a JSON schema: xgrammar
approximates what it cannot express (``not``, ``uniqueItems``, ``allOf`` ...: it accepts
instances the schema forbids), llguidance refuses such a schema (``EngineRefused``).
Before llguidance sees a schema, ``exact_rewrites`` turns what it lacks but can express
exactly into what it has (``dependencies`` as an ``anyOf`` per key; a custom ``format``,
which constrains nothing, dropped; ``not`` as its negation where one exists without
``not``; ``oneOf`` as ``anyOf`` where no instance can match two branches; a node bounded
by an ``enum`` as the enum of the values it allows, checked by the validator). llguidance
also has no ``indent`` layout and no ``any_order``: it refuses both.

Runaway digit guards (``GrammarSpec.max_*_digits``) hold on both backends. xgrammar's are
written into its EBNF (grammar_cache/compile.py). llguidance has no digit bounds, so
``number_guards`` writes them into the schema as bounds it turns into bounded digit runs:
an integer gets ``minimum`` / ``maximum`` of ``±(10**n - 1)``, a number
``exclusiveMinimum`` / ``exclusiveMaximum`` of ``±10**n`` and ``multipleOf: 10**-m``, on
the sides the schema leaves open (widened opposite a bound of more digits, so a number
the schema demands stays writable); a ``json_object``'s values get them through a
recursive any-value schema. llguidance writes such a number without an exponent. Guards
it cannot write (over 10 fraction or 18 integer digits, an integer bound past 64 bits,
which it would clamp) are refused, so ``auto`` serves them on xgrammar.

Every llguidance compile is bounded: the rewrites run under a ``RewriteBudget`` (steps
and CPU time; schema_rewrites.py), the rewritten schema under ``_MAX_GROWTH`` times its
source (plus 64 kB) and the property caps of ``_check_properties`` (what llguidance builds
in about a second), the build itself under our parser limits (``LLGUIDANCE_LIMITS``:
grammar size, lexer states and fuel), and a probe of its first steps catches a grammar
over the per-step limits where it starts; past any of them llguidance refuses the schema
by name (``grammar_too_large``) and ``auto`` serves it on xgrammar. The build releases the
GIL. Every mask step is bounded by the same limits' step fuel; a matcher that reaches it
mid-generation ends its request, its ``failure`` naming the limit.

Why one module over 500 lines: one library behind the protocol, its grammar writing
(rewrites, limits, refusals) and its matcher with the state keys closing needs.
"""

from __future__ import annotations

import json
import threading
import time

import torch

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from grammar_cache.format_patterns import format_patterns
from worker.guided.schema_budget import RewriteBudget, SchemaTooComplex
from worker.guided.schema_options import (MAX_LLGUIDANCE_FRAC_DIGITS,
                                          MAX_LLGUIDANCE_INT_DIGITS, any_value_guarded,
                                          number_guards, strict_schema)
from worker.guided.schema_rewrites import exact_rewrites
from worker.guided.backend import (LLGUIDANCE, LLGUIDANCE_KINDS, PROBE_FIELDS, PROBE_RUN,
                                   PROBE_TEXTS, SEPARATOR_TEXTS, CompiledGrammar,
                                   EngineRefused, GrammarBackend, GrammarMatcher)


class LLGuidanceBackend(GrammarBackend):
    """llguidance. JSON layouts map to its compile options ("spaced": ", " and ": " with no
    other blanks; "compact"; "bounded" / "any": flexible blanks, at most ``max_whitespace``
    for "bounded"); ``strict`` closes objects and tuples the schema leaves open, as
    xgrammar's strict mode does (``strict_schema``). It compiles in well under a
    millisecond for most schemas, and refuses keywords it cannot enforce."""

    name = LLGUIDANCE
    compiles_locally = True
    exact = True

    def __init__(self, tokenizer: "llguidance.LLTokenizer", limits: dict | None = None):
        """``limits``: llguidance's parser limits (``LLGUIDANCE_LIMITS`` by default; any
        ``LLParserLimits`` field)."""
        import llguidance

        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.stop_token_ids = frozenset(tokenizer.eos_tokens)
        self.probes = _run_probes(tokenizer)
        self.limits = llguidance.LLParserLimits(**{**LLGUIDANCE_LIMITS, **(limits or {})})
        self._executors: dict = {}  # threads -> llguidance.LLExecutor (built on first use)

    @classmethod
    def from_huggingface(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        """For a fast Hugging Face tokenizer, with the model's vocab size (padded rows
        are never allowed) and its EOS ids as stop tokens. About half a second."""
        import llguidance.hf

        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=list(stop_token_ids)))

    def compile(self, spec: GrammarSpec, *, client: str | None = None,
                cancel: threading.Event | None = None) -> CompiledGrammar:
        import llguidance

        start = time.perf_counter()
        grammar = _llguidance_grammar(spec)
        # (the construction releases the GIL: the engine thread steps on meanwhile)
        start_state = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                           limits=self.limits)
        if start_state.is_error():
            raise _refusal(spec, start_state.get_error())
        # the first steps, on a copy: a grammar over the per-step limits where it starts
        # (an object of hundreds of optional properties) is refused now, where ``auto``
        # can still serve it on xgrammar, not after its request's first token
        probe = start_state.deep_copy()
        probe.compute_bitmask()
        forced = probe.compute_ff_tokens()
        if forced and probe.consume_tokens(forced):
            probe.compute_bitmask()
        if probe.is_error():
            raise _refusal(spec, probe.get_error())
        return CompiledGrammar(LLGUIDANCE, spec, start_state, time.perf_counter() - start,
                               exact=self.exact)

    def matcher(self, compiled: CompiledGrammar) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(compiled.artifact.deep_copy(), self.stop_token_ids,
                                 self.tokenizer, self.probes)

    def fill_rows(self, bitmask: torch.Tensor, rows: list[int],
                  matchers: list[GrammarMatcher], threads: int = 1) -> None:
        """One row on this thread; more with llguidance's parallel fill (``threads``
        threads), into the same shared memory."""
        import llguidance
        import llguidance.numpy

        if len(rows) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        executor = self._executors.get(threads)
        if executor is None:
            executor = self._executors[threads] = llguidance.LLExecutor(
                num_threads=max(1, threads))
        live = [(m.inner, row) for m, row in zip(matchers, rows) if not m.is_terminated()]
        llguidance.numpy.fill_next_token_bitmask_par(executor, live, bitmask.numpy())

    def grammar_bytes(self, compiled: CompiledGrammar) -> int:
        """A guess: an llguidance grammar's memory is its start state, which Python cannot
        measure; counted in the size of its lexer, so the cache's byte bound holds it."""
        return _GRAMMAR_BYTES + len(compiled.spec.source)


_GRAMMAR_BYTES = 64 * 1024


# llguidance's parser limits (LLParserLimits), passed on every build. Each bounds the time
# or memory of one compile or of one mask step; past one, a compile is refused
# (grammar_too_large: ``auto`` serves the grammar on xgrammar) and a matcher that reaches
# one mid-generation fails its request (LLGuidanceMatcher.failure). Measured on the
# conformance bench and a 4,000-schema JSONSchemaBench sample (a build, then a 40-step
# random walk of masks, docs/benchmarks.md): tighter step limits break real schemas
# (step_lexer_fuel 100,000 failed Github_trivial/o9908 mid-walk, initial_lexer_fuel 200,000
# refused Github_ultra/o50639), so those stay at llguidance's defaults, which bound a mask
# step to ~15 ms of lexer and ~2.5 ms of parser work a row; the grammar size is cut to a
# fifth (no sampled schema needs a fifth of that).
LLGUIDANCE_LIMITS = dict(
    max_grammar_size=100_000,  # symbols (default 500,000; the sample builds under 20,000)
    max_lexer_states=250_000,  # ~1-2 kB each: a grammar's lexer memory (default)
    initial_lexer_fuel=1_000_000,  # ~50 per us: building the lexer (default)
    step_lexer_fuel=200_000,  # ~14 per us: one mask step's lexer work (default)
    step_max_items=50_000,  # ~20 per us: one mask step's Earley items (default)
    max_items_in_row=2000,  # one row's branching (default)
    verbose_errors=False,  # an error's first line names the limit; no grammar dump
)
# llguidance's words for a limit it reached (its errors name the limit, not a kind)
_LIMIT_WORDS = ("fuel", "too large", "too big", "max is", "limit", "lexer states",
                "grammar size", "too many")


def _refusal(spec: GrammarSpec, error: str) -> EngineRefused:
    """llguidance's error building ``spec`` as a refusal: over one of its limits
    (GRAMMAR_TOO_LARGE, naming the limit), else an invalid grammar."""
    line = _first_line(error)
    if any(word in line.lower() for word in _LIMIT_WORDS):
        return EngineRefused(LLGUIDANCE, f"this {spec.kind} grammar is over llguidance's "
                             f"compile limits: {line}", ErrorKind.GRAMMAR_TOO_LARGE)
    return EngineRefused(LLGUIDANCE, f"invalid {spec.kind} grammar for llguidance: {line}")


def _run_probes(tokenizer: "llguidance.LLTokenizer") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tokens of the probe characters and of the separators, for each one the
    tokenizer spells as one token."""
    def single(texts):
        tokens = [tokenizer.tokenize_str(text) for text in texts]
        return tuple(t[0] for t in tokens if len(t) == 1)
    return single(PROBE_TEXTS), single(SEPARATOR_TEXTS)


# what the rewrites may add to a schema: strict mode's and the guards' keywords take a few
# times a small node's bytes; a negation over shared definitions could take megabytes
_MAX_GROWTH, _MAX_GROWTH_BYTES = 8, 64 * 1024


def _llguidance_grammar(spec: GrammarSpec) -> str:
    import llguidance

    if spec.kind not in LLGUIDANCE_KINDS:
        raise EngineRefused(LLGUIDANCE, f"llguidance does not take {spec.kind} grammars "
                            f"here (they are written in xgrammar's dialect); use xgrammar")
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.source))
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.source)
    if spec.whitespace == "indent":
        raise EngineRefused(LLGUIDANCE, "llguidance has no indented JSON layout; use "
                            "whitespace 'spaced', 'compact', 'bounded' or 'any'")
    if spec.any_order:
        raise EngineRefused(LLGUIDANCE, "llguidance keeps a schema's property order; "
                            "any_order needs xgrammar")
    if (spec.max_frac_digits > MAX_LLGUIDANCE_FRAC_DIGITS
            or spec.max_int_digits > MAX_LLGUIDANCE_INT_DIGITS):
        raise EngineRefused(LLGUIDANCE, f"llguidance bounds numbers to at most "
                            f"{MAX_LLGUIDANCE_INT_DIGITS} integer and "
                            f"{MAX_LLGUIDANCE_FRAC_DIGITS} fraction digits; larger "
                            "max_int_digits / max_frac_digits need xgrammar")
    budget = RewriteBudget()  # one bound on all the preparation below
    try:
        if spec.kind == "json_object":
            schema = any_value_guarded(spec.max_int_digits, spec.max_frac_digits)
        else:
            schema = json.loads(spec.source)
            # the property caps first, on the schema as written: a schema over them is
            # refused for that (not for the rewrites' time, which on a loaded machine
            # could run out first)
            _check_properties(schema)
            if spec.strict:  # (first: the rewrites' anyOf members would keep a node open)
                schema = strict_schema(schema)
            schema = exact_rewrites(schema, budget=budget)
            schema = format_patterns(schema, spec.max_frac_digits)
            schema = number_guards(schema, spec.max_int_digits, spec.max_frac_digits,
                                   budget=budget)
        text = json.dumps(schema)
        if len(text) > _MAX_GROWTH * len(spec.source) + _MAX_GROWTH_BYTES:
            raise SchemaTooComplex(f"rewritten for llguidance it would be {len(text)} "
                                   f"bytes, from {len(spec.source)}")
        _check_properties(schema)
    except SchemaTooComplex as exc:
        raise EngineRefused(LLGUIDANCE, f"the schema could not be prepared for llguidance: "
                            f"{exc}", ErrorKind.GRAMMAR_TOO_LARGE) from None
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        # a shape the rewrites do not read (tests/unit/test_grammar_rewrites_unit.py fuzzes
        # them): refused here, so auto serves it on xgrammar, which names what is wrong
        raise EngineRefused(LLGUIDANCE, f"the schema could not be prepared for llguidance "
                            f"({type(exc).__name__}: {_first_line(str(exc))})") from None
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, overrides=_json_options(spec))
    except ValueError as exc:
        raise EngineRefused(LLGUIDANCE, f"invalid {spec.kind} grammar for llguidance: "
                            f"{_first_line(str(exc))}") from None


# what llguidance's compile costs grows with a schema's optional properties (their
# orders) and faster than linearly with one object's properties: one object of 7,500
# properties took 0.65 s to build on a quiet 2-core machine and 2.8 s on a busy one, 60
# objects of 100 optional integers 2.6 s there (then past the lexer fuel), where 200
# objects of 20 properties took 0.2-0.5 s. No real-world schema comes near the caps (the
# most properties in a 7,500-schema JSONSchemaBench sample: 2,173 in all). Beyond 500
# optional properties in one object llguidance's first step is over max_items_in_row (4
# items a property): it built such a schema, then failed its request's first token.
_MAX_OPTIONAL, _MAX_OPTIONAL_TOTAL, _MAX_OBJECT_PROPERTIES = 500, 4500, 4000


def _check_properties(schema) -> None:
    """Raises SchemaTooComplex where ``schema`` has more properties than llguidance
    compiles within about a second, or an object more optional ones than its first step
    takes."""
    optional_total, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                required = node.get("required")
                required = set(required) if isinstance(required, list) else set()
                optional = sum(1 for name in props if name not in required)
                optional_total += optional
                if optional > _MAX_OPTIONAL or len(props) > _MAX_OBJECT_PROPERTIES:
                    raise SchemaTooComplex(
                        f"an object has {len(props)} properties, {optional} of them "
                        f"optional; llguidance takes at most {_MAX_OBJECT_PROPERTIES}, "
                        f"{_MAX_OPTIONAL} optional")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if optional_total > _MAX_OPTIONAL_TOTAL:
        raise SchemaTooComplex(f"it has {optional_total} optional properties; llguidance "
                               f"compiles at most {_MAX_OPTIONAL_TOTAL} within its time "
                               "bound")


# xgrammar reads \d and \w in a regex as ASCII classes, as JSON Schema's patterns do
# (ECMA-262, and llguidance's own JSON path); llguidance's regex reads them as Unicode
# classes (hundreds of digits: a phone-number regex took U+0663). Written out in ASCII, a
# regex means one language on either engine. (outside a class, inside one)
_ASCII_CLASSES = {"d": ("[0-9]", "0-9"), "w": ("[0-9A-Za-z_]", "0-9A-Za-z_"),
                  "D": ("[^0-9]", "[:^digit:]"), "W": ("[^0-9A-Za-z_]", "[:^word:]")}


def ascii_classes(pattern: str) -> str:
    r"""``pattern`` with ``\d``, ``\w``, ``\D`` and ``\W`` written as the ASCII classes they
    are in xgrammar (``[0-9]``, ``[0-9A-Za-z_]`` and their complements), in and outside
    character classes; every other part as written."""
    out, i, depth = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            pair = _ASCII_CLASSES.get(pattern[i + 1])
            out.append(pair[1 if depth else 0] if pair else pattern[i:i + 2])
            i += 2
        elif depth and pattern.startswith("[:", i) and ":]" in pattern[i + 2:]:
            end = pattern.index(":]", i + 2) + 2  # a POSIX class inside a class
            out.append(pattern[i:end])
            i = end
        elif c == "[":
            depth += 1
            start = i + 1 + pattern.startswith("^", i + 1)
            start += pattern.startswith("]", start)  # a "]" first in a class is literal
            out.append(pattern[i:start])
            i = start
        else:
            depth -= c == "]" and depth > 0
            out.append(c)
            i += 1
    return "".join(out)


def _json_options(spec: GrammarSpec) -> dict:
    if spec.whitespace == "spaced":
        return dict(whitespace_flexible=False, item_separator=", ", key_separator=": ")
    if spec.whitespace == "compact":
        return dict(whitespace_flexible=False, item_separator=",", key_separator=":")
    if spec.whitespace == "bounded":
        return dict(whitespace_flexible=True,
                    whitespace_pattern=rf"[\x20\x0A\x0D\x09]{{0,{spec.max_whitespace}}}")
    return dict(whitespace_flexible=True)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["no reason given"])[0]


class LLGuidanceMatcher(GrammarMatcher):
    """llguidance's LLMatcher with xgrammar's semantics: a refused token leaves the
    matcher as it was (llguidance would enter its error state for good), a stop token is
    accepted where the grammar may end and counts as one step for ``rollback`` (the
    matcher itself never sees it), and ``accept_string`` is one step however many tokens
    it takes (``_steps``: the tokens of each step, for rollback)."""

    engine = LLGUIDANCE

    def __init__(self, inner: "llguidance.LLMatcher", stop_token_ids: frozenset[int],
                 tokenizer: "llguidance.LLTokenizer | None" = None,
                 probes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())):
        self.inner = inner
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer
        self.probes = probes  # (probe characters, separators): see _run_probes
        self.terminated = False
        self._steps: list[int] = []  # inner tokens per accepted step (0: the stop token)
        self._key: tuple | None = None  # state_key() of the state as it is (None: unknown)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        # llguidance.torch's helpers are torch.compile'd at import (seconds, and a
        # compiler we lack); the numpy one writes the same words into the shared memory
        import llguidance.numpy

        if self.terminated:  # as xgrammar: no next token after the stop token
            raise RuntimeError("the matcher has terminated: there is no next-token mask")
        llguidance.numpy.fill_next_token_bitmask(self.inner, bitmask.numpy(), row)

    def accept_token(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.stop_token_ids:
            self.terminated = self.inner.is_accepting()
            if self.terminated:
                self._steps.append(0)
                self._key = None
            return self.terminated
        if self.inner.try_consume_tokens([token]) != 1:
            return False
        self._steps.append(1)
        self._key = None
        return True

    def allows(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.stop_token_ids:
            return self.inner.is_accepting()
        return self.inner.validate_tokens([token]) == 1  # (consumes nothing)

    def accept_tokens(self, tokens) -> bool:
        # the tokens before any stop token in one call (llguidance consumes a list);
        # a stop token, and what follows it, one at a time as accept_token takes them
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self.stop_token_ids), len(tokens))
        head = tokens[:cut]
        if head:
            if self.terminated:
                return False
            done = self.inner.try_consume_tokens(head)
            if done:
                self._steps.extend([1] * done)
                self._key = None
            if done != len(head):
                return False
        return all(self.accept_token(t) for t in tokens[cut:])

    def accept_string(self, text: str) -> bool:
        if self.terminated or self.tokenizer is None:
            return False
        tokens = self.tokenizer.tokenize_str(text)
        done = self.inner.try_consume_tokens(tokens)
        if done != len(tokens):
            if done:
                self.inner.rollback(done)
            return False
        self._steps.append(len(tokens))
        self._key = None
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._steps):
            raise ValueError(f"cannot roll back {num_tokens} steps: only "
                             f"{len(self._steps)} were accepted")
        inner = 0
        for _ in range(num_tokens):
            inner += self._steps.pop()
        self.terminated = False
        self._key = None
        if inner and not self.inner.rollback(inner):
            raise ValueError(f"llguidance could not roll back {inner} tokens: "
                             f"{self.inner.get_error()}")

    def fork(self) -> "LLGuidanceMatcher":
        twin = LLGuidanceMatcher(self.inner.deep_copy(), self.stop_token_ids, self.tokenizer,
                                 self.probes)
        twin.terminated = self.terminated
        twin._steps = list(self._steps)
        return twin

    def is_completed(self) -> bool:
        return self.terminated or self.inner.is_accepting()

    def failure(self) -> str | None:
        if not self.inner.is_error():
            return None
        return (f"the grammar reached llguidance's per-step limits here "
                f"({_first_line(self.inner.get_error())}); simplify the grammar or use "
                "grammar engine 'xgrammar'")

    def is_terminated(self) -> bool:
        return self.terminated

    def forced_continuation(self) -> str:
        if self.terminated:
            return ""
        raw = self.inner.compute_ff_bytes()
        for cut in range(len(raw), max(-1, len(raw) - 4), -1):  # drop a split character
            try:
                return raw[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def state_key(self) -> tuple:
        if self.terminated:
            return (True, b"")
        if self._key is None:  # (a search asks again for the same state: once is enough)
            self._key = self.step_state() + (self._runs(),)
        return self._key

    def _runs(self) -> tuple:
        """For each probe character, how many may come in a row from here, and (for a
        bounded run) the bytes forced right after it: the place in a fixed-width run
        such as a uuid's ``[0-9a-f]{12}``, where mask and forced bytes repeat at every
        place, and which run it is (a uuid's last 4-digit group ends in "-", its
        12-digit group in a quote); then, for each separator that may come next, how many
        (separator, probe character) pairs may follow. Microseconds: validate_tokens consumes nothing; a
        bounded run is consumed and rolled back."""
        runs, inner = [], self.inner
        chars, separators = self.probes
        for probe in chars:
            n = inner.validate_tokens([probe] * PROBE_RUN)
            after = b""
            if 0 < n < PROBE_RUN:
                done = inner.try_consume_tokens([probe] * n)
                if done == n:
                    after = inner.compute_ff_bytes()
                if done:
                    inner.rollback(done)
            runs.append((n, after))
        # and for each separator allowed here, how long a run of (separator, probe
        # character) pairs may come: how many fields of a pattern are left, which tells a
        # field from the next one that looks alike from inside
        for sep in separators:
            if inner.validate_tokens([sep]):
                runs.append(tuple(inner.validate_tokens([sep, probe] * PROBE_FIELDS)
                                  for probe in chars))
            else:
                runs.append(None)
        return tuple(runs)

    def step_state(self) -> tuple:
        # without the runs (the costly part): the next mask tells next states apart
        # well enough to keep one token per next state
        if self.terminated:
            return (True, b"")
        return (self.inner.is_accepting(), self.inner.compute_ff_bytes(),
                hash(self.inner.compute_bitmask()))

    def rule_start(self) -> None:
        return None

    def has_parser_state(self) -> bool:
        return False
