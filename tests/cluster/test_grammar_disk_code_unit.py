"""The grammar disk tier's folder carries a digest of our own code that writes grammars
(grammar_cache/code_digest.py): a grammar compiled by other code (a change to the schema
rewrites, the format patterns, the envelope) is never loaded, with no version to bump."""

import shutil

import pytest

from grammar_cache import code_digest, disk, envelope
from grammar_cache.disk import DiskStore

pytestmark = pytest.mark.unit


def test_the_digest_covers_every_module_that_writes_grammars():
    names = set(code_digest.grammar_writer_sources())
    # the compile and what it imports of ours (found by reading imports, not listed)
    assert {"grammar_cache.compile", "grammar_cache.format_patterns", "grammar_cache.envelope",
            "core.json_schema", "core.grammar_spec"} <= names
    assert not any(n.startswith(("xgrammar", "json", "re")) for n in names)  # ours only


def _copy_writers(dst):
    for name in code_digest.grammar_writer_sources():
        src = code_digest.module_file(name)
        target = dst / src.relative_to(code_digest.ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, target)


def test_a_change_to_a_rewrite_changes_the_digest(tmp_path):
    _copy_writers(tmp_path)
    before = code_digest.code_digest(root=tmp_path)
    assert before == code_digest.code_digest()  # the copy is the same code
    patterns = tmp_path / "grammar_cache" / "format_patterns.py"
    patterns.write_text(patterns.read_text() + "\n# a rewrite changed\n")
    assert code_digest.code_digest(root=tmp_path) != before
    # a module the compile starts to import is covered too, with no list to update
    (tmp_path / "core" / "new_rewrite.py").write_text("RULE = 1\n")
    compile_py = tmp_path / "grammar_cache" / "compile.py"
    compile_py.write_text("from core.new_rewrite import RULE\n" + compile_py.read_text())
    assert "core.new_rewrite" in code_digest.grammar_writer_sources(root=tmp_path)


def test_a_grammar_written_by_other_code_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(envelope, "serialization_version", lambda: 1)  # no xgrammar import
    monkeypatch.setattr(disk, "grammar_code_digest", lambda: "old-code")
    old = DiskStore(tmp_path)
    assert old.put("fp", "k", b"compiled by the old rewrites")
    monkeypatch.setattr(disk, "grammar_code_digest", lambda: "new-code")
    new = DiskStore(tmp_path)
    assert new.get("fp", "k") is None  # compiled again, never served stale
    assert new.root.name.endswith("-cnew-code") and new.root != old.root
    assert DiskStore(tmp_path).get("fp", "k") is None
    monkeypatch.setattr(disk, "grammar_code_digest", lambda: "old-code")
    assert DiskStore(tmp_path).get("fp", "k") == b"compiled by the old rewrites"
