"""OpenAI's Responses API (``POST /v1/responses``) as a translation into the chat route's
plan. No Ray and no HTTP here; deploy/serve_app.py does the I/O, deploy/responses_events.py
shapes what goes back, core/response_store.py keeps conversations.

A Responses request is rewritten as the chat request it means (``input`` items and the
stored conversation as messages, ``instructions`` as the system message, ``text.format``
as ``response_format``, flat function tools as chat tools, ``max_output_tokens`` as
``max_completion_tokens``) and planned by ``openai_api.plan_chat``: grammars, tool calls,
limits and sampling have one implementation, the chat route's. An error the planner
raises names the Responses field (``RENAMED``), not the chat field it was translated into.

    turn = plan_response(parse_request(ResponsesRequest, body), history, limits)
    turn.plan      # the chat Plan that runs (one GenerationRequest)
    turn.echo      # the request's fields as the Response object repeats them
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from core.grammar_spec import GrammarSpec
from deploy import openai_api as api
from deploy.errors import APIError, bad_request
from deploy.settings import Limits

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")

# OpenAI fields this server knows and does not do: a request that sets one (to anything but
# its "off" value) is a 400 that names it and says what to do instead
UNSUPPORTED = {
    "background": (False, "background responses are not supported; send the request and "
                          "wait, or stream it"),
    "reasoning": (None, "reasoning settings are not supported; a reasoning model served "
                        "here thinks on its own (cap it with thinking_token_budget)"),
    "include": ([], "include is not supported (no extra output data to include)"),
    "conversation": (None, "conversation objects are not supported; continue with "
                           "previous_response_id"),
    "prompt": (None, "prompt templates are not supported; send input and instructions"),
    "max_tool_calls": (None, "max_tool_calls is not supported; use parallel_tool_calls: "
                             "false for one call"),
    "top_logprobs": (None, "logprobs are not supported on /v1/responses; use "
                           "/v1/chat/completions"),
    "truncation": ("disabled", "truncation 'auto' is not supported: an input over the "
                               "context is refused, never truncated"),
}

# a Responses function tool's fields; a tool of another type is a hosted one (web_search,
# file_search, ...) that OpenAI runs itself: refused, nothing here runs it
FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses (docs/reference.md lists every field)."""
    # unknown fields are errors that name the field, as on the chat route
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # rayguide, as on the chat route
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None  # echoed back (OpenAI's bounds: _check_metadata)
    user: str | None = None
    service_tier: str | None = None  # accepted and ignored, as on the chat route
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    # rayguide's extras, as on the chat route
    validation: api.Validation | None = None
    loop_guard: bool | dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    guided_decoding_backend: str | None = None
    grammar_id: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


# passed to the chat request as they are
_SAME = ("model", "temperature", "top_p", "seed", "stream", "user", "parallel_tool_calls",
         "validation", "loop_guard", "thinking_token_budget", "guided_decoding_backend",
         "grammar_id", "top_k", "min_p", "repetition_penalty")


@dataclass
class Turn:
    """One Responses request, planned: the chat ``plan`` that runs, the conversation it
    continues (``history``, chat messages) and the ``messages`` this turn adds to it (what
    a later ``previous_response_id`` gets back, with the output), the response's id and
    what the Response object repeats of the request (``echo``)."""
    plan: api.Plan
    id: str
    history: list[dict]
    messages: list[dict]
    echo: dict[str, Any]
    store: bool = True


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def check_previous_id(previous: str) -> None:
    if not RESPONSE_ID.fullmatch(previous):
        raise bad_request("previous_response_id is 'resp_' and 32 hex digits, as a response "
                          "of this server's gives its id", "previous_response_id")


def plan_response(req: ResponsesRequest, history: list[dict] | None, limits: Limits,
                  served: api.Served | None = None, client: str | None = None,
                  named: GrammarSpec | None = None) -> Turn:
    """The request's plan: the chat plan of the conversation so far (``history``: what
    ``previous_response_id`` names, None for none) followed by the request's ``input``;
    ``client`` and ``named`` as for ``openai_api.plan_chat``."""
    for name, (off, why) in UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not None and value != off:
            raise bad_request(why, name)
    _check_metadata(req.metadata)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}",
                          "max_output_tokens")
    messages, origins = input_messages(req.input)
    history = list(history or [])
    sent = history + messages
    where = ["previous_response_id"] * len(history) + origins
    if req.instructions:  # this request's own: never carried to the next turn
        sent = [{"role": "system", "content": req.instructions}] + sent
        where = ["instructions"] + where
    body: dict[str, Any] = {k: getattr(req, k) for k in _SAME if getattr(req, k) is not None}
    body["messages"] = sent
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    text_format = _text_format(req.text)
    if text_format["type"] != "text":
        body["response_format"] = _response_format(text_format)
    if req.tools:
        body["tools"] = [_function_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    try:
        chat = api.parse_request(api.ChatCompletionRequest, body)
        plan = api.plan_chat(chat, limits, served, client, named)
    except APIError as exc:
        raise _renamed(exc, where) from None
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls
            is not False, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "store": req.store}
    return Turn(plan, new_response_id(), history, messages, echo, req.store)


def _check_metadata(metadata: dict | None) -> None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, string values up to
    512."""
    if not metadata:
        return
    if len(metadata) > 16:
        raise bad_request(f"metadata has {len(metadata)} pairs; at most 16", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request("metadata keys are at most 64 characters and values strings "
                              f"of at most 512; {key[:64]!r} is not", f"metadata.{key[:64]}")


def input_messages(items: str | list) -> tuple[list[dict], list[str]]:
    """``input`` as chat messages, and for each message the input field it came from
    (``input.<i>``). Message items (``input_text`` / ``output_text`` parts), the model's
    ``function_call`` items (an assistant message's ``tool_calls``; consecutive calls, and
    calls right after the assistant's text, are one message) and ``function_call_output``
    items (``tool`` messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    if not items:
        raise bad_request("input is empty; send a string or at least one item", "input")
    out: list[dict] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{i}].role must be user, assistant, system or "
                                  f"developer; got {str(role)[:40]!r}", f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad_request(f"input[{i}]: a function_call needs 'name' and "
                                  "'arguments' (a JSON string)", where)
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                continue
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": text})
        else:
            raise bad_request(f"input[{i}].type {str(kind)[:40]!r} is not supported; send "
                              "message, function_call or function_call_output items",
                              f"{where}.type")
        origins.append(where)
    return out, origins


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (``input_text``, ``output_text``,
    ``refusal``) joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts",
                          f"{where}.content")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(f"{where}.content[{k}]: only text parts are supported (no "
                              f"images, files or audio), got {str(kind)[:40]!r}",
                              f"{where}.content.{k}.type")
        text = part.get("refusal" if kind == "refusal" else "text", "")
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{k}]: 'text' must be a string",
                              f"{where}.content.{k}")
        parts.append(text)
    return "".join(parts)


def _text_format(text: dict | None) -> dict:
    """``text.format`` checked: text, json_object or json_schema (``name``, ``schema``,
    ``strict``, ``description``)."""
    if text is None:
        return {"type": "text"}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise bad_request(f"text.{unknown[0]} is not a field of text (format)",
                          f"text.{unknown[0]}")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                              "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise bad_request(f"text.format.type {str(kind)[:40]!r} is not supported; use text, "
                          "json_object or json_schema", "text.format.type")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs 'schema' (an object) and "
                              "'name'", "text.format.schema")
        unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if unknown:
            raise bad_request(f"text.format.{unknown[0]} is not a field of a json_schema "
                              "format", f"text.format.{unknown[0]}")
    return fmt


def _response_format(fmt: dict) -> dict:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    body = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        body["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": body}


def _function_tool(tool: Any, i: int) -> dict:
    """A Responses function tool (flat: ``{type, name, description, parameters,
    strict}``) as a chat tool; hosted tools (web_search, file_search, ...) are refused."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"tools[{i}]: {str(kind)[:40]!r} tools are not supported here; "
                          "only function tools (this server runs no hosted tool)",
                          f"tools.{i}.type")
    unknown = sorted(set(tool) - FUNCTION_TOOL_KEYS)
    if unknown:
        raise bad_request(f"tools[{i}].{unknown[0]} is not a field of a function tool",
                          f"tools.{i}.{unknown[0]}")
    return {"type": "function",
            "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str) or not isinstance(choice, dict):
        return choice  # "none" / "auto" / "required", or a wrong shape the planner names
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': "
                      "'function', 'name': ...} (no hosted tools here)", "tool_choice")


# the chat planner's words for the fields a Responses request sent (param prefix, and the
# same words in its message)
RENAMED = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("response_format.json_schema", "text.format.schema"),
           ("response_format", "text.format"))


def _renamed(exc: APIError, where: list[str]) -> APIError:
    """The planner's error, naming the Responses field the chat field came from:
    ``messages.<k>...`` the input item (or instructions, or the stored conversation),
    ``tools.<i>.function.<x>`` ``tools.<i>.<x>``, the rest by ``RENAMED``."""
    param, message = exc.param, exc.message
    if param:
        m = re.match(r"messages(?:\.(\d+))?(.*)", param)
        if m:
            k = int(m.group(1)) if m.group(1) else None
            origin = where[k] if k is not None and k < len(where) else "input"
            param = origin + (m.group(2) if origin.startswith("input.") else "")
        param = re.sub(r"^tools\.(\d+)\.function\.", r"tools.\1.", param)
        for old, new in RENAMED:
            if param == old or param.startswith(old + "."):
                param = new + param[len(old):]
    for old, new in RENAMED:
        message = re.sub(rf"\b{re.escape(old)}\b", new, message)
    message = re.sub(r"\b(tools\[\d+\])\.function\.", r"\1.", message)
    message = re.sub(r"\bmessages\[(\d+)\]", lambda m: _where(where, int(m.group(1))), message)
    return APIError(exc.status, message, exc.type, param, exc.code, exc.headers)


def _where(where: list[str], k: int) -> str:
    origin = where[k] if k < len(where) else "input"
    return re.sub(r"\.(\d+)$", r"[\1]", origin)

