"""The batch job's resume never loses a row (deploy/batch_output.py), without Ray: a fake
runtime stands in for the cluster, in this process or in a child the test kills.

- duplicate ids are refused at input, naming their lines (they took each other's rows);
- a half-written last line is cut off before anything is appended;
- a --retry-failed that cannot reach the runtime leaves the output as it was;
- a --retry-failed killed (SIGKILL) at a random row, then resumed, ends with one row per
  input id, no valid row lost, and the attempts it made counted.
"""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.request import RequestOutput
from deploy import batch_job
from deploy.batch_account import attempts_of

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def answer(request) -> RequestOutput:
    """``long``: runs to any budget under 100 tokens; ``broken``: the runtime fails;
    anything else: a valid answer."""
    p = request.params
    if request.prompt == "long" and p.max_new_tokens < 100:
        return RequestOutput(request.request_id, '{"a": 1}', finish_reason="length",
                             completion_tokens=p.max_new_tokens, grammar_engine="xgrammar")
    if request.prompt == "broken":
        return RequestOutput(request.request_id, "", finish_reason="error",
                             error_kind="internal", error="model step failed")
    return RequestOutput(request.request_id, '{"a": 1}', finish_reason="stop",
                         completion_tokens=5, grammar_engine="xgrammar", validation="valid")


class Client:
    def __init__(self):
        self.calls = []

    async def complete(self, request):
        await asyncio.sleep(0)
        self.calls.append((request.prompt, request.params.max_new_tokens))
        return answer(request)


def fake_runtime(monkeypatch, client):
    import cluster.client
    monkeypatch.setattr(batch_job, "acquire_runtime", lambda args: ({"scheduler": None}, []))
    monkeypatch.setattr(cluster.client, "RuntimeClient", lambda scheduler: client)


def write_input(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))


def rows_of(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def job(inp, out, *flags):
    return batch_job.main(["--input", str(inp), "--output", str(out), "--quiet",
                           "--concurrency", "4", "--max-tokens", "32", *flags])


# ---- duplicate ids ---------------------------------------------------------------------

def test_duplicate_ids_are_refused_naming_their_lines(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"},
                      {"id": 2, "prompt": "w"}, {"id": "b", "prompt": "v"}])
    with pytest.raises(ValueError, match=r'id "a" on lines 1, 3; id 2 on lines 2, 4\)'):
        batch_job.plan(str(inp), set())
    assert job(inp, out) == 2  # before any runtime is looked for
    err = capsys.readouterr().err
    assert "2 ids are on more than one line" in err and "give each line its own id" in err
    assert not out.exists()


def test_a_duplicate_cannot_hide_a_line_from_a_resume(tmp_path, monkeypatch):
    """Before: the duplicate's error row kept the id in the skip set, and the line whose
    row --retry-errors dropped never ran again. Now the input is refused until fixed, and
    the fixed input's lines each get their row."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    fake_runtime(monkeypatch, Client())
    write_input(inp, [{"id": "a", "prompt": "broken"}, {"id": "a", "prompt": "ok"}])
    assert job(inp, out) == 2 and not out.exists()
    write_input(inp, [{"id": "a", "prompt": "broken"}, {"id": "b", "prompt": "ok"}])
    assert job(inp, out) == 0
    write_input(inp, [{"id": "a", "prompt": "fixed"}, {"id": "b", "prompt": "ok"}])
    assert job(inp, out, "--retry-errors") == 0
    assert sorted((r["id"], r["outcome"]) for r in rows_of(out)) == [("a", "valid"),
                                                                      ("b", "valid")]


# ---- a half-written last line ------------------------------------------------------------

@pytest.mark.parametrize("tail", ['{"id": "c", "line": 3, "te', '{"id": "c", "line": 3}'],
                         ids=["cut-mid-row", "no-newline"])
def test_a_half_written_last_line_is_cut_off_first(tmp_path, monkeypatch, capsys, tail):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, [{"id": k, "prompt": "ok"} for k in "abc"])
    fake_runtime(monkeypatch, Client())
    assert job(inp, out) == 0
    whole = out.read_text().splitlines(keepends=True)
    out.write_text("".join(whole[:2]) + tail)  # killed while writing row 3
    skip, again = batch_job.scan_output(str(out), False)
    assert "cutting a half-written last line off" in capsys.readouterr().err
    assert out.read_text() == "".join(whole[:2])  # cut at the last newline, nothing else
    assert skip == {batch_job.id_key("a"), batch_job.id_key("b")} and again == 0
    client = Client()
    fake_runtime(monkeypatch, client)
    assert job(inp, out) == 0
    assert client.calls == [("ok", 32)]  # line c, once
    assert [r["id"] for r in rows_of(out)] == ["a", "b", "c"]


# ---- durability ------------------------------------------------------------------------

LINES = ([{"id": f"ok{i}", "prompt": "ok", "schema": SCHEMA} for i in range(8)]
         + [{"id": f"long{i}", "prompt": "long", "schema": SCHEMA} for i in range(6)]
         + [{"id": f"broken{i}", "prompt": "broken"} for i in range(3)])


def test_an_unreachable_runtime_leaves_the_output_as_it_was(tmp_path, monkeypatch, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, LINES)
    fake_runtime(monkeypatch, Client())
    assert job(inp, out) == 0
    before = out.read_bytes()

    def unreachable(args):
        raise ConnectionError("no Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(batch_job, "acquire_runtime", unreachable)
    assert job(inp, out, "--retry-failed") == 1
    assert "no Ray cluster" in capsys.readouterr().err
    assert out.read_bytes() == before  # the rows to redo are still there
    client = Client()
    fake_runtime(monkeypatch, client)
    assert job(inp, out, "--retry-failed") == 0
    assert sorted(set(client.calls)) == [("broken", 32), ("long", 64)]
    rows = rows_of(out)
    assert len(rows) == len(LINES) and {r["attempt"] for r in rows if "attempt" in r} == {2}


CHILD = r"""
import asyncio, os, signal, sys
import cluster.client
from deploy import batch_job
from deploy.batch_output import row_text
from tests.serve.test_batch_resume_unit import answer

mode, kill_at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
seen = {"calls": 0, "rows": 0}


class Client:
    async def complete(self, request):
        await asyncio.sleep(0)
        seen["calls"] += 1
        if mode == "call" and seen["calls"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return answer(request)


write_row = batch_job.write_row


def write_or_die(out, row):
    seen["rows"] += 1
    if mode == "write" and seen["rows"] == kill_at:  # killed in the middle of a row
        text = row_text(row)
        out.write(text[:len(text) // 2])
        out.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    write_row(out, row)


batch_job.acquire_runtime = lambda args: ({"scheduler": None}, [])
cluster.client.RuntimeClient = lambda scheduler: Client()
batch_job.write_row = write_or_die
sys.exit(batch_job.main(argv))
"""


@pytest.mark.parametrize("mode,seed", [("call", 1), ("write", 2), ("call", 3)])
def test_retry_failed_killed_at_a_random_row_then_resumed_loses_nothing(
        tmp_path, monkeypatch, mode, seed):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, LINES)
    fake_runtime(monkeypatch, Client())
    assert job(inp, out) == 0
    valid_before = {r["id"] for r in rows_of(out) if r["outcome"] == "valid"}
    assert len(valid_before) == 8
    kill_at = random.Random(seed).randint(1, 9)  # 9 lines to retry: 6 long, 3 broken
    child = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(kill_at), "--input", str(inp), "--output",
         str(out), "--quiet", "--concurrency", "2", "--max-tokens", "32", "--retry-failed"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    # nothing was removed before its replacement was written: every line has its row, and
    # the lines the dead run retried have two (the one retried, its retry)
    written = []
    for x in out.read_text().splitlines():
        try:
            written.append(json.loads(x)["id"])
        except ValueError:
            pass  # the row it was killed writing
    assert set(written) >= {x["id"] for x in LINES}
    retried = {i for i in written if written.count(i) == 2}
    client = Client()
    fake_runtime(monkeypatch, client)
    assert job(inp, out, "--retry-failed") == 0  # the dead run's lock file is no obstacle
    rows = rows_of(out)
    assert sorted(r["id"] for r in rows) == sorted(x["id"] for x in LINES)  # one row each
    assert valid_before <= {r["id"] for r in rows if r["outcome"] == "valid"}
    # the dead run's attempts count: what it retried goes on from there (a long line
    # with four times its budget: valid), the rest has its first retry
    for r in rows:
        if r["id"].startswith(("long", "broken")):
            assert attempts_of(r) == (3 if r["id"] in retried else 2), r
        if r["id"].startswith("long"):
            assert r["outcome"] == ("valid" if r["id"] in retried else "closed_at_budget"), r
