"""Who may reach the endpoint: pure checks, no I/O.

- ``open_refusal``: serving on a non-loopback address needs an API key, or an explicit
  opt-in: ``rayguide serve --allow-open``, or ``allow_open: true`` in the app's arguments
  when the app is built from a Serve config (``deploy/serve_app.build_app`` checks the
  Serve proxies' ``http_options.host``, and each replica checks again as it starts).
- ``request_refusal``: a request that arrived over loopback must name a loopback host
  (``Host``), else a web page's DNS name that an attacker re-pointed at 127.0.0.1 could
  read the answers (DNS rebinding); and a browser's ``Origin`` must be loopback too, else
  any web page the user opens could POST to the endpoint. With an API key configured the
  ``Origin`` check is skipped: a page cannot know the key, and a cross-origin request
  carrying ``Authorization`` needs a CORS preflight the endpoint never grants.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "localhost.")


def is_loopback(host: str | None) -> bool:
    """``localhost``, ``*.localhost`` (RFC 6761: browsers resolve it to loopback
    themselves), 127.0.0.0/8 and ::1; brackets around an IPv6 address allowed."""
    if not host:
        return False
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES or name.rstrip(".").endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def open_refusal(host: str, api_key: str | bool | None, allow_open: bool, *,
                 serve_config: bool = False) -> str | None:
    """Why the endpoint must not listen on ``host`` as configured, or None (it may). A
    non-loopback address with no API key (``api_key``: the key, or any true value when a
    keys file gives keys) and no ``allow_open`` is refused. The message
    says what to change in ``rayguide serve``'s flags, or (``serve_config``) in a Serve
    config file."""
    if is_loopback(host) or api_key or allow_open:
        return None
    if serve_config:
        return (f"refusing to serve on {host} (the Serve config's http_options.host) without "
                "an API key: anyone who can reach this address could use the endpoint. Set "
                "api_key or keys_file in the app's args (or RAYGUIDE_API_KEY / "
                "RAYGUIDE_KEYS_FILE in the environment), or "
                "allow_open: true if an open endpoint is what you want (e.g. behind your own "
                "authenticating proxy), or set http_options.host to 127.0.0.1")
    return (f"refusing to serve on {host} without an API key: anyone who can reach this "
            "address could use the endpoint. Pass --api-key KEY (or set RAYGUIDE_API_KEY) "
            "or --keys-file PATH (one key per tenant), "
            "or --allow-open if an open endpoint is what you want (e.g. behind your own "
            "authenticating proxy), or serve on 127.0.0.1")


def host_of(authority: str) -> str:
    """The host part of a ``Host`` header value (``name:port``, ``[v6]:port``)."""
    authority = authority.strip()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    if authority.count(":") == 1:
        return authority.partition(":")[0]
    return authority  # a bare name, or an unbracketed IPv6 address


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    code: str


def _machine_names() -> frozenset[str]:
    # this machine's own name may resolve to 127.0.1.1 (Debian's /etc/hosts); an attacker
    # controls only names in their own domain, never this one
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return frozenset(n for n in names if n)


MACHINE_NAMES = _machine_names()


def request_refusal(server: tuple | list | None, host: str | None, origin: str | None, *,
                    api_key_configured: bool,
                    machine_names: frozenset[str] = MACHINE_NAMES) -> Refusal | None:
    """Why a request must be refused, or None. ``server`` is the ASGI scope's
    ``(local address, port)`` of the connection; only a connection that arrived over
    loopback is checked (an endpoint listening on another address is exposed on purpose,
    with an API key or ``--allow-open``). ``host`` and ``origin`` are the headers, absent
    as None (a client that sends no ``Host``, e.g. HTTP/1.0, is not a browser)."""
    if not server or not is_loopback(str(server[0])):
        return None
    if host is not None:
        name = host_of(host).lower()
        if not is_loopback(name) and name not in machine_names:
            return Refusal(421, f"Host {host!r} is not this server's: on a loopback address "
                                "the endpoint answers only requests for localhost or a "
                                "loopback IP (e.g. http://127.0.0.1:PORT)", "invalid_host")
    if origin is not None and not api_key_configured:
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not is_loopback(parts.hostname):
            return Refusal(403, f"cross-origin request from {origin!r} refused: a web page "
                                "may not call this endpoint unless it is served from "
                                "localhost (or the endpoint has an API key)",
                           "forbidden_origin")
    return None


def refusal_of(request, *, api_key_configured: bool) -> Refusal | None:
    """``request_refusal`` for a Starlette request: its connection's local address (the
    ASGI scope's ``server``; a request without a scope is not checked) and its headers."""
    scope = getattr(request, "scope", None) or {}
    return request_refusal(scope.get("server"), request.headers.get("host"),
                           request.headers.get("origin"),
                           api_key_configured=api_key_configured)
