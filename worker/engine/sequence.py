"""A request as the engine sees it: its Sequence (what it submitted and the chunks it
streams back are core/request.py)."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from core.request import GenerationRequest

if TYPE_CHECKING:
    import torch


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
        self.compiled = None  # the compiled grammar once ready (stop-string checks)
        self.validation = request.validation
        self.loop_guard = request.loop_guard  # None: the engine's default
        self.ending = None  # OutputState of the output policy, for a guided request
        self.held_logprobs: list = []  # per output token not yet streamed (None: forced)
        self.detokenizer = detokenizer
        self.resumed_text = ""  # a continuation's output streamed before its worker died
        self.generator = generator
        self.cached_tokens = 0
        self.arrival = time.monotonic()
        self.order = next(_seq_counter)
        self.finish_reason: str | None = None
        self.thinking_token_budget = request.thinking_token_budget
        self.thinking = None  # reasoning.Thinking while a reasoning model's thought runs
        self.stop = request.params.stop  # the answer's stop strings (not the thought's)

    @property
    def guided_now(self) -> bool:
        """Whether the grammar applies to this step's token: a guided request, not
        thinking."""
        return self.grammar is not None and (self.thinking is None or self.thinking.done)

    @property
    def thinking_now(self) -> bool:
        return self.thinking is not None and not self.thinking.done

    @property
    def matcher_key(self) -> tuple[str, int]:
        """Key of this request's grammar matcher: the request id plus an engine-wide
        counter, so neither a client-chosen session id nor a reused request id can ever
        make two requests share (or one release the other's) matcher."""
        return (self.request_id, self.order)

    @property
    def remaining_budget(self) -> int:
        """Tokens this request may still generate (max_new_tokens; the context is applied
        by the engine, which knows the model length)."""
        return self.params.max_new_tokens - self.num_output

    def truncate_kv(self, num_tokens: int) -> None:
        """The tokens from ``num_tokens`` on were replaced: their KV is computed again."""
        self.num_computed = min(self.num_computed, num_tokens)

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
