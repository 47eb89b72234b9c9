"""A request as the engine sees it: its Sequence (what it submitted and the chunks it
streams back are core/request.py)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from core.request import GenerationRequest

if TYPE_CHECKING:
    import torch


class SeqStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its grammar compiles off the step loop
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # running, held out of the batch while its guided part waits
    FINISHED = "finished"


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
        self.grammar = request.grammar  # the grammar asked for (None: unguided)
        self.held_logprobs: list = []  # per output token not yet streamed (None: forced)
        self.detokenizer = detokenizer
        self.resumed_text = ""  # a continuation's output streamed before its worker died
        self.generator = generator
        # prefix caching (worker/engine/block_manager.py): the keys of the table's first
        # blocks (registered or found), the scope its keys are chained in, whether it was
        # looked up once (cached_tokens: prompt tokens its first admission found cached)
        self.block_keys: list[bytes] = []
        self.cache_scope = request.cache_scope
        self.looked_up = False
        self.cached_tokens = 0
        self.arrival = time.monotonic()
        self.finish_reason: str | None = None
        # overlap (engine.py): the token sampled last step, not yet handled: it sits at the
        # end of token_ids so the next forward computes it, and is taken off before its
        # hooks run (None: none)
        self.ahead: int | None = None
        self.draft = 0  # speculation: draft tokens at the end of token_ids (during a forward)
        # its guided part (worker/guided/request.py: its grammar's matcher, a thought, the
        # output policy's state), None: plain. The engine and scheduler only call its hooks
        self.guide = None

    @property
    def remaining_budget(self) -> int:
        """Tokens this request may still generate (max_new_tokens; the context is applied
        by the engine, which knows the model length)."""
        return self.params.max_new_tokens - self.num_output

    # token edits: every change to a sequence's tokens goes through these two ---------------

    def append(self, tokens: list[int], logprobs: list | None = None, *,
               streamed: bool = False) -> None:
        """Appends output ``tokens``: sampled ones with their ``logprobs``, forced ones
        (closing, jump-forward, a cut's closers, a thought's end marker) with None.
        ``streamed``: the caller has them already (a failover's resumed output): they are
        not held for the stream."""
        self.token_ids.extend(tokens)
        if not streamed:
            self.held_logprobs.extend(logprobs if logprobs is not None
                                      else [None] * len(tokens))

    def rollback(self, num_tokens: int) -> None:
        """Removes the newest ``num_tokens`` output tokens (never streamed ones: the
        output policy holds back what a cut may take) and forgets their KV."""
        if not num_tokens:
            return
        assert 0 < num_tokens <= min(self.num_output, len(self.held_logprobs)), num_tokens
        del self.token_ids[len(self.token_ids) - num_tokens:]
        del self.held_logprobs[len(self.held_logprobs) - num_tokens:]
        self.truncate_kv(len(self.token_ids))

    def put_ahead(self, token: int) -> None:
        """Overlap: the sampled ``token`` goes in (its KV is computed by the next forward)
        before its hooks run; ``take_ahead`` takes it off again for them."""
        assert self.ahead is None
        self.token_ids.append(token)
        self.ahead = token

    def take_ahead(self) -> bool:
        """Takes the token ``put_ahead`` added off the end; returns whether a forward has
        computed its KV already (the caller gives that back with ``keep_ahead_kv`` if the
        token is still there after its hooks ran)."""
        assert self.ahead is not None and self.token_ids[-1] == self.ahead
        self.ahead = None
        self.token_ids.pop()
        computed = self.num_computed > len(self.token_ids)
        self.num_computed = min(self.num_computed, len(self.token_ids))
        return computed

    def keep_ahead_kv(self, position: int, token: int) -> None:
        """The token at ``position`` had its KV computed while it was ahead: if nothing
        before it changed and it is still there, that KV counts."""
        if (self.num_computed == position and len(self.token_ids) > position
                and self.token_ids[position] == token):
            self.num_computed = position + 1

    def put_draft(self, tokens: list[int]) -> None:
        """Speculation (engine.py): a draft goes after the pending token so the forward
        computes its KV; ``take_draft`` takes it off before anything is drawn."""
        self.token_ids.extend(tokens)
        self.draft = len(tokens)

    def take_draft(self) -> None:
        """Takes the draft off the end; its KV counts only as ``keep_ahead_kv`` gives it
        back, token by token, while the drawn tokens equal it."""
        del self.token_ids[len(self.token_ids) - self.draft:]
        self.draft = 0
        self.num_computed = min(self.num_computed, len(self.token_ids))

    def replace_released(self, tokens: list[int]) -> None:
        """The newest output token, released to the chunk being built (not sent yet, its KV
        not computed), is replaced by ``tokens`` (a reasoning end marker split from the
        answer text in its token: GuidedRequest._split_marker_token)."""
        assert not self.held_logprobs and self.num_computed < len(self.token_ids)
        self.token_ids[-1:] = tokens

    def stream(self, n: int) -> tuple[list[int], list | None, str]:
        """The ``n`` oldest held output tokens go to the stream: (tokens, their logprobs or
        None when none was asked for and none sampled, their text)."""
        if not n:
            return [], None, ""
        first = len(self.token_ids) - len(self.held_logprobs)  # the oldest held token
        new_tokens = self.token_ids[first:first + n]
        lps = self.release_held(n)
        text = self.detokenizer.add_tokens(new_tokens)
        if self.params.logprobs is None and all(lp is None for lp in lps):
            lps = None
        return new_tokens, lps, text

    def release_held(self, n: int) -> list:
        """The logprobs of the ``n`` oldest held output tokens, which go to the stream now
        (they can no longer be rolled back)."""
        lps = self.held_logprobs[:n]
        del self.held_logprobs[:n]
        return lps

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
