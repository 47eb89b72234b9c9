"""What POST /v1/responses answers: the Response object and its event stream, assembled
from the runtime's ``RequestOutput`` chunks of a ``Turn`` (deploy/responses_api.py). No
I/O here (testable without Ray).

    body = response_body(turn, output, model)             # non-streamed
    stream = ResponseStream(turn, model)                  # streamed: the same protocol as
    for event in stream.start(): send(event)              # responses.StreamAssembler, so
    for event in stream.feed(0, chunk): send(event)       # serve_app's one SSE loop runs it
    for event in stream.finish(): send(event)
    stream.final                                          # the finished Response object

The output is a list of items: a ``reasoning`` item (a reasoning model's thought), a
``message`` (its ``output_text``; left out when a tool-calling answer is calls only) and
one ``function_call`` per call. The budget ending an answer is ``status: "incomplete"``,
``incomplete_details.reason: "max_output_tokens"`` (an aborted request: ``"abort"``). The
Response carries the chat route's ``guided`` report (deploy/responses.py guided_report;
its ``tool_calls`` ids are the calls' ``call_id``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from core.request import RequestOutput
from deploy import responses, tools
from deploy.errors import for_kind
from deploy.responses_api import Turn


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(out: RequestOutput) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished output."""
    if out.finish_reason == "error":
        return "failed", None
    if out.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if out.finish_reason == "abort":
        return "incomplete", {"reason": "abort"}
    return "completed", None


def usage(out: RequestOutput) -> dict:
    """The chat usage block in the Responses API's words (``cache_write_tokens``: 0, the
    prefix cache is implicit: OpenAI counts only explicit cache writes there)."""
    chat = responses.usage([out], [0])
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]
                                     ["cached_tokens"], "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": chat.get(
                "completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


def response_object(turn: Turn, model: str, created: int, status: str,
                    output: list[dict] | None = None, **fields: Any) -> dict:
    """The Response object: the request's echoed fields, the output so far, ``fields``
    (usage, guided, error, incomplete_details) over the defaults."""
    body = {"id": turn.id, "object": "response", "created_at": created, "status": status,
            "completed_at": None, "error": None, "incomplete_details": None,
            "model": model, "output": output or [], **turn.echo, "usage": None}
    body.update(fields)
    return body


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or _item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or _item_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    """A chat tool call (tools.parse_tool_calls) as a function_call item."""
    fn = call["function"]
    return {"id": _item_id("fc"), "type": "function_call", "call_id": call["id"],
            "name": fn["name"], "status": status,
            "arguments": fn["arguments"] if arguments is None else arguments}


def _finished(turn: Turn, out: RequestOutput, calls: list[dict]) -> dict:
    """The fields a finished Response has beyond its output."""
    status, incomplete = status_of(out)
    fields: dict[str, Any] = {"status": status, "incomplete_details": incomplete,
                              "completed_at": int(time.time()), "usage": usage(out)}
    if turn.plan.grammar is not None:
        fields["guided"] = responses.guided_report(out, calls, turn.plan)
    return fields


def response_body(turn: Turn, out: RequestOutput, model: str) -> dict:
    """The non-streamed Response of a finished output."""
    status, _ = status_of(out)
    item_status = "completed" if status == "completed" else "incomplete"
    text, calls = (tools.parse_tool_calls(out.text) if turn.plan.tool_mode
                   else (out.text, []))
    output = []
    if out.reasoning_tokens is not None and out.reasoning:
        output.append(reasoning_item(out.reasoning, item_status))
    if text is not None and (text or not calls):
        output.append(message_item(text, item_status))
    output += [call_item(c) for c in calls]
    body = response_object(turn, model, int(time.time()), status, output)
    body.update(_finished(turn, out, calls))
    return body


def conversation(turn: Turn, response: dict) -> list[dict]:
    """The conversation after ``response``, as chat messages: what ``turn`` was sent
    (its instructions aside) and the answer (its text and calls; no thought)."""
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    answer: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        answer["tool_calls"] = calls
    return [*turn.history, *turn.messages, answer]


class ResponseStream:
    """The Responses event stream of one output: ``response.created`` and
    ``response.in_progress``; each item opened (``response.output_item.added``, a message's
    ``response.content_part.added``) when its first text comes, its deltas
    (``response.reasoning_text.delta``, ``response.output_text.delta``) as they come, and
    closed (``.done`` events) when the next begins or the output ends; the function calls,
    held back while they are written (tools.ToolStreamSplitter), each whole at the end
    (``response.function_call_arguments.delta`` and ``.done``); then
    ``response.completed`` (``response.incomplete`` when the budget ended it,
    ``response.failed`` when the request failed after it started). Every event carries
    its ``sequence_number``, from 0."""

    def __init__(self, turn: Turn, model: str):
        self.turn, self.model = turn, model
        self.created = int(time.time())
        self.out = RequestOutput(turn.plan.requests[0].request_id)
        self.splitter = tools.ToolStreamSplitter() if turn.plan.tool_mode else None
        self.items: list[dict] = []
        self.open: str | None = None  # the open item's type: "reasoning" or "message"
        self.held = ""  # under tools: leading whitespace, not a message until text comes
        self.calls: list[dict] = []
        self.seq = 0
        self.remaining = 1
        self.final: dict | None = None  # the finished Response (None: failed or not yet)

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _snapshot(self, status: str, **fields: Any) -> dict:
        return response_object(self.turn, self.model, self.created, status,
                               json.loads(json.dumps(self.items)), **fields)

    def start(self) -> list[str]:
        snapshot = self._snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, i: int, chunk: RequestOutput) -> list[str]:
        """The events for the output's next chunk (``i`` is always 0: one output)."""
        self.out.merge(chunk)
        events = []
        if chunk.reasoning:
            events += self._delta("reasoning", chunk.reasoning)
        text = chunk.text
        if self.splitter is not None:
            text = self.splitter.feed(text)
            if chunk.finished:
                tail, self.calls = self.splitter.finish()
                text += tail
            if self.open != "message":  # whitespace before the calls is no message
                text, self.held = "", self.held + text
                if self.held.strip():
                    text, self.held = self.held, ""
        if text:
            events += self._delta("message", text)
        if chunk.finished:
            self.remaining -= 1
        return events

    def _open(self, kind: str) -> list[str]:
        """Closes the open item and opens a ``kind`` item ("reasoning" or "message")."""
        events = self._close()
        self.open = kind
        make = reasoning_item if kind == "reasoning" else message_item
        item = make("", "in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "content": []} if kind == "message" else item
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=json.loads(json.dumps(added))))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part=_text_part("")))
        return events

    def _delta(self, kind: str, text: str) -> list[str]:
        events = self._open(kind) if self.open != kind else []
        index = len(self.items) - 1
        item = self.items[index]
        item["content"][0]["text"] += text
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, **extra))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        """The .done events of the open item, if any."""
        if self.open is None:
            return []
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if self.open == "reasoning":
            events = [self._event("response.reasoning_text.done", **at, text=part["text"])]
        else:
            events = [self._event("response.output_text.done", **at, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", **at, part=part)]
        self.open = None
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=item)]

    def finish(self) -> list[str]:
        """The closing events, after the output's last chunk."""
        out = self.out
        if out.finish_reason == "error":
            err = for_kind(out.error_kind, out.error or "generation failed",
                           request_id=out.request_id)
            events = self._close("incomplete")
            error = {"code": err.code or err.type, "message": err.message}
            return events + [self._event("response.failed", response=self._snapshot(
                "failed", error=error, completed_at=int(time.time()),
                usage=usage(out)))]
        status, _ = status_of(out)
        events = []
        if self.splitter is None and not any(i["type"] == "message" for i in self.items):
            events += self._open("message")  # an empty answer is an empty message
        events += self._close("completed" if status == "completed" else "incomplete")
        for call in self.calls:
            item = call_item(call, "in_progress", arguments="")
            self.items.append(item)
            index = len(self.items) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=dict(item)))
            arguments = call["function"]["arguments"]
            at = {"item_id": item["id"], "output_index": index}
            events.append(self._event("response.function_call_arguments.delta", **at,
                                      delta=arguments))
            events.append(self._event("response.function_call_arguments.done", **at,
                                      name=item["name"], arguments=arguments))
            item.update(arguments=arguments, status="completed")
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=item))
        self.final = self._snapshot(**_finished(self.turn, out, self.calls))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self.final)]

    @property
    def completion_tokens(self) -> int:
        return self.out.completion_tokens
