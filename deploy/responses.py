"""What goes back to the client: OpenAI response bodies and server-sent-event streams,
assembled from the runtime's ``RequestOutput`` chunks. No I/O here (testable without Ray).

    body = response_body(plan, outputs, model)            # non-streamed
    sse = StreamAssembler(plan, model)                    # streamed
    for event in sse.start(): send(event)
    for i, chunk in chunks: for event in sse.feed(i, chunk): send(event)
    for event in sse.finish(): send(event)

A guided choice carries a ``guided`` object next to OpenAI's fields: ``validation``
("valid" / "invalid" / null when not checked), ``validation_error``, ``closed_early``
(the budget ran out and the output was closed to stay valid; finish_reason stays
"length") and ``approximated`` (schema keywords the grammar only approximates, where the
validation is what enforces them), and ``engine``: the grammar engine that served it
("xgrammar" or "llguidance"). A tool-calling choice's report also holds ``tool_calls``,
one verdict per call (``tools.call_report``: its arguments against its function's
``parameters``), and its ``validation`` is theirs.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from core.request import RequestOutput
from deploy import tools
from deploy.errors import for_kind
from deploy.openai_api import Plan


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def finish_reason(reason: str | None, has_calls: bool) -> str:
    """OpenAI's finish_reason for an engine finish. An aborted request (its session ended,
    an idle sweep, a client's DELETE) is cut short: it says ``abort`` (vLLM's word), never
    ``stop``, so a truncated answer never looks complete."""
    if reason == "abort":
        return "abort"
    if has_calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def guided_report(out: RequestOutput, calls: list[dict] | None = None,
                  plan: Plan | None = None) -> dict:
    """The conformance report of a finished guided choice; with a tool-calling ``plan``,
    its ``calls`` validated (``tools.call_report``)."""
    report = {"validation": getattr(out, "validation", None),
              "validation_error": getattr(out, "validation_error", None),
              "closed_early": bool(getattr(out, "closed_early", False)),
              "loop_cut": bool(getattr(out, "loop_cuts", 0)),
              "loop_cuts": int(getattr(out, "loop_cuts", 0) or 0),
              "approximated": list(getattr(out, "approximated", None) or []),
              "engine": getattr(out, "grammar_engine", None)}
    if plan is not None and plan.tool_mode and out.finish_reason != "error":
        calls_report = tools.call_report(calls or [], plan.tools or [], plan.tool_mode)
        if calls_report["validation"] is None:  # text under "auto": the engine's word
            calls_report.pop("validation"), calls_report.pop("validation_error")
        report.update(calls_report)
    return report


# A token the engine forced to close an output early (its budget ran out) was not sampled:
# it is reported with logprob 0 (the grammar's closing path left it as the only choice)
# and no alternatives.
_FORCED = (0.0, [])

# What a non-finite logprob (NaN from broken logits, -inf for a token the mask or sampler
# ruled out) is reported as: OpenAI's own floor for "very unlikely". JSON has no NaN or
# Infinity (the response encoder refuses them: it was a 500), and a number, unlike null,
# keeps clients that read logprobs as floats working.
LOGPROB_FLOOR = -9999.0


def _lp(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(logprobs: list, tokens: list) -> dict:
    content = []
    for (lp, top), (text, alts) in zip((x or _FORCED for x in logprobs), tokens):
        content.append({"token": text, "logprob": _lp(lp), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": _lp(a_lp),
                                          "bytes": list(t.encode())}
                                         for t, (_, a_lp) in zip(alts, top)]})
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: list, tokens: list, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for (lp, top), (text, alts) in zip((x or _FORCED for x in logprobs), tokens):
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append({t: _lp(a_lp) for t, (_, a_lp) in zip(alts, top)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def usage(outputs: list[RequestOutput], prompt_index: list[int]) -> dict:
    """Each distinct prompt counts once; every sample's output counts."""
    prompt, cached, seen = 0, 0, set()
    for out, p in zip(outputs, prompt_index):
        if p not in seen:
            seen.add(p)
            prompt += out.prompt_tokens
            cached += out.cached_tokens
    completion = sum(out.completion_tokens for out in outputs)
    body = {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
    if any(out.reasoning_tokens is not None for out in outputs):  # a reasoning model's
        body["completion_tokens_details"] = {
            "reasoning_tokens": sum(out.reasoning_tokens or 0 for out in outputs)}
    return body


def response_body(plan: Plan, outputs: list[RequestOutput], model: str) -> dict:
    """The non-streamed response: one choice per runtime request."""
    choices = []
    for i, out in enumerate(outputs):
        calls: list[dict] = []
        if plan.kind == "chat":
            content, calls = (tools.parse_tool_calls(out.text) if plan.tool_mode
                              else (out.text, []))
            message: dict[str, Any] = {"role": "assistant", "content": content,
                                       "refusal": None}
            if out.reasoning_tokens is not None:  # a reasoning model's thought
                message["reasoning_content"] = out.reasoning
            if calls:
                message["tool_calls"] = calls
            choice = {"index": i, "message": message,
                      "logprobs": (chat_logprobs(out.logprobs or [], out.logprob_tokens or [])
                                   if plan.logprobs else None),
                      "finish_reason": finish_reason(out.finish_reason, bool(calls))}
        else:
            choice = {"index": i, "text": out.text,
                      "logprobs": (completion_logprobs(out.logprobs or [],
                                                       out.logprob_tokens or [])
                                   if plan.logprobs else None),
                      "finish_reason": finish_reason(out.finish_reason, False)}
        if plan.grammar is not None:
            choice["guided"] = guided_report(out, calls, plan)
        choices.append(choice)
    return {"id": new_id(plan.kind),
            "object": "chat.completion" if plan.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(outputs, plan.prompt_index)}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamAssembler:
    """Turns the choices' chunks, interleaved as they come, into SSE events: the role
    delta first (chat), one event per chunk with content, the finish reason, an error
    event for a choice that failed mid-stream, then the usage chunk (when asked) and
    ``[DONE]``. Tool calls are held back while they are written and sent whole."""

    def __init__(self, plan: Plan, model: str):
        self.plan, self.model = plan, model
        self.id, self.created = new_id(plan.kind), int(time.time())
        self.object = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
        n = len(plan.requests)
        self.outputs = [RequestOutput(r.request_id) for r in plan.requests]
        self.splitters = [tools.ToolStreamSplitter() if plan.tool_mode else None
                          for _ in range(n)]
        self.offsets = [0] * n
        self.remaining = n

    def _event(self, choice: dict) -> str:
        data = {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.plan.include_usage:
            data["usage"] = None
        return sse(data)

    def start(self) -> list[str]:
        if self.plan.kind != "chat":
            return []
        return [self._event({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for i in range(len(self.outputs))]

    def feed(self, i: int, chunk: RequestOutput) -> list[str]:
        """The events for choice ``i``'s next chunk."""
        out = self.outputs[i].merge(chunk)
        n_lp = len(chunk.logprobs or [])
        lp_slice = ((chunk.logprobs or [])[:n_lp], (chunk.logprob_tokens or [])[:n_lp])
        text, calls, reason = chunk.text, [], None
        if chunk.finished:
            self.remaining -= 1
        if self.plan.kind == "chat":
            splitter = self.splitters[i]
            if splitter is not None:
                text = splitter.feed(text)
                if chunk.finished:
                    tail, calls = splitter.finish()
                    text += tail
            if chunk.finished:
                reason = ("error" if out.finish_reason == "error"
                          else finish_reason(out.finish_reason, bool(calls)))
            delta: dict[str, Any] = {}
            if chunk.reasoning:  # a reasoning model's thought, as it is written
                delta["reasoning_content"] = chunk.reasoning
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            lps = chat_logprobs(*lp_slice) if self.plan.logprobs and n_lp else None
            choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}
            emit = bool(delta or lps or reason)
        else:
            lps = (completion_logprobs(*lp_slice, offset=self.offsets[i])
                   if self.plan.logprobs and n_lp else None)
            self.offsets[i] += len(text)
            if chunk.finished:
                reason = ("error" if out.finish_reason == "error"
                          else finish_reason(out.finish_reason, False))
            choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": reason}
            emit = bool(text or lps or reason)
        if reason is not None and self.plan.grammar is not None:
            choice["guided"] = guided_report(out, calls, self.plan)
        events = [self._event(choice)] if emit else []
        if chunk.finished and out.finish_reason == "error":
            err = for_kind(out.error_kind, out.error or "generation failed",
                           request_id=out.request_id)
            events.append(sse(err.body()))
        return events

    def finish(self) -> list[str]:
        events = []
        if self.plan.include_usage:
            events.append(sse({"id": self.id, "object": self.object,
                               "created": self.created, "model": self.model, "choices": [],
                               "usage": usage(self.outputs, self.plan.prompt_index)}))
        return events + ["data: [DONE]\n\n"]

    @property
    def completion_tokens(self) -> int:
        return sum(out.completion_tokens for out in self.outputs)
