"""FairLines: waiting work in one line per client, the clients grouped by tenant, served
round robin first between tenants and then between a tenant's clients (no Ray, no
threads: its owner locks it). The cache actor's CompileQueue (grammar_cache/actor.py) and
a worker's FairQueue (worker/guided/compile_queue.py) keep their waiting work in one.

A client is the front end's client identity (deploy/openai_api.client_identity,
``<tenant hash>.<user or address hash>``); its tenant is what comes before the first '.'
(``tenant_of``). Any other client (the batch job's ``batch``, None, a test's name) is a
tenant of its own, so with one client per tenant this is a plain round robin of lines.

When the owner's bound is reached, ``victim_for(client)`` says whose newest item gives its
place to ``client``'s: the heaviest tenant's heaviest client's, when ``client``'s tenant
waits with fewer (plus the new one) than that tenant; else, inside ``client``'s own
tenant, its heaviest client's, when ``client`` has fewer (plus one) than that client;
else none (the owner refuses). So a tenant that invents ``user`` values gets more lines
but not more than its tenant's share, and a lighter client never waits behind a heavier
one of its own tenant either.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Iterator


def tenant_of(client: object) -> object:
    """The tenant part of a client identity: what comes before its first '.'; any other
    client is its own tenant."""
    if isinstance(client, str):
        return client.split(".", 1)[0]
    return client


class FairLines:
    def __init__(self):
        # tenant -> client -> its waiting items, oldest first; both in serving order
        self._tenants: OrderedDict[object, OrderedDict[object, deque]] = OrderedDict()
        self._counts: dict[object, int] = {}  # tenant -> items waiting
        self.waiting = 0

    def add(self, client, item: Any) -> None:
        tenant = tenant_of(client)
        self._tenants.setdefault(tenant, OrderedDict()).setdefault(client, deque()).append(item)
        self._counts[tenant] = self._counts.get(tenant, 0) + 1
        self.waiting += 1

    def remove(self, client, item: Any) -> bool:
        """Takes ``item`` out of ``client``'s line; False when it is not there."""
        tenant = tenant_of(client)
        line = self._tenants.get(tenant, {}).get(client)
        if line is None or item not in line:
            return False
        line.remove(item)
        self._drop(tenant, client)
        return True

    def holds(self, client, item: Any) -> bool:
        return item in self._tenants.get(tenant_of(client), {}).get(client, ())

    def count(self, client) -> int:
        """How many of ``client``'s items wait."""
        return len(self._tenants.get(tenant_of(client), {}).get(client, ()))

    def pop(self) -> tuple[object, Any]:
        """The next item to serve, and its client: the head of the next tenant's next
        client's line; both go to the back of their turn. IndexError when none waits."""
        if not self._tenants:
            raise IndexError("no item waits")
        tenant, clients = next(iter(self._tenants.items()))
        client, line = next(iter(clients.items()))
        item = line.popleft()
        if line:
            clients.move_to_end(client)  # its next item waits for its tenant's others
        self._tenants.move_to_end(tenant)  # and its tenant's for the other tenants
        self._drop(tenant, client)
        return client, item

    def victim_for(self, client) -> tuple[object, Any] | None:
        """Whose newest item gives its place to a new one of ``client`` when the owner's
        bound is reached (the module doc), and that item; None: refuse ``client``'s."""
        if not self._tenants:
            return None
        tenant = tenant_of(client)
        heaviest = max(self._tenants, key=self._counts.__getitem__)
        if self._counts.get(tenant, 0) + 1 < self._counts[heaviest]:
            return self._newest_of_heaviest(heaviest)
        clients = self._tenants.get(tenant)
        if clients:
            victim, item = self._newest_of_heaviest(tenant)
            if self.count(client) + 1 < len(clients[victim]):
                return victim, item
        return None

    def items(self) -> Iterator[tuple[object, Any]]:
        """Every waiting item and its client (a snapshot)."""
        return iter([(c, item) for clients in self._tenants.values()
                     for c, line in clients.items() for item in line])

    def clear(self) -> None:
        self._tenants.clear()
        self._counts.clear()
        self.waiting = 0

    def __len__(self) -> int:
        return self.waiting

    def __bool__(self) -> bool:
        return self.waiting > 0

    def _newest_of_heaviest(self, tenant) -> tuple[object, Any]:
        clients = self._tenants[tenant]
        client = max(clients, key=lambda c: len(clients[c]))
        return client, clients[client][-1]

    def _drop(self, tenant, client) -> None:
        """Bookkeeping after one item of ``client`` left its line."""
        self.waiting -= 1
        self._counts[tenant] -= 1
        clients = self._tenants[tenant]
        if not clients[client]:
            del clients[client]
        if not clients:
            del self._tenants[tenant]
            del self._counts[tenant]
