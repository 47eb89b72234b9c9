"""The batch job's input (deploy/batch_job.py): each JSONL line read into an ``Item``, the
request it becomes or what is wrong with it, and which lines a run does (the plan).

``parse_row`` is the one conversion of a row to a request: the batch job's lines and the
Ray Data processor's rows (deploy/data.py) both go through it. A row may give its
sampling fields and its format at the top level (the batch line's shape) or inside
``sampling_params`` (``ray.data.llm``'s shape: ``{"max_tokens": .., "structured_outputs":
{"json": ..}}``); the two are read as one."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from core.grammar_spec import GrammarSpec, grammar_id
from core.params import SamplingParams
from core.request import GenerationRequest
from deploy import dialects
from deploy.openai_api import MAX_SEED

MAX_TOKENS_KEYS = ("max_tokens", "max_new_tokens", "max_completion_tokens")
# ray.data.llm's row field for the sampling fields (and vLLM's structured_outputs, or its
# older name guided_decoding)
SAMPLING_PARAMS = "sampling_params"
SAMPLING_PARAMS_KEYS = frozenset(SamplingParams.__dataclass_fields__) | {
    *MAX_TOKENS_KEYS, "structured_outputs", "guided_decoding", "response_format"}
JSON_KINDS = ("json_schema", "json_object")
# the job's requests are one client of the grammar cache's compile queue (each HTTP client
# has its own line: deploy/openai_api.client_identity), so a job with many new grammars
# takes its round-robin turn beside the endpoint's users rather than ahead of them
BATCH_CLIENT = "batch"


class LineError(ValueError):
    """What is wrong with one input line (it becomes that line's ``error``)."""


@dataclass
class Item:
    """One input line to run: its id, the request for the runtime (or why there is none),
    whether its output is JSON, its grammar's id (``grammar_id``: what ``POST
    /v1/grammars`` answers for the same spec) and which attempt at the line this is
    (``--retry-failed`` runs it again)."""

    line: int
    id: Any
    request: GenerationRequest | None = None
    error: str | None = None
    is_json: bool = False
    grammar: str | None = None
    attempt: int = 1


def id_key(value: Any) -> str:
    """Ids compare as JSON text: 3 and "3" are different ids."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _valid_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def line_id(obj: Any, line: int) -> Any:
    """The line's id: its ``id`` when that is a string or an integer, else the line number."""
    if isinstance(obj, dict) and _valid_id(obj.get("id")):
        return obj["id"]
    return line


def grammar_of(obj: dict, default: GrammarSpec | None) -> GrammarSpec | None:
    """The line's grammar (deploy/dialects.py reads the batch keys); else the default."""
    try:
        return dialects.from_batch_line(obj, default)
    except ValueError as exc:
        raise LineError(f"invalid {getattr(exc, 'param', None) or 'format'}: {exc}") from None


def prompt_of(obj: dict):
    has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_prompt and has_messages:
        raise LineError("give `prompt` or `messages`, not both")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise LineError("`prompt` must be a non-empty string")
        return obj["prompt"]
    if has_messages:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or any(not isinstance(m, dict) or "role" not in m for m in msgs)):
            raise LineError("`messages` must be a non-empty list of {role, content} objects")
        return msgs
    raise LineError("the line has no `prompt` or `messages`")


def params_of(obj: dict, defaults: dict) -> SamplingParams:
    known = {f for f in SamplingParams.__dataclass_fields__}
    params = dict(defaults)
    given = [k for k in MAX_TOKENS_KEYS if obj.get(k) is not None]
    if len(given) > 1:
        raise LineError(f"give one of {', '.join(given)}")
    if given:
        params["max_new_tokens"] = obj[given[0]]
    for name in known - {"max_new_tokens"}:
        if obj.get(name) is not None:
            params[name] = obj[name]
    seed = params.get("seed")
    if isinstance(seed, int) and not 0 <= seed <= MAX_SEED:
        raise LineError(f"seed must be in [0, {MAX_SEED}] (2^63 - 1), got {seed}")
    try:
        return SamplingParams.from_dict(params)  # a bad value fails its line at once
    except (ValueError, TypeError) as exc:
        raise LineError(str(exc)) from None


def flat_row(obj: dict) -> dict:
    """The row with its ``sampling_params`` (ray.data.llm's shape) read as its own keys.
    A key given both there and at the top level, or one there that is no sampling field
    (vLLM's ``n``, ``logprobs`` as a bool, ...), is a LineError naming it; keys whose
    value is null count as absent (Arrow gives every row the keys any row has)."""
    sp = obj.get(SAMPLING_PARAMS)
    if sp is None:
        return obj
    if not isinstance(sp, dict):
        raise LineError(f"`{SAMPLING_PARAMS}` must be an object")
    given = {k: v for k, v in sp.items() if v is not None}
    unknown = sorted(set(given) - SAMPLING_PARAMS_KEYS)
    if unknown:
        raise LineError(f"`{SAMPLING_PARAMS}` has fields rayguide does not take: "
                        f"{', '.join(unknown)}; it takes {', '.join(sorted(SAMPLING_PARAMS_KEYS))}")
    if "guided_decoding" in given:
        if "structured_outputs" in given:
            raise LineError("give `structured_outputs` or `guided_decoding`, not both")
        given["structured_outputs"] = given.pop("guided_decoding")
    twice = sorted(k for k in given if obj.get(k) is not None)
    if twice:
        raise LineError(f"{', '.join(twice)}: given in the row and in `{SAMPLING_PARAMS}`; "
                        "give each once")
    return {**{k: v for k, v in obj.items() if k != SAMPLING_PARAMS}, **given}


def parse_line(text: str | None, line: int, *, defaults: dict,
               default_grammar: GrammarSpec | None, run_tag: str) -> Item:
    """The Item for one input line (text None: not UTF-8); its ``error`` says what is
    wrong, if anything."""
    if text is None:
        return Item(line, line, error=f"line {line} is not valid UTF-8")
    try:
        obj = json.loads(text)
    except ValueError as exc:  # not JSON, or an integer of 4,300+ digits
        return Item(line, line, error=f"line {line} is not valid JSON: {exc}")
    except RecursionError:
        return Item(line, line, error=f"line {line} is nested too deeply to read")
    if not isinstance(obj, dict):
        return Item(line, line, error=f"line {line} is not a JSON object")
    return parse_row(obj, line, defaults=defaults, default_grammar=default_grammar,
                     request_id=f"batch-{run_tag}-{line}")


def parse_row(obj: dict, line: int, *, defaults: dict, default_grammar: GrammarSpec | None,
              request_id: str) -> Item:
    """The Item for one row (a parsed batch line, a Ray Data row): its request, or in
    ``error`` what is wrong with the row. Never raises for the row's content."""
    item = Item(line, line_id(obj, line))
    try:
        if obj.get("id") is not None and not _valid_id(obj["id"]):
            raise LineError("`id` must be a string or an integer")
        obj = flat_row(obj)
        grammar = grammar_of(obj, default_grammar)
        item.request = GenerationRequest(prompt_of(obj), params_of(obj, defaults),
                                         request_id=request_id, grammar=grammar,
                                         client=BATCH_CLIENT)
        item.is_json = grammar is not None and grammar.kind in JSON_KINDS
        item.grammar = grammar_id(grammar) if grammar is not None else None
    except LineError as exc:
        item.error = str(exc)
    return item


def load_schema(value: str) -> GrammarSpec:
    """--schema: a file with a JSON schema (or the schema inline)."""
    if os.path.exists(value):
        with open(value) as f:
            text = f.read()
    elif value.lstrip().startswith(("{", "[")):
        text = value
    else:
        raise ValueError(f"--schema {value}: no such file")
    try:
        return dialects.json_schema(text, "--schema")
    except ValueError as exc:
        raise ValueError(f"--schema {value}: {exc}") from None


@dataclass
class WorkPlan:
    todo: list[int] = field(default_factory=list)  # line numbers to run, in order
    skipped: int = 0
    lines: int = 0  # the input's lines (blank ones not counted): one output row each
    # line -> how --retry-failed runs it again: overrides (max_tokens, engine) and attempt
    retries: dict[int, dict] = field(default_factory=dict)


def plan(input_path: str, skip: set[str], retries: dict[str, dict] | None = None) -> WorkPlan:
    """First pass over the input: which lines to run (ids not yet in the output).
    ``retries``: by id key, how a line that --retry-failed runs again is changed.

    Raises ValueError naming every id that is on more than one line, with the lines:
    rows are kept, skipped and replaced by id, so two lines of one id would take each
    other's row (a resume lost one of them for good)."""
    p, lines_of = WorkPlan(), {}
    retries = retries or {}
    for line, text in input_lines(input_path):
        if text is not None and not text.strip():
            continue
        p.lines += 1
        try:
            key = id_key(line_id(json.loads(text), line))
        except (TypeError, ValueError, RecursionError):
            # not UTF-8, not JSON, an integer of 4,300+ digits, nesting past the recursion
            # limit: the line's id is its number, and parse_line makes it its error
            key = id_key(line)
        lines_of.setdefault(key, []).append(line)
        if len(lines_of[key]) > 1:
            continue
        if key in skip:
            p.skipped += 1
            continue
        if key in retries:
            p.retries[line] = retries[key]
        p.todo.append(line)
    duplicates = [(key, lines) for key, lines in lines_of.items() if len(lines) > 1]
    if duplicates:
        listed = "; ".join(f"id {key} on lines {', '.join(map(str, lines))}"
                           for key, lines in duplicates[:10])
        more = f"; and {len(duplicates) - 10} more" if len(duplicates) > 10 else ""
        raise ValueError(f"--input {input_path}: {len(duplicates)} ids are on more than one "
                         f"line ({listed}{more}); give each line its own id (or none: "
                         "the line number is its id)")
    return p


def input_lines(path: str):
    """(line number, text) per line; text is None for a line that is not valid UTF-8."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                yield line, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield line, None


def items(input_path: str, p: WorkPlan, **parse_kwargs):
    """Second pass: the Items of the planned lines, in order."""
    wanted = iter(p.todo)
    next_line = next(wanted, None)
    for line, text in input_lines(input_path):
        if next_line is None:
            return
        if line != next_line:
            continue
        item = parse_line(text, line, **parse_kwargs)
        if line in p.retries:
            retried(item, p.retries[line])
        yield item
        next_line = next(wanted, None)


def retried(item: Item, retry: dict) -> None:
    """Applies a --retry-failed override to the line's request: a larger ``max_tokens``,
    another grammar ``engine``; ``attempt`` counts the runs of the line."""
    item.attempt = retry.get("attempt", 2)
    if item.request is None:
        return
    params, grammar = item.request.params, item.request.grammar
    if retry.get("max_tokens"):
        params = dataclasses.replace(params, max_new_tokens=retry["max_tokens"])
    if retry.get("engine") and grammar is not None:
        grammar = dataclasses.replace(grammar, engine=retry["engine"])
    item.request = dataclasses.replace(item.request, params=params, grammar=grammar,
                                       request_id=f"{item.request.request_id}-a{item.attempt}")
