"""The grammar backends' protocol (worker/guided/backend.py), on byte-level vocabularies:
each backend compiles, makes matchers, fills mask rows, accepts, refuses, rolls back and
forks alike, and its state key (the closing search's) is equal for equal states and
different after a token that changes what may follow; the ``auto`` rule is one table;
nothing outside worker/guided touches a library's matcher or parser internals."""

import ast
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from core.grammar_spec import GrammarSpec
from worker.guided.guided_process import GuidedDecodingManager
from worker.guided.backend import (AUTO, BACKENDS, LLGUIDANCE, XGRAMMAR, CompiledGrammar,
                                   GrammarBackend, GrammarMatcher, backend_order)

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")
ROOT = Path(__file__).resolve().parents[2]
PATTERN = "(ab|cd)x[0-9]{3}-[a-z]+"


@pytest.fixture(scope="module")
def manager():
    from worker.guided.llguidance_backend import LLGuidanceBackend

    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)]
                             + [f"<s{i}>".encode() for i in range(6)],
                             stop_token_ids=list(BYTES.eos_tokens))
    return GuidedDecodingManager(info, max_batch_size=4,
                                 llguidance=lambda: LLGuidanceBackend(BYTES))


def matcher_after(backend: GrammarBackend, text: str, pattern: str = PATTERN) -> GrammarMatcher:
    m = backend.matcher(backend.compile(GrammarSpec.regex(pattern)))
    assert all(m.accept_token(b) for b in text.encode()), text
    return m


def allowed(backend: GrammarBackend, m: GrammarMatcher) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(2, backend.vocab_size)
    backend.fill_rows(bitmask, [1], [m])
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist()) & set(range(256))


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_satisfies_the_protocol(manager, name):
    backend = manager.backend(name)
    assert isinstance(backend, GrammarBackend) and backend.name == name
    compiled = backend.compile(GrammarSpec.regex(PATTERN))
    assert isinstance(compiled, CompiledGrammar) and compiled.engine == name
    assert compiled.exact == backend.exact and backend.grammar_bytes(compiled) > 0
    m = backend.matcher(compiled)
    assert isinstance(m, GrammarMatcher) and m.engine == name
    assert allowed(backend, m) == {ord("a"), ord("c")}
    assert not m.accept_token(ord("x"))  # refused: the matcher is as it was
    assert m.accept_token(ord("a")) and allowed(backend, m) == {ord("b")}
    assert m.forced_continuation() == "bx"
    assert m.accept_token(ord("b")) and m.accept_token(ord("x"))
    digits = {ord(c) for c in "0123456789"}
    assert allowed(backend, m) == digits
    twin = m.fork()
    assert twin.accept_token(ord("1")) and allowed(backend, m) == digits  # independent
    m.accept_token(ord("7"))
    m.rollback(1)
    assert allowed(backend, m) == digits
    assert m.accept_string("123-q") and m.is_completed() and not m.is_terminated()
    stop = BYTES.eos_tokens[0]
    assert m.accept_token(stop) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.accept_string("rs") and m.is_completed()


@pytest.mark.parametrize("name", BACKENDS)
def test_state_key_equal_for_equal_states(manager, name):
    backend = manager.backend(name)
    # the same place reached two ways, and one place inside a free field
    assert matcher_after(backend, "abx").state_key() == matcher_after(backend, "cdx").state_key()
    assert (matcher_after(backend, "abx123-q").state_key()
            == matcher_after(backend, "cdx123-qrs").state_key())
    m = matcher_after(backend, "abx1")
    key = m.state_key()
    m.accept_token(ord("2"))
    m.rollback(1)
    assert m.state_key() == key  # a probe or a rolled-back token leaves it as it was


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("first, second", [
    ("abx1", "abx12"),  # the same mask (a digit) and no forced text: the place tells
    ("abx", "abx1"),
    ("abx123", "abx123-q"),
])
def test_state_key_differs_after_a_distinguishing_token(manager, name, first, second):
    backend = manager.backend(name)
    assert matcher_after(backend, first).state_key() != matcher_after(backend, second).state_key()


def test_fill_bitmask_fills_each_backends_rows(manager):
    """Rows of both backends in one batch: each row as its matcher alone fills it."""
    specs = {XGRAMMAR: GrammarSpec("regex", "x[0-9]+", engine=XGRAMMAR),
             LLGUIDANCE: GrammarSpec("regex", "[a-c]y", engine=LLGUIDANCE)}
    ms = [manager.new_matcher(manager.get_grammar(specs[n]).result(timeout=30))
          for n in (XGRAMMAR, LLGUIDANCE, LLGUIDANCE, XGRAMMAR)]
    ms[1].accept_token(ord("a"))
    manager.mask.fill_bitmask([0, 1, 2, 3], ms)
    for row, m in enumerate(ms):
        alone = xgr.allocate_token_bitmask(1, manager.vocab_size)
        m.fill_bitmask(alone)
        assert torch.equal(manager.mask.bitmask[row], alone[0]), row


def test_a_fill_on_several_threads_fills_each_row_as_one_thread_does(manager):
    """``grammar_fill_threads``: each backend's batch fill on 2 threads (xgrammar's
    BatchGrammarMatcher, llguidance's parallel fill) writes the bitmask one thread writes."""
    specs = {XGRAMMAR: GrammarSpec("regex", "x[0-9]+", engine=XGRAMMAR),
             LLGUIDANCE: GrammarSpec("regex", "[a-c]y[0-9]", engine=LLGUIDANCE)}
    ms = [manager.new_matcher(manager.get_grammar(specs[n]).result(timeout=30))
          for n in (LLGUIDANCE, XGRAMMAR, LLGUIDANCE, XGRAMMAR)]
    ms[0].accept_token(ord("b"))
    ms[1].accept_token(ord("x"))
    masks = []
    try:
        for threads in (1, 2):
            manager.mask.fill_threads = threads
            manager.mask.bitmask.zero_()
            manager.mask.fill_bitmask([0, 1, 2, 3], ms)
            masks.append(manager.mask.bitmask[:4].clone())
    finally:
        manager.mask.fill_threads = 1
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0][0], masks[0][2])  # (the rows differ: b then y, or a-c)


def test_the_mask_stage_reads_and_sets_single_bits_of_its_bitmask(manager):
    """``allow`` / ``allowed`` on the bitmask's words, the sign bit (token 31 of a word)
    included, and again after the bitmask is replaced (pinned beside a GPU)."""
    mask = manager.mask
    saved = mask.bitmask
    try:
        for tensor in (saved, saved.clone()):
            mask.bitmask = tensor
            tensor[1].zero_()
            for t in (0, 31, 32, 63, 200):
                assert not mask.allowed(1, t)
                mask.allow(1, t)
                assert mask.allowed(1, t)
            assert int(tensor[1, 0]) == 1 - (1 << 31)  # bits 0 and 31: an int32's sign
            assert int(tensor[1, 1]) == 1 - (1 << 31)
            assert not mask.allowed(1, 33) and not mask.allowed(1, manager.vocab_size)
            mask.allow(1, manager.vocab_size)  # past the vocabulary: nothing is set
            assert sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in tensor[1]) == 5
    finally:
        mask.bitmask = saved


@pytest.mark.parametrize("engine, default, kind, has_llguidance, order", [
    (AUTO, AUTO, "json_schema", True, (LLGUIDANCE, XGRAMMAR)),
    (AUTO, AUTO, "json_object", True, (LLGUIDANCE, XGRAMMAR)),
    (AUTO, AUTO, "json_schema", False, (XGRAMMAR,)),
    (AUTO, AUTO, "regex", True, (XGRAMMAR,)),
    (AUTO, AUTO, "ebnf", True, (XGRAMMAR,)),
    (AUTO, LLGUIDANCE, "regex", True, (LLGUIDANCE,)),  # a server default of llguidance
    (AUTO, LLGUIDANCE, "ebnf", True, (XGRAMMAR,)),  # ... sends it the kinds it takes
    (AUTO, XGRAMMAR, "json_schema", True, (XGRAMMAR,)),
    (LLGUIDANCE, AUTO, "json_schema", True, (LLGUIDANCE,)),  # asked for: no fallback
    (LLGUIDANCE, AUTO, "ebnf", True, (LLGUIDANCE,)),  # (which refuses it by name)
    (LLGUIDANCE, XGRAMMAR, "json_schema", False, (LLGUIDANCE,)),
    (XGRAMMAR, LLGUIDANCE, "json_schema", True, (XGRAMMAR,)),
])
def test_the_auto_rule(engine, default, kind, has_llguidance, order):
    source = {"json_schema": "{}", "json_object": "", "regex": "a+",
              "ebnf": 'root ::= "a"'}[kind]
    spec = GrammarSpec(kind, source, engine=engine)
    assert backend_order(spec, default, llguidance=has_llguidance) == order


# what only a backend module may touch: a library's matcher classes and parser internals
LIBRARY_ONLY = {"GrammarMatcher", "BatchGrammarMatcher", "LLMatcher", "LLExecutor",
                "fill_next_token_bitmask_par"}
LIBRARIES = {"xgrammar", "llguidance"}


def library_uses(source: str) -> list[int]:
    """The lines of ``source`` that name a library's matcher (``xgr.GrammarMatcher``,
    ``from llguidance import LLMatcher`` ...) or read xgrammar's debug text."""
    aliases, lines = set(LIBRARIES), []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names
                        if a.name.split(".")[0] in LIBRARIES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if node.attr == "_debug_print_internal_state" or (
                    node.attr in LIBRARY_ONLY and isinstance(base, ast.Name)
                    and base.id in aliases):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            lines += [node.lineno for a in node.names if a.name in LIBRARY_ONLY]
    return lines


@pytest.mark.parametrize("source, expect", [
    ("import xgrammar as xgr\nm = xgr.GrammarMatcher(c)", [2]),
    ("import llguidance.numpy\nllguidance.numpy.fill_next_token_bitmask_par(e, r, b)", [2]),
    ("from llguidance import LLMatcher", [1]),
    ("text = m._debug_print_internal_state()", [1]),
    ("from worker.guided.backend import GrammarMatcher\nx: GrammarMatcher", []),
    ('"""a bare ``xgrammar.GrammarMatcher``"""', []),
])
def test_a_library_use_is_found(source, expect):
    assert library_uses(source) == expect


def test_nothing_outside_worker_guided_touches_a_library_matcher():
    found = []
    for top in ("worker", "grammar_cache", "scheduler", "cluster", "deploy", "cli", "core"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(ROOT / "worker" / "guided"):
                continue
            found += [f"{path.relative_to(ROOT)}:{n}"
                      for n in library_uses(path.read_text(encoding="utf-8"))]
    assert found == []
