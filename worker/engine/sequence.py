"""A request as the engine sees it, and the chunks it streams back."""

from __future__ import annotations

import enum
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from grammar_cache.spec import GrammarSpec
from worker.engine.sampling import SamplingParams

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
    # seq_id 0..n-1, so each has its own grammar matcher
    seq_id: int = 0


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
    # who caused the error: "grammar" (the request's grammar is invalid or over the
    # compile limits: the client's to fix), "grammar_wait" (the grammar was not ready in
    # time: a busy or restarting compile service), "internal" (the engine failed),
    # "rejected" (the grammar matcher refused a sampled token)
    error_kind: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the session (no prefill)
    # per new token, when logprobs were asked for: [token text, [top-n alternative texts]]
    # (filled by the worker actor, which has the vocabulary; front ends show text)
    logprob_tokens: list | None = None
    worker_id: str | None = None  # which worker produced it (set by the worker actor)

    def merge(self, chunk: "RequestOutput") -> "RequestOutput":
        """Accumulates a later chunk of the same request into this one (texts, tokens and
        logprobs appended; the final fields taken from the chunk). The one merge: the
        engine's ``generate``, the runtime client and the HTTP front end all use it."""
        self.text += chunk.text
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
                 "completion_tokens", "cached_tokens", "worker_id")


class SeqStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its grammar compiles off the step loop
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """Engine state of one generation: its tokens, how many have KV in the cache
    (``num_computed``), and the KV blocks that hold them."""

    def __init__(self, request: GenerationRequest, prompt_ids: list[int], detokenizer,
                 generator: torch.Generator):
        self.request_id = request.request_id
        self.session_id = request.session_id
        self.seq_id = request.seq_id
        self.params = request.params
        self.prompt_ids = prompt_ids
        self.token_ids = list(prompt_ids)  # prompt + output
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.grammar = request.grammar
        self.grammar_future = None  # Future of the compiled grammar while it compiles
        self.detokenizer = detokenizer
        self.generator = generator
        self.cached_tokens = 0
        self.arrival = time.monotonic()
        self.order = next(_seq_counter)
        self.finish_reason: str | None = None

    @property
    def processor_key(self) -> tuple[str, int]:
        """Key of this generation's grammar matcher: (session, seq_id); a request without
        a session is its own one-shot session."""
        return (self.session_id or self.request_id, self.seq_id)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet computed (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.value}, "
                f"computed={self.num_computed}/{len(self.token_ids)})")
