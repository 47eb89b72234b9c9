"""Incremental detokenization with stop strings, for streaming one sequence's output.

Every request's detokenizer (the engine builds a plain one's), in the guided path's layer
because the guided path is what edits it: a thought gets one of its own and its answer a
fresh one (request.py), and ``GrammarStopCheck`` binds stop strings to a grammar. It imports
nothing of the project."""

from __future__ import annotations

import codecs
import threading
from collections import OrderedDict
from typing import Callable, Sequence

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the output so its first token renders as it would
# mid-text (sentencepiece-style tokenizers drop a word's leading space at the start).
_PROMPT_CONTEXT = 5
# Tokens an unfinished character may stay pending before we look for a restart point;
# only invalid UTF-8 (e.g. a stray lead byte) ever gets this far.
_MAX_PENDING = 4


def _bytes_to_unicode() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class ByteVocab:
    """Each token id's bytes, as the tokenizer's decode writes them, for a byte-level BPE
    tokenizer (the default model's, GPT-2's, Llama 3's, Qwen's): the text of any ids is
    then their bytes joined and read as UTF-8, with no call into the tokenizer. A
    tokenizer's table is built once (``of``, about 50 ms for 49,152 tokens) and checked
    against its own decode, token by token; a tokenizer it does not match (another
    decoder, a normalizer, spaces cleaned up) has none, and its detokenizers decode."""

    # (id(tokenizer), skip) -> (the tokenizer, its table or None), the newest few: the
    # tokenizer is held so that its id cannot name another one while it is here
    _built: "OrderedDict[tuple[int, bool], tuple[object, ByteVocab | None]]" = OrderedDict()
    _KEPT = 8
    _lock = threading.Lock()

    def __init__(self, table: list[bytes]):
        self.table = table

    @classmethod
    def of(cls, tokenizer, skip_special_tokens: bool = True) -> "ByteVocab | None":
        """``tokenizer``'s table (built on its first ask; an engine asks at its start), or
        None where its text is not its tokens' bytes."""
        key = (id(tokenizer), skip_special_tokens)
        with cls._lock:
            hit = cls._built.get(key)
            if hit is None or hit[0] is not tokenizer:
                hit = cls._built[key] = (tokenizer, cls._build(tokenizer, skip_special_tokens))
                while len(cls._built) > cls._KEPT:
                    cls._built.popitem(last=False)
            cls._built.move_to_end(key)
            return hit[1]

    @classmethod
    def _build(cls, tokenizer, skip: bool) -> "ByteVocab | None":
        backend = getattr(tokenizer, "_tokenizer", None)
        if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False)
                or type(backend.decoder).__name__ != "ByteLevel"):
            return None
        try:
            size = backend.get_vocab_size(with_added_tokens=True)
            added = backend.get_added_tokens_decoder()
            table: list[bytes] = [b""] * size
            unbyte = _bytes_to_unicode()
            for token, i in backend.get_vocab(with_added_tokens=True).items():
                if i >= size:
                    return None
                if i in added:
                    table[i] = b"" if skip and added[i].special else token.encode()
                else:
                    table[i] = bytes(unbyte[c] for c in token)
            for i in range(size):  # the tokenizer's own decode, token by token
                if table[i].decode("utf-8", "replace") != backend.decode(
                        [i], skip_special_tokens=skip):
                    return None
        except (KeyError, AttributeError, TypeError, ValueError):
            return None
        return cls(table)


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into streamed text deltas.

    A byte-level BPE tokenizer's text is read from its tokens' bytes (``ByteVocab``: each
    token's bytes, checked against the tokenizer's own decode once), one incremental UTF-8
    read a token. Any other tokenizer's is decoded: only ``tokenizer.decode(ids,
    skip_special_tokens=...)`` is used, and each step decodes a
    window ``ids[prefix:]`` of a few tokens (under 10 for valid UTF-8): ``prefix`` is a token index the text restarts cleanly
    from, and ``emitted`` counts the window's characters already accounted for (emitted,
    or prompt context). A trailing U+FFFD is a character whose bytes may still arrive, so
    it is held back; the window slides forward whenever its text ends cleanly.

    Without stop strings, the deltas concatenate to ``tokenizer.decode(output_ids,
    skip_special_tokens=...)`` for byte-level BPE tokenizers. Empty stop strings are ignored.

    ``stop_check``, when set (a ``GrammarStopCheck``), decides whether a stop string found
    in the output is honoured: only where the grammar accepts exactly the output before it,
    so a stop never cuts output its grammar cannot end with.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, resumed_token_ids: Sequence[int] = (),
                 resumed_text: str = ""):
        """``resumed_token_ids`` / ``resumed_text``: a continuation's output generated
        elsewhere, and the part of its text the caller already has (a clean prefix of its
        decode: a character whose bytes were not all generated, or text held back for a
        stop string, was never sent). The deltas go on exactly after ``resumed_text``."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # a fast tokenizer's own decode (Rust) where transformers' wrapper adds nothing:
        # half the host time of a token's two decodes
        backend = getattr(tokenizer, "_tokenizer", None)
        self._fast = backend.decode if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False) else None
        # a byte-level BPE tokenizer's text is its tokens' bytes read as UTF-8: no decode
        # (a token costs a lookup and an incremental UTF-8 read, not two decodes)
        vocab = ByteVocab.of(tokenizer, skip_special_tokens)
        self._bytes = vocab.table if vocab is not None else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._carry = ""  # (bytes path) a continuation's text the caller has not had
        self._stops = tuple(s for s in stop if s)
        # (the bytes path needs no context: byte-level text drops no leading space)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if self._bytes is None else []
        context = self._decode(0, len(self._ids)) if self._ids else ""
        if context.endswith(_REPLACEMENT):
            # A prompt cut mid-character would glue its bytes onto the output's first ones.
            self._ids = []
            context = ""
        self._prefix = 0                    # window start: a clean restart point
        self._read = len(self._ids)         # end of the window's last clean decode
        self._emitted = len(context) + len(resumed_text)  # window chars accounted for
        self._ids.extend(resumed_token_ids)  # decoded with the next tokens, once
        if self._bytes is not None:
            table = self._bytes
            text = self._utf8.decode(b"".join(table[i] for i in resumed_token_ids
                                              if i < len(table)))
            self._carry = text[len(resumed_text):]
        self._before = resumed_text         # output the caller had before this one began
        self._held = ""                     # clean text that may begin a stop string
        self._text = ""
        self._stopped: str | None = None
        self._stop_check: GrammarStopCheck | None = None

    @property
    def stop_check(self) -> GrammarStopCheck | None:
        return self._stop_check

    @stop_check.setter
    def stop_check(self, check: GrammarStopCheck | None) -> None:
        """Set once the grammar is known: the check is advanced over all output so far."""
        self._stop_check = check
        if check is not None:
            check.commit(self._before + self._text)

    @property
    def text(self) -> str:
        """All text returned so far by add_tokens() and flush(), concatenated."""
        return self._text

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, or None: the first to be completed as text
        arrives (if several complete in one call, the one starting earliest)."""
        return self._stopped

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the new text that is safe to emit now.

        Text is withheld while it ends in an incomplete character or could be the start
        of a stop string. Once a stop string appears, the text is cut just before it,
        ``stopped`` is set, and this returns "" from then on.
        """
        if self._stopped is not None:
            return ""
        if self._bytes is not None:
            table, size = self._bytes, len(self._bytes)
            if len(new_token_ids) == 1:
                i = new_token_ids[0]
                text = self._utf8.decode(table[i] if i < size else b"")
            else:  # (an id past the tokenizer's, a padded embedding row, decodes to "")
                text = self._utf8.decode(b"".join(table[i] for i in new_token_ids
                                                  if i < size))
            if self._carry:
                text, self._carry = self._carry + text, ""
            return self._emit(text, final=False)
        self._ids.extend(new_token_ids)
        return self._emit(self._detokenize(final=False), final=False)

    def flush(self) -> str:
        """End the sequence: return all held-back text, cut before a stop string if one
        completes. Incomplete characters come out as U+FFFD, as a full decode has them."""
        if self._stopped is not None:
            return ""
        if self._bytes is not None:
            text, self._carry = self._carry + self._utf8.decode(b"", final=True), ""
            return self._emit(text, final=True)
        return self._emit(self._detokenize(final=True), final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        if self._fast is not None:
            return self._fast(self._ids[start:end], skip_special_tokens=self._skip)
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _detokenize(self, final: bool) -> str:
        text = self._decode(self._prefix)
        # Lossy UTF-8 decoding turns an unfinished character at the end into one U+FFFD
        # that later bytes may change; every character before it is settled.
        pending = text.endswith(_REPLACEMENT) and not final
        end = len(text) - 1 if pending else len(text)
        delta = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        if not pending:
            # Restart from the previous clean point, keeping one step of context.
            self._prefix, self._read = self._read, len(self._ids)
            self._emitted = len(self._decode(self._prefix, self._read))
        elif len(self._ids) - self._read > _MAX_PENDING:
            # Invalid bytes keep the window open: restart at the latest token k where the
            # split decodes identically. With some text after k, bytes that could still
            # join across k make the split differ, so the restart cannot change the text.
            for k in range(len(self._ids) - 1, self._read, -1):
                head, tail = self._decode(self._prefix, k), self._decode(k)
                if tail and head + tail == text:
                    self._prefix = self._read = k
                    self._emitted = len(tail) - 1
                    break
        return delta

    def _emit(self, new_text: str, final: bool) -> str:
        # Held text is the longest tail that could begin a stop string, so a stop cannot
        # start in text already emitted: searching held + new is enough.
        buf = self._held + new_text
        hit = self._first_stop(buf)
        if hit is not None:
            cut, self._stopped = hit
            out, self._held = buf[:cut], ""
        else:
            keep = 0 if final else self._stop_prefix_len(buf)
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
            if self._stop_check is not None:
                self._stop_check.commit(out)
        self._text += out
        return out

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """The earliest honoured stop string in ``buf``: (where it starts, which)."""
        if not self._stops:
            return None
        if self._stop_check is None:
            hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
            return min(hits, key=lambda h: h[0]) if hits else None
        hits = sorted((i, s) for s in self._stops
                      for i in _occurrences(buf, s))
        for i, s in hits:
            if self._stop_check.accepts(buf[:i]):
                return i, s
        return None

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest


class GrammarStopCheck:
    """Whether a grammar accepts exactly the output up to a stop string, in time linear in
    the output: one matcher is advanced over the text as it is emitted (``commit``), and a
    candidate asks only about the few characters after it (``accepts``), accepted and
    rolled back. (A fresh matcher over the whole output at each stop occurrence made a
    guided output with many occurrences quadratic, on the engine thread.)

    ``matcher``: a grammar matcher with ``accept_string(str) -> bool`` (one rollback step,
    the state unchanged when refused), ``is_completed()`` and ``rollback(n)``: either
    backend's matcher (worker/guided/backend.py), or a bare ``xgrammar.GrammarMatcher``.
    """

    def __init__(self, matcher):
        self._matcher = matcher
        self._refused = False  # the committed text left the grammar: nothing is accepted

    def commit(self, text: str) -> None:
        """``text`` follows the output committed so far and will not be taken back."""
        if text and not self._refused and not self._matcher.accept_string(text):
            self._refused = True

    def accepts(self, tail: str) -> bool:
        """Whether the grammar accepts exactly the committed text + ``tail`` and may end."""
        if self._refused:
            return False
        if not tail:
            return self._matcher.is_completed()
        if not self._matcher.accept_string(tail):
            return False
        done = self._matcher.is_completed()
        self._matcher.rollback(1)
        return done


def _occurrences(text: str, sub: str):
    i = text.find(sub)
    while i >= 0:
        yield i
        i = text.find(sub, i + 1)


def fast_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> token ids without special tokens: the fast tokenizer's Rust encoder where
    there is one (the transformers call around it costs about 3x the encoding itself, on
    every forced text and closing path of every guided row), else the tokenizer's call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
