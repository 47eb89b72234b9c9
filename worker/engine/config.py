"""Engine configuration: one dataclass that checks itself."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a dtype name is resolved (not by front ends)
    import torch


GRAMMAR_ENGINES = ("auto", "xgrammar", "llguidance")


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (see worker/models/loader.py)
    device: str = "cpu"
    dtype: torch.dtype | None = None  # None: fp32 on CPU, bf16 on CUDA; "int8": int8 weights
    block_size: int = 16  # tokens per KV block
    kv_cache_gb: float = 1.0  # KV cache size when num_kv_blocks is not given
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunk size bound)
    max_model_len: int | None = 8192  # capped by the model's max_position_embeddings
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    seed: int | None = None  # seeds the per-request generators of unseeded requests
    progress: bool = True  # progress bars for conversion and loading
    guided: bool = True  # grammar-constrained decoding
    # the grammar engine of a spec that asks for none ("auto" in the spec): "auto" (per
    # grammar: llguidance for a JSON grammar it compiles, xgrammar elsewhere; see
    # worker/engine/grammar_engines.py), "xgrammar" or "llguidance".
    # $RAYGUIDE_GRAMMAR_ENGINE sets the default (what runs every engine test on one engine)
    grammar_engine: str = field(
        default_factory=lambda: os.environ.get("RAYGUIDE_GRAMMAR_ENGINE", "auto"))
    # a request whose grammar is not ready this long after it arrived fails (a backstop
    # above the compile limit: a compile over its limit fails sooner, as a bad grammar)
    grammar_timeout_s: float = 60.0
    # the engine's local LRU of compiled grammars, bounded by their size in memory
    grammar_cache_bytes: int = 1 << 30
    # budget-aware closing: once a guided request has at most this many tokens of budget
    # left, the engine measures the grammar's shortest completion every step and steers
    # to it when the budget gets that tight (0 turns closing off)
    closing_window: int = 48
    # tokens kept in hand above the shortest completion when deciding to close: one
    # sampled token can open up to a few brackets at once
    closing_margin: int = 3
    # wall-time cap of one shortest-completion search (it runs on the engine thread; a
    # search cut short is retried a few tokens later, see closing.py)
    closing_search_ms: float = 100.0
    # the loop guard (loop_guard.py): a JSON value that repeats itself is ended where the
    # repetition began; on for every guided JSON request unless a request turns it off
    loop_guard: bool = True
    # reasoning models (reasoning.py): the markers around a thought, {start: "<think>",
    # end: "</think>"} (true: those), false: no thinking phase, None: those markers when
    # the model's chat template writes them. With markers, every request thinks freely
    # first; its grammar applies from the token after the end marker
    reasoning: object = None
    # the thought's default cap in tokens when a request names no thinking_token_budget
    # (None: only max_tokens, less the room the answer needs, bounds it)
    thinking_token_budget: int | None = None
    # jump-forward decoding (jump_forward.py): text a guided row's grammar forces is
    # appended without sampling and computed in the row's next forward. Off by default
    # until the whole test suite has run with it on (it was measured, not yet run suite-wide);
    # $RAYGUIDE_JUMP_FORWARD=1 sets the default (what runs the suite with it on)
    jump_forward: bool = field(
        default_factory=lambda: os.environ.get("RAYGUIDE_JUMP_FORWARD", "0") == "1")

    def __post_init__(self):
        if isinstance(self.dtype, str):
            import torch

            names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                     "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                     # weight-only int8 Linear layers on CPU, fp32 compute (worker/models/quant.py)
                     "int8": torch.int8}
            if self.dtype not in names:
                raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(names)}")
            self.dtype = names[self.dtype]
        from worker.engine.reasoning import ReasoningMarkers

        self.reasoning = ReasoningMarkers.parse(self.reasoning)
        if self.thinking_token_budget is not None and (
                isinstance(self.thinking_token_budget, bool)
                or not isinstance(self.thinking_token_budget, int)
                or self.thinking_token_budget < 0):
            raise ValueError("thinking_token_budget must be an integer >= 0, got "
                             f"{self.thinking_token_budget!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.grammar_engine not in GRAMMAR_ENGINES:
            raise ValueError(f"grammar_engine {self.grammar_engine!r} is not one of "
                             f"{', '.join(GRAMMAR_ENGINES)}")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")
        if self.closing_window < 0 or self.closing_margin < 0:
            raise ValueError("closing_window and closing_margin must be >= 0")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
