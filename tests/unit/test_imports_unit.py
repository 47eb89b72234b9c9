"""Modules that processes without an engine import stay light: Ray imports a worker actor's
module wherever one of its handles is unpickled (the scheduler, every front end), and the
scheduler restarts and front ends start in the time their imports take. Each module is
imported in a fresh interpreter and must not pull in torch, transformers or xgrammar.

And the ``unit`` mark means what it says: every ``tests/**/*_unit.py`` module carries it on
every test, and none starts Ray or a runtime."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
# what starts Ray or a runtime (a unit test may import the ray package, e.g. for its version)
STARTS_RAY = re.compile(r"\bray\.init\(|\bCluster\(|\blaunch\.up\(|\bservice\.start\(|"
                        r"\bray_runtime\b|\bshared_ray\b|\bshared_cluster\b")

HEAVY = ("torch", "transformers", "xgrammar")
LIGHT = ["worker.actor", "cluster.client", "scheduler.actor", "core.params", "core.request",
         "worker.engine.sequence", "grammar_cache.actor", "cluster.launch", "deploy.service",
         "deploy.serve_app", "cli.main", "deploy.data"]


@pytest.mark.parametrize("module", LIGHT)
def test_module_imports_no_engine(module):
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(TESTS.parent))
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_unit_files_are_marked_unit_and_start_no_ray():
    files = sorted(TESTS.rglob("test_*_unit.py"))
    assert len(files) >= 10
    starts = [f.name for f in files if STARTS_RAY.search(f.read_text())]
    assert not starts, f"unit test files that start Ray: {starts}"
    # every test collected from them carries the mark (module-wide or one by one)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", "not unit"]
                         + [str(f) for f in files],
                         capture_output=True, text=True, cwd=str(TESTS.parent))
    unmarked = [ln for ln in out.stdout.splitlines() if "::" in ln]
    assert not unmarked, f"tests in *_unit.py files without the unit mark: {unmarked}"
    assert "deselected" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
