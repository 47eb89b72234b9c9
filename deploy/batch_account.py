"""The batch job's account (deploy/batch_job.py): what each row's outcome is, which rows a
retry can help and how, and the summary a job ends with.

Every output row carries ``outcome``, one of OUTCOMES:

- ``valid``: the answer ended normally (``stop``), and validates where it was validated;
- ``closed_at_budget``: it ran to ``max_tokens`` (a guided answer is closed there, so it
  still parses; its content may be short of what the prompt asked);
- ``loop_cut``: the loop guard cut a repetition (the answer was closed after the cut);
- ``invalid``: the answer does not validate against its schema (the grammar backend that
  served it only approximates a keyword: ``validation_error`` says which);
- ``refused``: refused before generating: the line itself (not JSON, no prompt, a bad
  parameter), a prompt over the context, ``max_tokens`` below the grammar's shortest output;
- ``grammar_error``: the grammar is invalid, too large, or compiles too slowly;
- ``infrastructure``: the runtime failed under the line (a worker died, the grammar cache or
  every worker was unavailable, an internal error) after the job's own retries.

``--retry-failed`` runs again only the rows a retry can help (``retry_for``): closed at the
budget with twice the budget, refused for a budget below the grammar's shortest output with
twice what the refusal says it needs (four times a structural lower bound), at most
``--retry-max-tokens``; ``invalid`` on the engine that served it (pinned: under ``auto`` the
other engine may be the one that refused the schema) with twice the budget;
``infrastructure`` as it was. A line is run at most ``MAX_ATTEMPTS`` times in all (its
row's ``attempts``, else ``attempt``). Loop cuts, refusals of the line and grammar errors
stay: retrying them as they are gives the same answer (the summary says what to change
instead).

A retry's row is appended beside the row it retries; the better of the two is kept
(``better``: the better outcome, the retry on a tie), so a retry never makes a line worse.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter, defaultdict

from core.errors import ErrorKind

OUTCOMES = ("valid", "closed_at_budget", "loop_cut", "invalid", "refused", "grammar_error",
            "infrastructure")
MAX_ATTEMPTS = 3  # a row's first run and at most two retries
DEFAULT_RETRY_MAX_TOKENS = 4096

_GRAMMAR_KINDS = {ErrorKind.INVALID_GRAMMAR, ErrorKind.GRAMMAR_TOO_LARGE,
                  ErrorKind.COMPILE_TIMEOUT, ErrorKind.COMPILE_MEMORY}
# the runtime's failures (also a bug of ours: a retry may well pass)
_INFRASTRUCTURE_KINDS = {ErrorKind.INTERNAL, ErrorKind.REJECTED}
# the admission's refusal names what the grammar's shortest output needs: "about N" (what
# its search found), "at least N" (the schema's structural lower bound: often well short
# of a real output) or "more than N" (nothing found within N)
_NEEDS = re.compile(r"needs (at least|about|more than) (\d+) tokens")
_NEED_FACTOR = {"about": 2, "at least": 4, "more than": 4}
# outcomes from best to worst: which of two rows of one line is kept
_RANK = {o: i for i, o in enumerate(("valid", "closed_at_budget", "loop_cut", "invalid",
                                     "refused", "grammar_error", "infrastructure"))}

# what to do about each outcome, in the summary
ADVICE = {
    "valid": "",
    "closed_at_budget": "raise max_tokens (--retry-failed doubles it)",
    "loop_cut": "the model repeated itself: a higher temperature or a clearer prompt",
    "invalid": "the backend approximates a keyword (validation_error): --retry-failed "
               "tries again with twice the budget; `rayguide grammar check` says which",
    "refused": "fix the line (its error says what) or shorten the prompt; a budget below "
               "the grammar's shortest output is retried with the budget it needs",
    "grammar_error": "simplify the schema; `rayguide grammar check FILE` tells why",
    "infrastructure": "the runtime failed under the line: --retry-failed runs it again",
}


def _kind(row: dict) -> ErrorKind | None:
    value = row.get("error_kind")
    if value is None:
        return None
    try:
        return ErrorKind(value)
    except ValueError:
        return None


def outcome_of(row: dict) -> str:
    """The row's outcome (its ``outcome`` when it has one; rows written before the job
    recorded it are classified from their fields)."""
    if row.get("outcome") in OUTCOMES:
        return row["outcome"]
    if row.get("error"):
        kind = _kind(row)
        if row.get("transient") is True or (kind is not None and kind.transient) \
                or kind in _INFRASTRUCTURE_KINDS:
            return "infrastructure"
        if kind in _GRAMMAR_KINDS:
            return "grammar_error"
        return "refused"
    if row.get("validation") == "invalid":
        return "invalid"
    if row.get("loop_cuts"):
        return "loop_cut"
    if row.get("finish_reason") == "length":
        return "closed_at_budget"
    return "valid"


def retry_for(row: dict, max_tokens_cap: int = DEFAULT_RETRY_MAX_TOKENS) -> dict | None:
    """How ``--retry-failed`` runs the row's line again: ``{}`` (as it was), or overrides
    ``max_tokens`` / ``engine``; None when a retry cannot help."""
    if attempts_of(row) >= MAX_ATTEMPTS:
        return None
    outcome = outcome_of(row)
    used = (row.get("usage") or {}).get("completion_tokens") or 0
    if outcome == "closed_at_budget":
        budget = row.get("max_tokens") or used
        new = min(max_tokens_cap, max(2 * budget, 16))
        return {"max_tokens": new} if new > budget else None
    if outcome == "refused" and _kind(row) == ErrorKind.BUDGET_TOO_SMALL:
        m = _NEEDS.search(row.get("error") or "")
        needs = int(m.group(2)) if m else 0
        factor = _NEED_FACTOR[m.group(1)] if m else 2
        new = min(max_tokens_cap, max(factor * needs, 2 * (row.get("max_tokens") or 0), 16))
        return {"max_tokens": new} if new >= needs else None
    if outcome == "invalid":  # the same engine (the other may refuse the schema), more room
        budget = row.get("max_tokens") or used
        new = min(max_tokens_cap, max(2 * budget, 16))
        if new <= budget:
            return None
        engine = row.get("grammar_engine")
        return {"max_tokens": new, **({"engine": engine} if engine else {})}
    if outcome == "infrastructure":
        return {}
    return None


def attempts_of(row: dict) -> int:
    """How many times the row's line was run: ``attempts`` where a retry's row lost to the
    row it retried (``better``), else the row's own ``attempt`` (1 when absent)."""
    return max(row.get("attempts") or 1, row.get("attempt") or 1)


def better(new: dict, old: dict) -> bool:
    """Whether ``new`` (a later row of a line) is kept over ``old``: its outcome is as
    good or better."""
    return _RANK[outcome_of(new)] <= _RANK[outcome_of(old)]


class Account:
    """Counts of rows by outcome, and by grammar (the row's ``grammar``: the grammar id a
    ``POST /v1/grammars`` check gives the same spec; ``none`` for lines without one)."""

    def __init__(self):
        self.outcomes: Counter = Counter()
        self.by_grammar: dict[str, Counter] = defaultdict(Counter)
        self.retryable = 0
        self.prompt_tokens = 0  # of every row's prompt, and of those cached (not computed)
        self.cached_tokens = 0

    def add(self, row: dict, max_tokens_cap: int = DEFAULT_RETRY_MAX_TOKENS) -> str:
        usage = row.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        self.cached_tokens += usage.get("cached_tokens") or 0
        outcome = outcome_of(row)
        self.outcomes[outcome] += 1
        self.by_grammar[row.get("grammar") or "none"][outcome] += 1
        self.retryable += retry_for(row, max_tokens_cap) is not None
        return outcome

    @property
    def rows(self) -> int:
        return sum(self.outcomes.values())

    @property
    def valid_share(self) -> float:
        return self.outcomes["valid"] / self.rows if self.rows else 0.0

    def summary(self, **extra) -> dict:
        return {**extra, "rows": self.rows, "valid_share": round(self.valid_share, 4),
                "outcomes": {o: self.outcomes[o] for o in OUTCOMES},
                "retryable": self.retryable,
                "prompt_tokens": {"total": self.prompt_tokens, "cached": self.cached_tokens,
                                  "computed": self.prompt_tokens - self.cached_tokens},
                "by_grammar": {g: {o: c[o] for o in OUTCOMES if c[o]}
                               for g, c in sorted(self.by_grammar.items())}}

    def table(self) -> str:
        """The summary as text: one line per outcome (count, share, what to do), then the
        grammars with any row that is not valid."""
        n = max(1, self.rows)
        lines = [f"{'outcome':<17}{'rows':>7}{'share':>8}  what to do"]
        for o in OUTCOMES:
            lines.append(f"{o:<17}{self.outcomes[o]:>7}{self.outcomes[o] / n:>8.1%}  "
                         f"{ADVICE[o] if self.outcomes[o] and o != 'valid' else ''}".rstrip())
        lines.append(f"{'total':<17}{self.rows:>7}   ({self.retryable} rows "
                     "--retry-failed would run again)")
        lines.append(f"prompt tokens: {self.prompt_tokens} ({self.cached_tokens} cached, "
                     f"{self.prompt_tokens - self.cached_tokens} computed)")
        bad = [(g, c) for g, c in sorted(self.by_grammar.items()) if c["valid"] < sum(c.values())]
        if bad:
            lines.append("by grammar (those with rows that are not valid):")
            for g, c in bad[:20]:
                lines.append(f"  {g}: " + ", ".join(f"{o} {c[o]}" for o in OUTCOMES if c[o]))
            if len(bad) > 20:
                lines.append(f"  ... and {len(bad) - 20} more (in the JSON summary)")
        return "\n".join(lines)


def account_of(output_path: str, max_tokens_cap: int = DEFAULT_RETRY_MAX_TOKENS) -> Account:
    """The account of every row in the output file (this run's and earlier runs')."""
    acc = Account()
    try:
        f = open(output_path, "rb")
    except FileNotFoundError:
        return acc
    with f:
        for raw in f:
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict):
                acc.add(row, max_tokens_cap)
    return acc


def summary_path(output_path: str) -> str:
    return output_path + ".summary.json"


def write_summary(output_path: str, summary: dict) -> str:
    """Writes the JSON summary next to the output (atomically: a new file renamed over
    it, never through a link); returns its path."""
    path = summary_path(output_path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
