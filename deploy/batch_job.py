"""Batch job: run a JSONL file of (guided) generation requests through the rayguide runtime.

    ray job submit --working-dir . -- python -m deploy.batch_job \\
        --input /data/in.jsonl --output /data/out.jsonl [--schema schema.json]

Input: one JSON object per line (blank lines are ignored).

- ``prompt`` (text, sent as is) or ``messages`` (chat messages, rendered with the model's
  chat template); exactly one of them.
- at most one format: ``schema`` (a JSON schema, or OpenAI's ``{name, schema, strict}``),
  ``response_format`` (OpenAI: ``{"type": "json_schema", "json_schema": {"name": ..,
  "schema": {..}}}``, ``{"type": "json_object"}``, ``{"type": "text"}``, or
  ``{"type": "regex_schema", "regex_schema": ".."}``), ``regex`` (a pattern), ``choice``
  (a list of strings) or ``structured_outputs`` (vLLM's). ``--schema FILE`` applies to every
  line that names none of these.
- sampling: ``max_tokens`` (or ``max_new_tokens``), ``temperature``, ``top_p``, ``top_k``,
  ``seed``, ``stop`` (a string or a list), and the other ``SamplingParams`` fields; the
  flags ``--max-tokens`` (256) and ``--temperature`` (0: greedy) are the defaults.
- ``sampling_params``: ray.data.llm's shape, its fields (and ``structured_outputs``) read as
  the line's own (deploy/batch_input.py ``parse_row``: the Ray Data processor's rows,
  deploy/data.py, go through the same conversion).
- ``id``: a string or an integer, unique in the file (an id on several lines exits 2,
  naming the id and its lines); without one, the line number (1-based) is the id. Other
  keys are ignored (keep your metadata there).

Output: one JSON object per input line, in input order: ``id``, ``line``, ``text``,
``finish_reason`` (``stop``, ``length`` or ``error``), ``usage`` (``prompt_tokens``,
``cached_tokens``: those whose KV a worker had cached, ``completion_tokens``), for a JSON
format (``schema``, ``json_schema``, ``json_object``) the parsed value as ``json`` when
the text parses (a ``length`` finish can cut it short),
and ``error`` (with ``error_kind``, an ErrorKind value, when known) when the line failed:
malformed JSON (also an integer of over 4,300 digits, nesting past Python's recursion
limit), no prompt, a bad parameter, an invalid schema or regex, a worker error. A failed
line never stops the job. Each result is written (and flushed) as soon as every earlier
line is written, so an interrupted job leaves a finished prefix.

Transient failures (the runtime failing under a line: a worker died, the grammar cache
down, no worker, every worker overloaded, a call timed out) are retried with backoff, 8
tries over about 35 s, each under a new request id. One that outlasts them is written as
an error row with ``transient: true``.

Every row also carries its account (deploy/batch_account.py): ``outcome`` (``valid``,
``closed_at_budget``, ``loop_cut``, ``invalid``, ``refused``, ``grammar_error`` or
``infrastructure``), ``grammar`` (the line's grammar id, as ``POST /v1/grammars`` gives it),
``max_tokens``, ``grammar_engine`` (the backend that served it), ``loop_cuts``,
``closed_early`` (closed at the budget), ``approximated`` (keywords the grammar only
approximates),
``attempt`` (from 2 on: a retry) and ``attempts`` (on a row kept over its retry: the runs
of the line in all). The job ends with a table of the output's rows by outcome
and by grammar (stderr), and writes it as JSON to ``OUTPUT.summary.json`` (rows,
input_lines, missing, valid_share, outcomes, retryable, prompt_tokens: total, cached and
computed, by_grammar); stdout's last line is ``batch_job: summary=PATH valid_share=X``.
Rows need not be sorted for their shared instructions to be computed once: workers cache
prompt prefixes and the scheduler routes a row to the worker holding its prefix. The
progress bar shows the run's valid share.

``--retry-failed`` runs again the lines a retry can help: closed at the budget (or refused
for a budget below the grammar's shortest output) with twice the budget (at most
``--retry-max-tokens``, 4096), ``invalid`` on the backend that served it with twice the
budget, infrastructure errors as they were; at most two retries per line. Valid rows and
the rest stay as they are.

Resume: re-running with the same ``--output`` skips every id that already has a result
there and appends the rest (a half-written last line is cut off first). Rows marked
``transient`` are run again. Other error rows are skipped too, unless ``--retry-errors``.
A line run again has its new row appended beside the old one, and the run's end (or the
next run's start) keeps the better (deploy/batch_output.py ``settle_output``): a run
killed or unable to reach the runtime loses no row or attempt count.

Lock: a run holds an exclusive ``flock`` on ``OUTPUT.lock`` from start to end (removed
when it ends); a second run on the same output exits 2, naming the holder. The output, its
lock and the settling rewrite (a new file of a random name, renamed over the output) are
never opened through a symbolic link: an ``--output`` that is a link exits 2.

A row that cannot be written (a full disk, a quota) stops the job at once: the requests in
flight are cancelled, it exits 1 naming the error, and the rows before it stay (a re-run
resumes after them).

Runtime: the job uses the running runtime (``rayguide up``) of the cluster it runs on
(``--address``, default: the cluster of the Ray job, else a running local one). If there
is none, it starts its own for the job's length, from ``--model``, ``--workers`` and
``--config`` (a YAML file as for ``rayguide up``); those flags are ignored when a runtime
is running. It kills the actors it started when it ends (they are owned by the job, so
Ray removes them anyway if it is killed); it never touches a runtime it found. A job's own
runtime is claimed (a named actor, ``rayguide_batch_job_runtime``): another job that finds
the claim waits for that runtime to end and then starts its own, so jobs never share (or
kill) each other's runtime; for several jobs at once, run ``rayguide up`` first
(cluster/job_runtime.py).

Paths are read and written by the job's driver, on the head node; in a Ray job a relative
path is relative to the uploaded copy of the working directory, so give an absolute
``--output`` (or one on shared storage).

``--concurrency`` (32) requests are in flight at once; progress goes to stderr (tqdm) and
a last line to stdout: ``batch_job: done=N skipped=N errors=N seconds=S output=PATH``
(done: lines run by this run, errors among them; skipped: already in the output).
Exit code 0 when the job ran (whatever the per-line errors; transient ones are counted
on stderr), 2 for bad flags or files (or an output another run holds), 1 when the runtime
cannot be reached or started or a result cannot be written, 130 when interrupted.

This module is the job's command line and its pipeline (requests in flight, retries, rows
written in input order); deploy/batch_input.py reads the lines, deploy/batch_output.py
owns the output file, cluster/job_runtime.py the runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster import job_runtime
from cluster.client import INFRASTRUCTURE_ERRORS
from cluster.config import ClusterConfig
from cluster.job_runtime import connect as _connect
from cluster.job_runtime import (RUNTIME_CLAIM, claim_runtime, job_label, release_runtime,
                                 runtime_claim_owner)
from core.backoff import backoff
from core.errors import ErrorKind, GrammarUnavailable, NoWorkers, Overloaded
# the job's parts, by concern: its input lines, its output file, the runtime it runs on
from deploy.batch_account import (DEFAULT_RETRY_MAX_TOKENS, account_of, outcome_of,
                                  retry_for, write_summary)
from deploy.batch_input import (BATCH_CLIENT, Item, LineError, WorkPlan, id_key, items,
                                load_schema, params_of, parse_line, plan)
from deploy.batch_output import (close_quietly, error_row, lock_output, open_output,
                                 result_row, scan_output, settle_output, unlock_output,
                                 write_row)

__all__ = ["main", "parse_args", "process", "run_item", "transient_kind", "BatchCounts",
           "OutputWriteError", "acquire_runtime", "release_runtime", "RUNTIME_CLAIM",
           "runtime_claim_owner", "claim_runtime", "outcome_of", "retry_for", "BATCH_CLIENT", "Item", "LineError",
           "WorkPlan", "id_key", "items", "load_schema", "params_of", "parse_line", "plan",
           "error_row", "result_row", "scan_output", "settle_output", "lock_output",
           "unlock_output", "open_output"]


def exception_message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the remote exception
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, ValueError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


# failures of the machinery under a request, not of the line: a retry can succeed
_INFRASTRUCTURE = (*INFRASTRUCTURE_ERRORS, TimeoutError, ConnectionError, OSError)


def transient_kind(exc: BaseException) -> ErrorKind | None:
    """The transient ErrorKind of an exception the runtime raised (the scheduler
    overloaded or without workers, the grammar cache unavailable, a worker or actor
    gone, a call timed out); None for the line's own fault or a bug."""
    cause = getattr(exc, "cause", None)
    for e in (exc, cause) if isinstance(cause, BaseException) else (exc,):
        if isinstance(e, Overloaded):
            return ErrorKind.OVERLOADED
        if isinstance(e, NoWorkers):
            return ErrorKind.NO_WORKERS
        if isinstance(e, GrammarUnavailable):
            return e.kind if e.kind.transient else ErrorKind.GRAMMAR_UNAVAILABLE
    if isinstance(exc, _INFRASTRUCTURE) and not isinstance(exc, ValueError):
        return ErrorKind.WORKER_DIED  # an actor gone or unreachable, a call timed out
    return None


# a transient failure is tried this many times in all, the waits doubling from the first
# to the most (0.5 + 1 + 2 + 4 + 8 + 10 + 10 s: a worker restart, the cache actor back)
RETRY_ATTEMPTS, RETRY_FIRST_DELAY_S, RETRY_MAX_DELAY_S = 8, 0.5, 10.0


async def run_item(client, item: Item) -> dict:
    """The output row of one item; never raises (except on cancellation).

    A transient failure (an exception from :func:`transient_kind`, or an output whose
    ``error_kind`` is transient: a worker died, the grammar was unavailable) is retried
    with backoff, RETRY_ATTEMPTS times in all; if it still fails, its row is written with
    ``transient: true`` and a resume runs the line again."""
    if item.error is not None:
        return error_row(item, item.error, kind=ErrorKind.BAD_REQUEST)
    delays = backoff(RETRY_FIRST_DELAY_S, RETRY_MAX_DELAY_S)
    for attempt in range(RETRY_ATTEMPTS):
        request = item.request if attempt == 0 else dataclasses.replace(
            item.request, request_id=f"{item.request.request_id}-r{attempt}")
        try:
            row = result_row(item, await client.complete(request))
            if not row.get("transient"):
                return row
            failed = row
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes this line's error
            kind = transient_kind(exc)
            if kind is None:  # the line's fault (its own kind, when it has one) or a bug
                own = getattr(getattr(exc, "cause", None) or exc, "kind", None)
                return error_row(item, exception_message(exc),
                                 kind=own if isinstance(own, ErrorKind) else None)
            failed = error_row(item, exception_message(exc), kind=kind)
        if attempt + 1 < RETRY_ATTEMPTS:
            await asyncio.sleep(next(delays))  # every worker busy, restarting, or the cache down
    return failed


@dataclass
class BatchCounts:
    """This run's rows: written, error rows among them, those of them marked ``transient``
    (a resume runs their lines again), and the rows whose outcome is ``valid``."""
    done: int = 0
    errors: int = 0
    transient: int = 0
    valid: int = field(default=0, compare=False)  # for the progress bar's share


class OutputWriteError(OSError):
    """Writing a row to the output failed (a full disk, a quota, storage gone): the job
    stops at once; the rows written before it are kept and a resume goes on after them."""


async def process(item_iter, client, out_file, *, concurrency: int = 32, progress=None,
                  counts: BatchCounts | None = None) -> BatchCounts:
    """Runs the items with ``concurrency`` in flight; writes each row (and flushes) once
    every earlier row is written. Counts rows written in ``counts`` (kept up to date, so
    an interrupted run still knows), and returns it.

    A failed write raises OutputWriteError at once: the requests in flight are cancelled
    and nothing more is started (the rows after a lost one could never be written in
    input order, and waiting for that row would wait for ever)."""
    window = max(4 * concurrency, 64)  # rows that may wait for an earlier, slower one
    slots = asyncio.Semaphore(concurrency)
    advanced = asyncio.Condition()
    ready: dict[int, dict] = {}
    counts = counts if counts is not None else BatchCounts()
    state: dict[str, Any] = {"next": 0, "failed": None}
    tasks: set[asyncio.Task] = set()

    async def finish(seq: int, row: dict) -> None:
        ready[seq] = row
        async with advanced:
            while state["failed"] is None and state["next"] in ready:
                r = ready.pop(state["next"])
                try:
                    write_row(out_file, r)
                except OSError as exc:
                    state["failed"] = exc
                    break
                counts.done += 1
                counts.errors += "error" in r
                counts.transient += r.get("transient") is True
                counts.valid += r.get("outcome") == "valid"
                if progress is not None:
                    progress.set_postfix_str(f"valid {counts.valid / counts.done:.0%}",
                                             refresh=False)
                    progress.update(1)
                state["next"] += 1
            advanced.notify_all()

    async def one(seq: int, item: Item) -> None:
        try:
            row = await run_item(client, item)
        finally:
            slots.release()
        await finish(seq, row)

    try:
        for seq, item in enumerate(item_iter):
            async with advanced:
                await advanced.wait_for(lambda: state["failed"] is not None
                                        or seq - state["next"] < window)
            if state["failed"] is not None:
                break
            await slots.acquire()
            task = asyncio.create_task(one(seq, item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks and state["failed"] is None:
            await asyncio.wait(list(tasks), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
    exc = state["failed"]
    if exc is not None:
        raise OutputWriteError(f"could not write a result to the output ({exc}); the "
                               f"{counts.done} rows before it are kept: free the space (or "
                               "fix the storage) and run again to resume") from exc
    return counts


def acquire_runtime(args, *, poll_s: float = 5.0) -> tuple[dict, list[str]]:
    """(handles, names of the actors this job started, its runtime claim last): the
    cluster's running runtime, else the job's own from --model, --workers and --config
    (cluster/job_runtime.py)."""
    _connect(args.address)

    def make_config() -> ClusterConfig:
        overrides = {"model": args.model, "num_workers": args.workers}
        if args.config:
            return ClusterConfig.from_yaml(args.config, **overrides)
        return ClusterConfig(**{k: v for k, v in overrides.items() if v is not None})

    # the claim's functions are passed from this module's names, so the job's tests can
    # stand in for a cluster (tests/serve/test_batch_job_hardening_unit.py)
    handles, owned = job_runtime.acquire_runtime(
        make_config, label=job_label(), poll_s=poll_s,
        say=lambda message: print(f"batch_job: {message}", file=sys.stderr),
        claim_owner=runtime_claim_owner, take_claim=claim_runtime)
    ignored = [f for f in ("model", "workers", "config") if getattr(args, f) is not None]
    if not owned and ignored:
        print(f"batch_job: using the running runtime; ignoring "
              f"{', '.join('--' + f for f in ignored)}", file=sys.stderr)
    return handles, owned


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deploy.batch_job",
        description="Run a JSONL file of (guided) generation requests on the rayguide "
                    "runtime; results in input order, resumable.",
        epilog="Details (input and output fields, resume, runtime): the module docstring "
               "of deploy/batch_job.py.")
    p.add_argument("--input", required=True, help="JSONL file, one request per line")
    p.add_argument("--output", required=True, help="JSONL results (appended to: resume)")
    p.add_argument("--schema", default=None, metavar="FILE",
                   help="JSON schema for every line that gives no format of its own")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (32)")
    p.add_argument("--retry-errors", action="store_true",
                   help="run again the lines whose result in --output is an error")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the lines whose outcome a retry can help: closed at the "
                        "budget (twice the budget), invalid (the other grammar backend), "
                        "infrastructure errors")
    p.add_argument("--retry-max-tokens", type=int, default=DEFAULT_RETRY_MAX_TOKENS,
                   help="the largest budget --retry-failed gives a line "
                        f"({DEFAULT_RETRY_MAX_TOKENS})")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="default max_tokens for lines without one (256)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="default temperature for lines without one (0: greedy)")
    p.add_argument("--address", default=None,
                   help="Ray address (default: the job's cluster, else a local one)")
    g = p.add_argument_group("the job's own runtime (only when none is running)")
    g.add_argument("--model", default=None,
                   help="HF dir, .gguf file or hf:org/name@revision (a hub download)")
    g.add_argument("--workers", type=int, default=None, help="worker actors (2)")
    g.add_argument("--config", default=None, metavar="YAML", help="as for `rayguide up`")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    if in_job and not os.path.isabs(args.output):
        print(f"batch_job: warning: --output {args.output} is relative: it is written into "
              f"the job's copy of the working directory ({os.getcwd()}); give an absolute "
              "path to keep it", file=sys.stderr)
    lock = None
    try:
        default_grammar = load_schema(args.schema) if args.schema else None
        if os.path.abspath(args.input) == os.path.abspath(args.output):
            raise ValueError("--input and --output are the same file")
        if not os.path.isfile(args.input):
            raise ValueError(f"--input {args.input}: no such file")
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        if os.path.islink(args.output):
            raise ValueError(f"--output {args.output} is a symbolic link (to "
                             f"{os.path.realpath(args.output)}); give the real path")
        lock = lock_output(args.output)
        retries: dict = {}
        skip, again = scan_output(args.output, args.retry_errors,
                                  retry_failed=args.retry_failed, retries=retries,
                                  max_tokens_cap=args.retry_max_tokens)
        work = plan(args.input, skip, retries)
    except (ValueError, OSError) as exc:
        if lock is not None:
            unlock_output(args.output, lock)
        print(f"batch_job: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, work, again, default_grammar, started)
    finally:
        unlock_output(args.output, lock)


def _run(args, work: WorkPlan, again: int, default_grammar, started: float) -> int:
    if again:
        print(f"batch_job: running again {again} lines that failed before", file=sys.stderr)
    code = _run_lines(args, work, default_grammar, started)
    try:  # one row per line: a retried line keeps the better of its two rows
        settle_output(args.output)
    except OSError as exc:
        print(f"batch_job: could not settle the retried lines' rows ({exc}); the next run "
              "does it first", file=sys.stderr)
    if code in (0, 130):  # the account of every row in the output, this run's and before
        acc = account_of(args.output, args.retry_max_tokens)
        print("batch_job: outcomes of the rows in the output\n" + acc.table(), file=sys.stderr)
        try:
            path = write_summary(args.output, acc.summary(
                output=os.path.abspath(args.output), input_lines=work.lines,
                missing=max(0, work.lines - acc.rows)))
            print(f"batch_job: summary={path} valid_share={acc.valid_share:.4f}", flush=True)
        except OSError as exc:
            print(f"batch_job: could not write the summary ({exc})", file=sys.stderr)
    return code


def _run_lines(args, work: WorkPlan, default_grammar, started: float) -> int:
    counts = BatchCounts()
    owned: list[str] = []
    code = 0
    # `ray job stop` (SIGTERM): print the summary and kill the actors this job started
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if work.todo:
            from tqdm import tqdm

            from cluster.client import RuntimeClient

            try:
                handles, owned = acquire_runtime(args)
            except (ValueError, ConnectionError, TimeoutError) as exc:
                print(f"batch_job: {exc}", file=sys.stderr)
                return 1
            client = RuntimeClient(handles["scheduler"])
            defaults = {"max_new_tokens": args.max_tokens, "temperature": args.temperature}
            parse_kwargs = dict(defaults=defaults, default_grammar=default_grammar,
                                run_tag=uuid.uuid4().hex[:8])
            out = open_output(args.output)
            try:
                with tqdm(total=len(work.todo), file=sys.stderr, unit="line",
                          disable=args.quiet, mininterval=0.5 if sys.stderr.isatty() else 5,
                          desc="batch_job") as bar:
                    asyncio.run(process(items(args.input, work, **parse_kwargs), client, out,
                                        concurrency=args.concurrency, progress=bar,
                                        counts=counts))
            finally:
                close_quietly(out)
    except KeyboardInterrupt:
        print("batch_job: interrupted; finished lines are in the output: run again to "
              "resume", file=sys.stderr)
        code = 130
    except OutputWriteError as exc:
        print(f"batch_job: --output {args.output}: {exc}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if owned:
            release_runtime(owned)
    if counts.transient:
        print(f"batch_job: {counts.transient} lines failed because the runtime failed "
              "under them (a worker or the grammar cache down); run again to redo them",
              file=sys.stderr)
    print(f"batch_job: done={counts.done} skipped={work.skipped} errors={counts.errors} "
          f"seconds={time.monotonic() - started:.1f} output={os.path.abspath(args.output)}",
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
