"""The checked grammars, by owner and id: what ``POST /v1/grammars`` checked, so ``GET
/v1/grammars/{id}`` answers the same report and a request may name ``grammar_id`` instead
of repeating a large schema. No Ray: the cache actor holds the cluster's (every front end
reaches it), each front end a small one of its own in front.

Each entry belongs to the client that checked it (its owner: the front end's client
identity, ``<tenant hash>.<user or address hash>``): another client asking for the same
id finds nothing (it checks the grammar itself), so an id never tells one client what
another checked, and one tenant's checks can only evict its own while it holds more than
the other tenants (one client's, its own while it holds more than its tenant's others).
An entry is kept as the bytes it really is (the spec and the report pickled: no parsed
schema, no live objects), and those bytes are what is bounded: ``owner_bytes`` per owner
(its least recently used go first) and ``max_bytes`` in all (the least recently used of
the tenant holding the most, of its owner holding the most, go first). The newest entry
always stays.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict

from core.fair_lines import tenant_of
from core.grammar_spec import GrammarSpec

MAX_CHECKED_BYTES = 64 * 2**20  # the cache actor's; about 250 schemas of the 256 kB limit
OWNER_SHARE = 8  # an owner holds at most max_bytes / OWNER_SHARE
ENTRY_OVERHEAD = 256  # the keys and the tables' slots an entry takes besides its bytes


class CheckedGrammars:
    def __init__(self, max_bytes: int = MAX_CHECKED_BYTES, owner_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.owner_bytes = owner_bytes if owner_bytes is not None else max_bytes // OWNER_SHARE
        self.bytes = 0
        self.evictions = 0
        self._owners: OrderedDict[str, OrderedDict[str, bytes]] = OrderedDict()
        self._held: dict[str, int] = {}  # owner -> bytes

    def put(self, owner: str | None, grammar_id: str, spec: GrammarSpec, report: dict) -> None:
        """Keeps (or refreshes) ``grammar_id`` for ``owner`` (None: the owner of callers
        without an identity); then evicts past the bounds (see the module doc)."""
        owner = owner or ""
        blob = pickle.dumps((spec, report), protocol=pickle.HIGHEST_PROTOCOL)
        items = self._owners.setdefault(owner, OrderedDict())
        self._owners.move_to_end(owner)
        old = items.pop(grammar_id, None)
        if old is not None:
            self._account(owner, -_size(old))
        items[grammar_id] = blob
        self._account(owner, _size(blob))
        newest = (owner, grammar_id)
        while self._held[owner] > self.owner_bytes and self._evict(owner, newest):
            pass
        while self.bytes > self.max_bytes:
            if not any(self._evict(victim, newest) for victim in self._heaviest_first()):
                break

    def get(self, owner: str | None, grammar_id: str) -> tuple[GrammarSpec, dict] | None:
        """``owner``'s spec and report under ``grammar_id``; None when it has none."""
        owner = owner or ""
        items = self._owners.get(owner)
        blob = items.get(grammar_id) if items is not None else None
        if blob is None:
            return None
        items.move_to_end(grammar_id)
        spec, report = pickle.loads(blob)
        return spec, report

    def held(self, owner: str | None) -> int:
        """The bytes ``owner``'s entries count."""
        return self._held.get(owner or "", 0)

    def stats(self) -> dict:
        return {"checked_entries": len(self), "checked_bytes": self.bytes,
                "checked_max_bytes": self.max_bytes, "checked_owners": len(self._owners),
                "checked_evictions": self.evictions}

    def __len__(self) -> int:
        return sum(len(items) for items in self._owners.values())

    def _heaviest_first(self) -> list[str]:
        """The owners in the order the whole bound evicts them: the tenant holding the
        most first (core/fair_lines.tenant_of), and within a tenant the owner holding
        the most."""
        tenants: dict[object, int] = {}
        for owner, held in self._held.items():
            tenants[tenant_of(owner)] = tenants.get(tenant_of(owner), 0) + held
        return sorted(self._held, key=lambda o: (tenants[tenant_of(o)], self._held[o]),
                      reverse=True)

    def _account(self, owner: str, delta: int) -> None:
        self.bytes += delta
        self._held[owner] = self._held.get(owner, 0) + delta

    def _evict(self, owner: str, keep: tuple[str, str]) -> bool:
        """Drops ``owner``'s least recently used entry, never ``keep``; False when that
        is all it holds."""
        items = self._owners[owner]
        gone = next(iter(items))
        if (owner, gone) == keep:
            return False
        self._account(owner, -_size(items.pop(gone)))
        self.evictions += 1
        if not items:
            del self._owners[owner]
            del self._held[owner]
        return True


def _size(blob: bytes) -> int:
    return len(blob) + ENTRY_OVERHEAD
