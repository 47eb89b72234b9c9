"""The batch job's account through a real `ray job submit` (issue 42): a job of a few hundred
lines (bad lines, schemas that cannot compile, budgets below a grammar's shortest output,
budgets that cut answers) on a runtime whose only worker is killed mid-job ends with a
summary whose counts add up to the input; `--retry-failed` then raises the valid share and
leaves every valid row as it was. A tiny random-weight model: the outcomes are what its
budgets make them, not what a real model would write."""

import json
import subprocess
import sys
import time

import pytest

from tests.serve.test_batch_job import (REPO, ray_head, rayguide_actors,  # noqa: F401 (fixture)
                                        start_runtime)

pytestmark = pytest.mark.integration

NAME = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"]}
AGE = {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}},
       "required": ["age"]}
LONG = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 4}
                                         for i in range(12)},
        "required": [f"field_{i}" for i in range(12)]}


def lines(n=240):
    out = []
    for i in range(n):
        if i % 40 == 7:
            out.append("this line is not JSON {")
        elif i % 40 == 19:
            out.append({"id": f"r{i}", "max_tokens": 8})  # no prompt
        elif i % 40 == 23:
            out.append({"id": f"r{i}", "prompt": "x", "schema": {"type": "nonsense"}})
        elif i % 40 == 31:  # the grammar's shortest output is longer than this budget
            out.append({"id": f"r{i}", "prompt": "Fields:", "schema": LONG, "max_tokens": 6})
        elif i % 3 == 0:
            out.append({"id": f"r{i}", "prompt": f"Name {i}:", "schema": NAME, "max_tokens": 9})
        elif i % 3 == 1:  # budgets that cut many answers of a random model
            out.append({"id": f"r{i}", "prompt": f"Age {i}:", "schema": AGE, "max_tokens": 7})
        else:
            out.append({"id": f"r{i}", "prompt": f"Words {i}", "max_tokens": 6,
                        "response_format": {"type": "text"}})
    return out


def kill_worker(head):
    code = ("import ray; ray.init(address=%r, namespace='rayguide'); "
            "ray.kill(ray.get_actor('rayguide_worker_0'), no_restart=False)" % head["gcs"])
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=head["env"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def job(head, args):
    from cluster.launch import ray_executable

    return subprocess.Popen(
        [ray_executable(), "job", "submit", "--address", head["url"], "--working-dir", ".",
         "--", "python", "-m", "deploy.batch_job", *args],
        cwd=REPO, env=head["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def rows_of(path):
    try:
        return [json.loads(x) for x in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


def test_account_adds_up_after_a_worker_dies_and_retry_failed_raises_the_valid_share(
        ray_head, tiny_model_dir, tmp_path):  # noqa: F811 (the fixture)
    head = ray_head
    config = tmp_path / "runtime.yaml"
    config.write_text("worker: {num_cpus: 1, num_threads: 1}\n"
                      "engine: {num_kv_blocks: 512, max_num_seqs: 16}\n")
    start_runtime(head, tiny_model_dir, config)
    assert "rayguide_worker_0" in rayguide_actors(head)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    given = lines()
    inp.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in given))
    args = ["--input", str(inp), "--output", str(out), "--concurrency", "8", "--quiet"]

    proc = job(head, args)
    deadline = time.monotonic() + 240
    while len(rows_of(out)) < len(given) // 4:  # a quarter done: kill the only worker
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.2)
    killed_at = len(rows_of(out))
    kill_worker(head)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-4000:]
    assert killed_at < len(given)
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    rows = rows_of(out)
    # the counts add up to the input, whatever the worker's death did to the lines in flight
    assert summary["input_lines"] == len(given) == summary["rows"] == len(rows)
    assert summary["missing"] == 0
    assert sum(summary["outcomes"].values()) == len(given)
    assert sum(sum(c.values()) for c in summary["by_grammar"].values()) == len(given)
    print(f"worker killed after {killed_at} rows; outcomes {summary['outcomes']}")
    counted = {o: sum(r["outcome"] == o for r in rows) for o in summary["outcomes"]}
    assert counted == summary["outcomes"]
    assert counted["refused"] == 6 + 6 + 6  # not JSON, no prompt, a budget below the shortest
    assert counted["grammar_error"] == 6  # the nonsense schema
    assert counted["closed_at_budget"] > 0 and counted["valid"] > 0
    assert f"valid_share={summary['valid_share']:.4f}" in log
    assert "outcome" in log and "closed_at_budget" in log  # the table, on stderr

    # --retry-failed: only what a retry can help, and every valid row stays as it was
    (tmp_path / "first.jsonl").write_text(out.read_text())
    valid_before = [json.dumps(r, ensure_ascii=False) for r in rows if r["outcome"] == "valid"]
    text_before = out.read_text().splitlines()
    proc = job(head, args + ["--retry-failed"])
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-4000:]
    after = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    rows = rows_of(out)
    assert after["rows"] == len(rows) == len(given) == sum(after["outcomes"].values())
    print(f"--retry-failed: valid share {summary['valid_share']} -> {after['valid_share']}; "
          f"outcomes {after['outcomes']}")
    assert after["valid_share"] > summary["valid_share"]
    kept = set(out.read_text().splitlines())
    assert all(x in kept for x in text_before if json.loads(x)["outcome"] == "valid")
    assert len(valid_before) == sum(json.dumps(r, ensure_ascii=False) in valid_before
                                    for r in rows)
    assert after["outcomes"]["grammar_error"] == 6  # never retried: it cannot help
    # the lines refused for a budget below the grammar's shortest output ran with the
    # budget the refusal named; the lines' own faults stayed
    assert after["outcomes"]["refused"] == 6 + 6
    retried = [r for r in rows if r.get("attempt") == 2]
    assert retried and all(r["id"] not in {json.loads(x)["id"] for x in text_before
                                           if json.loads(x)["outcome"] == "valid"}
                           for r in retried)
    assert all(r["max_tokens"] > 5 for r in retried if r.get("grammar") and
               r["outcome"] != "infrastructure")
