"""Where a guided decode step's host time goes on a GPU: the engine's steps at a batch
size under cProfile, with the step's own timings (bitmask fill on its thread, the wait
for it, the mask's application, the matchers' accept) beside the unguided step's.

    python -m bench.gpu_host_profile [--shape 8b|1b] [--batch 32 64] [--graphs] [--engine auto]

Not a figure of docs/benchmarks.md: a tool for the next change (bench.gpu gives the figures).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import SHAPES, guided_schema, live, prompts, random_model, sync  # noqa: E402
from core.grammar_spec import GrammarSpec  # noqa: E402
from core.request import GenerationRequest  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import LLMEngine  # noqa: E402
from worker.engine.sampling import SamplingParams  # noqa: E402


def run(engine, batch: int, new: int, grammar, top: int) -> str:
    reqs = [GenerationRequest(p, SamplingParams(seed=i, max_new_tokens=3 * new + 96,
                                                temperature=0.0, ignore_eos=True),
                              grammar=grammar)
            for i, p in enumerate(prompts(engine.tokenizer, batch, 128, seed=batch))]
    for r in reqs:
        engine.add_request(r)
    while engine.waiting_for_grammar or engine.scheduler.waiting or engine.scheduler.parked or any(
            s.num_pending > 1 for s in engine.scheduler.running):
        engine.step()
    dev = engine.runner.device
    for _ in range(3):  # warm
        engine.step()
    times, parts = [], []
    prof = cProfile.Profile()
    # a row parked on its closing search (search_slices) is still in the batch
    while live(engine) == batch and len(times) < new:
        sync(dev)
        t = time.perf_counter()
        prof.enable()
        engine.step()
        sync(dev)
        prof.disable()
        times.append(time.perf_counter() - t)
        parts.append(engine.last_timings)
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_work():
        engine.step()
    if not times:
        raise RuntimeError(f"no step ran the whole batch of {batch}")
    out = io.StringIO()
    med = statistics.median(times) * 1e3
    out.write(f"batch {batch} {'guided' if grammar else 'unguided'}: {len(times)} steps, "
              f"median {med:.2f} ms, {med * 1e3 / batch:.1f} us a row\n")
    for k in ("fill_us", "fill_wait_us", "apply_us", "accept_us"):
        out.write(f"  {k} median {statistics.median(getattr(p, k) for p in parts):.0f}\n")
    for key in ("tottime", "cumtime"):
        s = pstats.Stats(prof, stream=out)
        s.sort_stats(key).print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from worker.models.loader import load_tokenizer, resolve_model_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(os.environ.get("RAYGUIDE_TOKENIZER_DIR")
                         or resolve_model_dir(None, progress=False))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(SHAPES[args.shape], device, dtype)
    engine = LLMEngine(EngineConfig(device=device.type, progress=False,
                                    max_num_seqs=max(args.batch), kv_cache_gb=8.0,
                                    cuda_graphs=args.graphs, grammar_engine=args.engine,
                                    prefix_caching=False, speculative=False),
                       model=model, tokenizer=tok)
    spec = GrammarSpec.json_schema(guided_schema(args.new))
    for b in args.batch:
        for grammar in (None, spec):
            text = run(engine, b, args.new, grammar, args.top)
            name = f"prof_b{b}_{'guided' if grammar else 'plain'}.txt"
            Path(args.out, name).write_text(text)
            print(text.splitlines()[0], "|", " ".join(
                line.strip() for line in text.splitlines()[1:5]), flush=True)


if __name__ == "__main__":
    main()
