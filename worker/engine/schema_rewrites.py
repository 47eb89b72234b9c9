"""Exact rewrites of JSON schemas, for llguidance: each one changes how a schema is written,
never which instances it allows, so that llguidance enforces a schema it would otherwise
refuse (``exact_rewrites``), and strict mode's closing of open objects and tuples, as
xgrammar's strict mode does (``strict_schema``).

llguidance refuses what it cannot enforce exactly (``not``, ``oneOf``, ``if`` / ``then``
/ ``else``, ``uniqueItems``, ``contains``, ``dependencies``, unknown formats); ``auto``
(worker/guided/backend.py) then sends the schema to xgrammar, which approximates. A rewrite here
is made only where the rewritten schema is provably the same set of instances; anything
else is left as written.

Every rewrite is bounded (``RewriteBudget``): it runs in the worker beside the engine
thread, in Python, so a hostile schema (``allOf`` s that reference each other, a ``not``
over a chain of definitions, hundreds of enum nodes sharing one large definition) must
not hold the interpreter for seconds nor produce megabytes. Each step (a node visited, a
reference followed, a negation built, a value checked) costs a unit; past ``MAX_WORK``
units or ``MAX_SECONDS`` of the thread's CPU time the rewrite stops with
``SchemaTooComplex`` (the caller then refuses the schema for llguidance, and ``auto``
serves it on xgrammar).
"""

from __future__ import annotations

import contextvars
import json
import time

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


# the bound on one rewrite: ~0.05 s of Python (a 210 kB schema of 4,000 plain nodes takes
# 4,200 units; a negation 4 a node, so its output stays under ~0.5 MB)
MAX_WORK = 25_000
MAX_SECONDS = 0.25


class SchemaTooComplex(ValueError):
    """A rewrite needed more than its budget (``MAX_WORK`` steps or ``MAX_SECONDS``)."""


class RewriteBudget:
    """The steps one rewrite may take; ``spend`` raises SchemaTooComplex past them."""

    def __init__(self, units: int = MAX_WORK, seconds: float = MAX_SECONDS):
        self.units, self.left = units, units
        self.seconds = seconds
        # the rewriting thread's CPU time: what it holds the GIL for beside the engine
        # thread (wall time would refuse ordinary schemas on a busy machine)
        self.deadline = time.thread_time() + seconds

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise SchemaTooComplex(
                f"the schema needs more than {self.units} steps to be rewritten for "
                "llguidance (references that multiply: allOf / not / oneOf over shared "
                "definitions)")
        if self.left % 512 < n and time.thread_time() > self.deadline:
            raise SchemaTooComplex(f"rewriting the schema for llguidance took over "
                                   f"{self.seconds:g} s")


_BUDGET: contextvars.ContextVar[RewriteBudget | None] = contextvars.ContextVar(
    "rewrite_budget", default=None)


def _spend(n: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend(n)


def exact_rewrites(node, root=None, budget: RewriteBudget | None = None):
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
    sends the schema to xgrammar).

    The whole rewrite runs under ``budget`` (a fresh ``RewriteBudget`` by default, or the
    one already running) and raises SchemaTooComplex past it."""
    return _under_budget(budget, _exact_rewrites, node, root)


def _under_budget(budget: RewriteBudget | None, fn, *args):
    """``fn(*args)`` under ``budget``; under the running budget where there is one and
    ``budget`` is None, else under a fresh one."""
    if _BUDGET.get() is not None and budget is None:
        return fn(*args)
    token = _BUDGET.set(budget or RewriteBudget())
    try:
        return fn(*args)
    finally:
        _BUDGET.reset(token)


def _exact_rewrites(node, root=None):
    if root is None:
        root = node
    _spend()
    if isinstance(node, list):
        return [_exact_rewrites(sub, root) for sub in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _exact_rewrites(sub, root) for name, sub in value.items()}
        elif key in _SCHEMA_VALUES and isinstance(value, (dict, list)) or (
                key in _SCHEMA_LISTS and isinstance(value, list)):
            value = _exact_rewrites(value, root)
        elif key == "dependencies" and isinstance(value, dict):
            value = {name: _exact_rewrites(sub, root) for name, sub in value.items()}
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
            _spend()
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
    members = node.get("allOf") if isinstance(node.get("allOf"), list) else ()
    for sub in (node, *(m for m in members if isinstance(m, dict))):
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

    text = json.dumps(schema, sort_keys=True)
    _spend(len(text) // 64 + len(values))
    try:
        validator = _validator(text)
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
    _spend(4)  # (per call: the calls build the negation, so this bounds its size too)
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
            part = _exact_rewrites(value, root) if isinstance(value, dict) else value
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
        self._seen: set[int] = set()  # schemas read: a second read adds no fact
        self._read(schema, root, depth)
        if beside is not None:  # a schema that applies with it (the node around a oneOf)
            self._read(beside, root, depth)

    def _read(self, schema, root, depth):
        if schema is True:
            return
        if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
            self.known = False
            return
        # the facts are a conjunction: reading a schema again (one that allOf members or
        # references reach more than once) adds nothing, and skipping it keeps the reading
        # linear in the schema where it was exponential in the depth of references
        if id(schema) in self._seen:
            return
        self._seen.add(id(schema))
        _spend()
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
    _spend()
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
    required = node.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    for key in ("dependencies", "dependentRequired"):
        if isinstance(node.get(key), dict):
            for name, dep in node[key].items():
                names += [name, *(n if isinstance(n, str) else None for n in dep)] if (
                    isinstance(dep, list)) else [None]
    return names


# --- runaway guards ---------------------------------------------------------------------------

# subschemas that apply to the value itself or to values inside it, where narrowing the
# subschema narrows the whole (not under ``not`` / ``if``, where it would widen it)
_GUARDED_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                 "dependentSchemas")
_GUARDED_VALUES = ("items", "prefixItems", "additionalProperties", "additionalItems",
                   "unevaluatedProperties", "unevaluatedItems", "then", "else")
# llguidance writes a number with a decimal multipleOf as at most this many fraction digits
# (``multipleOf: 1e-10``; a smaller step is "too many digits" for it), and an integer range
# as 64-bit integers
MAX_LLGUIDANCE_FRAC_DIGITS = 10
MAX_LLGUIDANCE_INT_DIGITS = 18


def number_guards(node, int_digits: int, frac_digits: int,
                  budget: RewriteBudget | None = None):
    """``node`` with xgrammar's runaway guards written into its ``number`` / ``integer``
    nodes as keywords llguidance turns into bounded digit runs (it has no digit bounds of
    its own), where the node sets no bound of its own:

    - an integer gets ``minimum`` / ``maximum`` of ``±(10**int_digits - 1)``: at most
      ``int_digits`` digits, exactly;
    - a number gets ``exclusiveMinimum`` / ``exclusiveMaximum`` of ``±10**int_digits``
      (at most ``int_digits`` integer digits) and ``multipleOf: 10**-frac_digits`` (at most
      ``frac_digits`` fraction digits).

    A side the schema bounds (``minimum`` / ``maximum``, either exclusive form) is left as
    written, and a guard never cuts off the values the schema demands: opposite a bound
    beyond it, the guard widens to that bound's digit count (``minimum: 1e16`` with 15
    integer digits gets ``exclusiveMaximum: 1e17``). A node with its own ``multipleOf``
    keeps it (it fixes the fraction digits itself). An integer bound past 64 bits is a
    ValueError (llguidance would clamp it). llguidance writes a bounded number
    without an exponent, so under the guards no exponent is written at all (xgrammar
    allows ``max_exp_digits`` of them).

    Values of any type get the guards too (``_guard_untyped``): a node without ``type``
    (``{}``, ``true``, one with only annotations or string / object keywords) gets the
    number's bounds (JSON Schema applies them to numbers only), and an object or array
    node that leaves its other properties / items open gets them as a guarded any-value
    (a definition ``#/$defs/<_ANY_VALUE>`` added to the root).

    Guards narrow what the grammar allows; the post-validation still checks the schema as
    the client wrote it. 0 turns a guard off. Runs under ``budget`` as ``exact_rewrites``
    does."""
    if not int_digits and not frac_digits:
        return node
    return _under_budget(budget, _guarded_root, node, int_digits, frac_digits)


def any_value_guarded(int_digits: int, frac_digits: int) -> dict:
    """A schema for any JSON value whose numbers (at any depth) carry the guards
    (``number_guards``): what a JSON object's values are under ``json_object``."""
    ref = {"$ref": f"#/$defs/{_ANY_VALUE}"}
    return {"$defs": {_ANY_VALUE: _any_value(ref, int_digits, frac_digits)}, "type": "object",
            "additionalProperties": ref}


_ANY_VALUE = "rayguide_any_value"
# keywords whose meaning depends on which properties / items a node's own keywords
# evaluate, or on a base other than the root: an added ``items`` / ``additionalProperties``
# or a ``$ref`` to the root's definitions could change it (only the numbers' own bounds
# are added where the schema has any of them)
_CONTEXT_WORDS = ('"unevaluatedProperties"', '"unevaluatedItems"', '"$id"', '"id"',
                  '"$anchor"', '"$dynamicRef"', '"$dynamicAnchor"', '"$recursiveRef"',
                  '"$recursiveAnchor"')
# subschemas that apply to the same value as the node around them: llguidance intersects
# them with it (an added any-value there would narrow the properties the node declares,
# and intersecting recursive definitions exceeds its stack): they get the number's own
# bounds only (the branches of an anyOf / oneOf that stands alone are not intersected)
_MERGED = frozenset(("allOf", "anyOf", "oneOf", "then", "else", "dependentSchemas"))
# keywords beside which a node's values are also constrained elsewhere (its branches, a
# reference's target: guarded there)
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "enum", "const", "not", "if")


def _any_value(ref: dict, int_digits: int, frac_digits: int) -> dict:
    number = _guarded({"type": "number"}, int_digits, frac_digits, None)
    return {"anyOf": [{"type": ["null", "boolean", "string"]}, number,
                      {"type": "array", "items": ref},
                      {"type": "object", "additionalProperties": ref}]}


def _guarded_root(node, int_digits: int, frac_digits: int):
    any_ref = None
    if isinstance(node, dict) and not any(w in json.dumps(node) for w in _CONTEXT_WORDS):
        defs = node.get("$defs")
        if defs is None or isinstance(defs, dict) and _ANY_VALUE not in defs:
            any_ref = {"$ref": f"#/$defs/{_ANY_VALUE}"}
    out = _guarded(node, int_digits, frac_digits, any_ref)
    if any_ref is not None and _ANY_VALUE in json.dumps(out):
        out = {**out, "$defs": {**out.get("$defs", {}),
                                _ANY_VALUE: _any_value(any_ref, int_digits, frac_digits)}}
    return out


def _guarded(node, int_digits: int, frac_digits: int, any_ref: dict | None):
    if isinstance(node, list):
        return [_guarded(sub, int_digits, frac_digits, any_ref) for sub in node]
    if node is True and any_ref is not None:
        return dict(any_ref)
    if not isinstance(node, dict):
        return node
    _spend()
    out = dict(node)
    for key in _GUARDED_MAPS:
        if isinstance(node.get(key), dict):
            ref = None if key in _MERGED else any_ref
            out[key] = {name: _guarded(sub, int_digits, frac_digits, ref)
                        for name, sub in node[key].items()}
    for key in (*_GUARDED_VALUES, *_SCHEMA_LISTS):
        if isinstance(node.get(key), (dict, list)) or node.get(key) is True:
            alone = key in ("anyOf", "oneOf") and set(node) - _ANNOTATIONS == {key}
            ref = None if key in _MERGED and not alone else any_ref
            out[key] = _guarded(node[key], int_digits, frac_digits, ref)
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(
        types, list) else set()
    if "number" in types:
        _bound_range(out, int_digits, exclusive=True)
        if frac_digits and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{frac_digits}")
    elif "integer" in types:
        _bound_range(out, int_digits, exclusive=False)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = _number(out.get(key))
            if value is not None and abs(value) >= 2 ** 63:
                # llguidance clamps such a bound to 64 bits and then allows values the
                # schema forbids (minimum 1e20 took 9223372036854775807): refused instead
                raise ValueError(f"the integer bound {key}: {out[key]} is past "
                                 "llguidance's 64-bit integer ranges")
    if not any(k in node for k in _COMBINED):
        out = _guard_untyped(out, types, int_digits, frac_digits, any_ref)
    return out


def _guard_untyped(out: dict, types: set, int_digits: int, frac_digits: int,
                   any_ref: dict | None) -> dict:
    """``out`` (a node with no combinator beside it) with the guards on the values it
    leaves untyped: its own value when it has no ``type``, the other properties of an
    object and the further items of an array it leaves open (see number_guards)."""
    if not types and any_ref is not None and not set(out) - _ANNOTATIONS:
        return {**out, **any_ref}  # any value at all: the guarded one
    if not types:
        _bound_range(out, int_digits, exclusive=True)
        if frac_digits and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{frac_digits}")
    if any_ref is None:
        return out
    if (not types or "object" in types) and out.get("additionalProperties", True) is True:
        out["additionalProperties"] = dict(any_ref)
    if not types or "array" in types:
        if isinstance(out.get("items"), list):
            if out.get("additionalItems", True) is True:
                out["additionalItems"] = dict(any_ref)
        elif out.get("items", True) is True:
            out["items"] = dict(any_ref)
    return out


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(
        value, bool) else None


def _bound_range(out: dict, digits: int, exclusive: bool) -> None:
    """Adds the integer-digit guard to the sides of ``out`` that have no bound."""
    if not digits:
        return
    low = [v for v in (_number(out.get("minimum")), _number(out.get("exclusiveMinimum")))
           if v is not None]
    high = [v for v in (_number(out.get("maximum")), _number(out.get("exclusiveMaximum")))
            if v is not None]
    if not high:  # (digits of the far bound on the other side: the guard must not cut it)
        width = max([digits] + [_int_digits(v) for v in low if v > 0])
        if exclusive:
            out["exclusiveMaximum"] = 10 ** width
        else:
            out["maximum"] = 10 ** width - 1
    if not low:
        width = max([digits] + [_int_digits(v) for v in high if v < 0])
        if exclusive:
            out["exclusiveMinimum"] = -10 ** width
        else:
            out["minimum"] = -(10 ** width - 1)


def _int_digits(value: float) -> int:
    """The digits of ``value`` 's integer part (at least 1)."""
    return len(str(int(abs(value)))) if abs(value) < 1e300 else 301
