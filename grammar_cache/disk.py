"""The disk tier: compiled grammars (their envelopes) persisted per node.

    <disk_dir>/xgr-<xgrammar version>-s<serialization version>-c<code digest>/
        <tokenizer fingerprint>/<key>.env

so a restarted cluster (the cache actor on its node) or a new worker warms from disk
instead of compiling. The path carries the versions and the fingerprint, and the envelope
repeats them (checked again on unpack), so a file written by another xgrammar or for
another tokenizer is never loaded; the code digest (grammar_cache/code_digest.py: a hash
of the source of our modules that write grammars) does the same for a file our own
earlier code compiled. Writes are atomic (a temporary file in the same folder,
then ``os.replace``): a reader sees a whole envelope or none, and several processes of a
node may write the same key at once. The folder is bounded by ``max_bytes``: past it, the
files least recently used (a read touches its file's mtime) are deleted.

Only compiled grammars and "compile locally" verdicts are written; errors are not (they
expire, and a grammar error is cheap to find again). Every failure of the disk (full,
read-only, removed under us) is logged once and counted, never raised: the disk is a cache.

A file is read only when it and every folder from ``root`` down to it are this user's and
writable by no one else (grammar_cache/private_files.py, as for the kernels and models):
a grammar is loaded into every worker, and one that others could write is treated as a
failed read (logged, counted in disk_errors, compiled instead). Folders are made 0755
whatever the umask, files 0600.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from grammar_cache import envelope
from grammar_cache.code_digest import grammar_code_digest
from grammar_cache.private_files import check_private, make_private_dirs
from grammar_cache.stats import DiskStats

logger = logging.getLogger(__name__)

SUFFIX = ".env"


class DiskStore:
    def __init__(self, root: str | Path, max_bytes: int = 2 * 2**30):
        self.base = Path(root)
        self._root: Path | None = None
        self.max_bytes = max_bytes
        self.counts = DiskStats()
        self._lock = threading.Lock()
        self._warned = False
        self._written_since_sweep = 0

    @property
    def root(self) -> Path:
        """The folder of this xgrammar and of this code that writes grammars (found on
        first use: see envelope.serialization_version, code_digest.grammar_code_digest)."""
        if self._root is None:
            self._root = self.base / (f"xgr-{envelope.XGRAMMAR_VERSION}"
                                      f"-s{envelope.serialization_version()}"
                                      f"-c{grammar_code_digest()}")
        return self._root

    def path(self, fingerprint: str, key: str) -> Path:
        return self.root / fingerprint / f"{key}{SUFFIX}"

    def get(self, fingerprint: str, key: str) -> bytes | None:
        """The envelope bytes kept for ``key``, or None."""
        p = self.path(fingerprint, key)
        try:
            check_private(p, self.base)  # PermissionError: an OSError, a failed read
            data = p.read_bytes()
            os.utime(p)  # recently used: evicted last
        except FileNotFoundError:
            with self._lock:
                self.counts.disk_misses += 1
            return None
        except OSError as exc:
            self._error(f"reading {p}", exc)
            return None
        with self._lock:
            if data:
                self.counts.disk_hits += 1
            else:
                self.counts.disk_misses += 1
        return data or None

    def has(self, fingerprint: str, key: str) -> bool:
        return self.path(fingerprint, key).exists()

    def put(self, fingerprint: str, key: str, data: bytes) -> bool:
        """Writes ``data`` atomically; False if it was not written (too large, disk error)."""
        if not data or len(data) > self.max_bytes:
            return False
        p = self.path(fingerprint, key)
        try:
            make_private_dirs(p.parent, self.base)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=p.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, p)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._error(f"writing {p}", exc)
            return False
        with self._lock:
            self.counts.disk_writes += 1
        with self._lock:
            self._written_since_sweep += len(data)
        self.sweep()
        return True

    def sweep(self) -> int:
        """Deletes the least recently used files while the folder holds more than max_bytes
        (every version's folder counts: an upgrade leaves old ones to age out). Returns
        the bytes held after."""
        files = []
        for f in self.base.glob(f"*/*/*{SUFFIX}"):
            try:
                st = f.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, f))
        total = sum(size for _, size, _ in files)
        files.sort()
        for _, size, f in files:
            if total <= self.max_bytes:
                break
            try:
                f.unlink()
                total -= size
                with self._lock:
                    self.counts.disk_evictions += 1
            except FileNotFoundError:
                total -= size  # another process of the node evicted it
            except OSError as exc:
                self._error(f"evicting {f}", exc)
                break
        for stale in self.base.glob("*/*/.*.tmp"):  # a writer killed mid-write, long ago
            try:
                if time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()
            except OSError:
                pass
        return total

    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.base.glob(f"*/*/*{SUFFIX}") if f.exists())

    def stats(self) -> dict:
        """The counters (``DiskStats``, grammar_cache/stats.py) as a dict (crosses Ray)."""
        with self._lock:
            return self.counts.as_dict()

    def _error(self, what: str, exc: OSError) -> None:
        with self._lock:
            self.counts.disk_errors += 1
        if not self._warned:
            self._warned = True
            logger.warning("grammar disk cache: %s failed (%s); going on without it where "
                           "it fails (counted in disk_errors)", what, exc)


def from_config(config) -> DiskStore | None:
    """The node's store for a GrammarCacheConfig, or None when the disk tier is off."""
    if not config.disk or config.disk_max_bytes <= 0:
        return None
    return DiskStore(config.disk_path(), config.disk_max_bytes)
