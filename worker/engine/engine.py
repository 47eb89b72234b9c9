"""The synchronous engine: requests in, one step at a time, output chunks out.

    def step(self):
        scheduled = self.scheduler.schedule()
        proc = FusedLogitsProcessor(inputs, self.guided); proc.prepare()  # mask fill starts
        logits, rows = self.runner.run(scheduled)                         # ... under the forward
        tokens = self.sampler(logits, inputs.rows, proc); proc.accept_token(tokens)

A guided request first waits (WAITING_FOR_GRAMMAR) while its grammar compiles on the
manager's thread pool; the batch goes on without it. ``AsyncEngine`` (async_engine.py)
drives ``step()`` from a thread for the Ray actor. The engine imports no Ray: a worker
injects how grammars are fetched (``grammar_fetch``).

Conformance (issue 12): each guided request has its own matcher; near the end of its
token budget the engine steers it to the grammar's shortest completion (closing.py), so a
response cut by its budget still parses; a stop string or stop token id ends a guided
request only where its grammar may end; each finished JSON output is validated against
its full schema (validation.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from grammar_cache.errors import ErrorKind, GrammarError
from worker.engine import bitmask
from worker.engine.block_manager import BlockManager
from worker.engine.closing import Completion
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.guided_process import GrammarFetchFactory, GuidedDecodingManager
from worker.engine.logits_process import FusedLogitsProcessor, RowStatus, StepTimings
from worker.engine.model_runner import ModelRunner, kv_bytes_per_token
from worker.engine.sampling import ARSamplingStrategy, Sampler
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import GenerationRequest, RequestOutput, Sequence, SeqStatus
from worker.engine.validation import approximated_keywords, validate_json
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
    budget_checks: int = 0  # guided requests whose budget was checked at admission
    budget_checks_memo: int = 0  # ... judged from a remembered verdict (no search)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None,
                 model_dir=None, grammar_fetch: GrammarFetchFactory | None = None):
        """``grammar_fetch(tokenizer_info)`` returns the function that turns a GrammarSpec
        into a compiled grammar (a worker in a cluster passes
        ``lambda info: GrammarCacheClient(info, ...).fetch``); None compiles in-process."""
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
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        self.sampler = Sampler()
        self.strategy = ARSamplingStrategy()
        self.guided: GuidedDecodingManager | None = None
        if config.guided:
            self.guided = GuidedDecodingManager.from_tokenizer(
                tokenizer, model.config.vocab_size, sorted(self.eos_ids),
                max_batch_size=config.max_num_seqs, grammar_fetch=grammar_fetch,
                cache_bytes=config.grammar_cache_bytes)
            self.guided.closer.time_limit_s = config.closing_search_ms / 1000
            if self.runner.device.type == "cpu":  # compile the mask kernel off the hot path
                threading.Thread(target=bitmask.warmup, daemon=True).start()
        self.seqs: dict[str, Sequence] = {}
        self.waiting_for_grammar: list[Sequence] = []
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_timings = StepTimings()
        self.counters = {"closed_early": 0, "validated": 0, "invalid": 0, "runaway": 0,
                         "closing_giveups": 0, "closing_steered": 0,
                         "closing_searches": 0, "closing_reused": 0,
                         "budget_checks": 0, "budget_checks_memo": 0}
        # (grammar key, budget) -> (time, certain, closing path or None, refusal or None):
        # a fresh request's grammar state depends only on its grammar, so the admission
        # search's verdict holds for every request with the same grammar and budget
        self._budget_memo: OrderedDict[tuple[str, int], tuple] = OrderedDict()

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
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
        # a continuation's text goes on exactly after the text the caller already has
        # (never repeating it, and never losing a character split across the failover)
        already = ""
        if resumed:
            already = request.resume_text
            if already is None:  # a clean prefix of their decode: what a worker sends
                already = self.tokenizer.decode(resumed, skip_special_tokens=True)
                already = already.rstrip("\ufffd")
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=request.params.stop,
                                       resumed_token_ids=resumed, resumed_text=already)
        if request.grammar is not None and self.guided is None:
            raise ValueError("guided decoding is disabled in this engine (EngineConfig.guided)")
        seq = Sequence(request, prompt_ids, detok, generator)
        seq.token_ids.extend(resumed)  # output already streamed: KV recomputed, not re-emitted
        seq.resumed_text = already  # what the caller has, for validating the whole output
        self.seqs[seq.request_id] = seq
        if seq.grammar is not None:
            seq.grammar_future = self.guided.get_grammar(seq.grammar)
            seq.status = SeqStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(seq)
        else:
            self.scheduler.add(seq)
        return seq

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
            for i, seq in enumerate(sampling):
                if seq.forced_path:  # closing from the start (see _plan_close_at_start)
                    forced = seq.forced_path[0]
                else:
                    forced = self._keep_closable(seq, result.token_ids[i])
                if forced is not None and forced != result.token_ids[i]:
                    result.token_ids[i] = forced
                    if result.logprobs:
                        result.logprobs[i] = None  # forced: not sampled from the model
            status = proc.accept_token(result.token_ids)
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
                    kind = exc.kind if isinstance(exc, GrammarError) else \
                        ErrorKind.GRAMMAR_UNAVAILABLE
                    outputs.append(self._finish(seq, "error", error=str(exc) or repr(exc),
                                                error_kind=kind))
                    continue
                compiled = fut.result()
                matcher = self.guided.add_matcher(seq.matcher_key, compiled)
                seq.compiled = compiled
                if seq.num_output and not self._advance_resumed(seq, matcher, outputs):
                    continue
                too_small = self._budget_too_small(seq, matcher)
                if too_small is not None:
                    outputs.append(self._finish(seq, "error", error=too_small,
                                                error_kind=ErrorKind.BUDGET_TOO_SMALL))
                    continue
                if seq.params.stop:  # a stop string only where the grammar may end
                    seq.detokenizer.stop_check = _grammar_accepts(compiled)
                self._plan_close_at_start(seq, matcher)
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
        """A continuation's matcher is advanced over the output it resumes. False (the
        request finished) when the grammar refuses that output, or it already completes
        the grammar."""
        for token in seq.output_ids:
            if not matcher.accept_token(token):
                outputs.append(self._finish(seq, "error", error=(
                    "cannot resume: the grammar does not accept the output streamed before "
                    "the worker died; resend the request"), error_kind=ErrorKind.WORKER_DIED))
                return False
        if matcher.is_terminated():
            outputs.append(self._finish(seq, "stop"))
            return False
        return True

    def _plan_close_at_start(self, seq: Sequence, matcher) -> None:
        """A budget already down to the grammar's shortest output (plus ``closing_margin``)
        gets that output: one freely sampled token could leave no room to close. The
        prompt still runs (a session keeps its KV); its first token is the path's first,
        and the rest follows at once (``_maybe_close``)."""
        path, seq.closing_start = seq.closing_start, None
        if not path or self._remaining(seq) > len(path) + self.config.closing_margin:
            return
        probe = matcher.fork()
        if all(probe.accept_token(t) for t in path):
            seq.forced_path = path

    def _remaining(self, seq: Sequence) -> int:
        """Tokens the request may still generate: its max_new_tokens, or the context."""
        return min(seq.params.max_new_tokens - seq.num_output,
                   self.max_model_len - len(seq.token_ids))

    def _budget_too_small(self, seq: Sequence, matcher) -> str | None:
        """A message when the grammar's shortest output needs more tokens than the
        request's budget (checked only for budgets within the closing window).

        A fresh request's verdict is remembered per (grammar, budget): a verdict the
        searches proved is kept; one from searches cut short by their time limit (a busy
        engine, a grammar with no short completion) is reused for ``_MEMO_UNSURE_S`` and
        then searched again, so such grammars cost one search per few seconds, not one per
        request."""
        budget = self._remaining(seq)
        if not self.config.closing_window or budget > self.config.closing_window:
            return None
        self.counters["budget_checks"] += 1
        key = None
        if not seq.output_ids:  # a continuation's state depends on what it resumes
            key = (seq.grammar.key(self.guided.fingerprint), budget)
            hit = self._budget_memo.get(key)
            if hit is not None and (hit[1] or time.monotonic() - hit[0] < _MEMO_UNSURE_S):
                self._budget_memo.move_to_end(key)
                self.counters["budget_checks_memo"] += 1
                path, need = hit[2], hit[3]
                return self._budget_verdict(seq, budget, path, need)
        closer = self.guided.closer
        timeouts = closer.stats["timeouts"]
        path, need = self._budget_search(matcher, budget, closer.pending_bytes(seq.output_ids))
        if key is not None:
            certain = closer.stats["timeouts"] == timeouts
            self._budget_memo[key] = (time.monotonic(), certain, path, need)
            while len(self._budget_memo) > _BUDGET_MEMO_SIZE:
                self._budget_memo.popitem(last=False)
        return self._budget_verdict(seq, budget, path, need)

    def _budget_search(self, matcher, budget: int, pending: int
                       ) -> tuple[list[int] | None, str | None]:
        """(a closing path that fits the budget, or None; the tokens the shortest output
        needs when the budget is refused, else None)."""
        closer = self.guided.closer
        found = closer.fitting(matcher, budget, pending=pending)
        if found.tokens is not None and len(found.tokens) <= budget:
            return found.tokens, None
        if found.tokens is None:
            more = closer.shortest(matcher, max(4 * budget, 256), pending=pending)
            if more.tokens is not None and len(more.tokens) <= budget:
                return None, None  # the first search was cut short; this one fits
            if more.tokens is None and not more.exhausted:
                return None, None  # nothing found in time: we do not know: no refusal
            found = more
        # the searches are heuristic: refuse what they prove (exhausted), or where the
        # shortest they found is well over the budget (a field of 36 fixed characters
        # opened at max_tokens=32: the output could only end invalid)
        if (found.tokens is not None and not found.exhausted
                and len(found.tokens) <= budget + budget // 4):
            return None, None
        return None, (f"more than {budget}" if found.tokens is None else
                      f"at least {len(found.tokens)}" if found.exhausted else
                      f"about {len(found.tokens)}")

    @staticmethod
    def _budget_verdict(seq: Sequence, budget: int, path: list[int] | None,
                        need: str | None) -> str | None:
        if path is not None:
            seq.closing_estimate = (seq.num_output, len(path))
            seq.closing_start = list(path)
            seq.closing_path = (seq.num_output, list(path), 0)  # for _maybe_close
            return None
        if need is None:
            return None
        which = ("max_tokens" if budget == seq.params.max_new_tokens
                 else "the context left after the prompt")
        return (f"the {seq.grammar.kind} grammar's shortest output needs {need} tokens, but "
                f"{which} allows {budget}; raise max_tokens (or shorten the prompt)")

    def _maybe_close(self, seq: Sequence) -> tuple[list[int], str] | None:
        """Budget-aware closing (see closing.py). When the tokens left are down to the
        grammar's shortest completion (plus ``closing_margin``), returns that completion,
        already accepted by the request's matcher, and the finish reason; else None."""
        if seq.forced_path is not None:  # its first token was just taken: the rest now
            path, seq.forced_path = seq.forced_path[1:], None
            return self._force(seq, path)
        cfg = self.config
        left = self._remaining(seq)
        if not cfg.closing_window or left > cfg.closing_window or seq.closing_failed:
            return None
        if seq.num_output < seq.closing_retry_at:
            return None
        est = seq.closing_estimate
        if est is not None:
            # one token grows the shortest completion by a few tokens at most (it can open
            # a string, an object and a key at once): skip the search while far from it
            # (within _GUARD_ZONE of it, every step searches: the guard in _keep_closable
            # needs this step's path, and one token such as ', {"' can add more than that)
            at, need = est
            if left > max(need + _GROWTH * (seq.num_output - at),
                          need + _GUARD_ZONE) + cfg.closing_margin:
                return None
        matcher = self.guided.matchers.get(seq.matcher_key)
        if matcher is None:
            return None
        carried, slack = self._carried_path(seq, matcher)
        if carried is not None and (left > len(carried) + cfg.closing_margin
                                    or slack <= _TRUSTED_SLACK and len(carried) <= left):
            # the last path still closes from here (followed or replayed: microseconds,
            # where a search costs milliseconds). One that may be longer than the
            # shortest from here by more than _TRUSTED_SLACK is searched again before it
            # is emitted
            self.counters["closing_reused"] += 1
            found = Completion(carried, False)
        else:
            closer = self.guided.closer
            pending = closer.pending_bytes(seq.output_ids)
            self.counters["closing_searches"] += 1
            found = closer.fitting(matcher, left, pending=pending)
            if carried is not None and (found.tokens is None
                                        or len(found.tokens) > len(carried)):
                found = Completion(carried, found.exhausted)  # cut short: the replayed one
            else:
                slack = 0
            if found.tokens is None or len(found.tokens) > left:
                # no completion fits: stop searching once that is certain (the shortest
                # only grows as the budget shrinks); a search that gave up is tried again
                # a few tokens later, at most _GIVEUPS times
                if not found.exhausted:
                    seq.closing_giveups += 1
                    seq.closing_retry_at = seq.num_output + 2 ** (seq.closing_giveups - 1)
                    seq.closing_failed = seq.closing_giveups >= _GIVEUPS
                    self.counters["closing_giveups"] += 1
                else:
                    seq.closing_failed = True
                return None
        seq.closing_estimate = (seq.num_output, len(found.tokens))
        if left > len(found.tokens) + cfg.closing_margin:
            # near the end, the next sampled token is checked against this path: one
            # token can cost many (", " in an array opens a whole object)
            seq.closing_path = (seq.num_output, found.tokens, slack)
            return None
        if not found.tokens and self.guided.only_stop_allowed(matcher):
            return [], "stop"  # complete, and the grammar allows nothing more
        return self._force(seq, found.tokens)

    @staticmethod
    def _carried_path(seq: Sequence, matcher) -> tuple[list[int] | None, int]:
        """The closing path last found for this request, if it still closes the output
        from here, and its slack: by how many tokens it may be longer than the shortest
        from here. Its rest, when the tokens since were its own (the rest of a shortest
        path is the shortest from there); else the whole path, when the matcher, forked,
        accepts it and may end after it (the usual case inside a string: another word
        leaves '", "tags": []}' as it was).

        The slack follows from one bound: a token shortens the shortest completion by one
        at most. A path found by a search has none (a search is the reference); k tokens
        after a path of length L with slack s, the shortest is at least L - s - k long."""
        at = seq.closing_path
        if at is None:
            return None, _UNKNOWN
        at_output, path, slack = at
        since = seq.output_ids[at_output:]
        if since == path[:len(since)]:
            return path[len(since):], slack
        if _closes(matcher, path):
            return list(path), slack + len(since)
        return None, _UNKNOWN

    def _keep_closable(self, seq: Sequence, token: int) -> int | None:
        """Within ``_GUARD_ZONE`` tokens of the closing path found for this very state: the
        sampled token if the output can still close after it within the budget, else the
        path's first token (which can). None: not checked."""
        at_path = seq.closing_path
        if at_path is None or at_path[0] != seq.num_output or not at_path[1]:
            return None
        path = at_path[1]
        left = self._remaining(seq) - 1  # after this token
        if token == path[0] or left > len(path) + _GUARD_ZONE:
            return None
        matcher = self.guided.matchers.get(seq.matcher_key)
        if matcher is None:
            return None
        probe = matcher.fork()
        if not probe.accept_token(token):
            return None  # not the grammar's: the guard in the sampler handles it
        closer = self.guided.closer
        # no search where the path still closes after this token: as it was (another word
        # in a string), or what is left of its text once the token's own is taken off
        # (' "' sampled where the path begins '""'). Its slack (see _carried_path) grows
        # by one unless it got one shorter, or the token left the parser where it was
        for again in (path, closer.rest_after(path, token)):
            if again is not None and len(again) <= left and _closes(probe, again):
                slack = at_path[2] + 1 - (len(path) - len(again))
                if closer.same_place(matcher, probe):
                    slack = min(slack, at_path[2])
                seq.closing_path = (seq.num_output + 1, again, max(slack, 0))
                return None
        self.counters["closing_searches"] += 1
        found = closer.shortest(probe, 2 * left + 8,
                                pending=closer.pending_bytes(seq.output_ids + [token]))
        if found.tokens is not None and len(found.tokens) <= left:
            seq.closing_path = (seq.num_output + 1, found.tokens, 0)  # for _maybe_close
            return None
        self.counters["closing_steered"] += 1
        return path[0]

    def _force(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str]:
        """Feeds a closing path to the request's matcher (which checks every token)."""
        matcher = self.guided.matchers.get(seq.matcher_key)
        for i, t in enumerate(tokens):
            if matcher is None or not matcher.accept_token(t):
                logger.error("closing: the grammar refused forced token %d", t)
                return tokens[:i], "length"
        return tokens, "length"

    def _append_token(self, seq: Sequence, token: int, logprob,
                      status: RowStatus | None = None) -> RequestOutput:
        p = seq.params
        # None in the list: a forced token (not sampled), still one entry per token
        lps = [logprob] if logprob is not None or p.logprobs is not None else None
        if status is not None and status.error:
            seq.token_ids.append(token)
            return self._finish(seq, "error", new_tokens=[token], logprobs=lps,
                                error=f"request {seq.request_id}: {status.error}",
                                error_kind=status.error_kind or ErrorKind.INTERNAL)
        seq.token_ids.append(token)
        reason = None
        text = ""
        if seq.grammar is not None:
            # a guided row ends where its grammar says: EOS (terminated) or a stop token id
            # where the grammar may end; other stop ids were grammar content
            if status is not None and (status.terminated or status.stop):
                reason = "stop"
        elif (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        new_tokens = [token]
        if reason is None:
            text = seq.detokenizer.add_tokens([token])
            if seq.detokenizer.stopped is not None:
                reason = "stop"
        if reason is None and seq.grammar is not None and self.guided is not None:
            closed = self._maybe_close(seq)
            if closed is not None:
                forced, reason = closed
                seq.closed_early = reason == "length"
                if forced:
                    seq.token_ids.extend(forced)
                    new_tokens += forced
                    if lps is not None:
                        lps += [None] * len(forced)  # forced: not sampled from the model
                    text += seq.detokenizer.add_tokens(forced)
                    if seq.detokenizer.stopped is not None:
                        reason = "stop"
        if reason is None and self._remaining(seq) <= 0:
            reason = "length"
        if reason is not None:
            text += seq.detokenizer.flush()
            return self._finish(seq, reason, text=text, new_tokens=new_tokens, logprobs=lps)
        return RequestOutput(seq.request_id, text, new_tokens, lps, **self._usage(seq))

    def _finish(self, seq: Sequence, reason: str, *, text: str = "", new_tokens=(),
                logprobs=None, error: str | None = None, error_kind: ErrorKind | None = None,
                keep_session: bool = True) -> RequestOutput:
        if seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar.remove(seq)
            seq.status = SeqStatus.FINISHED
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
                            **self._usage(seq))
        if seq.grammar is not None and reason in ("stop", "length"):
            self._report_conformance(seq, reason, out)
        return out

    def _report_conformance(self, seq: Sequence, reason: str, out: RequestOutput) -> None:
        """Closing and validation results onto the final chunk (once per request)."""
        out.closed_early = seq.closed_early
        if seq.closed_early:
            self.counters["closed_early"] += 1
        elif reason == "length":
            self.counters["runaway"] += 1
        kind = seq.grammar.kind
        if kind not in ("json_schema", "json_object"):
            return
        schema = seq.grammar.source if kind == "json_schema" else None
        out.approximated = approximated_keywords(schema) if schema else []
        if seq.validation == "off":
            return
        error = validate_json(schema, seq.resumed_text + seq.detokenizer.text)
        self.counters["validated"] += 1
        out.validation = "valid" if error is None else "invalid"
        if error is not None:
            self.counters["invalid"] += 1
            out.validation_error = error

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
            grammar_cache=dict(self.guided.stats) if self.guided else {},
            session_ids=sorted(set(self.blocks.sessions) | {
                s.session_id for s in self.seqs.values() if s.session_id is not None}),
            **self.counters,
        )


_GUARD_ZONE = 12  # tokens above the closing path within which sampled tokens are checked
_GIVEUPS = 4  # searches that hit their node cap before a request stops searching
_TRUSTED_SLACK = 2  # a path at most this much longer than the shortest is emitted unsearched
_UNKNOWN = 1 << 30  # the slack of a path that no search stands behind
_GROWTH = 3  # how much one token may lengthen the shortest completion (see _maybe_close)


def _closes(matcher, tokens: list[int]) -> bool:
    """Whether ``tokens`` take the matcher's output to where it may end (tried on a fork:
    microseconds)."""
    probe = matcher.fork()
    return all(probe.accept_token(t) for t in tokens) and probe.is_completed()


def _grammar_accepts(compiled):
    """text -> whether the grammar accepts exactly ``text`` (and may end there)."""
    def check(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()
    return check
_BUDGET_MEMO_SIZE = 4096  # (grammar, budget) admission verdicts kept
_MEMO_UNSURE_S = 5.0  # how long a verdict from searches cut short is reused
