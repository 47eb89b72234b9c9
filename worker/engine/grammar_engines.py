"""Grammar engines: xgrammar and llguidance behind one small interface, and the ``auto``
rule that picks one per grammar.

The engine (guided_process.py: GuidedDecodingManager), the closing search (closing.py),
the loop guard and the stop-string check use only this interface, so every guided
feature works on either engine. The protocol, per engine:

    compiled = engine.compile(spec)          # GrammarSpec -> CompiledGrammar, or EngineRefused
    m = engine.matcher(compiled)             # a fresh matcher (cheap: shares the compiled grammar)
    m.fill_bitmask(bitmask, row)             # bitmask: [B, ceil(V / 32)] int32 on CPU; row `row`
                                             # gets bit t set iff token t may come next
    m.accept_token(t) -> bool                # False leaves the matcher as it was
    m.rollback(n); m.fork()                  # undo the last n accepted tokens; an independent copy
    m.is_completed()                         # the text so far is a whole match (a stop token may come)
    m.is_terminated()                        # a stop token was accepted
    m.forced_continuation() -> str           # text every continuation starts with (jump-forward)
    m.accept_string(text) -> bool            # one rollback step; False leaves the matcher as it was
    m.state_key(); m.step_state()            # the closing search's state keys (see below)
    m.rule_start() -> int | None             # where the outermost open rule began (-1: the root)

xgrammar's method names are aliases on every matcher (``fill_next_token_bitmask``,
``find_jump_forward_string``), so code written against ``xgr.GrammarMatcher`` runs on both.

State keys, for the closing search's merging of states (closing.py). A merge of two states
that differ can only make a closing estimate worse (a path is missed), never an output
invalid: every closing path is replayed on the real matcher before it is emitted.
- xgrammar: ``state_key()`` is its parser state at the last step without positions (read
  from its debug text: xgrammar 0.2.8 has no public form), ``step_state()`` that state
  with positions, ``rule_start()`` the earliest position of an open rule.
- llguidance exposes no parser state. ``state_key()`` is what it does expose that is a
  function of the state: whether it may end, its forced bytes, and for each of a few
  probe characters (``0``, ``a``, ``A``) how many may come in a row from here
  (``validate_tokens``, which consumes nothing) and, for a bounded run, the bytes forced
  right after it. The runs stand in for xgrammar's unrolled positions: inside a uuid's
  ``[0-9a-f]{12}`` mask and forced bytes repeat at every place, and without them the
  search merged the places and could not close a uuid or a date (it then neither
  refused a budget too small for such a schema nor closed the output). ``step_state()``
  adds the next-token mask (so two tokens count as one next state only where everything
  that may follow them is the same); ``rule_start()`` is None (unknown: a closing edge
  always keeps its depth, which merges less). ``has_parser_state()`` is False, so a
  search that finds nothing searches again with states told apart by depth too (as
  xgrammar's does when its debug text cannot be read) before it calls a grammar
  unclosable.

Both engines write the same bitmask layout (xgrammar's: bit ``t % 32`` of word ``t // 32``),
so worker/engine/bitmask.py applies either. Their masks differ slightly: llguidance
leaves out special tokens, and where the grammar forces text (``{"`` of ``{"a": ``) the
tokens that cover only part of it (``{``), which it still accepts if fed. Stop tokens are the model's EOS ids on both: a
stop token is accepted only where the grammar may end, and ends the match.

The two differ in what they enforce for a JSON schema: xgrammar approximates what it
cannot express (``not``, ``uniqueItems``, ``allOf`` ...: it accepts instances the schema
forbids), llguidance refuses such a schema (``EngineRefused``). Before llguidance sees a
schema, ``exact_rewrites`` turns what it lacks but can express exactly into what it has
(``dependencies`` as an ``anyOf`` per key; a custom ``format``, which constrains nothing,
dropped; ``not`` as its negation where one exists without ``not``; ``oneOf`` as ``anyOf``
where no instance can match two branches; a node bounded by an ``enum`` as the enum of the
values it allows, checked by the validator). llguidance also has no
``indent`` layout, no ``any_order`` and no runaway digit guards (``max_*_digits``): it
refuses the first two and leaves numbers unbounded where the schema does.
"""

from __future__ import annotations

import functools
import json
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import xgrammar as xgr

from grammar_cache.compile import compile_spec
from grammar_cache.errors import ErrorKind, GrammarError
from grammar_cache.spec import GrammarSpec

XGRAMMAR, LLGUIDANCE, AUTO = "xgrammar", "llguidance", "auto"
ENGINES = (XGRAMMAR, LLGUIDANCE)
# the kinds ``auto`` may send to llguidance: the JSON ones, where refusing is its verdict on
# exactness; other kinds stay on xgrammar, whose dialects (EBNF, structural tags) they use
LLGUIDANCE_AUTO_KINDS = ("json_schema", "json_object")


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


@dataclass(frozen=True)
class CompiledGrammar:
    """What an engine built for a spec. ``artifact``: an ``xgr.CompiledGrammar`` or, for
    llguidance, the matcher at the start (each request gets a copy of it)."""

    engine: str
    spec: GrammarSpec
    artifact: object
    compile_s: float


class GrammarMatcher(ABC):
    """One request's position in a grammar (see the module doc for the protocol)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None: ...

    @abstractmethod
    def accept_token(self, token: int) -> bool: ...

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
    def has_parser_state(self) -> bool: ...

    engine: str

    # xgrammar's names, for code written against xgr.GrammarMatcher
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        self.fill_bitmask(bitmask, index)

    def find_jump_forward_string(self) -> str:
        return self.forced_continuation()


def as_matcher(m) -> GrammarMatcher:
    """``m`` as an interface matcher (a bare ``xgr.GrammarMatcher`` is wrapped)."""
    return XGrammarMatcher(m) if isinstance(m, xgr.GrammarMatcher) else m


class GrammarEngine(ABC):
    name: str
    vocab_size: int

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Builds ``spec``; raises EngineRefused naming what the engine refused."""

    @abstractmethod
    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher: ...


# --- xgrammar -------------------------------------------------------------------------------

class XGrammarEngine(GrammarEngine):
    """xgrammar through the served compile path (grammar_cache/compile.py: our JSON
    layouts, the control-character fix, the digit guards)."""

    name = XGRAMMAR

    def __init__(self, tokenizer_info: "xgr.TokenizerInfo", *, compile_threads: int = 1):
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=compile_threads,
                                            cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            artifact = compile_spec(self.compiler, spec)
        except GrammarError as exc:
            raise EngineRefused(XGRAMMAR, str(exc), exc.kind) from None
        return CompiledGrammar(XGRAMMAR, spec, artifact, time.perf_counter() - start)

    def matcher(self, compiled: CompiledGrammar) -> "XGrammarMatcher":
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.artifact))


class XGrammarMatcher(GrammarMatcher):
    engine = XGRAMMAR

    def __init__(self, inner: "xgr.GrammarMatcher"):
        self.inner = inner

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.inner.fork())

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_continuation(self) -> str:
        return self.inner.find_jump_forward_string()

    def accept_string(self, text: str) -> bool:
        return self.inner.accept_string(text)

    def state_key(self) -> tuple:
        return _without_positions(self._states())

    def step_state(self) -> str:
        return self.inner._debug_print_internal_state().rsplit("Last step", 1)[-1]

    def rule_start(self) -> int:
        return min((int(p) for _, _, _, p, _ in self._states()), default=-1)

    def has_parser_state(self) -> bool:
        return bool(self._states())

    def _states(self) -> tuple:
        return _states_of(self.step_state())


_PARSER_STATE = re.compile(r"rule_id=(\d+), sequence_id=(\d+), element_id=(\d+), "
                           r"rule_start_pos=(-?\d+), sub_element_id=(\d+)")


@functools.lru_cache(maxsize=4096)
def _states_of(text: str) -> tuple:
    """xgrammar's parser states in its debug text (parsed once per distinct text: a
    closing search reads the same few states thousands of times); () if it does not
    parse (another xgrammar)."""
    return tuple(_PARSER_STATE.findall(text))


@functools.lru_cache(maxsize=4096)
def _without_positions(states: tuple) -> tuple:
    """Where in which rules, without positions: only whether a rule began at the root is
    kept of them, or every path would be a state of its own. A repetition such as
    ``[0-9a-f]{8}`` is unrolled in xgrammar, so each place in it stays a state of its own."""
    return tuple((int(r), int(q), int(e), int(s), p == "-1") for r, q, e, p, s in states)


# --- llguidance -----------------------------------------------------------------------------

LLGUIDANCE_KINDS = ("json_schema", "json_object", "regex", "choice")


class LLGuidanceEngine(GrammarEngine):
    """llguidance. JSON layouts map to its compile options ("spaced": ", " and ": " with no
    other blanks; "compact"; "bounded" / "any": flexible blanks, at most ``max_whitespace``
    for "bounded"); ``strict`` closes objects and tuples the schema leaves open, as
    xgrammar's strict mode does (``strict_schema``). It compiles in well under a
    millisecond for most schemas, and refuses keywords it cannot enforce."""

    name = LLGUIDANCE

    def __init__(self, tokenizer: "llguidance.LLTokenizer"):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.stop_token_ids = frozenset(tokenizer.eos_tokens)
        self.probes = _run_probes(tokenizer)

    @classmethod
    def from_huggingface(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        """For a fast Hugging Face tokenizer, with the model's vocab size (padded rows
        are never allowed) and its EOS ids as stop tokens. About half a second."""
        import llguidance.hf

        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=list(stop_token_ids)))

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        start = time.perf_counter()
        grammar = _llguidance_grammar(spec)
        start_state = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if start_state.is_error():
            raise EngineRefused(LLGUIDANCE, f"invalid {spec.kind} grammar for llguidance: "
                                f"{_first_line(start_state.get_error())}")
        return CompiledGrammar(LLGUIDANCE, spec, start_state, time.perf_counter() - start)

    def matcher(self, compiled: CompiledGrammar) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(compiled.artifact.deep_copy(), self.stop_token_ids,
                                 self.tokenizer, self.probes)


# the characters whose runs tell places apart in llguidance's state key (see
# LLGuidanceMatcher.state_key): a fixed-width field's digits, hex digits or letters
_PROBE_TEXTS = ("0", "a", "A")
_PROBE_RUN = 64  # a run this long counts as unbounded


def _run_probes(tokenizer: "llguidance.LLTokenizer") -> tuple[int, ...]:
    """The token of each probe character the tokenizer spells as one token."""
    probes = []
    for text in _PROBE_TEXTS:
        tokens = tokenizer.tokenize_str(text)
        if len(tokens) == 1:
            probes.append(tokens[0])
    return tuple(probes)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    import llguidance

    if spec.kind not in LLGUIDANCE_KINDS:
        raise EngineRefused(LLGUIDANCE, f"llguidance does not take {spec.kind} grammars "
                            f"here (they are written in xgrammar's dialect); use xgrammar")
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.source)
    if spec.whitespace == "indent":
        raise EngineRefused(LLGUIDANCE, "llguidance has no indented JSON layout; use "
                            "whitespace 'spaced', 'compact', 'bounded' or 'any'")
    if spec.any_order:
        raise EngineRefused(LLGUIDANCE, "llguidance keeps a schema's property order; "
                            "any_order needs xgrammar")
    schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
    if spec.strict:  # (first: the rewrites' anyOf members would keep a node open)
        schema = strict_schema(schema)
    schema = exact_rewrites(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=_json_options(spec))
    except ValueError as exc:
        raise EngineRefused(LLGUIDANCE, f"invalid {spec.kind} grammar for llguidance: "
                            f"{_first_line(str(exc))}") from None


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


# formats the JSON Schema drafts (3 to 2020-12) name. One llguidance lacks (uri-reference,
# regex ...) is refused, so xgrammar checks or approximates it; any other format is a
# custom annotation (OpenAPI's "byte", a form's "textarea"), which the drafts say a
# validator ignores (and jsonschema-rs, the post-validation, does): it constrains nothing
_DRAFT_FORMATS = frozenset((
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
    "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
    "uri-template", "json-pointer", "relative-json-pointer", "regex", "host-name",
    "ip-address", "color", "style", "phone", "utc-millisec"))
# dependencies written as an anyOf per key: with more keys than this, llguidance's
# expansion of the branches may cost more than xgrammar's approximation
_MAX_DEPENDENCIES = 8
# where subschemas sit: name -> schema maps, single schemas (``items`` may be a list),
# lists of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_VALUES = ("items", "prefixItems", "additionalProperties", "additionalItems",
                  "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                  "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


def exact_rewrites(node, root=None):
    """``node`` rewritten, without changing which instances it allows, into keywords
    llguidance enforces, where it would refuse the original (``root``: the document its
    local ``$ref`` s point into; ``node`` itself by default):

    - a custom ``format`` (not one of the drafts': an annotation that constrains nothing)
      is dropped;
    - ``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` become, per key
      ``k``, an ``allOf`` member ``{"anyOf": [{"properties": {"k": false}}, <k present and
      what it requires>]}``;
    - a node that allows only the values of an ``enum`` / ``const`` (its own or an
      ``allOf`` member's) and uses a keyword llguidance lacks becomes the ``enum`` of those
      values the whole node allows, each checked by the post-validation's validator
      (``_enum_filtered``);
    - ``not`` becomes its negation written without ``not`` where that is exact
      (``_negated``: a type list, a required name absent, a property present and failing
      its schema, De Morgan over ``allOf`` / ``anyOf``, ``not`` of ``not``);
    - ``oneOf`` becomes ``anyOf`` where no instance can match two branches
      (``_disjoint``: distinct types, a required property one branch forbids, a required
      property whose values differ per branch), and a ``oneOf`` of bare ``required`` lists
      becomes the ``anyOf`` of each list present with every other one incomplete.

    What it does not rewrite stays as written (llguidance then refuses it and ``auto``
    sends the schema to xgrammar)."""
    if root is None:
        root = node
    if isinstance(node, list):
        return [exact_rewrites(sub, root) for sub in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: exact_rewrites(sub, root) for name, sub in value.items()}
        elif key in _SCHEMA_VALUES and isinstance(value, (dict, list)) or (
                key in _SCHEMA_LISTS and isinstance(value, list)):
            value = exact_rewrites(value, root)
        elif key == "dependencies" and isinstance(value, dict):
            value = {name: exact_rewrites(sub, root) for name, sub in value.items()}
        out[key] = value
    if isinstance(out.get("format"), str) and out["format"] not in _DRAFT_FORMATS:
        del out["format"]
    filtered = _enum_filtered(node, root)
    if filtered is not None:
        return filtered
    out = _dependencies_as_any_of(out)
    out = _not_rewritten(node, out, root)
    if isinstance(out, dict):
        out = _one_of_rewritten(node, out, root)
    return out


def _dependencies_as_any_of(node: dict) -> dict:
    keys = [k for k in ("dependencies", "dependentRequired", "dependentSchemas")
            if isinstance(node.get(k), dict)]
    if not keys or not isinstance(node.get("allOf", []), list):
        return node
    members = []
    for key in keys:
        for name, dep in node[key].items():
            if isinstance(dep, list) and all(isinstance(n, str) for n in dep):
                present = {"required": [name, *dep]}
            elif isinstance(dep, (dict, bool)) and key != "dependentRequired":
                present = {"allOf": [{"required": [name]}, dep]}
            else:  # malformed: leave it to the engines' verdicts
                return node
            members.append({"anyOf": [{"properties": {name: False}}, present]})
    if len(members) > _MAX_DEPENDENCIES:
        return node
    out = {k: v for k, v in node.items() if k not in keys}
    out["allOf"] = [*node.get("allOf", []), *members]
    return out


# --- exact rewrites of enum-bounded nodes, ``not`` and ``oneOf`` ----------------------------

# keywords llguidance refuses (a node using none of them needs no enum filtering)
_LLGUIDANCE_LACKS = frozenset(("not", "oneOf", "if", "then", "else", "uniqueItems",
                               "contains", "minContains", "maxContains"))
# keywords that constrain nothing (annotations): ignored where a node's keywords are read
_ANNOTATIONS = frozenset(("description", "title", "$comment", "examples", "default",
                          "deprecated", "readOnly", "writeOnly", "markdownDescription",
                          "errorMessage"))
_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
# keywords whose meaning depends on what sits around a node (annotations of its neighbours,
# a changed base for references)
_CONTEXTUAL = ("unevaluatedProperties", "unevaluatedItems", "$id", "$anchor", "$dynamicRef",
               "$recursiveRef")
_MAX_ENUM_FILTERED = 256  # values checked one by one at most
_MAX_REF_DEPTH = 16


def _resolve(root, ref):
    """The target of a local ``$ref`` (``#/...`` JSON pointer) in ``root``, or None."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _walk(node, root, seen=None):
    """Every dict reachable from ``node``, local ``$ref`` s followed; None where a
    ``$ref`` is not local (so cannot be checked)."""
    seen = set() if seen is None else seen
    todo, out = [node], []
    while todo:
        sub = todo.pop()
        if isinstance(sub, list):
            todo.extend(sub)
        elif isinstance(sub, dict):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            out.append(sub)
            if "$ref" in sub:
                target = _resolve(root, sub["$ref"])
                if target is None:
                    return None
                todo.append(target)
            todo.extend(v for k, v in sub.items() if k not in ("enum", "const", "$ref")
                        and isinstance(v, (dict, list)))
    return out


def _has_const(root) -> bool:
    """``const`` is a keyword of the document's draft (not of drafts 3 and 4, which
    ignore it as an unknown word)."""
    name = root.get("$schema") if isinstance(root, dict) else None
    return not (isinstance(name, str) and any(f"draft-0{n}" in name for n in (3, 4)))


def _enum_values(node: dict, root):
    """The values ``node`` allows at most: its ``enum`` / ``const``, else an ``allOf``
    member's; None when unbounded."""
    for sub in (node, *(m for m in node.get("allOf", ()) if isinstance(m, dict))):
        if "const" in sub and _has_const(root):
            return [sub["const"]]
        if isinstance(sub.get("enum"), list):
            return sub["enum"]
    return None


def _enum_filtered(node: dict, root):
    """``{"enum": [the values the node allows]}`` for a node bounded by an enum / const
    that uses a keyword llguidance lacks, else None. Each value is checked against the
    node by jsonschema-rs (the post-validation's validator), so the enum is exactly the
    node's set of instances."""
    values = _enum_values(node, root)
    if values is None or len(values) > _MAX_ENUM_FILTERED:
        return None
    reached = _walk(node, root)
    if reached is None or not any(_LLGUIDANCE_LACKS & set(sub) for sub in reached):
        return None
    if node is not root and any(
            isinstance(sub.get("id"), str) or any(k in sub for k in _CONTEXTUAL)
            for sub in reached):
        return None  # (what sits around the node could change what it means)
    if node is root:
        schema = node
    else:  # the node on its own, with the definitions its references point into
        refs = [sub["$ref"] for sub in reached if "$ref" in sub]
        if any(not r.startswith(("#/definitions/", "#/$defs/")) for r in refs) or any(
                k in node for k in ("definitions", "$defs")):
            return None
        schema = dict(node)
        for key in ("definitions", "$defs", "$schema"):
            if isinstance(root, dict) and key in root:
                schema[key] = root[key]
    from worker.engine.validation import _validator

    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
        kept = [v for v in values if validator.is_valid(v)]
    except Exception:  # a schema jsonschema-rs cannot build or run: leave it
        return None
    if not kept:
        return False
    return {"enum": kept}


def _not_rewritten(node: dict, out: dict, root):
    """``out`` (``node`` rewritten) with its ``not`` replaced by the negation, where that is
    exact; False where the negation allows nothing."""
    if "not" not in node or not isinstance(out.get("allOf", []), list):
        return out
    negation = _negated(node["not"], root, 0)
    if negation is None:
        return out
    if negation is False:
        return False
    rest = {k: v for k, v in out.items() if k != "not"}
    if negation is not True:
        rest["allOf"] = [*rest.get("allOf", []), negation]
    return rest


def _keywords(node: dict) -> dict:
    return {k: v for k, v in node.items() if k not in _ANNOTATIONS}


def _negated(schema, root, depth: int):
    """A schema without ``not`` that allows exactly the instances ``schema`` rejects
    (True: all of them; False: none), or None where that cannot be written exactly."""
    if schema is True:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
        return None
    words = _keywords(schema)
    if not words:
        return False
    if "$ref" in words:  # (alone only: drafts differ on what its siblings mean)
        target = _resolve(root, words["$ref"])
        return None if len(words) > 1 or target is None else _negated(target, root, depth + 1)
    parts = []  # the negation of each keyword: the schema fails if any of them fails
    for key, value in words.items():
        if key == "type":
            part = _type_complement(value)
        elif key == "required" and isinstance(value, list) and all(
                isinstance(n, str) for n in value):
            absent = [{"properties": {n: False}} for n in dict.fromkeys(value)]
            part = False if not absent else {"type": "object", **absent[0]} if len(
                absent) == 1 else {"type": "object", "anyOf": absent}
        elif key == "properties" and isinstance(value, dict) and not any(
                k in words for k in ("additionalProperties", "patternProperties",
                                     "unevaluatedProperties")):
            branches = []
            for name, sub in value.items():
                neg = _negated(sub, root, depth + 1)
                if neg is None:
                    return None
                if neg is not False:
                    branches.append({"type": "object", "required": [name],
                                     "properties": {name: neg}})
            part = _any_of(branches)
        elif key == "allOf" and isinstance(value, list):
            negs = [_negated(sub, root, depth + 1) for sub in value]
            if any(n is None for n in negs):
                return None
            part = _any_of(negs)
        elif key == "anyOf" and isinstance(value, list):
            negs = [_negated(sub, root, depth + 1) for sub in value]
            if any(n is None for n in negs):
                return None
            if any(n is False for n in negs):
                part = False
            else:
                negs = [n for n in negs if n is not True]
                part = True if not negs else negs[0] if len(negs) == 1 else {"allOf": negs}
        elif key == "not":
            part = exact_rewrites(value, root) if isinstance(value, dict) else value
        else:
            return None
        if part is None:
            return None
        parts.append(part)
    return _any_of(parts)


def _any_of(schemas: list):
    """The union of ``schemas`` (True / False standing for all / none)."""
    if any(s is True for s in schemas):
        return True
    schemas = [s for s in schemas if s is not False]
    return False if not schemas else schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _type_complement(value):
    """The types a ``type`` keyword rejects, as a ``type``; None where that set is not
    one (``integer`` without ``number``: the rest of the numbers)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(n in _JSON_TYPES for n in names):
        return None
    named = set(names)
    if "integer" in named and "number" not in named:
        return None
    rest = [t for t in _JSON_TYPES if t not in named
            and not (t == "integer" and "number" in named)]
    return False if not rest else {"type": rest}


def _one_of_rewritten(node: dict, out: dict, root) -> dict:
    """``out`` (``node`` rewritten) with its ``oneOf`` written as an ``anyOf`` where that is
    exact: no instance can match two branches, or every branch is a bare ``required``."""
    members = node.get("oneOf")
    if not isinstance(members, list) or not members or not isinstance(out.get("oneOf"), list):
        return out
    if not isinstance(out.get("allOf", []), list):
        return out
    rest = {k: v for k, v in node.items() if k != "oneOf"}  # (applies beside every branch)
    facts = [_Facts(m, root, 0, rest) for m in members]
    if all(_facts_disjoint(fa, fb, root, 0) for i, fa in enumerate(facts)
           for fb in facts[i + 1:]):
        union = out["oneOf"]
    else:
        union = _exclusive_required(members)
        if union is None:
            return out
    rest = {k: v for k, v in out.items() if k != "oneOf"}
    if union is False:
        return False
    if "anyOf" in rest:
        rest["allOf"] = [*rest.get("allOf", []), {"anyOf": union}]
    else:
        rest["anyOf"] = union
    if union is not out["oneOf"] and len(members) > 1:
        rest["allOf"] = [*rest.get("allOf", []), {"type": "object"}]
    return rest


def _exclusive_required(members: list):
    """A ``oneOf`` whose branches are bare ``required`` lists as anyOf branches: list i
    present and every other list missing a name of its own; None where a branch is
    anything else. (On a value that is not an object every list holds, so with two or
    more branches none may match: the caller adds ``"type": "object"``.)"""
    lists = []
    for member in members:
        words = _keywords(member) if isinstance(member, dict) else None
        if words is None or set(words) != {"required"} or not isinstance(
                words["required"], list) or not all(isinstance(n, str) for n in words["required"]):
            return None
        lists.append(list(dict.fromkeys(words["required"])))
    branches = []
    for i, names in enumerate(lists):
        others = []
        for j, other in enumerate(lists):
            missing = [n for n in other if n not in names]
            if j == i:
                continue
            if not missing:  # list j holds whenever list i does: branch i never matches alone
                others = None
                break
            others.append(_any_of([{"properties": {n: False}} for n in missing]))
        if others is None:
            continue
        branch = {"required": names} if names else {}
        if others:
            branch["allOf"] = others
        branches.append(branch)
    return branches or False


class _Facts:
    """What every instance of a schema has, read from it, its ``allOf`` members and the
    targets of its local ``$ref`` s: the types it may take (None: any), the values it
    may take (None: unbounded), the property names it requires, and per property the
    schemas that apply to it."""

    def __init__(self, schema, root, depth: int, beside=None):
        self.types, self.values, self.required = None, None, set()
        self.props: dict[str, list] = {}
        self.closed: list[dict] = []  # conjuncts whose additionalProperties is false
        self.prefixes: list[str] = []  # literal starts every string must have (patterns)
        self.known, self.never = True, schema is False
        self._read(schema, root, depth)
        if beside is not None:  # a schema that applies with it (the node around a oneOf)
            self._read(beside, root, depth)

    def _read(self, schema, root, depth):
        if schema is True:
            return
        if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
            self.known = False
            return
        if "$ref" in schema:  # the target applies (with or without its siblings, per draft)
            target = _resolve(root, schema["$ref"])
            if target is None:
                self.known = False
            else:
                self._read(target, root, depth + 1)
            return
        if "type" in schema:
            names = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
            if isinstance(names, list):
                self._narrow({t for t in names if t in _JSON_TYPES})
        values = [schema["const"]] if "const" in schema and _has_const(root) else schema.get(
            "enum")
        if isinstance(values, list):
            self.values = values if self.values is None else [
                v for v in self.values if _canonical(v) in {_canonical(w) for w in values}]
            self._narrow({t for v in values for t in _types_of(v)})
        if isinstance(schema.get("required"), list):
            self.required |= {n for n in schema["required"] if isinstance(n, str)}
        if isinstance(schema.get("properties"), dict):
            for name, sub in schema["properties"].items():
                self.props.setdefault(name, []).append(sub)
        if schema.get("additionalProperties") is False:
            self.closed.append(schema)
        if isinstance(schema.get("pattern"), str):
            self.prefixes.append(_literal_start(schema["pattern"]))
        for sub in schema.get("allOf", ()) if isinstance(schema.get("allOf"), list) else ():
            self._read(sub, root, depth + 1)

    def _narrow(self, types: set):
        if "number" in types:
            types = types | {"integer"}
        self.types = types if self.types is None else self.types & types

    def forbids(self, name: str) -> bool:
        """No instance that is an object has the property ``name``."""
        if any(sub is False for sub in self.props.get(name, ())):
            return True
        return any(name not in (c.get("properties") or {}) and not c.get("patternProperties")
                   for c in self.closed)


def _literal_start(pattern: str) -> str:
    """The text every string a ``pattern`` matches starts with: the literal characters
    after a leading ``^`` up to the first that is not plainly literal (a metacharacter, an
    escape other than of punctuation, or a character a quantifier follows); "" when the
    pattern is not anchored or has an alternation (``^a|b`` anchors ``a`` only)."""
    if not pattern.startswith("^") or "|" in pattern:
        return ""
    out, i = [], 1
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            char, step = pattern[i + 1], 2
        elif char.isalnum() or char in " -_/:@#%&=,;'\"<>~`!":
            step = 1
        else:
            break
        if i + step < len(pattern) and pattern[i + step] in "?*{+":
            break  # (the character may repeat or be absent: "+" keeps it, kept simple)
        out.append(char)
        i += step
    return "".join(out)


def _types_of(value) -> set:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"integer", "number"} if float(value).is_integer() else {"number"}
    return {"string"} if isinstance(value, str) else {"array"} if isinstance(
        value, list) else {"object"}


def _canonical(value) -> str:
    """A value's text, equal for values JSON Schema calls equal (1 and 1.0)."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _disjoint(a, b, root, depth: int) -> bool:
    """Provably no instance matches both ``a`` and ``b``. False: not shown."""
    if a is False or b is False:
        return True
    if depth > _MAX_REF_DEPTH:
        return False
    return _facts_disjoint(_Facts(a, root, depth), _Facts(b, root, depth), root, depth)


def _facts_disjoint(fa: "_Facts", fb: "_Facts", root, depth: int) -> bool:
    if fa.never or fb.never:
        return True
    if not fa.known or not fb.known:
        return False
    common = fa.types if fb.types is None else fb.types if fa.types is None else (
        fa.types & fb.types)
    if common is not None and not common:
        return True
    if common is not None and common <= {"string"} and any(
            not a_start.startswith(b_start) and not b_start.startswith(a_start)
            for a_start in fa.prefixes for b_start in fb.prefixes):
        return True  # (two strings, each pattern anchored on a different literal start)
    if fa.values is not None and fb.values is not None and not (
            {_canonical(v) for v in fa.values} & {_canonical(v) for v in fb.values}):
        return True
    if common is None or not common <= {"object"}:
        return False  # (required / properties say nothing of a value that is no object)
    if any(fb.forbids(n) for n in fa.required) or any(fa.forbids(n) for n in fb.required):
        return True
    return any(_disjoint(sa, sb, root, depth + 1)
               for name in fa.required | fb.required
               for sa in fa.props.get(name, ()) for sb in fb.props.get(name, ()))


# keywords whose presence beside "properties" / "prefixItems" makes closing the node wrong
# (the extra properties / items may be declared there) or a no-op
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
                "anyOf", "oneOf", "$ref", "if", "dependentSchemas")
_OPEN_ARRAY = ("items", "additionalItems", "unevaluatedItems", "allOf", "anyOf", "oneOf",
               "$ref", "if")
# subschemas by how they apply: to other values (a property's, an item's) or to this one
_OTHER_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OTHER_VALUES = ("items", "prefixItems", "additionalProperties", "additionalItems",
                 "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SAME_LISTS = ("allOf", "anyOf", "oneOf")
_SAME_VALUES = ("then", "else")


def strict_schema(node, merged: bool = False):
    """``node`` with xgrammar's strict mode written into it, for an engine that follows
    the schema to the letter: an object schema with ``properties`` and no word on other
    properties gets ``"additionalProperties": false``, a tuple (``prefixItems``, or a
    draft-4 ``items`` list) with no word on further items gets none allowed.

    A node stays open where another schema applies to the same value and may declare
    more (``merged``: the branches of an ``allOf``, of an ``anyOf`` / ``oneOf`` beside
    ``properties``, ``then`` / ``else``, ``dependentSchemas``), and where a sibling keyword
    may (``allOf``, ``$ref``, ``patternProperties`` ...). ``not`` and ``if`` are left as
    written: closing them would widen what the schema allows."""
    if isinstance(node, list):
        return [strict_schema(n, merged) for n in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _OTHER_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in node[key].items()}
    for key in _OTHER_VALUES:
        if isinstance(node.get(key), (dict, list)):
            out[key] = strict_schema(node[key])
    for key in _SAME_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [strict_schema(sub, merged=merged or key == "allOf" or "properties" in node)
                        for sub in node[key]]
    for key in _SAME_VALUES:
        if isinstance(node.get(key), dict):
            out[key] = strict_schema(node[key], merged=True)
    if isinstance(node.get("dependentSchemas"), dict):
        out["dependentSchemas"] = {name: strict_schema(sub, merged=True)
                                   for name, sub in node["dependentSchemas"].items()}
    if merged:
        return out
    props = node.get("properties")
    if isinstance(props, dict) and not any(k in node for k in _OPEN_OBJECT) and all(
            name in props for name in _named(node)):
        out["additionalProperties"] = False  # (a required key it does not list keeps it open)
    if isinstance(node.get("prefixItems"), list) and not any(k in node for k in _OPEN_ARRAY):
        out["items"] = False
    elif isinstance(node.get("items"), list) and not any(
            k in node for k in ("additionalItems", "unevaluatedItems", "allOf", "$ref")):
        out["additionalItems"] = False
    return out


def _named(node: dict) -> list:
    """The property names ``node`` requires, outright or on a condition (``dependencies``,
    ``dependentRequired``); None for a schema-valued dependency, which may declare more."""
    names = [n for n in node.get("required", ()) if isinstance(n, str)]
    for key in ("dependencies", "dependentRequired"):
        if isinstance(node.get(key), dict):
            for name, dep in node[key].items():
                names += [name, *(n if isinstance(n, str) else None for n in dep)] if (
                    isinstance(dep, list)) else [None]
    return names


class LLGuidanceMatcher(GrammarMatcher):
    """llguidance's LLMatcher with xgrammar's semantics: a refused token leaves the
    matcher as it was (llguidance would enter its error state for good), a stop token is
    accepted where the grammar may end and counts as one step for ``rollback`` (the
    matcher itself never sees it), and ``accept_string`` is one step however many tokens
    it takes (``_steps``: the tokens of each step, for rollback)."""

    engine = LLGUIDANCE

    def __init__(self, inner: "llguidance.LLMatcher", stop_token_ids: frozenset[int],
                 tokenizer: "llguidance.LLTokenizer | None" = None,
                 probes: tuple[int, ...] = ()):
        self.inner = inner
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer
        self.probes = probes
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
        12-digit group in a quote). Microseconds: validate_tokens consumes nothing; a
        bounded run is consumed and rolled back."""
        runs, inner = [], self.inner
        for probe in self.probes:
            n = inner.validate_tokens([probe] * _PROBE_RUN)
            after = b""
            if 0 < n < _PROBE_RUN:
                done = inner.try_consume_tokens([probe] * n)
                if done == n:
                    after = inner.compute_ff_bytes()
                if done:
                    inner.rollback(done)
            runs.append((n, after))
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


# --- choosing -------------------------------------------------------------------------------

def auto_engine(spec: GrammarSpec, llguidance_refusal: EngineRefused | None) -> str:
    """The ``auto`` rule: llguidance for a JSON grammar (json_schema, json_object) it
    compiles, since it compiles only what it enforces exactly, and in well under a
    millisecond; xgrammar for one it refuses (xgrammar approximates it) and for every
    other kind. ``llguidance_refusal``: what llguidance said of ``spec`` (None: it compiled).
    No schema class is sent to xgrammar for closing's sake: fixed-width formats (uuid,
    date, ``{n}`` patterns), which once broke budget-aware closing on llguidance, close
    there since its state key tells the places of a run apart (``LLGuidanceMatcher.state_key``)."""
    if spec.kind in LLGUIDANCE_AUTO_KINDS and llguidance_refusal is None:
        return LLGUIDANCE
    return XGRAMMAR


def compile_auto(engines: dict[str, GrammarEngine], spec: GrammarSpec) -> CompiledGrammar:
    """Compiles ``spec`` on the engine ``auto_engine`` picks; raises xgrammar's
    EngineRefused where neither takes it."""
    refusal = None
    if spec.kind in LLGUIDANCE_AUTO_KINDS:
        try:
            return engines[LLGUIDANCE].compile(spec)
        except EngineRefused as exc:
            refusal = exc
    return engines[auto_engine(spec, refusal)].compile(spec)


def engines_for(tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                compile_threads: int = 1) -> dict[str, GrammarEngine]:
    """Both engines for a Hugging Face tokenizer, by name."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids))
    return {XGRAMMAR: XGrammarEngine(info, compile_threads=compile_threads),
            LLGUIDANCE: LLGuidanceEngine.from_huggingface(tokenizer, vocab_size,
                                                          stop_token_ids)}
