"""Shared fixtures. The default model is converted once per machine (cached under
~/.cache/rayguide or $RAYGUIDE_CACHE_DIR) and loaded once per test session."""

import pytest
import torch


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
