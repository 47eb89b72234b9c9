"""The synchronous engine: requests in, one step at a time, output chunks out.

    def step(self):
        scheduled = self.scheduler.schedule()
        logits, rows = self.runner.run(scheduled)
        return self._postprocess(scheduled, logits, rows)

``AsyncEngine`` (async_engine.py) drives ``step()`` from a thread for the Ray actor.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.model_runner import ModelRunner, kv_bytes_per_token
from worker.engine.sampling import Sampler, SamplingRow
from worker.engine.scheduler import ScheduledSeq, Scheduler
from worker.engine.sequence import GenerationRequest, RequestOutput, Sequence
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
        self.model, self.tokenizer = model, tokenizer
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
        self.seqs: dict[str, Sequence] = {}
        self._ended_sessions: set[str] = set()
        self._rng = random.Random(config.seed)
        self.num_steps = 0

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
        seq = Sequence(request, prompt_ids, detok, generator)
        self.seqs[seq.request_id] = seq
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

    def end_session(self, session_id: str) -> None:
        """Frees an idle session's KV now; a session with a request in flight is freed when
        that request finishes."""
        self.blocks.drop_session(session_id)
        if any(s.session_id == session_id for s in self.seqs.values()):
            self._ended_sessions.add(session_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return self._unschedulable()
        self.num_steps += 1
        try:
            logits, rows = self.runner.run(scheduled)
        except Exception as exc:  # a failed forward fails its batch, not the engine
            logger.exception("model step failed")
            return [self._finish(s.seq, "error", error=f"model step failed: {exc}")
                    for s in scheduled]
        return self._postprocess(scheduled, logits, rows)

    def _postprocess(self, scheduled: list[ScheduledSeq], logits, rows) -> list[RequestOutput]:
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        sampling = [scheduled[i].seq for i in rows]
        if not sampling:
            return []
        result = self.sampler(logits, [
            SamplingRow(q.params, q.generator, q.prompt_ids, q.output_ids) for q in sampling])
        return [self._append_token(seq, token, lp)
                for seq, token, lp in zip(sampling, result.token_ids, result.logprobs)]

    def _append_token(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        seq.token_ids.append(token)
        p = seq.params
        reason = None
        is_eos = token in self.eos_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            reason, text = "stop", ""
        else:
            text = seq.detokenizer.add_tokens([token])
            if seq.detokenizer.stopped is not None:
                reason = "stop"
        if reason is None and (seq.num_output >= p.max_new_tokens
                               or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        lps = [logprob] if logprob is not None else None
        if reason is not None:
            text += seq.detokenizer.flush()
            return self._finish(seq, reason, text=text, new_tokens=[token], logprobs=lps)
        return RequestOutput(seq.request_id, text, [token], lps, **self._usage(seq))

    def _finish(self, seq: Sequence, reason: str, *, text: str = "", new_tokens=(),
                logprobs=None, error: str | None = None, keep_session: bool = True
                ) -> RequestOutput:
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        sid = seq.session_id
        if (sid is not None and keep_session and reason in ("stop", "length")
                and sid not in self._ended_sessions and seq.num_computed > 0):
            # the last sampled token has no KV yet; the next turn recomputes it
            self.blocks.keep_session(sid, seq.token_ids[:seq.num_computed], seq.block_table)
        else:
            self.blocks.free(seq.block_table)
        if sid is not None and not any(s.session_id == sid for s in self.seqs.values()):
            self._ended_sessions.discard(sid)
        return RequestOutput(seq.request_id, text, list(new_tokens), logprobs, finished=True,
                             finish_reason=reason, error=error, **self._usage(seq))

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
        )


def _merge(acc: RequestOutput, out: RequestOutput) -> None:
    acc.text += out.text
    acc.token_ids.extend(out.token_ids)
    if out.logprobs:
        acc.logprobs.extend(out.logprobs)
    for name in ("finished", "finish_reason", "error", "prompt_tokens", "completion_tokens",
                 "cached_tokens"):
        setattr(acc, name, getattr(out, name))
