"""The digest of our own code that decides what a grammar compiles to: part of the disk
tier's folder name (grammar_cache/disk.py), so a grammar written by other code is never
loaded.

The disk tier keeps compiled grammars across restarts and upgrades. The xgrammar version,
its serialization version and the tokenizer's fingerprint are in the path, and the spec in
the key; what is not, unless named here, is our own code between the spec and xgrammar
(the schema's rewrites, the format patterns, the EBNF we write for a choice or a number's
digits, the envelope). A change there used to need a hand-bumped ``KEY_VERSION``; one that
forgot it served stale grammars. So the folder carries a hash of the source of
``GRAMMAR_WRITERS`` and of every module of the project they import, found by reading
their imports (``ast``): a module they start to import is covered without a list to keep.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

# the modules that turn a spec into what the disk tier stores: the compile (spec ->
# xgrammar, with its rewrites) and the envelope around xgrammar's serialization
GRAMMAR_WRITERS = ("grammar_cache.compile", "grammar_cache.envelope")
ROOT = Path(__file__).resolve().parents[1]

_digest: str | None = None


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of the project's module ``name`` under ``root``, or None (a third-party
    module, or a name that is an attribute rather than a module)."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(name: str, path: Path, source: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # a submodule
    return found


def grammar_writer_sources(roots=GRAMMAR_WRITERS, root: Path = ROOT) -> dict[str, str]:
    """Module name -> source, for ``roots`` and every project module they import,
    directly or not."""
    sources: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        path = module_file(name, root)
        if name in sources or path is None:
            continue
        sources[name] = path.read_text(encoding="utf-8")
        todo.extend(_imported(name, path, sources[name]))
    return sources


def code_digest(roots=GRAMMAR_WRITERS, root: Path = ROOT) -> str:
    """A short hash of the sources of ``grammar_writer_sources`` (names and texts)."""
    h = hashlib.sha256()
    for name, source in sorted(grammar_writer_sources(roots, root).items()):
        h.update(name.encode() + b"\0" + source.encode() + b"\0")
    return h.hexdigest()[:16]


def grammar_code_digest() -> str:
    """``code_digest()`` of this installation, computed once per process."""
    global _digest
    if _digest is None:
        _digest = code_digest()
    return _digest
