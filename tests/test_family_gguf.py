"""GGUF for every family whose GGUF transformers can read: a tiny random model of the family written
as llama.cpp's convert_hf_to_gguf writes it (gguf's tensor names, its metadata keys, its weight
conventions: Llama's q/k row order, Gemma's norms stored as 1 + w), with SmolLM2's byte-level BPE
tokenizer cut to the model's vocabulary, loads through Rill to the logits the same weights give
from safetensors. A GGUF of an architecture no family serves is refused at start with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from family_cases import build
from test_model_parity import PagedSequence
from transformers import PreTrainedModel

from rill.services.worker import families
from rill.services.worker.llama import LlamaModel
from rill.shared import model_files
from rill.shared.broker import free_port
from rill.shared.model_files import convert_gguf, converted_from

VOCAB = 512
# Family -> (general.architecture, general.name, config values a GGUF cannot carry, set to what
# transformers assumes when it reads one back: llama.cpp stores no Qwen2/3 window switch, no
# Phi-3 window, no Gemma 2 LM head of its own; transformers reads no Gemma layer pattern, query
# scalar or soft-caps).
GGUF_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "tiny-llama", dict(rope_scaling=None)),
    "qwen2": ("qwen2", "tiny-qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", "tiny-qwen3", dict(use_sliding_window=False, head_dim=128)),
    "gemma2": ("gemma2", "tiny-gemma2", dict(tie_word_embeddings=True, query_pre_attn_scalar=256,
                                             attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("gemma3", "tiny-gemma3", dict(query_pre_attn_scalar=256, final_logit_softcapping=None,
                                             sliding_window_pattern=6)),
    "phi3": ("phi3", "tiny-phi3", dict(sliding_window=None)),
}
# Families whose GGUF transformers lists but cannot read, and why.
UNREADABLE = {
    # A Mistral GGUF is a "llama" file: transformers renames one named "mistral" to model type
    # mistral, then finds no gguf-py tensor names for it. Other names load as Llama, which
    # serves Mistral v0.2 on (no window) the same.
    "mistral": "transformers' GGUF loader has no tensor names for model type mistral",
}
# Families whose GGUF transformers reads into a wrong config: refused at start (families.py).
MISREAD = {"qwen3_moe": "qwen3moe", "smollm3": "smollm3", "granite": "granite", "gemma": "gemma",
           "olmo2": "olmo2", "olmo3": "olmo3"}


def tokenizer_fields(smollm2_dir: str, vocab: int) -> dict[str, Any]:
    """SmolLM2's tokenizer (as its GGUF carries it) cut to the first `vocab` ids: those tokens and
    the merges among them."""
    spec = json.loads((Path(smollm2_dir) / "tokenizer.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items() if i < vocab}
    tokens = [by_id[i] for i in range(vocab)]
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    known = set(tokens)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    merges = [m for m in merges if {*m.split(" "), m.replace(" ", "")} <= known]
    return {"tokens": tokens, "types": [3 if i in special else 1 for i in range(vocab)], "merges": merges}


def write_gguf(model: PreTrainedModel, arch: str, name: str, tok: dict[str, Any], path: Path) -> None:
    """The model's fp32 weights and config as llama.cpp's converter writes them for `arch`."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))  # Gemma 3: one per layer kind
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        if arch == "phi3":  # the dims RoPE turns, as llama.cpp writes them (Phi-4-mini: 96 of 128)
            w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            # llama.cpp interleaves each head's rotary halves (its RoPE pairs neighbours).
            heads = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2) \
                .reshape(data.shape)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1  # Gemma's norms scale by (1 + w): llama.cpp stores the sum
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{arch}: gguf has no name for {hf_name}"
        w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    seq = PagedSequence(model, model.allocate_kv_cache(16, 4), [5, 2, 9, 0, 12, 7, 3], 4)
    return seq.run(prompt)


@pytest.fixture(scope="module")
def tok(smollm2_dir: str) -> dict[str, Any]:
    return tokenizer_fields(smollm2_dir, VOCAB)


def test_every_family_gguf_transformers_reads_has_a_case() -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for fam in families.FAMILIES:
        if (fam.name in GGUF_CONFIG_MAPPING or fam.name.replace("_", "") in GGUF_CONFIG_MAPPING) \
                and fam.name not in UNREADABLE and fam.name not in MISREAD:
            assert fam.name in GGUF_CASES, f"{fam.name}: transformers reads its GGUF; add a GGUF_CASES row"


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_loads_to_the_safetensors_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              tok: dict[str, Any], name: str) -> None:
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path / "cache"))
    arch, label, overrides = GGUF_CASES[name]
    ref = build(name, tmp_path / "st", VOCAB, initializer_range=0.1, **overrides)
    write_gguf(ref, arch, label, tok, tmp_path / f"{name}.gguf")
    converted = convert_gguf(tmp_path / f"{name}.gguf")
    assert families.check_checkpoint(converted).name == name
    from_gguf = LlamaModel.load(converted, torch.float32, "cpu")
    from_st = LlamaModel.load(tmp_path / "st", torch.float32, "cpu")
    assert [layer.window for layer in from_gguf.layers] == [layer.window for layer in from_st.layers]
    prompt = [int(t) for t in torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(1))]
    want = logits(from_st, prompt)
    assert want.abs().max().item() > 1.0  # logits that differ by whole units
    assert (logits(from_gguf, prompt) - want).abs().max().item() <= 1e-4 * want.abs().max().item(), name


def test_a_conversion_is_found_by_content_and_names_the_live_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  tok: dict[str, Any]) -> None:
    """The same file installed again (another venv: another path and mtime) reuses its conversion,
    whose marker then names the new copy (the GGUF blocks are read from it, and the first may be
    gone); a file whose tensor data differ anywhere sampled gets its own."""
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path / "cache"))
    arch, label, overrides = GGUF_CASES["llama"]
    write_gguf(build("llama", tmp_path / "st", VOCAB, **overrides), arch, label, tok, tmp_path / "a.gguf")
    first = convert_gguf(tmp_path / "a.gguf")
    assert converted_from(first) == (tmp_path / "a.gguf").resolve()
    (tmp_path / "venv2").mkdir()
    os.replace(tmp_path / "a.gguf", tmp_path / "venv2" / "a.gguf")
    os.utime(tmp_path / "venv2" / "a.gguf", (1, 1))
    monkeypatch.setattr(model_files, "_convert", lambda *_: pytest.fail("converted the same content again"))
    assert convert_gguf(tmp_path / "venv2" / "a.gguf") == first
    assert converted_from(first) == (tmp_path / "venv2" / "a.gguf").resolve()
    data = bytearray((tmp_path / "venv2" / "a.gguf").read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor's data
    (tmp_path / "b.gguf").write_bytes(bytes(data))
    assert model_files.file_key(tmp_path / "b.gguf") != model_files.file_key(tmp_path / "venv2" / "a.gguf")


def test_a_conversion_parses_the_header_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            tok: dict[str, Any]) -> None:
    """transformers asks for the config, the tokenizer and the weights, each reading the file:
    one conversion parses it once, and leaves gguf-py as it found it."""
    import gguf

    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path / "cache"))
    arch, label, overrides = GGUF_CASES["llama"]
    write_gguf(build("llama", tmp_path / "st", VOCAB, **overrides), arch, label, tok, tmp_path / "a.gguf")
    parsed: list[str] = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path: Any, *args: Any) -> None:
            parsed.append(str(path))
            super().__init__(path, *args)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    names = gguf.get_tensor_name_map
    convert_gguf(tmp_path / "a.gguf")
    assert parsed == [str(tmp_path / "a.gguf")]
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is names


def test_gguf_of_an_unserved_architecture_is_refused_at_start(tmp_path: Path) -> None:
    """Before anything is converted: the architecture is read from the file's header."""
    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    env = dict(os.environ, RILL_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "rill.services.cli", "serve", str(path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rill: ") and "GGUF architecture 'gpt2' is not supported" in last, proc.stderr
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_misread_gguf_architecture_is_refused_by_name() -> None:
    for arch in MISREAD.values():
        with pytest.raises(families.UnsupportedModel, match=f"GGUF architecture '{arch}' is not supported: "):
            families.family_of_gguf(arch)
