"""Prefix keys: how a prompt starts, as short chained digests that the scheduler routes by
(scheduler/routing.py: a worker that was sent a prompt starting the same way holds its KV
blocks in its prefix cache).

``prefix_keys(prompt, scope)`` renders the prompt to text: a string as is; chat messages one
JSON object a line (keys sorted, so equal messages render alike; JSON escapes the newlines
inside a message, so no two message lists render alike); token ids as decimal numbers, each
followed by a comma. The text is cut into ``CHUNK_CHARS``-character chunks, and::

    key[i] = blake2b(key[i-1] + blake2b(scope) + chunk[i])      # key[-1] = b""

so key i names the whole text up to the end of chunk i: two prompts share key i exactly when
their first i chunks are equal and their scope is the same (the engine's cache partition,
``GenerationRequest.cache_scope``: a tenant; None, shared). Only full chunks count (a
partial last chunk says nothing about what other prompts share), and at most ``MAX_KEYS``
(a route message stays about a kilobyte; prompts equal that far route as equal).

Characters are not tokens: a chunk is about 64 tokens of English text, and routing needs
only "starts the same way", not the engine's block boundaries."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

CHUNK_CHARS = 256
MAX_KEYS = 64
_PERSON = b"rayguide-prefix"


def prefix_keys(prompt: str | list[int] | list[dict[str, Any]],
                scope: str | None = None) -> list[str]:
    """The chained keys (16 hex characters each) of the prompt's full chunks, at most
    ``MAX_KEYS``; [] for a prompt shorter than one chunk."""
    text = _rendered(prompt, CHUNK_CHARS * MAX_KEYS)
    seed = b"\x00" if scope is None else b"\x01" + scope.encode("utf-8", "surrogatepass")
    scope_digest = hashlib.blake2b(seed, digest_size=16, person=_PERSON).digest()
    keys, previous = [], b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        chunk = text[start:start + CHUNK_CHARS].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + scope_digest + chunk, digest_size=8,
                                   person=_PERSON).digest()
        keys.append(previous.hex())
    return keys


def _rendered(prompt, limit: int) -> str:
    """The prompt as text, cut to ``limit`` characters (what lies beyond makes no key)."""
    if isinstance(prompt, str):
        return prompt[:limit]
    text, size = [], 0
    for piece in _pieces(prompt):
        text.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(text)[:limit]


def _pieces(prompt: list) -> Iterator[str]:
    if all(isinstance(t, int) for t in prompt):
        for t in prompt:
            yield f"{t},"
        return
    for message in prompt:
        yield json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                         default=str) + "\n"


def prompt_tokens_estimate(prompt: str | list[int] | list[dict[str, Any]]) -> int:
    """About how many tokens the prompt is (4 characters a token of text; token ids as
    they are): what routing counts a request as beside its ``max_new_tokens``, since a
    worker's reported load counts its running prompts too."""
    if isinstance(prompt, str):
        return len(prompt) // 4
    if all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return sum(len(str(m.get("content") or "")) // 4 + 4 for m in prompt
               if isinstance(m, dict))

