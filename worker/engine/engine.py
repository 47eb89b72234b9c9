"""The synchronous engine: requests in, one step at a time, output chunks out.

    def step(self):
        scheduled = self.scheduler.schedule()
        proc = FusedLogitsProcessor(inputs, self.guided); proc.prepare()  # mask fill starts
        logits, rows = self.runner.run(scheduled)                         # ... under the forward
        result = self.sampler(logits, inputs.rows, proc)      # penalties, mask, draw
        self.policy.steer(...); proc.accept_token(result.token_ids)  # then _append_token

A guided request first waits (WAITING_FOR_GRAMMAR) while its grammar compiles on the
manager's thread pool; the batch goes on without it. ``AsyncEngine`` (async_engine.py)
drives ``step()`` from a thread for the Ray actor. The engine imports no Ray: a worker
injects how grammars are fetched (``grammar_fetch``).

Conformance: each guided request has its own matcher; near the end of its token budget
the output policy steers it to the grammar's shortest completion (output_policy.py,
closing.py), so a response cut by its budget still parses; a stop string or stop token id
ends a guided request only where its grammar may end; each finished JSON output is
validated against its full schema (validation.py).

Why one module over 500 lines: the step and each request's life in it (admission, a
thought, appending, finishing) act on the engine's one batch state; the guided policy,
sampling, reasoning and the grammars live in their own modules. Splitting the request
life out (a per-request guided object the step calls through a few hooks) is issue 40's
next part.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import torch

from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind
from worker.guided import bitmask
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import GrammarStopCheck, IncrementalDetokenizer
from worker.guided.guided_process import GrammarFetchFactory, GuidedDecodingManager
from worker.guided.jump_forward import JumpForward, JumpStats
from worker.engine.logits_process import FusedLogitsProcessor, RowStatus, StepTimings
from worker.engine.model_runner import ModelRunner, kv_bytes_per_token
from worker.guided.output_policy import OutputPolicy, OutputState, PolicyStats
from worker.guided.reasoning import (OPEN, Thinking, from_template, generation_prompt,
                                     opens_thought, prompt_thought, split_marker_token,
                                     thought_end)
from worker.engine.sampling import ARSamplingStrategy, Sampler
from worker.engine.scheduler import Scheduler
from core.request import GenerationRequest, RequestOutput
from worker.engine.sequence import Sequence, SeqStatus
from worker.guided.validation import not_checked
from worker.models import loader

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    running: int
    waiting: int
    running_tokens: int
    waiting_tokens: int
    free_blocks: int
    total_blocks: int
    session_blocks: int
    live_sessions: int
    preemptions: int
    steps: int = field(default=0)
    waiting_for_grammar: int = 0
    live_processors: int = 0  # grammar matchers alive (the name is on the wire: kept)
    grammar_cache: dict = field(default_factory=dict)
    session_ids: list = field(default_factory=list)  # sessions with KV or requests here
    # conformance counters: guided outputs closed early at their budget, outputs
    # validated / found invalid, guided outputs that ended at the budget unclosed
    closed_early: int = 0
    validated: int = 0
    invalid: int = 0
    runaway: int = 0
    closing_giveups: int = 0  # completion searches cut short (node cap or closing_search_ms)
    closing_steered: int = 0  # sampled tokens replaced: the output could not have closed
    closing_searches: int = 0  # completion searches run near the end of a budget
    closing_reused: int = 0  # ... skipped: the last step's path still closes (replayed)
    closing_probes: int = 0  # dives before the closing window (is the completion longer?)
    budget_checks: int = 0  # guided requests whose budget was checked at admission
    budget_checks_memo: int = 0  # ... judged from a remembered verdict (no search)
    loop_cuts: int = 0  # repeating values the loop guard ended
    loop_cut_outputs: int = 0  # guided outputs with at least one loop cut
    thinking_tokens: int = 0  # output tokens of reasoning models' thoughts (markers included)
    thoughts_forced: int = 0  # thoughts whose end marker the engine forced (budget, a stop)
    # jump-forward (jump_forward.py): tokens appended without a decode step, the steps
    # that did, those that re-split the sampled token, trailing tokens left to the model
    jump_forward_tokens: int = 0
    jump_forward_jumps: int = 0
    jump_forward_retokenized: int = 0
    jump_forward_held_back: int = 0
    sampled_tokens: int = 0  # tokens sampled (one per sampling row and step)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None,
                 model_dir=None, grammar_fetch: GrammarFetchFactory | None = None,
                 grammar_limits: GrammarCacheConfig | None = None):
        """``grammar_fetch(tokenizer_info)`` returns the function that turns a GrammarSpec
        into a compiled grammar (a worker in a cluster passes
        ``lambda info: GrammarCacheClient(info, ...).fetch``); None compiles here, under
        ``grammar_limits`` (the grammar cache's compile limits; a worker that serves
        requests passes its cluster's, which also makes ``grammar_compile_processes``
        default to child processes)."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            model_dir = loader.resolve_model_dir(config.model, progress=config.progress)
            model = loader.load_model(model_dir, device=config.device, dtype=config.dtype,
                                      progress=config.progress)
        if tokenizer is None:
            tokenizer = loader.load_tokenizer(model_dir)
        self.model, self.tokenizer, self.model_dir = model, tokenizer, model_dir
        self.eos_ids = set(loader.generation_eos_ids(model_dir, tokenizer)) if model_dir else (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.max_model_len = min(config.max_model_len or 10**9,
                                 int(model.config.max_position_embeddings))
        param = next(model.parameters())
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_gb * 2**30) // (
                kv_bytes_per_token(model, param.dtype) * config.block_size))
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.step_token_budget)
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        if (config.cuda_graphs is not False and self.runner.tiled
                and self.runner.device.type == "cuda"):
            try:
                self.runner.enable_graphs(config.max_num_seqs, self.max_model_len)
            except Exception as e:  # a recording that fails leaves every step eager
                logger.warning("CUDA graphs off: recording failed (%s: %s)", type(e).__name__, e)
                self.runner.graphs = None
        self.sampler = Sampler()
        self.strategy = ARSamplingStrategy()
        self.guided: GuidedDecodingManager | None = None
        if config.guided:
            self.guided = GuidedDecodingManager.from_tokenizer(
                tokenizer, model.config.vocab_size, sorted(self.eos_ids),
                max_batch_size=config.max_num_seqs, grammar_fetch=grammar_fetch,
                cache_bytes=config.grammar_cache_bytes, default_engine=config.grammar_engine,
                compile_processes=config.compile_processes(grammar_limits),
                compile_limits=grammar_limits)
            self.guided.closer.time_limit_s = config.closing_search_ms / 1000
            if self.runner.device.type == "cpu":  # compile the mask kernel off the hot path
                threading.Thread(target=bitmask.warmup, daemon=True).start()
            elif self.runner.device.type == "cuda":  # pinned: its copy to the GPU is async
                self.guided.bitmask = self.guided.bitmask.pin_memory()
        self.seqs: dict[str, Sequence] = {}
        self.waiting_for_grammar: list[Sequence] = []
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_timings = StepTimings()
        # how guided outputs end: budget checks, closing, the loop guard, validation
        self.policy = OutputPolicy(config, self.guided, self._remaining) \
            if self.guided is not None else None
        # reasoning models (reasoning.py): the end marker as tokens (what a budget forces),
        # and per grammar the length of an answer known to fit (the room a thought leaves)
        self.reasoning = config.reasoning
        if self.reasoning is None:  # a reasoning model's chat template names its markers
            self.reasoning = from_template(tokenizer)
        self.reasoning = self.reasoning or None
        self._end_ids = tokenizer(self.reasoning.end, add_special_tokens=False)[
            "input_ids"] if self.reasoning is not None else []
        self._answer_room: dict[str, int] = {}
        self._generation_prompt: tuple[str | None] | None = None  # read on first chat
        self.thinking_tokens = self.thoughts_forced = 0
        self._jumper: JumpForward | None = None  # built on first use (reads the vocabulary)
        self.num_sampled = 0

    # requests ---------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest, *,
                    prompt_ids: list[int] | None = None) -> Sequence:
        """Validates and queues a request; a bad request raises ValueError and changes nothing.
        ``prompt_ids``: the prompt already tokenized by ``encode_prompt`` (AsyncEngine does
        it off the engine loop)."""
        if request.request_id in self.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if prompt_ids is None:
            prompt_ids = self.encode_prompt(request.prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens but the model context is "
                             f"{self.max_model_len}; shorten the prompt")
        if not self.scheduler.can_ever_fit(len(prompt_ids) + 1):
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than the KV cache "
                             f"holds ({self.blocks.num_blocks * self.blocks.block_size}); "
                             "shorten the prompt or raise kv_cache_gb")
        resumed = self._check_resume(request, prompt_ids)
        seed = request.params.seed
        # on the CPU whatever the device: the sampler draws each row's uniform number on the
        # host (a seeded request gives the same tokens on every device)
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
        # a continuation's text goes on exactly after the text the caller already has
        # (never repeating it, and never losing a character split across the failover)
        already = ""
        if resumed:
            already = request.resume_text
            if already is None:  # a clean prefix of their decode: what a worker sends
                already = self.tokenizer.decode(resumed, skip_special_tokens=True)
                already = already.rstrip("\ufffd")
        if request.grammar is not None and self.guided is None:
            raise ValueError("guided decoding is disabled in this engine (EngineConfig.guided)")
        seq = None
        if self.reasoning is not None:  # None: the request starts in its answer
            seq = self._thinking_sequence(request, prompt_ids, resumed, generator)
        if seq is None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                           stop=request.params.stop,
                                           resumed_token_ids=resumed, resumed_text=already)
            seq = Sequence(request, prompt_ids, detok, generator)
        seq.append(resumed, streamed=True)  # KV recomputed, not re-emitted
        seq.resumed_text = already  # what the caller has, for validating the whole output
        self.seqs[seq.request_id] = seq
        if seq.grammar is not None:
            seq.grammar_future = self.guided.get_grammar(seq.grammar, request.client,
                                                         waiter=True)
            seq.status = SeqStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(seq)
        else:
            self.scheduler.add(seq)
        return seq

    def _thinking_sequence(self, request: GenerationRequest, prompt_ids: list[int],
                           resumed: list[int], generator) -> Sequence | None:
        """A reasoning model's request that starts in a thought: its rendered prompt ends
        inside an open one (``_prompt_thought``), or, unguided, its prompt holds no marker
        and its output may still open one itself (a detokenizer of its own for the
        thought, special tokens kept, no stop strings); a continuation whose resumed
        output already holds the end marker goes on in its answer. None when it starts in
        its answer (answered directly; guided: from its first token): every other prompt,
        or (no marker, unguided) an output so far that does not open a thought
        (reasoning.py)."""
        def raw(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False)

        state = self._prompt_thought(request.prompt, prompt_ids)
        opening = state is None and request.grammar is None
        if state != OPEN and not opening:
            return None
        if opening and resumed and opens_thought(raw(resumed), self.reasoning.start) is False:
            return None
        end = thought_end(raw, resumed, self.reasoning.end) if resumed else None
        thought = resumed if end is None else resumed[:end]
        text = raw(thought).rstrip("\ufffd") if thought else ""
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=(),
                                       skip_special_tokens=False,
                                       resumed_token_ids=thought, resumed_text=text)
        seq = Sequence(request, prompt_ids, detok, generator)
        budget = request.thinking_token_budget
        if budget is None:
            budget = self.config.thinking_token_budget
        room = request.params.max_new_tokens - len(self._end_ids) - 1
        seq.thinking = Thinking(self.reasoning, self._end_ids,
                                room if budget is None else min(budget, room))
        seq.thinking.tokens = len(thought)
        seq.thinking.opening = opening and opens_thought(text, self.reasoning.start) is None
        seq.thinking.feed(text)  # the caller has this thought's text already
        if end is not None:  # the answer had begun: its own detokenizer
            seq.thinking.done = True
            already = request.resume_text or ""
            after = seq.thinking.after if seq.grammar is None else ""
            if after and already.startswith(after):  # the marker's token holds it: context
                already = already[len(after):]
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids + thought, stop=seq.stop,
                resumed_token_ids=resumed[end:], resumed_text=already)
        return seq

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

    def _check_resume(self, request: GenerationRequest, prompt_ids: list[int]) -> list[int]:
        """The tokens a continuation resumes, checked (a ValueError says why it cannot be
        resumed here)."""
        resumed = list(request.resume_token_ids or ())
        if not resumed:
            return resumed
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in resumed):
            raise ValueError("cannot resume: resume_token_ids are outside the vocabulary")
        if len(resumed) >= request.params.max_new_tokens:
            raise ValueError("cannot resume: the request had already used its max_new_tokens")
        total = len(prompt_ids) + len(resumed)
        if total >= self.max_model_len or not self.scheduler.can_ever_fit(total + 1):
            raise ValueError(f"cannot resume: prompt and streamed output ({total} tokens) no "
                             "longer fit this worker's context or KV cache")
        return resumed

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; send at least one character")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if "role" not in m or "content" not in m:
                    raise ValueError("each chat message needs 'role' and 'content' keys")
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                      tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.model.config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a non-empty string, a non-empty list of token ids, "
                             "or a non-empty list of chat messages")
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        return ids

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Ends every request in the engine with an INTERNAL error (after a step raised
        where it should not have: no request may be left waiting for a chunk that never
        comes). Their blocks and matchers are released."""
        outs = []
        for seq in list(self.seqs.values()):
            try:
                outs.append(self._finish(seq, "error", error=error,
                                         error_kind=ErrorKind.INTERNAL, keep_session=False))
            except Exception:  # its state is broken too: still tell the caller
                logger.exception("failing request %s", seq.request_id)
                self.seqs.pop(seq.request_id, None)
                outs.append(RequestOutput(seq.request_id, finished=True,
                                          finish_reason="error", error=error,
                                          error_kind=ErrorKind.INTERNAL))
        return outs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its blocks; returns its final chunk (None if unknown)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort", keep_session=False)

    def end_session(self, session_id: str) -> list[RequestOutput]:
        """Ends a session: aborts the requests of the session that exist now (releasing
        their matchers and blocks at once) and frees its KV. A request that starts in the
        session later is a new request with its own matcher; nothing deferred can touch
        it. Returns the final chunks of the aborted requests."""
        outs = [self._finish(s, "abort") for s in list(self.seqs.values())
                if s.session_id == session_id]
        self.blocks.drop_session(session_id)
        return outs

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.waiting_for_grammar)

    # the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._admit_compiled_grammars()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.waiting_for_grammar:  # nothing to run until a grammar is ready
                wait([s.grammar_future for s in self.waiting_for_grammar], timeout=0.05,
                     return_when=FIRST_COMPLETED)
                return outputs
            return outputs + self._unschedulable()
        self.num_steps += 1
        sampling = [s.seq for s in scheduled if s.samples]
        inputs = self.strategy.make_sampling_inputs(sampling)
        proc = FusedLogitsProcessor(inputs, self.guided)
        try:
            proc.prepare()  # the bitmask fill overlaps the forward
            logits, rows = self.runner.run(scheduled)
        except Exception as exc:  # a failed forward fails its batch, not the engine
            logger.exception("model step failed")
            return outputs + [self._finish(s.seq, "error", error=f"model step failed: {exc}",
                                           error_kind=ErrorKind.INTERNAL) for s in scheduled]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        if sampling:
            result = self.sampler(logits, inputs.rows, proc)
            if self.policy is not None:
                self.policy.steer(sampling, result.token_ids, result.logprobs)
            status = proc.accept_token(result.token_ids)
            self.num_sampled += len(sampling)
            outputs += [self._append_token(seq, tok, lp, status.get(i))
                        for i, (seq, tok, lp) in enumerate(
                            zip(sampling, result.token_ids, result.logprobs))]
        self.last_timings = proc.timings
        return outputs

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Moves requests whose grammar compiled into the scheduler's queue (each with a
        matcher of its own); fails those whose grammar is invalid (its GrammarError's kind),
        could not be had (GRAMMAR_UNAVAILABLE: retry), was not ready in time, or needs more
        tokens than the request allows (BUDGET_TOO_SMALL)."""
        outputs = []
        limit = self.config.grammar_timeout_s
        for seq in list(self.waiting_for_grammar):
            fut = seq.grammar_future
            if fut.done():
                exc = fut.exception()
                if exc is not None:  # a bad grammar, or the compile service failed
                    # GrammarError's kind, or GrammarUnavailable's (OVERLOADED: the
                    # compile queue is full, a 429), else GRAMMAR_UNAVAILABLE
                    kind = getattr(exc, "kind", None) or ErrorKind.GRAMMAR_UNAVAILABLE
                    outputs.append(self._finish(seq, "error", error=str(exc) or repr(exc),
                                                error_kind=kind))
                    continue
                compiled = fut.result()
                matcher = self.guided.add_matcher(seq.matcher_key, compiled)
                seq.compiled = compiled
                seq.ending = OutputState()
                if seq.num_output and not self._advance_resumed(seq, matcher, outputs):
                    continue
                too_small = self.policy.admit(seq, matcher)
                if too_small is not None:
                    outputs.append(self._finish(seq, "error", error=too_small,
                                                error_kind=ErrorKind.BUDGET_TOO_SMALL))
                    continue
                if seq.thinking_now:
                    self._leave_answer_room(seq, matcher)
                elif seq.stop:  # a stop string only where the grammar may end
                    seq.detokenizer.stop_check = GrammarStopCheck(
                        self.guided.new_matcher(compiled))
                self.waiting_for_grammar.remove(seq)
                seq.status = SeqStatus.WAITING
                self.scheduler.add(seq)
            elif time.monotonic() - seq.arrival > limit:
                outputs.append(self._finish(seq, "error", error=(
                    f"the {seq.grammar.kind} grammar was not ready within {limit:g} s "
                    "(compiling it, or the grammar cache, is too slow right now); retry, "
                    "or simplify the grammar"), error_kind=ErrorKind.GRAMMAR_UNAVAILABLE))
        return outputs

    def _advance_resumed(self, seq: Sequence, matcher, outputs: list) -> bool:
        """A continuation's matcher is advanced over the output it resumes (the answer's:
        never a thought's). False (the request finished) when the grammar refuses that
        output, or it already completes the grammar."""
        if seq.thinking_now:
            return True
        for token in seq.output_ids[seq.thinking.tokens if seq.thinking else 0:]:
            if not matcher.accept_token(token):
                outputs.append(self._finish(seq, "error", error=(
                    "cannot resume: the grammar does not accept the output streamed before "
                    "the worker died; resend the request"), error_kind=ErrorKind.WORKER_DIED))
                return False
        if matcher.is_terminated():
            outputs.append(self._finish(seq, "stop"))
            return False
        return True

    def _remaining(self, seq: Sequence) -> int:
        """Tokens the request may still generate: its max_new_tokens, or the context
        (while it thinks: what its answer may have, the end marker it owes taken off)."""
        left = min(seq.params.max_new_tokens - seq.num_output,
                   self.max_model_len - len(seq.token_ids))
        # a thought takes one token at least, then its marker
        return left - len(self._end_ids) - 1 if seq.thinking_now else left

    def _leave_answer_room(self, seq: Sequence, matcher) -> None:
        """A guided thought ends (its marker forced) while the budget still holds the
        grammar's answer: the length of one completion from the grammar's start (a dive
        of the closing search, once per grammar) plus the closing margin and a few tokens
        of slack for the model's own choices."""
        key = seq.grammar.key(self.guided.fingerprint)
        need = self._answer_room.get(key)
        if need is None:
            path = self.guided.closer.estimate(matcher, 4 * self._remaining(seq) + 16)
            need = len(path) if path is not None else self.policy.shortest_bound(seq)
            self._answer_room[key] = need
            if len(self._answer_room) > 4096:
                self._answer_room.pop(next(iter(self._answer_room)))
        room = self._remaining(seq) - need - self.config.closing_margin - _ANSWER_SLACK
        th = seq.thinking
        th.limit = max(th.tokens, min(th.limit, seq.num_output + max(room, 0)))

    @property
    def jumper(self) -> JumpForward | None:
        """Jump-forward decoding (None when off or unguided)."""
        if self.guided is None or not self.config.jump_forward:
            return None
        if self._jumper is None:
            self._jumper = JumpForward(self.guided.closer.vocab, lambda text: self.tokenizer(
                text, add_special_tokens=False)["input_ids"])
        return self._jumper

    def _jump(self, seq: Sequence) -> int:
        """Appends the text the row's grammar forces after its sampled token (see
        jump_forward.py); returns how many output tokens that added."""
        if seq.ending is None or seq.ending.forced_path or self.jumper is None:
            return 0
        matcher = self.guided.matchers.get(seq.matcher_key)
        if matcher is None:
            return 0
        jump = self.jumper.extend(matcher, seq.token_ids[-1], self._remaining(seq))
        if jump is None:
            return 0
        if jump.replaces_last:
            seq.rollback(1)
        seq.append(jump.tokens)
        return jump.added

    def _append_token(self, seq: Sequence, token: int, logprob,
                      status: RowStatus | None = None) -> RequestOutput:
        if seq.thinking_now:
            return self._append_thought(seq, token, logprob)
        p = seq.params
        seq.append([token], [logprob])  # None: a forced token (not sampled)
        if status is not None and status.error:
            return self._finish(seq, "error", error=f"request {seq.request_id}: {status.error}",
                                error_kind=status.error_kind or ErrorKind.INTERNAL)
        reason = None
        if seq.grammar is not None:
            # a guided row ends where its grammar says: EOS (terminated) or a stop token id
            # where the grammar may end; other stop ids were grammar content
            if status is not None and (status.terminated or status.stop):
                reason = "stop"
        elif (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        if reason is not None:
            return self._finish(seq, reason)
        jumped = self._jump(seq) if seq.grammar is not None else 0
        new_tokens, lps, text = self._release(seq, final=False)
        if seq.detokenizer.stopped is not None:
            return self._finish(seq, "stop", text=text, new_tokens=new_tokens, logprobs=lps)
        if seq.ending is not None:
            closed = self.policy.after_token(seq, 1 + jumped)
            if closed is not None:
                reason = closed[1]
        if reason is None and self._remaining(seq) <= 0:
            reason = "length"
        if reason is not None:
            return self._finish(seq, reason, text=text, new_tokens=new_tokens, logprobs=lps)
        return RequestOutput(seq.request_id, text, new_tokens, lps, **self._usage(seq))

    def _append_thought(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        """A thinking row's token: streamed as reasoning. The end marker (sampled, or
        forced once the thought's limit is reached) begins the answer with the next token.
        A stop token id ends an unguided request (its output is the thought) and is
        replaced by the end marker in a guided one (the answer is owed)."""
        th, p = seq.thinking, seq.params
        stops = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if th.opening:  # no marker in the prompt (unguided): does this output open one?
            # judged on the whole output so far (a marker spans tokens: '<', 'think', '>');
            # while undecided its text was held back (no reasoning delta showed it)
            opens = False if stops else opens_thought(self.tokenizer.decode(
                seq.output_ids + [token], skip_special_tokens=False), self.reasoning.start)
            th.opening = opens is None
            if opens is False:  # an answer: the row goes on as an unguided one
                return self._answer_instead(seq, token, logprob)
        if stops and seq.grammar is None:
            return self._finish(seq, "stop")
        over = stops or th.tokens >= th.limit  # (a limit of 0: no sampled thought at all)
        if not over:
            seq.append([token], [logprob])
            th.tokens += 1
        new_tokens, lps, text = self._release(seq, final=False)
        reasoning = th.feed(text)
        tail = ""
        if th.done and seq.grammar is not None and th.after:
            tail = self._split_marker_token(seq, new_tokens, lps)
        if not th.done and (over or th.tokens >= th.limit):
            th.forced = True
            self.thoughts_forced += 1
            seq.append(th.end_ids)  # their KV is computed with the next token
            th.tokens += len(th.end_ids)
            more, more_lps, more_text = self._release(seq, final=False)
            if more_lps is not None:
                lps = (lps or [None] * len(new_tokens)) + more_lps
            new_tokens += more
            reasoning += th.feed(more_text)
            th.done = True  # the marker is in: whatever the text shows
        answer = ""
        if th.done:
            self.thinking_tokens += th.tokens
            reasoning += th.feed(seq.detokenizer.flush(), final=True)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, list(seq.token_ids),
                                                     stop=seq.stop)
            if seq.grammar is not None:
                if seq.stop:
                    seq.detokenizer.stop_check = GrammarStopCheck(
                        self.guided.new_matcher(seq.compiled))
                matcher = self.guided.matchers.get(seq.matcher_key)
                self.policy.begin_answer(seq, matcher)
                n = self._answer_tail(seq, matcher, tail)
                if n:  # the marker's token went on into the answer: its first tokens
                    closed = self.policy.after_token(seq, n)
                    more, more_lps, answer = self._release(seq, final=False)
                    if more_lps is not None:
                        lps = (lps or [None] * len(new_tokens)) + more_lps
                    new_tokens += more
                    if closed is not None:
                        return self._finish(seq, closed[1], text=answer,
                                            new_tokens=new_tokens, logprobs=lps,
                                            reasoning=reasoning)
            else:  # text after the marker in its own token: the answer's first
                answer = th.after
        if self._remaining(seq) <= 0:
            return self._finish(seq, "length", text=answer, new_tokens=new_tokens,
                                logprobs=lps, reasoning=reasoning)
        return RequestOutput(seq.request_id, answer, new_tokens, lps, reasoning=reasoning,
                             **self._usage(seq))

    def _answer_instead(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        """An unguided row whose output turned out not to open a thought goes on as a
        plain one: the text held back while that was undecided (whitespace, '<') is the
        answer's first, streamed with this token's."""
        seq.thinking = None
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids,
                                                 stop=seq.stop)
        held = seq.detokenizer.add_tokens(seq.output_ids)
        out = self._append_token(seq, token, logprob)
        out.text = held + out.text
        return out

    def _split_marker_token(self, seq: Sequence, new_tokens: list[int], lps) -> str:
        """A guided thought's last token completed the end marker and went on past it
        ('>"' after '</think'): it is replaced by the tokens of its text up to the
        marker's end (before its KV is computed, so the model's context is the bare
        marker), in the output and in this chunk. Returns the text after the marker (the
        answer's first: ``_answer_tail``); "" when the token cannot be split (a character
        split across tokens: that text is dropped, as the grammar could not see it)."""
        th = seq.thinking
        split = split_marker_token(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            seq.output_ids, self.reasoning.end)
        if split is None:
            return ""
        marker, tail = split
        ids = self.tokenizer(marker, add_special_tokens=False)["input_ids"]
        seq.replace_released(ids)
        new_tokens[-1:] = ids
        if lps is not None:
            lps[-1:] = [None] * len(ids)  # forced: not what was sampled
        th.tokens += len(ids) - 1
        return tail

    def _answer_tail(self, seq: Sequence, matcher, tail: str) -> int:
        """The text after a split end marker (``_split_marker_token``) as the answer's
        first tokens, forced, when the grammar accepts all of it (else it is dropped and
        the answer is sampled under the mask from the bare marker: nothing invalid is
        emitted). Not while the budget is down to a planned shortest answer. Returns how
        many tokens were appended (the matcher has accepted them)."""
        if not tail or matcher is None or seq.ending.forced_path:
            return 0
        ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"]
        if len(ids) > self._remaining(seq):
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

    def _release(self, seq: Sequence, final: bool) -> tuple[list[int], list | None, str]:
        """The output tokens the stream may have now (a guided row's newest are held back
        for the loop guard; see OutputPolicy.release): (tokens, logprobs, their text)."""
        n = (self.policy.release(seq, final) if seq.ending is not None and not seq.thinking_now
             else len(seq.held_logprobs))
        if not n:
            return [], None, ""
        new_tokens = seq.output_ids[seq.num_output - len(seq.held_logprobs):][:n]
        lps = seq.release_held(n)
        text = seq.detokenizer.add_tokens(new_tokens)
        if seq.params.logprobs is None and all(lp is None for lp in lps):
            lps = None
        return new_tokens, lps, text

    def _finish(self, seq: Sequence, reason: str, *, text: str = "", new_tokens=(),
                logprobs=None, error: str | None = None, error_kind: ErrorKind | None = None,
                keep_session: bool = True, reasoning: str = "") -> RequestOutput:
        """Ends a request: what it still held back is streamed with this last chunk (a
        stop string may still cut it), its matcher and blocks are released (or its KV
        kept for the session), and the output policy reports onto the chunk."""
        if seq.status is not SeqStatus.WAITING_FOR_GRAMMAR and reason != "abort":
            more, more_lps, more_text = self._release(seq, final=True)
            new_tokens = list(new_tokens) + more
            if more_lps is not None:
                logprobs = (logprobs or [None] * (len(new_tokens) - len(more))) + more_lps
            text += more_text + seq.detokenizer.flush()
            if seq.detokenizer.stopped is not None and reason == "length":
                reason = "stop"
        if seq.thinking_now:  # it ended in its thought: what it had is reasoning
            reasoning += seq.thinking.feed(text, final=True)
            text = ""
            self.thinking_tokens += seq.thinking.tokens
        if seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar.remove(seq)
            seq.status = SeqStatus.FINISHED
            self.guided.give_up(seq.grammar, seq.grammar_future)  # the last one stops it
        else:
            self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        if seq.grammar is not None and self.guided is not None:
            self.guided.remove_matcher(seq.matcher_key)  # nothing needs it any more
        sid = seq.session_id
        if (sid is not None and keep_session and reason in ("stop", "length")
                and seq.num_computed > 0):
            # the last sampled token has no KV yet; the next turn recomputes it
            self.blocks.keep_session(sid, seq.token_ids[:seq.num_computed], seq.block_table)
        else:
            self.blocks.free(seq.block_table)
        out = RequestOutput(seq.request_id, text, list(new_tokens), logprobs, finished=True,
                            finish_reason=reason, error=error, error_kind=error_kind,
                            reasoning=reasoning, **self._usage(seq))
        if seq.thinking is not None:
            out.reasoning_tokens = seq.thinking.tokens
        if seq.ending is not None and reason in ("stop", "length"):
            self.policy.report(seq, reason, out)
        compiled = seq.compiled
        if compiled is not None:
            out.grammar_engine = compiled.engine
            if compiled.exact and out.approximated:
                # the backend refuses what it cannot enforce exactly; a custom format it
                # drops (it constrains nothing) stays said: nothing checked it
                out.approximated = not_checked(out.approximated)
        return out

    def _unschedulable(self) -> list[RequestOutput]:
        """Nothing could run: the head of the queue needs more KV than the whole cache
        holds (a preempted sequence that grew too long). End it with "length"."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        seq = self.scheduler.waiting[0]
        self.blocks.free(seq.block_table)
        return [self._finish(seq, "length", text=seq.detokenizer.flush(), keep_session=False)]

    @staticmethod
    def _usage(seq: Sequence) -> dict:
        return dict(prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output,
                    cached_tokens=seq.cached_tokens)

    # convenience ------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
        """Runs requests to completion; returns one merged output per request id."""
        merged: dict[str, RequestOutput] = {}
        for r in requests:
            self.add_request(r)
            merged[r.request_id] = RequestOutput(r.request_id, logprobs=[])
        while self.has_work():
            for out in self.step():
                merged[out.request_id].merge(out)
        return merged

    def stats(self) -> EngineStats:
        sched = self.scheduler
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            running_tokens=sum(len(s.token_ids) for s in sched.running),
            waiting_tokens=sum(s.num_pending for s in sched.waiting),
            free_blocks=self.blocks.num_free,
            total_blocks=self.blocks.num_blocks,
            session_blocks=self.blocks.num_session_blocks,
            live_sessions=len(self.blocks.sessions),
            preemptions=sched.num_preemptions,
            steps=self.num_steps,
            waiting_for_grammar=len(self.waiting_for_grammar),
            live_processors=self.guided.num_matchers if self.guided else 0,
            grammar_cache=self.guided.stats.as_dict() if self.guided else {},
            session_ids=sorted(set(self.blocks.sessions) | {
                s.session_id for s in self.seqs.values() if s.session_id is not None}),
            thinking_tokens=self.thinking_tokens,
            thoughts_forced=self.thoughts_forced,
            **(self.policy.stats if self.policy else PolicyStats()).as_dict(),
            **(self._jumper.stats if self._jumper else JumpStats()).as_dict(),
            sampled_tokens=self.num_sampled,
        )



_ANSWER_SLACK = 8  # tokens a thought leaves above the answer's known length (reasoning.py)
