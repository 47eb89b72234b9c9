"""How long `rayguide serve` takes to answer, cold and warm, stage by stage.

Starts `rayguide serve` as a user does (a real process, its own local Ray), polls
`/health` until 200, sends the README's first request (the curl it prints: a JSON schema at
server defaults), then Ctrl-C (SIGINT) and waits for the exit. The first start uses an
empty grammar disk folder (cold: the model already converted, as after an install); the
next ones reuse it (warm: a restart). Each start's stage lines (Ray, grammar cache, model
load, worker registration, Serve, app) are parsed from its log; the log is also checked
for warnings and tracebacks on a normal start and stop.

    python bench/startup.py [--quick | --smoke] [--json] [--no-record] [--warm-runs N]

``--json`` keys: ``warm_start_s`` (median of the warm starts), ``cold_start_s``,
``first_request_s`` (the first request after a warm start), ``stop_s``, ``log_warnings``.
``--quick`` makes one warm start instead of three; ``--smoke`` one cold start of the tiny
random-weight model (the warm figures are then null).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report  # noqa: E402
from cluster.launch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# in the order `rayguide serve` reports them
STAGES = [("ray", "Ray ready"), ("serve_controller", "Serve controller"), ("app", "app ready"),
          ("grammar_cache", "grammar cache ready"), ("workers", "loaded the model"),
          ("scheduler", "registered with the scheduler")]
STAGE_LINE = re.compile(r"rayguide: (.*) \((\d+(?:\.\d+)?) s\)\s*$")
# what a clean log must not hold (Ray's and Serve's own lines included)
ALARM = re.compile(r"Traceback|WARNING|Warning:|ERROR|Error:|failed", re.I)
SCHEMA = {"type": "object", "properties": {"planet": {"type": "string"}},
          "required": ["planet"]}


def _rayguide() -> list[str]:
    exe = Path(sys.executable).parent / "rayguide"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cli.main"]


def one_start(env: dict, workers: int, timeout_s: float = 600.0,
              model: str | None = None) -> dict:
    """One `rayguide serve`: seconds to /health 200, stage times, the first request's
    latency and answer, the stop's time, and the log's alarming lines."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(_rayguide() + ["serve", "--port", str(port), "--workers",
                                           str(workers)]
                            + (["--model", model] if model else []),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    result: dict = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("rayguide serve exited before it was healthy:\n"
                                   + "".join(lines[-30:]))
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        result["health_s"] = time.monotonic() - t0
        body = {"messages": [{"role": "user", "content": "Name a planet."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "p", "schema": SCHEMA}}}
        t1 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        result["first_request_s"] = time.monotonic() - t1
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        text = (choice.get("message") or {}).get("content") or ""
        try:
            valid = isinstance(json.loads(text).get("planet"), str)
        except (ValueError, AttributeError):
            valid = False
        result.update(status=r.status_code, finish=choice.get("finish_reason"),
                      valid=valid, answer=text[:80])
    finally:
        t2 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            result["exit"] = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["exit"] = "killed"
        result["stop_s"] = time.monotonic() - t2
        reader.join(timeout=10)
    stages = {}
    for line in lines:
        m = STAGE_LINE.search(line)
        if m:
            for name, marker in STAGES:
                if marker in m.group(1):
                    stages[name] = float(m.group(2))
    result["stages"] = stages
    result["alarms"] = [ln.strip()[:160] for ln in lines if ALARM.search(ln)]
    return result


def main() -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--warm-runs", type=int, default=None, help="warm starts (default 3; "
                    "--quick: 1)")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    warm_runs = (args.warm_runs if args.warm_runs is not None
                 else 0 if args.smoke else 1 if args.quick else 3)
    folder = tempfile.mkdtemp(prefix="rayguide-startup-")
    model = None
    if args.smoke:
        model = report.tiny_model(Path(folder) / "tiny-llama")
    env = dict(os.environ, RAYGUIDE_GRAMMAR_CACHE_DIR=folder, RAYGUIDE_GRAMMAR_DISK="1",
               PYTHONUNBUFFERED="1")
    runs = []
    for i in range(1 + warm_runs):
        kind = "cold" if i == 0 else "warm"
        print(f"startup: {kind} start {i}/{warm_runs} ...", file=sys.stderr, flush=True)
        res = one_start(env, args.workers, model=model)
        res["kind"] = kind
        runs.append(res)
        print(f"startup: {kind}: healthy after {res['health_s']:.1f} s, first request "
              f"{res['first_request_s']:.1f} s ({res['finish']}, valid {res['valid']}), "
              f"stop {res['stop_s']:.1f} s", file=sys.stderr, flush=True)
    cold, warm = runs[0], runs[1:]
    rows = []
    for r in runs:
        st = r["stages"]
        rows.append([r["kind"], round(r["health_s"], 1)]
                    + [st.get(name, "-") for name, _ in STAGES]
                    + [round(r["first_request_s"], 2), f"{r['finish']}, "
                       f"{'valid' if r['valid'] else 'INVALID'}", round(r["stop_s"], 1),
                       r["exit"], len(r["alarms"])])
    headers = (["start", "to /health 200 s"] + [f"{n} s" for n, _ in STAGES]
               + ["first request s", "first answer", "Ctrl-C to exit s", "exit status",
                  "alarming log lines"])
    body = report.table(headers, rows)
    which = "tiny random-weight model" if model else "default model"
    body += (f"\n\n{args.workers} worker(s), {which}, `rayguide serve` as a process. "
             "Cold: the model already converted, an empty grammar disk folder; warm: the "
             "next starts. Stage times are each stage's own, in the order reported (the "
             "runtime's actors load while Serve starts: a stage after `app` is what was "
             "left of the runtime's load). The first request is the README's first curl (a JSON "
             "schema at server defaults).")
    alarms = sorted({a for r in runs for a in r["alarms"]})
    if alarms:
        body += "\n\nAlarming log lines seen: " + "; ".join(f"`{a}`" for a in alarms[:8])
    figures = {
        "cold_start_s": round(cold["health_s"], 2),
        "warm_start_s": round(statistics.median(r["health_s"] for r in warm), 2)
        if warm else None,
        "first_request_s": round(warm[0]["first_request_s"], 3) if warm else None,
        "stop_s": round(statistics.median(r["stop_s"] for r in runs), 2),
        "log_warnings": len(alarms),
        "first_answer_valid": all(r["valid"] for r in runs),
    }
    report.finish("startup", body, figures, args)


if __name__ == "__main__":
    main()
