"""xgrammar behind the grammar backends' protocol (backend.py).

xgrammar compiles through the served compile path (grammar_cache/compile.py: our JSON
layouts, the control-character fix, the digit guards); it approximates what a JSON
schema says that it cannot express (``not``, ``uniqueItems``, ``allOf`` ...: it accepts
instances the schema forbids).

State keys (closing.py): ``state_key()`` is its parser state at the last step without
positions (read from its debug text: xgrammar 0.2.8 has no public form), ``step_state()``
that state with positions, ``rule_start()`` the earliest position of an open rule.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from typing import Callable

import torch
import xgrammar as xgr

from core.errors import GrammarError
from core.grammar_spec import GrammarSpec
from grammar_cache.compile import compile_spec
from worker.guided.backend import (XGRAMMAR, CompiledGrammar, EngineRefused, GrammarBackend,
                                   GrammarMatcher)


def as_matcher(m) -> GrammarMatcher:
    """``m`` as a protocol matcher (a bare ``xgr.GrammarMatcher`` is wrapped)."""
    return XGrammarMatcher(m) if isinstance(m, xgr.GrammarMatcher) else m


# fetch(spec, client, cancel) -> xgr.CompiledGrammar: where a worker's xgrammar grammars
# come from (the shared cache actor, or its own compile processes); raises GrammarError
XGrammarFetch = Callable[[GrammarSpec, "str | None", "threading.Event | None"],
                         "xgr.CompiledGrammar"]


class XGrammarBackend(GrammarBackend):
    """xgrammar through the served compile path (grammar_cache/compile.py: our JSON
    layouts, the control-character fix, the digit guards), here or, with ``fetch``,
    wherever the worker gets its grammars (the shared cache, child processes: their
    GrammarError is raised as it is)."""

    name = XGRAMMAR

    def __init__(self, tokenizer_info: "xgr.TokenizerInfo", *, compile_threads: int = 1,
                 fetch: XGrammarFetch | None = None):
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        # the worker's cache is keyed by spec; xgrammar's internal one would duplicate it
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=compile_threads,
                                            cache_enabled=False)
        self._fetch = fetch
        self._batch: dict[int, xgr.BatchGrammarMatcher] = {}  # threads -> batch filler

    @classmethod
    def from_huggingface(cls, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                         compile_threads: int = 1) -> "XGrammarBackend":
        """For a Hugging Face tokenizer, with the model's vocab size and its EOS ids as
        stop tokens."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids)),
                   compile_threads=compile_threads)

    def compile(self, spec: GrammarSpec, *, client: str | None = None,
                cancel: threading.Event | None = None) -> CompiledGrammar:
        start = time.perf_counter()
        if self._fetch is not None:
            artifact = self._fetch(spec, client, cancel)
        else:
            try:
                artifact = self.build(spec)
            except GrammarError as exc:
                raise EngineRefused(XGRAMMAR, str(exc), exc.kind) from None
        return CompiledGrammar(XGRAMMAR, spec, artifact, time.perf_counter() - start,
                               exact=self.exact)

    def build(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        """xgrammar's compile of ``spec`` on this thread; raises GrammarError."""
        return compile_spec(self.compiler, spec)

    def matcher(self, compiled: CompiledGrammar) -> "XGrammarMatcher":
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.artifact))

    def fill_rows(self, bitmask: torch.Tensor, rows: list[int],
                  matchers: list[GrammarMatcher], threads: int = 1) -> None:
        batch = self._batch.get(threads)
        if batch is None:
            batch = self._batch[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        batch.batch_fill_next_token_bitmask([m.inner for m in matchers], bitmask, rows)

    def grammar_bytes(self, compiled: CompiledGrammar) -> int:
        """xgrammar's own estimate of the grammar's memory, where it has one."""
        try:
            return int(compiled.artifact.memory_size_bytes)
        except Exception:  # an older xgrammar, or a stand-in object in tests
            return 1 << 20


class XGrammarMatcher(GrammarMatcher):
    engine = XGRAMMAR

    def __init__(self, inner: "xgr.GrammarMatcher"):
        self.inner = inner

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.inner.fork())

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_continuation(self) -> str:
        return self.inner.find_jump_forward_string()

    def accept_string(self, text: str) -> bool:
        return self.inner.accept_string(text)

    def state_key(self) -> tuple:
        return _without_positions(self._states())

    def step_state(self) -> str:
        return self.inner._debug_print_internal_state().rsplit("Last step", 1)[-1]

    def rule_start(self) -> int:
        return min((int(p) for _, _, _, p, _ in self._states()), default=-1)

    def has_parser_state(self) -> bool:
        return bool(self._states())

    def _states(self) -> tuple:
        return _states_of(self.step_state())


_PARSER_STATE = re.compile(r"rule_id=(\d+), sequence_id=(\d+), element_id=(\d+), "
                           r"rule_start_pos=(-?\d+), sub_element_id=(\d+)")


@functools.lru_cache(maxsize=4096)
def _states_of(text: str) -> tuple:
    """xgrammar's parser states in its debug text (parsed once per distinct text: a
    closing search reads the same few states thousands of times); () if it does not
    parse (another xgrammar)."""
    return tuple(_PARSER_STATE.findall(text))


@functools.lru_cache(maxsize=4096)
def _without_positions(states: tuple) -> tuple:
    """Where in which rules, without positions: only whether a rule began at the root is
    kept of them, or every path would be a state of its own. A repetition such as
    ``[0-9a-f]{8}`` is unrolled in xgrammar, so each place in it stays a state of its own."""
    return tuple((int(r), int(q), int(e), int(s), p == "-1") for r, q, e, p, s in states)
