"""Bringing the runtime up on Ray, finding it, and taking it down.

up(): the grammar-cache actor, the scheduler and N worker actors (spread across nodes,
one GPU each on a GPU cluster), all named in the "rayguide" namespace so any process of
the cluster finds them; detached when the runtime runs as a service (``rayguide up``), so
it outlives the process that started it.

Why one module over 500 lines: the head ``rayguide up`` starts (its record, token, ports,
ingress directory and processes) and the actors it runs are started, found and stopped
together by ``up`` / ``down`` / ``status``; the ingress's environment itself is apart
(cluster/ingress.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray

from cluster.config import ClusterConfig
from cluster.ingress import choose_ingress, ingress_environment, remove_workdir, workdir_of
from grammar_cache.actor import ACTOR_NAME as CACHE_NAME
from grammar_cache.actor import get_or_create_actor, wait_ready
from scheduler.actor import NAMESPACE, SCHEDULER_NAME, WORKER_PREFIX, get_or_create_scheduler
from worker.actor import WorkerActor

logger = logging.getLogger(__name__)


def connect(address: str | None = None, *, start_head: bool = False,
            ingress: str = "haproxy") -> None:
    """Joins an existing cluster (``"auto"``, ``"host:port"``, ``"ray://..."``); with no
    address, starts a Ray instance: inside this process, or (``start_head``, for a runtime
    that must outlive this process) the head recorded by an earlier ``rayguide up``, else a
    new private head (:func:`start_ray_head`, with ``ingress``). Never attaches to some
    other Ray instance on the machine by accident."""
    if ray.is_initialized():
        return
    fast_death_notice()
    kwargs = dict(namespace=NAMESPACE, log_to_driver=False)
    if address is None and start_head:
        record = recorded_head()
        if record is None or not head_alive(record):
            record = start_ray_head(ingress=ingress)
        use_head_token(record)
        address = record["address"]
    if address is None:  # a new instance, even when `ray start` runs one on this machine
        kwargs.update(private_instance_options())
        address = "local"
    ray.init(address=address, **kwargs)


# Ray's switch for its metrics agent's Prometheus exporter (a RayConfig entry, also read
# from the environment by every Ray process)
METRICS_ENV = "RAY_enable_metrics_collection"


def private_instance_options(environ=os.environ) -> dict:
    """``ray.init`` options for a Ray instance started inside this process, reachable from
    this machine only as far as Ray allows: no dashboard (and so no job API), and no
    Prometheus exporter. Ray's metrics agent binds its exporter to every interface unless
    the node IP is loopback, and ``ray.init`` replaces a loopback ``_node_ip_address``
    with the routable one, so the exporter is turned off instead (rayguide's own counters
    are on the endpoint's ``/metrics``). ``RAY_enable_metrics_collection`` set in the
    environment wins."""
    options: dict = {"include_dashboard": False}
    if METRICS_ENV not in environ:
        options["_system_config"] = {"enable_metrics_collection": False}
    return options


# A head started by `rayguide up` -----------------------------------------------------------
#
# Recorded in $RAYGUIDE_RUN_DIR/head.json (default ~/.cache/rayguide/run), so `rayguide
# down` / `status` act on exactly that head by default and never on another Ray instance
# (a `rayguide serve`, someone's `ray start`) that happens to run on the machine.

RUN_DIR_ENV = "RAYGUIDE_RUN_DIR"
LOOPBACK = "127.0.0.1"


def run_dir() -> Path:
    return Path(os.environ.get(RUN_DIR_ENV) or Path.home() / ".cache" / "rayguide" / "run")


def head_record_path() -> Path:
    return run_dir() / "head.json"


def recorded_head() -> dict | None:
    try:
        return json.loads(head_record_path().read_text())
    except (OSError, ValueError):
        return None


def token_path() -> Path:
    """Where Ray looks for the token: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_token() -> Path | None:
    """The token file the head will require (created, mode 0600, when missing); None when
    the token comes from $RAY_AUTH_TOKEN instead."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = token_path()
    if not path.exists():
        from ray._private.authentication.authentication_token_generator import \
            generate_new_authentication_token

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate_new_authentication_token())
    return path


def use_head_token(record: dict) -> None:
    """Makes this process (and what it starts) authenticate to a token-auth head."""
    if record.get("token_path") and not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN_PATH"] = record["token_path"]
    set_auth_mode("token")


def fast_death_notice() -> None:
    """Ray waits up to 1 s for a dead actor's death cause before it fails the calls pending
    on it, so a caller learns that the scheduler (or a worker) died that much later; 100 ms
    is plenty for the GCS to answer. Set for this process and every Ray process it starts
    (a local instance, `ray start --head`); a value already in the environment wins."""
    os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "100")


def set_auth_mode(mode: str) -> None:
    """Sets RAY_AUTH_MODE for this process and what it starts. Ray reads the mode and the
    token once per process and caches them: refresh both (as Ray's own _enable_token_auth
    does), or an earlier read without them wins."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# Ray's worker processes listen on ports 10002-19999 by default (min/max_worker_port)
SERVER_PORTS_FROM = 20000
# Serve's replicas take their own HTTP ports from 30000-31000 under direct ingress (the
# HAProxy ingress, deploy/service.py): a server's port picked there could be taken by a
# replica before the server binds it
REPLICA_PORTS = range(30000, 31001)


def ephemeral_ports_from() -> int:
    """The low end of the kernel's range for the local ports of outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(preferred: int | None = None, host: str = "") -> int:
    """A port free on ``host`` now: ``preferred`` where it is free, else one between Ray's
    worker ports and the kernel's ephemeral range (the tests' and benches' servers take
    theirs here too). A port the system picks (bind to port 0) comes from the ephemeral
    range, where any outgoing connection made before the server binds it (a runtime's
    start makes hundreds) can take it first: Serve's proxy then failed with "Failed to
    bind to address" (a test's service start, 2026-11-29). Port 0 is the last resort."""
    below = ephemeral_ports_from()
    pick = random.SystemRandom()  # not the global generator: tests seed that one
    ports = [p for p in range(SERVER_PORTS_FROM, below) if p not in REPLICA_PORTS]
    spread = pick.sample(ports, 32) if len(ports) >= 64 else []
    for candidate in ([preferred] if preferred else []) + spread + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port")


def start_ray_head(*, listen: str = LOOPBACK, port: int | None = None,
                   timeout_s: float = 120.0, ingress: str = "haproxy") -> dict:
    """``ray start --head`` with token authentication on, its own ports and temp dir, the
    dashboard on ``listen`` (loopback by default), recorded for ``down`` / ``status``.

    ``ingress`` ("haproxy", or "proxy"; "proxy", logged, when no HAProxy binary is found)
    is what Serve puts in front of the replicas of any app deployed on this head later
    (``rayguide serve --address``, ``serve deploy``): Serve's controller and HAProxy
    manager read it from the environment of the raylet they start under, this one's.
    HAProxy gets a directory of its own (cluster/ingress.py ``ingress_environment``: its
    config, sockets and the loopback shim), recorded and removed with the head.

    Ray 2.60's GCS and raylet gRPC servers listen on every interface whatever the node IP
    (there is no bind option, and ``ray start`` turns a loopback node IP into the routable
    one), so the token is what keeps them closed; what rayguide can bind, it binds to
    ``listen``: the dashboard (and Ray's job API behind it) and the node IP it advertises.
    """
    token_file = ensure_token()
    stale = recorded_head()
    if stale is not None and not head_alive(stale):  # a head that died: its files go now
        remove_workdir(stale.get("ingress_dir"))
    temp_dir = run_dir() / "ray"
    if len(str(temp_dir)) > 40:
        # Ray's sockets live under <temp>/session_<date>_<pid>/sockets/ and a unix socket
        # path may not exceed 107 bytes: a long run dir gets a short sibling in /tmp
        import hashlib

        digest = hashlib.sha1(str(run_dir()).encode()).hexdigest()[:10]
        temp_dir = Path("/tmp") / f"rayguide-{os.getuid()}-{digest}"
    temp_dir.mkdir(parents=True, exist_ok=True)
    run_dir().mkdir(parents=True, exist_ok=True)
    gcs_port = free_port(port or 6379)
    if port and gcs_port != port:
        raise ConnectionError(f"port {port} is in use; pick another with --port")
    dashboard_port = free_port(8265)
    cmd = [ray_executable(), "start", "--head", "--disable-usage-stats",
           f"--port={gcs_port}", f"--temp-dir={temp_dir}",
           f"--dashboard-host={listen}", f"--dashboard-port={dashboard_port}",
           # Ray's fixed defaults (10001, 52365, ...) collide with any other Ray instance
           # on the machine: every port gets a free one
           f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}",
           f"--metrics-export-port={free_port()}"]
    if listen not in (LOOPBACK, "localhost", "0.0.0.0", "::"):
        cmd.append(f"--node-ip-address={listen}")
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    if _is_loopback(listen):
        # Ray's Prometheus exporter binds every interface unless the node IP is loopback,
        # which `ray start` never keeps: a this-machine-only head gets none (an
        # RAY_enable_metrics_collection of the user's wins)
        env.setdefault(METRICS_ENV, "0")
    if token_file is not None:
        env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    chosen = choose_ingress(ingress)
    ingress_env = ingress_environment(chosen)
    env.update(ingress_env)
    workdir = workdir_of(ingress_env)
    try:
        # its own session: the head's processes are found (and stopped) by its session id
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise TimeoutError(
                f"`ray start --head` did not finish in {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise ConnectionError("`ray start --head` failed:\n" + out[-2000:])
    except BaseException:
        remove_workdir(workdir)
        raise
    from ray._private.services import get_node_ip_address

    node_ip = listen if "--node-ip-address" in " ".join(cmd) else get_node_ip_address()
    record = {"address": f"{node_ip}:{gcs_port}", "gcs_port": gcs_port,
              "dashboard": f"http://{LOOPBACK if listen in ('0.0.0.0', '::') else listen}"
                           f":{dashboard_port}",
              "listen": listen, "temp_dir": str(temp_dir), "session_id": proc.pid,
              "token_path": str(token_file) if token_file else None,
              "ingress": chosen, "ingress_dir": workdir, "started_at": time.time()}
    head_record_path().write_text(json.dumps(record, indent=1))
    return record


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def head_processes(record: dict) -> list[int]:
    """The live processes of a recorded head: those in its session whose command line is
    Ray's or names its HAProxy directory (a pid or session id reused by something else is
    left alone)."""
    workdir = record.get("ingress_dir")
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != record["session_id"]:  # field 6: session id
                continue
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if "ray" in cmdline or (workdir and workdir in cmdline):
            pids.append(int(stat.parent.name))
    return pids


def head_alive(record: dict) -> bool:
    return any("gcs_server" in _cmdline(pid) and record["temp_dir"] in _cmdline(pid)
               for pid in head_processes(record))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def stop_ray_head(record: dict, grace_s: float = 5.0) -> int:
    """Stops the head ``rayguide up`` started (its processes only, never `ray stop`, which
    stops every Ray instance on the machine); forgets the record. Returns how many
    processes were signalled. The head's HAProxy directory goes with it."""
    pids = head_processes(record)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        if not any(_alive(p) for p in pids):
            break
    remove_workdir(record.get("ingress_dir"))
    if recorded_head() == record:
        head_record_path().unlink(missing_ok=True)
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def ray_executable() -> str:
    """The `ray` command of this environment (a virtualenv's bin/ need not be on PATH)."""
    local = os.path.join(os.path.dirname(sys.executable), "ray")
    return local if os.path.exists(local) else "ray"


# the names of the actors this process created (``up``): what ``down()`` stops by default
_created_here: set[str] = set()


def up(config: ClusterConfig, *, detached: bool = False, wait: bool = True) -> dict:
    """Starts (or finds) every component; returns their handles. Keep them: actors that are
    not detached end when the last handle to them goes away."""
    connect(config.address, start_head=detached, ingress=config.serve.ingress)
    names = [CACHE_NAME, SCHEDULER_NAME] + [f"{WORKER_PREFIX}{i}"
                                            for i in range(config.num_workers)]
    existing = set(_named_actors())
    _created_here.update(n for n in names if n not in existing)
    lifetime = "detached" if detached else None
    cache_config = config.grammar_cache
    cache = get_or_create_actor(cache_config, detached=detached,
                                resources=config.control_resources)
    scheduler = get_or_create_scheduler(config.scheduler, detached=detached,
                                        resources=config.control_resources)
    # workers compile through the cache actor with the cluster's compile limits (their
    # fallback compiles too)
    # (grammar_cache: {shared: false}: each worker compiles by itself, the baseline)
    # (not shared: each worker compiles in child processes of its own, under these limits)
    cache_link = (CACHE_NAME, NAMESPACE, cache_config)
    workers = []
    for i in range(config.num_workers):
        workers.append(WorkerActor.options(
            name=f"{WORKER_PREFIX}{i}", namespace=NAMESPACE, get_if_exists=True,
            lifetime=lifetime, scheduling_strategy="SPREAD",
            num_cpus=config.worker.num_cpus, num_gpus=config.worker.num_gpus,
        ).remote(config.engine, f"w{i}", (SCHEDULER_NAME, NAMESPACE), cache_link))
    if wait:
        ray.get([w.health.remote() for w in workers])
        wait_ready(cache)  # its compile processes are up (workers' first fetches wait for it)
        _wait_registered(scheduler, config.num_workers)
    return {"cache": cache, "scheduler": scheduler, "workers": workers}


def wait_cache_ready(cache, timeout_s: float = 120.0) -> None:
    """Blocks until the grammar cache actor can compile (front ends call it through here:
    deploy/ reaches the runtime only through cluster/)."""
    wait_ready(cache, timeout_s)


def _wait_registered(scheduler, n: int, timeout_s: float = 120.0) -> None:
    """Until ``n`` workers have registered and sent their first load report (what routing,
    /health and /metrics read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = ray.get(scheduler.stats.remote())["workers"].values()
        if sum("total_blocks" in row for row in rows) >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} workers registered with the scheduler")
        time.sleep(0.1)


def handles() -> dict:
    """The running runtime's actors (raises ValueError naming what is missing)."""
    try:
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        cache = ray.get_actor(CACHE_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ValueError("no rayguide runtime on this cluster; start one with `rayguide up`") \
            from None
    workers = [ray.get_actor(a["name"], namespace=NAMESPACE)
               for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == NAMESPACE and a["name"].startswith(WORKER_PREFIX)]
    return {"cache": cache, "scheduler": scheduler, "workers": workers}


def status() -> dict:
    """Each worker's node, device, load, and the cache and scheduler stats."""
    h = handles()
    return {"scheduler": ray.get(h["scheduler"].stats.remote()),
            "grammar_cache": ray.get(h["cache"].stats.remote()),
            "workers": ray.get([w.load.remote() for w in h["workers"]])}


def _named_actors() -> list[str]:
    """The names of the rayguide runtime's actors on the cluster (the cache, the scheduler,
    the workers; other actors that share the namespace are not the runtime's)."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE
            and (a["name"] in (CACHE_NAME, SCHEDULER_NAME)
                 or a["name"].startswith(WORKER_PREFIX))]


def down(*, every: bool = False) -> int:
    """Kills the runtime actors this process created with ``up`` (``every``: all of the
    runtime's actors on the cluster, whoever started them: ``rayguide down``); returns how
    many it killed (one that went away meanwhile is not counted). Actors of the namespace
    that are not the runtime's are never touched."""
    names = [n for n in _named_actors() if every or n in _created_here]
    killed = 0
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # it went away between the listing and the lookup
            continue
        ray.kill(actor, no_restart=True)
        _created_here.discard(name)
        killed += 1
    return killed


def connect_target(address: str | None) -> dict | None:
    """Connects ``down`` / ``status`` to what they act on: ``address`` when given, else the
    head ``rayguide up`` recorded on this machine (returned). Never ``auto``: that attaches
    to whatever Ray instance runs here, e.g. a ``rayguide serve``, whose actors ``down``
    would then kill."""
    if address:
        connect(address)
        return None
    record = recorded_head()
    if record is None:
        raise ConnectionError(
            f"no Ray head started by `rayguide up` is recorded in {head_record_path()}; "
            "pass --address HOST:PORT (or ray://HOST:PORT) of the cluster to act on")
    if not head_alive(record):
        raise ConnectionError(
            f"the Ray head `rayguide up` started ({record['address']}) is no longer "
            f"running; start it again with `rayguide up`, or pass --address")
    use_head_token(record)
    connect(record["address"])
    return record


def _uptime(seconds: float | None) -> str:
    if not seconds:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def status_table(st: dict) -> str:
    """One row per worker, then the cache and the scheduler: what an operator looks at.
    ``prefix hits``: of the prompt tokens the worker's prefix cache looked up, the share it
    found cached ("-" before any)."""
    header = ("worker  node          device  model                 running  waiting  "
              "KV used         sessions  grammars  prefix hits  uptime")
    rows = [header]
    for w in sorted(st["workers"], key=lambda w: w["worker_id"]):
        total = w.get("total_blocks") or 0
        used = total - (w.get("free_blocks") or 0)
        kv = f"{used}/{total} ({100 * used / total:.0f}%)" if total else "-"
        grammars = (w.get("grammar_cache") or {}).get("compiles", "-")
        query = w.get("prefix_cache_query_tokens", 0)
        hits = f"{100 * w.get('prefix_cache_hit_tokens', 0) / query:.0f}%" if query else "-"
        rows.append(f"{w['worker_id']:<7} {str(w.get('node_id', ''))[:12]:<13} "
                    f"{w.get('device', '-'):<7} {str(w.get('model', '-'))[:21]:<21} "
                    f"{w.get('running', 0):>7}  {w.get('waiting', 0):>7}  {kv:<15} "
                    f"{w.get('live_sessions', 0):>8}  {grammars:>8}  {hits:>11}  "
                    f"{_uptime(w.get('uptime_s'))}")
    if not st["workers"]:
        rows.append("(no workers)")
    c = st["grammar_cache"]
    rows.append(f"grammar cache: {c.get('entries', 0)} grammars cached "
                f"({c.get('bytes', 0) / 1e6:.1f} MB), {c.get('compiles', 0)} compiles, "
                f"{c.get('hits', 0)} hits, {c.get('errors', 0)} errors, "
                f"{c.get('timeouts', 0)} timeouts, {c.get('disk_hits', 0)} disk hits, "
                f"{c.get('compiles_per_distinct_grammar', 0):.2f} compiles per distinct "
                f"grammar ({c.get('leases', 0)} in the asking worker), {c.get('hot', 0)} hot; "
                "workers: " + ", ".join(
                    f"{sum((w.get('grammar_client') or {}).get(k, 0) for w in st['workers'])}"
                    f" {k.replace('_', ' ')}" for k in ("local_fallbacks", "prefetches",
                                                       "disk_hits", "grammar_request_waits",
                                                       "worker_compile_timeouts")))
    s = st["scheduler"]
    rows.append(f"scheduler: {len(s['workers'])} workers registered, {s['sessions']} sessions, "
                f"{s['routes']} routes ({s.get('prefix_routes', 0)} by prefix), "
                f"{s.get('rejected', 0)} rejected (overloaded)")
    return "\n".join(rows)
