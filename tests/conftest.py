"""Shared fixtures. The default model is converted once per machine (cached under
~/.cache/rayguide or $RAYGUIDE_CACHE_DIR) and loaded once per test session."""

import os
import tempfile

import pytest
import torch

# Tests count compiles and cache hits: the grammar cache's disk tier is off by default in
# the whole session (this process and the Ray processes, which inherit the environment),
# and any cache that turns it on (tests/test_grammar_replication.py) writes to a folder of
# this run's own, never to the user's ~/.cache (a second run would find it warm)
os.environ["RAYGUIDE_GRAMMAR_DISK"] = "0"
os.environ["RAYGUIDE_GRAMMAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rayguide-grammars-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    from worker.models.gguf_convert import ensure_converted

    return ensure_converted(None, progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from worker.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    from worker.models.loader import load_model

    return load_model(default_model_dir, progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir, tmp_path_factory):
    """A tiny random-weight Llama with the default model's real tokenizer: fast to load,
    for tests of the runtime's plumbing."""
    import shutil

    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                         "generation_config.json"):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture
def make_engine(default_model_dir, default_model, default_tokenizer):
    """Builds an engine over the shared default model; keyword args go to EngineConfig."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    def build(**overrides):
        overrides.setdefault("progress", False)
        overrides.setdefault("num_kv_blocks", 256)  # 4096 tokens: plenty, and quick to allocate
        return LLMEngine(EngineConfig(**overrides), model=default_model,
                         tokenizer=default_tokenizer, model_dir=default_model_dir)

    return build
