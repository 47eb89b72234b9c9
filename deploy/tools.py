"""Tool calling: the call format, the structural-tag grammar that enforces it, the prompt
that tells the model about the functions, and parsing calls back out of the text.

Calls are written as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, a
format many open models were trained on, for generation and for history alike. The grammar
fixes everything but the arguments, which follow the function's parameter schema, so a call
under "required" or a named tool_choice cannot be malformed; under "auto" the model may
write text, and once it starts a call the same rule holds.

The grammar only approximates some schema keywords, and a call closed at the budget may
lack required arguments, so each parsed call's arguments are validated against its
function's ``parameters`` like any JSON answer (``call_report``: one verdict per call, in
the choice's ``guided`` report).
"""

from __future__ import annotations

import json
import re
import uuid

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from core.json_validation import validate_json
from deploy.dialects import DialectError, check_depth
from deploy.errors import bad_request

MAX_TOOLS = 128

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def call_text(name: str, arguments) -> str:
    return (f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '
            f'{json.dumps(arguments, ensure_ascii=False)}}}\n{CALL_CLOSE}')


def tool_grammar(tools: list[dict], tool_choice, parallel: bool | None
                 ) -> tuple[list[dict], str | None, GrammarSpec | None]:
    """(function definitions, mode, structural-tag grammar); mode None: tool_choice none."""
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"{len(tools)} tools is over the limit of {MAX_TOOLS}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
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
        check_depth(params, f"tools.{i}.function.parameters")
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
    except DialectError:
        raise
    except ValueError as exc:
        kind = getattr(exc, "kind", ErrorKind.INVALID_GRAMMAR)
        raise DialectError(f"tools: {exc}", "tools", kind) from None
    return functions, mode, spec


def with_tool_prompt(messages: list[dict], functions: list[dict], mode: str,
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
    (cut off by max_tokens) stays in the content. Identical calls (same function, same
    arguments) in one response are collapsed into one: a small model under "required"
    tends to repeat its call, and running the same call twice is never what was meant."""
    calls, kept, pos, seen = [], [], 0, set()
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        identity = (str(name), json.dumps(args, sort_keys=True))
        if identity in seen:
            continue
        seen.add(identity)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name,
                                   "arguments": json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def call_report(calls: list[dict], functions: list[dict], mode: str | None) -> dict:
    """The ``guided`` report's tool-call part: ``tool_calls``, one ``{id, name,
    validation, validation_error}`` per call (``id`` as in ``message.tool_calls``), its
    arguments validated against its function's ``parameters``; and the choice's
    ``validation`` / ``validation_error``: "invalid" naming the first call that is, "valid"
    when every call is, and "invalid" when "required" or a named tool_choice produced no
    complete call (cut off by ``max_tokens``). Without calls under "auto" the answer is
    text, and there is nothing to validate (None)."""
    schemas = {f["name"]: f["parameters"] for f in functions}
    verdicts = []
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        error = (validate_json(schemas[name], arguments) if name in schemas
                 else f"no function named {name!r} in tools")
        verdicts.append({"id": call["id"], "name": name,
                         "validation": "invalid" if error else "valid",
                         "validation_error": error})
    bad = next((v for v in verdicts if v["validation"] == "invalid"), None)
    if bad is not None:
        validation, error = "invalid", f"tool call {bad['name']}: {bad['validation_error']}"
    elif verdicts:
        validation, error = "valid", None
    elif mode in ("required", "named"):
        validation, error = "invalid", "no complete tool call (cut off by max_tokens?)"
    else:
        validation, error = None, None
    return {"validation": validation, "validation_error": error, "tool_calls": verdicts}


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


