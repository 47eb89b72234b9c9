"""The synchronous engine: requests in, one step at a time, output chunks out.

    def step(self):
        scheduled = self.scheduler.schedule()
        proc = FusedLogitsProcessor(inputs, self.mask); proc.prepare()  # mask fill starts
        logits, rows = self.runner.run(scheduled)                         # ... under the forward
        result = self.sampler(logits, inputs.rows, proc)      # penalties, mask, draw
        self.guide.steer(...); proc.accept_token(result.token_ids)  # then _append_token

A guided request first waits (WAITING_FOR_GRAMMAR) while its grammar compiles on the
manager's thread pool; the batch goes on without it. ``AsyncEngine`` (async_engine.py)
drives ``step()`` from a thread for the Ray actor. The engine imports no Ray: a worker
injects how grammars are fetched (``grammar_fetch``).

What a request's grammar or thought changes is its guided part's (``Sequence.guide``,
worker/guided/request.py): the engine calls its hooks (``attach`` on arrival, ``admit``
when the grammar is ready, ``begin_step`` first in a step, ``steer`` and ``after_sample``
after the draw, ``resume`` for a row parked while its closing searched, ``releasable``
for the stream, ``finish`` at the end) and knows nothing of closing, the loop guard,
thoughts or the grammar libraries.

Why one module over 500 lines: the step in its two forms (``step`` and, on a GPU,
``_step_overlapped``) share the request lifecycle around them (admit, append, release,
finish); split apart, each would reach into the other's state.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import torch

from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.guided.detokenizer import ByteVocab, IncrementalDetokenizer
from worker.engine.logits_process import FusedLogitsProcessor, RowStatus, StepTimings
from worker.engine.model_runner import ModelRunner, kv_bytes_per_token
from worker.engine.sampling import ARSamplingStrategy, Sampler, SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.speculative import Drafter
from core.request import GenerationRequest, RequestOutput
from worker.engine.sequence import Sequence, SeqStatus
from worker.guided.guided_process import GrammarFetchFactory, GuidedDecodingManager
from worker.guided.request import GuidedCounters, GuidedPath, Outcome
from worker.models import loader

logger = logging.getLogger(__name__)

# speculation: a row drafts after at most this many pending tokens (its sampled one and
# what jump-forward forced after it: a CUDA graph's row holds 16 tokens)
MAX_DRAFTING_PENDING = 8

# a request draws at most this many tokens per token of its max_new_tokens: what loop cuts
# give back is generated again only up to there (see _remaining)
DRAWS_PER_TOKEN = 2


@dataclass(kw_only=True)
class EngineStats(GuidedCounters):
    """The engine's gauges (each one a worker metric): its batch and KV, and (from
    GuidedCounters) the guided path's counters."""

    running: int
    waiting: int
    running_tokens: int
    waiting_tokens: int
    free_blocks: int
    total_blocks: int
    block_size: int
    session_blocks: int
    live_sessions: int
    preemptions: int
    # prefix caching: registered blocks no one references (their KV kept), prompt tokens
    # looked up and found cached (a hit rate), cached blocks taken for other tokens
    cached_blocks: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evictions: int = 0
    steps: int = field(default=0)
    waiting_for_grammar: int = 0
    live_processors: int = 0  # grammar matchers alive (the name is on the wire: kept)
    grammar_cache: dict = field(default_factory=dict)
    session_ids: list = field(default_factory=list)  # sessions with KV or requests here
    sampled_tokens: int = 0  # tokens sampled (one per sampling row and step)
    # speculation: draft tokens computed, those the draws then equalled (an acceptance
    # rate), rows with a drafter's state (0 when nothing runs: nothing leaks)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    drafting_rows: int = 0


@dataclass
class _Sampled:
    """A step's draw (overlap): handled by the next step, under its forward."""

    proc: FusedLogitsProcessor
    seqs: list[Sequence]
    tokens: list[int]
    logprobs: list


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
        if model is None:  # a model_dir given alone is the model to load
            model_dir = loader.resolve_model_dir(model_dir or config.model,
                                                 progress=config.progress)
            model = loader.load_model(model_dir, device=config.device, dtype=config.dtype,
                                      progress=config.progress)
        if tokenizer is None:
            tokenizer = loader.load_tokenizer(model_dir)
        self.model, self.tokenizer, self.model_dir = model, tokenizer, model_dir
        ByteVocab.of(tokenizer)  # each token's bytes, read once here (detokenizer.py)
        self.eos_ids = set(loader.generation_eos_ids(model_dir, tokenizer)) if model_dir else (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.max_model_len = min(config.max_model_len or 10**9,
                                 int(model.config.max_position_embeddings))
        param = next(model.parameters())
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_gb * 2**30) // (
                kv_bytes_per_token(model, param.dtype) * config.block_size))
        self.blocks = BlockManager(num_blocks, config.block_size,
                                   prefix_caching=config.prefix_caching,
                                   root=f"{model_dir or type(model).__name__}|{param.dtype}")
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
        # the guided path (worker/guided/request.py): grammars, how outputs end, thoughts
        self.guide = GuidedPath.build(config, tokenizer, model.config.vocab_size,
                                      self.eos_ids, self.runner.device,
                                      remaining=self._remaining, grammar_fetch=grammar_fetch,
                                      grammar_limits=grammar_limits)
        self.guided: GuidedDecodingManager | None = self.guide.manager  # the grammar store
        self.mask = self.guided.mask if self.guided is not None else None  # the batch's mask
        self.seqs: dict[str, Sequence] = {}
        self.waiting_for_grammar: list[Sequence] = []
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_timings = StepTimings()
        self.num_sampled = 0
        # per request: the tokens drawn for it, cut or not (see _remaining)
        self._draws: dict[str, int] = {}
        # overlap (see _step_overlapped): on by default where the device is CUDA
        self.overlap = (config.overlap if config.overlap is not None
                        else self.runner.device.type == "cuda")
        self._ahead: _Sampled | None = None  # the last step's draw, not yet handled
        # speculation (see _verify): drafts for the plain step's decoding rows (overlapped,
        # in the steps where they pay: _drafts_pay)
        self.drafter = Drafter(config.speculative_tokens, self.eos_ids)
        self._hooks_s: float | None = None  # overlap: the hooks' time a step (decayed mean)
        self.warmup_s = None  # seconds the start's warm-up took (None: none ran)
        if config.warmup or (config.warmup is None and self.runner.device.type == "cuda"):
            self.warmup_s = self.warm_up()

    def warm_up(self) -> float:
        """Runs throwaway prompts through the step so the device kernels' variants a
        worker will need are compiled before any request: Triton specializes an integer
        argument by whether it is 1 or a multiple of 16, and the block table's width (the
        longest context's blocks in the batch) is one, so tables 1, 3, 16 and up to 128
        blocks wide, prefill and decode tiles, and the long prefill's matmul shapes. What
        it leaves: nothing (no block cached or referenced, the counters as they were).
        Returns its seconds."""
        t0 = time.perf_counter()
        size = self.blocks.block_size
        longest = min(self.max_model_len - 4, 2048,
                      (self.blocks.num_blocks - 8) * size // 2)
        # each alone (a batch's table is as wide as its longest row's), its 3 tokens
        # within the same number of blocks as its prompt
        lengths = sorted({n for n in (size // 2, 3 * size - 4, 16 * size - 4, longest)
                          if 0 < n <= longest})
        caching, self.blocks.prefix_caching = self.blocks.prefix_caching, False
        counters = (self.blocks.query_tokens, self.blocks.hit_tokens, self.num_steps,
                    self.num_sampled, self.scheduler.num_preemptions)
        try:
            vocab = self.model.config.vocab_size
            for n in lengths:
                self.generate([GenerationRequest(
                    [(7 * i + n) % vocab for i in range(n)],
                    SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
                    request_id=f"warm-up-{n}")])
        finally:
            self.blocks.prefix_caching = caching
            (self.blocks.query_tokens, self.blocks.hit_tokens, self.num_steps,
             self.num_sampled, self.scheduler.num_preemptions) = counters
        seconds = time.perf_counter() - t0
        logger.info("warmed up in %.2f s (prompts of %s tokens)", seconds, lengths)
        return seconds

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
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=request.params.stop,
                                       resumed_token_ids=resumed, resumed_text=already)
        seq = Sequence(request, prompt_ids, detok, generator)
        seq.guide = self.guide.attach(seq, request, resumed)  # None: a plain request
        seq.append(resumed, streamed=True)  # KV recomputed, not re-emitted
        seq.resumed_text = already  # what the caller has, for validating the whole output
        self.seqs[seq.request_id] = seq
        if seq.guide is not None and seq.guide.grammar_future is not None:
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
            except Exception:  # its state is broken too: still tell the caller (what it
                # held went back in _finish, whatever raised)
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
        return (self.scheduler.has_work() or bool(self.waiting_for_grammar)
                or self._ahead is not None)

    # the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.overlap:
            return self._step_overlapped()
        return self._step_plain()

    def _step_plain(self) -> list[RequestOutput]:
        outputs = self._begin_step()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.guide.searching:  # rows wait for searches: the next step goes on
                return outputs
            if self.waiting_for_grammar:  # nothing to run until a grammar is ready
                wait([s.guide.grammar_future for s in self.waiting_for_grammar], timeout=0.05,
                     return_when=FIRST_COMPLETED)
                return outputs
            return outputs + self._unschedulable()
        self.num_steps += 1
        drafts = self._draft(scheduled) if self.drafter is not None else {}
        sampling = [s.seq for s in scheduled if s.samples]
        inputs = self.strategy.make_sampling_inputs(sampling)
        proc = FusedLogitsProcessor(inputs, self.mask)
        try:
            proc.prepare()  # the bitmask fill overlaps the forward
            t0 = time.perf_counter()
            logits, rows = self.runner.run(scheduled)
            # what a forward of so many output tokens takes (a prompt's prefill, whose
            # long chunks cost less a token, is left out of the fit)
            if self.drafter is not None and all(s.seq.num_computed >= s.seq.num_prompt
                                                for s in scheduled):
                if logits.device.type == "cuda":
                    torch.cuda.synchronize(logits.device)
                self.drafter.cost.add(sum(s.num_tokens for s in scheduled),
                                      time.perf_counter() - t0)
        except Exception as exc:  # a failed forward fails its batch, not the engine
            logger.exception("model step failed")
            for seq in drafts:
                seq.take_draft()
            return outputs + [self._finish(s.seq, "error", error=f"model step failed: {exc}",
                                           error_kind=ErrorKind.INTERNAL) for s in scheduled]
        self._computed(scheduled)
        if drafts:
            return outputs + self._verify(sampling, logits, drafts, inputs, proc)
        if sampling:
            outputs += self._draw(sampling, logits, inputs, proc)
        return outputs

    def _draw(self, sampling: list[Sequence], logits, inputs, proc) -> list[RequestOutput]:
        """The plain step's draw for ``sampling`` (their logits, one row each): penalties,
        masks, the tokens, then each row's hooks (``_append_token``)."""
        result = self.sampler(logits, inputs.rows, proc)
        held = self.guide.steer(sampling, result.token_ids, result.logprobs)
        status = proc.accept_token(result.token_ids, skip=held)
        self.num_sampled += len(sampling)
        outputs = []
        for i, (seq, tok, lp) in enumerate(zip(sampling, result.token_ids, result.logprobs)):
            if i in held:  # its token waits for a search's verdict
                self.scheduler.park(seq)
            else:
                outputs.append(self._append_token(seq, tok, lp, status.get(i)))
        self.last_timings = proc.timings
        return outputs

    # Speculation (worker/engine/speculative.py). A decoding row's draft is put after its
    # pending token (``Sequence.put_draft``), so the forward computes the KV of all of them
    # and the logits after each. The draft is taken off again before anything is drawn;
    # then the rows are drawn position by position, each round exactly a plain step's
    # draw (``_draw``: the row's penalties over its output so far, its matcher where it
    # stands, its own generator's next number, every hook). A row goes on to the next
    # position while the token drawn equals its draft's and its hooks left it as it was
    # (running, nothing forced or cut): that token's KV was computed with the draft and
    # counts (``keep_ahead_kv``). So a draft decides how many tokens a forward yields,
    # never which: outputs are those of one token a step (tests/engine/
    # test_speculative_engine.py). The overlapped step launches its next forward before
    # this one's tokens are drawn, so where drafts pay it runs this step instead
    # (``_drafts_pay``).

    def _draft(self, scheduled) -> dict[Sequence, list[int]]:
        """Puts a draft after each decoding row's pending tokens (its sampled token, and
        any forced text after it), within the step's token budget, the row's own budget
        and the KV blocks free; returns them."""
        room = self.config.step_token_budget - sum(s.num_tokens for s in scheduled)
        batch = sum(1 for s in scheduled if s.samples)
        drafts = {}
        for s in scheduled:
            seq = s.seq
            if room <= 0:
                break
            if (not s.samples or seq.ahead is not None or s.num_tokens > MAX_DRAFTING_PENDING
                    or seq.num_computed < seq.num_prompt
                    or not seq.params.speculate(self.config.speculative)):
                continue  # a prompt's prefill (or a long forced text) drafts next step
            draft = self.drafter.propose(seq, min(room, self._remaining(seq) - 1), batch)
            if not draft or not self.blocks.grow(seq.block_table,
                                                 len(seq.token_ids) + len(draft)):
                continue
            seq.put_draft(draft)
            s.num_tokens += len(draft)
            s.num_logits = 1 + len(draft)
            room -= len(draft)
            drafts[seq] = draft
        if drafts:  # single-token rows first, as the runner's batch has them
            scheduled.sort(key=lambda s: not s.is_decode)
        return drafts

    def _verify(self, sampling, logits, drafts, inputs, proc) -> list[RequestOutput]:
        """Draws the rows of a step with drafts, position by position (see above); one
        chunk a request."""
        first, at = {}, 0
        for seq in sampling:  # the logits' rows: each sampling row's, in turn
            first[seq] = at
            at += 1 + len(drafts.get(seq, ()))
        for seq in drafts:
            seq.take_draft()
        merged: dict[str, RequestOutput] = {}
        rows, j = sampling, 0
        while rows:
            index = [first[seq] + j for seq in rows]
            positions = [len(seq.token_ids) for seq in rows]
            if j:
                inputs = self.strategy.make_sampling_inputs(rows)
                proc = FusedLogitsProcessor(inputs, self.mask)
                proc.prepare()
            for out in self._draw(rows, logits.index_select(
                    0, torch.tensor(index, device=logits.device)), inputs, proc):
                if out.request_id in merged:
                    merged[out.request_id].merge(out)
                else:
                    merged[out.request_id] = out
            going = []
            for seq, p in zip(rows, positions):
                draft = drafts.get(seq)
                if draft is None:
                    continue
                if j < len(draft):
                    seq.keep_ahead_kv(p, draft[j])
                if (j < len(draft) and seq.status is SeqStatus.RUNNING
                        and seq.num_computed == p + 1 == len(seq.token_ids)):
                    going.append(seq)
                else:
                    self.drafter.settle(seq.request_id, len(draft), j)
            rows, j = going, j + 1
        return list(merged.values())

    # Overlap. On a GPU the forward is launched and runs on its own; what the host does
    # after a draw (the matchers' accept, jump-forward, the loop guard, closing, stop
    # strings, the stream's text) would otherwise leave the device idle, and at batch 32
    # it takes longer than the forward. So a step launches its forward first and then
    # handles the tokens the step before drew: each drawn token is put at the end of its
    # row (``Sequence.put_ahead``) so the next forward computes it, and is taken off again
    # before its hooks run, exactly as they run without overlap. A row whose hooks changed
    # it (forced text added, a cut, the end) does not sample from this forward: its logits
    # follow a token that is no longer last; what it needs is computed by the next one
    # (the KV of its drawn token counts where the token is still there). Rows that ended
    # cost one row of one forward. Output is token for token what the step without overlap
    # gives (tests/engine/test_overlap_engine.py); chunks come one step later.

    def _step_overlapped(self) -> list[RequestOutput]:
        if self.drafter is not None and self._drafts_pay():
            # speculation: the last draw's hooks now, with no forward under them, then the
            # plain step with drafts (a draft follows the row's token after its hooks)
            drawn, self._ahead = self._ahead, None
            outputs = self._timed_handle(drawn) if drawn is not None else []
            return outputs + self._step_plain()
        outputs = self._begin_step()
        drawn, self._ahead = self._ahead, None
        scheduled = self.scheduler.schedule()
        logits, rows = None, []
        if scheduled:
            self.num_steps += 1
            try:
                logits, rows = self.runner.run(scheduled)  # launched: the device runs it
            except Exception as exc:  # a failed forward fails its batch, not the engine
                logger.exception("model step failed")
                outputs += [self._finish(s.seq, "error", error=f"model step failed: {exc}",
                                         error_kind=ErrorKind.INTERNAL) for s in scheduled]
                scheduled, rows = [], []
            targets = [len(scheduled[i].seq.token_ids) for i in rows]
            self._computed(scheduled)
        if drawn is not None:
            outputs += self._timed_handle(drawn)  # the host's work, under the forward
        if not scheduled:
            if drawn is None and not self.guide.searching:
                if self.waiting_for_grammar:  # nothing to run until a grammar is ready
                    wait([s.guide.grammar_future for s in self.waiting_for_grammar],
                         timeout=0.05, return_when=FIRST_COMPLETED)
                else:
                    outputs += self._unschedulable()
            return outputs
        # the rows this forward's logits still stand for: running, nothing changed
        keep = [j for j, (i, n) in enumerate(zip(rows, targets))
                if scheduled[i].seq.status is SeqStatus.RUNNING
                and scheduled[i].seq.num_computed == n == len(scheduled[i].seq.token_ids)]
        if not keep:
            return outputs
        sampling = [scheduled[rows[j]].seq for j in keep]
        if len(keep) < len(rows):
            logits = logits.index_select(0, torch.tensor(keep, device=logits.device))
        inputs = self.strategy.make_sampling_inputs(sampling)
        proc = FusedLogitsProcessor(inputs, self.mask)
        proc.prepare()
        result = self.sampler(logits, inputs.rows, proc)
        held = self.guide.steer(sampling, result.token_ids, result.logprobs)
        self.num_sampled += len(sampling)
        for i, (seq, token) in enumerate(zip(sampling, result.token_ids)):
            if i in held:  # its token waits for a search's verdict (_handle skips it)
                self.scheduler.park(seq)
            else:
                seq.put_ahead(token)
        self._ahead = _Sampled(proc, sampling, result.token_ids, result.logprobs)
        self.last_timings = proc.timings
        return outputs

    def _timed_handle(self, drawn: "_Sampled") -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._handle(drawn)
        took = time.perf_counter() - t0
        self._hooks_s = took if self._hooks_s is None else 0.8 * self._hooks_s + 0.2 * took
        return outputs

    def _drafts_pay(self) -> bool:
        """Overlap: whether this step drafts. A step with drafts runs without overlap (its
        drafts follow the tokens the last step drew, after their hooks), so it pays when
        the tokens its drafts are expected to yield save more forward time than the
        hooks' time the overlap would have hidden (``_hooks_s``, measured)."""
        if self._hooks_s is None:  # not measured yet: overlapped steps first
            return False
        batch = len(self.scheduler.running)
        if not batch:
            return False
        cost = self.drafter.cost
        # until the forward's fit has steps, any expected draft pays (the plain steps with
        # drafts feed the fit); rows are asked until the answer is known
        per_token = cost.a / batch + cost.b  # a token's share of a step, one a step
        needed = self._hooks_s / per_token if cost.fitted and per_token > 0 else 0.0
        kept = 0.0
        for seq in self.scheduler.running:
            if seq.num_computed < seq.num_prompt or not seq.params.speculate(
                    self.config.speculative):
                continue  # a prompt's prefill, a request without drafts
            kept += self.drafter.expected(seq, batch)
            if kept > needed:
                return True
        return False

    def _computed(self, scheduled) -> None:
        """A forward computed (or, overlapped, will have computed before any later one
        reads them) the scheduled tokens' KV; the prompt's blocks it filled are registered
        for later prompts that start with them (prompt tokens are never rolled back)."""
        caching = self.blocks.prefix_caching
        for s in scheduled:
            seq = s.seq
            seq.num_computed += s.num_tokens
            if caching and seq.num_computed - s.num_tokens < seq.num_prompt:
                self.blocks.register(seq.block_table, seq.block_keys, seq.token_ids,
                                     min(seq.num_computed, seq.num_prompt), seq.cache_scope)

    def _handle(self, drawn: "_Sampled") -> list[RequestOutput]:
        """The hooks of the tokens a step drew (overlap): the matchers accept them, then
        each row's ``_append_token`` as without overlap."""
        ended = set()
        computed = {}
        for i, seq in enumerate(drawn.seqs):
            if seq.ahead is None or self.seqs.get(seq.request_id) is not seq:
                ended.add(i)  # ended since it drew (an abort): nothing to handle
            else:
                computed[i] = seq.take_ahead()
        status = drawn.proc.accept_token(drawn.tokens, skip=ended)
        outputs = []
        for i, (seq, token, lp) in enumerate(zip(drawn.seqs, drawn.tokens, drawn.logprobs)):
            if i in ended:
                continue
            position = len(seq.token_ids)
            outputs.append(self._append_token(seq, token, lp, status.get(i)))
            if computed[i] and seq.status is SeqStatus.RUNNING:
                seq.keep_ahead_kv(position, token)
        return outputs

    def _begin_step(self) -> list[RequestOutput]:
        """A step's first work: the closing searches' slice (``GuidedPath.begin_step``),
        the rows whose search ended taken back into the batch (or ended: the search's
        answer may close them), then the requests whose grammar is ready admitted."""
        ended = self.guide.begin_step()
        outputs = []
        for seq in [s for s in self.scheduler.parked if s.request_id in ended]:
            outcome = seq.guide.resume()
            if not outcome.park:
                self.scheduler.unpark(seq)
            outputs.append(self._end(seq, outcome))
        return outputs + self._admit_compiled_grammars()

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Moves requests whose grammar is ready into the scheduler's queue, once their
        guided part admits them (``GuidedRequest.admit``: a matcher, the budget check);
        fails those it refuses and those whose grammar was not ready in time."""
        outputs = []
        limit = self.config.grammar_timeout_s
        for seq in list(self.waiting_for_grammar):
            if seq.guide.grammar_future.done():
                refused = seq.guide.admit()
                if refused is not None and refused.park:
                    continue  # its budget's verdict waits for a search
                if refused is not None:
                    outputs.append(self._end(seq, refused))
                    continue
                self.waiting_for_grammar.remove(seq)
                seq.status = SeqStatus.WAITING
                self.scheduler.add(seq)
            elif time.monotonic() - seq.arrival > limit:
                outputs.append(self._finish(seq, "error", error=(
                    f"the {seq.grammar.kind} grammar was not ready within {limit:g} s "
                    "(compiling it, or the grammar cache, is too slow right now); retry, "
                    "or simplify the grammar"), error_kind=ErrorKind.GRAMMAR_UNAVAILABLE))
        return outputs

    def _remaining(self, seq: Sequence) -> int:
        """Tokens the request may still generate: its max_new_tokens, or the context, less
        what its guided part owes (a thought's end marker). A loop cut gives the tokens it
        takes back to the budget, so the tokens drawn count too: at most DRAWS_PER_TOKEN
        times max_new_tokens in all (one forward step each), whatever its loop_guard."""
        budget = seq.params.max_new_tokens
        left = min(budget - seq.num_output, self.max_model_len - len(seq.token_ids),
                   DRAWS_PER_TOKEN * budget - self._draws.get(seq.request_id, 0))
        return left - self.guide.owed(seq)

    def _append_token(self, seq: Sequence, token: int, logprob,
                      status: RowStatus | None = None) -> RequestOutput:
        """A row's sampled token: its guided part's (``GuidedRequest.after_sample``), or
        a plain row's: appended, stop token ids, the stream's text, stop strings, the
        budget."""
        self._draws[seq.request_id] = self._draws.get(seq.request_id, 0) + 1
        prefix = ""
        if seq.guide is not None:
            outcome = seq.guide.after_sample(token, logprob, status)
            if not outcome.plain:
                return self._end(seq, outcome)
            prefix = outcome.text  # a thought that never opened: text held back so far
        p = seq.params
        seq.append([token], [logprob])
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            out = self._finish(seq, "stop")
        else:
            new_tokens, lps, text = self._release(seq, final=False)
            reason = ("stop" if seq.detokenizer.stopped is not None else
                      "length" if self._remaining(seq) <= 0 else None)
            out = self._end(seq, Outcome(reason, text, new_tokens, lps))
        out.text = prefix + out.text
        return out

    def _end(self, seq: Sequence, outcome: Outcome) -> RequestOutput:
        """The chunk of a hook's outcome: the last one when it finishes the request. A
        row that waits for a search is held out of the batch (parked) meanwhile."""
        if outcome.park and seq.status is SeqStatus.RUNNING:
            self.scheduler.park(seq)
        if outcome.finish is not None:
            return self._finish(seq, outcome.finish, text=outcome.text,
                                new_tokens=outcome.new_tokens, logprobs=outcome.logprobs,
                                error=outcome.error, error_kind=outcome.error_kind,
                                reasoning=outcome.reasoning)
        return RequestOutput(seq.request_id, outcome.text, outcome.new_tokens,
                             outcome.logprobs, reasoning=outcome.reasoning, **self._usage(seq))

    def _release(self, seq: Sequence, final: bool) -> tuple[list[int], list | None, str]:
        """The output tokens the stream may have now (a guided row's newest are held back
        for the loop guard; see OutputPolicy.release): (tokens, logprobs, their text)."""
        return seq.stream(seq.guide.releasable(final) if seq.guide is not None
                          else len(seq.held_logprobs))

    def _finish(self, seq: Sequence, reason: str, *, text: str = "", new_tokens=(),
                logprobs=None, error: str | None = None, error_kind: ErrorKind | None = None,
                keep_session: bool = True, reasoning: str = "") -> RequestOutput:
        """Ends a request: what it still held back is streamed with this last chunk (a
        stop string may still cut it), its blocks are released (or its KV kept for the
        session), and its guided part ends (``GuidedRequest.finish``: the matcher freed,
        the report onto the chunk). The release happens whatever the rest raises (the
        error still goes to the caller: ``fail_all``, the step's handler)."""
        waiting = seq.status is SeqStatus.WAITING_FOR_GRAMMAR
        new_tokens = list(new_tokens)
        released = False  # its held text went out: a session may keep its KV
        try:
            if seq.ahead is not None:  # a drawn token not handled yet (overlap): not output
                seq.take_ahead()
            if not waiting and reason != "abort":
                more, more_lps, more_text = self._release(seq, final=True)
                if more_lps is not None:
                    logprobs = (logprobs or [None] * len(new_tokens)) + more_lps
                new_tokens += more
                text += more_text + seq.detokenizer.flush()
                if seq.detokenizer.stopped is not None and reason == "length":
                    reason = "stop"
            released = True
        finally:
            try:
                self._release_request(seq, reason, waiting, keep_session and released)
            finally:
                out = RequestOutput(seq.request_id, text, new_tokens, logprobs,
                                    finished=True, finish_reason=reason, error=error,
                                    error_kind=error_kind, reasoning=reasoning,
                                    **self._usage(seq))
                if seq.guide is not None:
                    seq.guide.finish(reason, out, waiting)
        return out

    def _release_request(self, seq: Sequence, reason: str, waiting: bool,
                         keep_session: bool) -> None:
        """Takes an ended request out of the queues and gives its blocks back (or parks
        its KV for its session's next turn)."""
        self.seqs.pop(seq.request_id, None)
        self._draws.pop(seq.request_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq.request_id)
        try:
            if waiting:
                self.waiting_for_grammar.remove(seq)
                seq.status = SeqStatus.FINISHED
            else:
                self.scheduler.remove(seq)
        finally:
            # what it computed is kept for later prompts (whole blocks: the last sampled
            # token has no KV yet), and pinned for its session's next turn; not after an
            # error (a failed forward may have written part of a block)
            sid = seq.session_id
            keep = (sid is not None and keep_session and reason in ("stop", "length")
                    and seq.num_computed > 0)
            try:
                if reason in ("stop", "length", "abort") and (
                        keep or self.blocks.prefix_caching):
                    self.blocks.register(seq.block_table, seq.block_keys, seq.token_ids,
                                         seq.num_computed, seq.cache_scope)
                if keep:
                    self.blocks.keep_session(sid, seq.block_keys)
            finally:
                self.blocks.free(seq.block_table)
                seq.block_keys = []

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
            block_size=self.blocks.block_size,
            session_blocks=self.blocks.num_session_blocks,
            cached_blocks=self.blocks.num_cached,
            prefix_cache_query_tokens=self.blocks.query_tokens,
            prefix_cache_hit_tokens=self.blocks.hit_tokens,
            prefix_cache_evictions=self.blocks.evictions,
            live_sessions=len(self.blocks.sessions),
            preemptions=sched.num_preemptions,
            steps=self.num_steps,
            waiting_for_grammar=len(self.waiting_for_grammar),
            live_processors=self.guided.num_matchers if self.guided else 0,
            grammar_cache=self.guided.stats.as_dict() if self.guided else {},
            session_ids=sorted(set(self.blocks.sessions) | {
                s.session_id for s in self.seqs.values() if s.session_id is not None}),
            sampled_tokens=self.num_sampled,
            draft_tokens=self.drafter.draft_tokens if self.drafter else 0,
            accepted_draft_tokens=self.drafter.accepted_tokens if self.drafter else 0,
            drafting_rows=len(self.drafter.rows) if self.drafter else 0,
            **self.guide.stats(),
        )
