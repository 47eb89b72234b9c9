"""WorkerActor: one engine per Ray actor (one GPU each when the cluster has GPUs).

The actor owns an AsyncEngine. ``generate`` is an async generator, so Ray turns a call into
a streaming generator: the caller iterates object refs, one per output chunk, as they are
produced; tokens never pass through anyone else. ``end_sessions`` takes a batch of session
ids (the scheduler's broadcast), ``abort`` stops one request, ``load`` reports what the
scheduler routes on, ``health`` answers when the engine loop is alive.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections import OrderedDict

import ray

from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.sequence import GenerationRequest
from worker.models import loader

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_REPORTED_FAMILIES = 2048  # about the grammars a worker's local LRU keeps


def served_model_name(model: str | None) -> str:
    """The name clients see (``/v1/models``): the default model's, or the last part of a
    path or hub id."""
    if not model:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


@ray.remote(max_restarts=-1)
class WorkerActor:
    def __init__(self, engine_config: dict | None = None, worker_id: str | None = None,
                 scheduler: tuple[str, str] | None = None,
                 grammar_cache: tuple[str, str, dict] | None = None):
        """scheduler: (name, namespace) of the scheduler actor to register with, at start
        and again whenever Ray restarts this actor. grammar_cache: (name, namespace,
        GrammarCacheConfig fields) of the shared cache actor to compile through; None:
        compile in-process."""
        config = EngineConfig(**(engine_config or {}))
        self.worker_id = worker_id or f"worker-{os.getpid()}"
        self.grammar_client = None
        fetch = None
        if grammar_cache is not None:
            fetch = self._cache_fetch(*grammar_cache)
        self.engine = AsyncEngine(LLMEngine(config, grammar_fetch=fetch))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.device = config.device
        self.model_name = served_model_name(config.model)
        engine = self.engine.engine
        self.generation_defaults = (loader.generation_defaults(
            engine.model_dir, is_default_model=config.model is None) if engine.model_dir else {})
        self.started = time.time()
        # grammar families (GrammarSpec.family) this worker compiled or fetched, most recent
        # last: reported in load() for the scheduler's grammar-affinity routing
        self.families: OrderedDict[str, None] = OrderedDict()
        if scheduler is not None:
            try:
                handle = ray.get_actor(scheduler[0], namespace=scheduler[1])
                me = ray.get_runtime_context().current_actor
                handle.register.remote(self.worker_id, me, self.node_id, {
                    "model": self.model_name, "max_model_len": engine.max_model_len,
                    "generation_defaults": self.generation_defaults})
            except ValueError:
                pass  # no scheduler yet: it finds workers by name when it starts

    def _cache_fetch(self, name: str, namespace: str, config: dict):
        """The engine's grammar source: a factory the engine calls with its tokenizer
        info, giving the cache client's fetch (the engine itself knows no Ray)."""
        from grammar_cache.actor import GrammarCacheConfig
        from grammar_cache.client import GrammarCacheClient

        def factory(info):
            self.grammar_client = GrammarCacheClient(
                info, config=GrammarCacheConfig(**config), name=name, namespace=namespace)
            return self.grammar_client.fetch
        return factory

    async def generate(self, request: GenerationRequest):
        """Streams the request's RequestOutput chunks; a bad request raises ValueError
        before the first chunk."""
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"generate takes a GenerationRequest, got {type(request).__name__}")
        tokenizer = self.engine.engine.tokenizer
        if request.grammar is not None:
            self._hold(request.grammar.family)
        async for out in self.engine.generate(request):
            out.worker_id = self.worker_id
            if out.logprobs:  # front ends show tokens as text; only the worker has the vocab
                # a token the engine forced to close the output early has no logprobs
                out.logprob_tokens = [
                    [tokenizer.decode([tid]),
                     [tokenizer.decode([alt]) for alt, _ in (lp[1] if lp else ())]]
                    for tid, lp in zip(out.token_ids, out.logprobs)]
            yield out

    def _hold(self, family: str) -> None:
        self.families[family] = None
        self.families.move_to_end(family)
        while len(self.families) > MAX_REPORTED_FAMILIES:
            self.families.popitem(last=False)

    def end_sessions(self, session_ids: list[str]) -> int:
        for sid in session_ids:
            self.engine.end_session(sid)
        return len(session_ids)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def load(self) -> dict:
        stats = dataclasses.asdict(await self.engine.stats())
        stats.update(worker_id=self.worker_id, model=self.model_name, node_id=self.node_id,
                     device=self.device, host=socket.gethostname(), pid=os.getpid(),
                     max_model_len=self.engine.engine.max_model_len,
                     grammar_families=list(self.families),
                     generation_defaults=self.generation_defaults,
                     uptime_s=time.time() - self.started,
                     grammar_client=(self.grammar_client.stats()
                                     if self.grammar_client is not None else {}))
        return stats

    async def health(self) -> bool:
        await self.engine.stats()  # answered by the engine thread: the loop is alive
        return True
