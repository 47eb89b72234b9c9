"""Validating a JSON text against a JSON schema: the engine's post-validation of a
finished JSON output (worker/guided/validation.py) and the edge's of each tool call's
arguments (deploy/responses.py) are this one function, ``validate_json``.

The validator is jsonschema-rs (Rust): it builds a validator for a small schema in tens of
microseconds and validates in a few, supports drafts 4 to 2020-12 (pydantic's ``$defs``)
and never executes generated code. fastjsonschema validates about as fast once built, but
builds by generating and ``exec``-ing Python source (milliseconds per new schema) and stops
at draft 7. Figures: docs/benchmarks.md, "Conformance".

``format`` is checked, not left an annotation (jsonschema-rs's default, as draft 2020-12
says): every format jsonschema-rs knows (``CHECKED_FORMATS``), whatever the schema's
draft, plus draft 3's ``host-name`` and ``ip-address``. A reference outside the schema is
never fetched (``_no_retrieval``). Validators are kept per schema text (an LRU of 256).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import jsonschema_rs

_CACHE_SIZE = 256

# the formats jsonschema-rs checks under draft 2020-12 (under an older draft it ignores
# those the draft did not name yet, e.g. draft 7's uuid and duration: so each is checked
# here by a 2020-12 validator, whatever the schema's draft), and draft 3's names for two
CHECKED_FORMATS = {name: name for name in (
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
    "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
    "uri-template", "json-pointer", "relative-json-pointer", "regex")}
CHECKED_FORMATS.update({"host-name": "hostname", "ip-address": "ipv4"})


def _format_check(name: str):
    return jsonschema_rs.validator_for({"format": name}, validate_formats=True).is_valid


_FORMAT_CHECKS = {name: _format_check(std) for name, std in CHECKED_FORMATS.items()}
_validators: OrderedDict[str, object] = OrderedDict()
_lock = threading.Lock()


def validator(schema_text: str):
    """The jsonschema-rs validator of a schema given as JSON text (kept per text); raises
    what jsonschema-rs raises for a schema it cannot build."""
    with _lock:
        v = _validators.get(schema_text)
        if v is not None:
            _validators.move_to_end(schema_text)
            return v
    v = jsonschema_rs.validator_for(json.loads(schema_text), retriever=_no_retrieval,
                                    validate_formats=True, formats=_FORMAT_CHECKS)
    with _lock:
        _validators[schema_text] = v
        while len(_validators) > _CACHE_SIZE:
            _validators.popitem(last=False)
    return v


def _no_retrieval(uri: str):
    """jsonschema-rs fetches ``http://`` and ``file://`` references by default: a client's
    schema must never make the server reach the network or read a file."""
    raise ValueError(f"the reference {uri} is outside the schema and is not resolved")


def validate_json(schema: dict | bool | str | None, text: str) -> str | None:
    """Checks ``text`` against ``schema`` (a dict, a JSON string, or None for "any JSON
    object"). Returns None when valid, else a message saying what is wrong and where."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: a 5,000-digit integer
        return f"not valid JSON: {exc}"
    if schema is None:
        return None if isinstance(value, dict) else "not a JSON object"
    # a schema jsonschema-rs cannot build or run (wrong-typed keywords, a regex it refuses):
    # say so, never guess and never fail the request's step
    try:
        schema_text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        err = next(iter(validator(schema_text).iter_errors(value)), None)
    except Exception as exc:
        return f"the schema could not be used for validation: {exc}"
    if err is None:
        return None
    path = "/".join(str(p) for p in getattr(err, "instance_path", ()) or ())
    return f"at /{path}: {err.message}" if path else err.message
