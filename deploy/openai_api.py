"""The OpenAI API as rayguide speaks it: request models, their translation into runtime
requests, and the shapes of responses and stream chunks. No Ray and no HTTP here, so every
rule is unit-testable; deploy/serve_app.py does the I/O.

A request becomes a ``Plan``: one runtime request per choice (``n`` samples of a chat, or
``n`` per prompt of a completion), the grammar that constrains them, and what the response
needs (tool mode, logprobs, usage). Guided fields from every dialect map to one
``GrammarSpec``: OpenAI ``response_format`` (json_schema with ``strict``, json_object,
text), LMDeploy's ``regex_schema``, vLLM's ``guided_*`` and ``structured_outputs``, and
``tools`` + ``tool_choice``, which become an xgrammar structural tag (see ``tool_grammar``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from grammar_cache.spec import MAX_SOURCE_CHARS, GrammarSpec


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param",
    "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# requests -------------------------------------------------------------------------------

class _Request(BaseModel):
    # unknown fields are errors that name the field: a typo never passes silently
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # rayguide: keep a multi-turn conversation (and its KV) on one worker
    session_id: str | None = None
    # vLLM-compatible extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: always xgrammar
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored (OpenAI platform features with no meaning here)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def parse_request(cls: type[_Request], body: Any) -> _Request:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err["loc"]) or "body"
            msg = ("unknown field; remove it" if err["type"] == "extra_forbidden"
                   else err["msg"])
            problems.append(f"'{where}': {msg}")
        first = ".".join(str(p) for p in exc.errors()[0]["loc"]) if exc.errors() else None
        raise bad_request("invalid request: " + "; ".join(problems), param=first) from None


# plans ----------------------------------------------------------------------------------

@dataclass
class Limits:
    """Server-side bounds on what one request may ask for."""
    default_max_tokens: int = 512
    max_n: int = 16


@dataclass
class Plan:
    """What one API request runs: ``requests[i]`` is choice i's runtime request."""
    kind: Literal["chat", "completion"]
    requests: list[dict]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: list[dict] | None = None  # the function definitions, when tool calls are on
    tool_mode: str | None = None  # "auto" | "required" | "named"
    session_id: str | None = None  # the client's session
    temp_session: str | None = None  # a session the server made (n > 1) and must end
    model: str | None = None
    # tokens in the prompt of each choice (completions with several prompts differ)
    prompt_index: list[int] = field(default_factory=list)


def plan_chat(req: ChatCompletionRequest, limits: Limits) -> Plan:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    params = _params(req, limits, req.max_completion_tokens or req.max_tokens)
    if req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    messages = _messages(req.messages)
    grammar = _grammar(req)
    tools, mode = None, None
    if req.tools:
        tools, mode, tool_grammar_spec = tool_grammar(req.tools, req.tool_choice,
                                                      req.parallel_tool_calls)
        if mode is not None:
            if grammar is not None:
                raise bad_request("tools cannot be combined with response_format or guided "
                                  "fields in one request; send one of them", "tools")
            grammar = tool_grammar_spec
            messages = _with_tool_prompt(messages, tools, mode, req.tool_choice)
    elif req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    plan = Plan("chat", [], stream=req.stream, include_usage=_include_usage(req),
                logprobs=req.logprobs, tools=tools, tool_mode=mode,
                session_id=req.session_id, model=req.model)
    _fill(plan, [messages], req, params, grammar)
    return plan


def plan_completion(req: CompletionRequest, limits: Limits) -> Plan:
    if req.echo:
        raise bad_request("echo is not supported; leave it false", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
    params = _params(req, limits, req.max_tokens, default=16)
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= 20:
            raise bad_request("logprobs must be in [0, 20]", "logprobs")
        params["logprobs"] = req.logprobs
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not prompts or any(not p for p in prompts):
        raise bad_request("prompt is empty", "prompt")
    if len(prompts) * req.n > limits.max_n * 8:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} is over the limit of "
                          f"{limits.max_n * 8} choices per request", "prompt")
    plan = Plan("completion", [], stream=req.stream, include_usage=_include_usage(req),
                logprobs=req.logprobs is not None, session_id=req.session_id, model=req.model)
    _fill(plan, list(prompts), req, params, _grammar(req))
    return plan


def _fill(plan: Plan, prompts: list, req: _Request, params: dict,
          grammar: GrammarSpec | None) -> None:
    """One runtime request per (prompt, sample). Samples of one prompt share a session, so
    they run on one worker, reuse the prompt's KV and each get their own grammar matcher."""
    session = req.session_id
    if session is None and req.n > 1:
        session = plan.temp_session = f"tmp-{uuid.uuid4().hex}"
    if len(prompts) > 1 and req.session_id is not None:
        raise bad_request("session_id needs a single prompt", "session_id")
    for p_index, prompt in enumerate(prompts):
        for i in range(req.n):
            p = dict(params)
            if p.get("seed") is not None:
                p["seed"] = p["seed"] + i  # n samples with one seed would all be equal
            r = {"prompt": prompt, "params": p, "request_id": uuid.uuid4().hex, "seq_id": i}
            if session is not None:
                r["session_id"] = session if len(prompts) == 1 else f"{session}-{p_index}"
            if grammar is not None:
                r["grammar"] = grammar.to_dict()
            plan.requests.append(r)
            plan.prompt_index.append(p_index)


def _include_usage(req: _Request) -> bool:
    if req.stream_options and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    return bool((req.stream_options or {}).get("include_usage"))


def _params(req: _Request, limits: Limits, max_tokens: int | None, default=None) -> dict:
    if not 1 <= req.n <= limits.max_n:
        raise bad_request(f"n must be in [1, {limits.max_n}], got {req.n}", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported; constrain the output with a "
                          "grammar instead", "logit_bias")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    p: dict[str, Any] = {"max_new_tokens": max_tokens or default or limits.default_max_tokens}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "ignore_eos"):
        value = getattr(req, name)
        if value is not None:
            p[name] = value
    if req.stop:
        p["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        p["stop_token_ids"] = list(req.stop_token_ids)
    return p


def _grammar(req: _Request) -> GrammarSpec | None:
    """The one grammar a request asks for, from whichever dialect it used."""
    asked: list[tuple[str, Any]] = []
    if req.response_format is not None and req.response_format.get("type") != "text":
        asked.append(("response_format", req.response_format))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            asked.append((name, getattr(req, name)))
    if req.structured_outputs:
        asked.append(("structured_outputs", req.structured_outputs))
    if len(asked) > 1:
        raise bad_request(f"only one of {', '.join(n for n, _ in asked)} may be set")
    if not asked:
        if req.response_format is not None:
            GrammarSpec.from_response_format(req.response_format)  # checks its shape
        return None
    name, value = asked[0]
    try:
        if name == "response_format":
            return GrammarSpec.from_response_format(value)
        if name == "guided_json":
            return GrammarSpec.json_schema(value)
        if name == "guided_regex":
            return GrammarSpec.regex(value)
        if name == "guided_choice":
            return GrammarSpec.choice(value)
        if name == "guided_grammar":
            return GrammarSpec.ebnf(value)
        return _structured_outputs(value)
    except ValueError as exc:
        raise grammar_error(exc, name) from None


def _structured_outputs(so: dict) -> GrammarSpec:
    makers = {"json": GrammarSpec.json_schema, "regex": GrammarSpec.regex,
              "choice": GrammarSpec.choice, "grammar": GrammarSpec.ebnf,
              "structural_tag": GrammarSpec.structural_tag}
    given = [k for k in so if so[k] is not None]
    if len(given) != 1 or given[0] not in makers:
        raise ValueError(f"structured_outputs needs exactly one of {sorted(makers)}; "
                         f"got {sorted(given)}")
    if given[0] == "json" and so["json"] is True:
        return GrammarSpec.json_object()
    return makers[given[0]](so[given[0]])


def grammar_error(exc: ValueError, param: str | None = None) -> APIError:
    """A grammar the server refuses: 413 when it is too large, 400 otherwise."""
    msg = str(exc)
    if "over the limit" in msg and str(MAX_SOURCE_CHARS) in msg:
        return APIError(413, msg, param=param, code="grammar_too_large")
    return APIError(400, f"invalid grammar: {msg}", param=param, code="invalid_grammar")


def _messages(messages: list[dict]) -> list[dict]:
    """Chat messages as the engine's chat template takes them. Text content parts are
    joined; assistant tool calls and tool results become text in the same format the
    tool grammar generates, so any chat template renders them."""
    if not messages:
        raise bad_request("messages is empty; send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, developer, user, "
                              f"assistant or tool; got {role!r}", f"messages.{i}.role")
        content = _text(m.get("content"), i)
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {}) if isinstance(call, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    raise bad_request(f"messages[{i}].tool_calls: arguments are not JSON",
                                      f"messages.{i}.tool_calls") from None
                calls.append(_call_text(fn.get("name", ""), args))
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        elif role == "developer":
            role = "system"
        out.append({"role": role, "content": content})
    return out


def _text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: only text parts are supported, "
                                  f"got {kind!r}", f"messages.{i}.content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages.{i}.content")


# tools ----------------------------------------------------------------------------------
# Calls are written as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, a
# format many open models were trained on. The grammar fixes everything but the arguments,
# which follow the function's parameter schema, so a call under "required" or a named
# tool_choice cannot be malformed; under "auto" the model may write text, and once it
# starts a call the same rule holds.

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _call_text(name: str, arguments) -> str:
    return (f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '
            f'{json.dumps(arguments, ensure_ascii=False)}}}\n{CALL_CLOSE}')


def tool_grammar(tools: list[dict], tool_choice, parallel: bool | None
                 ) -> tuple[list[dict], str | None, GrammarSpec | None]:
    """(function definitions, mode, structural-tag grammar); mode None: tool_choice none."""
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                              f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}",
                                                                    fn["name"]):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, "
                              "'_', '.' or '-'", f"tools.{i}.function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools.{i}.function.parameters")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")

    if tool_choice in (None, "auto"):
        mode, chosen = "auto", functions
    elif tool_choice == "none":
        return functions, None, None
    elif tool_choice == "required":
        mode, chosen = "required", functions
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools "
                              f"({', '.join(names)})", "tool_choice")
        mode = "named"
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")

    tags = [{"type": "tag", "begin": f'{CALL_OPEN}\n{{"name": {json.dumps(f["name"])}, '
                                     '"arguments": ',
             "content": {"type": "json_schema", "json_schema": f["parameters"]},
             "end": f"}}\n{CALL_CLOSE}"} for f in chosen]
    if mode == "auto":
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
               "at_least_one": False, "stop_after_first": parallel is False}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
               "at_least_one": True, "stop_after_first": mode == "named" or parallel is False}
    try:
        spec = GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})
    except ValueError as exc:
        raise grammar_error(exc, "tools") from None
    return functions, mode, spec


def _with_tool_prompt(messages: list[dict], functions: list[dict], mode: str,
                      tool_choice) -> list[dict]:
    """Tells the model which functions exist and how to call them (in the system message,
    since not every chat template renders tools)."""
    listing = "\n".join(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                    "parameters": f["parameters"]}, ensure_ascii=False)
                        for f in functions)
    how = ("To call a function, write\n<tool_call>\n"
           '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>')
    if mode == "required":
        how += "\nYou must call at least one function."
    elif mode == "named":
        how += f"\nCall the function {tool_choice['function']['name']}."
    text = f"You can call these functions:\n{listing}\n{how}"
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, OpenAI tool_calls). A call that does not parse
    (cut off by max_tokens) stays in the content."""
    calls, kept, pos = [], [], 0
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name,
                                   "arguments": json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


class ToolStreamSplitter:
    """Streams content text while holding back anything that may be the start of a tool
    call; once a call starts, everything after it is kept for ``parse_tool_calls``."""

    def __init__(self):
        self.pending = ""
        self.in_calls = False
        self.captured = ""

    def feed(self, text: str) -> str:
        if self.in_calls:
            self.captured += text
            return ""
        self.pending += text
        at = self.pending.find(CALL_OPEN)
        if at >= 0:
            out, self.captured = self.pending[:at], self.pending[at:]
            self.pending, self.in_calls = "", True
            return out
        keep = 0  # the longest tail that is a prefix of CALL_OPEN
        for k in range(min(len(CALL_OPEN) - 1, len(self.pending)), 0, -1):
            if CALL_OPEN.startswith(self.pending[-k:]):
                keep = k
                break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still held back, parsed calls)."""
        content, calls = parse_tool_calls(self.captured) if self.captured else (None, [])
        return self.pending + (content or ""), calls


# responses ------------------------------------------------------------------------------

@dataclass
class Choice:
    """What one choice produced, accumulated over its chunks."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (logprob, [(id, lp)]) per token
    logprob_tokens: list = field(default_factory=list)  # [token text, [alt texts]]
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, chunk: dict) -> None:
        self.text += chunk.get("text", "")
        self.token_ids += chunk.get("token_ids", [])
        self.logprobs += chunk.get("logprobs") or []
        self.logprob_tokens += chunk.get("logprob_tokens") or []
        if chunk.get("finished"):
            self.finish_reason = chunk.get("finish_reason")
            self.error, self.error_kind = chunk.get("error"), chunk.get("error_kind")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            if chunk.get(name) is not None:
                setattr(self, name, chunk[name])


def chat_logprobs(logprobs: list, tokens: list) -> dict:
    content = []
    for (lp, top), (text, alts) in zip(logprobs, tokens):
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": a_lp,
                                          "bytes": list(t.encode())}
                                         for t, (_, a_lp) in zip(alts, top)]})
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: list, tokens: list, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for (lp, top), (text, alts) in zip(logprobs, tokens):
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({t: a_lp for t, (_, a_lp) in zip(alts, top)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def finish_reason(reason: str | None, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def usage(choices: list[Choice], prompt_index: list[int]) -> dict:
    """Each distinct prompt counts once; every sample's output counts."""
    prompt, cached, seen = 0, 0, set()
    for c, p in zip(choices, prompt_index):
        if p not in seen:
            seen.add(p)
            prompt += c.prompt_tokens
            cached += c.cached_tokens
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())
