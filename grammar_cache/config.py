"""GrammarCacheConfig: the grammar cache's settings, and the only place its compile limits
are defined. The cache actor, its compile pool, the worker-side client (its fallback pool
and its in-process compiles) all read them from here, so a limit set in the cluster config
(``grammar_cache: {compile_timeout_s: 30}``) holds on every path a grammar can take.

A pydantic model: unknown keys and bad values are refused with a message naming the key.
Built once (``ClusterConfig.grammar_cache``) and passed as the object: it crosses Ray
pickled, never as a dict to validate again. Its base, ``ConfigModel``, is core/config.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pydantic import ConfigDict, Field, field_validator

from core.config import ConfigModel

# xgrammar compiles a repetition as a counter, not an unrolled rule, so a large count does
# not make a compile slow, but it reads counts as 32-bit integers: a{2147483648} fails
# inside its C++ code and a{4294967297} compiles to another grammar. The largest count in
# the 9,557 schemas of JSONSchemaBench is 256 (patterns) and no minLength / minItems there
# is over 1,000.
MAX_REPETITION = 10_000


class GrammarCacheConfig(ConfigModel):
    # not strict (numbers given as strings are read as numbers), but its switches are
    model_config = ConfigDict(strict=False, validate_assignment=True)
    section = "grammar_cache"

    max_bytes: int = Field(512 * 2**20, ge=0, description="LRU budget for compiled grammars")
    # an hour: a grammar's own errors (invalid, too large, over the compile limits, which
    # count CPU time) are the grammar's; at 60 s a schema checked (POST /v1/grammars) and
    # requested a minute later was compiled again, and on a busy machine that compile
    # outlasted the request's grammar wait: 503 where the check had said 422
    error_ttl_s: float = Field(3600.0, ge=0,
                               description="grammar errors are remembered this long")
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
    # a client's grammar checks (POST /v1/grammars) may keep a worker compiling for at most
    # this share of one core on average, in bursts of up to check_compile_burst_s seconds;
    # past it a check that needs a compile there is refused (overloaded: 429) until its
    # debt drains (worker/guided/compile_meter.py). A check answered from a kept report or a
    # compiled grammar costs nothing and is never refused
    check_compile_share: float = Field(0.1, gt=0, le=64, allow_inf_nan=False)
    check_compile_burst_s: float = Field(1.0, ge=0, allow_inf_nan=False)
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
    # the Responses API's stored conversations that every front end finds
    # (core/response_store.py: per tenant, the heaviest tenant's oldest pushed out first;
    # a front end's own responses_ttl_s applies too, the shorter wins)
    responses_ttl_s: float = Field(3600.0, gt=0, allow_inf_nan=False)
    responses_max_stored: int = Field(10_000, ge=0)
    responses_max_stored_chars: int = Field(50_000_000, ge=0)
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
        from core.grammar_spec import GrammarSpec
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

    from core.grammar_spec import GrammarSpec
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
