"""GrammarFacts: the typed record of what searches learned of a compiled grammar
(worker/guided/backend.py), kept with it and put back by a kept grammar check's report."""

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.backend import CompiledGrammar, GrammarFacts

pytestmark = pytest.mark.unit


def test_a_new_record_knows_nothing_and_admission_carries_nothing():
    facts = GrammarFacts()
    assert facts.start_path is None and facts.checked_budget == 0
    assert not facts.witness_known and facts.start_dives == 0 and facts.refusals == {}
    assert facts.admission() is None


def test_the_shortest_start_path_is_kept():
    facts = GrammarFacts()
    facts.remember_start_path([1, 2, 3])
    facts.remember_start_path([4, 5, 6, 7])  # longer: ignored
    assert facts.start_path == (1, 2, 3)
    facts.remember_start_path([9])
    assert facts.start_path == (9,)


def test_admission_facts_go_back_only_where_the_new_grammar_knows_none():
    old = GrammarFacts(start_path=(1, 2), checked_budget=7, witness_path=None,
                       witness_known=True, start_dive=(3,), start_dives=2,
                       refusals={"llguidance": "no"})
    kept = old.admission()
    # the dive, its count and the refusals are not admission facts
    assert (kept.start_dive, kept.start_dives, kept.refusals) == (None, 0, {})
    fresh = GrammarFacts(start_path=(5,))
    fresh.adopt(kept)
    assert fresh.start_path == (5,)  # its own is kept
    assert fresh.checked_budget == 7 and fresh.witness_known and fresh.witness_path is None
    known = GrammarFacts(witness_path=(8, 8), witness_known=True, checked_budget=3)
    known.adopt(kept)
    assert known.witness_path == (8, 8) and known.checked_budget == 3


def test_each_compiled_grammar_has_a_record_of_its_own():
    spec = GrammarSpec.regex("a+")
    a = CompiledGrammar("xgrammar", spec, None, 0.0)
    b = CompiledGrammar("xgrammar", spec, None, 0.0)
    a.facts.checked_budget = 4
    assert b.facts.checked_budget == 0
    assert a == b  # the facts are not the grammar's identity
