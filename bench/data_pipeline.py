"""The Ray Data processor vs the JSONL batch job on the same rows (issue 61).

    python bench/data_pipeline.py [--quick | --smoke] [--json] [--no-record]

A 2-node ray.cluster_utils.Cluster (a head and one node) runs a runtime of 2 workers (the
tiny random-weight model with the real tokenizer: what is measured is the path of a row,
not the forward; 32 tokens a row). The rows: two instruction prompts, alternating, each
with a short text of its own and a JSON schema per row (``structured_outputs.json``).
Each way runs as its own driver process connected to the cluster, as a Ray job's would:

- the JSONL batch job: ``python -m deploy.batch_job --input in.jsonl --output out.jsonl
  --concurrency 32``;
- the processor: ``ray.data.read_parquet(in/)``, ``build_processor`` (2 actors, 16
  requests in flight each: the same 32), ``write_parquet(out/)``;
- the same processor with Ray Data's V1 Parquet reader (``RAY_DATA_USE_DATASOURCE_V2=0``
  in the driver's environment): the default V2 reader lists files in a task that starts
  footer-reader actors of its own, new worker processes on each read (a few seconds
  each on a small machine), where V1 samples the files in the driver.

Each run gets a fresh runtime (no prefix or grammar cached from the other). Figures: the
wall time of each driver (its start, its imports, Ray Data's planning, read tasks and
actors included), rows a second, ``ratio_processor_vs_jsonl`` (the processor's rows a
second over the job's, end to end; the bar is 0.9; ``ratio_processor_v1_vs_jsonl`` with
the V1 reader), ``steady_ratio_processor_vs_jsonl``
(rows over the runtime's busy window, from the first moment a worker held one of the run's
rows to the last, polled every 0.1 s: the rate once each runs, without its start-up), the rows each wrote and their valid share. A full run does
1,000 rows, both ways twice (alternating), and reports each pair; ``--quick`` 200 rows
once; ``--smoke`` 16 rows.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import finish, parser, table, tiny_model  # noqa: E402

INSTRUCTIONS = [
    "Read the text below and extract the one person it names: their name as written and "
    "their age in years. Answer in the JSON format the schema gives and nothing else. " * 3,
    "Read the text below and say whether its tone is polite, and how sure you are, from 0 "
    "to 1. Answer in the JSON format the schema gives and nothing else. " * 3,
]
SCHEMAS = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "age": {"type": "integer"}},
            "required": ["name", "age"]},
           {"type": "object", "properties": {"polite": {"type": "boolean"},
                                             "confidence": {"type": "number"}},
            "required": ["polite", "confidence"]}]
MAX_TOKENS = 32
CONCURRENCY = 32  # in flight: the job's --concurrency, the processor's actors x max_in_flight

PIPELINE = """
import sys, ray
sys.path.insert(0, {root!r})
ray.init(address={address!r}, log_to_driver=False)
from deploy.data import ProcessorConfig, build_processor
processor = build_processor(ProcessorConfig(concurrency=2, max_in_flight={half}))
processor(ray.data.read_parquet({src!r})).write_parquet({dst!r})
"""


def make_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        k = i % 2
        rows.append({"id": i, "messages": [
            {"role": "system", "content": INSTRUCTIONS[k]},
            {"role": "user", "content": f"Text {i}: Ada Lovelace, {20 + i % 60}, wrote to "
                                        f"thank the committee for letter {i}."}],
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                "structured_outputs": {"json": json.dumps(SCHEMAS[k])}}})
    return rows


def write_inputs(folder: Path, rows: list[dict]) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = folder / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = folder / "in"
    parquet.mkdir()
    table_ = pa.Table.from_struct_array(pa.array(rows))
    bounds = [part * len(rows) // 4 for part in range(5)]
    for part in range(4):  # a few files, as a real input has
        chunk = table_.slice(bounds[part], bounds[part + 1] - bounds[part])
        pq.write_table(chunk, parquet / f"part-{part}.parquet")
    return jsonl, parquet


def run_driver(cmd: list[str], env: dict, workers: list) -> dict:
    """Runs a driver to its end: its wall time, when the runtime first had a row of it
    (``first_rows_s``) and the runtime's busy window: from the first moment any worker held
    a row to the last (read from the workers' load every POLL_S; the same way for both)."""
    import ray

    t0 = time.perf_counter()
    first = last = None
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                text=True)
        while proc.poll() is None:
            loads = ray.get([w.load.remote() for w in workers])
            now = time.perf_counter()
            if any(x["running"] + x["waiting"] + x["waiting_for_grammar"] for x in loads):
                first = first or now
                last = now
            time.sleep(POLL_S)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}):\n{err.read()[-3000:]}")
    busy = (last - first + POLL_S) if first is not None else None
    return {"wall": wall, "busy": busy, "first_rows_s": (first - t0) if first else wall}


POLL_S = 0.1


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def parquet_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).select(["id", "outcome"]).to_pylist()


def one_run(way: str, address: str, model: str, jsonl: Path, parquet: Path, folder: Path,
            tag: str) -> dict:
    """way: "jsonl", "processor" or "processor_v1" (Ray Data's V1 Parquet reader)."""
    from cluster import launch
    from cluster.config import ClusterConfig

    handles = launch.up(ClusterConfig(
        model=model, num_workers=2, worker={"num_cpus": 1, "num_threads": 1},
        engine={"max_num_seqs": 32, "progress": False}))
    env = dict(os.environ, RAY_ADDRESS=address, PYTHONUNBUFFERED="1")
    if way == "processor_v1":
        env["RAY_DATA_USE_DATASOURCE_V2"] = "0"
    try:
        if way == "jsonl":
            out = folder / f"out-{tag}.jsonl"
            timing = run_driver([sys.executable, "-m", "deploy.batch_job", "--input",
                                 str(jsonl), "--output", str(out), "--address", address,
                                 "--quiet", "--concurrency", str(CONCURRENCY)], env,
                                handles["workers"])
            rows = jsonl_rows(out)
        else:
            out = folder / f"out-{tag}"
            code = PIPELINE.format(root=str(ROOT), address=address, half=CONCURRENCY // 2,
                                   src=str(parquet), dst=str(out))
            timing = run_driver([sys.executable, "-c", code], env, handles["workers"])
            rows = parquet_rows(out)
    finally:
        del handles
        launch.down(every=True)
    ids = sorted(r["id"] for r in rows)
    valid = sum(r["outcome"] == "valid" for r in rows) / max(1, len(rows))
    return {**timing, "rows": len(rows), "distinct": len(set(ids)), "valid": valid}


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from cluster import launch

    n = 16 if args.smoke else 200 if args.quick else 1000
    rounds = 1 if (args.smoke or args.quick) else 2
    model = tiny_model()
    folder = Path(tempfile.mkdtemp(prefix="rayguide-data-bench-"))
    rows = make_rows(n)
    jsonl, parquet = write_inputs(folder, rows)
    launch.fast_death_notice()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4,
                                                            "include_dashboard": False})
    ways = ("jsonl", "processor", "processor_v1")
    results: dict[str, list[dict]] = {way: [] for way in ways}
    try:
        cluster.add_node(num_cpus=4)
        ray.init(address=cluster.address, namespace="rayguide", log_to_driver=False)
        for r in range(rounds):
            for way in ways:
                results[way].append(one_run(way, cluster.address, model, jsonl, parquet,
                                            folder, f"{way}-{r}"))
    finally:
        ray.shutdown()
        cluster.shutdown()
    table_rows, ratios, steady_ratios, v1_ratios = [], [], [], []
    for r in range(rounds):
        j, p, v1 = results["jsonl"][r], results["processor"][r], results["processor_v1"][r]
        ratios.append(j["wall"] / p["wall"])  # the same rows: rows/s over rows/s
        v1_ratios.append(j["wall"] / v1["wall"])
        if p["busy"] and j["busy"]:
            steady_ratios.append(j["busy"] / p["busy"])  # the same rows: a rate ratio
        for way, res in (("JSONL batch job", j), ("Ray Data processor", p),
                         ("the processor, V1 Parquet reader", v1)):
            table_rows.append([r + 1, way, round(res["wall"], 1), round(n / res["wall"], 1),
                               round(res["first_rows_s"], 1),
                               "-" if res["busy"] is None else round(n / res["busy"], 1),
                               f"{res['distinct']}/{n}", round(res["valid"], 3)])
    ratio = statistics.median(ratios)
    steady = statistics.median(steady_ratios) if steady_ratios else None
    jw = statistics.median(x["wall"] for x in results["jsonl"])
    pw = statistics.median(x["wall"] for x in results["processor"])
    figs = {"rows": n, "jsonl_s": round(jw, 2), "processor_s": round(pw, 2),
            "jsonl_rows_s": round(n / jw, 2), "processor_rows_s": round(n / pw, 2),
            "processor_v1_s": round(statistics.median(
                x["wall"] for x in results["processor_v1"]), 2),
            "ratio_processor_vs_jsonl": round(ratio, 3),
            "ratio_processor_v1_vs_jsonl": round(statistics.median(v1_ratios), 3),
            "steady_ratio_processor_vs_jsonl": None if steady is None else round(steady, 3),
            "jsonl_steady_rows_s": round(n / results["jsonl"][-1]["busy"], 2)
            if results["jsonl"][-1]["busy"] else None,
            "processor_steady_rows_s": round(n / results["processor"][-1]["busy"], 2)
            if results["processor"][-1]["busy"] else None,
            "rows_out_jsonl": results["jsonl"][-1]["distinct"],
            "rows_out_processor": results["processor"][-1]["distinct"],
            "valid_share_jsonl": round(results["jsonl"][-1]["valid"], 3),
            "valid_share_processor": round(results["processor"][-1]["valid"], 3)}
    body = (f"{n} rows (two instruction prompts, a JSON schema per row, {MAX_TOKENS} tokens "
            f"each, the tiny model), a 2-node ray.cluster_utils.Cluster, 2 workers, "
            f"{CONCURRENCY} requests in flight either way, a fresh runtime per run. Seconds: "
            "each driver's wall time; first rows: until a worker held one of its rows; "
            "steady: rows a second over the runtime's busy window (from the first moment a "
            "worker held one of its rows to the last):\n\n"
            + table(["round", "way", "seconds", "rows/s", "first rows (s)", "steady rows/s",
                     "rows out", "valid share"], table_rows)
            + "\n\nprocessor / JSONL job throughput, end to end: "
            + ", ".join(f"{x:.2f}x" for x in ratios) + f" (median {ratio:.2f}x; bar 0.9x); "
            + "steady: " + ", ".join(f"{x:.2f}x" for x in steady_ratios)
            + (f" (median {steady:.2f}x)" if steady is not None else "-")
            + "; with the V1 Parquet reader, end to end: "
            + ", ".join(f"{x:.2f}x" for x in v1_ratios))
    finish("data_pipeline", body, figs, args)


if __name__ == "__main__":
    main()
