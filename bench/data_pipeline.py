"""The Ray Data processor vs the JSONL batch job on the same rows (issue 61).

    python bench/data_pipeline.py [--quick | --smoke] [--model tiny|default] [--json]
        [--no-record]

A 2-node ray.cluster_utils.Cluster (a head and one node) runs a runtime of 2 workers, 32
tokens a row. ``--model tiny`` (the default) is the tiny random-weight model with the real
tokenizer: what is measured is the path of a row, not the forward, so each way's fixed
start-up weighs the most it can. ``--model default`` is the runtime's default model
(SmolLM2-135M-Instruct), the rows a user's pipeline would send: the same start-up beside
real decoding. ``--ways`` picks which of the three ways below run (all by default);
``--processor-config`` adds ProcessorConfig fields (JSON) to the processor's. The rows: two instruction prompts, alternating, each
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
processor = build_processor(ProcessorConfig(concurrency=2, max_in_flight={half}, **{extra}))
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
    held: list[int] = []  # rows the runtime held at each poll of the busy window
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                text=True)
        while proc.poll() is None:
            loads = ray.get([w.load.remote() for w in workers])
            now = time.perf_counter()
            rows = sum(x["running"] + x["waiting"] + x["waiting_for_grammar"] for x in loads)
            if rows:
                first = first or now
                last = now
            if first is not None:
                held.append(rows)
            time.sleep(POLL_S)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}):\n{err.read()[-3000:]}")
    busy = (last - first + POLL_S) if first is not None else None
    while held and not held[-1]:
        held.pop()  # the busy window ends at the last poll that saw a row
    return {"wall": wall, "busy": busy, "first_rows_s": (first - t0) if first else wall,
            "held": statistics.mean(held) if held else 0.0}


POLL_S = 0.1


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def parquet_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).select(["id", "outcome"]).to_pylist()


def one_run(way: str, address: str, model: str | None, jsonl: Path, parquet: Path,
            folder: Path, tag: str, extra: dict) -> dict:
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
                                   extra=extra,
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
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny",
                    help="tiny: the random-weight model (the path of a row); default: "
                         "SmolLM2-135M-Instruct (real decoding)")
    ap.add_argument("--ways", default="jsonl,processor,processor_v1",
                    help="comma-separated: jsonl, processor, processor_v1")
    ap.add_argument("--processor-config", default="{}",
                    help="JSON: more ProcessorConfig fields for the processor's runs "
                         "(e.g. '{\"batch_size\": 16}')")
    args = ap.parse_args()
    extra = json.loads(args.processor_config)
    import ray
    from ray.cluster_utils import Cluster

    from cluster import launch

    n = 16 if args.smoke else 200 if args.quick else 1000
    rounds = 1 if (args.smoke or args.quick) else 2
    model = tiny_model() if args.smoke or args.model == "tiny" else None
    folder = Path(tempfile.mkdtemp(prefix="rayguide-data-bench-"))
    rows = make_rows(n)
    jsonl, parquet = write_inputs(folder, rows)
    launch.fast_death_notice()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4,
                                                            "include_dashboard": False})
    ways = tuple(w for w in args.ways.split(",") if w)
    assert "jsonl" in ways and set(ways) <= {"jsonl", "processor", "processor_v1"}, ways
    results: dict[str, list[dict]] = {way: [] for way in ways}
    try:
        cluster.add_node(num_cpus=4)
        ray.init(address=cluster.address, namespace="rayguide", log_to_driver=False)
        for r in range(rounds):
            for way in ways:
                results[way].append(one_run(way, cluster.address, model, jsonl, parquet,
                                            folder, f"{way}-{r}", extra))
    finally:
        ray.shutdown()
        cluster.shutdown()
    names = {"jsonl": "JSONL batch job", "processor": "Ray Data processor",
             "processor_v1": "the processor, V1 Parquet reader"}
    table_rows = []
    ratios = {way: [] for way in ways if way != "jsonl"}  # end to end, a round each
    steady_ratios: list[float] = []
    for r in range(rounds):
        j = results["jsonl"][r]
        for way in ways:
            res = results[way][r]
            if way != "jsonl":
                ratios[way].append(j["wall"] / res["wall"])  # the same rows: a rate ratio
            if way == "processor" and res["busy"] and j["busy"]:
                steady_ratios.append(j["busy"] / res["busy"])
            table_rows.append([r + 1, names[way], round(res["wall"], 1),
                               round(n / res["wall"], 1), round(res["first_rows_s"], 1),
                               "-" if res["busy"] is None else round(n / res["busy"], 1),
                               round(res["held"], 1), f"{res['distinct']}/{n}",
                               round(res["valid"], 3)])
    steady = statistics.median(steady_ratios) if steady_ratios else None
    figs: dict = {"rows": n, "model": args.model if not args.smoke else "tiny"}
    for way in ways:
        wall = statistics.median(x["wall"] for x in results[way])
        last = results[way][-1]
        figs[f"{way}_s"] = round(wall, 2)
        figs[f"{way}_rows_s"] = round(n / wall, 2)
        figs[f"{way}_steady_rows_s"] = round(n / last["busy"], 2) if last["busy"] else None
        figs[f"rows_out_{way}"] = last["distinct"]
        figs[f"rows_held_{way}"] = round(statistics.mean(x["held"] for x in results[way]), 1)
        figs[f"valid_share_{way}"] = round(last["valid"], 3)
        if way != "jsonl":
            figs[f"ratio_{way}_vs_jsonl"] = round(statistics.median(ratios[way]), 3)
    figs["steady_ratio_processor_vs_jsonl"] = None if steady is None else round(steady, 3)
    model_words = ("the tiny model" if figs["model"] == "tiny"
                   else "the default model, SmolLM2-135M-Instruct")
    body = (f"{n} rows (two instruction prompts, a JSON schema per row, {MAX_TOKENS} tokens "
            f"each, {model_words}), a 2-node ray.cluster_utils.Cluster, 2 workers, "
            f"{CONCURRENCY} requests in flight either way, a fresh runtime per run. Seconds: "
            "each driver's wall time; first rows: until a worker held one of its rows; "
            "steady: rows a second over the runtime's busy window (from the first moment a "
            "worker held one of its rows to the last); rows held: the mean of the rows the "
            "workers held (running or waiting) over that window, polled:\n\n"
            + table(["round", "way", "seconds", "rows/s", "first rows (s)", "steady rows/s",
                     "rows held", "rows out", "valid share"], table_rows)
            + "\n\nEnd to end, over the JSONL job's throughput (bar 0.9x): "
            + "; ".join(f"{names[way]} " + ", ".join(f"{x:.2f}x" for x in xs)
                        + f" (median {statistics.median(xs):.2f}x)"
                        for way, xs in ratios.items())
            + ("" if steady is None else "; the processor's steady rate: "
               + ", ".join(f"{x:.2f}x" for x in steady_ratios) + f" (median {steady:.2f}x)"))
    finish("data_pipeline", body, figs, args)


if __name__ == "__main__":
    main()
