"""Engine configuration: one pydantic model that checks itself. Unknown keys and bad
values are errors naming the key (``engine.max_num_seqs: Input should be a valid integer``);
values are strict (a YAML ``loop_guard: "yes"`` is an error, not True); an assignment
(``engine.config.jump_forward = False``) is checked too."""

from __future__ import annotations

import os
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from core.config import ConfigModel
from grammar_cache.config import GrammarCacheConfig

GRAMMAR_ENGINES = ("auto", "xgrammar", "llguidance")
# dtype names; torch is imported only where a name is resolved (front ends build this
# config and must not import torch)
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "int8")


class EngineConfig(ConfigModel):
    model_config = ConfigDict(validate_assignment=True)
    section = "engine"

    model: str | None = None  # None: the default model (see worker/models/loader.py)
    device: str = "cpu"
    # a torch.dtype or its name; None: fp32 on CPU, bf16 on CUDA; "int8": int8 weights
    dtype: Any = None
    block_size: int = Field(16, ge=1)  # tokens per KV block
    kv_cache_gb: float = Field(1.0, gt=0)  # KV cache size when num_kv_blocks is not given
    num_kv_blocks: int | None = Field(None, ge=1)
    # automatic prefix caching (worker/engine/block_manager.py): a prompt's full KV blocks
    # stay cached for later prompts that start with them; off: only sessions reuse KV
    prefix_caching: bool = True
    max_num_seqs: int = Field(64, ge=1)  # sequences running at once
    # tokens per step (bounds a prefill chunk); None: 512 on the CPU, 8192 on a GPU (64
    # prompts of 128 tokens reach their first token in one step)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = 8192  # capped by the model's max_position_embeddings
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    seed: int | None = None  # seeds the per-request generators of unseeded requests
    progress: bool = True  # progress bars for conversion and loading
    guided: bool = True  # grammar-constrained decoding
    # the grammar engine of a spec that asks for none ("auto" in the spec): "auto" (per
    # grammar: llguidance for a JSON grammar it compiles, xgrammar elsewhere; see
    # worker/guided/backend.py), "xgrammar" or "llguidance".
    # $RAYGUIDE_GRAMMAR_ENGINE sets the default (what runs every engine test on one engine)
    grammar_engine: str = Field(
        default_factory=lambda: os.environ.get("RAYGUIDE_GRAMMAR_ENGINE", "auto"),
        validate_default=True)
    # a request whose grammar is not ready this long after it arrived fails (a backstop
    # above the compile limit: a compile over its limit fails sooner, as a bad grammar)
    grammar_timeout_s: float = 60.0
    # where an xgrammar compile of an engine without the shared grammar cache runs: in N
    # killable child processes under the grammar cache's limits (compile_timeout_s,
    # compile_memory_mb), or with 0 on a thread of this process (xgrammar cannot stop it
    # there). None: child processes (grammar_cache.compile_processes of them) in a worker,
    # which serves requests; a thread in an engine used directly (`rayguide generate`,
    # the benches, tests: a child's imports take seconds)
    grammar_compile_processes: int | None = Field(None, ge=0)
    # threads that fill the guided rows' grammar masks each step, while the forward runs
    # (worker/guided/mask_stage.py: xgrammar's batch fill, llguidance's parallel fill; both
    # release the GIL). 1: a mask costs a few microseconds a row, and measured at batch 64
    # and 256 (docs/benchmarks.md, issue 56) two threads took longer than one
    grammar_fill_threads: int = Field(1, ge=1)
    # the engine's local LRU of compiled grammars, bounded by their size in memory
    grammar_cache_bytes: int = Field(1 << 30, ge=0)
    # budget-aware closing: once a guided request has at most this many tokens of budget
    # left, the engine measures the grammar's shortest completion every step and steers
    # to it when the budget gets that tight (0 turns closing off)
    closing_window: int = Field(48, ge=0)
    # tokens kept in hand above the shortest completion when deciding to close: one
    # sampled token can open up to a few brackets at once
    closing_margin: int = Field(3, ge=0)
    # cap of one shortest-completion search, in CPU time (a search cut short is retried a
    # few tokens later, see closing.py)
    closing_search_ms: float = 100.0
    # cap of the closing probe (CPU time): one greedy dive per request (and one more after
    # a loop cut) when its budget's end nears, given ten times the search's nodes. A large
    # grammar (hundreds of properties on llguidance) needs a few hundred ms for a dive that
    # closing_search_ms cuts short on every step; the path the probe finds is replayed
    # (microseconds) until it is emitted, so the output closes even where no search fits
    # in closing_search_ms. At most twice a request; it costs that request's time only
    closing_probe_ms: float = Field(2000.0, ge=0)
    # JSON grammars close from their schema (worker/guided/json_closing.py): the completion
    # is read off the schema as the output goes, with no search on the engine thread; the
    # searches above serve the other grammars, and a JSON state the schema closer does not
    # know (a partial string under a pattern). False: every grammar searches (the benches'
    # other side)
    schema_closing: bool = True
    # the searches' share of the engine thread (worker/guided/search_slices.py): all of a
    # step's closing searches together take at most this share of the engine's own recent
    # step time, and at least search_step_floor_ms; a search not done by then goes on in
    # the next steps while its request waits (parked), never the batch
    search_step_share: float = Field(0.5, gt=0)
    search_step_floor_ms: float = Field(5.0, gt=0)
    # the loop guard (loop_guard.py): a JSON value that repeats itself is ended where the
    # repetition began; on for every guided JSON request unless a request turns it off
    loop_guard: bool = True
    # reasoning models (reasoning.py): the markers around a thought, {start: "<think>",
    # end: "</think>"} (true: those), false: no thinking phase, None: those markers when
    # the model's chat template writes them. With markers, every request thinks freely
    # first; its grammar applies from the token after the end marker
    reasoning: Any = None
    # the thought's default cap in tokens when a request names no thinking_token_budget
    # (None: only max_tokens, less the room the answer needs, bounds it)
    thinking_token_budget: int | None = Field(None, ge=0)
    # jump-forward decoding (jump_forward.py): text a guided row's grammar forces is
    # appended without sampling and computed in the row's next forward. On by default;
    # $RAYGUIDE_JUMP_FORWARD=0 sets the default off (what runs the suite without it)
    # CUDA graphs for decode steps on a GPU (worker/engine/cuda_graphs.py): None or true: on
    # where the model takes the device kernels on CUDA; false: every step eager
    cuda_graphs: bool | None = None
    # overlap the host's work with the device's (engine.py, "Overlap"): a step launches
    # its forward first, then handles the tokens the step before sampled while the device
    # computes. None: on where the device is CUDA; true also runs it on the CPU (tests)
    overlap: bool | None = None
    # warm up at start (LLMEngine.warm_up): throwaway prompts of the shapes that pick the
    # device kernels' compiled variants (block tables 1, 3 and 16+ blocks wide, a long
    # prefill, decode steps), so no user's first request pays for a Triton compile. None:
    # on where the device is CUDA; true also runs it on the CPU (tests)
    warmup: bool | None = None
    jump_forward: bool = Field(
        default_factory=lambda: os.environ.get("RAYGUIDE_JUMP_FORWARD", "1") == "1")
    # speculative decoding (worker/engine/speculative.py): a decoding row's draft from its
    # own prompt and output, cut where its grammar refuses, computed in its forward and
    # kept as far as the tokens drawn equal it (outputs unchanged). The default for
    # requests that do not say (their ``speculative``); $RAYGUIDE_SPECULATIVE=0 sets it
    # off. Not in the overlapped step
    speculative: bool = Field(
        default_factory=lambda: os.environ.get("RAYGUIDE_SPECULATIVE", "1") == "1")
    # the longest draft (a row's adapts below it; with up to 8 forced tokens before it,
    # a CUDA graph's row of 16 holds it)
    speculative_tokens: int = Field(8, ge=1, le=8)

    @property
    def step_token_budget(self) -> int:
        """``max_num_batched_tokens``, or its default for ``device``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 512 if self.device == "cpu" else 8192

    def compile_processes(self, limits: "GrammarCacheConfig | None") -> int:
        """``grammar_compile_processes``, or its default: ``limits.compile_processes``
        where the engine was given compile limits (a worker), else 0."""
        if self.grammar_compile_processes is not None:
            return self.grammar_compile_processes
        return limits.compile_processes if limits is not None else 0

    @field_validator("model", mode="before")
    @classmethod
    def _path(cls, v):
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        if v is None:
            return None
        if isinstance(v, str) and v in DTYPE_NAMES:
            import torch

            # "int8": weight-only int8 Linear layers on CPU, fp32 compute (worker/models/quant.py)
            return {"float32": torch.float32, "fp32": torch.float32,
                    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                    "float16": torch.float16, "fp16": torch.float16, "int8": torch.int8}[v]
        if type(v).__module__ == "torch" and type(v).__name__ == "dtype":
            return v
        raise ValueError(f"must be one of {', '.join(DTYPE_NAMES)} (or a torch.dtype)")

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v):
        from worker.guided.reasoning import ReasoningMarkers

        return ReasoningMarkers.parse(v)

    @field_validator("grammar_engine")
    @classmethod
    def _grammar_engine(cls, v: str) -> str:
        if v not in GRAMMAR_ENGINES:
            raise ValueError(f"must be one of {', '.join(GRAMMAR_ENGINES)}")
        return v
