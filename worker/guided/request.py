"""The guided path as the engine sees it: one ``GuidedPath`` per engine, one
``GuidedRequest`` per request that has a grammar or a thought (the row's ``guide``; a
plain request has None). A row is the engine's ``Sequence`` seen through ``GuidedRow``, the
engine's config is seen through ``GuidedConfig`` (rows.py): nothing here imports the engine.
The engine's step calls these hooks and nothing else of the guided path:

    seq.guide = path.attach(seq, request, resumed)  # on arrival: grammar asked, thought set up
    outcome = seq.guide.admit()              # grammar ready: matcher, resumed output, budget
    path.steer(rows, token_ids, logprobs)    # after the batch's draw (closing, forced paths)
    outcome = seq.guide.after_sample(token, logprob, status)   # per row: the token's effect
    n = seq.guide.releasable(final)          # how many output tokens the stream may have
    seq.guide.finish(reason, out, waiting)   # matcher freed, thought and report on the chunk

and the step reads two of its fields: ``grammar_future`` (the request waits for it) and
``mask_matcher`` (the matcher that fills the row's mask this step; None: not masked).

The request's guided state is the GuidedRequest's alone (the row holds none of it):
its grammar's future, then the compiled grammar and a matcher of its own, its
``Thinking`` (reasoning.py), the output policy's ``OutputState`` (``ending``), and the
grammar's cached facts (the compiled grammar's ``facts``, the answer room per grammar
here). How a guided output ends (budget check, closing, loop guard, jump-forward,
validation) is decided in this package only.

The thought is a phase of the request (no mask, no policy until it ends), not a wrapper
around its matcher as SGLang's reasoner wraps a grammar object: its end is decided on
text (a marker spans tokens, and a token holding thought and answer is split), it swaps
the detokenizer and sets the answer's room in the budget, and an unguided request has one
with no grammar at all. The mask sees the phase in one place, ``mask_matcher``.

Why one module over 500 lines: the hooks act on one request's phases in a fixed order
(a thought, the marker, the answer under its grammar); each step they take (the policy,
the searches, reasoning's text rules, jump-forward) lives in its own module.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

from core.errors import ErrorKind
from core.request import GenerationRequest, RequestOutput
from worker.guided.detokenizer import GrammarStopCheck, IncrementalDetokenizer, fast_encoder
from worker.guided import bitmask
from worker.guided.guided_process import GuidedDecodingManager
from worker.guided.jump_forward import JumpForward, JumpStats
from worker.guided.output_policy import OutputPolicy, OutputState, PolicyStats
from worker.guided.search_slices import SliceStats
from worker.guided.rows import GuidedConfig, GuidedRow
from worker.guided.reasoning import (OPEN, Thinking, from_template, generation_prompt,
                                     opens_thought, prompt_thought, split_marker_token,
                                     thought_end)
from worker.guided.validation import not_checked

logger = logging.getLogger(__name__)
_BUILD_LOCK = threading.Lock()

_ANSWER_SLACK = 8  # tokens a thought leaves above the answer's known length (reasoning.py)


@dataclass
class ThoughtStats:
    """Counters of reasoning models' thoughts."""

    thinking_tokens: int = 0  # output tokens of thoughts (markers included)
    thoughts_forced: int = 0  # thoughts whose end marker was forced (budget, a stop)


@dataclass
class GuidedCounters(ThoughtStats, JumpStats, PolicyStats, SliceStats):
    """Every counter of the guided path (how outputs ended: closing, the loop guard,
    validation; jump-forward; thoughts): the guided fields of the engine's stats."""


@dataclass
class Outcome:
    """What a hook decided for its request: ``finish`` (a finish reason) ends it with the
    chunk's parts; None goes on with them. ``plain``: the row turned out to be a plain
    one (a thought that never opened): the engine appends the token as such, after
    ``text``."""

    finish: str | None = None
    text: str = ""
    new_tokens: list[int] = field(default_factory=list)
    logprobs: list | None = None
    reasoning: str = ""
    error: str | None = None
    error_kind: ErrorKind | None = None
    plain: bool = False
    # the request waits for a closing search (worker/guided/search_slices.py): the engine
    # holds its row out of the batch until ``GuidedPath.begin_step`` says it ended, then
    # calls ``GuidedRequest.resume``
    park: bool = False


@dataclass
class Accepted:
    """A held token's acceptance (the fields of the batch's ``RowStatus``)."""

    terminated: bool = False
    stop: bool = False
    error: str | None = None
    error_kind: ErrorKind | None = None


class GuidedPath:
    """An engine's guided path: the grammar manager (``manager``: compiles, matchers, the
    batch bitmask), the output policy, the reasoning markers and jump-forward, shared by
    its requests; counters for the engine's stats."""

    def __init__(self, config: GuidedConfig, tokenizer, *,
                 manager: GuidedDecodingManager | None, eos_ids: set[int],
                 remaining: Callable[[GuidedRow], int]):
        """``remaining(seq)``: the tokens a request may still generate (the engine's
        budget: max_new_tokens and the context, a thought's owed marker taken off)."""
        self.config, self.tokenizer, self.manager = config, tokenizer, manager
        self.eos_ids = eos_ids
        self.remaining = remaining
        # how guided outputs end: budget checks, closing, the loop guard, validation
        self.policy = OutputPolicy(config, manager, remaining) if manager is not None else None
        # reasoning models (reasoning.py): the end marker as tokens (what a budget forces),
        # and per grammar the length of an answer known to fit (the room a thought leaves)
        reasoning = config.reasoning
        if reasoning is None:  # a reasoning model's chat template names its markers
            reasoning = from_template(tokenizer)
        self.reasoning = reasoning or None
        self.end_ids = tokenizer(self.reasoning.end, add_special_tokens=False)[
            "input_ids"] if self.reasoning is not None else []
        self._answer_room: dict[str, int] = {}
        self._generation_prompt: tuple[str | None] | None = None  # read on first chat
        self.thinking_tokens = self.thoughts_forced = 0
        self._jumper: JumpForward | None = None  # built on first use (reads the vocabulary)

    @classmethod
    def build(cls, config: GuidedConfig, tokenizer, vocab_size: int, eos_ids: set[int],
              device, *, remaining, grammar_fetch=None, grammar_limits=None) -> "GuidedPath":
        """The path of an engine on ``device``: a grammar manager when ``config.guided``
        (its mask kernel warmed up on the CPU, its bitmask pinned for a GPU)."""
        manager = None
        if config.guided:
            manager = GuidedDecodingManager.from_tokenizer(
                tokenizer, vocab_size, sorted(eos_ids),
                max_batch_size=config.max_num_seqs, grammar_fetch=grammar_fetch,
                cache_bytes=config.grammar_cache_bytes, default_engine=config.grammar_engine,
                compile_processes=config.compile_processes(grammar_limits),
                compile_limits=grammar_limits,
                fill_threads=config.grammar_fill_threads)
            manager.closer.time_limit_s = config.closing_search_ms / 1000
            if device.type == "cpu":  # compile the mask kernel off the hot path
                threading.Thread(target=bitmask.warmup, daemon=True).start()
            elif device.type == "cuda":  # pinned: its copy to the GPU is async
                manager.mask.bitmask = manager.mask.bitmask.pin_memory()
        path = cls(config, tokenizer, manager=manager, eos_ids=eos_ids, remaining=remaining)
        if manager is not None:  # the vocabulary's tables, off the engine thread
            threading.Thread(target=path.prepare, name="guided-prepare", daemon=True).start()
        return path

    def prepare(self) -> None:
        """Builds what the first guided request would otherwise build on the engine
        thread (a new grammar's admission stalled the batch for half a second: the
        bound's cover tables, the loop guard's tables, jump-forward's sorted vocabulary).
        Each is published whole; a request that comes first builds its own."""
        try:
            self.policy.prepare()
            jumper = self.jumper
            if jumper is not None:
                jumper.prepare()
        except Exception:  # (a preparation, never a failure: the request builds it)
            logger.exception("preparing the guided path's tables failed")

    @property
    def jumper(self) -> JumpForward | None:
        """Jump-forward decoding (None when off or unguided)."""
        if self.manager is None or not self.config.jump_forward:
            return None
        if self._jumper is None:
            with _BUILD_LOCK:  # (prepare builds it beside the engine's first requests)
                if self._jumper is None:
                    self._jumper = JumpForward(self.manager.closer.vocab,
                                               fast_encoder(self.tokenizer))
        return self._jumper

    def stats(self) -> dict:
        """The path's counters (``GuidedCounters``' fields)."""
        return dict(thinking_tokens=self.thinking_tokens, thoughts_forced=self.thoughts_forced,
                    **(self.policy.stats if self.policy else PolicyStats()).as_dict(),
                    **asdict(self.policy.slices.stats if self.policy else SliceStats()),
                    **(self._jumper.stats if self._jumper else JumpStats()).as_dict())

    def owed(self, seq: GuidedRow) -> int:
        """Tokens a request's budget must keep for what it owes: while it thinks, a token
        of thought at least and the end marker."""
        return len(self.end_ids) + 1 if seq.guide is not None and seq.guide.thinking_now else 0

    # hooks --------------------------------------------------------------------------------

    def attach(self, seq: GuidedRow, request: GenerationRequest,
               resumed: list[int]) -> "GuidedRequest | None":
        """A new request's guided part, before its resumed output is appended: its grammar
        asked for (the sequence then waits for it: ``GuidedRequest.grammar_future``) and, for a
        reasoning model's request that starts in a thought, the thought set up (its own
        detokenizer). None for a plain request. A ValueError changes nothing."""
        if request.grammar is not None and self.manager is None:
            raise ValueError("guided decoding is disabled in this engine (EngineConfig.guided)")
        thinking = None
        if self.reasoning is not None:  # None: the request starts in its answer
            thinking = self._thinking(seq, request, resumed)
        if thinking is None and request.grammar is None:
            return None
        guide = GuidedRequest(self, seq, request, thinking)
        if request.grammar is not None:
            guide.grammar_future = self.manager.get_grammar(request.grammar, request.client,
                                                            waiter=True)
        return guide

    def begin_step(self) -> set[str]:
        """Once per engine step, first: the closing searches' slices of this step run
        (search_slices.py); returns the ids of the requests whose search ended (a parked
        row's ``resume``, a waiting request's ``admit``, is due)."""
        if self.policy is None:
            return set()
        self.policy.slices.begin_step()
        return self.policy.slices.advance()

    @property
    def searching(self) -> bool:
        """Whether a closing search is still under way (the engine keeps stepping)."""
        return self.policy is not None and self.policy.slices.pending

    def steer(self, seqs: list[GuidedRow], token_ids: list[int], logprobs) -> set[int]:
        """Once per batch, after the draw and before the matchers accept: the output
        policy's forced tokens (a planned shortest output, the closing path). Returns the
        rows whose token is held for a search's verdict: the engine parks them, their
        token not accepted, and ``GuidedRequest.resume`` takes it up."""
        if self.policy is None:
            return set()
        return self.policy.steer(seqs, token_ids, logprobs)

    # reasoning ----------------------------------------------------------------------------

    def _raw(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _thinking(self, seq: GuidedRow, request: GenerationRequest,
                  resumed: list[int]) -> Thinking | None:
        """A reasoning model's request that starts in a thought: its rendered prompt ends
        inside an open one (``_prompt_thought``), or, unguided, its prompt holds no marker
        and its output may still open one itself (a detokenizer of its own for the
        thought, special tokens kept, no stop strings); a continuation whose resumed
        output already holds the end marker goes on in its answer. None when it starts in
        its answer (answered directly; guided: from its first token): every other prompt,
        or (no marker, unguided) an output so far that does not open a thought
        (reasoning.py)."""
        prompt_ids = seq.prompt_ids
        state = self._prompt_thought(request.prompt, prompt_ids)
        opening = state is None and request.grammar is None
        if state != OPEN and not opening:
            return None
        if opening and resumed and opens_thought(self._raw(resumed),
                                                 self.reasoning.start) is False:
            return None
        end = thought_end(self._raw, resumed, self.reasoning.end) if resumed else None
        thought = resumed if end is None else resumed[:end]
        text = self._raw(thought).rstrip("\ufffd") if thought else ""
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=(),
                                                 skip_special_tokens=False,
                                                 resumed_token_ids=thought, resumed_text=text)
        budget = request.thinking_token_budget
        if budget is None:
            budget = self.config.thinking_token_budget
        room = request.params.max_new_tokens - len(self.end_ids) - 1
        th = Thinking(self.reasoning, self.end_ids,
                      room if budget is None else min(budget, room))
        th.tokens = len(thought)
        th.opening = opening and opens_thought(text, self.reasoning.start) is None
        th.feed(text)  # the caller has this thought's text already
        if end is not None:  # the answer had begun: its own detokenizer
            th.done = True
            already = request.resume_text or ""
            after = th.after if request.grammar is None else ""
            if after and already.startswith(after):  # the marker's token holds it: context
                already = already[len(after):]
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids + thought, stop=seq.params.stop,
                resumed_token_ids=resumed[end:], resumed_text=already)
        return th

    def _prompt_thought(self, prompt, prompt_ids: list[int]) -> str | None:
        """reasoning.prompt_thought of the rendered prompt, the one place a request's
        start is decided. A chat prompt: of what the template appends for the assistant's
        turn (a marker quoted in a message, or an earlier turn's thought, decides
        nothing). Text or token ids: of the prompt, read from its end: the last marker
        decides, so a window that holds one is enough (widened until one does)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self._generation_prompt is None:  # once per engine: the template is fixed
                self._generation_prompt = (generation_prompt(self.tokenizer),)
            text = self._generation_prompt[0]
            if text is not None:
                return prompt_thought(text, self.reasoning)
        n = 256
        while True:
            text = self.tokenizer.decode(prompt_ids[-n:], skip_special_tokens=False)
            state = prompt_thought(text, self.reasoning)
            if state is not None or n >= len(prompt_ids):
                return state
            n *= 4

    def answer_room(self, seq: GuidedRow, matcher) -> int:
        """The length of one completion from the grammar's start (a dive of the closing
        search, once per grammar; the schema's bound when the dive finds none)."""
        key = seq.grammar.key(self.manager.fingerprint)
        need = self._answer_room.get(key)
        if need is None:
            path = self.manager.closer.estimate(matcher, 4 * self.remaining(seq) + 16)
            need = len(path) if path is not None else self.policy.shortest_bound(seq)
            self._answer_room[key] = need
            if len(self._answer_room) > 4096:
                self._answer_room.pop(next(iter(self._answer_room)))
        return need


class GuidedRequest:
    """One request's guided part (its row's ``guide``): its grammar (the future while it
    compiles, then the compiled grammar and a matcher of its own), its thought, its output
    policy state, and the hooks the engine's step calls."""

    def __init__(self, path: GuidedPath, seq: GuidedRow, request: GenerationRequest,
                 thinking: Thinking | None):
        self.path, self.seq = path, seq
        self.grammar_future = None  # Future of the compiled grammar while it compiles
        self.compiled = None  # the compiled grammar, from admission on
        self.matcher = None  # the grammar's matcher, from admission to the end
        self.thinking = thinking  # a reasoning model's thought (None: none)
        self.ending: OutputState | None = None  # the output policy's, from admission on
        self.validation = request.validation
        self.loop_guard = request.loop_guard  # None: the engine's default

    @property
    def thinking_now(self) -> bool:
        """Whether this step's token is the thought's."""
        return self.thinking is not None and not self.thinking.done

    @property
    def guided_now(self) -> bool:
        """Whether the grammar applies to this step's token: a guided request, not
        thinking."""
        return self.seq.grammar is not None and not self.thinking_now

    @property
    def mask_matcher(self):
        """The matcher whose mask this step's row gets (None: the row is not masked: no
        grammar, or the thought runs)."""
        return self.matcher if self.guided_now else None

    # admission ----------------------------------------------------------------------------

    def admit(self) -> Outcome | None:
        """The request's grammar future is done: a matcher of its own, a continuation's
        resumed output advanced, the budget checked, stop strings bound to the grammar (or,
        while it thinks, the room its answer needs kept). An Outcome ends the request: its
        grammar failed (its GrammarError's kind, or GrammarUnavailable's: OVERLOADED, else
        GRAMMAR_UNAVAILABLE), the grammar refuses the resumed output (WORKER_DIED) or it is
        complete already (stop), or the budget cannot hold the grammar's shortest output
        (BUDGET_TOO_SMALL)."""
        seq, path = self.seq, self.path
        exc = self.grammar_future.exception()
        if exc is not None:  # a bad grammar, or the compile service failed
            kind = getattr(exc, "kind", None) or ErrorKind.GRAMMAR_UNAVAILABLE
            return Outcome("error", error=str(exc) or repr(exc), error_kind=kind)
        if self.matcher is None:  # (not when admission waited for a search: again)
            self.compiled = self.grammar_future.result()
            self.matcher = path.manager.add_matcher(self.compiled)
            self.ending = OutputState()
            if seq.num_output:
                refused = self._advance_resumed()
                if refused is not None:
                    return refused
        compiled, matcher = self.compiled, self.matcher
        too_small = path.policy.admit(seq, matcher)
        if too_small is not None:
            return Outcome("error", error=too_small, error_kind=ErrorKind.BUDGET_TOO_SMALL)
        if self.ending.waiting_on is not None:  # the budget's verdict needs a search
            return Outcome(park=True)
        if self.thinking_now:
            self._leave_answer_room()
        elif seq.params.stop:  # a stop string only where the grammar may end
            seq.detokenizer.stop_check = GrammarStopCheck(path.manager.new_matcher(compiled))
        return None

    def _advance_resumed(self) -> Outcome | None:
        """A continuation's matcher is advanced over the output it resumes (the answer's:
        never a thought's). An Outcome when the grammar refuses that output, or it already
        completes the grammar."""
        seq = self.seq
        if self.thinking_now:
            return None
        for token in seq.output_ids[self.thinking.tokens if self.thinking else 0:]:
            if not self.matcher.accept_token(token):
                return Outcome("error", error=(
                    "cannot resume: the grammar does not accept the output streamed before "
                    "the worker died; resend the request"), error_kind=ErrorKind.WORKER_DIED)
        if self.matcher.is_terminated():
            return Outcome("stop")
        return None

    def _leave_answer_room(self) -> None:
        """A guided thought ends (its marker forced) while the budget still holds the
        grammar's answer: its length (``GuidedPath.answer_room``) plus the closing margin
        and a few tokens of slack for the model's own choices."""
        seq, path = self.seq, self.path
        need = path.answer_room(seq, self.matcher)
        room = path.remaining(seq) - need - path.config.closing_margin - _ANSWER_SLACK
        th = self.thinking
        th.limit = max(th.tokens, min(th.limit, seq.num_output + max(room, 0)))

    # a sampled token ----------------------------------------------------------------------

    def after_sample(self, token: int, logprob, status) -> Outcome:
        """The row's sampled ``token`` (its matcher has accepted it, ``status``: the
        mask's verdict): appended, then what the grammar forces after it (jump-forward),
        the stream's share, the loop guard and budget-aware closing; a thinking row's
        token goes to its thought (``_after_thought``). A row with a thought done and no
        grammar is a plain one: ``Outcome(plain=True)``."""
        seq, path = self.seq, self.path
        if self.thinking_now:
            return self._after_thought(token, logprob)
        if seq.grammar is None:
            return Outcome(plain=True)
        seq.append([token], [logprob])  # None: a forced token (not sampled)
        if status is not None and status.error:
            return Outcome("error", error=f"request {seq.request_id}: {status.error}",
                           error_kind=status.error_kind or ErrorKind.INTERNAL)
        # a guided row ends where its grammar says: EOS (terminated) or a stop token id
        # where the grammar may end; other stop ids were grammar content
        if status is not None and (status.terminated or status.stop):
            return Outcome("stop")
        jumped = self._jump()
        new_tokens, lps, text = self._release(final=False)
        out = Outcome(None, text, new_tokens, lps)
        if seq.detokenizer.stopped is not None:
            out.finish = "stop"
            return out
        if self.ending is not None:
            closed = path.policy.after_token(seq, 1 + jumped)
            if closed is not None:
                out.finish = closed[1]
        return self._settle(out)

    def resume(self) -> Outcome:
        """A parked row's search has ended: its decision is made again from the same
        state (the answer is in now): a held token's (``OutputPolicy.steer_held``, then
        accepted and handled as ``after_sample`` would have), or closing's, as after its
        last token."""
        policy, seq = self.path.policy, self.seq
        if self.ending.held is not None:
            verdict = policy.steer_held(seq)
            if verdict is None:
                return Outcome(park=True)
            token, logprob = verdict
            return self.after_sample(token, logprob, self._accept(token))
        closed = policy.close(seq)
        new_tokens, lps, text = self._release(final=False)
        return self._settle(Outcome(closed and closed[1], text, new_tokens, lps))

    def _accept(self, token: int) -> "Accepted":
        """The matcher accepts a held token as the batch's accept would have (logits_process
        ``FusedLogitsProcessor.accept_token``)."""
        matcher = self.matcher
        may_end = matcher.is_completed()
        if may_end and token in self.seq.params.stop_token_ids:
            return Accepted(stop=True)
        if not matcher.accept_token(token):
            failure = matcher.failure()
            return Accepted(error=failure or f"the grammar rejected token {token}",
                            error_kind=ErrorKind.GRAMMAR_TOO_LARGE if failure
                            else ErrorKind.REJECTED)
        return Accepted(terminated=matcher.is_terminated())

    def _settle(self, out: Outcome) -> Outcome:
        """Parked while its closing waits for a search; else ends at its budget."""
        if out.finish is None and self.ending is not None and self.ending.waiting_on is not None:
            out.park = True
        elif out.finish is None and self.path.remaining(self.seq) <= 0:
            out.finish = "length"
        return out

    def _jump(self) -> int:
        """Appends the text the row's grammar forces after its sampled token (see
        jump_forward.py); returns how many output tokens that added."""
        seq, jumper = self.seq, self.path.jumper
        if self.ending is None or self.ending.forced_path or jumper is None:
            return 0
        if self.matcher is None:
            return 0
        jump = jumper.extend(self.matcher, seq.token_ids[-1], self.path.remaining(seq))
        if jump is None:
            return 0
        if jump.replaces_last:
            seq.rollback(1)
            # the schema closer's reader has read the sampled token: it reads again
            # (one token's bytes now begin the next one's, which it would skip)
            self.ending.rolled_back(seq.num_output - self.ending.scan_from)
        seq.append(jump.tokens)
        return jump.added

    def _after_thought(self, token: int, logprob) -> Outcome:
        """A thinking row's token: streamed as reasoning. The end marker (sampled, or
        forced once the thought's limit is reached) begins the answer with the next token.
        A stop token id ends an unguided request (its output is the thought) and is
        replaced by the end marker in a guided one (the answer is owed)."""
        seq, path = self.seq, self.path
        th, p = self.thinking, seq.params
        stops = (token in path.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if th.opening:  # no marker in the prompt (unguided): does this output open one?
            # judged on the whole output so far (a marker spans tokens: '<', 'think', '>');
            # while undecided its text was held back (no reasoning delta showed it)
            opens = False if stops else opens_thought(path._raw(seq.output_ids + [token]),
                                                      path.reasoning.start)
            th.opening = opens is None
            if opens is False:  # an answer: the row goes on as an unguided one
                return self._answer_instead()
        if stops and seq.grammar is None:
            return Outcome("stop")
        over = stops or th.tokens >= th.limit  # (a limit of 0: no sampled thought at all)
        if not over:
            seq.append([token], [logprob])
            th.tokens += 1
        new_tokens, lps, text = self._release(final=False)
        reasoning = th.feed(text)
        tail = ""
        if th.done and seq.grammar is not None and th.after:
            tail = self._split_marker_token(new_tokens, lps)
        if not th.done and (over or th.tokens >= th.limit):
            th.forced = True
            path.thoughts_forced += 1
            seq.append(th.end_ids)  # their KV is computed with the next token
            th.tokens += len(th.end_ids)
            more, more_lps, more_text = self._release(final=False)
            if more_lps is not None:
                lps = (lps or [None] * len(new_tokens)) + more_lps
            new_tokens += more
            reasoning += th.feed(more_text)
            th.done = True  # the marker is in: whatever the text shows
        answer = ""
        if th.done:
            path.thinking_tokens += th.tokens
            reasoning += th.feed(seq.detokenizer.flush(), final=True)
            seq.detokenizer = IncrementalDetokenizer(path.tokenizer, list(seq.token_ids),
                                                     stop=seq.params.stop)
            if seq.grammar is not None:
                if seq.params.stop:
                    seq.detokenizer.stop_check = GrammarStopCheck(
                        path.manager.new_matcher(self.compiled))
                matcher = self.matcher
                path.policy.begin_answer(seq, matcher)
                n = self._answer_tail(matcher, tail)
                if n:  # the marker's token went on into the answer: its first tokens
                    closed = path.policy.after_token(seq, n)
                    more, more_lps, answer = self._release(final=False)
                    if more_lps is not None:
                        lps = (lps or [None] * len(new_tokens)) + more_lps
                    new_tokens += more
                    if closed is not None:
                        return Outcome(closed[1], answer, new_tokens, lps, reasoning)
            else:  # text after the marker in its own token: the answer's first
                answer = th.after
        return self._settle(Outcome(None, answer, new_tokens, lps, reasoning))

    def _answer_instead(self) -> Outcome:
        """An unguided row whose output turned out not to open a thought goes on as a
        plain one: the text held back while that was undecided (whitespace, '<') is the
        answer's first, streamed with this token's."""
        seq = self.seq
        self.thinking = None
        seq.guide = None
        seq.detokenizer = IncrementalDetokenizer(self.path.tokenizer, seq.prompt_ids,
                                                 stop=seq.params.stop)
        held = seq.detokenizer.add_tokens(seq.output_ids)
        return Outcome(text=held, plain=True)

    def _split_marker_token(self, new_tokens: list[int], lps) -> str:
        """A guided thought's last token completed the end marker and went on past it
        ('>"' after '</think'): it is replaced by the tokens of its text up to the
        marker's end (before its KV is computed, so the model's context is the bare
        marker), in the output and in this chunk. Returns the text after the marker (the
        answer's first: ``_answer_tail``); "" when the token cannot be split (a character
        split across tokens: that text is dropped, as the grammar could not see it)."""
        seq, path = self.seq, self.path
        th = self.thinking
        split = split_marker_token(path._raw, seq.output_ids, path.reasoning.end)
        if split is None:
            return ""
        marker, tail = split
        ids = path.tokenizer(marker, add_special_tokens=False)["input_ids"]
        seq.replace_released(ids)
        new_tokens[-1:] = ids
        if lps is not None:
            lps[-1:] = [None] * len(ids)  # forced: not what was sampled
        th.tokens += len(ids) - 1
        return tail

    def _answer_tail(self, matcher, tail: str) -> int:
        """The text after a split end marker (``_split_marker_token``) as the answer's
        first tokens, forced, when the grammar accepts all of it (else it is dropped and
        the answer is sampled under the mask from the bare marker: nothing invalid is
        emitted). Not while the budget is down to a planned shortest answer. Returns how
        many tokens were appended (the matcher has accepted them)."""
        seq, path = self.seq, self.path
        if not tail or matcher is None or self.ending.forced_path:
            return 0
        ids = path.tokenizer(tail, add_special_tokens=False)["input_ids"]
        if len(ids) > path.remaining(seq):
            return 0
        accepted = 0
        for t in ids:
            if not matcher.accept_token(t):
                break
            accepted += 1
        if accepted < len(ids):
            if accepted:
                matcher.rollback(accepted)
            return 0
        seq.append(ids)
        return len(ids)

    # the stream and the end ---------------------------------------------------------------

    def releasable(self, final: bool) -> int:
        """How many held output tokens the stream may have now: a guided answer's newest
        are held back for the loop guard (OutputPolicy.release); a thought's, all."""
        seq = self.seq
        if self.ending is not None and not self.thinking_now:
            return self.path.policy.release(seq, final)
        return len(seq.held_logprobs)

    def _release(self, final: bool) -> tuple[list[int], list | None, str]:
        return self.seq.stream(self.releasable(final))

    def finish(self, reason: str, out: RequestOutput, waiting: bool) -> None:
        """The request ended with ``out`` (its last chunk, built): a compile it still
        waited for is given up (the last waiter's give-up stops it), its matcher freed,
        a thought it ended in is its reasoning, and the output policy's report (closing,
        loop cuts, validation), the grammar's engine and what it approximates go on the
        chunk."""
        seq, path = self.seq, self.path
        if self.thinking_now:  # it ended in its thought: what it had is reasoning
            out.reasoning += self.thinking.feed(out.text, final=True)
            out.text = ""
            path.thinking_tokens += self.thinking.tokens
        if waiting:
            path.manager.give_up(seq.grammar, self.grammar_future)
        if path.policy is not None:
            path.policy.forget(seq)
        if self.matcher is not None:
            path.manager.remove_matcher(self.matcher)  # nothing needs it any more
            self.matcher = None
        if self.thinking is not None:
            out.reasoning_tokens = self.thinking.tokens
        if self.ending is not None and reason in ("stop", "length"):
            path.policy.report(seq, reason, out)
        compiled = self.compiled
        if compiled is not None:
            out.grammar_engine = compiled.engine
            if compiled.exact and out.approximated:
                # the backend refuses what it cannot enforce exactly; a custom format it
                # drops (it constrains nothing) stays said: nothing checked it
                out.approximated = not_checked(out.approximated)
