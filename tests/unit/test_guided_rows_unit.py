"""The guided path sees the engine's rows and config through its own protocols
(worker/guided/rows.py: ``GuidedRow``, ``GuidedConfig``), so that it imports nothing of the
engine (tests/unit/test_layers_unit.py). Both sides are checked here: the engine's
``Sequence`` and ``EngineConfig`` have every member the protocols name, and the guided
modules that take rows and the config (parsed: request.py, output_policy.py) read no
member the protocols leave out."""

import ast
from pathlib import Path

import pytest
import torch

from core.params import SamplingParams
from core.request import GenerationRequest
from worker.engine.config import EngineConfig
from worker.engine.sequence import Sequence
from worker.guided.rows import GuidedConfig, GuidedRow

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# the guided modules handed rows (``seq``, ``self.seq``) and the config (``config``,
# ``cfg``, ``self.config``, ``path.config``)
READERS = ("worker/guided/request.py", "worker/guided/output_policy.py")


def members(protocol: type) -> set[str]:
    """What a protocol names: its annotated attributes, properties and methods."""
    return set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}


def _is_row(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "seq")
            or (isinstance(node, ast.Attribute) and node.attr == "seq"))


def _is_config(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Name) and node.id in ("config", "cfg"))
            or (isinstance(node, ast.Attribute) and node.attr == "config"))


def read_members(source: str) -> tuple[set[str], set[str]]:
    """The members read or written off a row and off the config in ``source``."""
    row, config = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if _is_row(node.value):
                row.add(node.attr)
            elif _is_config(node.value):
                config.add(node.attr)
    return row, config


def _seq() -> Sequence:
    req = GenerationRequest(request_id="r", prompt="", params=SamplingParams(max_new_tokens=8))
    return Sequence(req, [1, 2, 3], detokenizer=None, generator=torch.Generator())


def test_the_engine_sequence_is_a_guided_row():
    seq = _seq()
    assert isinstance(seq, GuidedRow)
    assert [m for m in sorted(members(GuidedRow)) if not hasattr(seq, m)] == []


def test_the_engine_config_is_a_guided_config():
    config = EngineConfig()
    assert isinstance(config, GuidedConfig)
    assert [m for m in sorted(members(GuidedConfig)) if not hasattr(config, m)] == []


def test_the_guided_path_reads_only_what_the_protocols_name():
    row, config = set(), set()
    for file in READERS:
        r, c = read_members((ROOT / file).read_text(encoding="utf-8"))
        row |= r
        config |= c
    assert row and config  # the parse sees the reads (a renamed variable would hide them)
    assert sorted(row - members(GuidedRow)) == []
    assert sorted(config - members(GuidedConfig)) == []


def test_a_read_the_protocols_leave_out_is_caught():
    row, config = read_members("seq.num_computed\nself.seq.block_table = []\n"
                               "self.path.config.max_model_len\ncfg.kv_cache_gb\n")
    assert row - members(GuidedRow) == {"num_computed", "block_table"}
    assert config - members(GuidedConfig) == {"max_model_len", "kv_cache_gb"}
