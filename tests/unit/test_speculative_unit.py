"""Speculation's drafts without a model (worker/engine/speculative.py): the n-gram lookup,
the forward-time fit and the draft length it gives."""

import pytest

from worker.engine.speculative import FIT_STEPS, Drafter, Lookup, StepCost

pytestmark = pytest.mark.unit


def test_the_longest_recent_ngram_proposes_what_followed_it():
    row = Lookup()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    row.index(tokens)
    # "1 2 3" was followed by 4 (position 3); "2 3" most recently by 7: the longer wins
    assert row.propose(tokens, 3) == [4, 5, 9]
    assert row.propose(tokens, 1) == [4]
    tokens = [5, 6, 2, 3, 7, 8, 2, 3]
    row = Lookup()
    row.index(tokens)
    assert row.propose(tokens, 2) == [7, 8]
    assert Lookup().propose([1, 2, 3], 4) == []  # nothing indexed, nothing found
    # a draft may run into the row's own newest tokens: a loop copies itself
    tokens = [4, 1, 4, 1, 4]
    row = Lookup()
    row.index(tokens)
    assert row.propose(tokens, 4) == [1, 4]


def test_entries_a_rollback_made_stale_are_skipped():
    row = Lookup()
    tokens = [1, 2, 3, 4, 5, 6]
    row.index(tokens)
    tokens = [1, 2, 9, 3]  # cut back to 2 tokens, then other tokens
    row.index(tokens)
    assert row.propose(tokens, 2) != [4, 5]  # "3" was followed by 4 at a position now gone


def test_the_step_cost_fit_recovers_a_line():
    cost = StepCost()
    for i in range(40):
        tokens = 8 + (i * 7) % 33
        cost.add(tokens, 0.04 + 0.002 * tokens)
    assert cost.fitted
    assert cost.a == pytest.approx(0.04, rel=1e-6) and cost.b == pytest.approx(0.002, rel=1e-6)
    flat = StepCost()
    for _ in range(4 * FIT_STEPS):
        flat.add(8, 0.05)  # one size only: no slope can be told
    assert not flat.fitted


def test_drafts_are_as_long_as_they_pay():
    d = Drafter(8, set())
    row = Lookup()
    assert d.length(row, 1) == 8  # nothing fitted yet: drafts as long as allowed
    for i in range(40):
        tokens = 8 + (i * 7) % 33
        d.cost.add(tokens, 0.04 + 0.002 * tokens)  # a CPU: 2 ms a token, 40 ms a step
    row.kept, row.tried = 1.0, 1.0  # keep rate (1 + 1) / (1 + 2) = 2/3
    # p^i * (a / rows + b) > b: 7 tokens at 1 row, 3 at 8, 1 at 32, none at 64
    assert [d.length(row, n) for n in (1, 8, 32, 64)] == [7, 3, 1, 0]
    row.kept, row.tried = 0.0, 6.0  # drafts that miss: none at 8 rows
    assert d.length(row, 8) == 0 and d.length(row, 1) > 0
    d.settle("r", 4, 4)  # an unknown row is not counted
    assert d.drafts == 0
    d.rows["r"] = row
    d.settle("r", 4, 4)
    assert (d.drafts, d.draft_tokens, d.accepted_tokens) == (1, 4, 4)
    assert row.keep_rate > 1 / 8
