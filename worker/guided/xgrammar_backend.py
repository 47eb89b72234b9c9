"""xgrammar behind the grammar backends' protocol (backend.py).

xgrammar compiles through the served compile path (grammar_cache/compile.py: our JSON
layouts, the control-character fix, the digit guards); it approximates what a JSON
schema says that it cannot express (``not``, ``uniqueItems``, ``allOf`` ...: it accepts
instances the schema forbids).

State keys (closing.py), from public calls only (no parser internals, no debug text):
``step_state()`` is (whether the grammar may end, the forced continuation, a digest of the
next-token bitmask); ``state_key()`` adds ``probe_runs`` (backend.py): how many of each
probe character (``0``, ``a``, ``A``) may come in a row from here and what is forced after
a bounded run, and, outside free text, how long a run of (separator, probe) pairs may
follow. Why that is enough: the closing search merges states only to stay small, and
every path it finds is replayed on the real matcher, so a key that merges two different
states can make an estimate worse, never an output invalid. What the search needs told
apart is what decides the way out: the next mask and forced text tell structure apart
(inside an object, an array, a string), and the runs tell apart the places of a
repetition whose mask repeats at every place (``[0-9a-f]{12}``, a date's fields), which
xgrammar's parser state once told by its unrolled positions. On a set of schemas and
regexes (uuid, date, nested objects, arrays with minItems, e-mail, ``{n}`` and multi-field
patterns), the dive, the exact search and ``fitting`` found the same lengths as with the
parser-state key read from xgrammar's debug text, and one the old key missed (an array's
``minItems``). ``has_parser_state()`` stays True, as with the parser-state key: equal
keys are taken as one place (``same_place``: another word inside a string leaves the
parser where it was), and a search that finds nothing does not search again by depth (on
the set above, the answers were the same either way). ``rule_start()`` is None (a closing
edge keeps its depth in the search's key, as on llguidance).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import xgrammar as xgr

from core.errors import GrammarError
from core.grammar_spec import GrammarSpec
from grammar_cache.compile import compile_spec
from worker.guided.backend import (XGRAMMAR, CompiledGrammar, EngineRefused, GrammarBackend,
                                   GrammarMatcher, probe_runs)


def as_matcher(m, vocab_size: int | None = None) -> GrammarMatcher:
    """``m`` as a protocol matcher (a bare ``xgr.GrammarMatcher`` is wrapped; its state
    key needs ``vocab_size``)."""
    return XGrammarMatcher(m, vocab_size) if isinstance(m, xgr.GrammarMatcher) else m


# fetch(spec, client, cancel) -> xgr.CompiledGrammar: where a worker's xgrammar grammars
# come from (the shared cache actor, or its own compile processes); raises GrammarError
XGrammarFetch = Callable[[GrammarSpec, "str | None", "threading.Event | None"],
                         "xgr.CompiledGrammar"]


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids) -> "xgr.TokenizerInfo":
    """xgrammar's vocabulary for a Hugging Face tokenizer, its special tokens (``<|endoftext|>``,
    ``<|im_start|>``, ...; the stop ids apart) never text. ``from_huggingface`` gives them
    their names as text, so a JSON string allowed them, while the output's text drops them
    (special tokens are skipped): three ``<|endoftext|>`` met a ``minLength`` of 12 and the
    answer's string was empty. An empty entry is what xgrammar takes as special (never
    allowed), as llguidance already keeps them out of text."""
    stops = [int(t) for t in stop_token_ids]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stops)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {int(i) for i, t in decoder.items() if getattr(t, "special", False)}
    special |= {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    special = {i for i in special if 0 <= i < info.vocab_size} - set(stops)
    vocab = list(info.decoded_vocab)
    if not any(vocab[i] for i in special):
        return info
    for i in special:
        vocab[i] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                             stop_token_ids=stops, add_prefix_space=info.add_prefix_space)


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
        return cls(tokenizer_info(tokenizer, vocab_size, stop_token_ids),
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
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.artifact), self.vocab_size)

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
    """xgrammar's GrammarMatcher. Its state key for the closing search is built from
    public calls only (see the module doc); ``vocab_size``: its bitmask's width."""

    engine = XGRAMMAR

    def __init__(self, inner: "xgr.GrammarMatcher", vocab_size: int | None = None):
        self.inner = inner
        self.vocab_size = vocab_size
        self._key: tuple | None = None  # state_key() of the state as it is (None: unknown)
        self._scratch: torch.Tensor | None = None  # [1, ceil(V / 32)] for step_state

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        self._key = None
        return self.inner.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._key = None
        self.inner.rollback(num_tokens)

    def allows(self, token: int) -> bool:
        if self.inner.is_terminated() or not self.inner.accept_token(token):
            return False
        self.inner.rollback(1)  # (the state, and its key, as they were)
        return True

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.inner.fork(), self.vocab_size)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_continuation(self) -> str:
        return self.inner.find_jump_forward_string()

    def accept_string(self, text: str) -> bool:
        self._key = None
        return self.inner.accept_string(text)

    def state_key(self) -> tuple:
        if self._key is None:  # (a search asks again for the same state: once is enough)
            self._key = self.step_state() + (probe_runs(self),)
        return self._key

    def step_state(self) -> tuple:
        if self.inner.is_terminated():
            return (True, "")
        if self._scratch is None:
            if self.vocab_size is None:
                raise RuntimeError("a wrapped xgrammar matcher needs its vocab size for a "
                                   "state key: as_matcher(m, vocab_size)")
            self._scratch = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.inner.fill_next_token_bitmask(self._scratch, 0)
        return (self.inner.is_completed(), self.inner.find_jump_forward_string(),
                hash(self._scratch.numpy().tobytes()))

    def rule_start(self) -> None:
        return None

    def has_parser_state(self) -> bool:
        return True  # (its key tells places apart: see the module doc)

