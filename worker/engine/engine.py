"""The synchronous engine: requests in, one step at a time, output chunks out.

    def step(self):
        scheduled = self.scheduler.schedule()
        proc = FusedLogitsProcessor(inputs, self.guided); proc.prepare()  # mask fill starts
        logits, rows = self.runner.run(scheduled)                         # ... under the forward
        tokens = self.sampler(logits, inputs.rows, proc); proc.accept_token(tokens)

A guided request first waits (WAITING_FOR_GRAMMAR) while its grammar compiles on the
manager's thread pool; the batch goes on without it. ``AsyncEngine`` (async_engine.py)
drives ``step()`` from a thread for the Ray actor.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import torch

from worker.engine import bitmask
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.guided_process import GuidedDecodingManager
from worker.engine.logits_process import FusedLogitsProcessor, RowStatus, StepTimings
from worker.engine.model_runner import ModelRunner, kv_bytes_per_token
from worker.engine.sampling import ARSamplingStrategy, Sampler
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import GenerationRequest, RequestOutput, Sequence, SeqStatus
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
    live_processors: int = 0
    grammar_cache: dict = field(default_factory=dict)
    session_ids: list = field(default_factory=list)  # sessions with KV or requests here


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None,
                 model_dir=None):
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
                max_batch_size=config.max_num_seqs, cache_actor=config.grammar_cache_actor)
            if self.runner.device.type == "cpu":  # compile the mask kernel off the hot path
                threading.Thread(target=bitmask.warmup, daemon=True).start()
        self.seqs: dict[str, Sequence] = {}
        self.waiting_for_grammar: list[Sequence] = []
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_timings = StepTimings()

    # requests ---------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> Sequence:
        """Validates and queues a request; a bad request raises ValueError and changes nothing."""
        if request.request_id in self.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        prompt_ids = self.encode_prompt(request.prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens but the model context is "
                             f"{self.max_model_len}; shorten the prompt")
        if not self.scheduler.can_ever_fit(len(prompt_ids) + 1):
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than the KV cache "
                             f"holds ({self.blocks.num_blocks * self.blocks.block_size}); "
                             "shorten the prompt or raise kv_cache_gb")
        seed = request.params.seed
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=request.params.stop)
        if request.grammar is not None and self.guided is None:
            raise ValueError("guided decoding is disabled in this engine (EngineConfig.guided)")
        seq = Sequence(request, prompt_ids, detok, generator)
        self.seqs[seq.request_id] = seq
        if seq.grammar is not None:
            seq.grammar_future = self.guided.get_grammar(seq.grammar)
            seq.status = SeqStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(seq)
        else:
            self.scheduler.add(seq)
        return seq

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

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its blocks; returns its final chunk (None if unknown)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort", keep_session=False)

    def end_session(self, session_id: str) -> list[RequestOutput]:
        """Ends a session: aborts its requests in flight, frees its KV, and queues it in the
        sampling strategy so the next forward deletes its processors (an idle engine
        releases them at once). Returns the final chunks of the aborted requests."""
        outs = [self._finish(s, "abort") for s in list(self.seqs.values())
                if s.session_id == session_id]
        self.blocks.drop_session(session_id)
        self.strategy.on_session_end(session_id)
        if not self.has_work():
            self._release_ended_sessions()
        return outs

    def _release_ended_sessions(self) -> None:
        ended = self.strategy.take_session_to_cleanup()
        if self.guided is not None and ended:
            self.guided.remove_sessions(ended)

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
            proc.prepare()  # releases ended sessions; the bitmask fill overlaps the forward
            logits, rows = self.runner.run(scheduled)
        except Exception as exc:  # a failed forward fails its batch, not the engine
            logger.exception("model step failed")
            return outputs + [self._finish(s.seq, "error", error=f"model step failed: {exc}",
                                           error_kind="internal") for s in scheduled]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        if sampling:
            result = self.sampler(logits, inputs.rows, proc)
            status = proc.accept_token(result.token_ids)
            outputs += [self._append_token(seq, tok, lp, status.get(i))
                        for i, (seq, tok, lp) in enumerate(
                            zip(sampling, result.token_ids, result.logprobs))]
        self.last_timings = proc.timings
        return outputs

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Moves requests whose grammar compiled into the scheduler's queue; fails those
        whose grammar is invalid or took longer than the configured limit."""
        outputs = []
        limit = self.config.grammar_timeout_s
        for seq in list(self.waiting_for_grammar):
            fut = seq.grammar_future
            if fut.done():
                if fut.exception() is not None:
                    exc = fut.exception()  # a bad grammar, or the compile service failed
                    kind = "grammar" if isinstance(exc, ValueError) else "grammar_wait"
                    outputs.append(self._finish(seq, "error", error=str(exc),
                                                error_kind=kind))
                    continue
                self.waiting_for_grammar.remove(seq)
                self.guided.add_processor(seq.processor_key, fut.result())
                seq.status = SeqStatus.WAITING
                self.scheduler.add(seq)
            elif time.monotonic() - seq.arrival > limit:
                outputs.append(self._finish(seq, "error", error=(
                    f"the {seq.grammar.kind} grammar was not ready within {limit:g} s "
                    "(compiling it, or the grammar cache, is too slow right now); retry, "
                    "or simplify the grammar"), error_kind="grammar_wait"))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob,
                      status: RowStatus | None = None) -> RequestOutput:
        seq.token_ids.append(token)
        p = seq.params
        lps = [logprob] if logprob is not None else None
        if status is not None and status.error:
            return self._finish(seq, "error", new_tokens=[token], logprobs=lps,
                                error=f"request {seq.request_id}: {status.error}",
                                error_kind="rejected")
        reason = None
        is_eos = token in self.eos_ids and not p.ignore_eos
        if (status is not None and status.terminated) or is_eos or token in p.stop_token_ids:
            reason, text = "stop", ""
        else:
            text = seq.detokenizer.add_tokens([token])
            if seq.detokenizer.stopped is not None:
                reason = "stop"
        if reason is None and (seq.num_output >= p.max_new_tokens
                               or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            text += seq.detokenizer.flush()
            return self._finish(seq, reason, text=text, new_tokens=[token], logprobs=lps)
        return RequestOutput(seq.request_id, text, [token], lps, **self._usage(seq))

    def _finish(self, seq: Sequence, reason: str, *, text: str = "", new_tokens=(),
                logprobs=None, error: str | None = None, error_kind: str | None = None,
                keep_session: bool = True) -> RequestOutput:
        if seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar.remove(seq)
            seq.status = SeqStatus.FINISHED
        else:
            self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        if seq.grammar is not None:
            self.guided.remove_processor(seq.processor_key)  # nothing needs it any more
        sid = seq.session_id
        if (sid is not None and keep_session and reason in ("stop", "length")
                and seq.num_computed > 0):
            # the last sampled token has no KV yet; the next turn recomputes it
            self.blocks.keep_session(sid, seq.token_ids[:seq.num_computed], seq.block_table)
        else:
            self.blocks.free(seq.block_table)
        return RequestOutput(seq.request_id, text, list(new_tokens), logprobs, finished=True,
                             finish_reason=reason, error=error, error_kind=error_kind,
                             **self._usage(seq))

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
                _merge(merged[out.request_id], out)
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
            live_processors=self.guided.num_processors if self.guided else 0,
            grammar_cache=dict(self.guided.stats) if self.guided else {},
            session_ids=sorted(set(self.blocks.sessions) | {
                s.session_id for s in self.seqs.values() if s.session_id is not None}),
        )


def _merge(acc: RequestOutput, out: RequestOutput) -> None:
    acc.text += out.text
    acc.token_ids.extend(out.token_ids)
    if out.logprobs:
        acc.logprobs.extend(out.logprobs)
    for name in ("finished", "finish_reason", "error", "error_kind", "prompt_tokens",
                 "completion_tokens", "cached_tokens"):
        setattr(acc, name, getattr(out, name))
