"""One vocabulary of errors, from the compile process to the HTTP edge.

Every failure a request can meet has an ``ErrorKind``. The kind travels unchanged: in a
compile envelope (``error_kind``), on the exception the worker raises, on the engine's final
``RequestOutput.error_kind``, and it is mapped to an HTTP status in exactly one table
(deploy/errors.py). Nothing downstream decides a status by reading a message.

Two families matter to callers:

- the client's to fix (``ErrorKind.client_fault``): an invalid grammar, a grammar over a
  limit, a valid grammar that compiles slower than the configured limit, a bad request;
- transient (``ErrorKind.transient``): the compile service crashed or is unreachable, a
  grammar was not ready in time under load, a worker died. These are never cached as a
  verdict on the grammar and never reported as the client's fault.

The scheduler's refusals (``Overloaded``, ``TooManySessions``, ``NoWorkers``) are here too:
the routing table raises them and the front ends map them to a status.
"""

from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    # the client's to fix ---------------------------------------------------------------
    INVALID_GRAMMAR = "invalid_grammar"  # the schema / regex / EBNF is wrong or unsupported
    GRAMMAR_TOO_LARGE = "grammar_too_large"  # over a size limit (source bytes, choices, depth)
    COMPILE_TIMEOUT = "compile_timeout"  # a valid grammar that compiles slower than the limit
    COMPILE_MEMORY = "compile_memory"  # compiling it needs more memory than the limit
    BAD_REQUEST = "bad_request"  # any other request problem found by the worker
    BUDGET_TOO_SMALL = "budget_too_small"  # max_tokens below the grammar's shortest output
    SESSION_BUSY = "session_busy"  # another request of this session is still running
    # transient: retry ------------------------------------------------------------------
    GRAMMAR_UNAVAILABLE = "grammar_unavailable"  # compile process crashed / cache down / wait ran out
    WORKER_DIED = "worker_died"  # the worker died while serving the request
    OVERLOADED = "overloaded"  # every worker is over its queue limit
    NO_WORKERS = "no_workers"  # no live worker serves this model
    # ours to fix -----------------------------------------------------------------------
    REJECTED = "rejected"  # the grammar matcher refused a sampled token (a bug)
    INTERNAL = "internal"  # the engine failed (a bug)

    @property
    def client_fault(self) -> bool:
        return self in _CLIENT

    @property
    def transient(self) -> bool:
        return self in _TRANSIENT

    @classmethod
    def parse(cls, value) -> "ErrorKind":
        """The kind for a value read off the wire; unknown values are INTERNAL."""
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL


_CLIENT = frozenset({ErrorKind.INVALID_GRAMMAR, ErrorKind.GRAMMAR_TOO_LARGE,
                     ErrorKind.COMPILE_TIMEOUT, ErrorKind.COMPILE_MEMORY,
                     ErrorKind.BAD_REQUEST, ErrorKind.BUDGET_TOO_SMALL,
                     ErrorKind.SESSION_BUSY})
_TRANSIENT = frozenset({ErrorKind.GRAMMAR_UNAVAILABLE, ErrorKind.WORKER_DIED,
                        ErrorKind.OVERLOADED, ErrorKind.NO_WORKERS})


class GrammarError(ValueError):
    """A grammar the client must change: invalid, unsupported, or over a limit. ``kind``
    says which (a client-fault ErrorKind). Cached like a compiled grammar, for a while."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.INVALID_GRAMMAR):
        super().__init__(message)
        self.kind = ErrorKind(kind)

    def __reduce__(self):  # keeps ``kind`` across pickling (Ray, processes)
        return (type(self), (str(self), self.kind))


class GrammarUnavailable(RuntimeError):
    """The grammar could not be had right now, through no fault of its own (the compile
    process crashed, the cache is unreachable, the wait ran out). Never cached; retry.
    ``kind``: a transient ErrorKind, GRAMMAR_UNAVAILABLE unless told (OVERLOADED: the
    compile queue was full, a 429 rather than a 503). ``retry_after_s``: when the refuser
    knows how long the client should wait (its compile share drains), the 429's
    Retry-After."""

    def __init__(self, message: str = "", kind: ErrorKind = ErrorKind.GRAMMAR_UNAVAILABLE,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keeps ``kind`` across pickling (Ray, processes)
        return (type(self), (str(self), self.kind, self.retry_after_s))


class Overloaded(RuntimeError):
    """Every worker's queue is over its limit; retry later."""


class TooManySessions(Overloaded):
    """A new session would pass the live-session cap (per worker or in total)."""


class NoWorkers(RuntimeError):
    """No live worker is registered."""
