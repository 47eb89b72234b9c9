"""The OpenAI-compatible HTTP endpoint: a FastAPI app inside a Ray Serve deployment. I/O only.

Each replica is a thin front end: it reads and checks the request (deploy/openai_api.py
plans it, deploy/dialects.py builds its grammar), asks the scheduler for a worker and
streams tokens straight from that worker (cluster/client.py), and writes what
deploy/responses.py assembles. It holds no model and no KV. Several replicas can run side
by side: sessions stay sticky because the scheduler, not the replica, owns the routing.

    serve run deploy.serve_app:app                         # defaults; starts the runtime
    serve run deploy.serve_app:build_app num_workers=2 api_key=secret
    serve deploy deploy/serve_config.yaml                  # the same through a config file
    rayguide serve                                         # runtime + app in one command

A replica that finds no runtime on the cluster starts one (detached, so the replicas share
it; ``rayguide down`` removes it), unless ``start_runtime`` is false.

Why one module over 500 lines: the FastAPI routes, their shared checks (auth, Host/Origin,
body limits) and the replica's lifecycle are one Serve deployment class.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and
# Serve ships this class by value, where string annotations would not resolve
import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
import ray
from ray import serve
from ray.serve.config import BackpressureConfig

from cluster import launch
from cluster.client import RuntimeClient
from core.errors import ErrorKind
from core.grammar_spec import is_grammar_id
from core.json_schema import nested_deeper
from core.request import RequestOutput
from core.response_store import ResponseStore
from deploy import exposure
from deploy import openai_api as api
from deploy import responses
from deploy import responses_api as rapi
from deploy import responses_events
from deploy import tenants
from deploy.errors import (APIError, bad_request, for_exception, for_kind, last_line,
                           too_large)
from deploy.metrics import Metrics
from deploy.openai_api import Plan
from deploy.refusals import Refusals
from deploy.settings import AppSettings
from core.config import config_error_message

logger = logging.getLogger(__name__)


def _body_schema(model) -> dict:
    """The OpenAPI request body of a route that reads its body itself (so the schema,
    and the fuzzers that read it, know what the route takes)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


def _bearer(request: Request) -> str:
    """The API key the request presents (``Authorization: Bearer <key>``), or ''."""
    header = request.headers.get("authorization", "")
    return header[7:] if header.lower().startswith("bearer ") else ""


async def _answer_within(call, timeout_s: float):
    """What ``call()`` answers within ``timeout_s``; None when it fails or is late."""
    try:
        return await asyncio.wait_for(call(), timeout_s)
    except Exception:
        return None


def serve_http_host() -> str | None:
    """The address Serve's HTTP proxies listen on (``http_options.host``), from the Serve
    controller; None when there is none to ask (Ray or Serve not started yet, HTTP off)."""
    if not ray.is_initialized():
        return None
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host or None
    except Exception:  # noqa: BLE001 - no controller yet, or Ray's internals moved
        logger.debug("could not read Serve's http_options.host", exc_info=True)
        return None


def _refuse_open(settings: AppSettings, host: str | None) -> None:
    """Raises ValueError when the app would serve ``host`` (non-loopback) with no API key
    and no ``allow_open`` (deploy/exposure.py open_refusal)."""
    if host is None:
        return
    refusal = exposure.open_refusal(host, settings.keyed, settings.allow_open,
                                    serve_config=True)
    if refusal is not None:
        raise ValueError(refusal)
    if not settings.keyed and not exposure.is_loopback(host):
        logger.warning("allow_open: serving on %s with NO API key; anyone who can reach "
                       "this address can use the endpoint", host)


def _drain(item: tuple, queue: asyncio.Queue) -> dict:
    """``item`` and whatever else ``queue`` holds now, as one merged chunk per choice (in
    the order the choices first came)."""
    gained: dict[int, RequestOutput] = {}
    while True:
        i, chunk = item
        if i in gained:
            gained[i].merge(chunk)
        else:
            gained[i] = chunk
        if queue.empty():
            return gained
        item = queue.get_nowait()


# the docs routes are ours (below), so they follow the API key like every other route
fastapi_app = FastAPI(title="rayguide", version="0.1.0", docs_url=None, redoc_url=None,
                      openapi_url=None,
                      description="Guided (structured) generation, OpenAI-compatible.")


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@fastapi_app.exception_handler(APIError)
async def _api_error(_request: Request, exc: APIError):
    return _error_response(exc)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError):
    message = config_error_message(exc, None, ())  # FastAPI's errors have pydantic's shape
    return _error_response(bad_request(f"invalid request: {message}"))


@fastapi_app.exception_handler(404)
async def _not_found(request: Request, _exc):
    return _error_response(APIError(404, f"no route {request.method} {request.url.path}",
                                    code="not_found"))


@fastapi_app.exception_handler(405)
async def _not_allowed(request: Request, _exc):
    return _error_response(APIError(405, f"{request.method} is not allowed on "
                                         f"{request.url.path}", code="method_not_allowed"))


@fastapi_app.exception_handler(Exception)
async def _bug(request: Request, exc: Exception):
    """Anything not handled above is a bug in our code: a 500 with a request id that is
    also in the log, never a stack trace to the client."""
    rid = uuid.uuid4().hex[:16]
    logger.error("bug while serving %s %s (request id %s)", request.method, request.url.path,
                 rid, exc_info=exc)
    return _error_response(APIError(500, f"internal error (request id {rid}); this is a bug "
                                          "in rayguide", type_="server_error", code="internal"))


# graceful_shutdown_wait_loop_s: a replica being stopped looks for requests still running
# this often (Ray's default, 2 s, is the least an idle replica took to stop; it still waits
# for every running request, up to graceful_shutdown_timeout_s)
@serve.deployment(max_ongoing_requests=256, health_check_period_s=10,
                  graceful_shutdown_wait_loop_s=0.2)
@serve.ingress(fastapi_app)
class OpenAIServer:
    def __init__(self, settings: dict):
        self.settings = AppSettings(**settings)
        self.limits = self.settings.limits
        # again here: an app deployed without build_app's check (`serve run
        # deploy.serve_app:app`, or Serve started after the app was built) is checked
        # before it answers anyone
        _refuse_open(self.settings, serve_http_host())
        try:
            launch.handles()
        except ValueError:
            if not self.settings.start_runtime:
                raise
            logger.info("no rayguide runtime on this cluster; starting one")
            launch.up(self.settings.cluster_config(), detached=True)
        self.runtime = RuntimeClient()
        self._models: list[str] = []
        self._served = api.Served()
        self._metrics = Metrics()
        self._cache = None  # the grammar cache actor's handle, for /metrics
        self._open_streams = 0  # SSE streams writing now (they share stream_events_per_s)
        # checks' 429s, kept per client for their Retry-After: an ask before it is
        # answered here (deploy/refusals.py)
        self._check_refusals = Refusals()
        self._stored = ResponseStore(self.settings.responses_ttl_s,
                                     self.settings.responses_max_stored,
                                     self.settings.responses_max_stored_chars)

    # endpoints --------------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self):
        """200 {"status": "ok"} when the scheduler answers and a worker is alive; else 503
        with the reason in plain words (no internals)."""
        try:
            stats = await asyncio.wait_for(self.runtime.scheduler.stats.remote(), 10)
        except Exception:
            return JSONResponse({"status": "unavailable",
                                 "reason": "the runtime's scheduler does not answer"}, 503)
        n = len(stats["workers"])
        if not n:
            return JSONResponse({"status": "unavailable", "reason": "no worker is alive"},
                                503)
        return JSONResponse({"status": "ok", "workers": n}, 200)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list",
                "data": [{"id": m, "object": "model", "created": 0, "owned_by": "rayguide"}
                         for m in await self._served_models()]}

    @fastapi_app.post("/v1/chat/completions",
                      openapi_extra=_body_schema(api.ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        return await self._serve(request, api.ChatCompletionRequest, api.plan_chat)

    @fastapi_app.post("/v1/completions", openapi_extra=_body_schema(api.CompletionRequest))
    async def completions(self, request: Request):
        return await self._serve(request, api.CompletionRequest, api.plan_completion)

    @fastapi_app.post("/v1/responses", openapi_extra=_body_schema(rapi.ResponsesRequest))
    async def create_response(self, request: Request):
        """OpenAI's Responses API: the request planned as the chat request it means
        (deploy/responses_api.py), run like one, answered as a Response object or its
        event stream (deploy/responses_events.py); with ``store`` (the default), its
        conversation kept for ``previous_response_id`` (core/response_store.py: in this
        replica, and in the grammar cache actor, where every replica finds it)."""
        started = time.monotonic()
        route = "/v1/responses"
        try:
            self._auth(request)
            parsed = api.parse_request(rapi.ResponsesRequest, await self._body(request))
            await self._check_model(parsed.model)
            client = self._client(request, parsed.user)
            turn = rapi.plan_response(parsed, await self._conversation(parsed, client),
                                      self.limits, self._served, client,
                                      named=await self._named(parsed.grammar_id, client))
            model = self._model(turn.plan)
            if turn.plan.stream:
                opened = await self._open_all(turn.plan)
                stream = responses_events.ResponseStream(turn, model)
                response = StreamingResponse(
                    self._kept(turn, client, stream,
                               self._sse(turn.plan, opened, started, stream)),
                    media_type="text/event-stream")
            else:
                outputs = await self._outputs(turn.plan)
                response = responses_events.response_body(turn, outputs[0], model)
                await self._keep(turn, client, response)
            self._metrics.request(route, 200, time.monotonic() - started)
            return response
        except APIError as exc:
            self._metrics.request(route, exc.status, time.monotonic() - started)
            raise

    async def _conversation(self, parsed, client: str) -> list[dict] | None:
        """The stored conversation ``previous_response_id`` names (None: no id): this
        replica's copy, else the shared one in the grammar cache actor (another replica
        answered it); a 404 naming it when this tenant has none under it."""
        previous = parsed.previous_response_id
        if previous is None:
            return None
        rapi.check_previous_id(previous)
        owner = api.cache_scope(client)
        found = self._stored.get(owner, previous)
        if found is None:
            found = await self.runtime.stored_response(owner, previous)
        if found is None:
            raise APIError(404, f"no stored response {previous!r} for this API key's tenant: "
                                "it was made with store: false, by another tenant, over "
                                f"{self.settings.responses_ttl_s:g} s ago (responses_ttl_s), "
                                "or pushed out by newer ones (or the runtime restarted); send "
                                "the conversation as input instead",
                           param="previous_response_id", code="response_not_found")
        return found

    async def _keep(self, turn, client: str, response: dict | None) -> None:
        """Stores the conversation after ``response`` under its id for the client's
        tenant, in this replica and in the shared cache actor, before the response is
        answered (its id may be continued on any replica at once); ``store: false``, or a
        failed response: nothing."""
        if turn.store and response is not None and response["status"] != "failed":
            owner, messages = api.cache_scope(client), responses_events.conversation(
                turn, response)
            self._stored.put(owner, turn.id, messages)
            await self.runtime.remember_response(owner, turn.id, messages,
                                                 self.settings.responses_ttl_s)

    async def _kept(self, turn, client: str, stream, events) -> AsyncIterator[str]:
        """``events``, the finished stream's conversation stored (``_keep``) before the
        events that finish it are sent (the client may continue it at once, on any
        replica)."""
        kept = False
        try:
            async for event in events:
                if not kept and stream.final is not None:
                    kept = True
                    await self._keep(turn, client, stream.final)
                yield event
        finally:
            await events.aclose()
        if not kept:
            await self._keep(turn, client, stream.final)

    @fastapi_app.post("/v1/grammars", openapi_extra=_body_schema(api.GrammarCheckRequest))
    async def check_grammar(self, request: Request):
        """The grammar check (docs/grammars.md): the body's grammar compiled on a worker's
        request path (a later request finds it compiled), and what requests with it will
        meet; 200 with the report, also for a grammar the runtime refuses (its ``status``
        is "refused" and ``error`` the error a request would get). A compile that outlasts
        ``wait_s`` (default ``grammar_check_wait_s``) is answered 202 with status
        "compiling" and a ``Location`` to GET: the compile goes on."""
        started = time.monotonic()
        route = "/v1/grammars"
        try:
            self._auth(request)
            parsed = api.parse_request(api.GrammarCheckRequest, await self._body(request))
            await self._check_model(parsed.model)
            client = self._client(request, parsed.user)
            wait = self._check_refusals.wait_left(client)
            if wait > 0:
                # answered when its Retry-After has passed (asleep: no CPU), so a client
                # that ignores it sends one body per connection per Retry-After
                await asyncio.sleep(wait)
                raise APIError(
                    429, "this client's grammar checks were refused (the worker's compile "
                    "queue holds its share) less than Retry-After ago; retry after it",
                    type_="rate_limit_error", code="overloaded",
                    headers={"Retry-After": str(max(1, round(wait)))})
            spec = api.check_spec(parsed, self.limits,
                                  await self._named(parsed.grammar_id, client))
            wait_s = (self.settings.grammar_check_wait_s if parsed.wait_s is None
                      else parsed.wait_s)
            try:
                report = await self._check(spec, client, wait_s)
            except APIError as exc:
                if exc.status == 429:
                    self._check_refusals.refused(client, exc.headers.get("Retry-After"))
                raise
            response = self._report_response(report)
            self._metrics.request(route, response.status_code, time.monotonic() - started)
            return response
        except APIError as exc:
            self._metrics.request(route, exc.status, time.monotonic() - started)
            raise

    @fastapi_app.get("/v1/grammars/{grammar_id}")
    async def get_grammar(self, grammar_id: str, request: Request, user: str | None = None):
        """The report ``POST /v1/grammars`` answered this client for this id (``user``:
        the ``user`` the check was sent with); 404 when this client checked no such
        grammar. One that was still compiling is checked again (up to
        ``grammar_check_wait_s``): 200 with the report once the compile is done, 202
        "compiling" until then."""
        self._auth(request)
        client = self._client(request, user)
        found = await self._checked(grammar_id, None, client)
        if found is None:
            raise api.grammar_not_found(grammar_id)
        spec, report = found
        if report.get("status") == "compiling":
            report = await self._check(spec, client, self.settings.grammar_check_wait_s)
        return self._report_response(report)

    async def _check(self, spec, client: str | None, wait_s: float) -> dict:
        """The worker's report on ``spec`` as the API answers it, kept under its id for
        ``client`` (grammar_cache/checked.py: a client's checked grammars are its own)."""
        try:
            report = await self.runtime.check_grammar(spec, client, wait_s)
        except Exception as exc:  # noqa: BLE001 - the runtime's failures, mapped
            raise for_exception(exc) from None
        report = self._shape_report(report)
        await self.runtime.remember_checked(client, report["id"], spec, report)
        return report

    @staticmethod
    def _report_response(report: dict) -> JSONResponse:
        if report.get("status") != "compiling":
            return JSONResponse(report)
        return JSONResponse(report, status_code=202, headers={
            "Location": f"/v1/grammars/{report['id']}", "Retry-After": "1"})

    async def _named(self, grammar_id: str | None, client: str | None):
        """The checked spec a request's ``grammar_id`` names among ``client``'s (None: no
        id, or unknown to this client; the planner answers the 404 or 400)."""
        if grammar_id is None or not is_grammar_id(grammar_id):
            return None
        found = await self._checked(grammar_id, "grammar_id", client)
        return found[0] if found is not None else None

    async def _checked(self, grammar_id: str, param: str | None, client: str | None):
        if not is_grammar_id(grammar_id):
            raise bad_request("a grammar id is 'grammar-' and 32 hex digits, as POST "
                              "/v1/grammars answers it", param)
        timeout = self.settings.scheduler_timeout_s
        try:
            return await asyncio.wait_for(self.runtime.checked(client, grammar_id), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("could not look up grammar %s: %r", grammar_id, exc)
            raise APIError(503, f"could not look up the grammar: the grammar cache did not "
                                f"answer within {timeout:g} s ({type(exc).__name__}); retry",
                           type_="server_error", code="unavailable") from None

    def _shape_report(self, report: dict) -> dict:
        """The worker's report as the API answers it: the served model, and a refusal's
        error in the shape (and with the HTTP status) a request would get it."""
        report = {**report, "model": self._models[0] if self._models else None}
        report.pop("worker_id", None)
        error = report.get("error")
        if error is not None:
            refusal = for_kind(error["code"], error["message"])
            report["error"] = {**refusal.body()["error"], "status": refusal.status}
        return report

    @fastapi_app.delete("/v1/sessions/{session_id}")
    async def end_session(self, session_id: str, request: Request):
        """Ends one of the caller's sessions (``?user=``: the ``user`` its requests gave);
        404 when the caller has no live session of that id, which is also what another
        client's session looks like (sessions are the client's own: api.session_key)."""
        self._auth(request)
        api.check_session_id(session_id, self.limits)
        params = getattr(request, "query_params", None) or {}
        owner = self._client(request, params.get("user"))
        live = await self._scheduler_call(
            self.runtime.end_session(api.session_key(owner, session_id)), "end the session")
        if not live:
            raise APIError(404, f"no live session {session_id!r} of this client (a session "
                           "belongs to the client that made it: its API key's tenant, and "
                           "its 'user' (send it as ?user=) or else its address; an idle one "
                           "ends by itself)", param="session_id", code="session_not_found")
        return {"id": session_id, "object": "session", "deleted": True}

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request):
        if not self.settings.public_metrics:
            self._auth(request)
        # a part whose actor is slow or down is left out of the page: never a hang, never a 500
        timeout = self.settings.scheduler_timeout_s
        status, cache = await asyncio.gather(
            _answer_within(self.runtime.scheduler.stats.remote, timeout),
            _answer_within(self._cache_stats, timeout))
        if cache is None:
            self._cache = None  # looked up again next time: it may have been rebuilt
        return PlainTextResponse(self._metrics.render(status, self.runtime.stats(), cache),
                                 media_type="text/plain; version=0.0.4")

    async def _cache_stats(self) -> dict:
        """The grammar cache actor's ``stats()`` (its handle looked up by name once)."""
        if self._cache is None:
            self._cache = await asyncio.to_thread(
                ray.get_actor, launch.CACHE_NAME, namespace=launch.NAMESPACE)
        return await self._cache.stats.remote()

    @fastapi_app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        if not self.settings.public_metrics:
            self._auth(request)
        return JSONResponse(fastapi_app.openapi())

    @fastapi_app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        if not self.settings.public_metrics:
            self._auth(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="rayguide")

    # the request path -------------------------------------------------------------------

    async def _serve(self, request: Request, model_cls, planner):
        started = time.monotonic()
        route = request.url.path
        try:
            self._auth(request)
            body = await self._body(request)
            parsed = api.parse_request(model_cls, body)
            await self._check_model(parsed.model)
            client = self._client(request, parsed.user)
            plan = planner(parsed, self.limits, self._served, client,
                           named=await self._named(parsed.grammar_id, client))
            if plan.stream:
                response = await self._stream(plan, started)
            else:
                response = await self._complete(plan)
            self._metrics.request(route, 200, time.monotonic() - started)
            return response
        except APIError as exc:
            self._metrics.request(route, exc.status, time.monotonic() - started)
            raise

    def _auth(self, request: Request) -> str | None:
        """Lets the request in, or raises (401: a key is configured and the request's is
        missing or not one of them). Returns its tenant (deploy/tenants.py: the keys
        file's name for its key, ``default`` for the single ``api_key``); None when the
        endpoint takes no key."""
        keys = self.settings.key_table()
        refusal = exposure.refusal_of(request, api_key_configured=bool(keys))
        if refusal is not None:  # a web page or a rebound DNS name (deploy/exposure.py)
            raise APIError(refusal.status, refusal.message, code=refusal.code)
        if not keys:
            return None
        tenant = tenants.tenant_of(keys, _bearer(request))
        if tenant is None:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")
        return tenant

    def _client(self, request: Request, user: str | None) -> str:
        """The request's client identity (openai_api.client_identity): its ``user``, else
        its address (Serve's proxy passes the connection's peer: behind a reverse proxy,
        the proxy's), under its tenant: the one its key belongs to (a presented key the
        server does not take is refused by ``_auth`` first; with no key configured every
        client is of one open tenant, and a presented key counts for nothing). Another
        tenant's clients are never this one's, whatever ``user`` they send."""
        keys = self.settings.key_table()
        tenant = tenants.tenant_of(keys, _bearer(request)) if keys else None
        peer = getattr(request, "client", None)
        host = peer.host if peer is not None else None
        return api.client_identity(user, host, tenant)

    async def _body(self, request: Request) -> Any:
        """The JSON body, read at most ``max_body_bytes`` (a chunked body is counted as it
        arrives, never buffered past the limit) within ``body_timeout_s`` (a 408 past it:
        a trickled body must not hold a replica's slot) and nested at most
        ``max_json_depth``."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large(f"request body is {declared} bytes, over the limit of {limit}")
        raw = bytearray()
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for part in request.stream():
                    raw += part
                    if len(raw) > limit:
                        raise too_large(f"request body is over the limit of {limit} bytes")
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within "
                           f"{self.settings.body_timeout_s:g} s (body_timeout_s)",
                           code="body_timeout") from None
        depth = self.limits.max_json_depth
        try:
            # strict UTF-8 (json.loads of bytes lets CESU-8 surrogate bytes through)
            body = json.loads(bytes(raw).decode("utf-8"))
        except ValueError as exc:  # not JSON, not UTF-8, or an integer of 4,300+ digits
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:  # nested past Python's stack: far over the limit
            body, too_deep = None, True
        else:
            too_deep = nested_deeper(body, depth)
        if too_deep:
            raise bad_request(f"the request body is nested deeper than {depth} levels")
        try:  # an escaped lone surrogate ("\ud800") parses, but no tokenizer takes it
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request body holds a lone UTF-16 surrogate (\\ud800-"
                              "\\udfff without its pair) in a string; send valid Unicode"
                              ) from None
        return body

    async def _scheduler_call(self, call, what: str):
        """Awaits a call on the scheduler for at most ``scheduler_timeout_s``; a scheduler
        that is down, restarting or slow is a 503 (retry), never a 500 or a hang."""
        timeout = self.settings.scheduler_timeout_s
        try:
            return await asyncio.wait_for(call, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("could not %s: the scheduler failed (%r)", what, exc)
            raise APIError(503, f"could not {what}: the runtime's scheduler is down or did "
                                f"not answer within {timeout:g} s ({type(exc).__name__}); "
                                "retry",
                           type_="server_error", code="unavailable") from None

    async def _served_models(self) -> list[str]:
        if not self._models:
            stats = await self._scheduler_call(self.runtime.scheduler.stats.remote(),
                                               "list the served models")
            workers = stats["workers"].values()
            self._models = sorted({w.get("model") for w in workers if w.get("model")})
            contexts = [w["max_model_len"] for w in workers if w.get("max_model_len")]
            sampling = next((w["generation_defaults"] for w in workers
                             if w.get("generation_defaults")), {})
            self._served = api.Served(min(contexts) if contexts else None, dict(sampling))
        return self._models

    async def _check_model(self, model: str | None) -> None:
        served = await self._served_models()
        if model is None or model in served or not served:
            return
        self._models = []  # the runtime may have been restarted with another model
        served = await self._served_models()
        if served and model not in served:
            raise APIError(404, f"model {model!r} is not served here; use one of {served}",
                           param="model", code="model_not_found")

    def _model(self, plan: Plan) -> str:
        """The response's ``model``: the served model's name (what /v1/models lists)."""
        if plan.model and plan.model in self._models:
            return plan.model
        return self._models[0] if self._models else (plan.model or "rayguide")

    async def _open(self, request) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Starts one runtime request; returns its stream and its first chunk. Errors that
        come before any token (bad request, bad grammar, overload) raise APIError, so a
        stream never starts with a 200 that then fails."""
        stream = self.runtime.generate(request)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(503, "the worker ended the request without output; retry",
                           type_="server_error", code="unavailable") from None
        except BaseException as exc:
            await stream.aclose()
            raise for_exception(exc, request.request_id) from None
        if first.finished and first.finish_reason == "error" and not first.token_ids:
            await stream.aclose()
            raise for_kind(first.error_kind, first.error or "generation failed",
                           request_id=request.request_id)
        return stream, first

    async def _open_all(self, plan: Plan, requests=None) -> list:
        tasks = [asyncio.ensure_future(self._open(r)) for r in (requests or plan.requests)]
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
            try:  # bounded: the answer is ready and must not wait on a down scheduler
                await asyncio.wait_for(self.runtime.end_session(plan.temp_session),
                                       self.settings.scheduler_timeout_s)
            except Exception:  # the idle sweep frees it later
                logger.warning("could not end session %s", plan.temp_session, exc_info=True)

    async def _run(self, plan: Plan, requests) -> list[RequestOutput]:
        """Runs requests to the end; one merged output each."""
        opened = await self._open_all(plan, requests)
        outputs = [first for _, first in opened]

        async def drain(i: int) -> None:
            try:
                async for chunk in opened[i][0]:
                    outputs[i].merge(chunk)
            except Exception as exc:  # noqa: BLE001 - after the first chunk, see below
                # the request started and then failed underneath (its worker died and the
                # continuation was refused or found no worker): the runtime's failure, a
                # 503 like a stream's error event, never a 500
                logger.warning("request %s failed mid-way: %r", requests[i].request_id, exc)
                cause = getattr(exc, "cause", None) or exc  # a RayTaskError's own error
                outputs[i].merge(RequestOutput(
                    requests[i].request_id, finished=True, finish_reason="error",
                    error_kind=ErrorKind.WORKER_DIED,
                    error=f"the request failed after it started and could not be continued "
                          f"({type(cause).__name__}: {last_line(cause)})"))

        try:
            await asyncio.gather(*(drain(i) for i in range(len(opened))))
        finally:  # also when the client went away and Serve cancelled us
            for stream, _ in opened:
                await stream.aclose()
        return outputs

    async def _complete(self, plan: Plan) -> dict:
        outputs = await self._outputs(plan)
        return responses.response_body(plan, outputs, self._model(plan))

    async def _outputs(self, plan: Plan) -> list[RequestOutput]:
        """The plan's finished outputs (validation "retry" resampled); a failed one raises
        its APIError."""
        try:
            outputs = await self._run(plan, plan.requests)
            if plan.validation == "retry":
                outputs = await self._resample_invalid(plan, outputs)
        finally:
            await self._end_temp_session(plan)
        for out in outputs:
            if out.finish_reason == "error":
                raise for_kind(out.error_kind, out.error or "generation failed",
                               request_id=out.request_id)
        self._metrics.tokens(sum(o.completion_tokens for o in outputs))
        return outputs

    async def _resample_invalid(self, plan: Plan, outputs: list) -> list:
        """validation "retry": a choice whose finished JSON failed its schema is sampled
        again (a new seed when it had one), up to ``max_validation_retries`` times; the
        last attempt is answered, flagged, if none validates."""
        for _ in range(self.settings.max_validation_retries):
            bad = [i for i, o in enumerate(outputs) if getattr(o, "validation", None) == "invalid"]
            if not bad:
                break
            again = []
            for i in bad:
                req = plan.requests[i]
                params = req.params
                if params.seed is not None:
                    params = dataclasses.replace(
                        params, seed=(params.seed + 7919) % (api.MAX_SEED + 1))
                plan.requests[i] = dataclasses.replace(req, request_id=uuid.uuid4().hex,
                                                       params=params)
                again.append(plan.requests[i])
            for i, out in zip(bad, await self._run(plan, again)):
                outputs[i] = out
        return outputs

    async def _stream(self, plan: Plan, started: float) -> StreamingResponse:
        opened = await self._open_all(plan)
        return StreamingResponse(self._sse(plan, opened, started),
                                 media_type="text/event-stream")

    def _write_gap(self) -> float:
        """Seconds a stream lets pass between two writes: the other open streams' share of
        the replica's ``stream_events_per_s``, at most ``stream_interval_ms``. What a stream gains
        meanwhile goes out in its next write (each SSE event costs the replica, Serve's
        proxy and the client about the same whatever it holds)."""
        s = self.settings
        others = max(0, self._open_streams - 1)  # a lone stream writes every token at once
        return min(s.stream_interval_ms / 1e3, others / s.stream_events_per_s)

    async def _sse(self, plan: Plan, opened: list, started: float,
                   assembler=None) -> AsyncIterator[str]:
        """Pumps every choice's stream into one queue and writes what ``assembler`` (the
        chat and completion routes' StreamAssembler unless given: the Responses route's
        ResponseStream) makes of it: all that came since the last write, one event per
        choice, at most every ``_write_gap()``; samples interleave as they are produced."""
        assembler = assembler or responses.StreamAssembler(plan, self._model(plan))
        # bounded: while the writer waits for its gap, a choice's chunks gather (merged)
        # in the runtime client's inbox instead of passing through here one by one
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(opened))

        async def pump(i: int) -> None:
            stream, first = opened[i]
            try:
                await queue.put((i, first))
                async for chunk in stream:
                    await queue.put((i, chunk))
            except BaseException as exc:  # surfaces as an error chunk, never a hang
                if not isinstance(exc, asyncio.CancelledError):
                    err = for_exception(exc, plan.requests[i].request_id)
                    await queue.put((i, RequestOutput(
                        plan.requests[i].request_id, finished=True, finish_reason="error",
                        error=err.message, error_kind=ErrorKind.WORKER_DIED)))
                raise
            finally:
                await stream.aclose()

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(opened))]
        first_token_seen = False
        last_write = None
        self._open_streams += 1
        try:
            for event in assembler.start():
                yield event
            while assembler.remaining:
                item = await queue.get()
                if last_write is not None:
                    await asyncio.sleep(max(0.0, last_write + self._write_gap()
                                            - time.monotonic()))
                gained = _drain(item, queue)
                if not first_token_seen and any(c.token_ids for c in gained.values()):
                    first_token_seen = True
                    self._metrics.ttft(time.monotonic() - started)
                # one write for everything that came while the last one was sent: a
                # client that keeps up gets each chunk as it comes, a slow one fewer,
                # larger events instead of a backlog of one-token events
                events = [e for i, chunk in gained.items() for e in assembler.feed(i, chunk)]
                if events:
                    yield "".join(events)
                    last_write = time.monotonic()
            self._metrics.tokens(assembler.completion_tokens)
            for event in assembler.finish():
                yield event
        finally:  # normal end, or the client disconnected and Serve cancelled us
            self._open_streams -= 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._end_temp_session(plan)


def build_app(args: dict[str, Any] | None = None):
    """The Serve application (an app builder: ``serve run deploy.serve_app:build_app k=v``
    and the ``args`` of a Serve config file land here; Serve wants exactly this one
    parameter). Refuses (ValueError) to serve on a non-loopback ``http_options.host`` (as
    the Serve controller says, when one runs) with no API key and no ``allow_open``."""
    settings = AppSettings.from_args(args)
    _refuse_open(settings, serve_http_host())
    return _application(settings)


def _application(settings: AppSettings):
    return OpenAIServer.options(
        num_replicas=settings.num_replicas,
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        backpressure_config=BackpressureConfig(
            status_code=429, retry_after_s=settings.backpressure_retry_after_s),
        ray_actor_options={"num_cpus": settings.replica_num_cpus,
                           **({"resources": settings.replica_resources}
                              if settings.replica_resources else {})},
    ).bind(settings.model_dump())


# `serve run deploy.serve_app:app`: the defaults (API key from $RAYGUIDE_API_KEY); its
# replicas check the proxies' address as they start
app = _application(AppSettings.from_args(None))
