"""The batch job (deploy/batch_job.py).

Unit tests drive its pieces with a fake runtime client: line parsing, input order with
out-of-order completions, per-line errors, resume and --retry-errors. The integration test
submits it with a real `ray job submit` to a Ray head started here (free ports, its own
--temp-dir), on a tiny random-weight model: mixed lines, then resume after the output was
cut to two lines, then a re-run with nothing left to do. The head is stopped by killing
exactly its processes (found by a marker in their environment): `ray stop` would kill every
Ray process on the machine, other tests' included."""

import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from core.params import SamplingParams
from core.request import GenerationRequest, RequestOutput
from deploy import batch_job
from core.grammar_spec import GrammarSpec

REPO = Path(__file__).resolve().parents[2]

# ---- unit: parsing -------------------------------------------------------------------------

DEFAULTS = {"max_new_tokens": 256, "temperature": 0.0}


def parse(obj_or_text, line=1, default_grammar=None):
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    return batch_job.parse_line(text, line, defaults=DEFAULTS, default_grammar=default_grammar,
                                run_tag="t")


@pytest.mark.unit
def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "deploy.batch_job", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--input", "--output", "--schema", "--concurrency", "--retry-errors",
                 "--model", "--workers", "--config", "--address"):
        assert flag in out.stdout


@pytest.mark.unit
def test_parse_prompt_messages_sampling():
    item = parse({"id": "a", "prompt": "Hi", "max_tokens": 5, "temperature": 0.7,
                  "top_p": 0.9, "seed": 3, "stop": ["\n"]}, line=4)
    assert item.error is None and item.id == "a" and item.line == 4 and not item.is_json
    assert item.request == GenerationRequest("Hi", SamplingParams(
        max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop=("\n",)),
        request_id="batch-t-4", client="batch")  # the job is one client of the compile queue
    msgs = [{"role": "user", "content": "Hi"}]
    item = parse({"messages": msgs}, line=7)
    assert item.id == 7 and item.request.prompt == msgs
    assert item.request.params == SamplingParams(**DEFAULTS) and item.request.grammar is None


@pytest.mark.unit
def test_parse_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    default = GrammarSpec.json_schema({"type": "string"})
    own = parse({"prompt": "x", "schema": schema}, default_grammar=default)
    assert own.is_json and own.request.grammar == GrammarSpec.json_schema(schema)
    assert parse({"prompt": "x"}, default_grammar=default).request.grammar == default
    text = parse({"prompt": "x", "response_format": {"type": "text"}}, default_grammar=default)
    assert text.request.grammar is None and not text.is_json
    rf = parse({"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert rf.is_json and rf.request.grammar.kind == "json_schema"
    assert parse({"prompt": "x", "response_format": {"type": "json_object"}}).is_json
    rx = parse({"prompt": "x", "response_format": {"type": "regex_schema",
                                                   "regex_schema": "[0-9]+"}})
    assert rx.request.grammar.kind == "regex" and not rx.is_json
    assert parse({"prompt": "x", "regex": "a+"}).request.grammar.source == "a+"
    assert parse({"prompt": "x", "choice": ["y", "n"]}).request.grammar.kind == "choice"


@pytest.mark.unit
@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ({"max_tokens": 3}, "no `prompt` or `messages`"),
    ({"prompt": ""}, "non-empty string"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "not both"),
    ({"messages": "hi"}, "`messages` must be"),
    ({"prompt": "x", "schema": "{nope"}, "invalid schema"),
    ({"prompt": "x", "schema": {}, "regex": "a"}, "at most one format"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "not supported"),
    ({"prompt": "x", "choice": []}, "invalid choice"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_tokens": 3, "max_new_tokens": 4}, "give one of"),
    ({"prompt": "x", "id": [1]}, "`id` must be"),
])
def test_parse_errors(line, message):
    item = parse(line, line=9)
    assert item.request is None and message in item.error
    assert item.id == 9  # no usable id: the line number


# ---- unit: the pipeline with a fake runtime ------------------------------------------------

class FakeClient:
    """Completes requests after a random delay (so they finish out of order); a prompt
    "worker-error" ends with an error chunk, "raise" raises ValueError."""

    def __init__(self):
        self.seen = []
        self.in_flight = self.max_in_flight = 0

    async def complete(self, request):
        self.seen.append(request.request_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(random.random() * 0.01)
            prompt = request.prompt
            if prompt == "raise":
                raise ValueError("prompt is too long")
            if prompt == "worker-error":
                return RequestOutput(request.request_id, "", finish_reason="error",
                                     error="invalid json_schema grammar: boom",
                                     prompt_tokens=3, completion_tokens=0)
            text = '{"a": 1}' if request.grammar is not None else f"echo {prompt}"
            return RequestOutput(request.request_id, text, finish_reason="stop",
                                 prompt_tokens=3, completion_tokens=2)
        finally:
            self.in_flight -= 1


def run_file(tmp_path, lines, *, retry_errors=False, concurrency=4, client=None):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    skip, _ = batch_job.scan_output(str(out), retry_errors)
    work = batch_job.plan(str(inp), skip)
    client = client or FakeClient()
    with open(out, "a") as f:
        counts = asyncio.run(batch_job.process(
            batch_job.items(str(inp), work, defaults=DEFAULTS, default_grammar=None,
                            run_tag="t"), client, f, concurrency=concurrency))
    batch_job.settle_output(str(out))  # as the job does at its end
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return rows, counts, work, client


@pytest.mark.unit
def test_order_errors_and_concurrency(tmp_path):
    random.seed(0)
    lines = [{"id": f"p{i}", "prompt": f"n{i}"} for i in range(40)]
    lines[3] = "{broken"
    lines[5] = {"id": "we", "prompt": "worker-error"}
    lines[7] = {"id": "ve", "prompt": "raise"}
    lines[9] = {"id": "js", "prompt": "j", "response_format": {"type": "json_object"}}
    lines.insert(13, "   ")  # blank: ignored
    rows, counts, work, client = run_file(tmp_path, lines)
    assert [r["line"] for r in rows] == [i for i in range(1, 42) if i != 14]
    assert rows[3]["id"] == 4 and "not valid JSON" in rows[3]["error"]
    assert rows[5]["finish_reason"] == "error" and "boom" in rows[5]["error"]
    assert rows[5]["usage"] == {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 0}
    assert rows[7]["error"] == "prompt is too long"
    assert rows[9]["json"] == {"a": 1} and "error" not in rows[9]
    assert rows[0] == {"id": "p0", "line": 1, "text": "echo n0", "finish_reason": "stop",
                       "usage": {"prompt_tokens": 3, "cached_tokens": 0,
                                 "completion_tokens": 2},
                       "max_tokens": 256, "outcome": "valid"}
    assert counts == batch_job.BatchCounts(done=40, errors=3)
    assert 1 < client.max_in_flight <= 4


@pytest.mark.unit
def test_resume_and_retry_errors(tmp_path):
    lines = [{"id": i, "prompt": "worker-error" if i == 2 else f"n{i}"} for i in range(6)]
    rows, counts, _, _ = run_file(tmp_path, lines)
    assert counts == batch_job.BatchCounts(done=6, errors=1)
    out = tmp_path / "out.jsonl"
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:3]) + text[3][:7])  # interrupted mid-write of line 4
    rows, counts, work, client = run_file(tmp_path, lines)
    assert [r["id"] for r in rows] == list(range(6)) and work.skipped == 3
    assert counts == batch_job.BatchCounts(done=3, errors=0) and len(client.seen) == 3
    rows, counts, work, client = run_file(tmp_path, lines)  # nothing left to do
    assert counts.done == 0 and work.skipped == 6 and client.seen == []
    lines[2]["prompt"] = "fixed"  # the failed line, fixed: --retry-errors runs it again
    rows, counts, work, client = run_file(tmp_path, lines, retry_errors=True)
    assert [r["id"] for r in rows] == [0, 1, 3, 4, 5, 2] and "error" not in rows[-1]
    assert counts == batch_job.BatchCounts(done=1, errors=0) and work.skipped == 5


@pytest.mark.unit
def test_undecodable_and_blank_lines(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"prompt": "a"}\n\xff\xfe{"prompt": "b"}\n\n{"prompt": "c"}\n')
    work = batch_job.plan(str(inp), set())
    got = list(batch_job.items(str(inp), work, defaults=DEFAULTS, default_grammar=None,
                               run_tag="t"))
    assert [(i.line, i.id) for i in got] == [(1, 1), (2, 2), (4, 4)]
    assert got[1].error == "line 2 is not valid UTF-8" and got[2].request.prompt == "c"


@pytest.mark.unit
def test_main_without_work_needs_no_ray(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n{"prompt": "y"}\n')
    out.write_text('{"id": "a", "text": "done"}\n{"id": 2, "error": "failed"}\n')
    assert batch_job.main(["--input", str(inp), "--output", str(out)]) == 0
    assert "batch_job: done=0 skipped=2 errors=0" in capsys.readouterr().out
    assert batch_job.main(["--input", str(inp), "--output", str(inp)]) == 2
    assert batch_job.main(["--input", str(inp), "--output", str(out),
                           "--schema", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---- integration: a real `ray job submit` --------------------------------------------------

MARKER = "RAYGUIDE_BATCH_JOB_TEST_HEAD"


def free_ports(n):
    """n distinct free ports outside the range of outgoing connections (launch.free_port)."""
    from cluster.launch import free_port

    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def marked_pids(value):
    """Every process whose environment carries MARKER=value: the head's GCS, raylet,
    dashboard and agents, its workers, the job's driver and its children."""
    needle = f"{MARKER}={value}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def kill_marked(value, grace_s=2.0):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = marked_pids(value)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = marked_pids(value)
        if not pids:
            return
    assert not marked_pids(value), "processes of the test's Ray head survived SIGKILL"


@pytest.fixture(scope="module")
def ray_head():
    from cluster.launch import ray_executable

    gcs, dash, client, agent, agent_grpc, metrics, renv, nm, om = free_ports(9)
    marker = uuid.uuid4().hex
    temp_dir = tempfile.mkdtemp(prefix="rgbj-", dir="/tmp")  # short: socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # `python` in the job's entrypoint resolves on the PATH the head was started with
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env[MARKER] = marker
    # Ray turns token auth on for `ray start` once ~/.ray/auth_token exists (any earlier
    # local ray.init() writes it), but `ray job submit` sends a token only with
    # RAY_AUTH_MODE=token: give this head, its jobs and our CLI calls their own token
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    cmd = [ray_executable(), "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
           "--include-dashboard=true", "--num-cpus=4", "--disable-usage-stats",
           f"--temp-dir={temp_dir}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={renv}",
           f"--node-manager-port={nm}", f"--object-manager-port={om}"]
    t0 = time.monotonic()
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        url = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 60
        while True:  # the dashboard's HTTP server answers (401 without Ray's auth token)
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(0.5)
        print(f"ray start --head: {time.monotonic() - t0:.1f} s")
        gcs_address = re.search(r"ray start --address='([^']+)'", started.stdout + started.stderr)
        yield {"url": url, "env": env, "gcs": gcs_address.group(1)}
    finally:
        kill_marked(marker)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(head, job_args, check_first="", timeout=300):
    """`ray job submit --working-dir <repo> -- python -m deploy.batch_job ...` (waits for
    the job and streams its log); returns (returncode, output, summary). check_first: a
    shell condition run in the job's directory before it (through `sh -c`: Ray quotes
    every entrypoint word, so `&&` cannot be given as a word)."""
    from cluster.launch import ray_executable

    entry = ["python", "-m", "deploy.batch_job", *shlex.split(" ".join(job_args))]
    if check_first:
        entry = ["sh", "-c", f"{check_first} && {shlex.join(entry)}"]
    cmd = [ray_executable(), "job", "submit", "--address", head["url"], "--working-dir", ".",
           "--", *entry]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=head["env"], capture_output=True, text=True,
                          timeout=timeout)
    output = done.stdout + done.stderr
    m = re.search(r"batch_job: done=(\d+) skipped=(\d+) errors=(\d+) seconds=([\d.]+)", output)
    summary = m and dict(zip(("done", "skipped", "errors"), map(int, m.groups()[:3])))
    print(f"ray job submit: {time.monotonic() - started:.1f} s, {m and m.group(0)}")
    return done.returncode, output, summary


def rayguide_actors(head):
    """Names of the live actors in the rayguide namespace (the dashboard's state API)."""
    req = urllib.request.Request(f"{head['url']}/api/v0/actors?limit=1000", headers={
        "Authorization": f"Bearer {head['env']['RAY_AUTH_TOKEN']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        actors = json.load(r)["data"]["result"]["result"]
    return sorted(a["name"] for a in actors
                  if a["state"] == "ALIVE" and a.get("ray_namespace") == "rayguide")


def settled_actors(head, expected, timeout_s=15.0):
    """rayguide_actors(), once it equals expected (kills reach the state API with a lag)."""
    deadline = time.monotonic() + timeout_s
    while (names := rayguide_actors(head)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return names


def start_runtime(head, model, config):
    """A detached runtime, as `rayguide up` starts it (someone else's, for the job)."""
    code = ("from cluster import launch; from cluster.config import ClusterConfig; "
            f"launch.up(ClusterConfig.from_yaml({str(config)!r}, model={str(model)!r}, "
            f"num_workers=1, address={head['gcs']!r}), detached=True)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=head["env"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]


NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
               "required": ["name"]}
AGE_SCHEMA = {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}},
              "required": ["age"]}
CHAT = [{"role": "user", "content": "Describe a cat."}]
LINES = [
    {"id": "plain", "prompt": "Once upon a time", "response_format": {"type": "text"},
     "max_tokens": 8},
    {"id": "chat", "messages": CHAT, "max_tokens": 96},  # --schema applies
    {"id": "own", "prompt": "A person:", "schema": AGE_SCHEMA, "max_tokens": 64},
    {"id": "rf", "messages": CHAT, "max_tokens": 64, "response_format": {
        "type": "json_schema", "json_schema": {"name": "age", "schema": AGE_SCHEMA}}},
    {"id": "re", "prompt": "Phone:", "regex": "[0-9]{3}-[0-9]{4}", "max_tokens": 16},
    "this line is not JSON {",
    {"id": "bad-schema", "prompt": "x", "schema": {"type": "nonsense"}},
    {"prompt": "Yes or no?", "choice": ["yes", "no"], "max_tokens": 8},  # id: line 8
    {"id": "no-prompt", "max_tokens": 8},
    {"id": "sampled", "prompt": "Random:", "temperature": 0.8, "top_p": 0.9, "seed": 7,
     "stop": ["\n"], "max_tokens": 12, "response_format": {"type": "text"}},
]
IDS = ["plain", "chat", "own", "rf", "re", 6, "bad-schema", 8, "no-prompt", "sampled"]
ERRORS = {6: "not valid JSON", "bad-schema": "invalid json_schema grammar",
          "no-prompt": "no `prompt` or `messages`"}


def check_rows(rows):
    import jsonschema

    assert [r["id"] for r in rows] == IDS
    for row in rows:
        if row["id"] in ERRORS:
            assert ERRORS[row["id"]] in row["error"] and row["finish_reason"] == "error"
            continue
        assert "error" not in row, row
        assert row["finish_reason"] in ("stop", "length"), row
        assert row["usage"]["prompt_tokens"] > 0 and row["usage"]["completion_tokens"] > 0
        # guided rows are valid whatever the finish reason: an output the budget would cut
        # is closed inside it (a random model runs to the budget on every row)
        if row["id"] in ("chat", "own", "rf"):
            schema = NAME_SCHEMA if row["id"] == "chat" else AGE_SCHEMA
            jsonschema.validate(row["json"], schema)
            assert json.loads(row["text"]) == row["json"]
        elif row["id"] == "re":
            assert re.fullmatch("[0-9]{3}-[0-9]{4}", row["text"])
        elif row["id"] == 8:
            assert row["text"] in ("yes", "no")
    assert "json" not in rows[0] and "json" not in rows[4]


@pytest.mark.integration
def test_batch_job_via_ray_job_submit(ray_head, tiny_model_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in LINES))
    (tmp_path / "schema.json").write_text(json.dumps(NAME_SCHEMA))
    (tmp_path / "runtime.yaml").write_text(
        "worker: {num_cpus: 1, num_threads: 1}\n"
        "engine: {num_kv_blocks: 256, max_num_seqs: 16}\n")
    args = [f"--input {inp}", f"--output {out}", f"--schema {tmp_path / 'schema.json'}",
            f"--model {tiny_model_dir}", "--workers 1", f"--config {tmp_path / 'runtime.yaml'}",
            "--concurrency 8"]

    # the job runs in an uploaded copy of the repo: .gitignore keeps .venv out of it
    code, log, summary = submit(ray_head, args,
                                   check_first="test ! -e .venv && test -f deploy/batch_job.py")
    assert code == 0 and "succeeded" in log, log[-4000:]
    assert summary == {"done": 10, "skipped": 0, "errors": 3}, log[-4000:]
    assert "starting one (1 workers" in log
    assert settled_actors(ray_head, []) == []  # the job took its own runtime down
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    check_rows(rows)

    # resume: an interrupted run left two lines; the rest is done again, once, this time
    # on a runtime that was running already (and that the job leaves running)
    start_runtime(ray_head, tiny_model_dir, tmp_path / "runtime.yaml")
    runtime = rayguide_actors(ray_head)
    assert "rayguide_scheduler" in runtime and "rayguide_worker_0" in runtime
    kept = out.read_text().splitlines(keepends=True)[:2]
    out.write_text("".join(kept))
    code, log, summary = submit(ray_head, args)
    assert code == 0 and summary == {"done": 8, "skipped": 2, "errors": 3}, log[-4000:]
    assert "using the running runtime; ignoring --model, --workers, --config" in log
    assert "starting one" not in log and settled_actors(ray_head, runtime) == runtime
    text = out.read_text()
    assert text.startswith("".join(kept))
    check_rows([json.loads(x) for x in text.splitlines()])
    # everything done: a re-run changes nothing and needs no Ray
    # (test_main_without_work_needs_no_ray, in process)


def readme_pipeline(src: Path, dst: Path) -> str:
    """The README's Ray Data example (its ``# my_pipeline.py`` block), reading ``src`` and
    writing ``dst`` where it names /data/in/ and /data/out/."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(# my_pipeline\.py\n.*?)```", readme, re.S)
    assert block, "README.md has no `# my_pipeline.py` example"
    code = block.group(1)
    assert "/data/in/" in code and "/data/out/" in code
    return code.replace("/data/in/", f"{src}/").replace("/data/out/", f"{dst}/")


@contextlib.contextmanager
def second_node(head, num_cpus=2):
    """A second node joined to ``head`` (``ray start --address``, ports of its own): the
    cluster the README's ``ray job submit`` path is written for. Its processes carry a
    marker of their own and are killed when it ends."""
    from cluster.launch import ray_executable

    marker = uuid.uuid4().hex
    env = {**head["env"], MARKER: marker}
    nm, om, metrics, agent, agent_grpc, renv = free_ports(6)
    cmd = [ray_executable(), "start", f"--address={head['gcs']}", f"--num-cpus={num_cpus}",
           "--disable-usage-stats", f"--node-manager-port={nm}",
           f"--object-manager-port={om}", f"--metrics-export-port={metrics}",
           f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={renv}"]
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        deadline = time.monotonic() + 60
        while len(alive_nodes(head)) < 2:
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(0.5)
        yield
    finally:
        kill_marked(marker)


def alive_nodes(head) -> list[dict]:
    """The cluster's alive nodes (the dashboard's state API)."""
    req = urllib.request.Request(f"{head['url']}/api/v0/nodes?limit=100", headers={
        "Authorization": f"Bearer {head['env']['RAY_AUTH_TOKEN']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        nodes = json.load(r)["data"]["result"]["result"]
    return [n for n in nodes if n["state"] == "ALIVE"]


@pytest.mark.integration
def test_the_readmes_ray_data_pipeline_via_ray_job_submit(ray_head, tiny_model_dir,
                                                          tmp_path):
    """The README's pipeline, as written there, submitted with `ray job submit
    --working-dir . -- python my_pipeline.py` to a 2-node cluster (a head and a node
    joined to it) with a runtime running: Parquet in, Parquet out, one row per input row,
    and the account printed."""
    with second_node(ray_head):
        readme_pipeline_job(ray_head, tiny_model_dir, tmp_path)
        assert len(alive_nodes(ray_head)) == 2


def readme_pipeline_job(ray_head, tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if "rayguide_scheduler" not in rayguide_actors(ray_head):
        (tmp_path / "runtime.yaml").write_text(
            "worker: {num_cpus: 1, num_threads: 1}\n"
            "engine: {num_kv_blocks: 256, max_num_seqs: 16}\n")
        start_runtime(ray_head, tiny_model_dir, tmp_path / "runtime.yaml")
    src, dst = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    rows = [{"id": i, "messages": [{"role": "user", "content": f"A person, {i}?"}],
             "sampling_params": {"max_tokens": 24, "temperature": 0.0,
                                 "structured_outputs": {"json": json.dumps(AGE_SCHEMA)}}}
            for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), src / "part-0.parquet")
    code = readme_pipeline(src, dst)
    # the script is written inside the job's uploaded working directory, where the README
    # has it, then run there
    entry = ["sh", "-c", f"printf %s {shlex.quote(code)} > my_pipeline.py && "
                         "python my_pipeline.py"]
    from cluster.launch import ray_executable
    done = subprocess.run([ray_executable(), "job", "submit", "--address", ray_head["url"],
                           "--working-dir", ".", "--", *entry], cwd=REPO, env=ray_head["env"],
                          capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in log, log[-4000:]
    out = pq.read_table(dst).to_pylist()
    assert sorted(r["id"] for r in out) == list(range(12))
    assert all(r["outcome"] for r in out) and all(r["finish_reason"] for r in out)
    assert re.search(r"\ntotal\s+12\s", log), log[-3000:]  # the account's table, printed


@pytest.mark.unit
def test_one_deeply_nested_line_fails_alone():
    """A line nested past Python's recursion limit, or a schema nested past the schema depth
    limit, is that line's error; the job goes on."""
    deep_text = '{"prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
    item = parse(deep_text, line=3)
    assert item.request is None and "nested too deeply" in item.error
    schema = {"type": "object"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    item = parse({"prompt": "x", "schema": schema}, line=4)
    assert item.request is None and "nested deeper" in item.error
    assert parse({"prompt": "fine"}, line=5).error is None
