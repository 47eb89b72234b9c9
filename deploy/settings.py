"""The endpoint's settings: one pydantic model, and every limit an HTTP request is checked
against, defined once here (the batch job reads its lines with its own checks).

``AppSettings`` are the app's arguments (``build_app(args)``, a Serve config's ``args``,
``serve run ... key=value`` pairs, which arrive as strings and are converted by pydantic).
Runtime keys (model, num_workers, ... or a ``config`` YAML path) are used only when a
replica has to start the runtime itself. Unknown keys are errors naming the key.
"""

from __future__ import annotations

import os

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError,
                      model_validator)

from cluster.config import ClusterConfig
from core.config import config_error_message
from deploy import tenants


class Limits(BaseModel):
    """What one request may ask for. Each is checked at the edge with a 4xx naming it."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # counted while the body is read
    max_json_depth: int = Field(64, ge=8)  # nesting of the request body
    default_max_tokens: int = Field(512, ge=1)  # as deploy/serve_config.yaml; <= the context
    max_n: int = Field(16, ge=1)
    # choices in one request (prompts x n): each is a runtime request that may run to the
    # context, and the n samples of a prompt share a session, which skips the 429
    max_choices: int = Field(16, ge=1)
    max_messages: int = Field(1024, ge=1)
    # checked before any tokenization (which still runs on the engine thread): about 6x what
    # fits the default model's 8192-token context, so a hostile prompt holds it well under 1 s
    max_prompt_chars: int = Field(200_000, ge=1)
    max_stops: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(64, ge=0)
    max_tools: int = Field(128, ge=0)
    # a session id lives in every worker's load report: short, and plain ASCII (SESSION_ID)
    max_session_id_chars: int = Field(128, ge=8, le=1024)


class AppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key: str | None = None  # default: $RAYGUIDE_API_KEY; None: no auth
    # a file of 'tenant: key' lines (deploy/tenants.py), default $RAYGUIDE_KEYS_FILE: each
    # tenant its own namespace (sessions, grammar ids, compile shares); read where the app
    # is built, into tenant_keys (what the replicas get: SHA-256 digests, no keys)
    keys_file: str | None = None
    tenant_keys: dict[str, str] | None = None  # {sha256 hex of a key: tenant}
    _key_table: dict[str, str] | None = PrivateAttr(default=None)
    # serve on a non-loopback http_options.host with no API key (refused otherwise: anyone
    # who can reach the address could use the endpoint); `rayguide serve --allow-open`
    allow_open: bool = False
    # /metrics, /docs and /openapi.json follow the API key unless this is true
    public_metrics: bool = False
    num_replicas: int = Field(1, ge=1)
    replica_num_cpus: float = Field(0.0, ge=0)
    replica_resources: dict | None = None  # e.g. {"cpu_node": 0.01}: where replicas may run
    max_ongoing_requests: int = Field(256, ge=1)
    # requests each caller (Serve's proxy, a handle) holds back while every replica has
    # max_ongoing_requests: past it a request is answered 429 with Retry-After at once
    # (Serve's backpressure) instead of waiting in an unbounded queue; -1: unbounded
    max_queued_requests: int = Field(512, ge=-1)
    backpressure_retry_after_s: float = Field(1.0, ge=0, allow_inf_nan=False)
    # SSE writes: each costs the replica, Serve's proxy and the client about the same
    # whatever it holds, so a replica's open streams share about stream_events_per_s
    # writes a second: a stream writes what it gained at most every (other open streams /
    # stream_events_per_s) seconds, and never waits longer than stream_interval_ms. A
    # stream's first write and a lone stream's every token go out at once
    stream_interval_ms: float = Field(200.0, ge=0, allow_inf_nan=False)
    stream_events_per_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    # the whole request body must arrive within this (Serve streams it to the replica, so
    # a connection that trickles it holds one of max_ongoing_requests): past it a 408
    body_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # when a non-streamed request with validation "retry" comes back invalid: how many
    # more samples it may take
    max_validation_retries: int = Field(2, ge=0, le=8)
    limits: Limits = Field(default_factory=Limits)
    # how long POST /v1/grammars waits for a compile before it answers 202 with status
    # "compiling" (the compile goes on; GET /v1/grammars/{id} gives the report once done)
    grammar_check_wait_s: float = Field(5.0, ge=0, le=600, allow_inf_nan=False)
    # POST /v1/responses: the conversations previous_response_id continues, kept in each
    # replica's memory (core/response_store.py) for responses_ttl_s, at most
    # responses_max_stored of them and responses_max_stored_chars characters in all (and
    # in the grammar cache actor, by its own bounds, for every replica)
    responses_ttl_s: float = Field(3600.0, gt=0, allow_inf_nan=False)
    responses_max_stored: int = Field(10_000, ge=0)
    responses_max_stored_chars: int = Field(50_000_000, ge=0)
    # how long the edge waits for the scheduler (the model list, a session's end) before it
    # answers 503
    scheduler_timeout_s: float = Field(5.0, gt=0)
    # bumped by `rayguide serve`'s self-healing after it rebuilt the scheduler: new
    # arguments make Serve replace the replicas in a rolling update (the old ones answer
    # meanwhile), where deleting the app left a window of Serve's plain 404s
    runtime_generation: int = Field(0, ge=0)
    start_runtime: bool = True
    config: str | None = None  # a ClusterConfig YAML
    model: str | None = None
    num_workers: int | None = None
    engine: dict | None = None
    worker: dict | None = None
    grammar_cache: dict | None = None
    scheduler: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _limits_at_top(cls, values):
        """Limits may be given flat (``max_n=4``) as well as under ``limits``."""
        if isinstance(values, dict):
            flat = {k: values[k] for k in Limits.model_fields if k in values}
            if flat:
                values = {k: v for k, v in values.items() if k not in flat}
                values["limits"] = {**(values.get("limits") or {}), **flat}
        return values

    @classmethod
    def from_args(cls, args: dict | None) -> "AppSettings":
        """Settings from app arguments; errors name the key. The API key defaults to
        ``$RAYGUIDE_API_KEY``. A bad runtime key fails here, at build time."""
        try:
            settings = cls.model_validate(dict(args or {}))
        except ValidationError as exc:
            raise ValueError("invalid app arguments: " + config_error_message(
                exc, None, cls)) from None
        if settings.api_key is None:
            settings.api_key = os.environ.get("RAYGUIDE_API_KEY") or None
        if settings.keys_file is None:
            settings.keys_file = os.environ.get("RAYGUIDE_KEYS_FILE") or None
        if settings.keys_file:
            settings.tenant_keys = tenants.read_keys_file(settings.keys_file)
        elif settings.tenant_keys is not None:
            try:  # given as is: checked as a keys file would be
                settings.tenant_keys = tenants.parse_keys("\n".join(
                    f"{t}: sha256:{d}" for d, t in settings.tenant_keys.items()),
                    "tenant_keys")
            except ValueError as exc:
                raise ValueError(f"invalid app arguments: {exc}") from None
        settings.key_table()
        settings.cluster_config()
        return settings

    def key_table(self) -> dict[str, str]:
        """``{sha256 hex of a key: tenant}`` for every key the endpoint takes (the keys
        file's and ``api_key``, tenant ``default``); empty: no key, the endpoint is open.
        Built once (the settings are not changed after the app is built)."""
        if self._key_table is None:
            self._key_table = tenants.key_table(self.api_key, self.tenant_keys)
        return self._key_table

    @property
    def keyed(self) -> bool:
        """Whether requests must present a key (an ``api_key`` or a keys file)."""
        return bool(self.api_key or self.tenant_keys)

    def cluster_config(self) -> ClusterConfig:
        overrides = {k: getattr(self, k) for k in
                     ("model", "num_workers", "engine", "worker", "grammar_cache", "scheduler")
                     if getattr(self, k) is not None}
        if self.config:
            return ClusterConfig.from_yaml(self.config, **overrides)
        return ClusterConfig(**overrides)
