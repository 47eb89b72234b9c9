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


def test_hub_id_goes_through_huggingface_hub(monkeypatch, tmp_path):
    # the real hub code path, offline (no network here): it looks in an empty cache and
    # huggingface_hub itself says the files are not there
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(Exception) as info:
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert type(info.value).__module__.startswith("huggingface_hub")
