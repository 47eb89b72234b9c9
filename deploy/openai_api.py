"""The OpenAI API as rayguide speaks it: request models and their translation into runtime
requests. No Ray and no HTTP here, so every rule is unit-testable; deploy/serve_app.py does
the I/O, deploy/responses.py shapes what goes back.

A request becomes a ``Plan``: one ``GenerationRequest`` per choice (``n`` samples of a
chat, or ``n`` per prompt of a completion), the grammar that constrains them (built once
by deploy/dialects.py, its key cached on it), and what the response needs (tool mode,
logprobs, usage). Every limit comes from ``settings.Limits`` and is refused with a 4xx that
names it.

Why one module over 500 lines: it is the API's request models (pydantic, one class per
body) and the one translation of each into a Plan; split, a field and its rule would part.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.grammar_spec import GrammarSpec, is_grammar_id
from core.params import LoopGuardParams, SamplingParams
from core.request import GenerationRequest
from deploy import dialects, tools
from deploy.errors import APIError, bad_request, for_kind
from deploy.settings import Limits
from core.config import config_error_message

Validation = Literal["flag", "retry", "off"]

# a seed is a 64-bit signed integer's non-negative half: what torch's generators take and
# what other servers accept; n > 1 seeds the samples seed, seed + 1, ... modulo its range
MAX_SEED = 2**63 - 1

# what a session id may hold (its length is ``Limits.max_session_id_chars``): ids ride every
# worker's load report and /metrics, so they are short plain ASCII, never arbitrary text
SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]+")


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
    # rayguide: what to do when a finished JSON output fails its full schema ("flag":
    # say so in the response; "retry": resample a non-streamed request; "off")
    validation: Validation | None = None
    # rayguide: the loop guard (a JSON value that repeats itself is ended where the
    # repetition began): true / false, or an object of its settings; null: on
    loop_guard: bool | dict[str, Any] | None = None
    # reasoning models: the thought's cap in tokens (vLLM's name; SGLang's thinking_budget
    # is taken too); ignored by a server without reasoning markers
    thinking_token_budget: int | None = None
    thinking_budget: int | None = None
    # vLLM-compatible extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    # rayguide: speculative decoding for this request (null: the server's default); it
    # changes the speed, never the tokens
    speculative: bool | None = None
    stop_token_ids: list[int] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # the grammar engine: "auto" (the server's default), "xgrammar", "llguidance"
    # ("guidance": vLLM's name); also structured_outputs.backend
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # rayguide: a grammar checked before (POST /v1/grammars answers its id), instead of
    # the guided fields
    grammar_id: str | None = None


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


class GrammarCheckRequest(ChatCompletionRequest):
    """POST /v1/grammars: any chat or completion request body (its guided fields or tools
    are checked, the rest is read and ignored), or just the guided fields."""
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # how long to wait for the compile before answering 202 "compiling" (default: the
    # server's grammar_check_wait_s; the worker waits at most its grammar_timeout_s)
    wait_s: float | None = Field(None, ge=0, le=600, allow_inf_nan=False)


def parse_request(cls: type[_Request], body: Any) -> _Request:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        raise bad_request("invalid request: " + config_error_message(exc, None, cls),
                          param=first) from None


def check_session_id(session_id: str, limits: Limits) -> str:
    """A client's session id, or a 400 naming ``session_id`` that says what it may hold."""
    limit = limits.max_session_id_chars
    if not session_id or len(session_id) > limit:
        raise bad_request(f"session_id must be 1 to {limit} characters, got "
                          f"{len(session_id)}", "session_id")
    if not SESSION_ID.fullmatch(session_id):
        raise bad_request("session_id may hold only ASCII letters, digits and '.', '_', "
                          "':', '@', '-'", "session_id")
    return session_id


def client_identity(user: str | None, address: str | None, tenant: str | None) -> str:
    """Who a request is for: the owner of its sessions (session_key) and checked grammar
    ids, and its line in the compile queues (grammar_cache/actor.py CompileQueue,
    worker/guided/compile_queue.py FairQueue). ``<tenant hash>.<u|a><hash>``: the tenant
    its API key belongs to (deploy/tenants.py; None: the server takes no key, one open
    tenant) is the root, so two tenants never share a session, a grammar id or a line,
    whatever ``user`` they send; under it the OpenAI ``user`` field when given, else the
    client's address. Short and opaque: no tenant name, user or address in it. ``user``
    is a hint inside a tenant, not authentication: any client of the tenant may send any
    ``user``, and one that invents new values gets a line (and namespace) for each."""
    def digest(text: str, size: int) -> str:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size,
                               person=b"rayguide-client").hexdigest()

    root = "t" + digest(tenant, 4) if tenant else "open"
    if user:
        return f"{root}.u{digest(user, 6)}"
    return f"{root}.a{digest(address or 'unknown', 6)}"


def cache_scope(client: str | None) -> str | None:
    """Whose cached prompt prefixes a request may start from (GenerationRequest.cache_scope,
    worker/engine/block_manager.py): its tenant's, the root of its client identity. As
    OpenAI shares prompt caches within an organization and never across, a tenant's
    clients share their prefixes (the system prompt every user sends is computed once),
    and no tenant hits, or learns from ``cached_tokens`` of, another's."""
    return client.split(".", 1)[0] if client else None


def session_key(client: str | None, session_id: str) -> str:
    """The runtime's name for a client's session: ``<client identity>:<session id>``. A
    session belongs to the client that made it (client_identity(): its ``user``, else its
    address, under its API key's tenant): another client naming the same id reaches a session of
    its own, so it can neither end the first one's (nor cut its running requests) nor learn
    from ``cached_tokens`` how much of that session's prompt its own matches. ``client``
    None (no identity: tests, a caller of the plan functions alone): the id as given."""
    return session_id if client is None else f"{client}:{session_id}"


# plans ----------------------------------------------------------------------------------

@dataclass
class Served:
    """What the edge knows of the served model: its context length (max_tokens beyond it
    is refused) and its sampling defaults (from its generation config), used for every
    sampling field a request leaves unset."""
    context: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """What one API request runs: ``requests[i]`` is choice i's runtime request."""
    kind: Literal["chat", "completion"]
    requests: list[GenerationRequest]
    grammar: GrammarSpec | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: list[dict] | None = None  # the function definitions, when tool calls are on
    tool_mode: str | None = None  # "auto" | "required" | "named"
    session_id: str | None = None  # the client's session, as the client named it
    temp_session: str | None = None  # a session the server made (n > 1) and must end
    model: str | None = None
    validation: Validation = "flag"
    loop_guard: LoopGuardParams | None = None  # None: the engine's default
    thinking_token_budget: int | None = None  # None: the server's default
    client: str | None = None  # client_identity(): the grammar cache's fair-share line
    # tokens in the prompt of each choice (completions with several prompts differ)
    prompt_index: list[int] = field(default_factory=list)


def plan_chat(req: ChatCompletionRequest, limits: Limits, served: Served | None = None,
              client: str | None = None, named: GrammarSpec | None = None) -> Plan:
    """The chat request's plan; ``client``: its client_identity() (None: the shared line);
    ``named``: the checked grammar its ``grammar_id`` names (None: unknown to the edge)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request("top_logprobs must be in [0, 20]", "top_logprobs")
    if len(req.messages) > limits.max_messages:
        raise bad_request(f"{len(req.messages)} messages is over the limit of "
                          f"{limits.max_messages}", "messages")
    params = _params(req, limits, req.max_completion_tokens or req.max_tokens, served,
                     logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    messages = _messages(req.messages)
    _check_prompt_chars(_chars(messages), limits)
    grammar = _grammar(req, named)
    functions, mode, tool_spec = _tools(req, limits)
    if req.tools:
        if mode is not None:
            if grammar is not None:
                raise bad_request("tools cannot be combined with response_format or guided "
                                  "fields in one request; send one of them", "tools")
            grammar = tool_spec
            messages = tools.with_tool_prompt(messages, functions, mode, req.tool_choice)
            # the tool listing (descriptions, parameter schemas) is prompt text too
            _check_prompt_chars(_chars(messages), limits, "tools",
                                " with the tool definitions")
    elif req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    if grammar is not None:
        grammar = dialects.with_engine(grammar, _engine(req))
    plan = Plan("chat", [], grammar, stream=req.stream, include_usage=_include_usage(req),
                logprobs=req.logprobs, tools=functions, tool_mode=mode,
                session_id=req.session_id, model=req.model,
                validation=req.validation or "flag", loop_guard=_loop_guard(req),
                thinking_token_budget=_thinking_budget(req), client=client)
    _fill(plan, [messages], req, params)
    return plan


def plan_completion(req: CompletionRequest, limits: Limits, served: Served | None = None,
                    client: str | None = None, named: GrammarSpec | None = None) -> Plan:
    """The completion request's plan; ``client`` and ``named`` as for plan_chat."""
    if req.echo:
        raise bad_request("echo is not supported; leave it false", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request("logprobs must be in [0, 20]", "logprobs")
    params = _params(req, limits, req.max_tokens, served, default=16,
                     logprobs=req.logprobs)
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not prompts or any(not p for p in prompts):
        raise bad_request("prompt is empty", "prompt")
    if len(prompts) * req.n > limits.max_choices:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} is over the limit of "
                          f"{limits.max_choices} choices per request (max_choices); send "
                          "fewer", "n" if req.n > 1 else "prompt")
    _check_prompt_chars(sum(len(p) for p in prompts), limits, "prompt")
    grammar = _grammar(req, named)
    if grammar is not None:
        grammar = dialects.with_engine(grammar, _engine(req))
    plan = Plan("completion", [], grammar, stream=req.stream,
                include_usage=_include_usage(req), logprobs=req.logprobs is not None,
                session_id=req.session_id, model=req.model,
                validation=req.validation or "flag", loop_guard=_loop_guard(req),
                thinking_token_budget=_thinking_budget(req), client=client)
    _fill(plan, list(prompts), req, params)
    return plan


def _fill(plan: Plan, prompts: list, req: _Request, params: SamplingParams) -> None:
    """One runtime request per (prompt, sample). Samples of one prompt share a session, so
    they run on one worker, reuse the prompt's KV and each get their own grammar matcher."""
    session = req.session_id
    if session is not None:
        session = session_key(plan.client, session)
    elif req.n > 1:
        session = plan.temp_session = f"tmp-{uuid.uuid4().hex}"
    if len(prompts) > 1 and req.session_id is not None:
        raise bad_request("session_id needs a single prompt", "session_id")
    for p_index, prompt in enumerate(prompts):
        for i in range(req.n):
            p = params
            if p.seed is not None and i:  # n samples with one seed would all be equal
                p = SamplingParams(**{**_fields(p), "seed": (p.seed + i) % (MAX_SEED + 1)})
            sid = None
            if session is not None:
                sid = session if len(prompts) == 1 else f"{session}-{p_index}"
            plan.requests.append(GenerationRequest(
                prompt=prompt, params=p, request_id=uuid.uuid4().hex, session_id=sid,
                grammar=plan.grammar, seq_id=i, validation=plan.validation,
                loop_guard=plan.loop_guard, thinking_token_budget=plan.thinking_token_budget,
                client=plan.client, cache_scope=cache_scope(plan.client)))
            plan.prompt_index.append(p_index)


def _thinking_budget(req: _Request) -> int | None:
    """The thought's cap: thinking_token_budget, or SGLang's thinking_budget (one of them,
    or both equal), an integer >= 0."""
    budget, other = req.thinking_token_budget, req.thinking_budget
    if budget is not None and other is not None and budget != other:
        raise bad_request("thinking_token_budget and thinking_budget differ; send one",
                          "thinking_token_budget")
    budget = other if budget is None else budget
    name = "thinking_token_budget" if req.thinking_token_budget is not None else "thinking_budget"
    if budget is not None and budget < 0:
        raise bad_request(f"{name} must be >= 0, got {budget}", name)
    return budget


def _loop_guard(req: _Request) -> LoopGuardParams | None:
    if req.loop_guard is None:
        return None
    try:
        return LoopGuardParams.from_value(req.loop_guard)
    except (TypeError, ValueError) as exc:
        field = getattr(exc, "field", None)  # LoopGuardFieldError: the field to change
        raise bad_request(str(exc), f"loop_guard.{field}" if field else "loop_guard") from None


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def _include_usage(req: _Request) -> bool:
    if req.stream_options and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    return bool((req.stream_options or {}).get("include_usage"))


def _chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


def _check_prompt_chars(n: int, limits: Limits, param: str = "messages",
                        what: str = "") -> None:
    if n > limits.max_prompt_chars:
        raise APIError(413, f"the prompt{what} is {n} characters, over the limit of "
                            f"{limits.max_prompt_chars} (max_prompt_chars); shorten it",
                       param=param, code="prompt_too_large")


def _params(req: _Request, limits: Limits, max_tokens: int | None, served: Served | None,
            default: int | None = None, logprobs: int | None = None) -> SamplingParams:
    served = served or Served()
    context = served.context
    if not 1 <= req.n <= limits.max_n:
        raise bad_request(f"n must be in [1, {limits.max_n}], got {req.n}", "n")
    if req.session_id is not None:
        check_session_id(req.session_id, limits)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported; constrain the output with a "
                          "grammar instead", "logit_bias")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, {MAX_SEED}] (2^63 - 1), got {req.seed}",
                          "seed")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens is not None and context is not None and max_tokens >= context:
        raise bad_request(f"max_tokens is {max_tokens}, but the model's context is {context} "
                          "tokens (prompt included); ask for fewer", "max_tokens")
    budget = max_tokens or default or limits.default_max_tokens
    if context is not None:
        budget = min(budget, context - 1)
    p: dict[str, Any] = {"max_new_tokens": budget, **served.sampling}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "ignore_eos", "speculative"):
        value = getattr(req, name)
        if value is not None:
            p[name] = value
    if req.stop:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stops) > limits.max_stops:
            raise bad_request(f"{len(stops)} stop strings is over the limit of "
                              f"{limits.max_stops}", "stop")
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise bad_request(f"a stop string is longer than {limits.max_stop_chars} "
                              "characters", "stop")
        p["stop"] = stops
    if req.stop_token_ids:
        if len(req.stop_token_ids) > limits.max_stop_token_ids:
            raise bad_request(f"{len(req.stop_token_ids)} stop_token_ids is over the limit "
                              f"of {limits.max_stop_token_ids}", "stop_token_ids")
        p["stop_token_ids"] = list(req.stop_token_ids)
    if logprobs is not None:
        p["logprobs"] = logprobs
    try:
        return SamplingParams(**p)
    except (ValueError, TypeError) as exc:
        name = next((k for k in p if k in str(exc)), None)
        raise bad_request(str(exc), name) from None


def check_spec(req: GrammarCheckRequest, limits: Limits,
               named: GrammarSpec | None = None) -> GrammarSpec:
    """The grammar POST /v1/grammars checks: the one the same body would constrain a
    chat request with (its guided fields, its tools, its grammar_id; with the engine it
    forces)."""
    grammar = _grammar(req, named)
    _, mode, tool_spec = _tools(req, limits)
    if mode is not None:
        if grammar is not None:
            raise bad_request("tools cannot be combined with response_format or guided "
                              "fields in one request; send one of them", "tools")
        grammar = tool_spec
    if grammar is None:
        raise bad_request("no grammar to check: send response_format (json_schema, "
                          "json_object, regex), a guided_* field, structured_outputs, tools "
                          "(with tool_choice other than 'none') or grammar_id",
                          "response_format")
    return dialects.with_engine(grammar, _engine(req))


def _tools(req: _Request, limits: Limits) -> tuple[list[dict] | None, str | None,
                                                    GrammarSpec | None]:
    """The request's tools as (functions, mode, their grammar); mode None: no tool calls."""
    if not getattr(req, "tools", None):
        return None, None, None
    if len(req.tools) > limits.max_tools:
        raise bad_request(f"{len(req.tools)} tools is over the limit of "
                          f"{limits.max_tools}", "tools")
    try:
        return tools.tool_grammar(req.tools, req.tool_choice, req.parallel_tool_calls)
    except dialects.DialectError as exc:
        raise for_kind(exc.kind, str(exc), exc.param) from None


def _grammar(req: _Request, named: GrammarSpec | None = None) -> GrammarSpec | None:
    """The one grammar a request asks for, from whichever dialect it used, or the checked
    grammar its ``grammar_id`` names (``named``: what the edge found under it)."""
    fields = {name: getattr(req, name) for name in
              ("response_format", *dialects.VLLM_FIELDS, "structured_outputs")}
    try:
        asked = dialects.from_openai(fields)
    except dialects.DialectError as exc:
        raise for_kind(exc.kind, str(exc), exc.param) from None
    if req.grammar_id is None:
        return asked
    if asked is not None:
        raise bad_request("grammar_id names the grammar; leave out response_format, the "
                          "guided_* fields and structured_outputs", "grammar_id")
    if not is_grammar_id(req.grammar_id):
        raise bad_request("grammar_id is 'grammar-' and 32 hex digits, as POST /v1/grammars "
                          "answers it", "grammar_id")
    if named is None:
        raise grammar_not_found(req.grammar_id, "grammar_id")
    return named


def grammar_not_found(grammar_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no checked grammar {grammar_id[:80]!r} for this client: POST its "
                         "grammar to /v1/grammars first, with a key of the same tenant and "
                         "the same user "
                         "(a client's checked grammars are its own, kept while the runtime "
                         "runs, its least recently used forgotten past a bound)",
                    param=param, code="grammar_not_found")


def _engine(req: _Request) -> str | None:
    """The grammar engine the request forces, None when it names none."""
    try:
        return dialects.engine_from({"guided_decoding_backend": req.guided_decoding_backend,
                                     "structured_outputs": req.structured_outputs})
    except dialects.DialectError as exc:
        raise for_kind(exc.kind, str(exc), exc.param) from None


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
                              f"assistant or tool; got {str(role)[:40]!r}",
                              f"messages.{i}.role")
        content = _text(m.get("content"), i)
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join(([content] if content else [])
                                + _tool_call_texts(m["tool_calls"], i))
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        elif role == "developer":
            role = "system"
        out.append({"role": role, "content": content})
    return out


def _tool_call_texts(calls: Any, i: int) -> list[str]:
    """An assistant message's tool_calls as the text the tool grammar generates."""
    where = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list of "
                          "{'type': 'function', 'function': {'name', 'arguments'}}", where)
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls[{k}] needs 'function': "
                              "{'name': str, 'arguments': str}", f"{where}.{k}")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, RecursionError):  # ValueError: also a 4,300+ digit integer
            raise bad_request(f"messages[{i}].tool_calls[{k}]: arguments are not JSON",
                              f"{where}.{k}") from None
        try:
            out.append(tools.call_text(fn["name"], args))
        except (TypeError, ValueError, RecursionError):
            raise bad_request(f"messages[{i}].tool_calls[{k}]: arguments are not "
                              "JSON-serializable", f"{where}.{k}") from None
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
                                  f"got {str(kind)[:40]!r}", f"messages.{i}.content")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise bad_request(f"messages[{i}].content: a text part's 'text' must be a "
                                  "string", f"messages.{i}.content")
            parts.append(text)
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages.{i}.content")
