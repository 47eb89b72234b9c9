"""The runtime's configuration: one dataclass, loadable from YAML, overridable by CLI flags.

    model: null                # default model; or an HF dir, a .gguf file, hf:org/name@rev
    num_workers: 2
    worker: {num_cpus: 1, num_gpus: 0, num_threads: 1}
    engine: {kv_cache_gb: 1.0, max_num_seqs: 64, ...}       # EngineConfig fields
    grammar_cache: {compile_timeout_s: 10, max_bytes: ...}   # GrammarCacheConfig fields
    scheduler: {max_queued_tokens: 65536, ...}               # SchedulerConfig fields
    address: null              # null: a local Ray instance; "auto" or "ray://host:10001"
    control_resources: null    # e.g. {head: 0.01}: custom resources the scheduler and the
                               # grammar cache need, to keep them on some nodes
    serve: {host: 127.0.0.1, port: 8000}

Unknown keys are errors that name the key (``section.key: unknown key; known keys: ...``,
grammar_cache.config's one formatter), so a typo never passes silently. The sections are
checked once, here; the built grammar cache and scheduler configs are kept
(``grammar_cache_config``, ``scheduler_config``) and passed on as objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from grammar_cache.actor import GrammarCacheConfig
from grammar_cache.config import config_error_message
from scheduler.actor import SchedulerConfig
from worker.engine.config import EngineConfig


@dataclass
class WorkerResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0  # 1 per worker on a GPU cluster: one worker actor per GPU
    num_threads: int | None = 1  # torch CPU threads per worker


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000


@dataclass
class ClusterConfig:
    model: str | None = None
    num_workers: int = 2
    address: str | None = None
    worker: WorkerResources = field(default_factory=WorkerResources)
    engine: dict = field(default_factory=dict)
    grammar_cache: dict = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)
    serve: ServeConfig = field(default_factory=ServeConfig)
    control_resources: dict | None = None  # custom Ray resources of scheduler and cache
    # built from the sections above in __post_init__ (again by dataclasses.replace)
    grammar_cache_config: GrammarCacheConfig = field(init=False, repr=False, compare=False)
    scheduler_config: SchedulerConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if isinstance(self.worker, dict):
            self.worker = _build(WorkerResources, self.worker, "worker")
        if isinstance(self.serve, dict):
            self.serve = _build(ServeConfig, self.serve, "serve")
        # check the nested sections now, not when an actor starts on some node
        self.engine_config()
        self.grammar_cache_config = _build(GrammarCacheConfig, self.grammar_cache,
                                           "grammar_cache")
        self.scheduler_config = _build(SchedulerConfig, self.scheduler, "scheduler")

    def engine_config(self) -> EngineConfig:
        values = dict(self.engine)
        values.setdefault("model", self.model)
        values.setdefault("num_threads", self.worker.num_threads)
        values.setdefault("progress", False)
        if self.worker.num_gpus > 0:
            values.setdefault("device", "cuda")
        return _build(EngineConfig, values, "engine")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ClusterConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return _build(cls, data, None, where=str(path))


def _build(cls, values: dict, section: str | None, where: str | None = None):
    """One validation pattern for every section: unknown keys are errors naming the key
    (dataclass sections: config_error_message, as pydantic sections' own check does with
    extra="forbid"). ``section``: the key's prefix (None at the top level); ``where``:
    what the message starts with (the YAML file)."""
    if not isinstance(values, dict):
        raise ValueError(f"{section or where} must be a mapping, got {type(values).__name__}")
    if hasattr(cls, "model_validate"):
        return cls(**values)  # a pydantic section: its own errors name the key
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [key for key in values if key not in known]
    if unknown:
        exc = ValidationError.from_exception_data(cls.__name__, [
            {"type": "extra_forbidden", "loc": (key,), "input": values[key]}
            for key in unknown])
        message = config_error_message(exc, section, known)
        raise ValueError(f"{where}: {message}" if where else message)
    return cls(**values)
