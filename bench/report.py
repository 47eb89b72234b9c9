"""Shared output for the benchmarks: a markdown table on stdout, the same table recorded
in docs/benchmarks.md (between markers named after the benchmark), and with --json one
JSON object of figures as the last line.

Every bench takes ``--quick`` (the same shape, scaled down: figures worth reading) and
``--smoke`` (seconds, the tiny random-weight model where the model does not matter: the
same code path, figures meaningless; tests/serve/test_bench_smoke.py runs it), neither recorded."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import math
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from core import percentile as shared

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return (f"{os.cpu_count()} CPU cores ({cpu}){gpu}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def record(name: str, body: str) -> None:
    """Replaces this benchmark's section of docs/benchmarks.md (adds it if missing)."""
    cmd = "python " + " ".join([f"bench/{Path(sys.argv[0]).name}"] + sys.argv[1:])
    section = (f"<!-- bench:{name} -->\n### {name}\n\n"
               f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Command: `{cmd}`\n\n"
               f"{body}\n<!-- /bench:{name} -->")
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + section + "\n")
    DOCS.write_text(text)


# the tree's one percentile (core/percentile.py); nan without samples
percentile = functools.partial(shared.percentile, default=math.nan)


_REPEAT = re.compile(r"(.{4,64}?)\1{2,}", re.S)


def repeated_span(text: str) -> str | None:
    """The first span of 4-64 characters holding a letter that ``text`` repeats at least
    three times in a row (``"eggs", "eggs", "eggs", ``, ``Ko...Ko...Ko...``), else None:
    what the benches count as an output that still loops. Digits and punctuation alone do
    not count (``[1, 1, 1]`` may be what was asked)."""
    for m in _REPEAT.finditer(text):
        if any(c.isalpha() for c in m.group(1)):
            return m.group(1)
    return None


def emit_json(figures: dict) -> None:
    print(json.dumps(figures, sort_keys=True))


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="reduced run, same shape")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds, tiny model where it does not matter: checks the bench runs")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON last")
    ap.add_argument("--no-record", action="store_true", help="do not update docs/benchmarks.md")
    return ap


def finish(name: str, body: str, figures: dict, args) -> None:
    """Prints the table, records full runs in docs/benchmarks.md, then the JSON line."""
    print(body)
    if not args.no_record and not args.quick and not getattr(args, "smoke", False):
        record(name, body)
    if args.json:
        emit_json(figures)



# A folder holding the tiny model already (it is deterministic: seed 0): the benches use it
# instead of writing their own. tests/serve/test_bench_smoke.py passes the test session's,
# so each smoke skips the build (3-9 s each, most of it importing transformers).
TINY_MODEL_ENV = "RAYGUIDE_TINY_MODEL"


def tiny_model(path=None) -> str:
    """The tiny random-weight model (the real tokenizer): the folder $RAYGUIDE_TINY_MODEL
    names, else one written to ``path`` (default: a new temporary folder)."""
    import os
    import tempfile

    given = os.environ.get(TINY_MODEL_ENV)
    if given:
        return given
    from worker.models.tiny_model import build_tiny_model
    return str(build_tiny_model(path or tempfile.mkdtemp(prefix="rayguide-smoke-")))


def smoke_model() -> str:
    """The tiny random-weight model of a --smoke run (``tiny_model``)."""
    return tiny_model()


# A --smoke run's answers: the tiny random model writes to the budget, and the server's
# default budget (512) made a smoke of a few requests take most of a minute
SMOKE_MAX_TOKENS = 48


def smoke_app_args(args) -> dict | None:
    """The endpoint's arguments of a served bench: with --smoke, a small default budget for
    requests that set none (the client libraries' calls)."""
    return {"default_max_tokens": SMOKE_MAX_TOKENS} if args.smoke else None


@contextlib.contextmanager
def served(args) -> Iterator[tuple[str, str]]:
    """`rayguide serve` with one worker of ``args.threads`` threads on a free port (the
    tiny model with --smoke, else the default model): yields its URL and model name, and
    stops it."""
    import httpx

    from cluster.config import ClusterConfig
    from cluster.launch import free_port
    from deploy import service

    port = free_port()  # outside the range of outgoing connections
    svc = service.start(ClusterConfig(model=smoke_model() if args.smoke else None,
                                      num_workers=1, worker={"num_threads": args.threads}),
                        port=port, app_args=smoke_app_args(args))
    try:
        yield svc.url, httpx.get(svc.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    finally:
        service.stop(svc)
