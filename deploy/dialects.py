"""Every way a client asks for structure, turned into one ``GrammarSpec``, at the edge.

Dialects: OpenAI ``response_format`` (json_schema with ``strict``, json_object, text),
LMDeploy's ``{"type": "regex_schema", ...}``, vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and ``structured_outputs``, ``tools`` +
``tool_choice`` (an xgrammar structural tag, see deploy/tools.py), the CLI's flags and the
batch job's per-line keys. Below deploy/ only ``GrammarSpec`` exists.

Errors are ``GrammarError`` (its ``kind`` says invalid or too large), raised with the name
of the field the client should change in ``param``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from core.errors import ErrorKind, GrammarError
from core.grammar_spec import GrammarSpec
from core.json_schema import nested_deeper

# A schema nested deeper than this is refused before anything walks it recursively (the
# JSON encoder, xgrammar's converter): real schemas stay far below it.
MAX_SCHEMA_DEPTH = 64

VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# a batch line's (and a Ray Data row's: deploy/data.py) format keys; structured_outputs is
# vLLM's, as ray.data.llm rows give it inside sampling_params
BATCH_KEYS = ("schema", "response_format", "regex", "choice", "structured_outputs")


class DialectError(GrammarError):
    """A grammar field the server refuses; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None,
                 kind: ErrorKind = ErrorKind.INVALID_GRAMMAR):
        super().__init__(message, kind)
        self.param = param

    def __reduce__(self):
        return (type(self), (str(self), self.param, self.kind))


def _wrap(param: str, make, *args, **kwargs) -> GrammarSpec:
    """Builds a spec; any refusal becomes a DialectError naming ``param``."""
    try:
        return make(*args, **kwargs)
    except DialectError:
        raise
    except GrammarError as exc:
        raise DialectError(str(exc), param, exc.kind) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise DialectError(f"invalid grammar in {param}: {exc}", param) from None


def check_depth(value: Any, param: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Refuses a schema nested deeper than ``limit``, before anything walks it
    recursively (the JSON encoder, xgrammar's converter)."""
    if nested_deeper(value, limit):
        raise DialectError(f"{param} is nested deeper than {limit} levels; flatten it",
                           param, ErrorKind.GRAMMAR_TOO_LARGE)


def json_schema(schema: Any, param: str = "json_schema", **options) -> GrammarSpec:
    """A JSON schema given as an object, a JSON string, or OpenAI's
    ``{"name", "schema", "strict"}`` wrapper."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:  # also a 4,300+ digit integer
            raise DialectError(f"invalid grammar in {param} (json_schema): not valid JSON: {exc}",
                               param) from None
    check_depth(schema, param)
    if isinstance(schema, dict) and "schema" in schema and ("name" in schema
                                                            or "strict" in schema):
        if schema.get("strict") is not None:
            options.setdefault("strict", bool(schema["strict"]))
        schema = schema["schema"]
    return _wrap(param, GrammarSpec.json_schema, schema, **options)


def from_response_format(rf: Any) -> GrammarSpec | None:
    """OpenAI ``response_format`` and LMDeploy's regex_schema; None for text."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or "type" not in rf:
        raise DialectError("response_format must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise DialectError("response_format json_schema needs "
                               "{'json_schema': {'name': ..., 'schema': {...}}}",
                               "response_format.json_schema")
        return json_schema(body, "response_format.json_schema")
    if kind == "regex_schema":
        pattern = rf.get("regex_schema")
        if not isinstance(pattern, str):
            raise DialectError("response_format regex_schema needs a string "
                               "'regex_schema'", "response_format.regex_schema")
        return _wrap("response_format.regex_schema", GrammarSpec.regex, pattern)
    raise DialectError(f"response_format type {kind!r} is not supported; use text, "
                       "json_object, json_schema or regex_schema", "response_format.type")


def structured_outputs(so: Any) -> GrammarSpec:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    structural_tag, json_object (``json: true`` and ``json_object: true`` are any JSON
    object; ``json_object: false`` is as if absent)."""
    makers = {"json": json_schema, "regex": GrammarSpec.regex, "choice": GrammarSpec.choice,
              "grammar": GrammarSpec.ebnf, "structural_tag": GrammarSpec.structural_tag,
              "json_object": lambda _: GrammarSpec.json_object()}
    if not isinstance(so, dict):
        raise DialectError("structured_outputs must be an object", "structured_outputs")
    given = [k for k in so if so[k] is not None and k != "backend"
             and not (k == "json_object" and so[k] is False)]
    if len(given) != 1 or given[0] not in makers:
        raise DialectError(f"structured_outputs needs exactly one of {sorted(makers)}; "
                           f"got {sorted(given)}", "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json":
        if so["json"] is True:
            return GrammarSpec.json_object()
        return json_schema(so["json"], param)
    if key == "structural_tag":
        check_depth(so[key], param)
    return _wrap(param, makers[key], so[key])


def vllm_field(name: str, value: Any) -> GrammarSpec:
    """One of vLLM's ``guided_*`` request fields."""
    if name == "guided_json":
        return json_schema(value, name)
    makers = {"guided_regex": GrammarSpec.regex, "guided_choice": GrammarSpec.choice,
              "guided_grammar": GrammarSpec.ebnf}
    return _wrap(name, makers[name], value)


# the grammar engine a request may ask for, by name; "guidance" is vLLM's name of llguidance
ENGINE_NAMES = {"auto": "auto", "xgrammar": "xgrammar", "llguidance": "llguidance",
                "guidance": "llguidance"}


def engine_from(fields: dict[str, Any]) -> str | None:
    """The grammar engine a request forces (``guided_decoding_backend``, or vLLM's newer
    ``structured_outputs.backend``), None when it names none. An unknown name, or two
    fields naming different engines, is a DialectError naming the field."""
    asked = []
    so = fields.get("structured_outputs")
    for param, value in (("guided_decoding_backend", fields.get("guided_decoding_backend")),
                         ("structured_outputs.backend",
                          so.get("backend") if isinstance(so, dict) else None)):
        if value is None:
            continue
        if not isinstance(value, str) or value not in ENGINE_NAMES:
            raise DialectError(f"{param} {value!r} is not a grammar engine; use one of "
                               f"{', '.join(ENGINE_NAMES)}", param, ErrorKind.BAD_REQUEST)
        asked.append((param, ENGINE_NAMES[value]))
    if len({engine for _, engine in asked}) > 1:
        raise DialectError("guided_decoding_backend and structured_outputs.backend name "
                           "different engines; send one", "structured_outputs.backend",
                           ErrorKind.BAD_REQUEST)
    return asked[0][1] if asked else None


def with_engine(spec: GrammarSpec, engine: str | None) -> GrammarSpec:
    """``spec`` asking for ``engine`` (None: as it is)."""
    if engine is None or spec.engine == engine:
        return spec
    return dataclasses.replace(spec, engine=engine)


def from_openai(fields: dict[str, Any]) -> GrammarSpec | None:
    """The one grammar an OpenAI-style request asks for, from whichever dialect it used
    (``fields``: response_format, guided_*, structured_outputs as given, None if absent).
    Two dialects in one request are an error."""
    asked = []
    rf = fields.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        asked.append("response_format")
    asked += [n for n in (*VLLM_FIELDS, "structured_outputs") if fields.get(n) is not None]
    if len(asked) > 1:
        raise DialectError(f"only one of {', '.join(asked)} may be set", asked[1])
    if not asked:
        return from_response_format(rf)  # checks the shape of a text format
    name = asked[0]
    if name == "response_format":
        return from_response_format(rf)
    if name == "structured_outputs":
        return structured_outputs(fields[name])
    return vllm_field(name, fields[name])


def from_batch_line(obj: dict, default: GrammarSpec | None) -> GrammarSpec | None:
    """The batch job's per-line format (also a Ray Data row's): one of ``schema``,
    ``response_format``, ``regex``, ``choice``, ``structured_outputs`` (with its
    ``backend``); else the job's default."""
    given = [k for k in BATCH_KEYS if obj.get(k) is not None]
    if len(given) > 1:
        raise DialectError(f"give at most one format, got {', '.join(given)}", given[1])
    if not given:
        return default
    key = given[0]
    value = obj[key]
    if key == "schema":
        return json_schema(value, "schema")
    if key == "response_format":
        return from_response_format(value)
    if key == "structured_outputs":
        return with_engine(structured_outputs(value), engine_from({key: value}))
    if key == "regex":
        if not isinstance(value, str):
            raise DialectError("regex must be a string", "regex")
        return _wrap("regex", GrammarSpec.regex, value)
    return _wrap("choice", GrammarSpec.choice, value)


def from_cli_args(args) -> GrammarSpec | None:
    """The grammar the CLI's guided flags ask for (``--json-schema`` text or file,
    ``--json-object``, ``--regex``, ``--choice``, ``--grammar`` / ``--lark`` files)."""
    given = [name for name in ("json_schema", "json_object", "regex", "choice", "grammar",
                               "lark") if getattr(args, name, None)]
    if len(given) > 1:
        raise DialectError(f"use one guided flag at a time, got {', '.join(given)}")
    if args.json_schema:
        text = args.json_schema
        if not text.lstrip().startswith(("{", "[")) and Path(text).is_file():
            text = Path(text).read_text()
        return json_schema(text, "--json-schema")
    if args.json_object:
        return GrammarSpec.json_object()
    if args.regex:
        return _wrap("--regex", GrammarSpec.regex, args.regex)
    if args.choice:
        return _wrap("--choice", GrammarSpec.choice, args.choice)
    if args.grammar:
        return _wrap("--grammar", GrammarSpec.ebnf, Path(args.grammar).read_text())
    if args.lark:
        return _wrap("--lark", GrammarSpec.lark, Path(args.lark).read_text())
    return None
