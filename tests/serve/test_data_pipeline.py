"""The Ray Data processor (deploy/data.py) on a 2-node ray.cluster_utils.Cluster (a head
and one node, a worker of the tiny random-weight model on each): Parquet in, Parquet out,
one output row per input row, guided rows valid or labelled, a bad row an error row; and
a worker killed mid-run costs no row."""

import json
import threading
import time

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from cluster import launch
from cluster.config import ClusterConfig
from deploy.batch_account import OUTCOMES
from deploy.data import ProcessorConfig, account, build_processor

pytestmark = pytest.mark.integration

SCHEMAS = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer"}},
            "required": ["name", "age"]},
           {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]
INSTRUCTIONS = ["You extract one person from the text below and answer in JSON. " * 6,
                "You say whether the text below is polite, in JSON, and nothing else. " * 6]


@pytest.fixture(scope="module")
def cluster(ray_runtime, tiny_model_dir):
    launch.fast_death_notice()
    with ray_runtime(num_cpus=3, nodes=1, node_cpus=3) as c:
        handles = launch.up(ClusterConfig(  # kept: the actors live as long as a handle
            model=str(tiny_model_dir), num_workers=2,
            worker={"num_cpus": 1, "num_threads": 1},
            engine={"num_kv_blocks": 128, "max_num_seqs": 16, "grammar_engine": "xgrammar"}))
        try:
            yield c
        finally:
            del handles
            launch.down(every=True)


def rows(n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        k = i % 2
        out.append({"id": i, "messages": [
            {"role": "system", "content": INSTRUCTIONS[k]},
            {"role": "user", "content": f"Text {i}: Ada is {20 + i} and says thanks."}],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0,
                                "structured_outputs": {"json": json.dumps(SCHEMAS[k])}}})
    return out


def write_input(folder, table_rows: list[dict]) -> str:
    path = folder / "in"
    path.mkdir()
    table = pa.Table.from_struct_array(pa.array(table_rows))
    pq.write_table(table.slice(0, len(table_rows) // 2), path / "a.parquet")
    pq.write_table(table.slice(len(table_rows) // 2), path / "b.parquet")
    return str(path)


def run_pipeline(src: str, dst: str, **config) -> None:
    processor = build_processor(ProcessorConfig(batch_size=8, max_in_flight=8, **config))
    processor(ray.data.read_parquet(src)).write_parquet(dst)


def check_rows(out: list[dict], n: int) -> None:
    assert sorted(r["id"] for r in out) == list(range(n))  # one row per input row
    for r in out:
        assert r["outcome"] in OUTCOMES
        if r["outcome"] == "valid":  # valid, or labelled as what it is
            assert r["finish_reason"] == "stop" and r["guided"]["validation"] == "valid"
            jsonschema.validate(json.loads(r["generated_text"]), SCHEMAS[r["id"] % 2])
        assert r["num_input_tokens"] > 0 or r["outcome"] == "refused"


def test_parquet_in_parquet_out_one_row_per_row(cluster, tmp_path):
    n = 24
    table_rows = rows(n, 24)
    table_rows[5] = {**table_rows[5], "sampling_params": {  # a bad row: not a pipeline failure
        "max_tokens": 24, "structured_outputs": {"json": '{"type": "object",'}}}
    table_rows[6] = {**table_rows[6], "sampling_params": {"n": 3}}
    dst = str(tmp_path / "out")
    run_pipeline(write_input(tmp_path, table_rows), dst, concurrency=2)
    out = pq.read_table(dst).to_pylist()
    check_rows(out, n)
    by_id = {r["id"]: r for r in out}
    assert by_id[5]["outcome"] == "refused" and "not valid JSON" in by_id[5]["error"]
    assert by_id[6]["outcome"] == "refused" and "n" in by_id[6]["error"]
    good = [r for i, r in by_id.items() if i not in (5, 6)]
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for r in good)
    assert all(r["guided"]["engine"] == "xgrammar" for r in good)
    # rows of one instruction prompt find it cached (prefix-aware routing, grouped sends)
    assert sum(r["num_cached_tokens"] for r in good) > 0
    acc = account(ray.data.read_parquet(dst))
    assert acc.rows == n and acc.outcomes["refused"] == 2
    print("\n" + acc.table())


def test_a_worker_killed_mid_run_costs_no_row(cluster, tmp_path):
    n = 96  # enough rows that the run outlasts the poll below (40 finished within 0.5 s once)
    dst = str(tmp_path / "out")
    src = write_input(tmp_path, rows(n, 64))
    done = threading.Event()
    failure: list[BaseException] = []

    def go():
        try:
            run_pipeline(src, dst)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=go)
    thread.start()
    victim = launch.handles()["workers"][0]
    deadline = time.monotonic() + 180
    while ray.get(victim.load.remote())["running"] == 0:
        assert time.monotonic() < deadline and not done.is_set(), failure
        time.sleep(0.02)
    assert not done.is_set()  # killed with rows in flight: not after the run
    ray.kill(victim, no_restart=False)
    thread.join(timeout=300)
    assert not failure, failure
    out = pq.read_table(dst).to_pylist()
    check_rows(out, n)
    outcomes = {o: sum(r["outcome"] == o for r in out) for o in OUTCOMES}
    assert outcomes["infrastructure"] == 0, outcomes  # continued on the other worker
    print(f"\na worker killed mid-run: {n} rows back, {outcomes}")
