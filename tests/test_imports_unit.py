"""Modules that processes without an engine import stay light: Ray imports a worker actor's
module wherever one of its handles is unpickled (the scheduler, every front end), and the
scheduler restarts and front ends start in the time their imports take. Each module is
imported in a fresh interpreter and must not pull in torch, transformers or xgrammar."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "xgrammar")
LIGHT = ["worker.actor", "cluster.client", "scheduler.actor", "worker.engine.params",
         "worker.engine.sequence", "grammar_cache.actor", "cluster.launch", "deploy.service",
         "deploy.serve_app", "cli.main"]


@pytest.mark.parametrize("module", LIGHT)
def test_module_imports_no_engine(module):
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"
