"""core/prefix_keys.py: a prompt's chained prefix keys (what prefix-aware routing matches)."""

import pytest

from core.prefix_keys import CHUNK_CHARS, MAX_KEYS, prefix_keys

pytestmark = pytest.mark.unit

SHARED = "You extract invoices as JSON. " * 40  # 1,200 characters: 4 full chunks


def test_keys_are_chained_over_full_chunks():
    a = prefix_keys(SHARED + "Document A: total 12.50 EUR " * 20)
    b = prefix_keys(SHARED + "Document B: a bill of lading " * 20)
    shared = len(SHARED) // CHUNK_CHARS
    assert a[:shared] == b[:shared]  # the chunks wholly inside the shared part
    # from the first chunk that differs on, every key differs (each names its whole prefix)
    assert all(x != y for x, y in zip(a[shared + 1:], b[shared + 1:]))
    assert len(set(a)) == len(a) and all(len(k) == 16 for k in a)
    # the same chunk text after different beginnings is another key
    assert prefix_keys("x" * CHUNK_CHARS + "y" * CHUNK_CHARS)[1] != \
        prefix_keys("z" * CHUNK_CHARS + "y" * CHUNK_CHARS)[1]


def test_a_partial_last_chunk_makes_no_key():
    assert prefix_keys("a" * (CHUNK_CHARS - 1)) == []
    assert len(prefix_keys("a" * CHUNK_CHARS)) == 1
    full = prefix_keys("a" * (2 * CHUNK_CHARS))
    assert prefix_keys("a" * (2 * CHUNK_CHARS) + "tail") == full


def test_the_scope_separates_equal_prompts():
    unscoped, acme, globex = (prefix_keys(SHARED, s) for s in (None, "tacme", "tglobex"))
    assert unscoped == prefix_keys(SHARED)
    assert not set(unscoped) & set(acme) and not set(acme) & set(globex)
    assert prefix_keys(SHARED, "") != unscoped  # an empty scope is a scope, not None


def test_the_count_is_capped():
    keys = prefix_keys("b" * CHUNK_CHARS * (MAX_KEYS + 10))
    assert len(keys) == MAX_KEYS
    assert keys == prefix_keys("b" * CHUNK_CHARS * MAX_KEYS)


def test_chat_messages_render_canonically():
    system = {"role": "system", "content": SHARED}
    one = [system, {"role": "user", "content": "row 1"}]
    two = [{"content": SHARED, "role": "system"}, {"role": "user", "content": "row 2"}]
    assert prefix_keys(one)[:4] == prefix_keys(two)[:4]  # key order inside a message is moot
    # a role boundary cannot be forged by content: the same characters split otherwise
    joined = [{"role": "user", "content": "a" * 300 + "b" * 300}]
    split = [{"role": "user", "content": "a" * 300}, {"role": "user", "content": "b" * 300}]
    assert prefix_keys(joined)[1:] != prefix_keys(split)[1:]
    assert prefix_keys([{"role": "user", "content": "x\n"}] * 100) != \
        prefix_keys([{"role": "user", "content": "x"}] * 100)


def test_token_ids_render_as_ids():
    ids = list(range(1000, 1200))
    assert prefix_keys(ids) == prefix_keys(ids + [7, 8])[:len(prefix_keys(ids))]
    assert prefix_keys(ids) != prefix_keys([i + 1 for i in ids])
    assert prefix_keys([]) == [] and prefix_keys("") == []
    # a token list is capped like text: a huge prompt costs no more than MAX_KEYS chunks
    assert len(prefix_keys(list(range(10**6)))) == MAX_KEYS
