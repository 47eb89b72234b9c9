"""The engine's step knows the guided path only through its hooks (issue 40): how a guided
output ends (closing, the loop guard, jump-forward, validation), a reasoning model's
thought and the grammar libraries live in worker/guided, and worker/engine/engine.py
reaches them through ``GuidedPath`` / ``GuidedRequest`` (worker/guided/request.py) and
the manager the mask stage reads (and builds a plain request's ``IncrementalDetokenizer``,
worker/guided/detokenizer.py). A request's guided state (its thought, the output
policy's state, its compiled grammar and matcher) is its ``GuidedRequest``'s: no module of
worker/engine holds or reads it, and the mask stage gets each row's matcher from the
request's guided part, never by key from the manager (that a sequence's tokens change
through ``Sequence.append`` / ``rollback`` only: test_sequence_edits_unit.py). Checked on
the modules' syntax."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / "worker" / "engine"
ENGINE = ENGINE_DIR / "engine.py"
SEQUENCE = ENGINE_DIR / "sequence.py"
# what the engine may import of the guided package: the hooks, the manager (masks) and the
# detokenizer (a plain request's; binding its stop strings to a grammar is the guided path's)
ALLOWED_IMPORTS = {"worker.guided.request", "worker.guided.guided_process",
                   "worker.guided.detokenizer"}
# a request's guided state: GuidedRequest's fields, never a Sequence's, read by no module
# of worker/engine (``matchers``/``matcher_key``: the manager's old per-key matchers)
GUIDED_STATE = {"thinking", "thinking_now", "guided_now", "ending", "compiled", "matcher",
                "matcher_key", "matchers", "grammar_future", "validation", "loop_guard",
                "thinking_token_budget"}
# names of the guided path's inside: an attribute or a name the engine must not use
INSIDE = GUIDED_STATE - {"grammar_future"} | {
    "policy", "closer", "jumper", "reasoning_markers", "add_matcher", "remove_matcher",
    "new_matcher", "begin_answer", "after_token", "OutputPolicy", "OutputState", "Thinking",
    "JumpForward", "GrammarStopCheck", "xgrammar", "xgr", "llguidance", "not_checked"}


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


def state_reads(source: str) -> list[str]:
    """Where ``source`` reaches a request's guided state other than through its guided
    part (``seq.ending``, ``manager.matchers[key]``; ``seq.guide.grammar_future`` is the
    guided part's own), as ``line: .name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in GUIDED_STATE:
            through_guide = isinstance(node.value, ast.Attribute) and node.value.attr == "guide"
            if not through_guide:
                found.append((node.lineno, node.col_offset, f"{node.lineno}: .{node.attr}"))
    return [what for *_, what in sorted(found)]


def sequence_fields(source: str) -> set[str]:
    """What ``class Sequence`` holds: its ``self.x`` fields and its methods/properties."""
    cls = next(n for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.ClassDef) and n.name == "Sequence")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names


def test_the_engine_reaches_the_guided_path_through_its_hooks():
    assert leaks(ENGINE.read_text()) == []


@pytest.mark.parametrize("module", sorted(p.name for p in ENGINE_DIR.glob("*.py")))
def test_no_engine_module_reads_a_requests_guided_state(module):
    # the scheduler, the sampler and the mask stage included: a row's matcher comes from
    # its guided part (GuidedRequest.mask_matcher), the engine waits on the guided part's
    # grammar future
    assert state_reads((ENGINE_DIR / module).read_text()) == []


def test_a_sequence_holds_no_guided_state():
    fields = sequence_fields(SEQUENCE.read_text())
    assert "guide" in fields and "append" in fields  # (the parse sees the class)
    assert fields & (GUIDED_STATE | {"stop"}) == set()


def test_a_leak_is_caught():
    # the checks would pass on nothing: each form of leak is found
    code = ("from worker.guided.output_policy import OutputPolicy\n"
            "import xgrammar as xgr\n"
            "if seq.thinking_now:\n    self.policy.after_token(seq)\n")
    assert leaks(code) == ["1: imports worker.guided.output_policy", "2: imports xgrammar",
                           "3: .thinking_now", "4: .after_token", "4: .policy"]
    code = ("keys = [s.matcher_key if s.guided_now else None for s in seqs]\n"
            "m = manager.matchers.get(key)\n"
            "f = seq.grammar_future\n"
            "g = seq.guide.grammar_future\n")
    assert state_reads(code) == ["1: .matcher_key", "1: .guided_now", "2: .matchers",
                                 "3: .grammar_future"]
    code = ("class Sequence:\n    def __init__(self):\n        self.ending = None\n"
            "    @property\n    def thinking_now(self):\n        return False\n")
    assert sequence_fields(code) == {"__init__", "ending", "thinking_now"}
