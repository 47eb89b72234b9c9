"""The grammar backends' protocol: xgrammar and llguidance (a grammar **backend**: the
library that compiles a grammar and masks tokens by it) behind one small interface, and
the ``auto`` rule that picks one per grammar.

The engine's guided path (worker/guided/guided_process.py: GuidedDecodingManager), the
closing search (closing.py), the loop guard and the stop-string check use only this
interface, so every guided feature works on either backend. One module per library
implements it (xgrammar_backend.py, llguidance_backend.py); nothing outside this package
touches a library's matcher. The protocol:

    compiled = backend.compile(spec)         # GrammarSpec -> CompiledGrammar, or EngineRefused
    m = backend.matcher(compiled)            # a fresh matcher (cheap: shares the compiled grammar)
    backend.fill_rows(bitmask, rows, ms)     # row rows[i] for ms[i], the batch at once
    m.fill_bitmask(bitmask, row)             # bitmask: [B, ceil(V / 32)] int32 on CPU; row `row`
                                             # gets bit t set iff token t may come next
    m.accept_token(t) -> bool                # False leaves the matcher as it was
    m.rollback(n); m.fork()                  # undo the last n accepted tokens; an independent copy
    m.is_completed()                         # the text so far is a whole match
                                             # (a stop token may come)
    m.is_terminated()                        # a stop token was accepted
    m.forced_continuation() -> str           # text every continuation starts with (jump-forward)
    m.accept_string(text) -> bool            # one rollback step; False leaves the matcher as it was
    m.state_key(); m.step_state()            # the closing search's state keys (see below)
    m.rule_start() -> int | None             # where the outermost open rule began (-1: the root)

xgrammar's method names are aliases on every matcher (``fill_next_token_bitmask``,
``find_jump_forward_string``), so code written against ``xgr.GrammarMatcher`` runs on both.

State keys, for the closing search's merging of states (closing.py): each backend's
module says what its keys are. A merge of two states that differ can only make a closing
estimate worse (a path is missed), never an output invalid: every closing path is
replayed on the real matcher before it is emitted.

Both backends write the same bitmask layout (xgrammar's: bit ``t % 32`` of word ``t // 32``),
so worker/guided/bitmask.py applies either. Their masks differ slightly: llguidance
leaves out special tokens, and where the grammar forces text (``{"`` of ``{"a": ``) the
tokens that cover only part of it (``{``), which it still accepts if fed. Stop tokens are
the model's EOS ids on both: a stop token is accepted only where the grammar may end, and
ends the match.

The names ``xgrammar``, ``llguidance`` and ``auto`` are what users see: a spec's
``engine``, the server's ``grammar_engine``, reports and metrics.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from core.errors import ErrorKind, GrammarError
from core.grammar_spec import GrammarSpec

XGRAMMAR, LLGUIDANCE, AUTO = "xgrammar", "llguidance", "auto"
BACKENDS = (XGRAMMAR, LLGUIDANCE)
# the kinds ``auto`` may send to llguidance: the JSON ones, where refusing is its verdict on
# exactness; other kinds stay on xgrammar, whose dialects (EBNF, structural tags) they use
LLGUIDANCE_AUTO_KINDS = ("json_schema", "json_object")

# the kinds llguidance takes (the others are written in xgrammar's dialects)
LLGUIDANCE_KINDS = ("json_schema", "json_object", "regex", "choice")


class EngineRefused(GrammarError):
    """An engine would not compile a grammar: invalid, over a limit, or (llguidance) not
    enforceable exactly. ``engine`` names the engine; the message names what it refused.
    A GrammarError (so a ValueError) with the client-fault ``kind`` of the cache's
    vocabulary."""

    def __init__(self, engine: str, message: str, kind: ErrorKind = ErrorKind.INVALID_GRAMMAR):
        super().__init__(message, kind)
        self.engine = engine

    def __reduce__(self):
        return (type(self), (self.engine, str(self), self.kind))


@dataclass(eq=False, slots=True)
class GrammarFacts:
    """What searches learned of a compiled grammar, shared by its requests and the grammar
    check (worker/guided/grammar_check.py, check_reports.py), kept with the grammar in the
    manager's cache. Each field is read and written by name; none is a search's input."""

    # the shortest output found from the start so far (OutputPolicy's admission: a budget
    # that holds it is admitted with it, whatever a later search on a busy engine finds in
    # its time)
    start_path: tuple[int, ...] | None = None
    # the shortest output the grammar check reported (a request with that max_tokens is
    # admitted with ``start_path``); 0: none reported
    checked_budget: int = 0
    # the schema's witness (schema_witness.py) replayed from the start, or None where it has
    # none; read only once ``witness_known``
    witness_path: tuple[int, ...] | None = None
    witness_known: bool = False
    # the dive's output from the start (the closing window's floor,
    # OutputPolicy._estimate_at_start), and how many dives were tried for it
    start_dive: tuple[int, ...] | None = None
    start_dives: int = 0
    # auto: the engines that refused the grammar before the one that compiled it (name ->
    # its EngineRefused), which the grammar check reports without compiling it again
    refusals: dict = field(default_factory=dict)

    def remember_start_path(self, path) -> None:
        """Keeps ``path`` as ``start_path`` where it is shorter than the one known."""
        if self.start_path is None or len(path) < len(self.start_path):
            self.start_path = tuple(path)

    def admission(self) -> "GrammarFacts | None":
        """The facts admission reads (``start_path``, ``checked_budget``, the witness), as a
        record of their own (a kept grammar check's report puts them back on a grammar
        compiled again, ``adopt``); None where none is known."""
        if self.start_path is None and not self.checked_budget and not self.witness_known:
            return None
        return GrammarFacts(start_path=self.start_path, checked_budget=self.checked_budget,
                            witness_path=self.witness_path, witness_known=self.witness_known)

    def adopt(self, other: "GrammarFacts") -> None:
        """Takes ``other``'s admission facts where this record knows none."""
        if self.start_path is None:
            self.start_path = other.start_path
        if not self.checked_budget:
            self.checked_budget = other.checked_budget
        if not self.witness_known and other.witness_known:
            self.witness_path, self.witness_known = other.witness_path, True


@dataclass(frozen=True)
class CompiledGrammar:
    """What an engine built for a spec. ``artifact``: an ``xgr.CompiledGrammar`` or, for
    llguidance, the matcher at the start (each request gets a copy of it)."""

    engine: str
    spec: GrammarSpec
    artifact: object
    compile_s: float
    # the backend compiles a JSON schema only where it enforces it exactly (GrammarBackend.exact)
    exact: bool = False
    # what searches learned of the grammar (GrammarFacts), shared by its requests and the
    # grammar check
    facts: GrammarFacts = field(default_factory=GrammarFacts, compare=False, repr=False)


class GrammarMatcher(ABC):
    """One request's position in a grammar (see the module doc for the protocol)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None: ...

    @abstractmethod
    def accept_token(self, token: int) -> bool: ...

    def accept_tokens(self, tokens) -> bool:
        """Accepts ``tokens`` in turn; False at the first one refused (the matcher then
        stands after the ones before it: callers replay paths on a fork). A library that
        takes a list in one call overrides it (replaying a closing path of hundreds of
        tokens is then one call, not hundreds)."""
        return all(self.accept_token(t) for t in tokens)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (the matcher is left as it was). A library
        that can tell without a copy of the matcher overrides it."""
        return self.fork().accept_token(token)

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def fork(self) -> "GrammarMatcher": ...

    @abstractmethod
    def is_completed(self) -> bool: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def forced_continuation(self) -> str: ...

    @abstractmethod
    def accept_string(self, text: str) -> bool: ...

    @abstractmethod
    def state_key(self) -> tuple: ...

    @abstractmethod
    def step_state(self) -> object: ...

    @abstractmethod
    def rule_start(self) -> int | None: ...

    @abstractmethod
    def has_parser_state(self) -> bool:
        """Whether equal ``state_key()``s mean the parser stands at the same place (closing
        then trusts the key in ``same_place`` and searches no third time by depth)."""

    engine: str

    def failure(self) -> str | None:
        """Why the matcher can go no further though the grammar was not done (llguidance:
        a mask step over its limits, ``LLGUIDANCE_LIMITS``), or None."""
        return None

    # xgrammar's names, for code written against xgr.GrammarMatcher
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        self.fill_bitmask(bitmask, index)

    def find_jump_forward_string(self) -> str:
        return self.forced_continuation()


class GrammarBackend(ABC):
    """One grammar library: compiles specs, makes matchers, fills a batch's mask rows (see
    the module doc). What the guided path must know of a library is said here, as data,
    so nothing outside this package branches on a library's name."""

    name: str  # the user-visible name: "xgrammar" or "llguidance"
    vocab_size: int
    # compiled in the worker in about a millisecond, never through the shared grammar
    # cache (which applies its own limits to what it compiles): the worker applies the
    # repetition limit itself, and another worker gains next to nothing by sending such a
    # grammar's requests here
    compiles_locally: bool = False
    # refuses a JSON schema it cannot enforce exactly (an approximated keyword never
    # reaches a matcher: only a custom format, which constrains nothing, stays unchecked)
    exact: bool = False

    @abstractmethod
    def compile(self, spec: GrammarSpec, *, client: str | None = None,
                cancel: threading.Event | None = None) -> CompiledGrammar:
        """Builds ``spec``; raises EngineRefused naming what the backend refused (or the
        GrammarError of the compile service it fetches from). ``client`` (the request's
        GenerationRequest.client) and ``cancel`` (set: nobody waits any more) are for a
        backend that compiles through a service; the others ignore them."""

    @abstractmethod
    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher: ...

    def fill_rows(self, bitmask: torch.Tensor, rows: list[int],
                  matchers: list[GrammarMatcher], threads: int = 1) -> None:
        """Fills bitmask row ``rows[i]`` for ``matchers[i]`` (this backend's matchers), at
        most ``threads`` threads at once; the library's batch fill where it has one."""
        for row, m in zip(rows, matchers):
            m.fill_bitmask(bitmask, row)

    @abstractmethod
    def grammar_bytes(self, compiled: CompiledGrammar) -> int:
        """What ``compiled`` counts against the worker's grammar cache bound."""


# --- state keys from public calls --------------------------------------------------------

# the characters whose runs tell places apart in a state key (probe_runs; llguidance's
# LLGuidanceMatcher._runs): a fixed-width field's digits, hex digits or letters
PROBE_TEXTS = ("0", "a", "A")
PROBE_RUN = 64  # a run this long counts as unbounded
# separators a pattern's fields are joined by: how many (separator, probe character)
# pairs may follow tells apart two fields that look alike from inside (in
# ``[0-9]+-[0-9]+-[0-9]+`` the first field is followed by two "-0", the second by one)
SEPARATOR_TEXTS = ("/", "-", ":", ".", "_", "@", "+", ",", " ")
PROBE_FIELDS = 4  # pairs probed: up to this many fields ahead


def probe_runs(m: GrammarMatcher) -> tuple:
    """What a matcher's state key adds to its next mask to tell apart the places of a
    fixed-width run, from ``accept_string`` and ``rollback`` alone: for each probe
    character, how many may come in a row from here (up to ``PROBE_RUN``) and, for a
    bounded run, the text forced right after it (a uuid's last 4-digit group ends in "-",
    its 12-digit group in a quote); then, for each separator allowed here, how many
    characters of (separator, probe character) pairs may follow (up to ``PROBE_FIELDS``
    pairs): which field of ``[0-9]+-[0-9]+-[0-9]+`` this is (not in free text, where every
    probe character may run on). Each length is found by a
    binary search of all-or-nothing ``accept_string`` calls (a few microseconds each);
    ``m`` is left as it was."""
    runs = []
    for probe in PROBE_TEXTS:
        n = _longest(m, probe * PROBE_RUN)
        after = ""
        if 0 < n < PROBE_RUN and m.accept_string(probe * n):
            after = m.forced_continuation()
            m.rollback(1)
        runs.append((n, after))
    if all(n == PROBE_RUN for n, _ in runs):
        return tuple(runs)  # free text: every separator is a character like any other
    for sep in SEPARATOR_TEXTS:
        fields = tuple(_longest(m, (sep + probe) * PROBE_FIELDS) for probe in PROBE_TEXTS)
        runs.append(fields if any(fields) else None)
    return tuple(runs)


def _longest(m: GrammarMatcher, text: str) -> int:
    """The length of the longest prefix of ``text`` that ``m`` accepts (a matcher accepts
    every prefix of what it accepts), ``m`` left as it was."""
    if m.accept_string(text):  # (free text: one call)
        m.rollback(1)
        return len(text)
    ok, bad = 0, len(text)
    while bad - ok > 1:
        mid = (ok + bad) // 2
        if m.accept_string(text[:mid]):
            m.rollback(1)
            ok = mid
        else:
            bad = mid
    return ok


# --- choosing -------------------------------------------------------------------------------

def backend_order(spec: GrammarSpec, default: str = AUTO, *,
                  llguidance: bool = True) -> tuple[str, ...]:
    """The ``auto`` rule, and what a spec or server asks for: the backends that may serve
    ``spec``, in the order they are tried; the first that compiles it serves it, and the
    last one's refusal is the answer. ``default``: the server's ``grammar_engine``, for a
    spec whose engine is ``auto``; ``llguidance``: whether llguidance is available here.

    - A spec that names llguidance gets it or its refusal; a server default of llguidance
      sends it the kinds it takes (the others are written in xgrammar's dialects).
    - ``auto``: llguidance for a JSON grammar (json_schema, json_object) it compiles,
      since it compiles only what it enforces exactly, and in well under a millisecond;
      xgrammar for one it refuses (xgrammar approximates it) and for every other kind.
      No schema class is sent to xgrammar for closing's sake: fixed-width formats (uuid,
      date, ``{n}`` patterns) close on llguidance too, since its state key tells the
      places of a run apart (``LLGuidanceMatcher.state_key``)."""
    asked = spec.engine if spec.engine != AUTO else default
    if spec.engine == LLGUIDANCE or (asked == LLGUIDANCE and spec.kind in LLGUIDANCE_KINDS):
        return (LLGUIDANCE,)
    if asked == AUTO and spec.kind in LLGUIDANCE_AUTO_KINDS and llguidance:
        return (LLGUIDANCE, XGRAMMAR)
    return (XGRAMMAR,)


def auto_backend(spec: GrammarSpec, llguidance_refusal: EngineRefused | None) -> str:
    """The backend ``auto`` serves ``spec`` on (``backend_order``), given what llguidance
    said of it (``llguidance_refusal``; None: it compiled)."""
    order = backend_order(spec)
    return order[-1] if llguidance_refusal is not None else order[0]


def compile_auto(backends: dict[str, GrammarBackend], spec: GrammarSpec) -> CompiledGrammar:
    """Compiles ``spec`` on the backends ``auto`` tries (``backend_order``); raises the
    last one's EngineRefused where none takes it."""
    *first, last = backend_order(spec)
    for name in first:
        try:
            return backends[name].compile(spec)
        except EngineRefused:
            continue
    return backends[last].compile(spec)


def backends_for(tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 compile_threads: int = 1) -> dict[str, GrammarBackend]:
    """Both backends for a Hugging Face tokenizer, by name."""
    from worker.guided.llguidance_backend import LLGuidanceBackend
    from worker.guided.xgrammar_backend import XGrammarBackend

    return {XGRAMMAR: XGrammarBackend.from_huggingface(tokenizer, vocab_size, stop_token_ids,
                                                       compile_threads=compile_threads),
            LLGUIDANCE: LLGuidanceBackend.from_huggingface(tokenizer, vocab_size,
                                                           stop_token_ids)}
