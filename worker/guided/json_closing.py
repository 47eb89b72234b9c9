"""Closing a JSON document from its schema: the text that ends a partial output validly,
written from where the output stands, with no search.

The closing search (closing.py) finds a grammar's shortest completion from the matcher
alone, which holds for every grammar kind but costs a search over tokens: inside long
required answers (twelve objects of three strings of at least 24 characters) it runs out
of time or nodes and gives up, and the output ends at its budget unclosed. A JSON schema
says what is left to write, so the completion can be read off the schema instead:

    scan = JsonScan(closer)           # per request: follows the output's text
    scan.feed(text)                   # the output's new text (incremental; ``clone`` to try)
    rest = scan.completion(layout)    # text that ends the document, or None

``JsonScan`` is a small pushdown reader of JSON: a stack of open objects and arrays, each
with the schema node it is in (``$ref`` resolved, ``allOf`` merged, ``anyOf`` / ``oneOf``
kept as options and narrowed by the keys seen), the keys written or the items counted, and
the scalar being written (a string with its length so far and pending escape, a number, a
literal). ``completion`` then writes, innermost first: the rest of the scalar (a string
padded to its ``minLength``, the rest of the ``enum`` / ``const`` value it started, a
number or literal finished), the missing colon and value of a key, each required key not
yet written with the schema's witness value (schema_witness.py), the items an array still
needs for its ``minItems``, and the closing brackets.

What it does not know (a partial string under a ``pattern`` or ``format``, a key that no
property starts with, a text that is not JSON) gives None, and the caller falls back on
the search. It is a heuristic like the search's state merge, so its answer is never
trusted as is: the caller (output_policy.py) replays the tokens on a fork of the request's
matcher and validates the whole text against the schema before it takes them.

Cost: ``feed`` is a loop over the new characters (one token's, microseconds);
``completion`` walks the stack (a few frames) and reuses witness text per schema node.

Why one module over 500 lines: the reader, the schema at each of its places and the
completion written from its stack are one algorithm over one state.
"""

from __future__ import annotations

import codecs
import json

from core.json_schema import ANNOTATIONS
from worker.guided.schema_witness import _Builder, _NoWitness, _string

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_MAX_OPTIONS = 16  # anyOf / oneOf branches kept per node


class _Unknown(Exception):
    """The text or the schema left what a completion needs unknown."""


class SchemaNodes:
    """A schema's nodes as the reader needs them: a node's options (dicts), a property's
    or an item's node, and the witness text of a node; memoized per node."""

    def __init__(self, root):
        self.root = root
        self.builder = _Builder(root)
        self._options: dict[int, list] = {}
        self._witness: dict[tuple[int, str, str], str | None] = {}
        self._keep: list = []  # nodes built here (merged), kept alive for the id memo
        self.jump: int | None = None  # the caller's token count of ``jumps`` (memo)

    def options(self, node) -> list:
        """``node`` as a list of plain dict options: references resolved, ``allOf``
        merged, ``anyOf`` / ``oneOf`` branches each merged with the keywords beside them.
        ``True`` (anything) is ``[{}]``; ``False`` is ``[]``."""
        key = id(node)
        hit = self._options.get(key)
        if hit is None:
            hit = self._options[key] = self._expand(node, 0)
            self._keep.append(node)
        return hit

    def _expand(self, node, depth: int) -> list:
        if depth > 16:
            raise _Unknown
        if node is True or node is None:
            return [{}]
        if not isinstance(node, dict):
            return []
        b = self.builder
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = b.resolver.get(ref) if b.resolver is not None else None
            if target is None:
                raise _Unknown
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = {**target, **rest} if rest and isinstance(target, dict) else target
            return self._expand(node, depth + 1)
        if "allOf" in node:
            try:
                return self._expand(b._merged(node), depth + 1)
            except _NoWitness as exc:
                raise _Unknown from exc
        for word in ("anyOf", "oneOf"):
            branches = node.get(word)
            if isinstance(branches, list) and branches:
                rest = {k: v for k, v in node.items() if k != word}
                out = []
                for branch in branches[:_MAX_OPTIONS]:
                    branch = b._deref(branch)
                    if isinstance(branch, dict):
                        out += self._expand({**rest, **branch}, depth + 1)
                    elif branch is True:
                        out += self._expand(rest, depth + 1)
                return out
        return [node]

    def witness(self, node, layout: tuple[str, str]) -> str | None:
        """The witness of ``node`` as JSON text in ``layout``, or None."""
        key = (id(node), *layout)
        if key not in self._witness:
            self.builder.nodes = 0
            self.builder.open_refs = set()
            text = None
            try:
                value = self.builder.value(node, 0)
                text = json.dumps(value, ensure_ascii=False, separators=layout)
            except (_NoWitness, RecursionError, TypeError, ValueError, OverflowError):
                pass
            self._witness[key] = text
            self._keep.append(node)
        return self._witness[key]


    def jumps(self, layout: tuple[str, str], keep: int = 3) -> list[str]:
        """The longest texts one choice of the model can commit an output to, beyond what
        its closing needed before: an optional property's key and witness value, an item
        past ``minItems``, an additional property's value (the ``keep`` longest, by
        characters). A bound on how much one token can lengthen a completion, so closing
        checks tokens early enough for it (the search's estimate from a dive did that)."""
        comma, colon = layout
        found: list[str] = []
        seen: set[int] = set()
        todo = [self.root]
        while todo and len(seen) < 2000:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            try:
                options = self.options(node)
            except _Unknown:
                continue
            for option in options:
                props = option.get("properties")
                props = props if isinstance(props, dict) else {}
                required = option.get("required")
                required = set(required) if isinstance(required, list) else set()
                for name, sub in props.items():
                    todo.append(sub)
                    if name not in required:
                        text = self.witness(sub, layout)
                        if text is not None:
                            found.append(comma + json.dumps(name) + colon + text)
                extra = option.get("additionalProperties")
                if isinstance(extra, dict):
                    todo.append(extra)
                    text = self.witness(extra, layout)
                    if text is not None:
                        found.append(colon + text)
                items = option.get("items")
                for sub in ([items] if isinstance(items, dict) else []) + [
                        p for p in option.get("prefixItems", []) if isinstance(p, dict)]:
                    todo.append(sub)
                    text = self.witness(sub, layout)
                    if text is not None:
                        found.append(comma + text)
        return sorted(found, key=len, reverse=True)[:keep]


def _within(option: dict, value) -> bool:
    """``value`` inside the option's numeric bounds (other keywords: the caller's check)."""
    try:
        for word, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                         ("exclusiveMinimum", lambda b: value > b),
                         ("exclusiveMaximum", lambda b: value < b)):
            bound = option.get(word)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not ok(bound):
                return False
    except TypeError:
        return False
    return True


def _kinds(option: dict) -> set[str]:
    kinds = option.get("type")
    if isinstance(kinds, str):
        return {kinds}
    if isinstance(kinds, list):
        return {k for k in kinds if isinstance(k, str)}
    return set()  # any (or implied by the keywords: not narrowed here)


# the keywords of a string option that bound nothing of its text but its least length
_FREE_STRING = ANNOTATIONS | {"type", "minLength"}


def _takes(option: dict, kind: str) -> bool:
    kinds = _kinds(option)
    if not kinds:
        return True
    return kind in kinds or (kind == "number" and "integer" in kinds)


class _Frame:
    __slots__ = ("array", "options", "keys", "count", "state", "key")

    def __init__(self, array: bool, options: list):
        self.array = array
        self.options = options
        self.keys: list[str] = []
        self.count = 0
        # object: "first" (after '{'), "key" (after ','), "colon" (key written), "value"
        # (after ':'), "next" (after a value); array: "first", "value", "next"
        self.state = "first"
        self.key: str | None = None

    def clone(self) -> "_Frame":
        f = _Frame(self.array, self.options)
        f.keys, f.count, f.state, f.key = list(self.keys), self.count, self.state, self.key
        return f


class _Scalar:
    __slots__ = ("kind", "chars", "esc", "hex", "is_key", "options")

    def __init__(self, kind: str, options: list, is_key: bool = False, first: str = ""):
        self.kind = kind  # "string", "number", "literal"
        self.chars: list[str] = [first] if first else []
        self.esc = 0  # string: 0 none, 1 after '\', 2.. inside \\uXXXX (hex digits + 2)
        self.hex = ""
        self.is_key = is_key
        self.options = options

    def clone(self) -> "_Scalar":
        s = _Scalar(self.kind, self.options, self.is_key)
        s.chars, s.esc, s.hex = list(self.chars), self.esc, self.hex
        return s


class JsonScan:
    """Follows one output's JSON text against its schema (see the module doc)."""

    def __init__(self, nodes: SchemaNodes):
        self.nodes = nodes
        self.stack: list[_Frame] = []
        self.scalar: _Scalar | None = None
        self.started = self.done = self.broken = False
        self.sep = ""  # the separator (',' or ':' and the blanks after it) just written
        self.tokens = 0  # how many of the output's tokens were fed (the caller's count)
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        # the last closing piece of each open container, by depth: (what it was read
        # from, the piece); see _complete
        self._pieces: dict[int, tuple] = {}

    def clone(self) -> "JsonScan":
        c = JsonScan.__new__(JsonScan)
        c.nodes = self.nodes
        c._pieces = {}
        c.stack = [f.clone() for f in self.stack]
        c.scalar = self.scalar.clone() if self.scalar is not None else None
        c.started, c.done, c.broken, c.tokens = self.started, self.done, self.broken, self.tokens
        c.sep = self.sep
        c._utf8 = codecs.getincrementaldecoder("utf-8")()
        c._utf8.setstate(self._utf8.getstate())
        return c

    @property
    def pending(self) -> bool:
        """An unfinished UTF-8 character is waiting for its next bytes."""
        return bool(self._utf8.getstate()[0])

    def in_free_string(self) -> bool:
        """Whether what was fed ends inside a string value whose text may go on with any
        characters but a quote and a backslash, at any length: not a key, no escape or
        unfinished character under way, exactly one of its options takes a string and
        says nothing of the text but its least length (``minLength``, annotations), and
        every open container has one option (so the text chooses between none). More
        such characters then leave what may follow the string as it was."""
        s = self.scalar
        if (self.broken or s is None or s.kind != "string" or s.is_key or s.esc
                or self.pending):
            return False
        strings = [o for o in s.options if _takes(o, "string")]
        if len(strings) != 1 or not _FREE_STRING.issuperset(strings[0]):
            return False
        return all(len(f.options) == 1 for f in self.stack)

    def feed_bytes(self, data: bytes) -> None:
        try:
            self.feed(self._utf8.decode(data))
        except UnicodeDecodeError:
            self.broken = True

    def feed(self, text: str) -> None:
        for ch in text:
            if self.broken:
                return
            s = self.scalar
            if s is not None:
                if s.kind == "string":
                    self._string_char(s, ch)
                    continue
                if ch.isalnum() or ch in "+-.":
                    s.chars.append(ch)
                    continue
                self._end_value()
            self._structural(ch)

    # reading --------------------------------------------------------------------------

    def _string_char(self, s: _Scalar, ch: str) -> None:
        if s.esc == 0:
            if ch == "\\":
                s.esc = 1
            elif ch == '"':
                self._end_string(s)
            else:
                s.chars.append(ch)
        elif s.esc == 1:
            if ch == "u":
                s.esc, s.hex = 2, ""
            else:
                s.esc = 0
                s.chars.append(_ESCAPES.get(ch, ch))
        else:
            s.hex += ch
            if len(s.hex) == 4:
                s.esc = 0
                try:
                    s.chars.append(chr(int(s.hex, 16)))
                except ValueError:
                    self.broken = True

    def _structural(self, ch: str) -> None:
        if ch in _WS:
            if self.sep:
                self.sep += ch
            return
        self.sep = ch if ch in ",:" else ""
        top = self.stack[-1] if self.stack else None
        if ch == '"':
            if top is not None and not top.array and top.state in ("first", "key"):
                self.scalar = _Scalar("string", top.options, is_key=True)
            else:
                self.scalar = _Scalar("string", self._value_options())
        elif ch == "{" or ch == "[":
            options = self._value_options()
            self.stack.append(_Frame(ch == "[", options))
        elif ch == ":" and top is not None and not top.array and top.state == "colon":
            top.state = "value"
        elif ch == "," and top is not None and top.state == "next":
            top.state = "value" if top.array else "key"
        elif ch in "}]" and top is not None and top.array == (ch == "]") and (
                top.state in ("first", "next")):
            self.stack.pop()
            self._value_done()
        elif ch in "-0123456789":
            self.scalar = _Scalar("number", self._value_options(), first=ch)
        elif ch in "tfn":
            self.scalar = _Scalar("literal", self._value_options(), first=ch)
        else:
            self.broken = True

    def _value_options(self) -> list:
        """The options of the value that starts here (and marks the document started)."""
        if not self.stack:
            if self.started:  # a second document
                self.broken = True
                return []
            self.started = True
            return self.nodes.options(self.nodes.root)
        top = self.stack[-1]
        if top.array:
            return self.nodes.options(self._item_node(top))
        if top.state != "value":
            self.broken = True
            return []
        return self.nodes.options(self._property_node(top, top.key))

    def _end_string(self, s: _Scalar) -> None:
        self.scalar = None
        if s.is_key:
            top = self.stack[-1]
            top.key, top.state = "".join(s.chars), "colon"
        else:
            self._value_done()

    def _end_value(self) -> None:
        s, self.scalar = self.scalar, None
        text = "".join(s.chars)
        if s.kind == "literal" and text not in _LITERALS:
            self.broken = True
        self._value_done()

    def _value_done(self) -> None:
        if not self.stack:
            self.done = True
            return
        top = self.stack[-1]
        if top.array:
            top.count += 1
        else:
            top.keys.append(top.key)
            top.key = None
        top.state = "next"

    # the schema at a place ----------------------------------------------------------------

    def _object_option(self, frame: _Frame) -> dict:
        """The first object option that names every key seen (or allows others)."""
        for option in frame.options:
            if not _takes(option, "object"):
                continue
            props = option.get("properties") if isinstance(option.get("properties"), dict) else {}
            if all(k in props or option.get("additionalProperties", True) is not False
                   for k in frame.keys + ([frame.key] if frame.key else [])):
                return option
        raise _Unknown

    def _property_node(self, frame: _Frame, key: str | None):
        option = self._object_option(frame)
        props = option.get("properties")
        if isinstance(props, dict) and key in props:
            return props[key]
        if isinstance(option.get("patternProperties"), dict) and option["patternProperties"]:
            raise _Unknown  # which pattern names it: not worked out here
        extra = option.get("additionalProperties", True)
        return True if extra is None else extra

    def _array_option(self, frame: _Frame) -> dict:
        for option in frame.options:
            if _takes(option, "array"):
                return option
        raise _Unknown

    def _item_node(self, frame: _Frame, index: int | None = None):
        option = self._array_option(frame)
        index = frame.count if index is None else index
        prefix, items = option.get("prefixItems"), option.get("items")
        if isinstance(items, list):  # draft 4's tuple
            prefix, items = items, option.get("additionalItems", True)
        if isinstance(prefix, list) and index < len(prefix):
            return prefix[index]
        return True if items is None else items

    # the completion ---------------------------------------------------------------------

    def completion(self, layout: tuple[str, str] = (", ", ": ")) -> str | None:
        """Text that, after what was fed, ends the document validly for the schema (as
        far as these rules see: the caller validates), or None."""
        parts = self.completion_parts(layout)
        return None if parts is None else "".join(parts)

    def completion_parts(self, layout: tuple[str, str] = (", ", ": ")) -> list[str] | None:
        """``completion`` in pieces: the open value's rest, then each open container's,
        innermost first. The outer pieces stay the same while the model writes inside an
        inner value, so a caller that counts each piece's tokens once (the closing
        estimate, every step of a long answer) tokenizes only what changed."""
        if self.broken or self.pending:
            return None
        if self.done:
            return []
        if not self.started:
            text = self.nodes.witness(self.nodes.root, layout)
            return None if text is None else [text]
        try:
            return self._complete(layout)
        except (_Unknown, _NoWitness, RecursionError):
            return None

    def _witness(self, node, layout) -> str:
        text = self.nodes.witness(node, layout)
        if text is None:
            raise _Unknown
        return text

    def _complete(self, layout: tuple[str, str]) -> list[str]:
        out: list[str] = []
        s = self.scalar
        frames = [f.clone() for f in self.stack]
        if s is not None:
            if s.kind == "string" and s.is_key:
                top = frames[-1]
                prefix = "".join(s.chars)
                name = self._key_name(top, prefix, s)
                out.append(json.dumps(name[len(prefix):], ensure_ascii=False)[1:] )
                top.key, top.state = name, "colon"
            else:
                out.append(self._scalar_rest(s))
                if frames:
                    self._done_in(frames[-1])
        pad = ""
        if s is None and self.sep:  # the rest of the layout's separator (", " after ",")
            want = layout[0] if self.sep[0] == "," else layout[1]
            pad = want[len(self.sep):] if want.startswith(self.sep) else ""
        # a container's piece follows from its state once what is inside it is closed:
        # kept by depth and read again while that state is the same (its frame, count,
        # keys written, place, and the pad before it; keys are only ever appended), so a
        # long answer's outer pieces (the items still owed of an array of 12 objects) are
        # not written again at every token of its innermost value
        pieces = self._pieces
        for i in range(len(frames) - 1, -1, -1):
            frame = frames[i]
            p = pad if i == len(frames) - 1 else ""
            key = (self.stack[i], frame.count, len(frame.keys), frame.state, frame.key, p,
                   layout)
            kept = pieces.get(i)
            if kept is not None and kept[0] == key:
                out.append(kept[1])
            else:
                piece = self._close_frame(frame, layout, p)
                pieces[i] = (key, piece)
                out.append(piece)
            if i:
                self._done_in(frames[i - 1])
        return out

    @staticmethod
    def _done_in(frame: _Frame) -> None:
        if frame.array:
            frame.count += 1
        else:
            frame.keys.append(frame.key)
            frame.key = None
        frame.state = "next"

    def _key_name(self, frame: _Frame, prefix: str, s: _Scalar) -> str:
        """The key being written: a property name starting with what was written (a
        required one not yet written first)."""
        if s.esc:
            raise _Unknown
        option = self._object_option(frame)
        props = option.get("properties") if isinstance(option.get("properties"), dict) else {}
        required = [r for r in option.get("required", []) if isinstance(r, str)]
        names = [r for r in required if r not in frame.keys] + [
            n for n in props if n not in frame.keys]
        for name in names:
            if name.startswith(prefix):
                return name
        raise _Unknown

    def _scalar_rest(self, s: _Scalar) -> str:
        text = "".join(s.chars)
        if s.kind == "literal":
            for word in _LITERALS:
                if word.startswith(text):
                    return word[len(text):]
            raise _Unknown
        if s.kind == "number":
            # the digits that finish it within the bounds: a "1" under "minimum": 3 can
            # still become "10" (a few zeros tried; the caller validates the rest)
            base = "0" if text.endswith(("-", ".", "e", "E", "+")) else ""
            for rest in (base + "0" * k for k in range(7)):
                try:
                    value = json.loads(text + rest)
                except ValueError:
                    continue
                if all(_within(o, value) for o in s.options if _takes(o, "number")):
                    return rest
            raise _Unknown
        # a string value
        rest = ""
        if s.esc == 1:
            rest, text = "n", text + "\n"
        elif s.esc >= 2:
            if s.hex.lower().startswith("d"):
                raise _Unknown  # half a surrogate pair
            rest = "0" * (4 - len(s.hex))
            text += chr(int((s.hex + rest) or "0", 16))
        for option in s.options:
            if not _takes(option, "string"):
                continue
            values = [option["const"]] if "const" in option else option.get("enum")
            if isinstance(values, list):
                for v in values:
                    if isinstance(v, str) and v.startswith(text) and not rest:
                        return json.dumps(v[len(text):], ensure_ascii=False)[1:-1] + '"'
                continue
            if "pattern" in option or "format" in option:
                if not text and not rest:
                    try:
                        return json.dumps(_string(option), ensure_ascii=False)[1:-1] + '"'
                    except _NoWitness:
                        continue
                continue  # a partial text under a pattern: the search's
            least = option.get("minLength", 0)
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            most = option.get("maxLength")
            if isinstance(most, int) and len(text) > most:
                continue
            return rest + "a" * max(0, least - len(text)) + '"'
        raise _Unknown

    def _close_frame(self, frame: _Frame, layout: tuple[str, str], pad: str = "") -> str:
        """What ends one open container (its scalar already finished): a pending value
        (after ``pad``: the rest of a separator), the required keys or items still
        missing, the bracket."""
        comma, colon = layout
        out = [pad] if frame.state in ("value", "key") else []
        if frame.array:
            option = self._array_option(frame)
            least = option.get("minItems", 0)
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            if frame.state == "value":  # after ',': an item is owed
                out.append(self._witness(self._item_node(frame), layout))
                frame.count += 1
            while frame.count < least:
                if frame.count or out:
                    out.append(comma)
                out.append(self._witness(self._item_node(frame), layout))
                frame.count += 1
                if len(out) > 4096:
                    raise _Unknown
            out.append("]")
        else:
            option = self._object_option(frame)
            props = option.get("properties") if isinstance(option.get("properties"), dict) else {}
            if frame.state == "colon":
                out.append(colon)
                frame.state = "value"
            if frame.state == "value":
                out.append(self._witness(self._property_node(frame, frame.key), layout))
                self._done_in(frame)
            elif frame.state == "key":  # after ',': a key is owed
                names = [r for r in option.get("required", []) if isinstance(r, str)
                         and r not in frame.keys] or [n for n in props if n not in frame.keys]
                if not names:
                    raise _Unknown
                out.append(self._member(frame, names[0], layout))
            required = [r for r in option.get("required", []) if isinstance(r, str)]
            for name in dict.fromkeys(required):
                if name not in frame.keys:
                    if frame.keys:
                        out.append(comma)
                    out.append(self._member(frame, name, layout))
            least = option.get("minProperties", 0)
            for name in props:
                if not isinstance(least, int) or len(frame.keys) >= least:
                    break
                if name not in frame.keys:
                    out.append(comma if frame.keys else "")
                    out.append(self._member(frame, name, layout))
            out.append("}")
        return "".join(out)

    def _member(self, frame: _Frame, name: str, layout: tuple[str, str]) -> str:
        frame.key = name
        text = json.dumps(name, ensure_ascii=False) + layout[1] + self._witness(
            self._property_node(frame, name), layout)
        self._done_in(frame)
        return text
