"""The batch job under hostile lines and a failing runtime (deploy/batch_job.py), no Ray.

- a line Python cannot read (an integer of 5,000 digits, nesting 100,000 deep) is that
  line's error row in plan() too, and the job goes on;
- a transient failure (a worker died, the grammar cache down, no workers) is retried; one
  that outlasts the retries is written ``transient`` and a resume runs it again, while a
  line's own error stays an error a resume skips;
- ``--output`` is locked: a second run on it exits 2 naming the holder;
- a job that starts its own runtime claims it, and a job that finds another job's claim
  waits instead of using (or taking over) that runtime.
"""

import asyncio
import json
import os
import subprocess
import sys
import types

import pytest
from ray.exceptions import ActorDiedError

from core.errors import ErrorKind, GrammarError, GrammarUnavailable, NoWorkers
from core.request import RequestOutput
from deploy import batch_job

pytestmark = pytest.mark.unit

DEFAULTS = {"max_new_tokens": 16, "temperature": 0.0}
BIG_INT = "1" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(batch_job, "RETRY_FIRST_DELAY_S", 0.001, raising=False)
    monkeypatch.setattr(batch_job, "RETRY_MAX_DELAY_S", 0.002, raising=False)


class Client:
    """Answers "echo <prompt>"; ``script[prompt]``: what the first calls do instead, in
    order (an exception to raise, or a RequestOutput to return)."""

    def __init__(self, script=None):
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.calls = []

    async def complete(self, request):
        self.calls.append((request.prompt, request.request_id))
        todo = self.script.get(request.prompt)
        if todo:
            step = todo.pop(0)
            if isinstance(step, BaseException):
                raise step
            step.request_id = request.request_id
            return step
        return RequestOutput(request.request_id, f"echo {request.prompt}",
                             finish_reason="stop", prompt_tokens=2, completion_tokens=2)


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))


def run(tmp_path, lines, client, *, retry_errors=False):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, lines)
    skip, dropped = batch_job.scan_output(str(out), retry_errors)
    work = batch_job.plan(str(inp), skip)
    with open(out, "a") as f:
        counts = asyncio.run(batch_job.process(
            batch_job.items(str(inp), work, defaults=DEFAULTS, default_grammar=None,
                            run_tag="t"), client, f, concurrency=4))
    batch_job.settle_output(str(out))  # as the job does at its end
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return rows, counts, work, dropped


def died(kind=ErrorKind.WORKER_DIED):
    return RequestOutput("", "", finished=True, finish_reason="error", error_kind=kind,
                         error=f"{kind.value}: the runtime failed")


# ---- lines Python cannot read --------------------------------------------------------------

def test_unreadable_lines_are_their_own_errors_and_the_job_goes_on(tmp_path):
    lines = [{"id": "a", "prompt": "one"},
             '{"id": "big", "prompt": "x", "max_tokens": ' + BIG_INT + "}",
             '{"id": "deep", "prompt": "x", "meta": ' + DEEP + "}",
             '{"id": ' + BIG_INT + ', "prompt": "x"}',
             {"id": "b", "prompt": "two"}]
    rows, counts, work, _ = run(tmp_path, lines, Client())
    assert work.todo == [1, 2, 3, 4, 5]
    assert [r["id"] for r in rows] == ["a", 2, 3, 4, "b"]
    assert "not valid JSON" in rows[1]["error"] and "4300" in rows[1]["error"]
    assert "nested too deeply" in rows[2]["error"]
    assert "not valid JSON" in rows[3]["error"]
    assert rows[4]["text"] == "echo two" and counts == batch_job.BatchCounts(done=5, errors=3)
    assert all(r["error_kind"] == "bad_request" and "transient" not in r for r in rows[1:4])
    # a resume skips them (the line is wrong, not the runtime) and plans nothing
    rows, counts, work, _ = run(tmp_path, lines, Client())
    assert work.todo == [] and work.skipped == 5 and len(rows) == 5


def test_plan_survives_unreadable_output_rows(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": ' + BIG_INT + '}\n' + DEEP + "\n" + '{"id": "a", "text": "x"}\n')
    skip, dropped = batch_job.scan_output(str(out), retry_errors=True)
    assert skip == {batch_job.id_key("a")} and dropped == 0


# ---- transient failures --------------------------------------------------------------------

@pytest.mark.parametrize("failure", [
    pytest.param(NoWorkers("every worker is restarting"), id="no-workers"),
    pytest.param(GrammarUnavailable("the grammar cache is down"), id="cache-down"),
    pytest.param(ActorDiedError(), id="actor-died"),
    pytest.param(TimeoutError("the call timed out"), id="timeout"),
    pytest.param(died(), id="worker-died-chunk"),
    pytest.param(died(ErrorKind.GRAMMAR_UNAVAILABLE), id="grammar-unavailable-chunk"),
])
def test_transient_failure_is_retried(tmp_path, failure):
    client = Client({"flaky": [failure, failure]})
    rows, counts, _, _ = run(tmp_path, [{"id": "f", "prompt": "flaky"}], client)
    assert rows == [{"id": "f", "line": 1, "text": "echo flaky", "finish_reason": "stop",
                     "usage": {"prompt_tokens": 2, "cached_tokens": 0,
                               "completion_tokens": 2},
                     "max_tokens": 16, "outcome": "valid"}]
    ids = [rid for _, rid in client.calls]
    assert ids == ["batch-t-1", "batch-t-1-r1", "batch-t-1-r2"]  # each try its own id


def test_lasting_transient_failure_is_redone_by_a_resume(tmp_path):
    lines = [{"id": "ok", "prompt": "fine"}, {"id": "f", "prompt": "flaky"},
             {"id": "bad", "prompt": "refused"}]
    client = Client({"flaky": [died()] * batch_job.RETRY_ATTEMPTS,
                     "refused": [GrammarError("invalid json_schema grammar: nope")]})
    rows, counts, _, _ = run(tmp_path, lines, client)
    assert len([c for c in client.calls if c[0] == "flaky"]) == batch_job.RETRY_ATTEMPTS
    assert len([c for c in client.calls if c[0] == "refused"]) == 1  # the line's fault
    assert rows[1]["transient"] is True and rows[1]["error_kind"] == "worker_died"
    assert "transient" not in rows[2] and "invalid json_schema" in rows[2]["error"]
    assert rows[2]["error_kind"] == "invalid_grammar"
    assert counts == batch_job.BatchCounts(done=3, errors=2, transient=1)
    # a plain resume (no --retry-errors) runs the transient line again, once in the file
    client = Client()
    rows, counts, work, dropped = run(tmp_path, lines, client)
    assert dropped == 1 and work.skipped == 2 and [c[0] for c in client.calls] == ["flaky"]
    assert [r["id"] for r in rows] == ["ok", "bad", "f"]
    assert rows[2]["text"] == "echo flaky" and "error" not in rows[2]


def test_transient_kind():
    assert batch_job.transient_kind(NoWorkers("x")) == ErrorKind.NO_WORKERS
    assert batch_job.transient_kind(GrammarUnavailable("x", ErrorKind.OVERLOADED)) == \
        ErrorKind.OVERLOADED
    assert batch_job.transient_kind(ConnectionError("x")) == ErrorKind.WORKER_DIED

    class Remote(Exception):  # a RayTaskError carries the remote exception as ``cause``
        pass

    err = Remote("remote")
    err.cause = NoWorkers("inside")
    assert batch_job.transient_kind(err) == ErrorKind.NO_WORKERS
    for permanent in (ValueError("bad"), GrammarError("bad"), KeyError("bug"), Remote("bug")):
        assert batch_job.transient_kind(permanent) is None


# ---- the output's lock ---------------------------------------------------------------------

def test_second_run_on_the_same_output_is_refused(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": "a", "prompt": "x"}])
    out.write_text('{"id": "a", "text": "done"}\n')
    args = ["--input", str(inp), "--output", str(out)]
    holder = subprocess.Popen(  # another process holds the lock, as a running job does
        [sys.executable, "-c", "import sys; from deploy import batch_job; "
         f"batch_job.lock_output({str(out)!r}); print('locked', flush=True); "
         "sys.stdin.read()"], cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert batch_job.main(args) == 2
        err = capsys.readouterr().err
        assert f"--output {out} is in use by another batch job (pid {holder.pid}" in err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert batch_job.main(args) == 0  # released: the run goes on (nothing left to do)
    assert "done=0 skipped=1" in capsys.readouterr().out
    assert not os.path.exists(f"{out}.lock")  # a finished run leaves no lock file


def test_lock_is_exclusive_in_one_process_too(tmp_path):
    path = str(tmp_path / "out.jsonl")
    fd = batch_job.lock_output(path)
    with pytest.raises(ValueError, match="in use by another batch job"):
        batch_job.lock_output(path)
    batch_job.unlock_output(path, fd)
    batch_job.unlock_output(path, batch_job.lock_output(path))


# ---- the job's own runtime -----------------------------------------------------------------

class FakeCluster:
    """launch.handles / launch.up, the claim and Ray's actor listing, in memory."""

    def __init__(self, claims):
        self.claims = list(claims)  # runtime_claim_owner()'s answers, then None
        self.actors = set()
        self.claimed = []

    def owner(self):
        return self.claims.pop(0) if self.claims else None

    def handles(self):
        if "rayguide_scheduler" not in self.actors:
            raise ValueError("no rayguide runtime on this cluster; start one with "
                             "`rayguide up`")
        return {"scheduler": "s", "cache": "c", "workers": ["w0"]}

    def up(self, config):
        self.actors |= {"rayguide_scheduler", "rayguide_grammar_cache", "rayguide_worker_0"}
        return self.handles()

    def claim(self, me):
        self.claimed.append(me)
        self.actors.add(batch_job.RUNTIME_CLAIM)
        return True

    def listing(self, all_namespaces=False):
        return [{"name": n, "namespace": "rayguide"} for n in self.actors]


@pytest.fixture
def cluster(monkeypatch):
    import ray

    from cluster import launch

    fake = FakeCluster(["job-1 (pid 1 on h)", "job-1 (pid 1 on h)"])
    monkeypatch.setattr(batch_job, "_connect", lambda address: None)
    monkeypatch.setattr(batch_job, "job_label", lambda: "job-2")
    monkeypatch.setattr(batch_job, "runtime_claim_owner", fake.owner)
    monkeypatch.setattr(batch_job, "claim_runtime", fake.claim)
    monkeypatch.setattr(launch, "handles", fake.handles)
    monkeypatch.setattr(launch, "up", fake.up)
    monkeypatch.setattr(ray.util, "list_named_actors", fake.listing)
    return fake


ARGS = types.SimpleNamespace(address=None, model=None, workers=1, config=None)


def test_job_waits_for_another_jobs_runtime_then_claims_its_own(cluster, capsys):
    handles, owned = batch_job.acquire_runtime(ARGS, poll_s=0.001)
    assert not cluster.claims and cluster.claimed == ["job-2"]
    assert "belongs to batch job job-1 (pid 1 on h) and ends with it; waiting" in \
        capsys.readouterr().err
    # its own actors, the claim last (released after them)
    assert owned == ["rayguide_grammar_cache", "rayguide_scheduler", "rayguide_worker_0",
                     batch_job.RUNTIME_CLAIM]


@pytest.mark.parametrize("claims", [
    pytest.param(["job-1"] * 3, id="claimed"),
    pytest.param([None, "job-3"], id="claimed-between-look-and-use"),
])
def test_job_never_uses_a_runtime_another_job_claimed(cluster, claims):
    cluster.up(None)  # a runtime is up; another job claims it for a while, then ends
    cluster.claims = list(claims)
    handles, owned = batch_job.acquire_runtime(ARGS, poll_s=0.001)
    assert not cluster.claims  # used only once no job claimed it: nothing of its own
    assert owned == [] and cluster.claimed == []
