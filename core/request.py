"""The request a caller submits and the chunks it streams back: the types that cross Ray
from the front ends to the workers and back (no torch, no Ray)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams, SamplingParams

Messages = list[dict[str, Any]]


@dataclass
class GenerationRequest:
    """What a caller submits. ``prompt`` is text, token ids, or chat messages (rendered
    with the model's chat template); ``grammar`` constrains every generated token."""

    prompt: str | list[int] | Messages
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    grammar: GrammarSpec | None = None
    # which sample of the session this is; n > 1 samples are n requests sharing a session,
    # seq_id 0..n-1 (each request has its own grammar matcher, keyed by the request)
    seq_id: int = 0
    # post-validation of a finished JSON output against its full schema: "flag" (validate
    # and report on the final chunk), "retry" (the same here; the caller resamples an
    # invalid non-streamed answer), "off" (do not validate)
    validation: str = "flag"
    # a continuation after a worker died mid-stream: the tokens the request had already
    # generated and streamed. They count as output (and against max_new_tokens), their KV
    # is recomputed and the grammar matcher advanced over them, and they are not emitted
    # again: the caller's stream goes on where it stopped.
    resume_token_ids: list[int] = field(default_factory=list)
    # the text the caller already has of those tokens (its chunks' text, concatenated);
    # None: their decode, less an unfinished last character
    resume_text: str | None = None
    # the loop guard's settings for this request (worker/guided/loop_guard.py); None: the
    # engine's default (on for JSON grammars unless EngineConfig.loop_guard is off)
    loop_guard: LoopGuardParams | None = None
    # reasoning models (worker/guided/reasoning.py): the thought's cap in tokens; None:
    # the engine's default. Ignored by an engine without reasoning markers
    thinking_token_budget: int | None = None
    # who the request is for, as an opaque short string the front end derives (an API
    # key's hash and a user or address, deploy/openai_api.client_identity): the grammar
    # cache shares its compile processes fairly between clients. A fairness hint, never
    # authentication; None: the one shared line
    client: str | None = None
    # whose prompts may share KV with this one (worker/engine/block_manager.py): the
    # front end names the tenant, so one tenant's prompts never hit another's cached
    # prefix (nor learn from cached_tokens what it sent); None: the one shared scope
    cache_scope: str | None = None

    def __post_init__(self):
        if self.validation not in VALIDATION_MODES:
            raise ValueError(f"validation {self.validation!r} is not one of "
                             f"{', '.join(VALIDATION_MODES)}")
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")


VALIDATION_MODES = ("flag", "retry", "off")


@dataclass
class RequestOutput:
    """One streamed chunk. ``text`` and ``token_ids`` are the new part only."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per new token: (logprob, [(token_id, logprob)] top-n), when requested
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # who caused the error (core.errors.ErrorKind; set only with finish "error")
    error_kind: ErrorKind | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was cached (a prefix, a session's turn)
    # per new token, when logprobs were asked for: [token text, [top-n alternative texts]]
    # (filled by the worker actor, which has the vocabulary; front ends show text)
    logprob_tokens: list | None = None
    worker_id: str | None = None  # which worker produced it (set by the worker actor)
    # conformance, on the final chunk of a guided request: the engine steered the output to
    # the grammar's shortest completion because its token budget ran out (finish "length")
    closed_early: bool = False
    # post-validation against the full JSON schema: "valid", "invalid", or None (not
    # validated: not JSON, validation "off", or not finished normally)
    validation: str | None = None
    validation_error: str | None = None
    # schema keywords xgrammar's grammar only approximates (validation is what enforces them)
    approximated: list[str] | None = None
    # values the loop guard ended where they began to repeat (then closed; see
    # worker/guided/loop_guard.py); an output that then ended on its own finishes "stop"
    loop_cuts: int = 0
    # a reasoning model's thought (worker/guided/reasoning.py): the new part of its text
    # (``text`` holds the answer only), and on the final chunk how many output tokens the
    # thought took (its end marker included)
    reasoning: str = ""
    reasoning_tokens: int | None = None
    # the grammar engine that served a guided request ("xgrammar" | "llguidance"), final chunk
    grammar_engine: str | None = None

    def merge(self, chunk: "RequestOutput") -> "RequestOutput":
        """Accumulates a later chunk of the same request into this one (texts, tokens and
        logprobs appended; the final fields taken from the chunk). The one merge: the
        engine's ``generate``, the runtime client and the HTTP front end all use it."""
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs = (self.logprobs or []) + list(chunk.logprobs)
        if chunk.logprob_tokens:
            self.logprob_tokens = (self.logprob_tokens or []) + list(chunk.logprob_tokens)
        for name in _FINAL_FIELDS:
            value = getattr(chunk, name)
            if value is not None:
                setattr(self, name, value)
        return self


# fields a later chunk overrides when merged (the last chunk carries the final values)
_FINAL_FIELDS = ("finished", "finish_reason", "error", "error_kind", "prompt_tokens",
                 "completion_tokens", "cached_tokens", "worker_id", "closed_early",
                 "validation", "validation_error", "approximated", "loop_cuts",
                 "reasoning_tokens", "grammar_engine")
