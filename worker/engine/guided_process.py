"""GuidedDecodingManager: the engine's one handle on xgrammar.

It owns the tokenizer info (built with the *model's* vocab size, so padded embedding rows
and ids the tokenizer lacks can never be sampled under a grammar, and with the model's
real EOS ids as stop tokens), compiles grammars off the step loop with a cache of
compiled grammars and of failures, owns the batch token bitmask (allocated once at the
engine's max batch size), and keeps one matcher per ``(session_id, seq_id)``.

Where a compile happens is pluggable: by default in-process on the manager's thread pool;
with ``fetch`` (the cluster's GrammarCacheClient.fetch) through the shared cache actor. The
manager's cache then serves as the worker's local LRU of deserialized grammars.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import xgrammar as xgr

from grammar_cache.compile import GrammarError, compile_spec, tokenizer_fingerprint
from grammar_cache.spec import GrammarSpec
from worker.engine.bitmask import apply_token_bitmask_inplace

logger = logging.getLogger(__name__)

ProcessorKey = tuple[str, int]  # (session_id, seq_id)


class GuidedDecodingManager:
    def __init__(self, tokenizer_info: "xgr.TokenizerInfo", *, max_batch_size: int = 64,
                 compile_threads: int = 1, fill_threads: int = 1, cache_size: int = 512,
                 error_ttl_s: float = 60.0,
                 fetch: Callable[[GrammarSpec], "xgr.CompiledGrammar"] | None = None):
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.fingerprint = tokenizer_fingerprint(tokenizer_info)
        # our own cache below is keyed by spec; xgrammar's internal one would duplicate it
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=compile_threads,
                                            cache_enabled=False)
        # [max_batch_size, ceil(vocab / 32)] int32, reused every step
        self.bitmask = xgr.allocate_token_bitmask(max_batch_size, self.vocab_size)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=fill_threads)
        self.processors: dict[ProcessorKey, xgr.GrammarMatcher] = {}
        self._grammars: OrderedDict[str, object] = OrderedDict()  # key -> compiled | error
        self._error_time: dict[str, float] = {}
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        # with a remote fetch (the cache actor) the threads mostly wait: several, so one
        # slow answer does not hold every other new grammar behind it
        self._pool = ThreadPoolExecutor(max_workers=compile_threads if fetch is None else 4,
                                        thread_name_prefix="grammar-compile")
        self._fetch = fetch or (lambda spec: compile_spec(self.compiler, spec))
        self.cache_size = cache_size
        self.error_ttl_s = error_ttl_s
        self.stats = {"hits": 0, "misses": 0, "compiles": 0, "errors": 0}

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                       cache_actor: str | None = None, **kwargs):
        """``cache_actor``: name of the cluster's grammar cache actor to compile through."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        if cache_actor is not None:
            from grammar_cache.client import GrammarCacheClient

            kwargs["fetch"] = GrammarCacheClient(info, name=cache_actor).fetch
        return cls(info, **kwargs)

    # grammars ---------------------------------------------------------------------------

    def get_grammar(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (or of the GrammarError). Cached grammars and
        cached failures resolve at once; concurrent asks for one spec share one compile."""
        key = spec.key(self.fingerprint)
        with self._lock:
            cached = self._grammars.get(key)
            if cached is not None and not self._expired(key):
                self._grammars.move_to_end(key)
                self.stats["hits"] += 1
                fut: Future = Future()
                if isinstance(cached, GrammarError):
                    fut.set_exception(cached)
                else:
                    fut.set_result(cached)
                return fut
            if key in self._inflight:
                self.stats["hits"] += 1
                return self._inflight[key]
            self.stats["misses"] += 1
            fut = self._pool.submit(self._compile, key, spec)
            self._inflight[key] = fut
            return fut

    def _compile(self, key: str, spec: GrammarSpec):
        t = time.perf_counter()
        try:
            result = self._fetch(spec)
        except GrammarError as exc:
            result = exc
        except BaseException:
            # not the grammar's fault (the compile service failed): fail this wait, and let
            # the next request for the spec try again instead of joining a dead future
            with self._lock:
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self._inflight.pop(key, None)
            self.stats["compiles"] += 1
            self._grammars[key] = result
            if isinstance(result, GrammarError):
                self.stats["errors"] += 1
                self._error_time[key] = time.monotonic()
            while len(self._grammars) > self.cache_size:
                old, _ = self._grammars.popitem(last=False)
                self._error_time.pop(old, None)
        logger.debug("compiled %s in %.1f ms", spec.describe(), 1e3 * (time.perf_counter() - t))
        if isinstance(result, GrammarError):
            raise result
        return result

    def _expired(self, key: str) -> bool:
        t = self._error_time.get(key)
        return t is not None and time.monotonic() - t > self.error_ttl_s

    # processors -------------------------------------------------------------------------

    def add_processor(self, key: ProcessorKey, compiled: "xgr.CompiledGrammar"):
        """A fresh matcher for one generation (replacing any earlier one under that key)."""
        matcher = xgr.GrammarMatcher(compiled)
        self.processors[key] = matcher
        return matcher

    def remove_processor(self, key: ProcessorKey) -> None:
        self.processors.pop(key, None)

    def remove_sessions(self, session_ids) -> int:
        ids = set(session_ids)
        doomed = [k for k in self.processors if k[0] in ids]
        for k in doomed:
            del self.processors[k]
        return len(doomed)

    @property
    def num_processors(self) -> int:
        return len(self.processors)

    # masks ------------------------------------------------------------------------------

    def fill_bitmask(self, rows: list[int], matchers: list) -> None:
        """Fills bitmask row ``rows[i]`` for ``matchers[i]``; every other row up to the
        largest one is reset to all-allowed, so unguided rows stay untouched by apply."""
        n = max(rows) + 1
        if len(rows) != n:
            self.bitmask[:n].fill_(-1)
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, self.bitmask, rows)

    def apply_bitmask(self, logits: torch.Tensor, num_rows: int) -> None:
        """Masks logits[:num_rows] in place with bitmask[:num_rows]."""
        apply_token_bitmask_inplace(logits[:num_rows], self.bitmask[:num_rows])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
