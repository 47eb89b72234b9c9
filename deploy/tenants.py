"""Tenants: which API key belongs to whom (no Ray, no HTTP).

A keys file gives every tenant its own key (or keys): one ``tenant: key`` a line; blank
lines and lines that start with ``#`` are ignored (a ``#`` after a key is part of it). A key may be written as ``sha256:<64 hex digits>`` (its
SHA-256, so the file need not hold the secret: ``printf %s KEY | sha256sum``) or as
itself. One tenant may have several lines (a key being rotated); one key may not name
two tenants.

    # tenant: key
    acme: sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    globex: sk-globex-4b1d...

The table the front ends check a presented key against holds only SHA-256 digests
(``key_table``): the file is read once, where the app is built (a bad file stops the
start with its path, line and what is wrong), and the replicas get the digests. A single
``api_key`` is one more key, of the tenant ``default``.

The tenant, not the key and not the OpenAI ``user``, is the root of every namespace a
client has (deploy/openai_api.client_identity): its sessions, its checked grammar ids, its
share of the compile queues and of the checked-grammar store.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

DEFAULT_TENANT = "default"  # the tenant of the single api_key
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
MIN_KEY_CHARS = 8


def key_digest(key: str) -> str:
    """The hex SHA-256 of a key as sent (``Authorization: Bearer <key>``)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def parse_keys(text: str, source: str = "the keys file") -> dict[str, str]:
    """``{sha256 hex of a key: its tenant}`` from a keys file's text; ValueError naming
    ``source``, the line and what is wrong (never the key itself)."""
    table: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}, line {number}"
        tenant, sep, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep:
            raise ValueError(f"{where}: expected 'tenant: key' (or 'tenant: sha256:<hex>'), "
                             "found no ':'")
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{where}: the tenant name {tenant[:70]!r} is not 1-64 "
                             "letters, digits and '_.@-' (starting with a letter or digit)")
        if not key:
            raise ValueError(f"{where}: tenant {tenant!r} has no key")
        if key.lower().startswith("sha256:"):
            hashed = HASHED.fullmatch(key)
            if hashed is None:
                raise ValueError(f"{where}: tenant {tenant!r}: a hashed key is 'sha256:' "
                                 "and 64 hex digits (printf %s KEY | sha256sum)")
            digest = hashed.group(1).lower()
        else:
            if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
                raise ValueError(f"{where}: tenant {tenant!r}: a key is at least "
                                 f"{MIN_KEY_CHARS} characters, without spaces")
            digest = key_digest(key)
        other = table.get(digest)
        if other is not None:
            raise ValueError(f"{where}: this key is already given (to tenant {other!r}); "
                             "a key names one tenant, once")
        table[digest] = tenant
    if not table:
        raise ValueError(f"{source} names no tenant: write one 'tenant: key' a line")
    return table


def read_keys_file(path: str) -> dict[str, str]:
    """parse_keys() of the file at ``path``; ValueError naming it when it cannot be read."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"cannot read the keys file {path!r}: {reason}") from None
    return parse_keys(text, f"the keys file {path!r}")


def key_table(api_key: str | None, tenant_keys: dict[str, str] | None) -> dict[str, str]:
    """Every key the endpoint takes, as ``{sha256 hex: tenant}``: the keys file's
    (``tenant_keys``) and ``api_key``, a key of tenant ``default``. Empty: no key at all
    (the endpoint is open)."""
    table = dict(tenant_keys or {})
    if api_key:
        digest = key_digest(api_key)
        other = table.get(digest)
        if other is not None and other != DEFAULT_TENANT:
            raise ValueError(f"the API key is also in the keys file, as tenant {other!r}: a "
                             f"key names one tenant (the API key's is {DEFAULT_TENANT!r})")
        table[digest] = DEFAULT_TENANT
    return table


def tenant_of(table: dict[str, str], presented: str) -> str | None:
    """The tenant whose key ``presented`` is; None for a key not in ``table`` (or none).
    A dict lookup of the key's SHA-256: its time tells nothing about the stored keys."""
    if not presented:
        return None
    return table.get(key_digest(presented))
