"""FairLines (core/fair_lines.py): round robin between tenants, then between a tenant's
clients, and who gives up a place when the owner's bound is reached; the same through a
worker's FairQueue and the checked-grammar store: a tenant that invents ``user`` values
gets more lines, never more than its tenant's share."""

import threading
from concurrent.futures import Future

import pytest

from core.fair_lines import FairLines, tenant_of
from core.grammar_spec import GrammarSpec, grammar_id
from deploy.openai_api import client_identity
from grammar_cache.checked import CheckedGrammars
from worker.guided.compile_queue import FairQueue, QueueFull

pytestmark = pytest.mark.unit

A1, A2, A3 = (client_identity(u, None, "acme") for u in ("u1", "u2", "u3"))
B1 = client_identity("u1", None, "globex")


def test_the_tenant_is_the_identitys_root():
    assert tenant_of(A1) == tenant_of(A2) != tenant_of(B1)
    assert tenant_of("batch") == "batch" and tenant_of(None) is None and tenant_of(7) == 7


def test_round_robin_goes_between_tenants_first():
    lines = FairLines()
    for i in range(3):
        for client in (A1, A2, A3):
            lines.add(client, f"{client[-4:]}-{i}")
    lines.add(B1, "b-0")
    lines.add(B1, "b-1")
    served = [lines.pop()[0] for _ in range(len(lines))]
    # globex's two go out as soon as acme's three clients' first two
    assert served[:4] == [A1, B1, A2, B1]
    assert served[4:] == [A3, A1, A2, A3, A1, A2, A3]
    assert not lines and lines.waiting == 0


def test_one_client_per_tenant_is_the_plain_round_robin():
    lines = FairLines()
    for i in range(2):
        for client in ("a", "b", "c"):
            lines.add(client, i)
    assert [lines.pop()[0] for _ in range(6)] == ["a", "b", "c"] * 2


def test_a_lighter_tenant_displaces_the_heaviest_tenants_heaviest_client():
    lines = FairLines()
    for client, n in ((A1, 3), (A2, 1), (A3, 1)):
        for i in range(n):
            lines.add(client, (client, i))
    assert lines.victim_for(B1) == (A1, (A1, 2))  # globex: 0 + 1 < acme's 5
    # acme's own lighter client takes from acme's heaviest, never from another tenant
    lines.add(B1, "b")
    lines.add(B1, "b2")
    lines.add(B1, "b3")
    assert lines.victim_for(A2) == (A1, (A1, 2))  # acme 5 vs globex 3: A2 1 + 1 < A1 3
    assert lines.victim_for(A1) is None  # acme's heaviest asks: refused
    assert lines.victim_for(client_identity("u9", None, "acme")) == (A1, (A1, 2))


def test_a_tenant_inventing_users_cannot_crowd_another_out_of_a_fair_queue():
    """8 places: acme floods from 40 made-up users, globex asks for 3 afterwards. globex's
    are taken (each displacing one of acme's), and served no later than acme's others."""
    gate = threading.Event()
    queue = FairQueue(threads=1, limit=8, name="test")
    order, refused = [], []
    blocker = Future()
    queue.submit("first", blocker, gate.wait, lambda: None)  # holds the only thread
    futures = []
    for i in range(40):
        client = client_identity(f"made-up-{i}", None, "acme")
        f = Future()
        try:
            queue.submit(client, f, lambda c=client: order.append(tenant_of(c)),
                         lambda: refused.append("acme"))
        except QueueFull:
            refused.append("acme")
        futures.append(f)
    for i in range(3):
        f = Future()
        queue.submit(B1, f, lambda: order.append(tenant_of(B1)), lambda: refused.append("b"))
        futures.append(f)
    assert queue.waiting == 8 and "b" not in refused
    gate.set()
    for f in futures[-3:]:
        f.result(timeout=10)
    queue.close()
    assert order.count(tenant_of(B1)) == 3
    assert order[:6].count(tenant_of(B1)) == 3  # every other turn is globex's


def test_a_tenant_with_many_users_evicts_its_own_checked_grammars_first():
    checked = CheckedGrammars(max_bytes=40_000, owner_bytes=10_000)
    polite = [GrammarSpec.regex(f"polite{i}[a-z]{{{i + 1}}}") for i in range(5)]
    for spec in polite:
        checked.put(B1, grammar_id(spec), spec, {"id": grammar_id(spec)})
    for i in range(400):  # each made-up user holds less than globex's one client
        spec = GrammarSpec.regex(f"flood{i}" + "x" * 100)
        checked.put(client_identity(f"made-up-{i}", None, "acme"), grammar_id(spec), spec,
                    {"id": grammar_id(spec)})
        assert checked.bytes <= 40_000
    for spec in polite:
        assert checked.get(B1, grammar_id(spec)) is not None
