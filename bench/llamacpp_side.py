"""llama.cpp (llama-cpp-python) batch-1 decode on the same model, for side-by-side figures.

Q4_1 is the default model's own GGUF; Q8_0 is made from it once with llama.cpp's quantizer
(requantized: same speed as a native Q8_0 file, not its quality). Greedy decode, one token
per ``eval`` call, the same prompt tokens as our engine, EOS ignored.
"""

from __future__ import annotations

import time
from pathlib import Path


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def q8_0_from(q4_path: Path, cache_dir: Path) -> Path:
    import llama_cpp

    out = cache_dir / (q4_path.stem.replace("Q4_1", "") + "requant.Q8_0.gguf")
    if not out.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(q4_path).encode(), str(tmp).encode(),
                                          params) != 0:
            raise RuntimeError("llama.cpp could not requantize to Q8_0")
        tmp.replace(out)
    return out


def decode_s_per_token(gguf: Path, prompt: list[int], n: int, threads: int) -> float:
    """Seconds per decode token (prompt eval excluded), median of 3 runs."""
    import statistics

    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                n_ctx=len(prompt) + n + 8, verbose=False, logits_all=False)
    runs = []
    for _ in range(3):
        llm.reset()
        llm.eval(prompt)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        runs.append((time.perf_counter() - t) / (n - 1))
    return statistics.median(runs)
