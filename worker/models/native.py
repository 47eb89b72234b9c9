"""Small C kernels, compiled once per machine with the system C compiler and loaded
through ctypes (which releases the GIL while they run).

A library is built with ``-march=native`` into ``$RAYGUIDE_CACHE_DIR/kernels`` (default
``~/.cache/rayguide/kernels``), named by a hash of its source, the flags and this CPU's
model and flags, and written atomically (a concurrent build never loads a half-written
file). The kernels parallelize with the OpenMP runtime torch has already loaded (same
soname, same thread pool). Callers keep a plain-torch path for when no library can be
built (no C compiler, not x86-64 with AVX2 and FMA).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
KERNELS = Path(__file__).parent / "kernels"


def cache_dir() -> Path:
    from worker.models.gguf_convert import cache_root

    return cache_root() / "kernels"


def cpu_model() -> str:
    """The model name and flags lines: a library built with -march=native is tied to both."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [next((ln for ln in lines if ln.startswith(key)), "") for key in ("model name", "flags")]
    return "\n".join(keep)


def has_avx2_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpu_model().rpartition("\n")[2].split()
    return "avx2" in flags and "fma" in flags


def build(source: Path) -> Path:
    """The shared library of ``source`` (a C file), built on first use."""
    text = source.read_bytes()
    tag = hashlib.sha256(text + " ".join(FLAGS).encode() + platform.machine().encode()
                         + cpu_model().encode()).hexdigest()[:16]
    from worker.models.gguf_convert import cache_subdir, check_private

    out = cache_dir() / f"{source.stem}-{tag}.so"
    try:
        check_private(out)
    except PermissionError as exc:  # never load a library others could have replaced
        private = Path(tempfile.mkdtemp(prefix="rayguide-kernels-"))
        logger.warning("%s; building %s in %s for this process instead", exc, source.name,
                       private)
        out = private / out.name
    if not out.exists():
        if out.parent == cache_dir():
            cache_subdir("kernels")
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, out)
    return out


def load(source: Path) -> ctypes.CDLL:
    """Builds (if needed) and loads an AVX2 kernel; raises where it cannot."""
    if not has_avx2_fma():
        raise RuntimeError("the kernel needs x86-64 with AVX2 and FMA")
    torch.empty(1).add_(1)  # torch's OpenMP runtime is loaded first: the kernel shares it
    return ctypes.CDLL(str(build(source)))


class LazyKernel(Generic[T]):
    """A kernel built and loaded on its first call (by whichever thread comes first), then
    kept: ``kernel()`` is ``bind(library)`` (the library's functions with their ctypes
    signatures set), or None from then on where it cannot be built, after one warning
    that says what runs instead (``fallback``). ``needs_avx2``: refuse without AVX2 and
    FMA (``load``); False builds for whatever this CPU has (``build``)."""

    def __init__(self, source: Path, bind: Callable[[ctypes.CDLL], T], fallback: str,
                 needs_avx2: bool = True):
        self.source, self.bind, self.fallback = source, bind, fallback
        self.needs_avx2 = needs_avx2
        self._value: T | None = None
        self._failed = False
        self._lock = threading.Lock()

    def __call__(self) -> T | None:
        if self._value is None and not self._failed:
            with self._lock:
                if self._value is None and not self._failed:
                    try:
                        lib = (load(self.source) if self.needs_avx2
                               else ctypes.CDLL(str(build(self.source))))
                        self._value = self.bind(lib)
                    except Exception as exc:  # no C compiler, or an unusual platform
                        self._failed = True
                        logger.warning("could not build the %s kernel (%s); %s",
                                       self.source.stem, exc, self.fallback)
        return self._value
