"""A tiny random-weight Llama with the default model's real tokenizer.

Its forward costs almost nothing, so what runs around it (grammars, scheduling, Ray, HTTP)
is what a test or a bench's ``--smoke`` size exercises; the tokenizer is the default
model's, so grammars compile and masks cost what they cost in production.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# the files of the default model's folder that a tokenizer and chat template need
_TOKENIZER_FILES = ("chat_template.jinja", "generation_config.json")


def build_tiny_model(path: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Writes the tiny model (2 layers, hidden size 64, vocab 49152, seed 0) to ``path``
    with the tokenizer files of ``tokenizer_dir`` (default: the default model's folder,
    converted on first use). Returns ``path``."""
    import torch
    import transformers

    from worker.models.loader import resolve_model_dir

    path = Path(path)
    source = Path(tokenizer_dir) if tokenizer_dir else resolve_model_dir(None, progress=False)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name in _TOKENIZER_FILES:
            shutil.copy(f, path / f.name)
    return path
