"""Batch job: run a JSONL file of (guided) generation requests through the rayguide runtime.

    ray job submit --working-dir . -- python -m deploy.batch_job \\
        --input /data/in.jsonl --output /data/out.jsonl [--schema schema.json]

Input: one JSON object per line (blank lines are ignored).

- ``prompt`` (text, sent as is) or ``messages`` (chat messages, rendered with the model's
  chat template); exactly one of them.
- at most one format: ``schema`` (a JSON schema, or OpenAI's ``{name, schema, strict}``),
  ``response_format`` (OpenAI: ``{"type": "json_schema", "json_schema": {"name": ..,
  "schema": {..}}}``, ``{"type": "json_object"}``, ``{"type": "text"}``, or
  ``{"type": "regex_schema", "regex_schema": ".."}``), ``regex`` (a pattern) or ``choice``
  (a list of strings). ``--schema FILE`` applies to every line that names none of these.
- sampling: ``max_tokens`` (or ``max_new_tokens``), ``temperature``, ``top_p``, ``top_k``,
  ``seed``, ``stop`` (a string or a list), and the other ``SamplingParams`` fields; the
  flags ``--max-tokens`` (256) and ``--temperature`` (0: greedy) are the defaults.
- ``id``: a string or an integer, unique in the file; without one, the line number
  (1-based) is the id. Other keys are ignored (keep your metadata there).

Output: one JSON object per input line, in input order: ``id``, ``line``, ``text``,
``finish_reason`` (``stop``, ``length`` or ``error``), ``usage`` (``prompt_tokens``,
``completion_tokens``), for a JSON format (``schema``, ``json_schema``, ``json_object``)
the parsed value as ``json`` when the text parses (a ``length`` finish can cut it short),
and ``error`` (with ``error_kind``, an ErrorKind value, when known) when the line failed:
malformed JSON (also an integer of over 4,300 digits, nesting past Python's recursion
limit), no prompt, a bad parameter, an invalid schema or regex, a worker error. A failed
line never stops the job. Each result is written (and flushed) as soon as every earlier
line is written, so an interrupted job leaves a finished prefix.

Transient failures (the runtime failing under a line: a worker died, the grammar cache
down, no worker, every worker overloaded, a call timed out) are retried with backoff, 8
tries over about 35 s, each under a new request id. One that outlasts them is written as
an error row with ``transient: true``.

Resume: re-running with the same ``--output`` skips every id that already has a result
there and appends the rest (a half-written last line is cut off first). Rows marked
``transient`` are removed and their lines run again. Other error rows are skipped too,
unless ``--retry-errors``: then they are removed and their lines run again. Lines run
again have their new results appended after the others (so the file is in input order
except for those).

Lock: a run holds an exclusive ``flock`` on ``OUTPUT.lock`` from start to end (removed
when it ends); a second run on the same output exits 2, naming the holder. The output, its
lock and the resume's rewrite (a new file of a random name, renamed over the output) are
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
kill) each other's runtime; for several jobs at once, run ``rayguide up`` first.

Paths are read and written by the job's driver, on the head node; in a Ray job a relative
path is relative to the uploaded copy of the working directory, so give an absolute
``--output`` (or one on shared storage).

``--concurrency`` (32) requests are in flight at once; progress goes to stderr (tqdm) and
a last line to stdout: ``batch_job: done=N skipped=N errors=N seconds=S output=PATH``
(done: lines run by this run, errors among them; skipped: already in the output).
Exit code 0 when the job ran (whatever the per-line errors; transient ones are counted
on stderr), 2 for bad flags or files (or an output another run holds), 1 when the runtime
cannot be reached or started or a result cannot be written, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.client import INFRASTRUCTURE_ERRORS
from core.errors import ErrorKind, GrammarUnavailable, NoWorkers, Overloaded
from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest, RequestOutput
from deploy import dialects
from deploy.openai_api import MAX_SEED
from core.backoff import backoff

FORMAT_KEYS = ("schema", "response_format", "regex", "choice")
MAX_TOKENS_KEYS = ("max_tokens", "max_new_tokens", "max_completion_tokens")
JSON_KINDS = ("json_schema", "json_object")
# the job's requests are one client of the grammar cache's compile queue (each HTTP client
# has its own line: deploy/openai_api.client_identity), so a job with many new grammars
# takes its round-robin turn beside the endpoint's users rather than ahead of them
BATCH_CLIENT = "batch"


class LineError(ValueError):
    """What is wrong with one input line (it becomes that line's ``error``)."""


# ---- parsing one line -------------------------------------------------------------------

@dataclass
class Item:
    """One input line to run: its id, the request for the runtime (or why there is none),
    and whether its output is JSON."""

    line: int
    id: Any
    request: GenerationRequest | None = None
    error: str | None = None
    is_json: bool = False


def id_key(value: Any) -> str:
    """Ids compare as JSON text: 3 and "3" are different ids."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _valid_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def line_id(obj: Any, line: int) -> Any:
    """The line's id: its ``id`` when that is a string or an integer, else the line number."""
    if isinstance(obj, dict) and _valid_id(obj.get("id")):
        return obj["id"]
    return line


def grammar_of(obj: dict, default: GrammarSpec | None) -> GrammarSpec | None:
    """The line's grammar (deploy/dialects.py reads the batch keys); else the default."""
    try:
        return dialects.from_batch_line(obj, default)
    except ValueError as exc:
        raise LineError(f"invalid {getattr(exc, 'param', None) or 'format'}: {exc}") from None


def prompt_of(obj: dict):
    has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_prompt and has_messages:
        raise LineError("give `prompt` or `messages`, not both")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise LineError("`prompt` must be a non-empty string")
        return obj["prompt"]
    if has_messages:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or any(not isinstance(m, dict) or "role" not in m for m in msgs)):
            raise LineError("`messages` must be a non-empty list of {role, content} objects")
        return msgs
    raise LineError("the line has no `prompt` or `messages`")


def params_of(obj: dict, defaults: dict) -> SamplingParams:
    known = {f for f in SamplingParams.__dataclass_fields__}
    params = dict(defaults)
    given = [k for k in MAX_TOKENS_KEYS if obj.get(k) is not None]
    if len(given) > 1:
        raise LineError(f"give one of {', '.join(given)}")
    if given:
        params["max_new_tokens"] = obj[given[0]]
    for name in known - {"max_new_tokens"}:
        if obj.get(name) is not None:
            params[name] = obj[name]
    seed = params.get("seed")
    if isinstance(seed, int) and not 0 <= seed <= MAX_SEED:
        raise LineError(f"seed must be in [0, {MAX_SEED}] (2^63 - 1), got {seed}")
    try:
        return SamplingParams.from_dict(params)  # a bad value fails its line at once
    except (ValueError, TypeError) as exc:
        raise LineError(str(exc)) from None


def parse_line(text: str | None, line: int, *, defaults: dict,
               default_grammar: GrammarSpec | None, run_tag: str) -> Item:
    """The Item for one input line (text None: not UTF-8); its ``error`` says what is
    wrong, if anything."""
    if text is None:
        return Item(line, line, error=f"line {line} is not valid UTF-8")
    try:
        obj = json.loads(text)
    except ValueError as exc:  # not JSON, or an integer of 4,300+ digits
        return Item(line, line, error=f"line {line} is not valid JSON: {exc}")
    except RecursionError:
        return Item(line, line, error=f"line {line} is nested too deeply to read")
    item = Item(line, line_id(obj, line))
    try:
        if not isinstance(obj, dict):
            raise LineError(f"line {line} is not a JSON object")
        if obj.get("id") is not None and not _valid_id(obj["id"]):
            raise LineError("`id` must be a string or an integer")
        grammar = grammar_of(obj, default_grammar)
        item.request = GenerationRequest(prompt_of(obj), params_of(obj, defaults),
                                         request_id=f"batch-{run_tag}-{line}", grammar=grammar,
                                         client=BATCH_CLIENT)
        item.is_json = grammar is not None and grammar.kind in JSON_KINDS
    except LineError as exc:
        item.error = str(exc)
    return item


def load_schema(value: str) -> GrammarSpec:
    """--schema: a file with a JSON schema (or the schema inline)."""
    if os.path.exists(value):
        with open(value) as f:
            text = f.read()
    elif value.lstrip().startswith(("{", "[")):
        text = value
    else:
        raise ValueError(f"--schema {value}: no such file")
    try:
        return dialects.json_schema(text, "--schema")
    except ValueError as exc:
        raise ValueError(f"--schema {value}: {exc}") from None


# ---- results -----------------------------------------------------------------------------

def error_row(item: Item, error: str, out: RequestOutput | None = None, *,
              kind: ErrorKind | None = None) -> dict:
    """A failed line's row. A ``kind`` that is transient (the runtime failed underneath:
    a worker died, the grammar cache was down) marks the row ``transient``: a resume runs
    that line again rather than skipping it."""
    out = out or RequestOutput("")
    row = {"id": item.id, "line": item.line, "text": out.text, "finish_reason": "error",
           "usage": {"prompt_tokens": out.prompt_tokens,
                     "completion_tokens": out.completion_tokens},
           "error": error}
    if kind is not None:
        row["error_kind"] = kind.value
        if kind.transient:
            row["transient"] = True
    return row


def result_row(item: Item, out: RequestOutput) -> dict:
    if out.finish_reason == "error":
        kind = ErrorKind.parse(getattr(out.error_kind, "value", out.error_kind)) \
            if out.error_kind is not None else None
        return error_row(item, out.error or "the request failed", out, kind=kind)
    row = {"id": item.id, "line": item.line, "text": out.text,
           "finish_reason": out.finish_reason,
           "usage": {"prompt_tokens": out.prompt_tokens,
                     "completion_tokens": out.completion_tokens}}
    if getattr(out, "validation", None) is not None:
        row["validation"] = out.validation
        if getattr(out, "validation_error", None):
            row["validation_error"] = out.validation_error
    if item.is_json:
        try:
            row["json"] = json.loads(row["text"])
        except (ValueError, RecursionError):
            pass  # cut short by max_tokens (or beyond what Python reads): the text is there
    return row


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


# ---- resume --------------------------------------------------------------------------------

def scan_output(path: str, retry_errors: bool) -> tuple[set[str], int]:
    """Prepares the output file for appending and returns (ids to skip, error rows
    dropped). Cuts a half-written last line; rewrites the file (atomically) without the
    rows to run again, so those lines appear once: rows marked ``transient`` (the runtime
    failed underneath them) always, every error row with retry_errors."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return set(), 0
    with os.fdopen(fd, "r+b") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            print(f"batch_job: cutting a half-written last line off {path}", file=sys.stderr)
            f.truncate(end)
            data = data[:end]
        mode = stat.S_IMODE(os.fstat(fd).st_mode)

    def redo(row: dict | None) -> bool:
        return row is not None and bool(row.get("error")) and (
            retry_errors or row.get("transient") is True)

    done, failed, rows = set(), set(), []
    for raw in data.splitlines(keepends=True):
        try:
            row = json.loads(raw)
            key = id_key(row["id"])
        except (ValueError, KeyError, TypeError, RecursionError):
            rows.append((raw, None))
            continue
        if not row.get("error"):
            done.add(key)
        elif not redo(row):
            failed.add(key)
        rows.append((raw, row))
    dropped = [raw for raw, row in rows if redo(row)]
    if dropped:
        # a new file of a random name, created exclusively (never through a link someone
        # planted at a guessable name), then renamed over the output
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-",
                                   dir=os.path.dirname(os.path.abspath(path)))
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)
                f.writelines(raw for raw, row in rows if not redo(row))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return done | failed, len(dropped)


@dataclass
class WorkPlan:
    todo: list[int] = field(default_factory=list)  # line numbers to run, in order
    duplicates: dict[int, str] = field(default_factory=dict)  # line -> error
    skipped: int = 0


def plan(input_path: str, skip: set[str]) -> WorkPlan:
    """First pass over the input: which lines to run (ids not yet in the output)."""
    p, first_line = WorkPlan(), {}
    for line, text in input_lines(input_path):
        if text is not None and not text.strip():
            continue
        try:
            key = id_key(line_id(json.loads(text), line))
        except (TypeError, ValueError, RecursionError):
            # not UTF-8, not JSON, an integer of 4,300+ digits, nesting past the recursion
            # limit: the line's id is its number, and parse_line makes it its error
            key = id_key(line)
        if key in skip:
            p.skipped += 1
            continue
        if key in first_line:
            p.duplicates[line] = f"duplicate id {key} (first on line {first_line[key]})"
        else:
            first_line[key] = line
        p.todo.append(line)
    return p


def input_lines(path: str):
    """(line number, text) per line; text is None for a line that is not valid UTF-8."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                yield line, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield line, None


def items(input_path: str, p: WorkPlan, **parse_kwargs):
    """Second pass: the Items of the planned lines, in order."""
    wanted = iter(p.todo)
    next_line = next(wanted, None)
    for line, text in input_lines(input_path):
        if next_line is None:
            return
        if line != next_line:
            continue
        item = parse_line(text, line, **parse_kwargs)
        if line in p.duplicates:
            item.request, item.error = None, p.duplicates[line]
        yield item
        next_line = next(wanted, None)


# ---- the pipeline --------------------------------------------------------------------------

@dataclass
class BatchCounts:
    """The job's summary: rows written, error rows among them, and those of them marked
    ``transient`` (a resume runs their lines again)."""
    done: int = 0
    errors: int = 0
    transient: int = 0


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

    def write(r: dict) -> None:
        text = json.dumps(r, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: write it escaped
            text = json.dumps(r)
        out_file.write(text + "\n")
        out_file.flush()

    async def finish(seq: int, row: dict) -> None:
        ready[seq] = row
        async with advanced:
            while state["failed"] is None and state["next"] in ready:
                r = ready.pop(state["next"])
                try:
                    write(r)
                except OSError as exc:
                    state["failed"] = exc
                    break
                counts.done += 1
                counts.errors += "error" in r
                counts.transient += r.get("transient") is True
                if progress is not None:
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


# ---- the runtime ---------------------------------------------------------------------------

def _connect(address: str | None) -> None:
    from cluster import launch

    if address is not None:
        launch.connect(address)
        return
    try:
        launch.connect("auto")  # the Ray job's cluster (RAY_ADDRESS), or a running local one
    except ConnectionError:
        launch.connect(None)  # none: a Ray instance in this process


# A runtime a batch job starts is not detached: Ray ends its actors with the job. A second
# job that found it would lose it when the first ends, and its own `launch.up` would take
# over the first job's actors by name. So a job that starts a runtime first creates this
# named actor (creating a name that exists fails: a cluster-wide claim, released by Ray when
# the job dies); a job that finds the claim waits for that job's runtime to go away.
RUNTIME_CLAIM = "rayguide_batch_job_runtime"


def _claim_class():
    import ray

    @ray.remote(num_cpus=0)
    class BatchJobRuntimeClaim:
        def __init__(self, owner: str):
            self.owner = owner

        def who(self) -> str:
            return self.owner

    return BatchJobRuntimeClaim


def runtime_claim_owner() -> str | None:
    """Who holds the claim (another batch job's own runtime is on the cluster), or None."""
    import ray

    from cluster.launch import NAMESPACE

    try:
        return ray.get(ray.get_actor(RUNTIME_CLAIM, namespace=NAMESPACE).who.remote(),
                       timeout=30)
    except ValueError:
        return None  # no claim
    except Exception:  # noqa: BLE001 - it died between the lookup and the call
        return None


def claim_runtime(owner: str) -> bool:
    """Takes the claim for a runtime this job starts; False when another job holds it."""
    import ray

    from cluster.launch import NAMESPACE

    try:
        claim = _claim_class().options(name=RUNTIME_CLAIM, namespace=NAMESPACE).remote(owner)
    except ValueError:  # the name is taken
        return False
    try:
        if ray.get(claim.who.remote(), timeout=60) != owner:
            return False
    except Exception:  # noqa: BLE001 - killed as it started (`rayguide down`): try again
        return False
    _held_claim.append(claim)  # a named actor lives while a handle to it does
    return True


_held_claim: list = []


def job_label() -> str:
    """This job as the claim names it to a job that waits: Ray's job id, pid and host."""
    import ray

    return f"{ray.get_runtime_context().get_job_id()} (pid {os.getpid()} on " \
           f"{socket.gethostname()})"


def acquire_runtime(args, *, poll_s: float = 5.0) -> tuple[dict, list[str]]:
    """(handles, names of the actors this job started, its runtime claim last)."""
    import ray

    from cluster import launch
    from cluster.config import ClusterConfig
    from cluster.launch import NAMESPACE

    _connect(args.address)
    me = job_label()
    told = False
    while True:
        owner = runtime_claim_owner()
        if owner is not None:  # another job's runtime: it ends with that job
            if not told:
                print(f"batch_job: the runtime on this cluster belongs to batch job {owner} "
                      "and ends with it; waiting for it to end (run `rayguide up` for a "
                      "runtime several jobs share)", file=sys.stderr)
                told = True
            time.sleep(poll_s)
            continue
        try:
            handles = launch.handles()
            if not handles["workers"]:
                raise ValueError("the rayguide runtime on this cluster has no workers")
        except ValueError as exc:
            if runtime_claim_owner() is not None:
                continue  # another job is starting its runtime
            if "no rayguide runtime" not in str(exc):
                raise
        else:
            if runtime_claim_owner() is not None:
                continue  # found as another job started it
            ignored = [f for f in ("model", "workers", "config") if getattr(args, f) is not None]
            if ignored:
                print(f"batch_job: using the running runtime; ignoring "
                      f"{', '.join('--' + f for f in ignored)}", file=sys.stderr)
            return handles, []
        if claim_runtime(me):
            break
    overrides = {"model": args.model, "num_workers": args.workers}

    def names():
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NAMESPACE}

    before = names() | {RUNTIME_CLAIM}
    try:
        config = (ClusterConfig.from_yaml(args.config, **overrides) if args.config else
                  ClusterConfig(**{k: v for k, v in overrides.items() if v is not None}))
        print(f"batch_job: no runtime running; starting one ({config.num_workers} workers, "
              f"model {config.model or 'default'})", file=sys.stderr)
        started = time.monotonic()
        handles = launch.up(config)
    except BaseException:
        release_runtime(sorted(names() - before) + [RUNTIME_CLAIM])
        raise
    owned = sorted(names() - before)
    print(f"batch_job: runtime up in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return handles, owned + [RUNTIME_CLAIM]


def release_runtime(owned: list[str], timeout_s: float = 30.0) -> None:
    """Kills the actors this job started, the claim last, once the others are gone (a
    job waiting for the claim must not find this runtime half dead)."""
    import ray

    from cluster.launch import NAMESPACE

    def kill(name: str) -> None:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    runtime = [n for n in owned if n != RUNTIME_CLAIM]
    for name in runtime:
        kill(name)
    deadline = time.monotonic() + timeout_s
    while runtime and time.monotonic() < deadline:
        alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE}
        if not alive & set(runtime):
            break
        time.sleep(0.2)
    if RUNTIME_CLAIM in owned:
        kill(RUNTIME_CLAIM)
        _held_claim.clear()


# ---- the output's lock ---------------------------------------------------------------------

def lock_output(path: str) -> int:
    """An exclusive lock (``fcntl.flock``) on ``PATH.lock`` for the run's length, so two
    runs never append to one output; returns its file descriptor. Raises ValueError when
    another run holds it (flock works between processes of one machine, and on NFS v4)."""
    lock_path = f"{path}.lock"
    while True:
        try:  # never through a link: it would make the job write the holder line elsewhere
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise ValueError(f"{lock_path} is a symbolic link; a batch job's lock file "
                             "must be a plain file: remove the link") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode("utf-8", "replace").strip()
            os.close(fd)
            raise ValueError(f"--output {path} is in use by another batch job "
                             f"({holder or 'it holds ' + lock_path}); wait for it to end or "
                             "give another --output") from None
        try:
            ours = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            ours = False
        if ours:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            return fd
        os.close(fd)  # its holder removed it as we opened it: lock the new one


def unlock_output(path: str, fd: int) -> None:
    """Removes the lock file (while holding it: nobody else can) and releases it."""
    try:
        os.unlink(f"{path}.lock")
    except FileNotFoundError:
        pass
    os.close(fd)


def open_output(path: str):
    """The output, opened for appending. Never through a symbolic link (O_NOFOLLOW): a
    link planted at the output's path must not redirect the job's writes elsewhere."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


def _close_quietly(f) -> None:
    """Closes the output; after a failed write its buffer still holds the row that could
    not be written, and closing retries (and fails) that write: the job already says so."""
    try:
        f.close()
    except OSError:
        pass


# ---- main ----------------------------------------------------------------------------------

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
        skip, dropped = scan_output(args.output, args.retry_errors)
        work = plan(args.input, skip)
    except (ValueError, OSError) as exc:
        if lock is not None:
            unlock_output(args.output, lock)
        print(f"batch_job: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, work, dropped, default_grammar, started)
    finally:
        unlock_output(args.output, lock)


def _run(args, work: WorkPlan, dropped: int, default_grammar, started: float) -> int:
    if dropped:
        print(f"batch_job: running again {dropped} lines that failed before", file=sys.stderr)
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
                _close_quietly(out)
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
