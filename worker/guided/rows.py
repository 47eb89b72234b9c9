"""What the guided path needs of the engine, declared here so that it imports nothing of
it (the engine imports the guided path, never the other way: tests/unit/test_layers_unit.py):

- ``GuidedRow``: a request's row as the guided hooks read and edit it: the engine's
  ``Sequence`` (worker/engine/sequence.py) is one.
- ``GuidedConfig``: the settings the guided path reads: the engine's ``EngineConfig``
  (worker/engine/config.py) is one. The path keeps the config it was given and reads it
  when it decides, so an assignment to the engine's config (``engine.config.jump_forward =
  False``) takes effect on the next step, as it always did.

Both are ``typing.Protocol``s: structural, nothing is built or copied for them.
tests/unit/test_guided_rows_unit.py checks that ``Sequence`` and ``EngineConfig`` have every
member named here, and that the guided modules read no other member of a row or a config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from core.grammar_spec import GrammarSpec
    from core.params import SamplingParams
    from grammar_cache.config import GrammarCacheConfig
    from worker.guided.detokenizer import IncrementalDetokenizer
    from worker.guided.reasoning import ReasoningMarkers
    from worker.guided.request import GuidedRequest


@runtime_checkable
class GuidedRow(Protocol):
    """One request's row: its tokens (prompt + output), its request's parameters and
    grammar, its detokenizer, and its guided part (``guide``, set by the guided path)."""

    request_id: str
    params: SamplingParams
    grammar: GrammarSpec | None  # the grammar asked for (None: unguided)
    prompt_ids: list[int]
    token_ids: list[int]  # prompt + output
    held_logprobs: list  # per output token not yet streamed (None: forced)
    detokenizer: IncrementalDetokenizer  # replaced when a thought begins or ends
    resumed_text: str  # a continuation's output streamed before its worker died
    guide: GuidedRequest | None

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def num_output(self) -> int: ...

    def append(self, tokens: list[int], logprobs: list | None = None, *,
               streamed: bool = False) -> None:
        """Appends output tokens: sampled ones with their logprobs, forced ones with None."""

    def rollback(self, num_tokens: int) -> None:
        """Removes the newest ``num_tokens`` output tokens (never streamed ones)."""

    def replace_released(self, tokens: list[int]) -> None:
        """The newest output token, released to the chunk being built, becomes ``tokens``."""

    def stream(self, n: int) -> tuple[list[int], list | None, str]:
        """The ``n`` oldest held output tokens go to the stream: (tokens, logprobs, text)."""


@runtime_checkable
class GuidedConfig(Protocol):
    """The engine settings the guided path reads (their meanings: EngineConfig)."""

    guided: bool
    max_num_seqs: int
    grammar_engine: str
    grammar_cache_bytes: int
    grammar_fill_threads: int
    closing_window: int
    closing_margin: int
    closing_search_ms: float
    closing_probe_ms: float
    schema_closing: bool
    search_step_share: float
    search_step_floor_ms: float
    loop_guard: bool
    reasoning: ReasoningMarkers | bool | None
    thinking_token_budget: int | None
    jump_forward: bool

    def compile_processes(self, limits: GrammarCacheConfig | None) -> int:
        """How many child processes compile grammars (0: a thread)."""
