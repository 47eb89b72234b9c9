"""The batch job's output under a failing disk and planted links (deploy/batch_job.py),
no Ray.

- a write that fails (a full disk) stops the job at once with a clear error and exit 1;
  it never waits for ever for the row it lost, and the rows before it stay;
- the lock file, the resume's temporary file and the output itself are never opened
  through a symbolic link.
"""

import asyncio
import errno
import json
import os

import pytest

from core.request import RequestOutput
from deploy import batch_job

pytestmark = pytest.mark.unit

DEFAULTS = {"max_new_tokens": 16, "temperature": 0.0}


class Client:
    async def complete(self, request):
        await asyncio.sleep(0)
        return RequestOutput(request.request_id, f"echo {request.prompt}",
                             finish_reason="stop", prompt_tokens=2, completion_tokens=2)


class FullDisk:
    """A text file whose writes fail with ENOSPC after ``room`` rows."""

    def __init__(self, path, room):
        self.f, self.room = open(path, "a", encoding="utf-8"), room

    def write(self, text):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return self.f.write(text)

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()


def write_input(path, n):
    path.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n"
                            for i in range(n)))


@pytest.mark.parametrize("lines", [5, 500])  # fewer than the reorder window, and more
def test_failed_write_stops_the_pipeline(tmp_path, lines):
    inp = tmp_path / "in.jsonl"
    write_input(inp, lines)
    work = batch_job.plan(str(inp), set())
    out = FullDisk(tmp_path / "out.jsonl", room=3)

    async def go():
        # a generous bound: before the fix this waited for ever (500 lines) or ended
        # "successfully" with the lost rows missing (5 lines)
        return await asyncio.wait_for(batch_job.process(
            batch_job.items(str(inp), work, defaults=DEFAULTS, default_grammar=None,
                            run_tag="t"), Client(), out, concurrency=4), timeout=20)

    with pytest.raises(batch_job.OutputWriteError, match="No space left on device"):
        asyncio.run(go())
    out.close()
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2]  # the rows before the failure stay


def test_main_exits_1_naming_the_failed_write(tmp_path, monkeypatch, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 300)
    monkeypatch.setattr(batch_job, "acquire_runtime", lambda args: ({"scheduler": None}, []))
    import cluster.client
    monkeypatch.setattr(cluster.client, "RuntimeClient", lambda scheduler: Client())
    monkeypatch.setattr(batch_job, "open_output", lambda path: FullDisk(path, room=10))
    code = batch_job.main(["--input", str(inp), "--output", str(out), "--quiet",
                           "--concurrency", "4"])
    captured = capsys.readouterr()
    assert code == 1
    assert f"--output {out}: could not write a result" in captured.err
    assert "No space left on device" in captured.err and "run again to resume" in captured.err
    assert "done=10 " in captured.out
    assert not os.path.exists(f"{out}.lock")
    # a resume goes on after the rows that were written
    assert batch_job.scan_output(str(out), False)[0] == {batch_job.id_key(i) for i in range(10)}


# ---- links ------------------------------------------------------------------------------

def test_lock_file_link_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out.jsonl"
    os.symlink(victim, f"{out}.lock")
    with pytest.raises(ValueError, match="symbolic link"):
        batch_job.lock_output(str(out))
    assert victim.read_text() == "precious\n"


def test_resume_rewrite_never_follows_a_planted_temp_link(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    # a retried line's two rows (a run that died before its end): the resume settles them
    out.write_text('{"id": 1, "text": "a"}\n{"id": 2, "error": "x", "transient": true}\n'
                   '{"id": 2, "text": "b"}\n')
    os.chmod(out, 0o640)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    # the old name was the pid's: a link there redirected (and truncated) the rewrite
    me = os.getpid()
    for pid in (me, 4242):
        os.symlink(victim, f"{out}.tmp-{pid}")
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    skip, dropped = batch_job.scan_output(str(out), retry_errors=False)
    assert dropped == 0 and skip == {batch_job.id_key(1), batch_job.id_key(2)}
    assert victim.read_text() == "precious\n"
    assert out.read_text() == '{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n'
    assert os.stat(out).st_mode & 0o777 == 0o640  # the rewrite keeps the output's mode
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out.jsonl", "victim", "out.jsonl.tmp-4242", f"out.jsonl.tmp-{me}"])


def test_output_link_is_refused(tmp_path, capsys):
    inp, real = tmp_path / "in.jsonl", tmp_path / "real.jsonl"
    write_input(inp, 1)
    real.write_text("")
    out = tmp_path / "out.jsonl"
    os.symlink(real, out)
    assert batch_job.main(["--input", str(inp), "--output", str(out), "--quiet"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    with pytest.raises(OSError):
        batch_job.open_output(str(out))
