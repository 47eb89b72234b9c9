"""A grammar compile nobody waits for stops, on a real engine (issue 39, part 4): an
engine without the shared grammar cache compiles xgrammar in its own killable child
process; a request whose grammar is not ready within ``grammar_timeout_s`` fails with a
503-kind error naming the grammar, its compile is stopped, and a later request with an
easy grammar is answered (a hostile compile would otherwise hold the only compile
process until it ended on its own). The hostile compile is a compile process that hangs
on one grammar (as a compile of tens of minutes would), so the test does not depend on
how slow a real grammar is on this machine."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from grammar_cache.compile_pool import CompilePool
from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the real compile process, except that it never finishes a grammar naming HANG
HANGING_ON_HANG = textwrap.dedent("""
    import time
    from grammar_cache import compile_worker
    read = compile_worker.read_frame
    def read_frame(stream):
        frame = read(stream)
        if frame is not None and b"HANG" in frame:
            time.sleep(3600)
        return frame
    compile_worker.read_frame = read_frame
    compile_worker.main()
""")


@pytest.fixture
def engine(tiny_model_dir, monkeypatch):
    def popen(self):
        return subprocess.Popen(
            [sys.executable, "-c", HANGING_ON_HANG, "--memory-mb",
             str(self.config.compile_memory_mb), "--parent-pid", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT))
    monkeypatch.setattr(CompilePool, "_popen", popen)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), progress=False,
                                    num_kv_blocks=64, grammar_timeout_s=3.0,
                                    grammar_compile_processes=1),
                       grammar_limits=GrammarCacheConfig(compile_timeout_s=300))
    yield engine
    engine.guided.shutdown()


def run(engine, request: GenerationRequest):
    out = engine.generate([request])[request.request_id]
    return out


def test_a_hostile_compile_is_stopped_when_its_request_gives_up(engine):
    pool = engine.guided.compile_pool
    assert pool is not None  # compiles go to the engine's own child process
    hostile = GenerationRequest("x", SamplingParams(max_new_tokens=4, temperature=0.0),
                                grammar=GrammarSpec.regex("HANG[ab]+", engine="xgrammar"))
    t = time.monotonic()
    out = run(engine, hostile)
    assert out.finish_reason == "error" and out.error_kind == ErrorKind.GRAMMAR_UNAVAILABLE
    assert "regex grammar was not ready within 3 s" in out.error
    assert time.monotonic() - t < 30  # generous: the wait is 3 s
    deadline = time.monotonic() + 10
    while pool.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.cancelled == 1 and engine.guided.stats.cancelled == 1
    # the only compile process is free again: an easy grammar is answered (its wait is
    # long enough for a fresh process's imports; before, it waited for the hang)
    engine.config.grammar_timeout_s = 60.0
    easy = GenerationRequest("x", SamplingParams(max_new_tokens=8, temperature=0.0),
                             grammar=GrammarSpec.regex("[ab]{3}", engine="xgrammar"))
    t = time.monotonic()
    out = run(engine, easy)
    assert out.finish_reason == "stop", out.error
    assert len(out.text) == 3 and set(out.text) <= set("ab")
    print(f"\neasy grammar after the hostile one answered in {time.monotonic() - t:.1f} s")
