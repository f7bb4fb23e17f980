"""Tiny randomly initialised checkpoints of every family Rill serves, built with transformers' own
classes: one row per family (model class, config class, the overrides that switch on what makes
the family different). A family added to services/worker/families.py needs its row here, or the
tests that go over every family fail on it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

WINDOW = 16  # sliding windows shorter than the prompts

# Several layers and GQA for every family.
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

FAMILY_CASES: dict[str, tuple[type[PreTrainedModel], type[PretrainedConfig], dict[str, Any]]] = {
    # Llama 3.x RoPE frequency scaling, a separate LM head.
    "llama": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=False, rope_scaling=dict(
        rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    # Every layer slides.
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    # q/k/v biases; layers from max_window_layers on slide, the first attends to everything.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1, tie_word_embeddings=False)),
    # Per-head q/k norms, a head_dim that is not hidden / heads, sliding upper layers.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1, tie_word_embeddings=False)),
    # Gemma (1): Llama's layer with (1 + w) norms, GeGLU and a scaled embedding.
    "gemma": (GemmaForCausalLM, GemmaConfig, dict(head_dim=32, tie_word_embeddings=False)),
    # Gemma 2: as Gemma 3 without q/k norms or a local RoPE base, plus attention logit
    # soft-capping; every other layer slides, the first included. A separate LM head: tied, this
    # tiny random model repeats a few tokens (Gemma 3's row keeps the tied head).
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=1.5,
        final_logit_softcapping=30.0, tie_word_embeddings=False)),
    # (1 + w) norms, GeGLU, scaled embedding, q/k norms, query_pre_attn_scalar, sliding layers
    # around a global one on their own RoPE base, final logit soft-capping, tied head.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=30.0,
        sliding_window_pattern=2, tie_word_embeddings=True)),
    # OLMo 2: norms after attention and MLP only, q/k norms over the whole projection; its eps,
    # four layers (with three, this random model's continuations repeat a few tokens).
    "olmo2": (Olmo2ForCausalLM, Olmo2Config, dict(rms_norm_eps=1e-6, num_hidden_layers=4, tie_word_embeddings=False)),
    # OLMo 3: the same, layers 0-2 sliding, 3 global.
    "olmo3": (Olmo3ForCausalLM, Olmo3Config, dict(rms_norm_eps=1e-6, num_hidden_layers=4, sliding_window=WINDOW,
                                                  tie_word_embeddings=False)),
    # Granite's four scalars, away from 1 so that each one shows (test_model_families also ties the
    # head; tied, this tiny random model repeats one token).
    "granite": (GraniteForCausalLM, GraniteConfig, dict(embedding_multiplier=2.0, attention_multiplier=0.2,
                                                        residual_multiplier=0.5, logits_scaling=1.5,
                                                        tie_word_embeddings=False)),
    # Every second layer without RoPE (NoPE) and sliding, as SmolLM3 makes its NoPE layers slide.
    "smollm3": (SmolLM3ForCausalLM, SmolLM3Config, dict(no_rope_layer_interval=2, use_sliding_window=True,
                                                        sliding_window=WINDOW, pad_token_id=0, bos_token_id=1,
                                                        eos_token_id=2, tie_word_embeddings=False)),
    # Fused qkv_proj and gate_up_proj, every layer slides, RoPE over half of each head (Phi-4-mini's
    # partial rotary embeddings).
    "phi3": (Phi3ForCausalLM, Phi3Config, dict(sliding_window=WINDOW, pad_token_id=0, partial_rotary_factor=0.5,
                                               tie_word_embeddings=False)),
    # Qwen3-MoE: 8 experts, top-2 renormalised, the middle layer dense (mlp_only_layers), q/k norms.
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        mlp_only_layers=[1], tie_word_embeddings=False)),
    # Mixtral: top-2 of 4 experts in every layer, every layer sliding.
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                                        sliding_window=WINDOW, tie_word_embeddings=False)),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def build(name: str, dest: Path, vocab_size: int, initializer_range: float = 0.02, seed: int = 0,
          **overrides: Any) -> PreTrainedModel:
    """The family's tiny model (eval mode), saved as safetensors in `dest`."""
    cls, cfg_cls, extra = FAMILY_CASES[name]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**BASE, **extra, "vocab_size": vocab_size, "initializer_range": initializer_range,
                     **overrides})
    model = cls(cfg).eval()
    model.save_pretrained(dest)
    return model


def copy_tokenizer(src: Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
