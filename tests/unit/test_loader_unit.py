"""Model references resolve to the right source; errors name the problem."""

import pytest

from worker.models.loader import resolve_model_dir

pytestmark = pytest.mark.unit


def test_local_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(tmp_path) == tmp_path


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(tmp_path)


def test_missing_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "nope.gguf")


def test_not_a_reference(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        resolve_model_dir(str(tmp_path / "missing" / "dir"))


def test_hub_model_goes_through_huggingface_hub(monkeypatch, tmp_path):
    # the real hub code path, offline (no network here): it looks in an empty cache and
    # huggingface_hub itself says the files are not there
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(Exception) as info:
        resolve_model_dir("hf:HuggingFaceTB/SmolLM2-135M-Instruct")
    assert type(info.value).__module__.startswith("huggingface_hub")


FULL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e4,
                                                         "rope_type": "default"}}


@pytest.mark.parametrize("change, fast", [
    ({}, True),  # states everything, plain RoPE: read as it is
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128}}, False),
    ({"num_key_value_heads": None}, False),  # left out: transformers' default is needed
])
def test_load_config_reads_a_full_config_without_transformers(tmp_path, change, fast):
    import json

    import transformers

    from worker.models.loader import ModelConfig, load_config

    raw = {**FULL, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_config(tmp_path)
    assert isinstance(config, ModelConfig) == fast
    reference = transformers.AutoConfig.from_pretrained(tmp_path)
    for name in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "vocab_size",
                 "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, name) == getattr(reference, name), name
