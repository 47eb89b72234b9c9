"""JSON schemas as the runtime reads them: one ``$ref`` resolver, one walker, one depth check.

A schema is parsed once, where its ``GrammarSpec`` is built (``GrammarSpec.parsed``);
every later stage (the edge's checks, the rewrites for llguidance, the shortest-output
bound, the keyword reports, the benches) reads that object through this module:

- ``resolve(root, ref)`` / ``Resolver``: a ``$ref`` inside the document (``#``,
  ``#/$defs/Name``): a JSON pointer (RFC 6901) in a URI fragment, so percent-decoded
  first, then ``~1`` -> ``/`` and ``~0`` -> ``~`` per segment. A reference to another
  document (``other.json#/x``, ``https://...``) is a ``RefError``: the runtime never
  fetches one. ``Resolver`` memoizes per document and follows chains of bare references
  (``{"$ref": ...}`` to ``{"$ref": ...}``) with a cycle check.
- ``walk(schema)``: every subschema with its path (a tuple of keys and indices; the
  ``pointer`` of a ``Subschema`` is its JSON pointer) and depth, across every keyword that
  holds subschemas (``SCHEMA_MAPS``, ``SCHEMA_VALUES``, ``SCHEMA_LISTS``, and draft 4's
  ``dependencies`` where a dependency is a schema), iteratively (a
  deep schema cannot exhaust the stack), with an optional depth limit (deeper subschemas
  are not visited) and node cap (``TooManyNodes`` past it). ``lenient=True`` also walks
  the values of keywords it does not know (an extension's schema, a structural tag's
  ``schema`` fields) as schemas; the values of data keywords (``enum``, ``const``,
  ``default``, ``examples``) are never walked.
- ``nested_deeper(value, limit)``: the raw JSON nesting of any value, iteratively: the
  edge's check before anything recursive (the JSON encoder, xgrammar's converter) reads
  it, and GrammarSpec's (which checks every object's ``$ref`` in the same pass).

Standard library only (core is the bottom layer).
"""

from __future__ import annotations

from typing import Any, Iterator
from urllib.parse import unquote

# keywords whose value maps names to subschemas
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose value is one subschema (``items`` and ``additionalItems`` may also be a
# list: draft 4's tuples)
SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "contains",
                 "propertyNames", "unevaluatedProperties", "unevaluatedItems", "not", "if",
                 "then", "else")
# keywords whose value is a list of subschemas
SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
# keywords whose values are data, never schemas
DATA_KEYWORDS = ("enum", "const", "default", "examples")
# keywords that constrain nothing (annotations)
ANNOTATIONS = frozenset(("description", "title", "$comment", "examples", "default",
                         "deprecated", "readOnly", "writeOnly", "markdownDescription",
                         "errorMessage"))


class RefError(ValueError):
    """A ``$ref`` that cannot be resolved inside its document: remote, malformed, missing
    its target, or part of a cycle of bare references."""


def pointer(path) -> str:
    """The JSON pointer of ``path`` (keys and indices): ``("properties", "a/b")`` ->
    ``/properties/a~1b``; ``()`` -> ``""`` (the root)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def is_local(ref) -> bool:
    """Whether ``ref`` points into its own document (``#`` or ``#...``)."""
    return isinstance(ref, str) and ref.startswith("#")


def outside(ref: str) -> str:
    """Why a remote reference is refused, after the keyword that holds it."""
    return (f"{ref[:100]!r} points outside the schema; only local references "
            "('#/$defs/...') are resolved: inline the referenced schema")


def resolve(root, ref: str):
    """The target of ``ref`` in ``root``; RefError saying why where there is none."""
    if not isinstance(ref, str):
        raise RefError(f"$ref must be a string, got {type(ref).__name__}")
    if not is_local(ref):
        raise RefError(f"$ref {outside(ref)}")
    fragment = unquote(ref[1:])
    if fragment == "":
        return root
    if not fragment.startswith("/"):
        raise RefError(f"$ref {ref[:100]!r} is not a JSON pointer ('#/...'); anchors are "
                       "not resolved")
    target = root
    for raw in fragment[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isascii() and part.isdigit() and (
                int(part) < len(target)):
            target = target[int(part)]
        else:
            raise RefError(f"$ref {ref[:100]!r} points to nothing in the schema "
                           f"(no {part[:60]!r})")
    return target


def resolve_or_none(root, ref):
    """``resolve``, None where it fails (for readers that treat an unresolved reference
    as "unknown")."""
    try:
        return resolve(root, ref)
    except RefError:
        return None


_MISSING = object()


class Resolver:
    """The references of one document, each resolved once."""

    def __init__(self, root):
        self.root = root
        self._targets: dict[str, Any] = {}

    def resolve(self, ref: str):
        """``resolve(self.root, ref)``, memoized (a RefError is remembered too)."""
        target = self._targets.get(ref, _MISSING) if isinstance(ref, str) else _MISSING
        if target is _MISSING:
            try:
                target = resolve(self.root, ref)
            except RefError as exc:
                target = exc
            if isinstance(ref, str):
                self._targets[ref] = target
        if isinstance(target, RefError):
            raise target
        return target

    def get(self, ref):
        """``resolve``, None where it fails."""
        try:
            return self.resolve(ref)
        except RefError:
            return None

    def deref(self, node):
        """``node`` with bare references (``{"$ref": ...}`` and nothing else) followed
        until a schema that is not one; RefError on a cycle of them."""
        seen: set[str] = set()
        while isinstance(node, dict) and set(node) == {"$ref"}:
            ref = node["$ref"]
            if ref in seen:
                raise RefError(f"$ref {ref[:100]!r} refers to itself through "
                               f"{len(seen)} bare reference(s)")
            seen.add(ref)
            node = self.resolve(ref)
        return node


class TooManyNodes(ValueError):
    """A walk met more subschemas than its ``max_nodes``."""


class Subschema:
    """One subschema met by ``walk``: what it is (a dict or a bool), how many subschema
    steps down, and where it sits (``path``: keys and indices from the root, built when
    asked for; ``pointer``: the same as a JSON pointer)."""

    __slots__ = ("node", "depth", "_at")

    def __init__(self, node, depth: int, at):
        self.node, self.depth, self._at = node, depth, at  # at: (parent's at, key) or None

    @property
    def path(self) -> tuple:
        keys, at = [], self._at
        while at is not None:
            at, key = at
            keys.append(key)
        return tuple(reversed(keys))

    @property
    def pointer(self) -> str:
        return pointer(self.path)

    def __repr__(self) -> str:
        return f"Subschema({self.pointer!r}, depth={self.depth})"


_MAPS = frozenset((*SCHEMA_MAPS, "dependencies"))
_VALUES = frozenset(SCHEMA_VALUES)
_LISTS = frozenset((*SCHEMA_LISTS, "items", "additionalItems"))
_SCHEMA_KEYS = _MAPS | _VALUES | _LISTS
_DATA = frozenset(DATA_KEYWORDS)


def walk(schema, *, max_depth: int | None = None, max_nodes: int | None = None,
         lenient: bool = False, seen: set[int] | None = None) -> Iterator[Subschema]:
    """Every subschema of ``schema``, itself first, depth-first in document order.

    Subschemas deeper than ``max_depth`` are not visited; past ``max_nodes`` visited the
    walk raises TooManyNodes. References are not followed (``Resolver`` does that).
    ``lenient``: also the dict values (and dicts in list values) of unknown keywords, and
    of known ones whose value has the wrong shape, walked as schemas. ``seen``: ids of
    dicts already visited (by an earlier walk of the same document), neither yielded nor
    walked again; the ones this walk yields are added (to follow references, walk each
    target with the same set: each node is met once however many references reach it)."""
    stack = [(schema, None, 0)]
    push, pop = stack.append, stack.pop
    schema_keys, maps, values, lists, data = _SCHEMA_KEYS, _MAPS, _VALUES, _LISTS, _DATA
    containers, schemas = (dict, list), (dict, bool)
    count = 0
    while stack:
        node, at, depth = pop()
        if isinstance(node, list):  # only where lenient: a list where a schema was
            for i in range(len(node) - 1, -1, -1):
                if isinstance(node[i], containers):
                    push((node[i], (at, i), depth + 1))
            continue
        is_dict = isinstance(node, dict)
        if seen is not None and is_dict:
            if id(node) in seen:
                continue
            seen.add(id(node))
        count += 1
        if max_nodes is not None and count > max_nodes:
            raise TooManyNodes(f"the schema has more than {max_nodes} subschemas")
        yield Subschema(node, depth, at)
        if not is_dict or (max_depth is not None and depth >= max_depth):
            continue
        mark, down = len(stack), depth + 1
        for key, value in node.items():
            if key in schema_keys:
                if isinstance(value, dict):
                    if key in maps:
                        here = (at, key)
                        for name, sub in value.items():
                            if isinstance(sub, schemas) or (
                                    lenient and key != "dependencies" and isinstance(sub, list)):
                                push((sub, (here, name), down))
                        continue
                    if key in values:
                        push((value, (at, key), down))
                        continue
                elif isinstance(value, list):
                    if key in lists:
                        here = (at, key)
                        for i, sub in enumerate(value):
                            if isinstance(sub, schemas) or (lenient and isinstance(sub, list)):
                                push((sub, (here, i), down))
                        continue
                elif value is True or value is False:
                    if key in values:
                        push((value, (at, key), down))
                    continue
                if lenient and isinstance(value, containers):  # a known word, odd shape
                    push((value, (at, key), down))
            elif lenient and isinstance(value, containers) and key not in data:
                push((value, (at, key), down))
        if len(stack) - mark > 1:
            stack[mark:] = stack[mark:][::-1]  # (popped in document order)


def nested_deeper(value, limit: int, each_object=None) -> bool:
    """Whether a JSON value nests deeper than ``limit`` (a scalar is 1 deep, ``[1]`` 2),
    iteratively: a hostile value cannot exhaust the stack here. ``each_object``: called
    with every object (dict) met on the way, data included (a check that must see every
    object, in one pass with the depth check)."""
    if limit < 1:
        return True
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    push = stack.append
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if each_object is not None:
                each_object(node)
            children = node.values()
        else:
            children = node
        if children and depth >= limit:
            return True  # (a child is one deeper)
        depth += 1
        for child in children:
            if isinstance(child, (dict, list)):
                push((child, depth))
    return False
