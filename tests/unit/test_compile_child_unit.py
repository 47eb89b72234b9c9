"""A grammar-compile child imports xgrammar's compile API without torch and transformers
(grammar_cache/compile_worker.py ``import_xgrammar``: about 1.9 s of CPU and 150 MB less
per child), and what it compiles is what the plain import compiles."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import xgrammar as xgr

from core.grammar_spec import GrammarSpec
from grammar_cache.compile import compile_spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
VOCAB = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>", b'{"', b'":', b"true", b"  "]

SPECS = [GrammarSpec.json_schema({"type": "object", "properties": {
             "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
             "ok": {"type": "boolean"}}, "required": ["name", "n"]}),
         GrammarSpec.regex(r"[a-z]{2,5}-\d+"),
         GrammarSpec.choice(["yes", "no", "maybe"]),
         GrammarSpec.ebnf('root ::= "a" b*\nb ::= [0-9]'),
         GrammarSpec.json_object()]

CHILD = """
import json, sys
from grammar_cache.compile_worker import import_xgrammar
xgr = import_xgrammar()
from grammar_cache.compile import compile_spec
from core.grammar_spec import GrammarSpec
info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
out = [compile_spec(compiler, GrammarSpec.from_dict(d)).serialize_json()
       for d in json.loads(sys.stdin.readline())]
# a grammar serialized here loads in the same process (the child's trial load)
xgr.CompiledGrammar.deserialize_json(out[0], info)
print(json.dumps({"modules": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                  "version": xgr.get_serialization_version(), "out": out}))
"""


def test_a_compile_child_compiles_as_the_plain_import_without_torch_or_transformers():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[257])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    expected = [compile_spec(compiler, spec).serialize_json() for spec in SPECS]
    stdin = info.serialize_json() + "\n" + json.dumps([s.to_dict() for s in SPECS]) + "\n"
    proc = subprocess.run([sys.executable, "-c", CHILD], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["modules"] == [], "the child imported " + ", ".join(got["modules"])
    assert got["version"] == xgr.get_serialization_version()
    assert got["out"] == expected
    assert not proc.stderr.strip(), proc.stderr[-2000:]  # no warning about a missing torch


def test_a_process_that_has_xgrammar_already_keeps_it():
    from grammar_cache.compile_worker import import_xgrammar

    assert import_xgrammar() is xgr
