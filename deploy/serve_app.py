"""The OpenAI-compatible HTTP endpoint: a FastAPI app inside a Ray Serve deployment.

Each replica is a thin front end. It checks the request (deploy/openai_api.py turns it into
runtime requests), asks the scheduler for a worker and streams tokens straight from that
worker (cluster/client.py); it holds no model and no KV. Several replicas can run side by
side: sessions stay sticky because the scheduler, not the replica, owns the routing table.

    serve run deploy.serve_app:app                         # defaults; starts the runtime
    serve run deploy.serve_app:build_app num_workers=2 api_key=secret
    serve deploy deploy/serve_config.yaml                  # the same through a config file
    rayguide serve                                         # runtime + app in one command

A replica that finds no runtime on the cluster starts one (detached, so the replicas share
it; ``rayguide down`` removes it), unless ``start_runtime`` is false.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and
# Serve ships this class by value, where string annotations would not resolve
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayTaskError

from cluster import launch
from cluster.client import RuntimeClient
from cluster.config import ClusterConfig
from deploy import openai_api as api
from deploy.openai_api import APIError, Choice, Plan
from scheduler.routing import NoWorkers, Overloaded

logger = logging.getLogger(__name__)


@dataclass
class AppSettings:
    """The app's arguments (``build_app(args)``, Serve config ``args``, ``serve run``
    key=value pairs). Runtime keys (model, num_workers, ... or a ``config`` YAML path) are
    used only when a replica has to start the runtime itself."""
    api_key: str | None = None  # default: $RAYGUIDE_API_KEY; None: no auth
    num_replicas: int = 1
    replica_num_cpus: float = 0.0
    replica_resources: dict | None = None  # e.g. {"cpu_node": 0.01}: where replicas may run
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 512
    max_n: int = 16
    max_ongoing_requests: int = 256
    start_runtime: bool = True
    config: str | None = None  # a ClusterConfig YAML
    model: str | None = None
    num_workers: int | None = None
    address: str | None = None
    engine: dict | None = None
    worker: dict | None = None
    grammar_cache: dict | None = None
    scheduler: dict | None = None

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "AppSettings":
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown app argument(s) {unknown}; known: {sorted(known)}")
        for f in dataclasses.fields(cls):  # `serve run ... key=value` passes strings
            value = args.get(f.name)
            if isinstance(value, str) and f.type in (int, int | None):
                args[f.name] = int(value)
            elif isinstance(value, str) and f.type is float:
                args[f.name] = float(value)
            elif isinstance(value, str) and f.type is bool:
                args[f.name] = value.lower() in ("1", "true", "yes")
        settings = cls(**args)
        if settings.api_key is None:
            settings.api_key = os.environ.get("RAYGUIDE_API_KEY") or None
        settings.cluster_config()  # a bad runtime key fails at build time, naming it
        return settings

    def cluster_config(self) -> ClusterConfig:
        overrides = {k: getattr(self, k) for k in
                     ("model", "num_workers", "engine", "worker", "grammar_cache", "scheduler")
                     if getattr(self, k) is not None}
        if self.config:
            return ClusterConfig.from_yaml(self.config, **overrides)
        return ClusterConfig(**overrides)


fastapi_app = FastAPI(title="rayguide", version="0.1.0",
                      description="Guided (structured) generation, OpenAI-compatible.")


@fastapi_app.exception_handler(APIError)
async def _api_error(_request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError):
    return JSONResponse(api.bad_request(f"invalid request: {exc.errors()[:3]}").body(), 400)


@fastapi_app.exception_handler(404)
async def _not_found(request: Request, _exc):
    return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}",
                                 code="not_found").body(), 404)


@fastapi_app.exception_handler(405)
async def _not_allowed(request: Request, _exc):
    return JSONResponse(APIError(405, f"{request.method} is not allowed on "
                                      f"{request.url.path}", code="method_not_allowed").body(),
                        405)


def _api_error(exc: BaseException) -> APIError:
    """What a client is told when the runtime refuses or fails a request."""
    if isinstance(exc, APIError):
        return exc
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, Overloaded):
        return APIError(429, f"the runtime is overloaded: {cause}; retry later",
                        type_="rate_limit_error", code="overloaded")
    if isinstance(cause, NoWorkers):
        return APIError(503, f"no worker is alive: {cause}", type_="server_error",
                        code="no_workers")
    if isinstance(cause, ValueError):
        return api.bad_request(str(cause).strip().splitlines()[-1] if str(cause) else
                               "invalid request")
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    logger.error("request failed: %r", exc)
    return APIError(503, f"the runtime could not serve this request: "
                         f"{type(cause).__name__}: {str(cause)[:300]}; retry",
                    type_="server_error", code="unavailable")


def _chunk_error(chunk: dict) -> APIError:
    kind, msg = chunk.get("error_kind"), chunk.get("error") or "generation failed"
    if kind == "grammar":
        return APIError(400, f"invalid grammar: {msg}", code="invalid_grammar")
    if kind in ("worker_died", "grammar_wait"):
        return APIError(503, msg, type_="server_error", code=kind)
    return APIError(500, msg, type_="server_error", code=kind or "generation_failed")


class _Metrics:
    """Request counters and latencies, exported through Ray's metrics agent (Prometheus
    format on each node's metrics port) and, together with the runtime's gauges, as
    Prometheus text on GET /metrics."""

    def __init__(self):
        from ray.util import metrics
        self.requests = metrics.Counter("rayguide_http_requests",
                                        "HTTP requests by route and status",
                                        tag_keys=("route", "status"))
        self.latency = metrics.Histogram("rayguide_http_request_seconds",
                                         "time to the response (to the stream start when "
                                         "streaming)", boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2,
                                                                   5, 10, 30, 60],
                                         tag_keys=("route",))
        self.first_token = metrics.Histogram("rayguide_time_to_first_token_seconds",
                                             "streamed requests: time to the first token",
                                             boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10])
        self.generated = metrics.Counter("rayguide_generated_tokens",
                                         "completion tokens sent to clients")
        self.local = {"requests": {}, "tokens": 0}

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.inc(1, {"route": route, "status": str(status)})
        self.latency.observe(seconds, {"route": route})
        key = (route, status)
        self.local["requests"][key] = self.local["requests"].get(key, 0) + 1

    def ttft(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def tokens(self, n: int) -> None:
        self.generated.inc(n)
        self.local["tokens"] += n

    def render(self, status: dict | None) -> str:
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
        reg = CollectorRegistry()
        req = Counter("rayguide_replica_http_requests", "this replica's HTTP requests",
                      ("route", "status"), registry=reg)
        for (route, code), n in self.local["requests"].items():
            req.labels(route, str(code)).inc(n)
        Counter("rayguide_replica_generated_tokens", "this replica's completion tokens",
                registry=reg).inc(self.local["tokens"])
        up = Gauge("rayguide_up", "1 when the scheduler answers", registry=reg)
        up.set(1 if status else 0)
        if status:
            Gauge("rayguide_sessions", "sessions pinned by the scheduler",
                  registry=reg).set(status["sessions"])
            Gauge("rayguide_workers", "workers registered", registry=reg).set(
                len(status["workers"]))
            per = {name: Gauge(f"rayguide_worker_{name}", f"per worker: {name}",
                               ("worker",), registry=reg)
                   for name in ("running", "waiting", "free_blocks", "total_blocks",
                                "live_sessions", "live_processors")}
            for wid, load in status["workers"].items():
                for name, gauge in per.items():
                    if isinstance(load.get(name), (int, float)):
                        gauge.labels(wid).set(load[name])
            for name in ("routes", "rejected", "sessions_ended", "broadcast_messages",
                         "workers_dropped"):
                Gauge(f"rayguide_scheduler_{name}", f"scheduler: {name} so far",
                      registry=reg).set(status.get(name, 0))
        return generate_latest(reg).decode()


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10)
@serve.ingress(fastapi_app)
class OpenAIServer:
    def __init__(self, settings: dict):
        self.settings = AppSettings(**settings)
        self.limits = api.Limits(self.settings.default_max_tokens, self.settings.max_n)
        try:
            launch.handles()
        except ValueError:
            if not self.settings.start_runtime:
                raise
            logger.info("no rayguide runtime on this cluster; starting one")
            launch.up(self.settings.cluster_config(), detached=True)
        self.runtime = RuntimeClient()
        self._models: list[str] = []
        self._metrics = _Metrics()

    # endpoints --------------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self):
        try:
            stats = await self.runtime.scheduler.stats.remote()
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)[:200]}, 503)
        n = len(stats["workers"])
        return JSONResponse({"status": "ok" if n else "no_workers", "workers": n},
                            200 if n else 503)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list",
                "data": [{"id": m, "object": "model", "created": 0, "owned_by": "rayguide"}
                         for m in await self._served_models()]}

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, api.ChatCompletionRequest, api.plan_chat)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, api.CompletionRequest, api.plan_completion)

    @fastapi_app.delete("/v1/sessions/{session_id}")
    async def end_session(self, session_id: str, request: Request):
        self._auth(request)
        await self.runtime.end_session(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @fastapi_app.get("/metrics")
    async def metrics(self):
        try:
            status = await self._runtime_status()
        except Exception:
            status = None
        return PlainTextResponse(self._metrics.render(status),
                                 media_type="text/plain; version=0.0.4")

    # the request path -------------------------------------------------------------------

    async def _serve(self, request: Request, model_cls, planner):
        started = time.monotonic()
        route = request.url.path
        try:
            self._auth(request)
            body = await self._body(request)
            plan = planner(api.parse_request(model_cls, body), self.limits)
            await self._check_model(plan.model)
            if plan.stream:
                response = await self._stream(plan, started)
            else:
                response = await self._complete(plan)
            self._metrics.request(route, 200, time.monotonic() - started)
            return response
        except APIError as exc:
            self._metrics.request(route, exc.status, time.monotonic() - started)
            raise

    def _auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes, over the limit of {limit}",
                           code="request_too_large")
        raw = await request.body()
        if len(raw) > limit:
            raise APIError(413, f"request body is {len(raw)} bytes, over the limit of {limit}",
                           code="request_too_large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise api.bad_request(f"the request body is not valid JSON: {exc}") from None

    async def _served_models(self) -> list[str]:
        if not self._models:
            stats = await self.runtime.scheduler.stats.remote()
            self._models = sorted({w.get("model") for w in stats["workers"].values()
                                   if w.get("model")})
        return self._models

    async def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        served = await self._served_models()
        if served and model not in served:
            self._models = []  # the runtime may have been restarted with another model
            served = await self._served_models()
            if served and model not in served:
                raise APIError(404, f"model {model!r} is not served here; use one of "
                                    f"{served}", param="model", code="model_not_found")

    async def _open(self, request: dict) -> tuple[AsyncIterator[dict], dict]:
        """Starts one runtime request; returns its stream and its first chunk. Errors that
        come before any token (bad request, bad grammar, overload) raise APIError, so a
        stream never starts with a 200 that then fails."""
        stream = self.runtime.generate(request)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the worker ended the request without output",
                           type_="server_error") from None
        except BaseException as exc:
            await stream.aclose()
            raise _api_error(exc) from None
        if first.get("finished") and first.get("finish_reason") == "error" \
                and not first.get("token_ids"):
            await stream.aclose()
            raise _chunk_error(first)
        return stream, first

    async def _open_all(self, plan: Plan) -> list[tuple[AsyncIterator[dict], dict]]:
        tasks = [asyncio.ensure_future(self._open(r)) for r in plan.requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            opened = await asyncio.gather(*tasks, return_exceptions=True)
            for item in opened:
                if isinstance(item, tuple):
                    await item[0].aclose()
            await self._end_temp_session(plan)
            raise

    async def _end_temp_session(self, plan: Plan) -> None:
        if plan.temp_session is not None:
            try:
                await self.runtime.end_session(plan.temp_session)
            except Exception:
                logger.exception("ending session %s", plan.temp_session)

    async def _complete(self, plan: Plan) -> dict:
        opened = await self._open_all(plan)
        choices = [Choice() for _ in opened]

        async def drain(i: int) -> None:
            stream, first = opened[i]
            choices[i].add(first)
            async for chunk in stream:
                choices[i].add(chunk)

        try:
            await asyncio.gather(*(drain(i) for i in range(len(opened))))
        finally:  # also when the client went away and Serve cancelled us
            for stream, _ in opened:
                await stream.aclose()
            await self._end_temp_session(plan)
        for c in choices:
            if c.finish_reason == "error":
                raise _chunk_error({"error": c.error, "error_kind": c.error_kind})
        self._metrics.tokens(sum(c.completion_tokens for c in choices))
        return self._response(plan, choices)

    def _response(self, plan: Plan, choices: list[Choice]) -> dict:
        model = plan.model or (self._models[0] if self._models else "rayguide")
        out = []
        for i, c in enumerate(choices):
            if plan.kind == "chat":
                content, calls = (api.parse_tool_calls(c.text) if plan.tool_mode
                                  else (c.text, []))
                message = {"role": "assistant", "content": content, "refusal": None}
                if calls:
                    message["tool_calls"] = calls
                out.append({"index": i, "message": message,
                            "logprobs": (api.chat_logprobs(c.logprobs, c.logprob_tokens)
                                         if plan.logprobs else None),
                            "finish_reason": api.finish_reason(c.finish_reason, bool(calls))})
            else:
                out.append({"index": i, "text": c.text,
                            "logprobs": (api.completion_logprobs(c.logprobs, c.logprob_tokens)
                                         if plan.logprobs else None),
                            "finish_reason": api.finish_reason(c.finish_reason, False)})
        return {"id": api.new_id(plan.kind),
                "object": "chat.completion" if plan.kind == "chat" else "text_completion",
                "created": api.now(), "model": model, "choices": out,
                "usage": api.usage(choices, plan.prompt_index)}

    async def _stream(self, plan: Plan, started: float) -> StreamingResponse:
        opened = await self._open_all(plan)
        return StreamingResponse(self._sse(plan, opened, started),
                                 media_type="text/event-stream")

    async def _sse(self, plan: Plan, opened: list, started: float) -> AsyncIterator[str]:
        """Server-sent events: one chunk per runtime chunk of any choice, then an optional
        usage chunk, then [DONE]. Samples interleave as they are produced."""
        rid, created = api.new_id(plan.kind), api.now()
        model = plan.model or (self._models[0] if self._models else "rayguide")
        obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
        choices = [Choice() for _ in opened]
        splitters = [api.ToolStreamSplitter() if plan.tool_mode else None for _ in opened]
        offsets = [0] * len(opened)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            stream, first = opened[i]
            try:
                await queue.put((i, first))
                async for chunk in stream:
                    await queue.put((i, chunk))
            except BaseException as exc:  # surfaces as an error chunk, never a hang
                if not isinstance(exc, asyncio.CancelledError):
                    await queue.put((i, {"finished": True, "finish_reason": "error",
                                         "error": _api_error(exc).message}))
                raise
            finally:
                await stream.aclose()

        def event(choice: dict) -> str:
            data = {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice]}
            if plan.include_usage:
                data["usage"] = None
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(opened))]
        first_token_seen = False
        try:
            if plan.kind == "chat":
                for i in range(len(opened)):
                    yield event({"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
            remaining = len(opened)
            while remaining:
                i, chunk = await queue.get()
                c = choices[i]
                c.add(chunk)
                if not first_token_seen and chunk.get("token_ids"):
                    first_token_seen = True
                    self._metrics.ttft(time.monotonic() - started)
                text = chunk.get("text", "")
                n_lp = len(chunk.get("logprobs") or [])
                lp_slice = (c.logprobs[len(c.logprobs) - n_lp:],
                            c.logprob_tokens[len(c.logprob_tokens) - n_lp:])
                finished = chunk.get("finished", False)
                if finished:
                    remaining -= 1
                if plan.kind == "chat":
                    delta: dict[str, Any] = {}
                    calls: list = []
                    if splitters[i] is not None:
                        text = splitters[i].feed(text)
                        if finished:
                            tail, calls = splitters[i].finish()
                            text += tail
                    if text:
                        delta["content"] = text
                    if calls:
                        delta["tool_calls"] = [{"index": k, **call}
                                               for k, call in enumerate(calls)]
                    lps = (api.chat_logprobs(*lp_slice) if plan.logprobs and n_lp else None)
                    reason = None
                    if finished:
                        reason = ("error" if c.finish_reason == "error"
                                  else api.finish_reason(c.finish_reason, bool(calls)))
                    if delta or lps or reason:
                        yield event({"index": i, "delta": delta, "logprobs": lps,
                                     "finish_reason": reason})
                else:
                    lps = (api.completion_logprobs(*lp_slice, offset=offsets[i])
                           if plan.logprobs and n_lp else None)
                    offsets[i] += len(text)
                    reason = None
                    if finished:
                        reason = ("error" if c.finish_reason == "error"
                                  else api.finish_reason(c.finish_reason, False))
                    if text or lps or reason:
                        yield event({"index": i, "text": text, "logprobs": lps,
                                     "finish_reason": reason})
                if finished and c.finish_reason == "error":
                    err = _chunk_error({"error": c.error, "error_kind": c.error_kind})
                    yield f"data: {json.dumps(err.body())}\n\n"
            self._metrics.tokens(sum(c.completion_tokens for c in choices))
            if plan.include_usage:
                data = {"id": rid, "object": obj, "created": created, "model": model,
                        "choices": [], "usage": api.usage(choices, plan.prompt_index)}
                yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client disconnected and Serve cancelled us
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._end_temp_session(plan)

    async def _runtime_status(self) -> dict:
        stats = await self.runtime.scheduler.stats.remote()
        return stats


def build_app(args: dict[str, Any] | None = None):
    """The Serve application (an app builder: ``serve run deploy.serve_app:build_app k=v``
    and the ``args`` of a Serve config file land here)."""
    settings = AppSettings.from_args(args)
    return OpenAIServer.options(
        num_replicas=settings.num_replicas,
        max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": settings.replica_num_cpus,
                           **({"resources": settings.replica_resources}
                              if settings.replica_resources else {})},
    ).bind(dataclasses.asdict(settings))


app = build_app()
