"""The worker-side client of the grammar cache actor.

``fetch(spec)`` returns a compiled grammar, blocking; the engine's GuidedDecodingManager
calls it on its compile thread pool (never on the step loop) and keeps the deserialized
results in its own local LRU. On a miss the client asks the actor; if the actor cannot be
reached (not started, dead, restarting, too slow) or its envelope does not match this
process (versions, tokenizer), it compiles locally in its own CompilePool with the same
limits, logs that once, and tries the actor again on a miss after ``retry_after_s`` (5 s;
in between, misses compile locally at once instead of waiting on a dead or restarting
actor), so a request never fails because the cache is down. A "compile locally" verdict (see actor.py) is compiled
in-process: the actor has proven it safe, and it loads slower than it compiles.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import ray
import xgrammar as xgr

from grammar_cache import envelope
from grammar_cache.actor import ACTOR_NAME, NAMESPACE
from grammar_cache.compile import GrammarError, compile_spec, tokenizer_fingerprint
from grammar_cache.compile_pool import CompileLimits, CompilePool
from grammar_cache.spec import GrammarSpec

logger = logging.getLogger(__name__)


class GrammarCacheClient:
    def __init__(self, tokenizer_info: "xgr.TokenizerInfo", *, name: str = ACTOR_NAME,
                 namespace: str = NAMESPACE, limits: CompileLimits | None = None,
                 rpc_timeout_s: float | None = None, ping_timeout_s: float = 2.0):
        self.info = tokenizer_info
        self.fingerprint = tokenizer_fingerprint(tokenizer_info)
        self._tokenizer_json = tokenizer_info.serialize_json()
        self.name, self.namespace = name, namespace
        self.limits = limits or CompileLimits()
        # an actor compile can take up to its own limit; allow for transfer on top, and
        # keep room for a local compile within the engine's wait limit if the actor is slow
        self.rpc_timeout_s = rpc_timeout_s or self.limits.timeout_s + 15.0
        self.ping_timeout_s = ping_timeout_s
        self._actor = None
        self._registered = False
        self._local: CompilePool | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._down_until = 0.0  # after a failure, skip the actor until then
        self.retry_after_s = 5.0
        self._in_process = None
        self.counts = {"actor": 0, "verdict": 0, "local": 0}
        # the fallback's compile process starts now, in the background: started only when
        # the actor fails, it would make every request wait for its imports (seconds,
        # tens of seconds on a loaded machine) exactly when the cache is down
        threading.Thread(target=self._warm_local, name="grammar-fallback-warmup",
                         daemon=True).start()

    def fetch(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        """The compiled grammar for ``spec``; raises GrammarError for a bad grammar."""
        key = spec.key(self.fingerprint)
        data = self._from_actor(spec)
        if data is not None:
            try:
                compiled = envelope.unpack(data, self.info, self.fingerprint, key)
                self.counts["actor"] += 1
                return compiled
            except envelope.CompileLocally:
                # proven to compile within the limits, and cheaper to compile than to load
                self.counts["verdict"] += 1
                return compile_spec(self._compiler(), spec)
            except envelope.EnvelopeMismatch as exc:
                self._warn(f"grammar cache envelope does not match this worker ({exc})")
        self.counts["local"] += 1
        data = self._local_pool().compile(spec, self.fingerprint, self._tokenizer_json, key)
        return envelope.unpack(data, self.info, self.fingerprint, key)

    def _from_actor(self, spec: GrammarSpec) -> bytes | None:
        if time.monotonic() < self._down_until:
            return None  # it failed a moment ago: compile locally without waiting on it
        try:
            actor = self._handle()
            # a dead or restarting actor must not hold this compile for the long timeout
            ray.get(actor.ping.remote(), timeout=self.ping_timeout_s)
            for _ in range(2):
                if not self._registered:
                    ray.get(actor.register_tokenizer.remote(self.fingerprint,
                                                            self._tokenizer_json),
                            timeout=self.rpc_timeout_s)
                    self._registered = True
                data = ray.get(actor.get.remote(spec.to_dict(), self.fingerprint),
                               timeout=self.rpc_timeout_s)
                if data:
                    return data
                self._registered = False  # a restarted actor forgot our tokenizer
            return None
        except GrammarError:
            raise
        except Exception as exc:  # not found, dead, restarting, timed out
            self._actor = None
            self._registered = False
            self._down_until = time.monotonic() + self.retry_after_s
            self._warn(f"grammar cache actor unavailable ({type(exc).__name__}: {exc}); "
                       "compiling locally")
            return None

    def _handle(self):
        if self._actor is None:
            if not ray.is_initialized():
                raise RuntimeError("Ray is not initialized")
            self._actor = ray.get_actor(self.name, namespace=self.namespace)
            self._registered = False
            if self._warned:
                logger.info("grammar cache actor reachable again")
                self._warned = False
        return self._actor

    def _compiler(self):
        with self._lock:
            if self._in_process is None:
                self._in_process = xgr.GrammarCompiler(self.info, max_threads=1,
                                                       cache_enabled=False)
            return self._in_process

    def _local_pool(self) -> CompilePool:
        with self._lock:
            if self._local is None:  # one process: it only serves while the actor is down
                self._local = CompilePool(dataclasses.replace(self.limits, processes=1))
            return self._local

    def _warm_local(self) -> None:
        try:
            self._local_pool().wait_ready()
        except Exception:  # it will be started again on first use
            logger.exception("starting the fallback compile process")

    def _warn(self, message: str) -> None:
        if not self._warned:
            logger.warning(message)
            self._warned = True

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
