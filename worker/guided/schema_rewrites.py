"""Exact rewrites of JSON schemas, for llguidance: each one changes how a schema is written,
never which instances it allows, so that llguidance enforces a schema it would otherwise
refuse (``exact_rewrites``). (What a spec's options add to a schema, strict mode and the
runaway guards, is schema_options.py.)

llguidance refuses what it cannot enforce exactly (``not``, ``oneOf``, ``if`` / ``then``
/ ``else``, ``uniqueItems``, ``contains``, ``dependencies``, unknown formats); ``auto``
(worker/guided/backend.py) then sends the schema to xgrammar, which approximates. A rewrite here
is made only where the rewritten schema is provably the same set of instances; anything
else is left as written.

Every rewrite is bounded (``RewriteBudget``, schema_budget.py): past its steps or CPU time
it stops with ``SchemaTooComplex``, and ``auto`` serves the schema on xgrammar.

One module of about 530 lines: the three rewrites (enum-bounded nodes, ``not``, ``oneOf``)
share one reading of a schema (``_Facts``, ``_keywords``, ``_any_of``, ``_negated``) and
call one another (a negated ``not`` is rewritten again; a ``oneOf`` is disjoint by the same
facts a negation reads); split, each part would import the others' privates.
"""

from __future__ import annotations

import json

from core.json_schema import (ANNOTATIONS, SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES,
                              resolve_or_none, walk)
from worker.guided.schema_budget import RewriteBudget, SchemaTooComplex, spend, under_budget

__all__ = ["RewriteBudget", "SchemaTooComplex", "exact_rewrites"]

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
    return under_budget(budget, _exact_rewrites, node, root)


def _exact_rewrites(node, root=None):
    if root is None:
        root = node
    spend()
    if isinstance(node, list):
        return [_exact_rewrites(sub, root) for sub in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _exact_rewrites(sub, root) for name, sub in value.items()}
        elif key in SCHEMA_VALUES and isinstance(value, (dict, list)) or (
                key in SCHEMA_LISTS and isinstance(value, list)):
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
_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
# keywords whose meaning depends on what sits around a node (annotations of its neighbours,
# a changed base for references)
_CONTEXTUAL = ("unevaluatedProperties", "unevaluatedItems", "$id", "$anchor", "$dynamicRef",
               "$recursiveRef")
_MAX_ENUM_FILTERED = 256  # values checked one by one at most
_MAX_REF_DEPTH = 16


def _walk(node, root):
    """Every dict reachable from ``node``, local ``$ref`` s followed; None where a
    ``$ref`` is not local (so cannot be checked)."""
    seen: set[int] = set()
    todo, out = [node], []
    while todo:
        for sub in walk(todo.pop(), lenient=True, seen=seen):
            if not isinstance(sub.node, dict):
                continue
            spend()
            out.append(sub.node)
            if "$ref" in sub.node:
                target = resolve_or_none(root, sub.node["$ref"])
                if target is None:
                    return None
                todo.append(target)
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
    from worker.guided.validation import _validator

    text = json.dumps(schema, sort_keys=True)
    spend(len(text) // 64 + len(values))
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
    return {k: v for k, v in node.items() if k not in ANNOTATIONS}


def _negated(schema, root, depth: int):
    """A schema without ``not`` that allows exactly the instances ``schema`` rejects
    (True: all of them; False: none), or None where that cannot be written exactly."""
    if schema is True:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
        return None
    spend(4)  # (per call: the calls build the negation, so this bounds its size too)
    words = _keywords(schema)
    if not words:
        return False
    if "$ref" in words:  # (alone only: drafts differ on what its siblings mean)
        target = resolve_or_none(root, words["$ref"])
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
        spend()
        if "$ref" in schema:  # the target applies (with or without its siblings, per draft)
            target = resolve_or_none(root, schema["$ref"])
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
    spend()
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


