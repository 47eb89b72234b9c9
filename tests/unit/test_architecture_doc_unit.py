"""docs/architecture.md names only what exists: every backticked file path is a file of the
repository, and every backticked name that reads as code (dotted, or called) is in its
Python sources. A renamed function or a deleted file then fails here, not in a reader's
head."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache"}

PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*\.(?:py|md|yaml|yml)$")
# `a.b.c`, `f()`, `f(x, y=1)`, `A.b(...)`: a dotted name or a call
CODE = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?$")
# a bare name that can only be code: snake_case with an underscore, or CamelCase
WORD = re.compile(r"^(?:_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+|_?[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)$")


def _repo_files() -> list[Path]:
    """The repository's files, this test's own aside (it spells made-up names)."""
    out = []
    for path in ROOT.rglob("*"):
        if (path.is_file() and path != Path(__file__).resolve()
                and not SKIP_DIRS.intersection(path.relative_to(ROOT).parts)):
            out.append(path)
    return out


def _tokens(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _path_exists(token: str, files: list[Path]) -> bool:
    """A path with a folder is relative to the repository root (or to docs/); a bare file
    name must name some file of the repository."""
    if "/" in token:
        return (ROOT / token).is_file() or (DOC.parent / token).is_file()
    return any(f.name == token for f in files)


def _code_names(text: str) -> list[str]:
    """The backticked dotted or called names, as bare dotted names."""
    names = []
    for token in _tokens(text):
        if PATH.match(token):
            continue
        m = CODE.match(token)
        if m and ("." in m.group(1) or m.group(2) is not None):
            names.append(m.group(1))
    return names


def _code_words(text: str) -> list[str]:
    """The backticked bare names that read as code (``max_num_seqs``, ``SessionKV``)."""
    return [t for t in _tokens(text) if WORD.match(t)]


def _known(name: str, source: str, modules: set[str]) -> bool:
    """Found by plain text search: the dotted name as written, or each of its parts as a
    word with the last one defined (a def, a class, a field, an assignment, a keyword
    argument or a module)."""
    if name in source:
        return True
    parts = name.split(".")
    if not all(re.search(rf"\b{re.escape(p)}\b", source) for p in parts):
        return False
    last = re.escape(parts[-1])
    return parts[-1] in modules or re.search(
        rf"(?:\bdef|\bclass)\s+{last}\b|\b{last}\s*(?::[^\n=]*)?=|^\s*{last}\s*:",
        source, re.M) is not None


def _problems(text: str, files: list[Path]) -> list[str]:
    py = [f for f in files if f.suffix == ".py"]
    source = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in py)
    modules = {f.stem for f in py} | {f.parent.name for f in py}
    bad = [f"missing file: {t}" for t in _tokens(text)
           if PATH.match(t) and not _path_exists(t, files)]
    bad += [f"unknown name: {n}" for n in _code_names(text) if not _known(n, source, modules)]
    bad += [f"unknown name: {w}" for w in _code_words(text)
            if not re.search(rf"\b{re.escape(w)}\b", source)]
    return bad


@pytest.fixture(scope="module")
def files() -> list[Path]:
    return _repo_files()


def test_architecture_doc_names_only_what_exists(files):
    assert _problems(DOC.read_text(encoding="utf-8"), files) == []


@pytest.mark.parametrize("token", ["`worker/engine/no_such_stage.py`", "`RoutingTable.route_by_mood`",
                                   "`auto_engine_v9()`", "`no_such_module.percentile`",
                                   "`max_moods_per_step`", "`MoodTable`"])
def test_a_made_up_name_is_caught(files, token):
    assert _problems(f"The path: {token}.", files)


@pytest.mark.parametrize("token", ["`worker/guided/closing.py`", "`closing.py`",
                                   "`RoutingTable.route`", "`auto_backend()`",
                                   "`get(spec, fp, lease=True)`", "`engine: {jump_forward: false}`",
                                   "`max_num_seqs`", "`SessionKV`", "`auto`", "`[B, V]`"])
def test_a_real_name_passes(files, token):
    assert _problems(f"The path: {token}.", files) == []
