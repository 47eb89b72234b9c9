"""A sequence's tokens change in one place (issue 40): ``Sequence.append`` and
``Sequence.rollback`` (and ``release_held`` for what the stream takes), so the tokens and
the logprobs held for the stream can never part. Checked by parsing every module of the
worker: no other module mutates ``token_ids`` or ``held_logprobs``; and the methods
themselves keep the two in step."""

import ast
from pathlib import Path

import pytest
import torch

from core.params import SamplingParams
from core.request import GenerationRequest
from worker.engine.sequence import Sequence

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"token_ids", "held_logprobs"}
MUTATORS = {"append", "extend", "pop", "insert", "clear", "remove", "sort", "reverse"}


def _edits(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in FIELDS):
            lines.append(node.lineno)
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if isinstance(t, ast.Subscript):
                t = t.value
            if (isinstance(t, ast.Attribute) and t.attr in FIELDS
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                lines.append(node.lineno)
    return lines


def test_only_the_sequence_edits_its_tokens():
    found = {}
    for path in sorted((ROOT / "worker").rglob("*.py")):
        if path.name == "sequence.py":
            continue
        lines = _edits(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"token edits outside Sequence.append / rollback: {found}"


def test_the_check_finds_an_edit():
    # the check above would pass on nothing: it finds each form of edit
    code = ("seq.token_ids.append(1)\nseq.held_logprobs.extend([])\n"
            "del seq.token_ids[-2:]\nseq.held_logprobs[-1:] = [None]\nseq.token_ids += [3]\n")
    assert sorted(_edits(ast.parse(code))) == [1, 2, 3, 4, 5]


def _seq() -> Sequence:
    req = GenerationRequest(request_id="r", prompt="", params=SamplingParams(max_new_tokens=8))
    return Sequence(req, [1, 2, 3], detokenizer=None, generator=torch.Generator())


def test_append_and_rollback_keep_tokens_and_logprobs_in_step():
    seq = _seq()
    seq.num_computed = 3
    seq.append([10], [-0.5])
    seq.append([11, 12])  # forced: no logprobs
    assert seq.output_ids == [10, 11, 12] and seq.held_logprobs == [-0.5, None, None]
    seq.num_computed = 6
    seq.rollback(2)
    assert seq.output_ids == [10] and seq.held_logprobs == [-0.5]
    assert seq.num_computed == 4  # the KV of the removed tokens is computed again
    assert seq.release_held(1) == [-0.5] and seq.held_logprobs == []
    with pytest.raises(AssertionError):
        seq.rollback(1)  # streamed already: a rollback may not take it back
    seq.append([7, 8], streamed=True)  # a failover's resumed output: not held
    assert seq.output_ids == [10, 7, 8] and seq.held_logprobs == []
