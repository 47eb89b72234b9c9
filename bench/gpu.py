"""The engine on a GPU, without Ray, against HF transformers on the same device in one run.

A model of a real shape (Llama-3-8B by default: hidden 4096, 32 layers, GQA 32/8,
intermediate 14336, vocab 128256) with random weights drawn on the device, bf16, the
default model's tokenizer (ids past it are never allowed under a grammar). Random weights
decode as fast as real ones of the same shape. Speculation off: one token a step, as HF's
``generate`` (a random model's loops would keep prompt-lookup drafts wholesale;
bench/speculative.py measures drafts on real outputs).

1. The device's measured copy bandwidth and the bytes a batch-1 step reads: the limit.
2. Decode tok/s at batch 1 / 8 / 32 / 64 (greedy, 128-token prompts, steps timed once every
   row decodes), and the share of the bandwidth limit reached at batch 1.
3. HF ``generate`` with a dynamic cache and with a static cache (torch.compile on CUDA), batch 1.
4. First token of one 2,048-token prompt; of 64 prompts of 128 tokens together.
5. Guided / unguided per batch (a JSON schema, with ``auto`` and each grammar engine;
   step times while every row of the batch is still running), and sampled / greedy at batch 1.
6. Kernels per decoder layer in a decode step (the device path, counted on ``meta``: any
   machine) and, on CUDA, counted by the profiler; host time per row per step at batch 64
   (the engine's step with a model that computes nothing).

    python -m bench.gpu [--quick | --smoke] [--json] [--no-record] [--shape 8b|1b]

``--smoke`` runs the same code on the CPU with the tiny model (tests/serve/test_bench_smoke.py).
Keys: tok_s_b1, tok_s_b64, bw_share_b1, ratio_vs_hf_static_b1,
ratio_guided_unguided_b{1,8,32,64}, prefill_ttft_ms_2048, first_ttft_ms_2048_cold,
first_ttft_ms_2048_warm, warmup_s, sampled_vs_greedy_b1,
ops_per_layer_decode, host_us_per_row_b64 (and more; see the JSON line). The figures above
run every step eagerly (``cuda_graphs: false``); on CUDA the same decode and guided runs
again with CUDA graphs: tok_s_b{1,8,32,64}_graphs, ratio_guided_unguided_b{...}_graphs
(guided with graphs / unguided with graphs), ratio_vs_hf_static_b1_graphs; and the sides
``_no_jf`` (jump-forward off) and ``_no_overlap`` (the engine's overlap off: the host's
work after a draw in series with the forward). Tokens a second count what the rows gained
(a guided row's forced text too). On CUDA the overlap is on in every run but the
``_no_overlap`` side.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import finish, parser, smoke_model, table  # noqa: E402
from core.grammar_spec import GrammarSpec  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.model_runner import ModelRunner  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402
from worker.engine.scheduler import ScheduledSeq  # noqa: E402
from core.request import GenerationRequest  # noqa: E402
from worker.models import triton_kernels  # noqa: E402
from worker.models.llama import LlamaForCausalLM  # noqa: E402

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True),
}


def guided_schema(new: int) -> dict:
    """The guided runs' schema: a list of notes with at least ``new`` + 8 items, so no row
    can end inside the ``new`` timed steps. Without the floor a random model may close
    ``{"notes": []}`` at once and the timing gets no step of the whole batch."""
    return {"type": "object", "properties": {"notes": {
        "type": "array", "items": {"type": "string"}, "minItems": new + 8}},
        "required": ["notes"]}

ENGINES = ("auto", "xgrammar", "llguidance")


def live(engine) -> int:
    """Rows in the batch: running, or parked while their closing search goes on."""
    return len(engine.scheduler.running) + len(engine.scheduler.parked)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_gbs(device, mb: int) -> float:
    a = torch.ones(mb * 2**20 // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 2 / best / 1e9


def random_model(shape: dict, device, dtype) -> LlamaForCausalLM:
    """Our model of ``shape``, random weights drawn on the device (no checkpoint)."""
    import transformers

    config = transformers.LlamaConfig(**shape)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.rotary.reset_tables(device, dtype)
    return model.eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompts(tok, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist()
            for _ in range(count)]


def decode_tok_s(engine, batch: int, new: int, plen: int, params: dict | None = None,
                 grammar=None) -> tuple[float, int]:
    """(tokens per second of the batch's decode steps, steps timed): at most ``new`` steps
    in which every row decodes (no prefill in a timed step; timing stops when a row
    finishes). Tokens are those the rows gained (a guided row's forced text counts, as
    it is output), per step on average, over the median step's time. The budget leaves
    room past the steps, so no row is near its end (budget-aware closing is the
    conformance benches' subject); the rest is aborted."""
    # room for the guided schema's shortest output (two tokens an item at most) and more
    kw = dict(max_new_tokens=3 * new + 96, temperature=0.0, ignore_eos=True)
    kw.update(params or {})
    reqs = [GenerationRequest(p, SamplingParams(seed=i, **kw), grammar=grammar)
            for i, p in enumerate(prompts(engine.tokenizer, batch, plen, seed=batch))]
    for r in reqs:
        engine.add_request(r)
    while engine.waiting_for_grammar or engine.scheduler.waiting or engine.scheduler.parked or any(
            s.num_pending > 1 or s.num_computed < s.num_prompt
            for s in engine.scheduler.running):
        engine.step()
    dev = engine.runner.device
    times = []
    seqs = list(engine.scheduler.running)
    first = 0
    # a row parked on its closing search (search_slices) is still in the batch
    while live(engine) == batch and len(times) < new:
        sync(dev)
        t = time.perf_counter()
        engine.step()
        sync(dev)
        times.append(time.perf_counter() - t)
        if len(times) == 1:  # the first may still compile a kernel: not counted
            first = sum(len(s.token_ids) for s in seqs)
    tokens = sum(len(s.token_ids) for s in seqs) - first
    for r in reqs:
        engine.abort(r.request_id)
    if not times:
        raise RuntimeError(f"no step ran the whole batch of {batch}: a row finished before "
                           "the timed steps")
    steady = times[1:] or times
    per_step = tokens / len(steady) if len(times) > 1 else batch
    return per_step / statistics.median(steady), len(steady)


def ttft_ms(engine, lengths: list[int]) -> float:
    """ms from adding the prompts to every one's first token."""
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=2, temperature=0.0,
                                                ignore_eos=True))
            for p in (prompts(engine.tokenizer, 1, n, seed=n)[0] for n in lengths)]
    dev = engine.runner.device
    sync(dev)
    t = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    pending = {r.request_id for r in reqs}
    while pending:
        for out in engine.step():
            if out.token_ids:
                pending.discard(out.request_id)
    sync(dev)
    elapsed = (time.perf_counter() - t) * 1e3
    while engine.has_work():
        engine.step()
    return elapsed


@torch.no_grad()
def hf_tok_s(shape: dict, device, dtype, plen: int, new: int, static: bool) -> float:
    import transformers

    config = transformers.LlamaConfig(**shape)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(100, 1000, (1, plen), device=device)
    kw = dict(do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
        if device.type != "cuda":
            kw["disable_compile"] = True

    def run(n):
        sync(device)
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t

    run(new)  # warm-up (and torch.compile for the static cache)
    prefill, total = run(1), run(new)
    del hf
    return (new - 1) / (total - prefill)


def ops_per_layer(shape: dict, batch: int = 1, context: int = 128) -> int:
    """Kernels one decoder layer launches in a decode step on the device path: a model of
    two layers minus one of one, counted on meta (no device, no memory)."""
    from types import SimpleNamespace

    import transformers

    def count(layers):
        with torch.device("meta"):
            model = LlamaForCausalLM(transformers.LlamaConfig(
                **dict(shape, num_hidden_layers=layers))).to(torch.bfloat16)
        bs = 16
        per = -(-context // bs)
        runner = ModelRunner(model, batch * per + 1, bs, tiled=True)
        step = [ScheduledSeq(SimpleNamespace(token_ids=list(range(context)),
                                             num_computed=context - 1,
                                             block_table=list(range(i * per, (i + 1) * per))), 1)
                for i in range(batch)]
        return sum(triton_kernels.count_kernels(runner.run, step)[1].values())

    return count(2) - count(1)


def profiled_kernels_per_step(engine, batch: int = 1) -> dict:
    """A few steady decode steps under torch.profiler: CUDA kernels a step, the GPU's busy
    time a step against the step's wall time, and the kernels that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                ignore_eos=True))
            for p in prompts(engine.tokenizer, batch, 128, seed=5)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    steps = 8
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3 / steps
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_work():
        engine.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy: dict[str, float] = {}
    for e in kernels:
        busy[e.name] = busy.get(e.name, 0.0) + e.device_time / 1e3 / steps
    top = sorted(busy.items(), key=lambda kv: -kv[1])[:10]
    return {"kernels": round(len(kernels) / steps, 1), "wall_ms": round(wall_ms, 3),
            "gpu_busy_ms": round(sum(busy.values()), 3),
            "top_ms": {name[:80]: round(ms, 3) for name, ms in top}}


class _NoModel(nn.Module):
    """The model's interface, computing nothing: what is left of a step is host work."""

    def __init__(self, model):
        super().__init__()
        self.config = model.config
        self.anchor = nn.Parameter(torch.zeros(1, device=next(model.parameters()).device))
        self._hidden = model.config.hidden_size
        self.tie_word_embeddings = False

    def forward(self, input_ids, positions, kv_caches, batch):
        return torch.zeros(input_ids.shape[0], self._hidden, device=self.anchor.device)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.config.vocab_size, device=self.anchor.device)


def host_us_per_row(engine, batch: int, new: int, grammar=None) -> float:
    """Host time per row per step at ``batch``: the engine's steps with a model that
    computes nothing (scheduling, packing, sampling, grammar work, detokenizing)."""
    real, tiled = engine.runner.model, engine.runner.tiled
    # the GPU's packing (one copy) whatever the device; the model is not called anyway
    engine.runner.model, engine.runner.tiled = _NoModel(real), True
    try:
        tok_s, _ = decode_tok_s(engine, batch, new, 32, grammar=grammar)
    finally:
        engine.runner.model, engine.runner.tiled = real, tiled
    return 1e6 / tok_s


class _Sections:
    """Each part of the run in its own ``with``: a part that fails is named in the figures
    (``errors``) with its traceback on stderr, and the rest still runs. The figures so far
    go to stderr after each part (a run stopped at a time limit keeps what it measured)."""

    def __init__(self, fig: dict):
        self.fig = fig

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported, the next part runs
            traceback.print_exc()
            self.fig.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:400]
        finally:
            self.fig.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 1)
            print("# partial " + json.dumps(self.fig), file=sys.stderr, flush=True)


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate peer")
    ap.add_argument("--tokenizer", default=os.environ.get("RAYGUIDE_TOKENIZER_DIR"),
                    help="a folder with the default model's tokenizer files (a GPU machine "
                         "without its GGUF: make gpu-wheels copies them to .gpu-wheels/"
                         "tokenizer); default: the default model")
    args = ap.parse_args()
    smoke = args.smoke
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from worker.models.loader import load_tokenizer, resolve_model_dir

    tokenizer_dir = (smoke_model() if smoke else args.tokenizer
                     or resolve_model_dir(None, progress=False))
    tok = load_tokenizer(tokenizer_dir)
    if smoke:
        import transformers

        shape = transformers.AutoConfig.from_pretrained(tokenizer_dir).to_dict()
        shape = {k: shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads",
                                       "vocab_size", "max_position_embeddings",
                                       "tie_word_embeddings")}
        dtype = torch.float32
    else:
        shape = SHAPES[args.shape]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [1, 4] if smoke else ([1, 8, 32, 64] if not args.quick else [1, 8, 64])
    new = 12 if smoke else (48 if args.quick else 128)
    plen = 16 if smoke else 128
    fig: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "shape": "tiny" if smoke else args.shape, "dtype": str(dtype).split(".")[-1]}

    model = random_model(shape, device, dtype)
    wbytes = weight_bytes(model)
    bw = copy_bandwidth_gbs(device, 64 if smoke else 1024)
    limit_ms = wbytes / (bw * 1e9) * 1e3
    fig.update(copy_bw_gbs=round(bw, 1), weight_gb=round(wbytes / 1e9, 2),
               limit_ms_b1=round(limit_ms, 3))

    def engine(**kw):
        kw.setdefault("progress", False)
        kw.setdefault("max_num_seqs", max(batches))
        kw.setdefault("kv_cache_gb", 0.25 if smoke else 8.0)
        kw.setdefault("cuda_graphs", False)
        # rounds run the same prompts again: prefix caching (bench/prefix_cache.py) off
        kw.setdefault("prefix_caching", False)
        # one token a step, as HF's generate: a random model's greedy output loops, so
        # prompt-lookup drafts would be kept wholesale (bench/speculative.py measures
        # speculation on real outputs)
        kw.setdefault("speculative", False)
        return LLMEngine(EngineConfig(device=device.type, **kw), model=model, tokenizer=tok)

    long = min(2048, shape["max_position_embeddings"] - 8) if not smoke else 256
    # the first long prompt of a process that compiled nothing yet (Triton's disk cache,
    # ~/.triton/cache, may hold kernels of an earlier run on this machine), then the same
    # after the start's warm-up (LLMEngine.warm_up: on by default on CUDA)
    cold = engine(warmup=False)
    fig["first_ttft_ms_2048_cold"] = round(ttft_ms(cold, [long]), 1)
    del cold
    eng = engine(warmup=True)
    fig["warmup_s"] = round(eng.warmup_s, 2)
    fig["first_ttft_ms_2048_warm"] = round(ttft_ms(eng, [long + 8]), 1)
    fig["tiled"] = eng.runner.tiled
    rows = []
    step = _Sections(fig)
    with step("decode"):
        for b in batches:
            tok_s, steps = decode_tok_s(eng, b, new, plen)
            fig[f"tok_s_b{b}"] = round(tok_s, 1)
            rows.append([f"decode b{b}", round(tok_s, 1), round(b / tok_s * 1e3, 2), steps])
        fig["bw_share_b1"] = round(limit_ms / (1e3 / fig["tok_s_b1"]), 3)

    with step("sampled"):
        sampled, _ = decode_tok_s(eng, 1, new, plen, dict(temperature=0.8, top_p=0.9, top_k=50))
        fig["sampled_vs_greedy_b1"] = round(sampled / fig["tok_s_b1"], 3)
        rows.append(["sampled b1 (t=0.8, top-p 0.9, top-k 50)", round(sampled, 1),
                     round(1e3 / sampled, 2), ""])

    with step("prefill"):
        fig["prefill_ttft_ms_2048"] = round(ttft_ms(eng, [long]), 1)
        fig["ttft_ms_64x128"] = round(ttft_ms(eng, [plen] * max(batches)), 1)
        rows.append([f"first token, one {long}-token prompt", "", fig["prefill_ttft_ms_2048"],
                     ""])
        rows.append([f"the first {long}-token prompt of a process, cold / after the "
                     f"warm-up ({fig['warmup_s']} s)", "",
                     f"{fig['first_ttft_ms_2048_cold']} / {fig['first_ttft_ms_2048_warm']}", ""])
        rows.append([f"first token, {max(batches)} x {plen}-token prompts", "",
                     fig["ttft_ms_64x128"], ""])

    for name in ENGINES:
        with step(f"guided_{name}"):
            geng = engine(grammar_engine=name)
            spec = GrammarSpec.json_schema(guided_schema(new))
            for b in batches:
                guided, _ = decode_tok_s(geng, b, new, plen, grammar=spec)
                ratio = guided / fig[f"tok_s_b{b}"]
                key = f"ratio_guided_unguided_b{b}" + ("" if name == "auto" else f"_{name}")
                fig[key] = round(ratio, 3)
                rows.append([f"guided ({name}) b{b}", round(guided, 1),
                             round(b / guided * 1e3, 2), f"ratio {ratio:.2f}"])
            del geng

    if device.type == "cuda":  # the same runs with CUDA graphs recorded for decode steps
        spec = GrammarSpec.json_schema(guided_schema(new))
        # (suffix, engine options): overlap on (the default on CUDA) with and without
        # jump-forward, and overlap off
        sides = [("", {}), ("_no_jf", {"jump_forward": False}),
                 ("_no_overlap", {"overlap": False})]
        for suffix, opts in sides:
            with step(f"graphs{suffix}"):
                geng = engine(cuda_graphs=True, **opts)
                if not suffix:
                    fig["graph_memory_mb"] = round(geng.runner.graphs.memory_bytes / 2**20, 1) \
                        if geng.runner.graphs is not None else None
                for b in batches:
                    key = f"tok_s_b{b}_graphs{suffix}"
                    if suffix != "_no_jf":  # jump-forward changes nothing unguided
                        tok_s, _ = decode_tok_s(geng, b, new, plen)
                        fig[key] = round(tok_s, 1)
                        rows.append([f"decode b{b}, CUDA graphs{suffix}", round(tok_s, 1),
                                     round(b / tok_s * 1e3, 2), ""])
                    base = fig.get(key) or fig[f"tok_s_b{b}_graphs"]
                    guided, _ = decode_tok_s(geng, b, new, plen, grammar=spec)
                    ratio = guided / base
                    fig[f"ratio_guided_unguided_b{b}_graphs{suffix}"] = round(ratio, 3)
                    rows.append([f"guided (auto) b{b}, CUDA graphs{suffix}", round(guided, 1),
                                 round(b / guided * 1e3, 2), f"ratio {ratio:.2f}"])
                if not suffix:
                    if fig.get("tok_s_b1_graphs"):
                        fig["bw_share_b1_graphs"] = round(
                            limit_ms / (1e3 / fig["tok_s_b1_graphs"]), 3)
                    fig["profile_b1_graphs"] = profiled_kernels_per_step(geng)
                del geng

    fig["ops_per_layer_decode"] = ops_per_layer(shape)
    if device.type == "cuda":
        with step("profile"):
            fig["profile_b1"] = profiled_kernels_per_step(eng)
            fig["cuda_kernels_per_step_b1"] = fig["profile_b1"]["kernels"]
            fig["profile_b64"] = profiled_kernels_per_step(eng, 64)
    with step("host"):
        fig["host_us_per_row_b64"] = round(host_us_per_row(engine(max_num_seqs=64), 64, new), 1)
        fig["host_us_per_row_b64_guided"] = round(host_us_per_row(
            engine(max_num_seqs=64), 64, new, GrammarSpec.json_schema(guided_schema(new))), 1)
        rows.append(["host per row per step, b64 (unguided / guided)", "",
                     f"{fig['host_us_per_row_b64']} / {fig['host_us_per_row_b64_guided']} us",
                     ""])

    if not args.no_hf:
        del eng
        for static in (False, True):
            name = "static" if static else "dynamic"
            with step(f"hf_{name}"):
                hf = hf_tok_s(shape, device, dtype, plen, new, static)
                fig[f"hf_{name}_tok_s_b1"] = round(hf, 1)
                rows.append([f"HF generate b1, {name} cache", round(hf, 1), round(1e3 / hf, 2),
                             ""])
        if fig.get("hf_static_tok_s_b1") and fig.get("tok_s_b1"):
            fig["ratio_vs_hf_static_b1"] = round(fig["tok_s_b1"] / fig["hf_static_tok_s_b1"], 3)
            if "tok_s_b1_graphs" in fig:
                fig["ratio_vs_hf_static_b1_graphs"] = round(
                    fig["tok_s_b1_graphs"] / fig["hf_static_tok_s_b1"], 3)

    body = table(["what", "tok/s", "ms (per step, or to first token)", "notes"], rows)
    body += (f"\n\nShape {fig['shape']} ({fig['weight_gb']} GB of weights, {fig['dtype']}) on "
             f"{fig['device']}; copy bandwidth {fig['copy_bw_gbs']} GB/s, so a batch-1 step "
             f"cannot beat {fig['limit_ms_b1']} ms; batch 1 reaches "
             f"{fig.get('bw_share_b1', float('nan')):.0%} of that. A decoder layer launches {fig['ops_per_layer_decode']} kernels in a "
             f"decode step (device path; counted on meta).")
    finish("gpu", body, fig, args)


if __name__ == "__main__":
    main()
