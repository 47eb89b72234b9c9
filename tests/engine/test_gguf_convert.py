"""Tests for the GGUF -> HF-format conversion of the default model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from worker.models import gguf_convert
from worker.models.gguf_convert import (
    cache_root,
    convert_gguf,
    converted_dir_for,
    default_gguf_path,
    ensure_converted,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.mark.unit
def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYGUIDE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("RAYGUIDE_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "rayguide"


@pytest.mark.unit
def test_converted_dir_for_is_stable_and_tracks_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYGUIDE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 16)
    first = converted_dir_for(f)
    assert first == converted_dir_for(str(f)) == converted_dir_for(tmp_path / "." / "tiny.gguf")
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("tiny-")
    os.utime(f, ns=(0, 123_456_789_000))
    assert converted_dir_for(f) != first  # a changed file gets a fresh conversion


@pytest.mark.unit
def test_default_gguf_path_is_a_gguf_file():
    path = default_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.unit
def test_not_a_gguf_file_names_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYGUIDE_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "notes.txt"
    text.write_text("just some text\n")
    with pytest.raises(ValueError, match="notes.txt.*not a GGUF file"):
        convert_gguf(text, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="notes.txt"):
        ensure_converted(text, progress=False)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        ensure_converted(tmp_path / "missing.gguf", progress=False)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache" / "models").exists() or \
        not any((tmp_path / "cache" / "models").iterdir())


def _fake_convert_into(src, tmp, progress):
    for name in gguf_convert._REQUIRED:
        (tmp / name).write_text("{}")
    (tmp / gguf_convert._MARKER).write_text(json.dumps({"format": gguf_convert.FORMAT_VERSION}))


@pytest.mark.unit
def test_interrupted_conversion_leaves_nothing_and_incomplete_dir_is_replaced(
        monkeypatch, tmp_path):
    src = tmp_path / "tiny.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 16)
    out = tmp_path / "models" / "tiny"

    def interrupted(src, tmp, progress):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_convert_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src, out, progress=False)
    assert not out.exists() and not any(out.parent.iterdir())

    out.mkdir()
    (out / "config.json").write_text("{}")  # looks started, has no completion marker
    monkeypatch.setattr(gguf_convert, "_convert_into", _fake_convert_into)
    assert convert_gguf(src, out, progress=False) == out
    assert (out / gguf_convert._MARKER).is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]


@pytest.fixture(scope="module")
def converted(default_model_dir):
    """The default model as ``ensure_converted`` left it: the session's conversion (on a
    fresh machine the first test that needs the model converts it; a second conversion
    into a private cache here cost 20-45 s of the suite and tested nothing more)."""
    return default_model_dir


@pytest.fixture(scope="module")
def gguf_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


@pytest.mark.integration
def test_converted_dir_layout(converted):
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json"):
        assert (converted / name).is_file(), name
    assert "quantization_config" not in (converted / "config.json").read_text()
    assert not list(converted.parent.glob(".*.tmp-*"))  # no leftover temp dir


@pytest.mark.integration
def test_converted_model_matches_gguf_logits(converted, gguf_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    print(f"reload took {time.perf_counter() - start:.2f} s")
    assert model.dtype == torch.float32
    ref_model, ref_tok = gguf_model
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.tolist() == ref_tok(prompt, return_tensors="pt").input_ids.tolist()
        with torch.no_grad():
            got = model(ids).logits
            want = ref_model(ids).logits
        assert (got - want).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.integration
def test_tokenizer_chat_template_and_special_tokens(converted, gguf_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.chat_template and tok.chat_template == gguf_model[1].chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    # The chat template's markers must be single special tokens, not split text.
    assert tok("<|im_start|>user\n").input_ids[0] == tok.bos_token_id
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    # the model card's recommended sampling, the server's defaults for this model
    assert {k: gen[k] for k in gguf_convert.DEFAULT_MODEL_SAMPLING} == \
        gguf_convert.DEFAULT_MODEL_SAMPLING


@pytest.mark.integration
def test_second_ensure_converted_does_not_reconvert(converted, monkeypatch):
    # no conversion (it would call _convert_into) and no rewrite of the directory: the
    # seconds that saves are the startup bench's figure, not asserted here
    marker = converted / gguf_convert._MARKER
    before = (converted.stat().st_ino, marker.stat().st_mtime_ns)

    def fail(*args, **kwargs):
        raise AssertionError("reconverted an already complete directory")

    monkeypatch.setattr(gguf_convert, "_convert_into", fail)
    assert ensure_converted(progress=False) == converted
    assert convert_gguf(default_gguf_path(), converted, progress=False) == converted
    assert (converted.stat().st_ino, marker.stat().st_mtime_ns) == before


@pytest.mark.integration
def test_the_tokenizer_loads_as_autotokenizer_would(converted, tiny_model_dir):
    """load_tokenizer takes transformers' generic fast tokenizer class directly where
    tokenizer_config.json names it (the converted and the tiny model), skipping
    AutoTokenizer's lookup: what it gives must be what AutoTokenizer gives."""
    from transformers import AutoTokenizer

    from worker.models import loader

    texts = ["Hello world", ' {"a": 1}', "<|im_start|>user\nhi<|im_end|>", "ünïcode ✓ 😀",
             "  leading spaces\tand\ttabs\n\n"]
    chat = [{"role": "user", "content": "hi"}]
    for model_dir in (converted, tiny_model_dir):
        assert loader._plain_fast_tokenizer(model_dir, loader.load_config(model_dir))
        ours, auto = loader.load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
        assert type(ours) is type(auto)
        assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
        assert [ours(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]
        assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)
        assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
            (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id)
        assert ours.chat_template == auto.chat_template
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
