"""Every bench runs: each one's ``--smoke --json`` size (seconds, the tiny model where the
model does not matter, the same code path as a full run) in a subprocess of its own, and
its last line is one JSON object holding the bench's figures. The figures themselves are
meaningless at this size; what is checked is that the bench finishes and reports."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# bench file -> figures its JSON line must hold (a subset: the ones its docs promise)
BENCHES = {
    "guided_overhead.py": {"ratio_guided_b1", "guided_tok_s_b1", "unguided_tok_s_b1",
                           "fill_us_b1", "apply_us_b1", "accept_us_b1", "fill_hidden_b1",
                           "hf_xgrammar_tok_s_b1", "ratio_guided_b1_vs_hf_xgrammar",
                           "closing_window", "dtype", "jump_speedup_keys_b1",
                           "jump_speedup_tools_b1", "jump_speedup_conformance_b1",
                           "ratio_guided_jump_vs_unguided_keys_b1", "forced_token_share_keys",
                           "forced_token_share_tools", "forced_token_share_conformance",
                           "jump_speedup_keys_b8", "jump_speedup_keys_b32"},
    "engine_throughput.py": {"b1_ours_tok_s", "b1_hf_tok_s", "ratio_b1_vs_hf", "ratio_prefill_vs_hf",
                             "ratio_mixed_vs_hf", "ratio_mixed_sampled_vs_hf",
                             "draw_ms_per_step", "quant_b1_tok_s", "quant_top1_agreement"},
    "conformance.py": {"valid_share_all", "valid_share_stop", "valid_share_length",
                       "runaway_share", "closed_early_share", "mean_output_tokens",
                       "validation_us_p50", "wall_s", "requests", "refused", "loop_share"},
    "clients.py": {"parsed_share_openai", "parsed_share_responses", "parsed_share_instructor",
                   "parsed_share_langchain",
                   "loop_share", "loop_cut_share", "length_share", "mean_output_tokens"},
    "grammar_cache.py": {"cold_ms_small", "actor_hit_ms_small", "local_hit_us_small",
                         "client_local_fallbacks", "grammar_wait_share",
                         "grammar_wait_share_local", "compiles_per_distinct_grammar",
                         "ttft_p99_ratio_vs_local", "warm_worker_first_hit_ms_p50"},
    "startup.py": {"cold_start_s", "warm_start_s", "first_request_s", "stop_s",
                   "log_warnings", "first_answer_valid"},
    "cluster.py": {"ratio_vs_baseline_16_clients", "ratio_guided_stack",
                   "failed_requests_worker_kill", "longest_pause_worker_kill_s",
                   "recovery_worker_kill_s", "valid_share_worker_kill", "route_ms_p50_2w",
                   "ray_hop_ms_per_token_2w"},
    "realworld.py": {"requests", "answered", "refused", "length_share", "invalid", "compliance",
                     "latency_max_s",
                     "invalid_at_length", "loop_share", "loop_cut_share", "mean_output_tokens"},
    "load.py": {"requests", "failed", "valid_share", "leaks"},
    "stack_rate.py": {"engine_tok_s_64", "engine_tok_s_256", "ray_over_engine_64",
                      "ray_over_engine_256", "http_over_engine_64", "http_over_engine_256",
                      "http_stream_over_engine_64", "http_stream_over_engine_256",
                      "tpot_p99_ms_http_stream_64", "engine_step_ms_1",
                      "tpot_ms_http_stream_1"},
    "grammar_check.py": {"schemas", "check_wall_s", "ready_wall_s", "compiling", "exact",
                         "approximated", "refused",
                         "requests", "refused_mismatch", "exact_invalid", "budget_refused",
                         "below_bound", "unpredicted", "shorter_than_predicted"},
    "gpu.py": {"tok_s_b1", "bw_share_b1", "ratio_vs_hf_static_b1", "ratio_guided_unguided_b1",
               "ratio_guided_unguided_b1_xgrammar", "ratio_guided_unguided_b1_llguidance",
               "prefill_ttft_ms_2048", "sampled_vs_greedy_b1", "ops_per_layer_decode",
               "host_us_per_row_b64", "copy_bw_gbs"},
    "guided_host.py": {"ratio_guided_unguided_cpu_b4", "max_step_over_median_cpu_b4",
                       "valid_share_cpu", "host_us_per_row_b16_guided",
                       "host_us_per_row_b16_unguided", "host_us_per_row_b16_fill",
                       "host_us_per_row_b16_search", "max_step_over_median_b16",
                       "draw_us_per_row_b16_guided", "draw_us_per_row_b16_unguided",
                       "host_us_per_row_b16_closing_guard", "host_us_per_row_b16_loop_guard",
                       "host_us_per_row_b16_jump_forward", "host_us_per_row_b16_stream"},
    "prefix_cache.py": {"computed_over_unique_tokens", "speedup_shared_prefix", "ttft_p50_ratio",
                        "cluster_hit_rate_routed", "cluster_hit_rate_load_only",
                        "batch_job_speedup"},
    "data_pipeline.py": {"rows", "jsonl_s", "processor_s", "ratio_processor_vs_jsonl",
                         "steady_ratio_processor_vs_jsonl", "rows_out_jsonl",
                         "rows_out_processor", "valid_share_processor"},
    "speculative.py": {"speedup_extract_b1", "speedup_json_b1", "speedup_prose_b1",
                       "tok_s_extract_b1_on", "tok_s_extract_b1_off", "acceptance_extract",
                       "acceptance_json", "acceptance_prose", "identical_share",
                       "tokens_per_step_extract_b1_on", "identical_extract"},
    "fidelity.py": {"pass_share_auto", "pass_share_xgrammar", "pass_share_llguidance",
                    "invalid_accepted_auto", "invalid_accepted_llguidance_served",
                    "compile_p99_ms_llguidance_served", "compile_p99_ms_auto",
                    "compile_p99_ms_xgrammar", "schemas"},
}
# modules of bench/ that are not benches themselves
# not benches of figures: shared code, a peer's side, a profile of a GPU step's host time
# (bench/gpu_host_profile.py, run on a lent GPU by bench/gpu_lease.sh)
HELPERS = {"__init__.py", "report.py", "llamacpp_side.py", "gpu_host_profile.py"}


def smoke_env(tiny_model_dir) -> dict:
    from bench.report import TINY_MODEL_ENV

    return dict(os.environ, PYTHONUNBUFFERED="1", **{TINY_MODEL_ENV: str(tiny_model_dir)})


@pytest.mark.unit
def test_every_bench_has_a_smoke_run():
    benches = {p.name for p in BENCH.glob("*.py")} - HELPERS
    assert benches == set(BENCHES), (
        "a bench without a smoke run here (or a listed one that is gone): "
        f"{sorted(benches ^ set(BENCHES))}")


# Smokes run SMOKE_JOBS at a time (most of a smoke is starting Ray, Serve and worker
# processes, which wait as much as they compute; every bench binds free ports and starts a
# Ray of its own): the module's first test starts them all, longest first, and each test
# reads its own. Their figures mean nothing at this size, so running side by side changes
# no verdict.
SMOKE_JOBS = int(os.environ.get("RAYGUIDE_SMOKE_JOBS", "2"))
LONGEST_FIRST = ("cluster.py", "grammar_cache.py", "clients.py", "load.py", "startup.py",
                 "data_pipeline.py", "grammar_check.py", "realworld.py", "gpu.py")
SWEEP = ("-m", "bench.clients", "--sweep")


def _command(key) -> list[str]:
    if key == SWEEP:
        return [sys.executable, *SWEEP, "--smoke", "--json"]
    return [sys.executable, str(BENCH / key), "--smoke", "--json"]


@pytest.fixture(scope="module")
def smoke_runs(request, default_model_dir, tiny_model_dir):
    """``key -> future of its CompletedProcess`` for the smokes this session selected.
    default_model_dir: the default model converted once, before any bench wants its
    tokenizer (a conversion inside a bench would count against its timeout);
    tiny_model_dir: the session's tiny model, which every bench uses instead of writing
    its own (bench/report.py tiny_model)."""
    keys = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        if item.originalname == "test_bench_smoke":
            keys.append(item.callspec.params["name"])
        elif item.originalname == "test_clients_sweep_smoke":
            keys.append(SWEEP)
    keys.sort(key=lambda k: LONGEST_FIRST.index(k) if k in LONGEST_FIRST else len(LONGEST_FIRST))
    env = smoke_env(tiny_model_dir)
    pool = ThreadPoolExecutor(max(1, SMOKE_JOBS))
    runs = {key: pool.submit(subprocess.run, _command(key), cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600) for key in keys}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_smoke(name, smoke_runs):
    proc = smoke_runs[name].result()
    tail = (proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-3000:])
    assert proc.returncode == 0, tail
    lines = proc.stdout.strip().splitlines()
    assert lines, tail
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), tail
    missing = BENCHES[name] - set(figures)
    assert not missing, (sorted(missing), tail)


@pytest.mark.integration
def test_clients_sweep_smoke(smoke_runs):
    """bench/clients.py --sweep (how the loop guard's defaults were chosen) runs too."""
    proc = smoke_runs[SWEEP].result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["sweep"]
    assert [r["setting"] for r in rows] == ["off", "defaults"]
    assert all(r["requests"] > 0 for r in rows)


def test_the_gpu_host_profile_runs_on_the_cpu(make_tiny_engine):
    """bench/gpu_host_profile.py's step profile (a tool for a lent GPU) on the tiny model:
    it still drives the engine as the engine is now."""
    from bench.gpu_host_profile import run
    from core.grammar_spec import GrammarSpec
    from bench.gpu import guided_schema

    engine = make_tiny_engine(max_num_seqs=2)
    plain = run(engine, 2, 3, None, 5)
    guided = run(engine, 2, 3, GrammarSpec.json_schema(guided_schema(3)), 5)
    assert plain.startswith("batch 2 unguided: ") and "fill_us median" in plain
    assert guided.startswith("batch 2 guided: ") and "cumulative" in guided
    assert engine.stats().live_processors == 0 and not engine.has_work()
