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
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
KERNELS = Path(__file__).parent / "kernels"


def cache_dir() -> Path:
    env = os.environ.get("RAYGUIDE_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "rayguide"
    return root / "kernels"


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
    out = cache_dir() / f"{source.stem}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
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
