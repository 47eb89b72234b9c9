"""The runtime's configuration: one pydantic model, loadable from YAML, overridable by CLI flags.

    model: null                # default model; or an HF dir, a .gguf file, hf:org/name@rev
    num_workers: 2
    worker: {num_cpus: 1, num_gpus: 0, num_threads: 1}
    engine: {kv_cache_gb: 1.0, max_num_seqs: 64, ...}       # EngineConfig fields
    grammar_cache: {compile_timeout_s: 10, max_bytes: ...}   # GrammarCacheConfig fields
    scheduler: {max_queued_tokens: 65536, ...}               # SchedulerConfig fields
    address: null              # null: a local Ray instance; "auto" or "ray://host:10001"
    control_resources: null    # e.g. {head: 0.01}: custom resources the scheduler and the
                               # grammar cache need, to keep them on some nodes
    serve: {host: 127.0.0.1, port: 8000, ingress: haproxy}

Every section is a pydantic model (extra="forbid", strict), checked once, here, into typed
objects: ``engine`` an EngineConfig (its model, threads, progress and device default from
the top level), ``grammar_cache`` a GrammarCacheConfig, ``scheduler`` a SchedulerConfig.
They are passed on as those objects (pickled through Ray), never as dicts to validate
again. Unknown keys and bad values are errors naming the key (``engine.max_num_seqs: Input
should be a valid integer (got '8')``; ``section.key: unknown key; known keys: ...``),
core.config's one formatter, so a typo never passes silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from core.config import ConfigModel
from grammar_cache.config import GrammarCacheConfig
from scheduler.actor import SchedulerConfig
from worker.engine.config import EngineConfig


class WorkerResources(ConfigModel):
    section = "worker"

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)  # 1 per worker on a GPU cluster: one worker actor per GPU
    num_threads: int | None = 1  # torch CPU threads per worker


class ServeConfig(ConfigModel):
    section = "serve"

    host: str = "127.0.0.1"
    port: int = 8000
    # what takes HTTP in front of the app's replicas on an instance rayguide starts:
    # "haproxy" (each replica serves HTTP itself, HAProxy balances: no Python hop or Ray
    # item per SSE event) or "proxy" (Serve's Python HTTP proxy actor). deploy/service.py
    ingress: Literal["haproxy", "proxy"] = "haproxy"


class ClusterConfig(ConfigModel):
    model: str | None = None
    num_workers: int = Field(2, ge=1)
    address: str | None = None
    worker: WorkerResources = Field(default_factory=WorkerResources)
    # built with the defaults _engine_defaults gives it from the fields above
    engine: EngineConfig = Field(default_factory=EngineConfig)
    grammar_cache: GrammarCacheConfig = Field(default_factory=GrammarCacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    control_resources: dict[str, float] | None = None  # Ray resources of scheduler and cache

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, values):
        """The engine's model, threads, progress bars and device follow the top level
        unless the engine section names them."""
        if not isinstance(values, dict):
            return values  # refused by pydantic, naming what it got
        engine, worker = values.get("engine") or {}, values.get("worker") or {}
        if isinstance(engine, EngineConfig):  # given built: what it was given, and defaults
            engine = {k: getattr(engine, k) for k in engine.model_fields_set}
        if isinstance(worker, WorkerResources):
            worker = worker.model_dump()
        if not isinstance(engine, dict) or not isinstance(worker, dict):
            return values
        engine = dict(engine)
        engine.setdefault("model", values.get("model"))
        engine.setdefault("num_threads", worker.get("num_threads", 1))
        engine.setdefault("progress", False)
        num_gpus = worker.get("num_gpus", 0.0)
        if isinstance(num_gpus, (int, float)) and num_gpus > 0:
            engine.setdefault("device", "cuda")
        return {**values, "engine": engine}

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ClusterConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        odd = [k for k in data if not isinstance(k, str)]
        if odd:
            raise ValueError(f"{path}: keys are names, got {odd[0]!r}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
