"""GrammarCacheActor: compiles each grammar once per cluster and hands out the result.

An async Ray actor, named so any process of the cluster finds it (detached when the
runtime runs as a service). Workers register their tokenizer once (xgrammar's TokenizerInfo
serialization, keyed by its fingerprint); ``get(spec, fingerprint)`` returns envelope bytes
(grammar_cache/envelope.py): the compiled grammar or the error. Concurrent asks for one key
wait on the same compile; compiles run in a CompilePool (killable child processes, time and
memory limits); results live in a byte-bounded LRU, errors in a small cache with a shorter
lifetime. When xgrammar's serialization of a grammar loads slower than the grammar
compiles (large token-mask tables), the cache keeps a small "compile locally" verdict
instead: the grammar is proven safe, and workers compile it in-process. Stats are exported
as Ray metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

import ray
from ray.util import metrics

from grammar_cache import envelope
from grammar_cache.compile_pool import CompileLimits, CompilePool
from grammar_cache.spec import GrammarSpec

logger = logging.getLogger(__name__)

ACTOR_NAME = "rayguide_grammar_cache"
NAMESPACE = "rayguide"


@dataclass
class GrammarCacheConfig:
    max_bytes: int = 512 * 2**20  # LRU budget for compiled grammars
    error_ttl_s: float = 60.0  # failures are remembered this long
    max_errors: int = 4096
    compile_timeout_s: float = 10.0
    compile_memory_mb: int = 8192
    compile_processes: int = 2
    # send a "compile locally" verdict when loading the serialized grammar takes longer
    # than this factor times compiling it (0: always; inf: never)
    local_verdict_factor: float = 1.0


class _ByteLRU:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.evictions = 0

    def get(self, key: str) -> bytes | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        if key in self._items:
            self.bytes -= len(self._items.pop(key))
        if len(data) > self.max_bytes:
            return  # larger than the whole budget: serve it, don't keep it
        self._items[key] = data
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old)
            self.evictions += 1

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class GrammarCache:
    """The actor's logic, usable without Ray (the actor class below wraps it)."""

    def __init__(self, config: GrammarCacheConfig | None = None):
        self.config = config = config or GrammarCacheConfig()
        self.pool = CompilePool(CompileLimits(config.compile_timeout_s, config.compile_memory_mb,
                                              config.compile_processes))
        self.tokenizers: dict[str, str] = {}
        self.lru = _ByteLRU(config.max_bytes)
        self.errors: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.inflight: dict[str, asyncio.Future] = {}
        self.compile_times: deque[float] = deque(maxlen=2048)
        self.counts = {"hits": 0, "misses": 0, "compiles": 0, "errors": 0, "timeouts": 0,
                       "joined": 0, "local_verdicts": 0}
        tags = ("kind",)
        self._m_requests = metrics.Counter("rayguide_grammar_cache_requests",
                                           "grammar cache lookups", tag_keys=("result",))
        self._m_compile = metrics.Histogram(
            "rayguide_grammar_compile_seconds", "grammar compile time",
            boundaries=[0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30], tag_keys=tags)
        self._m_bytes = metrics.Gauge("rayguide_grammar_cache_bytes", "bytes of cached grammars")

    def register_tokenizer(self, fingerprint: str, tokenizer_json: str) -> None:
        self.tokenizers[fingerprint] = tokenizer_json

    def has_tokenizer(self, fingerprint: str) -> bool:
        return fingerprint in self.tokenizers

    async def get(self, spec_dict: dict, fingerprint: str) -> bytes:
        """Envelope bytes for the spec; ``b""`` means: register your tokenizer first."""
        if fingerprint not in self.tokenizers:
            return b""
        try:
            spec = GrammarSpec.from_dict(spec_dict)
        except (TypeError, ValueError) as exc:  # size limits and shape checks, again
            return envelope.pack_error(f"invalid grammar spec: {exc}", fingerprint, "")
        key = spec.key(fingerprint)
        data = self.lru.get(key) or self._cached_error(key)
        if data is not None:
            self._count("hits")
            return data
        if key in self.inflight:
            self._count("joined")
            return await asyncio.shield(self.inflight[key])
        self._count("misses")
        fut = asyncio.get_running_loop().create_future()
        self.inflight[key] = fut
        try:
            data = await self._compile(spec, fingerprint, key)
            fut.set_result(data)
            return data
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        finally:
            del self.inflight[key]

    async def _compile(self, spec: GrammarSpec, fingerprint: str, key: str) -> bytes:
        t = time.perf_counter()
        data = await asyncio.to_thread(self.pool.compile, spec, fingerprint,
                                       self.tokenizers[fingerprint], key)
        elapsed = time.perf_counter() - t
        self.counts["compiles"] += 1
        self.compile_times.append(elapsed)
        self._m_compile.observe(elapsed, tags={"kind": spec.kind})
        header = envelope.read_header(data)
        if "error" in header:
            self.counts["errors"] += 1
            if header.get("error_kind") == "timeout":
                self.counts["timeouts"] += 1
            if header.get("error_kind") != "internal":
                self.errors[key] = (data, time.monotonic() + self.config.error_ttl_s)
            while len(self.errors) > self.config.max_errors:
                self.errors.popitem(last=False)
        else:
            if header.get("load_s", 0.0) >= (self.config.local_verdict_factor
                                              * header.get("compile_s", 0.0)):
                # xgrammar's serialization of this grammar loads slower than it compiles:
                # keep (and send) a small verdict instead; workers compile it themselves,
                # knowing it compiles within the limits
                data = envelope.pack_local(fingerprint, key, header["compile_s"])
                self.counts["local_verdicts"] += 1
            self.lru.put(key, data)
            self._m_bytes.set(self.lru.bytes)
        return data

    def _cached_error(self, key: str) -> bytes | None:
        item = self.errors.get(key)
        if item is None:
            return None
        if time.monotonic() > item[1]:
            del self.errors[key]
            return None
        return item[0]

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        self._m_requests.inc(tags={"result": result})

    def stats(self) -> dict:
        times = sorted(self.compile_times)

        def pct(q):
            return times[min(len(times) - 1, int(q * len(times)))] if times else 0.0

        return {**self.counts, "entries": len(self.lru), "bytes": self.lru.bytes,
                "max_bytes": self.config.max_bytes, "evictions": self.lru.evictions,
                "cached_errors": len(self.errors), "tokenizers": len(self.tokenizers),
                "compile_p50_s": pct(0.5), "compile_p99_s": pct(0.99),
                "config": asdict(self.config)}

    def close(self) -> None:
        self.pool.close()


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class GrammarCacheActor:
    def __init__(self, config: dict | None = None):
        self.cache = GrammarCache(GrammarCacheConfig(**(config or {})))
        # not alive (pings wait) until the compile processes are: a restarted cache sends
        # workers to their local compiles instead of holding their requests
        self.cache.pool.wait_ready()

    def register_tokenizer(self, fingerprint: str, tokenizer_json: str) -> None:
        self.cache.register_tokenizer(fingerprint, tokenizer_json)

    async def get(self, spec_dict: dict, fingerprint: str) -> bytes:
        return await self.cache.get(spec_dict, fingerprint)

    def stats(self) -> dict:
        return self.cache.stats()

    def ping(self) -> bool:
        return True


def get_or_create_actor(config: GrammarCacheConfig | None = None, *, detached: bool = False,
                        name: str = ACTOR_NAME, namespace: str = NAMESPACE,
                        resources: dict | None = None):
    """The cluster's grammar cache actor, created on first use (``ray.init`` must have run).
    ``resources``: custom Ray resources it needs (to place it on some nodes)."""
    return GrammarCacheActor.options(
        name=name, namespace=namespace, get_if_exists=True,
        lifetime="detached" if detached else None, resources=resources or {},
    ).remote(asdict(config or GrammarCacheConfig()))
