"""Dependencies point down, never up or sideways. Every module of the runtime is parsed
(``ast``, imports inside functions and ``TYPE_CHECKING`` blocks included) and each import
of another layer must be one its layer may make:

    cli -> deploy -> cluster -> scheduler / worker / grammar_cache -> core

with ``worker -> grammar_cache`` (the worker's cache client) and, inside the worker,
``worker/actor.py -> worker/engine -> worker/guided, worker/models`` (worker/guided: the
guided path: grammar backends, output policy, reasoning, the detokenizer). core imports
no other layer. ``EXCEPTIONS`` would name an import allowed against the rule: there is
none. The guided path imports nothing of the engine (not even for a type annotation:
test_the_guided_path_imports_nothing_of_the_engine): it sees the engine's ``Sequence``
and ``EngineConfig`` through its own protocols (worker/guided/rows.py ``GuidedRow``,
``GuidedConfig``; tests/unit/test_guided_rows_unit.py checks both sides of them).
The engine (worker/engine, worker/models) imports no Ray and no HTTP library, neither
itself nor through a module of the project it imports; core imports nothing heavy
(it is unpickled in every process: front ends, the scheduler, the workers)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# most specific first: a module belongs to the first layer its name starts with
LAYERS = ("worker.engine", "worker.guided", "worker.models", "worker", "core", "grammar_cache", "scheduler",
          "cluster", "deploy", "cli")
MAY_IMPORT = {
    "core": set(),
    "grammar_cache": {"core"},
    "scheduler": {"core"},
    "worker.models": {"core", "grammar_cache"},
    "worker.guided": {"core", "grammar_cache", "worker.models"},
    "worker.engine": {"core", "grammar_cache", "worker.guided", "worker.models"},
    "worker": {"core", "grammar_cache", "worker.engine", "worker.guided", "worker.models"},
    "cluster": {"core", "grammar_cache", "scheduler", "worker", "worker.engine",
                "worker.guided", "worker.models"},
    "deploy": {"core", "cluster"},
    # the command line also runs an engine in its own process (rayguide generate)
    "cli": {"core", "cluster", "deploy", "grammar_cache", "worker", "worker.engine",
            "worker.guided", "worker.models"},
}
# (importing module, imported module) pairs allowed against the layer rule, each with why
# (none: the guided path's imports of the engine's nouns became worker/guided/rows.py's
# protocols and worker/guided/detokenizer.py)
EXCEPTIONS: set[tuple[str, str]] = set()
RAY_OR_HTTP = {"ray", "fastapi", "starlette", "httpx", "uvicorn", "aiohttp", "requests"}
HEAVY = RAY_OR_HTTP | {"torch", "transformers", "xgrammar", "llguidance"}
# third-party packages a layer must not import, itself or through the project's modules
FORBIDDEN = {"worker.engine": RAY_OR_HTTP, "worker.guided": RAY_OR_HTTP,
             "worker.models": RAY_OR_HTTP, "core": HEAVY}


def layer_of(module: str) -> str | None:
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def runtime_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the runtime's packages: dotted name -> file."""
    mods = {}
    for top in {layer.split(".")[0] for layer in LAYERS}:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def imports(module: str, path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement of the file; ``from a import b``
    counts as ``a.b`` (b may be a module), a relative import is resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    source = path.read_text(encoding="utf-8") if source is None else source
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base)
                      for a in node.names]
    return found


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The project module an imported name is (or is in), or None for a third party."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    mods = runtime_modules()
    return mods, {m: imports(m, p) for m, p in mods.items()}


def violations(mods: dict[str, Path], graph: dict[str, list[tuple[int, str]]],
               root: Path = ROOT) -> list[str]:
    """Every import against the layer rule, as ``file:line: what``."""
    bad = []
    for mod, found in graph.items():
        mine = layer_of(mod)
        for line, name in found:
            target = _resolve(name, mods)
            other = layer_of(target) if target else None
            if (other is not None and other != mine and other not in MAY_IMPORT[mine]
                    and (mod, target) not in EXCEPTIONS):
                bad.append(f"{mods[mod].relative_to(root)}:{line}: {mine} imports {name} "
                           f"({other})")
    # third parties a layer must not reach, directly or through the project's modules
    for mod in graph:
        banned = FORBIDDEN.get(layer_of(mod))
        if not banned:
            continue
        seen, todo = {mod}, [(mod, [mod])]
        while todo:
            cur, chain = todo.pop()
            for line, name in graph[cur]:
                target = _resolve(name, mods)
                if target is None:
                    if name.split(".")[0] in banned:
                        via = " via " + " -> ".join(chain[1:]) if len(chain) > 1 else ""
                        bad.append(f"{mods[mod].relative_to(root)}: {layer_of(mod)} imports "
                                   f"{name}{via} ({mods[cur].relative_to(root)}:{line})")
                elif target not in seen:
                    seen.add(target)
                    todo.append((target, [*chain, target]))
    return sorted(set(bad))


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_import_points_down(graph):
    assert violations(*graph) == []


def guided_imports_of_the_engine(mods: dict[str, Path],
                                 graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Every import of a worker/guided module that reaches an engine module, whatever
    ``EXCEPTIONS`` says: worker/guided sits below worker/engine (the engine's nouns are
    seen through worker/guided/rows.py)."""
    return [f"{mod} imports {name}" for mod, found in graph.items()
            if layer_of(mod) == "worker.guided" for _, name in found
            if layer_of(_resolve(name, mods) or "") == "worker.engine"]


def test_the_guided_path_imports_nothing_of_the_engine(graph):
    assert guided_imports_of_the_engine(*graph) == []
    assert not EXCEPTIONS


def test_a_guided_import_of_the_engine_is_caught(graph):
    mods, edges = graph
    planted = {**edges, "worker.guided.rows": [
        *edges["worker.guided.rows"], (1, "worker.engine.sequence.Sequence")]}
    assert guided_imports_of_the_engine(mods, planted) == [
        "worker.guided.rows imports worker.engine.sequence.Sequence"]


def test_every_runtime_module_has_a_layer(graph):
    assert all(layer_of(m) for m in graph[0])
    assert set(MAY_IMPORT) == set(LAYERS)


@pytest.mark.parametrize("file, line, expect", [
    ("core/errors.py", "from grammar_cache.config import GrammarCacheConfig",
     "core imports grammar_cache.config.GrammarCacheConfig (grammar_cache)"),
    ("grammar_cache/disk.py", "from worker.engine.sequence import Sequence",
     "grammar_cache imports worker.engine.sequence.Sequence (worker.engine)"),
    ("scheduler/routing.py", "    from worker import actor",  # inside a function
     "scheduler imports worker.actor (worker)"),
    ("deploy/tools.py", "from scheduler.actor import NAMESPACE",
     "deploy imports scheduler.actor.NAMESPACE (scheduler)"),
    ("worker/engine/sampling.py", "from worker.actor import WorkerActor",
     "worker.engine imports worker.actor.WorkerActor (worker)"),
    ("worker/models/rope.py", "from . import llama\nfrom ..engine import config",
     "worker.models imports worker.engine.config (worker.engine)"),
    ("worker/engine/sequence.py", "import ray", "worker.engine imports ray"),
    ("worker/engine/block_manager.py", "from starlette.requests import Request",
     "worker.engine imports starlette.requests.Request"),
    ("worker/guided/backend.py", "from worker.engine.sequence import Sequence",
     "worker.guided imports worker.engine.sequence.Sequence (worker.engine)"),
    ("worker/guided/xgrammar_backend.py", "from worker.engine.scheduler import Scheduler",
     "worker.guided imports worker.engine.scheduler.Scheduler (worker.engine)"),
    # the guided path's old imports of the engine's nouns, now against the rule
    ("worker/guided/output_policy.py", "from worker.engine.config import EngineConfig",
     "worker.guided imports worker.engine.config.EngineConfig (worker.engine)"),
    ("worker/guided/request.py", "    from worker.engine.sequence import Sequence",
     "worker.guided imports worker.engine.sequence.Sequence (worker.engine)"),
    ("worker/guided/detokenizer.py", "from ..engine import sequence",
     "worker.guided imports worker.engine.sequence (worker.engine)"),
    ("worker/guided/llguidance_backend.py", "import ray", "worker.guided imports ray"),
    ("grammar_cache/compile.py", "import httpx",  # reached from the engine
     "worker.guided imports httpx via grammar_cache.compile"),
    ("core/backoff.py", "import torch", "core imports torch"),
])
def test_a_wrong_import_is_caught(graph, file, line, expect):
    mods, edges = graph
    module = next(m for m, p in mods.items() if p == ROOT / file)
    body = mods[module].read_text(encoding="utf-8")
    if line.startswith(" "):  # an import inside a function
        body += f"\n\ndef _planted():\n{line}\n"
    else:
        body += "\n" + line + "\n"
    planted = {**edges, module: imports(module, mods[module], body)}
    found = violations(mods, planted)
    assert any(expect in v for v in found), found
