"""The batch job's output (deploy/batch_job.py): a line's result row (also the Ray Data
processor's, deploy/data.py, as columns: ``columns_of``), and the output file:
its lock for the run's length, the resume's scan, the appends, and settling each line to
one row (an atomic rewrite that drops only rows whose replacement is on disk). Nothing is
opened through a symbolic link."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import tempfile

from core.errors import ErrorKind
from core.request import RequestOutput
from deploy.batch_account import (DEFAULT_RETRY_MAX_TOKENS, attempts_of, better,
                                  outcome_of, retry_for)
from deploy.batch_input import Item, id_key


def error_row(item: Item, error: str, out: RequestOutput | None = None, *,
              kind: ErrorKind | None = None) -> dict:
    """A failed line's row. A ``kind`` that is transient (the runtime failed underneath:
    a worker died, the grammar cache was down) marks the row ``transient``: a resume runs
    that line again rather than skipping it."""
    out = out or RequestOutput("")
    row = {"id": item.id, "line": item.line, "text": out.text, "finish_reason": "error",
           "usage": _usage(out),
           "error": error}
    if kind is not None:
        row["error_kind"] = kind.value
        if kind.transient:
            row["transient"] = True
    return _accounted(row, item)


def _usage(out: RequestOutput) -> dict:
    """A row's usage: its prompt tokens, how many of them were cached (a prefix the worker
    held already: the shared instructions of earlier rows), its completion tokens."""
    return {"prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
            "completion_tokens": out.completion_tokens}


def _accounted(row: dict, item: Item, out: RequestOutput | None = None) -> dict:
    """The row's account fields: its grammar's id, its budget, the backend that served it,
    its loop cuts, which attempt at the line it is, and its ``outcome``
    (deploy/batch_account.py)."""
    if item.grammar is not None:
        row["grammar"] = item.grammar
    if item.request is not None:
        row["max_tokens"] = item.request.params.max_new_tokens
    if out is not None and out.grammar_engine:
        row["grammar_engine"] = out.grammar_engine
    if out is not None and out.loop_cuts:
        row["loop_cuts"] = out.loop_cuts
    if out is not None and out.closed_early:
        row["closed_early"] = True
    if out is not None and out.approximated:
        row["approximated"] = list(out.approximated)
    if item.attempt > 1:
        row["attempt"] = item.attempt
    row["outcome"] = outcome_of(row)
    return row


def result_row(item: Item, out: RequestOutput) -> dict:
    if out.finish_reason == "error":
        kind = ErrorKind.parse(getattr(out.error_kind, "value", out.error_kind)) \
            if out.error_kind is not None else None
        return error_row(item, out.error or "the request failed", out, kind=kind)
    row = {"id": item.id, "line": item.line, "text": out.text,
           "finish_reason": out.finish_reason,
           "usage": _usage(out)}
    if getattr(out, "validation", None) is not None:
        row["validation"] = out.validation
        if getattr(out, "validation_error", None):
            row["validation_error"] = out.validation_error
    if item.is_json:
        try:
            row["json"] = json.loads(row["text"])
        except (ValueError, RecursionError):
            pass  # cut short by max_tokens (or beyond what Python reads): the text is there
    return _accounted(row, item, out)


# The Ray Data processor's output columns (deploy/data.py), with their Arrow types:
# ray.data.llm's three, then ours. ``guided`` is null for a row without a grammar.
GUIDED_FIELDS = {"validation": "string", "validation_error": "string", "closed_early": "bool",
                 "loop_cuts": "int64", "engine": "string", "approximated": "list<string>"}
COLUMNS = {"generated_text": "string", "num_generated_tokens": "int64",
           "num_input_tokens": "int64", "num_cached_tokens": "int64",
           "finish_reason": "string", "outcome": "string", "guided": GUIDED_FIELDS,
           "grammar": "string", "max_tokens": "int64", "error": "string", "error_kind": "string"}


def columns_of(row: dict) -> dict:
    """A result row (``result_row`` / ``error_row``) as the processor's columns (every key
    of COLUMNS): the same row, named as ``ray.data.llm`` names its outputs."""
    usage = row.get("usage") or {}
    guided = None
    if row.get("grammar") is not None:
        guided = {"validation": row.get("validation"),
                  "validation_error": row.get("validation_error"),
                  "closed_early": bool(row.get("closed_early")),
                  "loop_cuts": row.get("loop_cuts") or 0,
                  "engine": row.get("grammar_engine"),
                  "approximated": list(row.get("approximated") or [])}
    return {"generated_text": row.get("text") or "",
            "num_generated_tokens": usage.get("completion_tokens") or 0,
            "num_input_tokens": usage.get("prompt_tokens") or 0,
            "num_cached_tokens": usage.get("cached_tokens") or 0,
            "finish_reason": row.get("finish_reason"), "outcome": row["outcome"],
            "guided": guided, "grammar": row.get("grammar"),
            "max_tokens": row.get("max_tokens"), "error": row.get("error"), "error_kind": row.get("error_kind")}


def row_of_columns(cols: dict) -> dict:
    """The result row a processor's output row holds (what ``batch_account`` reads): the
    inverse of ``columns_of`` for the fields the account uses."""
    guided = cols.get("guided") or {}
    row = {"text": cols.get("generated_text"), "finish_reason": cols.get("finish_reason"),
           "outcome": cols.get("outcome"),
           "usage": {"prompt_tokens": cols.get("num_input_tokens") or 0,
                     "cached_tokens": cols.get("num_cached_tokens") or 0,
                     "completion_tokens": cols.get("num_generated_tokens") or 0}}
    for key, value in (("grammar", cols.get("grammar")), ("max_tokens", cols.get("max_tokens")),
                       ("error", cols.get("error")),
                       ("error_kind", cols.get("error_kind")),
                       ("validation", guided.get("validation")),
                       ("loop_cuts", guided.get("loop_cuts")),
                       ("grammar_engine", guided.get("engine"))):
        if value:
            row[key] = value
    return row


def scan_output(path: str, retry_errors: bool, *, retry_failed: bool = False,
                retries: dict | None = None,
                max_tokens_cap: int = DEFAULT_RETRY_MAX_TOKENS) -> tuple[set[str], int]:
    """Prepares the output file for appending and returns (ids to skip, lines to run
    again). Cuts a half-written last line, and settles the lines a run that did not reach
    its end left with two rows (``settle_output``). Lines to run again: rows marked
    ``transient`` (the runtime failed underneath them) always, every error row with
    retry_errors, and with retry_failed every row a retry can help
    (``batch_account.retry_for``), whose overrides and next attempt go into ``retries`` by
    id key. Their rows stay in the file until their replacements are written (the run's
    end settles each line to its better row): a run that dies or never reaches the
    runtime loses none of them, nor their attempt counts."""
    retries = retries if retries is not None else {}
    rows = settle_output(path)

    def redo(row: dict) -> dict | None:
        retry = retry_for(row, max_tokens_cap) if retry_failed else None
        if retry is None and row.get("error") and (retry_errors or row.get("transient") is True):
            retry = {}
        return retry

    skip, again = set(), 0
    for key, row in rows:
        if key is None:
            continue
        retry = redo(row)
        if retry is None:
            skip.add(key)
        else:
            retries[key] = {**retry, "attempt": attempts_of(row) + 1}
            again += 1
    return skip, again


def _read_rows(data: bytes) -> list[tuple[bytes, str | None, dict | None]]:
    """(line, id key, row) per line of the output; key and row None for a line that is
    not a row (kept as it is)."""
    out = []
    for raw in data.splitlines(keepends=True):
        try:
            row = json.loads(raw)
            out.append((raw, id_key(row["id"]), row))
        except (ValueError, KeyError, TypeError, RecursionError):
            out.append((raw, None, None))
    return out


def settle_output(path: str) -> list[tuple[str | None, dict | None]]:
    """Leaves one row per id in the output, and returns its (id key, row) pairs.

    A retried line's row is appended beside the row it retries, so a line has two rows
    from the moment its retry is written until this runs (at a run's end, or at the start
    of the next one if a run died first): the better is kept (``batch_account.better``,
    the later on a tie) where it stands, with ``attempts`` the most either counted. The
    file is replaced atomically (a new file, fsynced, renamed over it), so every row it
    drops has its replacement on disk. A half-written last line (a run killed in a write)
    is cut off first."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "r+b") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            print(f"batch_job: cutting a half-written last line off {path}", file=sys.stderr)
            f.truncate(end)
            data = data[:end]
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    rows = _read_rows(data)
    kept: dict[str, int] = {}  # id key -> index of its row in rows
    attempts: dict[str, int] = {}
    for i, (_, key, row) in enumerate(rows):
        if key is None:
            continue
        attempts[key] = max(attempts.get(key, 1), attempts_of(row))
        if key not in kept or better(row, rows[kept[key]][2]):
            kept[key] = i
    if len(kept) == sum(key is not None for _, key, _ in rows):
        return [(key, row) for _, key, row in rows]
    settled = []
    for i, (raw, key, row) in enumerate(rows):
        if key is not None and kept[key] != i:
            continue
        if key is not None and attempts[key] > attempts_of(row):
            row = {**row, "attempts": attempts[key]}
            raw = row_text(row).encode("utf-8")
        settled.append((raw, key, row))
    _replace(path, b"".join(raw for raw, _, _ in settled), mode)
    return [(key, row) for _, key, row in settled]


def _replace(path: str, data: bytes, mode: int) -> None:
    """Replaces the file at ``path`` with ``data``, atomically and durably: a new file of
    a random name, created exclusively (never through a link someone planted at a
    guessable name), fsynced, renamed over it, and the folder fsynced."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


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


def row_text(row: dict) -> str:
    """The row as one line of JSON (a lone surrogate in a text is written escaped)."""
    text = json.dumps(row, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(row)
    return text + "\n"


def write_row(out_file, row: dict) -> None:
    """Appends one row and flushes it."""
    out_file.write(row_text(row))
    out_file.flush()


def close_quietly(f) -> None:
    """Closes the output; after a failed write its buffer still holds the row that could
    not be written, and closing retries (and fails) that write: the job already says so."""
    try:
        f.close()
    except OSError:
        pass
