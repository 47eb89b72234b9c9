"""Reasoning models: a free thought, then the answer in the grammar.

A request of an engine configured with reasoning markers (``EngineConfig.reasoning``:
``{"start": "<think>", "end": "</think>"}``) has two phases. While it thinks, no grammar
mask applies and its matcher sees nothing (the row samples like an unguided one; a stop
token id there ends the thought, not the request). Once the end-of-thought marker has been
produced (as text: a marker may span several tokens, or be one added token), the answer
phase begins with the next token: the grammar, the output policy (budget-aware closing,
the loop guard, post-validation) and stop strings apply to the answer only.

The thought's length is bounded by the request's ``thinking_token_budget`` (or the
engine's default) and by what the answer needs: ``max_tokens`` covers both phases, so a
guided request's thought ends (the marker forced) while the budget still holds the
marker and the grammar's shortest answer plus a margin. A budget that cannot hold even
that is refused at admission.

Where a request starts is decided once, from what its rendered prompt ends with
(``prompt_thought``): a prompt whose last marker is an open start marker (a template that
opens the thought, ``<think>\n``; a completion prompt that stops mid-thought) starts in
the thought; every other prompt starts in its answer (a completion prompt that closed the
thought, a template's empty thought for a non-thinking turn, a prompt with no marker). A
chat prompt is judged by what its template appends for the assistant's turn
(``generation_prompt``), so a marker quoted in a message or an earlier turn's thought
decides nothing. A request that starts in its answer is answered directly: a guided one
is under its grammar from its first token. One exception, unguided only: with no marker
in the prompt (a chat: in its template's assistant turn), an output that itself begins with the start marker (a template that leaves the
model to open its thought) is taken as a thought (``opens_thought``); until its first text
decides, that text is held back, and an output that turns out not to open one (``\n\nAda``,
``<b>``) is streamed whole as the answer.

The thought streams as ``reasoning`` deltas: the markers are taken out, and leading and
trailing whitespace around the thought is dropped. Text after the end marker in the same
token (``</think>\n\nYes``, ``>"``) is the answer's first text (``Thinking.after``): an
unguided request streams it as content. A guided one cannot keep a token that is half
thought, half answer (its matcher must see the answer's text, and the model's context
must be what the client got), so the engine splits it (``split_marker_token``): the token
becomes the tokens of its text up to the marker's end, and the text after it, tokenized,
joins the answer as forced tokens when the grammar accepts all of it; when it does not,
that text is dropped (the model then writes the answer's start under the mask, from a
context that ends with the bare marker): nothing invalid is ever emitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningMarkers:
    """What begins and ends a thought (as text)."""

    start: str = "<think>"
    end: str = "</think>"

    @classmethod
    def parse(cls, value) -> "ReasoningMarkers | bool | None":
        """``EngineConfig.reasoning``: None (read from the chat template: see
        ``from_template``), False (no reasoning phase), True (the default markers), or a
        dict with ``start`` / ``end``."""
        if value is None or value is False:
            return value
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("must be a mapping like "
                             "{start: '<think>', end: '</think>'}, true, or null")
        unknown = set(value) - {"start", "end"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}; "
                             "use start and end")
        markers = cls(**value)
        for name in ("start", "end"):
            text = getattr(markers, name)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{name} must be a non-empty string")
        return markers


def from_template(tokenizer) -> ReasoningMarkers | None:
    """The default markers when the model's chat template writes them (a reasoning model's
    template renders or strips ``<think> ... </think>``), else None."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    markers = ReasoningMarkers()
    return markers if markers.start in template and markers.end in template else None


OPEN, CLOSED = "open", "closed"


def prompt_thought(text: str, markers: ReasoningMarkers) -> str | None:
    """Where a rendered prompt (``text``, special tokens kept) leaves a thought: OPEN when
    its last marker is a start marker (it ends inside a thought), CLOSED when it is an end
    marker, None when it holds neither."""
    start, end = text.rfind(markers.start), text.rfind(markers.end)
    if start < 0 and end < 0:
        return None
    return OPEN if start > end else CLOSED


def generation_prompt(tokenizer) -> str | None:
    """The text a chat template appends for the assistant's turn (``add_generation_prompt``:
    ``<|im_start|>assistant\n``, ``<|Assistant|><think>\n``), read by rendering one probe
    chat with and without it; None when the template renders the two differently before
    that point (then the whole rendered prompt is judged)."""
    probe = [{"role": "user", "content": "?"}]
    try:
        bare = tokenizer.apply_chat_template(probe, add_generation_prompt=False,
                                             tokenize=False)
        full = tokenizer.apply_chat_template(probe, add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # a template that refuses the probe: judge each rendered prompt
        return None
    return full[len(bare):] if full.startswith(bare) else None


def opens_thought(text: str, start: str) -> bool | None:
    """Whether an output that begins with ``text`` opens a thought: True when it begins with
    the start marker, False when it cannot, None while undecided (only whitespace, or a
    piece of the marker: ``<``, ``<th``)."""
    body = text.lstrip()
    if body.startswith(start):
        return True
    return None if start.startswith(body) else False


class Thinking:
    """One request's thinking phase: how many tokens its thought took, how many it may
    take (``limit``: then the end marker is forced), and the thought's text, turned into
    reasoning deltas as it arrives (``feed``)."""

    def __init__(self, markers: ReasoningMarkers, end_ids: list[int], limit: int):
        self.markers = markers
        self.end_ids = list(end_ids)  # the end marker as tokens (what is forced)
        self.limit = max(0, limit)
        self.tokens = 0  # output tokens of the thought so far, the marker's included
        self.done = False  # the end marker was produced: the answer phase has begun
        self.forced = False  # ... because the budget ran out (or the model stopped)
        # no marker in the prompt and unguided: the output's first text says whether this
        # is a thought at all (opens_thought); the engine decides on it
        self.opening = False
        self._text = ""  # the thought's raw text so far
        self._emitted = 0  # characters of the reasoning view handed out

    @property
    def active(self) -> bool:
        return not self.done

    @property
    def after(self) -> str:
        """The text after the end marker in what was fed (the marker's own token, or the
        tokens forced with it, went on past it): the answer's first text."""
        at = self._text.find(self.markers.end)
        return self._text[at + len(self.markers.end):] if at >= 0 else ""

    def feed(self, text: str, final: bool = False) -> str:
        """The thought's next text in; the reasoning delta out. Sets ``done`` when the end
        marker appears (what follows it in the same text is ``after``: the answer's)."""
        self._text += text
        end = self.markers.end
        at = self._text.find(end)
        if at >= 0:
            self.done = True
            view = self._view(self._text[:at], final=True)
        else:
            view = self._view(self._text, final=final)
        delta = view[self._emitted:]
        self._emitted = max(self._emitted, len(view))
        return delta

    def _view(self, text: str, final: bool) -> str:
        """The reasoning a raw thought shows: without a leading start marker, without the
        surrounding whitespace. Text that may still become a marker (a proper prefix of the
        start marker at the beginning, of the end marker at the end) is held back until
        the next text decides it, so the view only ever grows."""
        start, end = self.markers.start, self.markers.end
        body = text.lstrip()
        if not final and start.startswith(body):
            return ""  # "", "<thi": may still be the start marker
        if body.startswith(start):
            body = body[len(start):].lstrip()
        if final:
            return body.rstrip()
        body = body[:len(body) - _prefix_tail(body, end)]
        return body.rstrip()


def _prefix_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_marker_token(decode, thought: list[int], end: str) -> tuple[str, str] | None:
    """The last token of ``thought`` completed the end marker and went on past it: (the
    token's text up to the marker's end, the text after it), or None when the token's
    text cannot be told apart from its neighbours' (a character split across tokens).
    ``decode(ids)`` renders ids as text, special tokens kept."""
    before, whole = decode(thought[:-1]), decode(thought)
    cut = whole.find(end) + len(end)
    if cut < len(end) or not whole.startswith(before) or cut <= len(before):
        return None
    return whole[len(before):cut], whole[cut:].rstrip("\ufffd")


def thought_end(decode, token_ids: list[int], end: str) -> int | None:
    """Where a thought ended in ``token_ids`` (a failover's resumed output): the number of
    tokens up to and including the one that completes the end marker, or None (still
    thinking). ``decode(ids)`` renders ids as text, special tokens kept."""
    if end not in decode(token_ids):
        return None
    lo, hi = 1, len(token_ids)  # the shortest prefix whose text holds the marker
    while lo < hi:
        mid = (lo + hi) // 2
        if end in decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
