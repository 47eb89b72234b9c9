"""The bound on one schema rewrite for llguidance (schema_rewrites.py, schema_options.py).

Every rewrite runs in the worker beside the engine thread, in Python, so a hostile schema
(``allOf`` s that reference each other, a ``not`` over a chain of definitions, hundreds of
enum nodes sharing one large definition) must not hold the interpreter for seconds nor
produce megabytes. Each step (a node visited, a reference followed, a negation built, a
value checked) costs a unit (``spend``); past ``MAX_WORK`` units or ``MAX_SECONDS`` of the
thread's CPU time the rewrite stops with ``SchemaTooComplex`` (the caller then refuses the
schema for llguidance, and ``auto`` serves it on xgrammar). ``under_budget`` runs a rewrite
under one budget, or under the one already running.
"""

from __future__ import annotations

import contextvars
import time

# the bound on one rewrite. Steps decide (a 210 kB schema of 4,000 plain nodes takes 4,200
# units; a negation 4 a node, so its output stays under ~0.5 MB); the time is a backstop for
# a step that costs far more than it should. That schema takes 0.075 s of a thread's CPU time
# here (0.155 s at first use, and past 0.25 s on a loaded 2-core machine, so 0.25 s refused
# it there): 25,000 steps at that rate are ~0.45 s, hence 1 s
MAX_WORK = 25_000
MAX_SECONDS = 1.0


class SchemaTooComplex(ValueError):
    """A rewrite needed more than its budget (``MAX_WORK`` steps or ``MAX_SECONDS``)."""


class RewriteBudget:
    """The steps one rewrite may take; ``spend`` raises SchemaTooComplex past them."""

    def __init__(self, units: int = MAX_WORK, seconds: float = MAX_SECONDS):
        self.units, self.left = units, units
        self.seconds = seconds
        # the rewriting thread's CPU time: what it holds the GIL for beside the engine
        # thread (wall time would refuse ordinary schemas on a busy machine)
        self.deadline = time.thread_time() + seconds

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise SchemaTooComplex(
                f"the schema needs more than {self.units} steps to be rewritten for "
                "llguidance (references that multiply: allOf / not / oneOf over shared "
                "definitions)")
        if self.left % 512 < n and time.thread_time() > self.deadline:
            raise SchemaTooComplex(f"rewriting the schema for llguidance took over "
                                   f"{self.seconds:g} s")


_BUDGET: contextvars.ContextVar[RewriteBudget | None] = contextvars.ContextVar(
    "rewrite_budget", default=None)


def spend(n: int = 1) -> None:
    """One step (``n`` units) of the running rewrite's budget; nothing outside one."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend(n)


def under_budget(budget: RewriteBudget | None, fn, *args):
    """``fn(*args)`` under ``budget``; under the running budget where there is one and
    ``budget`` is None, else under a fresh one."""
    if _BUDGET.get() is not None and budget is None:
        return fn(*args)
    token = _BUDGET.set(budget or RewriteBudget())
    try:
        return fn(*args)
    finally:
        _BUDGET.reset(token)
