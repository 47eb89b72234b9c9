"""GrammarCacheConfig: the grammar cache's settings, and the only place its compile limits
are defined. The cache actor, its compile pool, the worker-side client (its fallback pool
and its in-process compiles) all read them from here, so a limit set in the cluster config
(``grammar_cache: {compile_timeout_s: 30}``) holds on every path a grammar can take.

A pydantic model: unknown keys and bad values are refused with a message naming the key.
It crosses Ray as ``config.model_dump()`` and is rebuilt with ``GrammarCacheConfig(**d)``.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class GrammarCacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_bytes: int = Field(512 * 2**20, ge=0, description="LRU budget for compiled grammars")
    error_ttl_s: float = Field(60.0, ge=0, description="grammar errors are remembered this long")
    max_errors: int = Field(4096, ge=0, description="at most this many remembered errors")
    compile_timeout_s: float = Field(10.0, gt=0, description="wall time of one compile")
    # address space of a compile process: xgrammar and its imports take a few hundred MB,
    # and a large schema's serialization alone can take hundreds more
    compile_memory_mb: int = Field(8192, ge=512, description="memory of a compile process")
    compile_processes: int = Field(2, ge=1, le=64, description="the actor's compile processes")
    # send a "compile locally" verdict when loading the serialized grammar takes longer
    # than this factor times compiling it (0: always; inf: never)
    local_verdict_factor: float = Field(1.0, ge=0)
    # how long a client waits for a starting cache actor (its compile processes import
    # xgrammar: seconds, tens of seconds on a loaded machine) before compiling locally
    ready_timeout_s: float = Field(60.0, gt=0)

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ValueError(_explain(exc)) from None

    @field_validator("compile_timeout_s", "error_ttl_s", "ready_timeout_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        # inf would turn a compile limit into no limit at all
        if not math.isfinite(v):
            raise ValueError("must be a finite number of seconds")
        return v


def _explain(exc: ValidationError) -> str:
    """One line per problem, each naming the key: ``grammar_cache.compile_timeout_s: ...``."""
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        if err["type"] == "extra_forbidden":
            known = ", ".join(GrammarCacheConfig.model_fields)
            parts.append(f"grammar_cache.{key}: unknown key; known keys: {known}")
        else:
            parts.append(f"grammar_cache.{key}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
