"""The engine's step knows the guided path only through its hooks (issue 40): how a guided
output ends (closing, the loop guard, jump-forward, validation), a reasoning model's
thought and the grammar libraries live in worker/guided, and worker/engine/engine.py
reaches them through ``GuidedPath`` / ``GuidedRequest`` (worker/guided/request.py) and
the manager the mask stage reads. Checked on the module's syntax: what it imports from the
guided package, and which of the guided path's names it touches."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "worker" / "engine" / "engine.py"
# what the engine may import of the guided package: the hooks, and the manager (masks)
ALLOWED_IMPORTS = {"worker.guided.request", "worker.guided.guided_process"}
# names of the guided path's inside: an attribute or a name the engine must not use
INSIDE = {"policy", "thinking", "thinking_now", "ending", "closer", "jumper", "reasoning_markers",
          "matchers", "add_matcher", "remove_matcher", "new_matcher", "begin_answer",
          "after_token", "OutputPolicy", "OutputState", "Thinking", "JumpForward",
          "GrammarStopCheck", "xgrammar", "xgr", "llguidance", "not_checked"}


def leaks(source: str) -> list[str]:
    """The guided imports and inside names ``source`` uses, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("worker.guided"):
            if node.module not in ALLOWED_IMPORTS:
                found.append(f"{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in INSIDE or a.name.startswith("worker.guided")]
        elif isinstance(node, ast.Attribute) and node.attr in INSIDE:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in INSIDE:
            found.append(f"{node.lineno}: {node.id}")
    return found


def test_the_engine_reaches_the_guided_path_through_its_hooks():
    assert leaks(ENGINE.read_text()) == []


def test_a_leak_is_caught():
    # the check would pass on nothing: each form of leak is found
    code = ("from worker.guided.output_policy import OutputPolicy\n"
            "import xgrammar as xgr\n"
            "if seq.thinking_now:\n    self.policy.after_token(seq)\n")
    assert leaks(code) == ["1: imports worker.guided.output_policy", "2: imports xgrammar",
                           "3: .thinking_now", "4: .after_token", "4: .policy"]
