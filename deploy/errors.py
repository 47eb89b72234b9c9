"""Errors as a client sees them: OpenAI's shape, and the one table from ErrorKind to HTTP.

Every failure below the edge carries a ``core.errors.ErrorKind`` (on the final
output chunk, or on the exception); ``STATUS`` maps each kind to its HTTP status, and
nothing here decides a status by reading a message. A client's mistake is a 4xx naming
what to change; an infrastructure failure is a 503 with a ``Retry-After`` hint; a 500 is a
bug in our code and is logged with the request id.
"""

from __future__ import annotations

import asyncio
import math
import logging

from ray.exceptions import RayTaskError

from cluster.client import INFRASTRUCTURE_ERRORS
from core.errors import ErrorKind, GrammarError, GrammarUnavailable, NoWorkers, Overloaded

try:  # the chat templates' engine (a dependency of the tokenizers' chat templates)
    from jinja2 import TemplateError, TemplateSyntaxError
except ImportError:  # pragma: no cover - no chat templates, nothing of theirs to map
    class TemplateError(Exception):  # type: ignore[no-redef]
        pass

    TemplateSyntaxError = TemplateError  # type: ignore[misc,assignment]

logger = logging.getLogger(__name__)

# failures of the machinery under a request (an actor died, a call timed out, the network):
# 503 and retry, never the client's fault, never a 500
_INFRASTRUCTURE = (*INFRASTRUCTURE_ERRORS, TimeoutError, ConnectionError, OSError)


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param",
    "code"}}`` with an HTTP status (and headers, e.g. ``Retry-After`` on a 503)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers or ({"Retry-After": "1"} if status in (429, 503) else {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_large(message: str, param: str | None = None) -> APIError:
    return APIError(413, message, param=param, code="request_too_large")


# ErrorKind -> (HTTP status, OpenAI error type). One row per kind; a test checks that every
# kind has a row, that client faults are 4xx and transient failures 503/429.
STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_GRAMMAR: (400, "invalid_request_error"),
    ErrorKind.GRAMMAR_TOO_LARGE: (413, "invalid_request_error"),
    ErrorKind.COMPILE_TIMEOUT: (422, "invalid_request_error"),
    ErrorKind.COMPILE_MEMORY: (422, "invalid_request_error"),
    ErrorKind.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorKind.BUDGET_TOO_SMALL: (400, "invalid_request_error"),
    ErrorKind.SESSION_BUSY: (409, "invalid_request_error"),
    ErrorKind.GRAMMAR_UNAVAILABLE: (503, "server_error"),
    ErrorKind.WORKER_DIED: (503, "server_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.NO_WORKERS: (503, "server_error"),
    ErrorKind.REJECTED: (500, "server_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


def for_kind(kind, message: str, param: str | None = None,
             request_id: str | None = None) -> APIError:
    """The APIError for an error of this kind (a kind read off a chunk may be a string)."""
    kind = ErrorKind.parse(kind.value if isinstance(kind, ErrorKind) else kind)
    status, type_ = STATUS[kind]
    if kind.transient and "retry" not in message.lower():
        message += "; retry"
    if status >= 500 and not kind.transient:
        logger.error("request %s failed inside the runtime (%s): %s", request_id,
                     kind.value, message)
        message = (f"{message} (this is a bug in rayguide; request id {request_id})"
                   if request_id else f"{message} (this is a bug in rayguide)")
    return APIError(status, message, type_=type_, param=param, code=kind.value)


def for_exception(exc: BaseException, request_id: str | None = None) -> APIError:
    """What a client is told when the runtime refuses or fails a request with an
    exception (rather than an error chunk). Cancellation is re-raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, Overloaded):
        return for_kind(ErrorKind.OVERLOADED, f"the runtime is overloaded: {cause}")
    if isinstance(cause, NoWorkers):
        return for_kind(ErrorKind.NO_WORKERS, f"no worker is alive: {cause}")
    if isinstance(cause, GrammarError):
        return for_kind(cause.kind, last_line(cause))
    if isinstance(cause, GrammarUnavailable):  # OVERLOADED (429) or GRAMMAR_UNAVAILABLE
        error = for_kind(cause.kind, last_line(cause))
        if cause.retry_after_s and error.status == 429:  # the refuser knows how long
            error.headers = {"Retry-After": str(max(1, math.ceil(cause.retry_after_s)))}
        return error
    if isinstance(cause, TemplateError) and not isinstance(cause, TemplateSyntaxError):
        # the model's chat template refused these messages (raise_exception: "roles must
        # alternate", a missing key): the client's to change. A template that does not
        # parse is the server's own, and stays a bug below.
        return for_kind(ErrorKind.BAD_REQUEST, "the model's chat template refused the "
                        f"messages: {last_line(cause) or type(cause).__name__}",
                        param="messages")
    if isinstance(cause, ValueError):  # the worker's checks of a request
        return for_kind(ErrorKind.BAD_REQUEST, last_line(cause) or "invalid request")
    if isinstance(exc, RayTaskError) or not isinstance(cause, _INFRASTRUCTURE):
        # our code raised something it should not have: a bug, not the client's fault
        return for_kind(ErrorKind.INTERNAL, f"{type(cause).__name__}: {last_line(cause)}",
                        request_id=request_id)
    # the runtime could not be reached or failed underneath (actor died, timed out)
    logger.warning("request %s: runtime failure %r", request_id, exc)
    return APIError(503, f"the runtime could not serve this request "
                         f"({type(cause).__name__}); retry", type_="server_error",
                    code="unavailable")


def last_line(exc: BaseException) -> str:
    """The last line of an exception's text (a remote traceback's own message)."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""
