"""The output policy: one object decides how a guided output ends well.

    policy.admit(seq, matcher)      # at admission: refuse a budget the grammar cannot fit,
                                    # plan the shortest output when that is all that fits
    policy.steer(seqs, token_ids)   # once per batch, after sampling: near the end of a
                                    # budget, a token after which the output could not
                                    # close in time is replaced by the closing path's
    policy.after_token(seq, token)  # per appended token: the loop guard (cut a repeating
                                    # value, close it, go on), then budget-aware closing
    policy.release(seq, final)      # how many output tokens may be streamed now
    policy.report(seq, reason, out) # closing, loop cuts and post-validation onto the last chunk

Its per-request state is one ``OutputState`` (``GuidedRequest.ending``); its counters are one
``PolicyStats``. The searches themselves live in closing.py (the shortest completion) and
loop_guard.py (the repeating span and where to end it); post-validation in validation.py.

Budget-aware closing: near the end of its budget a guided request is steered to the
grammar's shortest completion (``_maybe_close``), so a response cut by its budget still
parses. Loop guard: a value that repeats itself is cut back to where the repetition
began (never before what was streamed: the newest ``hold_tokens`` are held back from the
stream for that), closed, and the document goes on; an output that then ends on its own
finishes with ``stop`` and says ``loop_cut`` (see docs/architecture.md).

Why one module over 500 lines: admission, steering, loop cuts, closing and the report act on
one ``OutputState`` in a fixed order per token; the searches they call live elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Callable

from worker.guided.closing import Completion
from worker.guided.json_closing import JsonScan, SchemaNodes
from core.params import LoopGuardParams
from worker.guided.loop_guard import LoopCut, LoopGuard, closer_ids, token_shapes
from core.request import RequestOutput
from worker.guided.rows import GuidedConfig, GuidedRow
from worker.guided.schema_witness import witness_tokens
from worker.guided.search_slices import SearchSlices
from worker.guided.shortest_bound import TokenCapacity
from worker.guided.validation import approximated_keywords, validate_json

logger = logging.getLogger(__name__)

_LOOP_KINDS = ("json_schema", "json_object")  # grammars whose values the guard can see


@dataclass
class OutputState:
    """One guided request's state in the output policy."""

    closed_early: bool = False  # steered to the shortest completion at the budget's end
    # budget-aware closing: (output length when computed, shortest completion length)
    closing_estimate: tuple[int, int] | None = None
    closing_failed: bool = False  # no completion fits the budget: not searched again
    # a search that gave up (node cap or time) is tried again 4, then 16 tokens later,
    # then never (the admission's counts as one): its cost (closing_search_ms, once or
    # twice) must not be paid on every token of a batch
    closing_giveups: int = 0
    closing_retry_at: int = 0
    closing_start: list[int] | None = None  # shortest output found at admission
    start_forced: bool = False  # ... given whatever the budget (the checked budget's)
    closing_probed: bool = False  # the dive's estimate taken before the window
    # the output's length from the grammar's start, where it is longer than the window
    # (admission's estimate): what a cut leaves as the estimate, so that closing still
    # begins in time after it (the output cut back is as far from its end as before)
    prior_estimate: int | None = None
    # the probe's dive path (at output length, path): what closing falls back on where
    # every search is cut short (a large grammar); probes given the long time so far
    fallback: tuple[int, list[int]] | None = None
    long_probe_s: float = 0.0  # the time its dives with the probe's caps have taken
    forced_path: list[int] | None = None  # the output, when that is all that fits
    # the last closing path: (at output length, path, by how many tokens it may be
    # longer than the shortest there; see OutputPolicy._carried_path)
    closing_path: tuple[int, list[int], int] | None = None
    loop: LoopGuard | None = None
    loop_cuts: list[LoopCut] = field(default_factory=list)
    released: int = 0  # output tokens handed to the stream (a cut never goes below)
    # output tokens before the ones the policy follows (a continuation's resumed output,
    # a reasoning model's thought): the loop guard counts from here
    base: int = 0
    hold: int = 0  # the newest output tokens held back from the stream
    # the sliced searches (search_slices.py): the key of the one this request waits for
    # (None: none; the engine parks the row meanwhile), and the answers its current state
    # got (a decision that asked several searches is replayed, each answer kept)
    waiting_on: object = None
    held: tuple | None = None  # a drawn token waiting for its steer verdict (token, logprob)
    tick: int = 0  # the state's number: one more after each token (answers are of one)
    answers: dict = field(default_factory=dict)
    answers_tick: int = 0
    # the schema closer's reader of the output (json_closing.py; None: not built yet or
    # not a JSON grammar) and where the document begins in the output
    scan: JsonScan | None = None
    scan_from: int = 0
    # copies of the reader every _MARK_EVERY tokens (rising): a cut or a jump's rollback
    # reads on from the last one before it, not from the document's start (a long answer
    # cut several times was read whole again each time: 43,191 tokens fed for 12,061)
    scan_marks: list = field(default_factory=list)
    schema_row: bool = False  # a JSON grammar's row: the schema closer serves it
    jump: int = 0  # ... how many tokens one choice can add to its completion (at most)

    def reset_closing(self, at: int) -> None:
        """After a cut (the output now ``at`` tokens) the output is another: no closing
        path holds, and the estimate is the grammar's from its start, if it has one."""
        self.closing_path = self.fallback = None
        self.closing_estimate = None if self.prior_estimate is None else (at, self.prior_estimate)
        self.closing_failed = False
        self.closing_giveups = self.closing_retry_at = 0
        self.closing_probed = False

    def rolled_back(self, kept: int) -> None:
        """The output keeps its first ``kept`` tokens from ``scan_from``: the reader and
        its copies that read past them go (called before anything is appended)."""
        if self.scan is not None and self.scan.tokens > kept:
            self.scan = None
        marks = self.scan_marks
        while marks and marks[-1].tokens > kept:
            marks.pop()


@dataclass(frozen=True)
class _Verdict:
    """An admission budget check's outcome: a closing path that fits (``path``), a refusal
    (``need``: how many tokens the shortest output needs, in words), or neither;
    ``undecided``: the searches found no completion in time."""

    path: list[int] | None = None
    need: str | None = None
    undecided: bool = False


class _Waiting(Exception):
    """A decision needs a search that is still running (search_slices.py): the policy
    unwinds to its public method, which records the wait; the decision is replayed, from
    the same state, once the answer is in. (Internal: never leaves this module.)"""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


@dataclass(frozen=True)
class _Answer:
    """A sliced search's answer: its value, whether it was cut short by its time limit,
    and the engine-thread CPU time it took."""

    value: object
    timed_out: bool
    cpu_s: float


@dataclass
class PolicyStats:
    """Counters of the output policy (exported on /metrics through EngineStats)."""

    closed_early: int = 0  # guided outputs closed at their budget
    validated: int = 0  # JSON outputs validated against their full schema
    invalid: int = 0  # ... found invalid
    runaway: int = 0  # guided outputs that ended at the budget unclosed
    closing_giveups: int = 0  # completion searches cut short (node cap or time)
    closing_probes: int = 0  # dives before the window (a completion longer than it?)
    closing_steered: int = 0  # sampled tokens replaced: the output could not have closed
    closing_searches: int = 0  # completion searches run near the end of a budget
    closing_reused: int = 0  # ... skipped: the last step's path still closes (replayed)
    # closing paths written from the schema (json_closing.py): no search was needed
    closing_schema: int = 0
    # outputs closed on the probe's dive path because every search was cut short
    closing_fallbacks: int = 0
    budget_checks: int = 0  # guided requests whose budget was checked at admission
    budget_checks_memo: int = 0  # ... judged from a remembered verdict (no search)
    # decisions that waited for a search to end in a later step (the row held meanwhile)
    closing_waits: int = 0
    loop_cuts: int = 0  # repeating values the loop guard ended
    loop_cut_outputs: int = 0  # outputs with at least one cut

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class OutputPolicy:
    def __init__(self, config: GuidedConfig, guided, remaining: Callable[[GuidedRow], int]):
        """``remaining(seq)``: the tokens a request may still generate (its budget, or
        the context left: the engine knows the model's length)."""
        self.config = config
        self.guided = guided
        self.remaining = remaining
        # the searches' share of the engine thread: each step's at most a bounded slice
        self.slices = SearchSlices(share=config.search_step_share,
                                   floor_ms=config.search_step_floor_ms)
        self.stats = PolicyStats()
        self.loop_defaults = LoopGuardParams(enabled=config.loop_guard)
        self._closers: dict[str, int] | None = None  # the closers' token ids (first use)
        self._shapes: list[int] = []  # loop_guard.token_shapes of the vocabulary (first use)
        # (grammar key, budget) -> (time, certain, _Verdict): a fresh request's grammar
        # state depends only on its grammar, so the admission search's verdict holds for
        # every request with the same grammar and budget
        self._budget_memo: OrderedDict[tuple[str, int], tuple] = OrderedDict()
        # grammar key -> a lower bound on its shortest output in tokens (shortest_bound.py)
        self._bounds: OrderedDict[str, int] = OrderedDict()
        self._capacity: TokenCapacity | None = None  # of the vocabulary (first use)
        # grammar key -> the schema's nodes for the schema closer (None: not a JSON grammar)
        self._schemas: OrderedDict[str, SchemaNodes | None] = OrderedDict()
        self._piece_tokens: dict[str, int] = {}  # _schema_need: tokens per completion piece

    def prepare(self) -> None:
        """The vocabulary's tables that a first request would otherwise build on the
        engine thread, half a second in all on the default model: the bound's token
        capacity and cover tables, the loop guard's closers and shapes. Idempotent; run
        beside the engine at its start (GuidedPath.build)."""
        if self._capacity is None:
            self._capacity = _vocab_tables(self.guided.closer.vocab)[0]
        if self._closers is None:
            self._loop_tables()

    def _loop_tables(self) -> None:
        _, closers, shapes = _vocab_tables(self.guided.closer.vocab)
        self._shapes, self._closers = shapes, closers  # (closers last: they are the flag)

    # admission ----------------------------------------------------------------------------

    def admit(self, seq: GuidedRow, matcher) -> str | None:
        """A guided request whose grammar is ready: a refusal message when its budget
        cannot hold the grammar's shortest output; else its state is set up (the loop
        guard, the shortest output planned when that is all that fits) and None."""
        st = seq.guide.ending
        st.waiting_on = None
        counted = self.stats.as_dict()
        try:
            too_small = self._budget_too_small(seq, matcher)
        except _Waiting as wait:  # admitted or refused once the search answers
            st.waiting_on = wait.key
            for name, value in counted.items():  # the replay counts once
                setattr(self.stats, name, value)
            return None
        if too_small is not None:
            return too_small
        params = seq.guide.loop_guard or self.loop_defaults
        if self._closers is None:
            self._loop_tables()
        if params.enabled and seq.grammar.kind in _LOOP_KINDS and {"s", "a", "o"} <= self._closers.keys():
            st.loop = LoopGuard(params, self.guided.closer.vocab, self._closers, self._shapes)
            # with stop strings the text is checked as it is made: nothing is held back
            st.hold = 0 if seq.params.stop else params.hold_tokens
        st.released = st.base = seq.num_output  # a continuation's was streamed already
        st.scan, st.scan_from, st.scan_marks = None, 0, []
        st.schema_row = self._schema_nodes(seq) is not None
        st.jump = self._schema_jump(seq) if st.schema_row else 0
        if not seq.guide.thinking_now:  # a thought's plan waits for its answer (begin_answer)
            self._plan_close_at_start(seq, matcher)
        return None

    def begin_answer(self, seq: GuidedRow, matcher) -> None:
        """A reasoning model's thought ended: the policy follows the answer from here
        (what admission found for the grammar's start holds here: the matcher saw no
        thought)."""
        st = seq.guide.ending
        st.released = st.base = seq.num_output
        st.scan, st.scan_from, st.scan_marks = None, seq.num_output, []
        if st.closing_estimate is not None:
            st.closing_estimate = (seq.num_output, st.closing_estimate[1])
        if st.closing_path is not None:
            st.closing_path = (seq.num_output,) + st.closing_path[1:]
        if matcher is not None:
            self._plan_close_at_start(seq, matcher)

    # after sampling -------------------------------------------------------------------------

    def steer(self, seqs: list[GuidedRow], token_ids: list[int], logprobs) -> set[int]:
        """Once per batch, before the matchers accept: a guided row planned to its shortest
        output takes the plan's token; one near its budget's end whose sampled token would
        leave no room to close takes the closing path's. A replaced token has no logprob.
        Returns the rows whose verdict waits for a search: their token is held
        (``OutputState.held``; the matcher has not seen it) until ``steer_held``."""
        held = set()
        for i, seq in enumerate(seqs):
            if seq.guide is None or not seq.guide.guided_now:
                continue
            st = seq.guide.ending
            st.waiting_on = None
            try:
                forced = st.forced_path[0] if st.forced_path else self._keep_closable(
                    seq, token_ids[i])
            except _Waiting as wait:
                st.waiting_on = wait.key
                st.held = (token_ids[i], logprobs[i] if logprobs else None)
                held.add(i)
                continue
            if forced is not None and forced != token_ids[i]:
                token_ids[i] = forced
                if logprobs:
                    logprobs[i] = None
        return held

    def steer_held(self, seq: GuidedRow) -> tuple[int, object] | None:
        """A held token's verdict, now that its search has ended: (the token, its logprob;
        the closing path's token, without one, where the drawn one could not close), or
        None while it waits for another search."""
        st = seq.guide.ending
        token, logprob = st.held
        held = [token]
        logprobs = [logprob]
        if self.steer([seq], held, logprobs):
            return None
        st.held = None
        return held[0], logprobs[0]

    def after_token(self, seq: GuidedRow, new: int = 1) -> tuple[list[int], str] | None:
        """After a guided row's ``new`` newest tokens were accepted (its sampled one, and
        any jump-forward appended after it) and the request goes on: a repeating
        value is cut and closed (the output is rewritten, None is returned: it goes on);
        then near the budget's end the closing path is forced: (its tokens, appended to
        the output already, and the finish reason)."""
        st = seq.guide.ending
        st.tick += 1
        if st.loop is not None and st.loop.active:  # spent: it records nothing more
            for token in seq.token_ids[len(seq.token_ids) - new:]:
                st.loop.push(token)
            cut = st.loop.find(lambda keep, closers: self._may_cut(seq, keep, closers))
            if cut is not None:
                self._cut(seq, cut)
        return self.close(seq)

    def close(self, seq: GuidedRow) -> tuple[list[int], str] | None:
        """Budget-aware closing from the output as it is (``after_token``'s second half;
        also a parked row's, once the search it waited for has answered): the closing
        path, appended, and the finish reason; None: it goes on, or waits for a search
        (``OutputState.waiting_on``: the engine parks the row, and calls this again)."""
        st = seq.guide.ending
        st.waiting_on = None
        try:
            closed = self._maybe_close(seq)
        except _Waiting as wait:
            st.waiting_on = wait.key
            return None
        if closed is not None:
            forced, reason = closed
            st.closed_early = reason == "length"
            seq.append(forced)
        return closed

    def release(self, seq: GuidedRow, final: bool) -> int:
        """How many more output tokens the stream may have now: all when the request
        finishes, else all but the newest ``hold`` (which a loop cut may still remove)."""
        st = seq.guide.ending
        upto = seq.num_output if final else max(st.released, seq.num_output - st.hold)
        n, st.released = upto - st.released, upto
        return n

    def _may_cut(self, seq: GuidedRow, keep: int, closers: tuple[int, ...]) -> bool:
        """Whether the loop guard may cut after ``keep`` output tokens and force
        ``closers``: nothing streamed is taken back, the grammar accepts them, and (cut at
        the newest token) the grammar does not force them anyway (``"aaaa"`` for
        ``a{4}``: that is no cut)."""
        keep += seq.guide.ending.base  # the guard counts the tokens it was shown
        if keep < seq.guide.ending.released:
            return False
        matcher = seq.guide.matcher
        if matcher is None:
            return False
        probe = matcher.fork()
        probe.rollback(seq.num_output - keep)
        if keep == seq.num_output:
            forced = probe.find_jump_forward_string()
            if forced and forced.encode().startswith(
                    b"".join(self.guided.closer.vocab[t] for t in closers)):
                return False
        return probe.accept_tokens(closers)

    def _cut(self, seq: GuidedRow, cut: LoopCut) -> None:
        """Rolls the output, its matcher and its KV back to ``cut.keep`` tokens, then
        appends the closers (accepted by the matcher; their KV is computed next step)."""
        st = seq.guide.ending
        drop = seq.num_output - (st.base + cut.keep)
        matcher = seq.guide.matcher
        matcher.rollback(drop)
        for t in cut.closers:
            matcher.accept_token(t)
        seq.rollback(drop)
        st.rolled_back(seq.num_output - st.scan_from)
        seq.append(cut.closers)  # (their KV is computed next step)
        st.loop.cut(cut.keep, cut.closers)
        st.loop_cuts.append(cut)
        st.reset_closing(seq.num_output)
        self.stats.loop_cuts += 1
        if len(st.loop_cuts) == 1:
            self.stats.loop_cut_outputs += 1

    # the end -------------------------------------------------------------------------------

    def report(self, seq: GuidedRow, reason: str, out: RequestOutput) -> None:
        """Closing, loop cuts and validation onto the final chunk (once per request)."""
        st = seq.guide.ending
        out.closed_early = st.closed_early
        out.loop_cuts = len(st.loop_cuts)
        if st.closed_early:
            self.stats.closed_early += 1
        elif reason == "length":
            self.stats.runaway += 1
        kind = seq.grammar.kind
        if kind not in ("json_schema", "json_object"):
            return
        schema = seq.grammar.source if kind == "json_schema" else None
        out.approximated = approximated_keywords(seq.grammar.parsed) if schema else []
        if seq.guide.validation == "off":
            return
        error = validate_json(schema, seq.resumed_text + seq.detokenizer.text)
        self.stats.validated += 1
        out.validation = "valid" if error is None else "invalid"
        if error is not None:
            self.stats.invalid += 1
            out.validation_error = error

    # budget-aware closing (see closing.py) ----------------------------------------------------

    def _plan_close_at_start(self, seq: GuidedRow, matcher) -> None:
        """A budget already down to the grammar's shortest output (plus ``closing_margin``)
        gets that output: one freely sampled token could leave no room to close. The
        prompt still runs (a session keeps its KV); its first token is the path's first,
        and the rest follows at once (``_maybe_close``)."""
        path, seq.guide.ending.closing_start = seq.guide.ending.closing_start, None
        if not path or (self.remaining(seq) > len(path) + self.config.closing_margin
                        and not seq.guide.ending.start_forced):
            return
        probe = matcher.fork()
        if probe.accept_tokens(path):
            seq.guide.ending.forced_path = path

    def _budget_too_small(self, seq: GuidedRow, matcher) -> str | None:
        """A message when the grammar's shortest output needs more tokens than a fresh
        request's budget (never for a failover's continuation: it goes on).

        A fresh JSON-schema request is first held against a lower bound from the schema's
        structure (shortest_bound.py: microseconds, once per grammar): a budget under it
        is refused at any size, with no search. Within the closing window the searches
        decide the rest. A fresh request's verdict is remembered per (grammar, budget): a
        verdict the bound or the searches proved is kept; one from searches cut short by
        their time limit (a busy engine, a grammar with no short completion) is reused
        for ``_MEMO_UNSURE_S`` and then searched again, so such grammars cost one search
        per few seconds, not one per request."""
        budget = self.remaining(seq)
        cfg = self.config
        if not cfg.closing_window:
            return None
        fresh = not seq.output_ids  # a continuation's state depends on what it resumes
        if budget > cfg.closing_window:
            if fresh and self.shortest_bound(seq) > budget:
                self.stats.budget_checks += 1
                return self._budget_verdict(seq, budget, self._bound_refusal(seq))
            if fresh and seq.guide.compiled is not None:
                self._estimate_at_start(seq, matcher, budget)
                facts = seq.guide.compiled.facts
                known = self._known_start(seq, matcher)
                if known is not None and len(known) <= budget <= cfg.closing_margin + max(
                        len(known), facts.checked_budget):
                    # a budget down to the output found from the start, or to the shortest
                    # output the grammar check reported (sent as max_tokens): admitted with
                    # that output, as within the window. Sampled freely, a large grammar's
                    # closing found only longer paths (Github_hard/o60179)
                    self.stats.budget_checks_memo += 1
                    seq.guide.ending.start_forced = True
                    return self._budget_verdict(seq, budget, _Verdict(path=list(known)))
            return None
        self.stats.budget_checks += 1
        facts = seq.guide.compiled.facts if fresh and seq.guide.compiled is not None else None
        known = self._known_start(seq, matcher) if facts is not None else None
        if known is not None and len(known) <= budget:
            # an output that fits was found from the start before (a request's search, the
            # grammar check's): admitted with it, so the verdict on a budget never depends
            # on how much time this search would get; at the budget the grammar check
            # reported, the output is that one (a request at it was cut unclosed)
            self.stats.budget_checks_memo += 1
            seq.guide.ending.start_forced = budget <= self.config.closing_margin + max(
                len(known), facts.checked_budget)
            return self._budget_verdict(seq, budget, _Verdict(path=list(known)))
        key = None
        if fresh:
            key = (seq.grammar.key(self.guided.fingerprint), budget)
            hit = self._budget_memo.get(key)
            if hit is not None and (hit[1] or time.monotonic() - hit[0] < _MEMO_UNSURE_S):
                self._budget_memo.move_to_end(key)
                self.stats.budget_checks_memo += 1
                return self._budget_verdict(seq, budget, hit[2])
        if fresh and self.shortest_bound(seq) > budget:
            verdict, certain = self._bound_refusal(seq), True
        else:
            pending = self.guided.closer.pending_bytes(seq.output_ids)
            answer = self._ask(seq, "budget", lambda c, m: self._budget_search(
                c, m, budget, pending), matcher, shared=key and ("budget",) + key)
            verdict, certain = answer.value, not answer.timed_out
        if facts is not None and verdict.path is not None:
            remember_start_path(seq.guide.compiled, verdict.path)
        if key is not None:
            self._budget_memo[key] = (time.monotonic(), certain, verdict)
            while len(self._budget_memo) > _BUDGET_MEMO_SIZE:
                self._budget_memo.popitem(last=False)
        refusal = self._budget_verdict(seq, budget, verdict)  # (sets up the closing path)
        # a continuation was admitted once and its client has tokens already: a worker's
        # death must not turn into a 400, so it goes on and closes what the budget allows
        return refusal if fresh else None

    def _estimate_at_start(self, seq: GuidedRow, matcher, budget: int) -> None:
        """A budget over the closing window: the dive's output from the grammar's start
        (milliseconds, at most twice per grammar, each given the closing probe's time;
        ``facts.start_dive``), kept as the closing estimate where it is longer than the
        window, so that closing begins in time for it. The probe at twice the window comes
        too late for such a grammar: 20 required properties left took more tokens to close
        than were left (real-world schemas cut unclosed at their budget).

        The dive's output, not the shortest one known (``start_path``, the witness): the
        dive takes the optional keys as they come, as an output sampled freely does, and
        its length is what closing such an output takes. A shortest output of 27 tokens
        (Github_hard/o60179 after a grammar check) left the window at its default, and an
        answer at 256 tokens was cut inside a string; the dive's 129 closes it."""
        need = self._schema_need(seq)
        if need is not None:  # the schema closer's, from the start: the witness (no search)
            if need + _GUARD_ZONE > self.config.closing_window:
                seq.guide.ending.closing_estimate = (seq.num_output, need)
                seq.guide.ending.prior_estimate = need
            return
        facts = seq.guide.compiled.facts
        dive = facts.start_dive
        if dive is None and facts.start_dives < _START_DIVES:
            # the probe's time (a busy machine cut 4x the search's short), 4x the nodes;
            # one dive per grammar, whichever of its requests asks
            probe_s = self.config.closing_probe_ms / 1000
            path = self._ask(seq, "start_dive", lambda c, m: c.estimate(
                m, 4 * budget + 16, scale=_START_SCALE,
                time_limit_s=max(probe_s, _START_SCALE * c.time_limit_s),
                max_expansions=_START_SCALE * c.max_expansions), matcher,
                shared=("start_dive", seq.grammar.key(self.guided.fingerprint))).value
            facts.start_dives += 1
            if path is not None:
                remember_start_path(seq.guide.compiled, path)
                facts.start_dive = dive = tuple(path)
        floor = dive if dive is not None else facts.start_path
        if floor is not None and len(floor) + _GUARD_ZONE > self.config.closing_window:
            seq.guide.ending.closing_estimate = (seq.num_output, len(floor))
            seq.guide.ending.prior_estimate = len(floor)

    def _known_start(self, seq: GuidedRow, matcher) -> tuple | None:
        """The shortest output of a fresh request's grammar known from its start: the
        searches' (``start_path``) or the schema's witness (schema_witness.py, built and
        replayed on a fork of ``matcher`` once per grammar: a large schema's search found
        only outputs with every optional key, Github_hard/o60179), whichever is shorter.
        The witness is not the closing estimate's floor (``_estimate_at_start``): it
        says what fits a budget, not how long an output sampled freely takes to close."""
        facts = seq.guide.compiled.facts
        if not facts.witness_known:
            facts.witness_path = start_witness(seq.grammar, matcher, self.guided.closer)
            facts.witness_known = True
        found = [p for p in (facts.start_path, facts.witness_path) if p is not None]
        return min(found, key=len) if found else None

    def shortest_bound(self, seq: GuidedRow) -> int:
        """A lower bound on the tokens of the grammar's shortest output (0: none known),
        computed once per grammar."""
        if seq.grammar.kind != "json_schema":
            return 0
        key = seq.grammar.key(self.guided.fingerprint)
        bound = self._bounds.get(key)
        if bound is not None:
            self._bounds.move_to_end(key)
            return bound
        if self._capacity is None:
            self._capacity = _vocab_tables(self.guided.closer.vocab)[0]
        bound = self._bounds[key] = self._capacity.bound(seq.grammar.parsed)
        while len(self._bounds) > _BUDGET_MEMO_SIZE:
            self._bounds.popitem(last=False)
        return bound

    def _bound_refusal(self, seq: GuidedRow) -> _Verdict:
        return _Verdict(need=f"at least {self.shortest_bound(seq)}")

    @staticmethod
    def _budget_search(closer, matcher, budget: int, pending: bytes) -> _Verdict:
        """The searches' verdict: a closing path that fits the budget, a refusal, or
        neither (``undecided`` when they found no completion in time). Given
        ``_START_SCALE`` times the search's time (``closer`` is this search's own clone):
        the verdict is once per (grammar, budget) and sliced off the batch's steps, and at
        1x the dive of a uuid record (67 ms of 100) ran out of time on a CPU whose sibling
        was busy, so a budget it refuses calm was admitted and ended invalid."""
        closer.time_limit_s = _START_SCALE * closer.time_limit_s
        found = closer.fitting(matcher, budget, pending=pending)
        if found.tokens is not None and len(found.tokens) <= budget:
            return _Verdict(path=found.tokens)
        if found.tokens is None:
            more = closer.shortest(matcher, max(4 * budget, 256), pending=pending)
            if more.tokens is not None and len(more.tokens) <= budget:
                return _Verdict()  # the first search was cut short; this one fits
            if more.tokens is None and not more.exhausted:
                return _Verdict(undecided=True)  # nothing found in time: no refusal
            found = more
        # the searches are heuristic: refuse what they prove (exhausted), or where the
        # shortest they found is well over the budget (a field of 36 fixed characters
        # opened at max_tokens=32: the output could only end invalid)
        if (found.tokens is not None and not found.exhausted
                and len(found.tokens) <= budget + budget // 4):
            return _Verdict()
        return _Verdict(need=f"more than {budget}" if found.tokens is None else
                        f"at least {len(found.tokens)}" if found.exhausted else
                        f"about {len(found.tokens)}")

    @staticmethod
    def _budget_verdict(seq: GuidedRow, budget: int, verdict: _Verdict) -> str | None:
        st = seq.guide.ending
        if verdict.path is not None:
            st.closing_estimate = (seq.num_output, len(verdict.path))
            st.closing_start = list(verdict.path)
            st.closing_path = (seq.num_output, list(verdict.path), 0)  # for _maybe_close
            return None
        if verdict.undecided:  # the admission's search gave up: the first give-up
            _gave_up(seq)
        if verdict.need is None:
            return None
        which = ("max_tokens" if budget == seq.params.max_new_tokens
                 else "the context left after the prompt")
        return (f"the {seq.grammar.kind} grammar's shortest output needs {verdict.need} "
                f"tokens, but {which} allows {budget}; raise max_tokens (or shorten the "
                "prompt)")

    def _maybe_close(self, seq: GuidedRow) -> tuple[list[int], str] | None:
        """Budget-aware closing (see closing.py). When the tokens left are down to the
        grammar's shortest completion (plus ``closing_margin``), returns that completion,
        already accepted by the request's matcher, and the finish reason; else None."""
        if seq.guide.ending.forced_path is not None:  # its first token was just taken: the rest now
            path, seq.guide.ending.forced_path = seq.guide.ending.forced_path[1:], None
            return self._force(seq, path)
        cfg = self.config
        left = self.remaining(seq)
        st = seq.guide.ending
        if not cfg.closing_window or st.closing_failed:
            return None
        est = st.closing_estimate
        if st.schema_row and (est is None or left <= est[1] + max(st.jump, _GROWTH * (
                seq.num_output - est[0])) + _GUARD_ZONE + cfg.closing_margin):
            # a schema's row: what closing needs is read off the schema as the output
            # goes (json_closing.py, no search), whenever it could have grown to the
            # tokens left; so closing begins in time whatever optional values the output
            # opened, without a dive. Where the guard has just replayed a closing path
            # from this very state (_keep_closable), its length is that estimate: no
            # reading of the schema (a long answer near its budget did, every step)
            # (or one the output has followed since: what is left of it, as _carried_path
            # reads it)
            at = st.closing_path
            need = None
            if at is not None and at[2] < _UNKNOWN:
                gone = seq.num_output - at[0]
                if gone == 0:
                    need = len(at[1])
                elif 0 < gone <= len(at[1]) and seq.output_ids[at[0]:] == list(at[1][:gone]):
                    need = len(at[1]) - gone
            if need is None:
                need = self._schema_need(seq)
            if need is not None:
                st.closing_estimate = (seq.num_output, need)
                st.closing_probed = True
        if (st.closing_estimate is None and not st.closing_probed
                and left <= 2 * cfg.closing_window):
            self._probe_closing(seq)
        if left > self._window(st):
            return None
        if seq.num_output < seq.guide.ending.closing_retry_at:
            return None
        est = seq.guide.ending.closing_estimate
        if est is not None:
            # one token grows the shortest completion by a few tokens at most (it can open
            # a string, an object and a key at once): skip the search while far from it
            # (within _GUARD_ZONE of it, every step searches: the guard in _keep_closable
            # needs this step's path, and one token such as ', {"' can add more than that)
            at, need = est
            if left > max(need + max(st.jump, _GROWTH * (seq.num_output - at)),
                          need + _GUARD_ZONE) + cfg.closing_margin:
                return None
        matcher = seq.guide.matcher
        if matcher is None:
            return None
        carried, slack = self._carried_path(seq, matcher)
        if carried is not None and (left > len(carried) + cfg.closing_margin
                                    or slack <= _TRUSTED_SLACK and len(carried) <= left):
            # the last path still closes from here (followed or replayed: microseconds,
            # where a search costs milliseconds). One that may be longer than the
            # shortest from here by more than _TRUSTED_SLACK is searched again before it
            # is emitted
            self.stats.closing_reused += 1
            found = Completion(carried, False)
        elif (written := self._schema_path(seq, matcher)) is not None and len(written) <= left:
            # the schema says what is left (json_closing.py): no search. Taken as the
            # reference (slack 0): it may be a little longer than the shortest, which
            # only closes a little early (one that does not fit: the search may know a
            # shorter)
            self.stats.closing_schema += 1
            found, slack = Completion(written, False), 0
        else:
            pending = self.guided.closer.pending_bytes(seq.output_ids)
            found = self._ask(seq, "fitting", lambda c, m: c.fitting(m, left, pending=pending),
                              matcher).value
            self.stats.closing_searches += 1
            if carried is not None and (found.tokens is None
                                        or len(found.tokens) > len(carried)):
                found = Completion(carried, found.exhausted)  # cut short: the replayed one
            else:
                slack = 0
            if found.tokens is None or len(found.tokens) > left:
                # no completion fits: stop searching once that is certain (the shortest
                # only grows as the budget shrinks); a search that gave up is tried again
                # later (see _gave_up), unless a dive's path closes from here: it becomes
                # the closing path, replayed on the next steps and emitted when the budget
                # is down to it (at once when that is near: nothing guards it on the way)
                if not found.exhausted:
                    fallback = self._fallback(seq, matcher, left)
                    if fallback is not None:
                        self.stats.closing_fallbacks += 1
                        if left > len(fallback) + cfg.closing_margin + _GUARD_ZONE:
                            seq.guide.ending.closing_path = (seq.num_output, fallback, _UNKNOWN)
                            return None
                        return self._force(seq, fallback)
                    _gave_up(seq)
                    self.stats.closing_giveups += 1
                else:
                    seq.guide.ending.closing_failed = True
                return None
        seq.guide.ending.closing_estimate = (seq.num_output, len(found.tokens))
        if left > len(found.tokens) + cfg.closing_margin:
            # near the end, the next sampled token is checked against this path: one
            # token can cost many (", " in an array opens a whole object)
            seq.guide.ending.closing_path = (seq.num_output, found.tokens, slack)
            return None
        if not found.tokens and self.guided.mask.only_stop_allowed(matcher):
            return [], "stop"  # complete, and the grammar allows nothing more
        return self._force(seq, found.tokens)

    def _window(self, st: OutputState) -> int:
        """The closing window: tokens left at which closing begins. A completion longer
        than the default (many required properties still to come) widens it, so closing
        starts early enough for it. The grammar's length from its start stays a floor: a
        short completion found near the end (close a list) does not shrink the window back
        while an optional object with required keys may still open in it
        (WashingtonPost/wp_100 was cut inside a string at 512)."""
        window = self.config.closing_window
        for estimate in (st.closing_estimate and st.closing_estimate[1], st.prior_estimate):
            if estimate:
                window = max(window, estimate + _GUARD_ZONE + self.config.closing_margin)
        if st.jump and st.closing_estimate:  # a schema's row: room for its longest choice
            window = max(window, st.closing_estimate[1] + st.jump + _GUARD_ZONE
                         + self.config.closing_margin)
        return window

    def _probe_closing(self, seq: GuidedRow) -> None:
        """Once per request, at twice the closing window from its budget's end: the dive's
        completion length (milliseconds), kept as the closing estimate when it is longer
        than the window, so that closing begins in time for it (a completion of 50 tokens
        found at 48 left cannot be emitted any more)."""
        st = seq.guide.ending
        matcher = seq.guide.matcher
        if matcher is None:
            st.closing_probed = True
            return
        path = self._dive(seq, matcher)
        st.closing_probed = True
        if path is not None and len(path) + _GUARD_ZONE > self.config.closing_window:
            st.closing_estimate = (seq.num_output, len(path))

    def _dive(self, seq: GuidedRow, matcher) -> list[int] | None:
        """The closing probe's dive from here, kept as the request's fallback. A request's
        dives get ``closing_probe_ms`` and ten times the search's nodes (a large grammar's
        dive needs them) until they have taken ``_LONG_PROBES`` times that time in all (a
        dive of a large grammar takes about 0.1 s, and each loop cut needs a new one), the
        others the search's own caps."""
        st = seq.guide.ending
        written = self._schema_path(seq, matcher)
        if written is not None:
            self.stats.closing_probes += 1
            st.fallback = (seq.num_output, written)
            return written
        closer = self.guided.closer
        caps = {}
        probe_s = self.config.closing_probe_ms / 1000
        long = probe_s > 0 and st.long_probe_s < _LONG_PROBES * probe_s
        if long:
            caps = {"time_limit_s": probe_s, "max_expansions": 10 * closer.max_expansions}
        limit, pending = 4 * self.remaining(seq) + 16, closer.pending_bytes(seq.output_ids)
        answer = self._ask(seq, "long_dive" if long else "dive", lambda c, m: c.estimate(
            m, limit, pending=pending, **caps), matcher)
        path = answer.value
        self.stats.closing_probes += 1
        if long:
            st.long_probe_s += answer.cpu_s
        if path is not None:
            st.fallback = (seq.num_output, path)
        return path

    def _fallback(self, seq: GuidedRow, matcher, left: int) -> list[int] | None:
        """Where a search is cut short: the last dive's path if it still closes the output
        from here (its rest, when the tokens since were its own; else replayed whole on a
        fork), else a new dive's (``_dive``: long while the request has long probes left);
        None when none fits ``left``."""
        st = seq.guide.ending
        path = None
        if st.fallback is not None:
            at, dived = st.fallback
            since = seq.output_ids[at:]
            if since == dived[:len(since)]:
                path = dived[len(since):]
            elif _closes(matcher, dived):
                path = list(dived)
        if path is None:
            path = self._dive(seq, matcher)
        return path if path is not None and len(path) <= left else None

    @staticmethod
    def _carried_path(seq: GuidedRow, matcher) -> tuple[list[int] | None, int]:
        """The closing path last found for this request, if it still closes the output
        from here, and its slack: by how many tokens it may be longer than the shortest
        from here. Its rest, when the tokens since were its own (the rest of a shortest
        path is the shortest from there); else the whole path, when the matcher, forked,
        accepts it and may end after it (the usual case inside a string: another word
        leaves '", "tags": []}' as it was).

        The slack follows from one bound: a token shortens the shortest completion by one
        at most. A path found by a search has none (a search is the reference); k tokens
        after a path of length L with slack s, the shortest is at least L - s - k long."""
        at = seq.guide.ending.closing_path
        if at is None:
            return None, _UNKNOWN
        at_output, path, slack = at
        since = seq.output_ids[at_output:]
        if since == path[:len(since)]:
            return path[len(since):], slack
        if _closes(matcher, path):
            return list(path), slack + len(since)
        return None, _UNKNOWN

    def _keep_closable(self, seq: GuidedRow, token: int) -> int | None:
        """Within the closing window (or ``_GUARD_ZONE`` tokens of the closing path found
        for this very state, where that is further): the sampled token if the output can
        still close after it within the budget, else the path's first token (which can).
        None: not checked. The whole window, not only the path's last tokens: one token
        there (', ' before an optional object's key, a free key that names an object
        schema) can commit the output to a value of many required keys, longer than what
        is left (WashingtonPost/wp_100)."""
        st = seq.guide.ending
        at_path = st.closing_path
        matcher = seq.guide.matcher
        if at_path is None or not at_path[1] or matcher is None:
            return None
        left = self.remaining(seq) - 1  # after this token
        if at_path[0] != seq.num_output:
            # a path found some steps back (the search was skipped since): brought to this
            # state where it still closes from here (microseconds), within the window
            if left > self._window(st):
                return None
            carried, slack = self._carried_path(seq, matcher)
            if not carried:
                return None
            at_path = st.closing_path = (seq.num_output, carried, slack)
        path = at_path[1]
        # a path no search stands behind (a dive's, where every search gives up) is held
        # at any distance from the budget's end: it is the only way out known, and the
        # next search would give up again
        unsure = at_path[2] >= _UNKNOWN
        if token == path[0] or (left > max(len(path) + _GUARD_ZONE, self._window(st))
                                and not unsure):
            return None
        probe = matcher.fork()
        if not probe.accept_token(token):
            return None  # not the grammar's: the guard in the sampler handles it
        if probe.is_terminated():
            return None  # a stop token where the grammar may end: the output ends here
        closer = self.guided.closer
        if len(path) <= left and self._string_goes_on(seq, probe, token, path):
            # another piece of a free string: the path as it was, known from its first
            # few tokens (slack as below)
            slack = at_path[2] + 1
            if closer.same_place(matcher, probe):
                slack = at_path[2]
            seq.guide.ending.closing_path = (seq.num_output + 1, path, slack)
            return None
        # no search where the path still closes after this token: as it was (another word
        # in a string), its rest with the token in its first one's place (a digit for
        # a digit in a fixed-width pattern: a phone number's regex searched at every
        # digit), or what is left of its text once the token's own is taken off (' "'
        # sampled where the path begins '""'). Its slack (see _carried_path) grows by one
        # unless it got one shorter, or the token left the parser where it was
        # (tried lazily: the text's re-encoding only where the first two fail)
        for again in (path, path[1:], None):
            if again is None:
                again = closer.rest_after(path, token)
            if again is not None and len(again) <= left and _closes(probe, again):
                slack = at_path[2] + 1 - (len(path) - len(again))
                if slack > at_path[2] and closer.same_place(matcher, probe):
                    slack = at_path[2]
                seq.guide.ending.closing_path = (seq.num_output + 1, again, max(slack, 0))
                return None
        written = self._schema_path(seq, probe, token)
        if written is not None:  # the schema's completion after this token (no search)
            self.stats.closing_schema += 1
            if len(written) <= left:
                seq.guide.ending.closing_path = (seq.num_output + 1, written, 0)
                return None
            self.stats.closing_steered += 1
            return path[0]
        if unsure and left > len(path) + _GUARD_ZONE:
            self.stats.closing_steered += 1  # (no search: see above)
            return path[0]
        pending = closer.pending_bytes(seq.output_ids + [token])
        found = self._ask(seq, ("keep", token), lambda c, m: c.shortest(
            m, 2 * left + 8, pending=pending), probe).value
        self.stats.closing_searches += 1
        if found.tokens is not None and len(found.tokens) <= left:
            seq.guide.ending.closing_path = (seq.num_output + 1, found.tokens, 0)  # for _maybe_close
            return None
        self.stats.closing_steered += 1
        return path[0]

    def _string_goes_on(self, seq: GuidedRow, probe, token: int, path) -> bool:
        """Whether ``path`` (a closing path from before ``token``) still closes after it,
        ``probe`` being the matcher that has accepted it, known without replaying the
        whole path: ``token`` writes more of a free string (no quote or backslash in it;
        ``JsonScan.in_free_string``), and the path's part up to the quote that ends the
        string still ends it after ``token`` (replayed: a few tokens). A string's text
        leaves the parser's state after the string as it was, so the path's rest closes
        from there as it did. A long answer near its budget replayed its whole path, some
        hundreds of tokens, at every token of its strings (tests/engine/
        test_keep_closable_engine.py compares the two verdicts)."""
        vocab = self.guided.closer.vocab
        data = vocab[token]
        if not data or b'"' in data or b"\\" in data:
            return False
        scan = self._scan(seq)
        if scan is None or not scan.in_free_string():
            return False
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        for end, t in enumerate(path):
            text = vocab[t]
            quote = text.find(b'"')
            if b"\\" in (text if quote < 0 else text[:quote]):
                return False
            if quote >= 0:
                break
        else:
            return False
        check = probe.fork()
        return check.accept_tokens(list(path[:end + 1]))

    # the schema closer (json_closing.py) ---------------------------------------------------

    def _schema_nodes(self, seq: GuidedRow) -> SchemaNodes | None:
        kind = seq.grammar.kind
        if (kind not in _LOOP_KINDS or self.guided.closer.encode is None
                or not getattr(self.config, "schema_closing", True)):
            return None
        key = seq.grammar.key(self.guided.fingerprint)
        if key not in self._schemas:
            schema = seq.grammar.parsed if kind == "json_schema" else {"type": "object"}
            self._schemas[key] = SchemaNodes(schema) if isinstance(schema, (dict, bool)) else None
            while len(self._schemas) > _BUDGET_MEMO_SIZE:
                self._schemas.popitem(last=False)
        else:
            self._schemas.move_to_end(key)
        return self._schemas[key]

    def _scan(self, seq: GuidedRow) -> JsonScan | None:
        """The row's reader of its document, fed up to its newest token (incremental:
        one token's bytes a step; rebuilt after a cut, which clears it)."""
        st = seq.guide.ending
        nodes = self._schema_nodes(seq)
        if nodes is None:
            return None
        ids = seq.output_ids
        have = len(ids) - st.scan_from
        scan, marks = st.scan, st.scan_marks
        if scan is None or scan.tokens > have:
            st.rolled_back(have)
            scan = st.scan = marks[-1].clone() if marks else JsonScan(nodes)
        vocab = self.guided.closer.vocab
        for t in ids[st.scan_from + scan.tokens:]:
            scan.feed_bytes(vocab[t])
            scan.tokens += 1
            if scan.tokens % _MARK_EVERY == 0:
                marks.append(scan.clone())
        return scan

    def _schema_jump(self, seq: GuidedRow) -> int:
        """The most tokens one choice of the model adds to the row's completion
        (``SchemaNodes.jumps``), once per grammar."""
        nodes = self._schema_nodes(seq)
        if nodes.jump is None:
            texts = nodes.jumps(_LAYOUTS[0])
            nodes.jump = max((len(self.guided.closer.encode(t)) for t in texts), default=0)
        return nodes.jump

    def _schema_need(self, seq: GuidedRow) -> int | None:
        """The schema closer's completion length in tokens, unverified (an estimate: a
        path is verified before it is taken); None where it has none. Counted piece by
        piece (``JsonScan.completion_parts``), each piece's count kept: a long answer's
        completion is hundreds of tokens, asked for every step near the budget, and only
        its innermost piece changes from one step to the next. A sum of pieces may count
        a token or two more than the whole (a merge across a seam): closing then begins
        that much earlier."""
        scan = self._scan(seq)
        if scan is None:
            return None
        parts = scan.completion_parts(_LAYOUTS[0])
        if parts is None:
            return None
        counts, encode, need = self._piece_tokens, self.guided.closer.encode, 0
        for part in parts:
            if not part:
                continue
            n = counts.get(part)
            if n is None:
                if len(counts) >= _PIECES_KEPT:
                    counts.clear()
                n = counts[part] = len(encode(part))
            need += n
        return need

    def _schema_path(self, seq: GuidedRow, matcher, token: int | None = None) -> list[int] | None:
        """The schema closer's completion of the output (and ``token`` after it, which
        ``matcher`` has accepted already) as tokens: replayed on a fork of ``matcher``
        (every token accepted, the grammar may end after) and the whole text valid for the
        schema; else None (the caller searches)."""
        scan = self._scan(seq)
        if scan is None or scan.broken:
            return None
        closer = self.guided.closer
        if token is not None:
            scan = scan.clone()
            scan.feed_bytes(closer.vocab[token])
        text = None
        for layout in _LAYOUTS:
            rest = scan.completion(layout)
            if rest is None:
                return None
            tokens = closer.encode(rest) if rest else []
            probe = matcher.fork()
            if not (probe.accept_tokens(tokens) and probe.is_completed()):
                continue
            if seq.grammar.kind == "json_schema":
                if text is None:
                    ids = seq.output_ids[seq.guide.ending.scan_from:]
                    text = b"".join(closer.vocab[t] for t in ids + (
                        [token] if token is not None else [])).decode("utf-8", "replace")
                if validate_json(seq.grammar.parsed, text + rest) is not None:
                    continue
            return tokens
        return None

    def _ask(self, seq: GuidedRow, name, search, matcher, shared=None) -> "_Answer":
        """``search(closer, matcher)`` for this request's current state, on a fork of
        ``matcher`` and a closing search of its own, as a sliced search
        (search_slices.py): the answer this state got already, or the search's when it
        ends within the step's budget; else ``_Waiting`` is raised (the decision is
        replayed when it has ended). ``shared``: the key under which other requests'
        identical search is the same one (a grammar's start, a fresh budget's verdict)."""
        st = seq.guide.ending
        if st.answers_tick != st.tick:
            st.answers, st.answers_tick = {}, st.tick
        if name in st.answers:
            return st.answers[name]
        key = shared if shared is not None else (seq.request_id, st.tick, name)
        job = None
        if key not in self.slices:
            closer, due, fork = self.guided.closer, self.slices.due, matcher.fork()

            def job():
                own = closer.clone(due)
                try:
                    return search(own, fork), own.stats["timeouts"] > 0
                finally:
                    for counter, n in own.stats.items():
                        closer.stats[counter] += n
        done = self.slices.run(key, seq.request_id, job)
        if done is None:
            self.stats.closing_waits += 1
            raise _Waiting(key)
        answer = st.answers[name] = _Answer(*done.value, done.cpu_s)
        return answer

    def forget(self, seq: GuidedRow) -> None:
        """The request ended: the searches only it waited for are dropped."""
        self.slices.drop(seq.request_id)

    def _force(self, seq: GuidedRow, tokens: list[int]) -> tuple[list[int], str]:
        """Feeds a closing path to the request's matcher (which checks every token)."""
        matcher = seq.guide.matcher
        for i, t in enumerate(tokens):
            if matcher is None or not matcher.accept_token(t):
                logger.error("closing: the grammar refused forced token %d", t)
                return tokens[:i], "length"
        return tokens, "length"



_GUARD_ZONE = 12  # tokens above the closing path within which sampled tokens are checked
_LONG_PROBES = 2  # a request's dives with the probe's caps: this many times its time in all
_START_SCALE = 4  # the dive from a grammar's start: 4x the nodes (and at least 4x the time)
_START_DIVES = 2  # dives from a grammar's start per grammar (one cut short is tried again)
_GIVEUPS = 3  # searches cut short (admission's included) before a request stops searching
_RETRY_BASE = 4  # the k-th give-up is retried _RETRY_BASE ** k tokens later
_TRUSTED_SLACK = 2  # a path at most this much longer than the shortest is emitted unsearched
_UNKNOWN = 1 << 30  # the slack of a path that no search stands behind
_GROWTH = 3  # how much one token may lengthen the shortest completion (see _maybe_close)


_VOCAB_TABLES: OrderedDict = OrderedDict()  # vocabulary -> (capacity, closers, shapes)
_VOCAB_LOCK = threading.Lock()


def _vocab_tables(vocab: list[bytes]) -> tuple:
    """A vocabulary's tables (``TokenCapacity`` with its cover tables, the loop guard's
    ``closer_ids`` and ``token_shapes``), built once per process for each vocabulary
    (engines of one model share them; read-only once built). Built outside the lock: two
    threads that ask at once may both build, and one copy is kept."""
    key = (len(vocab), hash(tuple(vocab)))
    with _VOCAB_LOCK:
        got = _VOCAB_TABLES.get(key)
    if got is None:
        capacity = TokenCapacity(vocab)
        capacity.prepare()
        got = (capacity, closer_ids(vocab), token_shapes(vocab))
        with _VOCAB_LOCK:
            got = _VOCAB_TABLES.setdefault(key, got)
            while len(_VOCAB_TABLES) > 4:
                _VOCAB_TABLES.popitem(last=False)
    return got


def _gave_up(seq: GuidedRow) -> None:
    """A completion search for this request was cut short (node cap or time): searched
    again 4, then 16 tokens later, then never. A grammar the search cannot decide in
    time rarely becomes decidable a token later, and each try stalls the whole batch for
    up to ``closing_search_ms``."""
    st = seq.guide.ending
    st.closing_giveups += 1
    st.closing_retry_at = seq.num_output + _RETRY_BASE ** st.closing_giveups
    st.closing_failed = st.closing_giveups >= _GIVEUPS


def _closes(matcher, tokens: list[int]) -> bool:
    """Whether ``tokens`` take the matcher's output to where it may end (tried on a fork:
    microseconds)."""
    probe = matcher.fork()
    return probe.accept_tokens(tokens) and probe.is_completed()

def start_witness(grammar, matcher, closer) -> tuple | None:
    """A JSON-schema grammar's witness as tokens from ``matcher`` (at the grammar's start;
    schema_witness.py), or None (another kind, or no witness the grammar accepts)."""
    if grammar.kind != "json_schema" or closer.encode is None:
        return None
    path = witness_tokens(grammar.parsed, matcher, closer.encode)
    return None if path is None else tuple(path)


def remember_start_path(compiled, path: list[int]) -> None:
    """Keeps ``path`` (an output of ``compiled`` found from its start) as the grammar's
    ``start_path`` when it is shorter than the one known."""
    compiled.facts.remember_start_path(path)


_BUDGET_MEMO_SIZE = 4096  # (grammar, budget) admission verdicts kept
_LAYOUTS = ((", ", ": "), (",", ":"))  # JSON's usual layouts, tried in turn
_MEMO_UNSURE_S = 5.0  # how long a verdict from searches cut short is reused
_PIECES_KEPT = 8192
_MARK_EVERY = 32  # output tokens between two copies of a row's reader (OutputState.scan_marks)  # completion pieces whose token count _schema_need keeps
