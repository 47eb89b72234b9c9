"""GrammarCacheConfig: the grammar cache's settings, and the only place its compile limits
are defined. The cache actor, its compile pool, the worker-side client (its fallback pool
and its in-process compiles) all read them from here, so a limit set in the cluster config
(``grammar_cache: {compile_timeout_s: 30}``) holds on every path a grammar can take.

A pydantic model: unknown keys and bad values are refused with a message naming the key.
Built once (``ClusterConfig.grammar_cache``) and passed as the object: it crosses Ray
pickled, never as a dict to validate again. ``ConfigModel``, the base of every layer's
config, and ``config_error_message``, the one formatter of their errors, live here: this
module is a leaf (pydantic only) that every layer may import.
"""

from __future__ import annotations

import math
import os
from contextvars import ContextVar
from pathlib import Path
from typing import ClassVar, Iterable, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# xgrammar compiles a repetition as a counter, not an unrolled rule, so a large count does
# not make a compile slow, but it reads counts as 32-bit integers: a{2147483648} fails
# inside its C++ code and a{4294967297} compiles to another grammar. The largest count in
# the 9,557 schemas of JSONSchemaBench is 256 (patterns) and no minLength / minItems there
# is over 1,000.
MAX_REPETITION = 10_000


# set while a config model is being built: a section built inside another leaves the
# message to the outermost, which names the key with its whole path (engine.max_num_seqs)
_building: ContextVar[bool] = ContextVar("rayguide_config_building", default=False)


class ConfigModel(BaseModel):
    """The base of every layer's config: unknown keys are refused (extra="forbid"), values
    are strict (a YAML ``loop_guard: "yes"`` is an error, not True), and a failed build
    raises ValueError with config_error_message's text, keys prefixed with ``section``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    section: ClassVar[str | None] = None

    def __init__(self, **values):
        if _building.get():  # inside another config: its errors carry our path
            super().__init__(**values)
            return
        token = _building.set(True)
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ValueError(config_error_message(exc, self.section, type(self))) from None
        finally:
            _building.reset(token)

    def __setattr__(self, name, value):
        try:  # checked where the model says validate_assignment
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ValueError(config_error_message(exc, self.section, type(self))) from None


class GrammarCacheConfig(ConfigModel):
    # not strict (numbers given as strings are read as numbers), but its switches are
    model_config = ConfigDict(strict=False, validate_assignment=True)
    section = "grammar_cache"

    max_bytes: int = Field(512 * 2**20, ge=0, description="LRU budget for compiled grammars")
    error_ttl_s: float = Field(60.0, ge=0, description="grammar errors are remembered this long")
    max_errors: int = Field(4096, ge=0, description="at most this many remembered errors")
    compile_timeout_s: float = Field(10.0, gt=0,
                                     description="CPU time of one compile (wall up to 3x it)")
    # address space of a compile process: xgrammar and its imports take a few hundred MB,
    # and a large schema's serialization alone can take hundreds more
    compile_memory_mb: int = Field(8192, ge=512, description="memory of a compile process")
    compile_processes: int = Field(2, ge=1, le=64, description="the actor's compile processes")
    # the largest {n} / {n,m} of a regex, a schema's pattern or an EBNF / Lark grammar, and
    # the largest minLength / minItems / minProperties / minContains of a schema: a grammar
    # over it is refused (grammar_too_large) before anything is compiled or queued
    max_repetition: int = Field(MAX_REPETITION, ge=1, le=2**31 - 1)
    # compiles that may wait for a free compile process in the actor; past it a new
    # grammar is refused at once (overloaded: retry later), not queued until its request
    # times out. With compiles of 1-3 s and 2 processes, 32 waiting is about half a minute
    max_queued_compiles: int = Field(32, ge=1)
    # send a "compile locally" verdict when loading the serialized grammar takes longer
    # than this factor times compiling it (0: always; inf: never)
    local_verdict_factor: float = Field(1.0, ge=0)
    # a grammar's first compile in the cluster runs in the worker that asked for it (a lease
    # from the actor: the others wait for it; the worker publishes the result in the
    # background), so the request waits for the compile alone, not for the child process's
    # serialization and the worker's load of it. Off by default: where the workers' cores
    # are all busy, the publications are late and whoever waits for them waits longer
    # (bench/grammar_cache.py; README). Only for grammars that look ordinary:
    # sources up to worker_compile_max_source_bytes with no number of worker_compile_max_digits
    # digits or more (long length bounds and repetitions are what make compiles slow and
    # big); the others compile in the actor's killable child processes, as do all when off
    worker_first_compile: bool = Field(False, strict=True)
    worker_compile_max_source_bytes: int = Field(32 * 1024, ge=0)
    worker_compile_max_digits: int = Field(4, ge=1)
    # ... and the worker publishes xgrammar's serialization only for grammars up to this
    # size in memory (its JSON is 3-35x that, and writing it takes about 15x the JSON's
    # size for a moment); bigger ones are published as compile-locally verdicts
    worker_publish_max_grammar_bytes: int = Field(5 * 2**20, ge=0)
    # how long a client waits for a starting cache actor (its compile processes import
    # xgrammar: seconds, tens of seconds on a loaded machine) before compiling locally
    ready_timeout_s: float = Field(60.0, gt=0)
    # workers compile through the shared actor; False: each worker compiles by itself (no
    # actor, no replication: the baseline bench/grammar_cache.py compares against)
    shared: bool = Field(True, strict=True)
    # warm replication: a grammar requested this many times anywhere in the cluster (or
    # listed in hot_specs) is fetched by every worker of the model in the background
    replicate: bool = Field(True, strict=True)
    replicate_after_requests: int = Field(2, ge=1)
    replicate_interval_s: float = Field(1.0, gt=0, le=60)
    # a worker stops prefetching while its local grammar LRU holds more than this; what
    # its requests ask for is still fetched (the LRU's own bound is the engine's
    # grammar_cache_bytes)
    replicate_max_bytes: int = Field(256 * 2**20, ge=0)
    # the cache actor remembers the spec and request count of at most this many grammars
    # (least recently asked for forgotten first), and forgets one nobody asked for in
    # hot_idle_s; a forgotten grammar leaves the hot list (hot_specs never do)
    max_tracked_grammars: int = Field(10_000, ge=1)
    hot_idle_s: float = Field(3600.0, gt=0)
    # grammars every worker warms at start, as GrammarSpec fields: {"kind": "json_schema",
    # "source": {...schema...}} (a JSON source may be given as an object)
    hot_specs: list[dict] = Field(default_factory=list)
    # the disk tier: compiled grammars (envelopes) persist per node under disk_dir (default
    # $RAYGUIDE_CACHE_DIR/grammars, else ~/.cache/rayguide/grammars), keyed by xgrammar
    # version, tokenizer fingerprint and spec key; oldest evicted past disk_max_bytes
    # ($RAYGUIDE_GRAMMAR_CACHE_DIR, when set, is the folder itself; RAYGUIDE_GRAMMAR_DISK=0
    # makes off the default, for processes that must start cold: tests of the actor path)
    disk: bool = Field(default_factory=lambda: os.environ.get("RAYGUIDE_GRAMMAR_DISK") != "0",
                       strict=True)
    disk_dir: str | None = None
    disk_max_bytes: int = Field(2 * 2**30, ge=0)

    @field_validator("hot_specs")
    @classmethod
    def _specs(cls, v: list[dict]) -> list[dict]:
        return [hot_spec(d).to_dict() for d in v]  # canonical, and checked now

    def hot_grammar_specs(self) -> list:
        from grammar_cache.spec import GrammarSpec
        return [GrammarSpec.from_dict(d) for d in self.hot_specs]

    def disk_path(self) -> Path:
        if self.disk_dir:
            return Path(self.disk_dir).expanduser()
        if os.environ.get("RAYGUIDE_GRAMMAR_CACHE_DIR"):  # tests: a folder of their own
            return Path(os.environ["RAYGUIDE_GRAMMAR_CACHE_DIR"]).expanduser()
        root = os.environ.get("RAYGUIDE_CACHE_DIR")
        return (Path(root) if root else Path.home() / ".cache" / "rayguide") / "grammars"

    @field_validator("compile_timeout_s", "error_ttl_s", "ready_timeout_s", "hot_idle_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        # inf would turn a compile limit into no limit at all
        if not math.isfinite(v):
            raise ValueError("must be a finite number of seconds")
        return v


def hot_spec(d: dict):
    """A GrammarSpec from a hot_specs entry; a JSON source may be an object or a list."""
    import json

    from grammar_cache.spec import GrammarSpec
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError(f"each hot_specs entry is a mapping of GrammarSpec fields with a "
                         f"'kind' (e.g. {{kind: json_schema, source: {{...}}}}), got {d!r}")
    d = dict(d)
    if not isinstance(d.get("source", ""), str):
        d["source"] = json.dumps(d["source"], ensure_ascii=False, separators=(",", ":"))
    try:
        return GrammarSpec.from_dict(d)
    except TypeError as exc:
        raise ValueError(f"hot_specs entry {d!r}: {exc}") from None


def config_error_message(exc: ValidationError, section: str | None,
                         known: Iterable[str] | type[BaseModel], most: int = 5) -> str:
    """The one "message naming the key" of every config (the runtime's sections, the
    grammar cache's, the engine's, the app's arguments): one part per problem (the first
    ``most``), each naming the key as ``section.key``: ``unknown key; known keys: a, b``
    for a key the model does not have, else pydantic's reason and the value given (cut
    short). ``known``: the model class (its nested models' keys are listed too) or the
    top level's key names."""
    parts = []
    for err in exc.errors()[:most]:
        key = ".".join(str(p) for p in (section, *err["loc"]) if p is not None) or "(config)"
        if err["type"] == "extra_forbidden":
            parts.append(unknown_key_message(key, _known_at(known, err["loc"][:-1])))
        else:
            reason = err["msg"].removeprefix("Value error, ")
            parts.append(f"{key}: {reason} (got {_short(err.get('input'))})")
    return "; ".join(parts)


def unknown_key_message(key: str, known: Iterable[str] | None) -> str:
    """``key: unknown key; known keys: a, b``: the words for a key nobody defined, shared
    by the configs and the places that check a plain dict (SamplingParams.from_dict)."""
    return f"{key}: unknown key" + (f"; known keys: {', '.join(sorted(known))}"
                                    if known is not None else "")


def _known_at(known, loc: tuple) -> list[str] | None:
    """The key names of the model at ``loc`` (a path of field names from ``known``), or
    None where it is not a model we can name (a list item, a dict)."""
    if not isinstance(known, type):
        return (list(known) or None) if not loc else None
    model = known
    for name in loc:
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            return None
        model = next((t for t in (field.annotation, *get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:
            return None
    return list(model.model_fields)


def _short(value, limit: int = 80) -> str:
    """A value as the message shows it: its repr, cut to ``limit`` characters (a request's
    prompt or a hot spec's schema may be long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
