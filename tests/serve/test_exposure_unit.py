"""Who can reach what (issue 28, "Exposure" and "Leftovers"), without Ray: an open
non-loopback endpoint is refused, loopback requests need a loopback Host and Origin, Ray's
metrics exporter is off on the instances rayguide starts, the cache is loaded from only
when it is this user's alone, hub models are downloaded only when asked for and pinned,
and a stop or a failed start removes exactly what this process made."""

import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from cli.main import main
from cluster import launch
from deploy import exposure
from deploy import serve_app
from deploy.errors import APIError
from deploy.settings import AppSettings

pytestmark = pytest.mark.unit

SERVER = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)
METRICS_ENV = "RAY_enable_metrics_collection"  # Ray's switch for its Prometheus exporter


@pytest.fixture(autouse=True)
def keep_signal_handlers(monkeypatch):
    """`rayguide serve` installs Ctrl-C handlers; the test process keeps its own."""
    import signal

    monkeypatch.setattr(signal, "signal", lambda *_a: None)


def raising(exc: BaseException):
    def call(*_a, **_k):
        raise exc
    return call


# 1. rayguide serve on a non-loopback address --------------------------------------------

@pytest.mark.parametrize("host, key, allow_open, refused", [
    ("127.0.0.1", None, False, False),
    ("localhost", None, False, False),
    ("::1", None, False, False),
    ("0.0.0.0", None, False, True),
    ("::", None, False, True),
    ("192.168.1.5", None, False, True),
    ("myhost.example", None, False, True),
    ("0.0.0.0", "secret", False, False),
    ("0.0.0.0", None, True, False),
])
def test_open_refusal(host, key, allow_open, refused):
    reason = exposure.open_refusal(host, key, allow_open)
    assert (reason is not None) == refused
    if refused:
        assert "--api-key" in reason and "RAYGUIDE_API_KEY" in reason
        assert "--allow-open" in reason


class _Started(Exception):
    pass


@pytest.fixture
def no_start(monkeypatch):
    """service.start records its call and stops there; nothing of Ray starts."""
    from deploy import service

    calls = []

    def start(config, **kwargs):
        calls.append(kwargs)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(service, "start", start)
    monkeypatch.delenv("RAYGUIDE_API_KEY", raising=False)
    monkeypatch.setenv(METRICS_ENV, "1")  # run_serve leaves it set
    return calls


def test_serve_on_every_interface_without_a_key_is_refused(no_start, capsys):
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "RAYGUIDE_API_KEY" in err and "--allow-open" in err
    assert no_start == []  # refused before anything started


def test_serve_open_on_purpose_warns_loudly(no_start, capsys):
    assert main(["serve", "--host", "0.0.0.0", "--allow-open"]) == 1  # the test's stop
    assert "WARNING" in capsys.readouterr().err and len(no_start) == 1


def test_serve_with_a_key_or_on_loopback_starts(no_start, monkeypatch, capsys):
    assert main(["serve", "--host", "0.0.0.0", "--api-key", "k"]) == 1
    monkeypatch.setenv("RAYGUIDE_API_KEY", "k2")
    assert main(["serve", "--host", "0.0.0.0"]) == 1
    monkeypatch.delenv("RAYGUIDE_API_KEY")
    assert main(["serve"]) == 1
    assert len(no_start) == 3 and "WARNING" not in capsys.readouterr().err


# 2. Host and Origin on loopback -----------------------------------------------------------

LOOP = ("127.0.0.1", 8000)


@pytest.mark.parametrize("server, host, origin, key, status", [
    (LOOP, "127.0.0.1:8000", None, False, None),  # the openai client
    (LOOP, "localhost:8000", None, False, None),
    (LOOP, "[::1]:8000", None, False, None),
    (LOOP, "app.localhost:8000", None, False, None),
    (LOOP, None, None, False, None),  # HTTP/1.0, no Host: not a browser
    (LOOP, "evil.example:8000", None, False, 421),  # DNS rebinding
    (LOOP, "evil.example:8000", None, True, 421),
    (LOOP, "127.0.0.1.evil.example", None, False, 421),
    (LOOP, "127.0.0.1:8000", "http://localhost:3000", False, None),
    (LOOP, "127.0.0.1:8000", "https://evil.example", False, 403),  # a web page's POST
    (LOOP, "127.0.0.1:8000", "null", False, 403),  # a sandboxed frame, a file:// page
    (LOOP, "127.0.0.1:8000", "https://evil.example", True, None),  # the key protects
    (("192.168.1.5", 8000), "evil.example", "https://evil.example", False, None),
    (None, "evil.example", "https://evil.example", False, None),
])
def test_request_refusal(server, host, origin, key, status):
    refusal = exposure.request_refusal(server, host, origin, api_key_configured=key,
                                       machine_names=frozenset({"thisbox"}))
    assert (refusal.status if refusal else None) == status


def test_this_machines_own_name_is_not_rebinding():
    assert exposure.request_refusal(LOOP, "thisbox:8000", None, api_key_configured=False,
                                    machine_names=frozenset({"thisbox"})) is None


def _request(host=None, origin=None, server=LOOP, auth=None):
    headers = [(k.encode(), v.encode()) for k, v in
               (("host", host), ("origin", origin), ("authorization", auth)) if v]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": headers, "server": server, "client": ("127.0.0.1", 5),
                    "query_string": b""})


@pytest.mark.parametrize("api_key", [None, "k"])
def test_the_edge_refuses_a_foreign_host(api_key):
    server = SimpleNamespace(settings=AppSettings(api_key=api_key))
    auth = f"Bearer {api_key}" if api_key else None
    SERVER._auth(server, _request("127.0.0.1:8000", auth=auth))  # passes
    with pytest.raises(APIError) as info:
        SERVER._auth(server, _request("attacker.example:8000", auth=auth))
    assert info.value.status == 421 and info.value.code == "invalid_host"


def test_the_edge_refuses_a_foreign_origin_without_a_key():
    server = SimpleNamespace(settings=AppSettings(api_key=None))
    with pytest.raises(APIError) as info:
        SERVER._auth(server, _request("127.0.0.1:8000", origin="https://attacker.example"))
    assert info.value.status == 403
    keyed = SimpleNamespace(settings=AppSettings(api_key="k"))
    SERVER._auth(keyed, _request("127.0.0.1:8000", origin="https://attacker.example",
                                 auth="Bearer k"))


# 3. Ray's metrics exporter ----------------------------------------------------------------

def test_private_instance_has_no_dashboard_and_no_metrics_exporter():
    assert launch.METRICS_ENV == METRICS_ENV
    options = launch.private_instance_options({})
    assert options["include_dashboard"] is False
    assert options["_system_config"] == {"enable_metrics_collection": False}
    # a user's own setting wins
    assert "_system_config" not in launch.private_instance_options({METRICS_ENV: "1"})


def test_connect_starts_a_local_instance_with_those_options(monkeypatch):
    seen = {}
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.delenv(METRICS_ENV, raising=False)
    launch.connect(None)
    assert seen["address"] == "local" and seen["include_dashboard"] is False
    assert seen["_system_config"] == {"enable_metrics_collection": False}


def test_serve_turns_the_exporter_off_for_its_private_instance(no_start, monkeypatch):
    monkeypatch.delenv(METRICS_ENV)
    seen = []
    from deploy import service

    def start(config, **kwargs):
        seen.append(os.environ.get(METRICS_ENV))
        raise ValueError("stop")

    monkeypatch.setattr(service, "start", start)
    main(["serve"])
    assert seen == ["0"]


@pytest.mark.parametrize("listen, exporter_env", [("127.0.0.1", "0"), ("10.0.0.7", None)])
def test_loopback_head_gets_no_metrics_exporter(monkeypatch, tmp_path, listen,
                                                exporter_env):
    monkeypatch.setenv("RAYGUIDE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    monkeypatch.delenv(METRICS_ENV, raising=False)
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env, **_kw):
            seen["env"], self.pid, self.returncode = env, 4242, 0

        def communicate(self, timeout=None):
            return "", None

    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    record = launch.start_ray_head(listen=listen, ingress="proxy")  # no HAProxy files
    Path(record["temp_dir"]).rmdir()  # a long run dir gets a short one in /tmp
    assert seen["env"].get(METRICS_ENV) == exporter_env


# 4. the cache directory -------------------------------------------------------------------

@pytest.fixture
def cache(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    monkeypatch.setenv("RAYGUIDE_CACHE_DIR", str(root))
    return root


def test_cache_folders_are_created_private_whatever_the_umask(cache):
    from worker.models.gguf_convert import cache_subdir, check_private

    old = os.umask(0o002)
    try:
        kernels = cache_subdir("kernels")
    finally:
        os.umask(old)
    for folder in (cache, kernels):
        assert not folder.stat().st_mode & 0o022
    check_private(kernels)


def test_group_or_world_writable_cache_is_refused(cache):
    from worker.models.gguf_convert import cache_subdir, check_private

    lib = cache_subdir("kernels") / "k.so"
    lib.write_bytes(b"")
    lib.chmod(0o644)
    check_private(lib)
    for item, mode in ((cache, 0o777), (lib.parent, 0o775), (lib, 0o666)):
        old = stat.S_IMODE(item.stat().st_mode)
        item.chmod(mode)
        with pytest.raises(PermissionError, match="chmod go-w") as info:
            check_private(lib)
        assert str(item) in str(info.value) and "RAYGUIDE_CACHE_DIR" in str(info.value)
        item.chmod(old)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file away")
def test_cache_owned_by_someone_else_is_refused(cache):
    from worker.models.gguf_convert import cache_subdir, check_private

    lib = cache_subdir("kernels") / "k.so"
    lib.write_bytes(b"")
    os.chown(lib, 12345, -1)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        check_private(lib)


def test_kernel_from_an_unsafe_cache_is_rebuilt_privately(cache, tmp_path):
    import shutil

    from worker.models import native

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    source = tmp_path / "tiny.c"
    source.write_text("int tiny(void) { return 7; }\n")
    safe = native.build(source)
    assert safe.parent == native.cache_dir()
    native.cache_dir().chmod(0o777)  # anyone could have replaced the library
    rebuilt = native.build(source)
    assert rebuilt.parent != native.cache_dir() and rebuilt.name == safe.name
    import ctypes
    assert ctypes.CDLL(str(rebuilt)).tiny() == 7


def test_converted_model_from_an_unsafe_cache_is_refused(cache, tmp_path, monkeypatch):
    from worker.models import gguf_convert

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    out = gguf_convert.converted_dir_for(gguf)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_convert, "_is_complete", lambda _out: True)
    for folder in (cache, cache / "models", out):
        folder.chmod(0o755)
    assert gguf_convert.ensure_converted(gguf) == out
    (out / "config.json").chmod(0o666)
    with pytest.raises(PermissionError, match="config.json"):
        gguf_convert.ensure_converted(gguf)


# 5. hub models: only when asked for, and pinned ------------------------------------------

def test_a_bare_hub_id_is_never_downloaded(monkeypatch):
    import huggingface_hub

    from worker.models.loader import resolve_model_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda **kw: pytest.fail("downloaded without being asked"))
    with pytest.raises(FileNotFoundError, match="hf:HuggingFaceTB/SmolLM2-135M@REVISION"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M")


@pytest.mark.parametrize("ref", ["hf:", "hf:name", "hf:org/", "hf:org/name@", "hf:a/b/c"])
def test_a_malformed_hub_reference_names_the_form(ref):
    from worker.models.loader import resolve_model_dir

    with pytest.raises(ValueError, match="hf:org/name@revision"):
        resolve_model_dir(ref)


def test_a_pinned_hub_model_is_read_from_the_local_cache_first(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from worker.models.loader import resolve_model_dir

    calls, downloaded = [], []

    def snapshot_download(**kw):
        calls.append(kw)
        if kw.get("local_files_only") and not downloaded:
            raise LocalEntryNotFoundError("not yet")
        downloaded.append(True)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model_dir("hf:org/name@abc123") == tmp_path  # downloaded once
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert all(c["repo_id"] == "org/name" and c["revision"] == "abc123" for c in calls)
    calls.clear()
    assert resolve_model_dir("hf:org/name@abc123") == tmp_path  # then no network
    assert len(calls) == 1 and calls[0]["local_files_only"]
    calls.clear()
    resolve_model_dir("hf:org/name")  # unpinned: asked for, warned about
    assert calls == [{"repo_id": "org/name", "revision": None,
                      "allow_patterns": calls[0]["allow_patterns"]}]


# 6. leftovers: a stop removes what it started, a failed start leaves no app -----------------

@pytest.fixture
def fake_cluster(monkeypatch):
    """Named actors on a fake cluster: the runtime's, and a user's in the same namespace."""
    actors = {"rayguide_scheduler", "rayguide_grammar_cache", "rayguide_worker_0",
              "rayguide_worker_1", "my_own_actor"}
    killed = []
    monkeypatch.setattr(launch.ray.util, "list_named_actors", lambda all_namespaces: [
        {"name": n, "namespace": launch.NAMESPACE} for n in sorted(actors)])
    monkeypatch.setattr(launch.ray, "get_actor", lambda name, namespace: name)

    def kill(actor, no_restart):
        killed.append(actor)
        actors.discard(actor)

    monkeypatch.setattr(launch.ray, "kill", kill)
    monkeypatch.setattr(launch, "_created_here", set())
    return SimpleNamespace(actors=actors, killed=killed)


def test_down_stops_only_what_this_process_created(fake_cluster):
    launch._created_here.add("rayguide_worker_1")
    assert launch.down() == 1 and fake_cluster.killed == ["rayguide_worker_1"]
    assert launch.down(every=True) == 3  # `rayguide down`: the whole runtime
    assert "my_own_actor" in fake_cluster.actors  # never an actor not of the runtime


def test_up_records_the_actors_it_creates(fake_cluster, monkeypatch):
    from cluster.config import ClusterConfig

    fake_cluster.actors.discard("rayguide_worker_1")
    fake_cluster.actors.discard("rayguide_scheduler")
    monkeypatch.setattr(launch, "connect", lambda *a, **k: None)
    monkeypatch.setattr(launch, "get_or_create_actor", lambda *a, **k: "cache")
    monkeypatch.setattr(launch, "get_or_create_scheduler", lambda *a, **k: "scheduler")
    fake_worker = SimpleNamespace(options=lambda **kw: SimpleNamespace(
        remote=lambda *a: kw["name"]))
    monkeypatch.setattr(launch, "WorkerActor", fake_worker)
    start = launch.up  # connect and every actor are faked above: no Ray starts
    start(ClusterConfig(num_workers=2), wait=False)
    assert launch._created_here == {"rayguide_scheduler", "rayguide_worker_1"}


@pytest.mark.parametrize("address, deleted", [("auto", True), (None, False)])
def test_a_failed_serve_start_leaves_no_app(monkeypatch, address, deleted, capsys):
    from ray import serve

    from deploy import service

    calls = []
    monkeypatch.setattr(service, "start", raising(RuntimeError("the Serve app did not start")))
    monkeypatch.setenv(METRICS_ENV, "1")
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("delete", name)))
    monkeypatch.setattr(launch, "down", lambda **kw: calls.append(("down", kw)) or 0)
    monkeypatch.delenv("RAYGUIDE_API_KEY", raising=False)
    argv = ["serve"] + (["--address", address] if address else [])
    assert main(argv) == 1
    assert (("delete", service.APP_NAME) in calls) == deleted
    assert ("down", {}) in calls  # only what this process created
    assert "could not start" in capsys.readouterr().err


def test_a_crash_while_serving_still_stops_the_service(monkeypatch):
    import threading

    from deploy import service

    stopped = []
    monkeypatch.setattr(service, "start", lambda *a, **k: SimpleNamespace(
        url="http://127.0.0.1:8000", curl_example=lambda: ""))
    monkeypatch.setattr(service, "heal", raising(KeyError("a bug in the loop")))
    monkeypatch.setattr(service, "stop", lambda svc: stopped.append(svc))
    monkeypatch.setattr(threading.Event, "wait", lambda self, t=None: False)
    with pytest.raises(KeyError):
        main(["serve", "--address", "auto"])
    assert len(stopped) == 1
