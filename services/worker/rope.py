"""Rotary position embeddings: a model's inverse frequencies with its config's frequency scaling
(default, linear, dynamic NTK, Llama-3, YaRN, LongRoPE) and the cos/sin table the kernels read.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rill.shared.config import ModelConfig


def _rope_kind(cfg: ModelConfig) -> str:
    scaling = cfg.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def inv_frequencies(cfg: ModelConfig, served: int | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] (fp32), with the config's frequency scaling.

    `served`: the longest sequence the table serves (max_model_len; default the model's
    max_position_embeddings). transformers recomputes `dynamic` and `longrope` frequencies in
    every forward from the sequence's current length, so a cached key keeps the rotation of the
    step that wrote it while later queries get another. Rill, like vLLM, fixes one table for
    the whole context instead (so cached keys stay valid), sized by what it serves: `dynamic`
    takes the NTK base of a sequence of `served` tokens, the plain base within the original
    context (the default), which is transformers' there; `longrope` takes the long factors when
    `served` exceeds original_max_position_embeddings (vLLM's rule), else the short ones. That
    is transformers' choice for a sequence that stays within the original context, or starts
    beyond it; one that crosses it mid-way gets the long factors from its first token here."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = _rope_kind(cfg)
    served = served or cfg.max_position_embeddings
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "dynamic":
        factor, old_len = float(scaling["factor"]), cfg.max_position_embeddings
        length = max(served, old_len)
        base = cfg.rope_theta * ((factor * length / old_len) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "longrope":
        long = served > _longrope_original(cfg, scaling)
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(cfg, scaling, inv_freq)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def _longrope_original(cfg: ModelConfig, scaling: dict) -> int:
    """LongRoPE's pretraining context (Phi-3 keeps it beside rope_scaling, not in it)."""
    return int(scaling.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
               or cfg.max_position_embeddings)


def _yarn_inv_frequencies(cfg: ModelConfig, scaling: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: dimensions that turn more than
    beta_fast times over the original context keep their frequency, those under beta_slow are
    interpolated by `factor`, and a linear ramp blends the band between."""
    dim, base = cfg.head_dim, cfg.rope_theta
    old_len = float(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = float(scaling.get("factor") or cfg.max_position_embeddings / old_len)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's attention temperature and LongRoPE's
    attention factor (for the short and the long factors alike, as transformers applies it)."""
    scaling = cfg.rope_scaling or {}
    kind = _rope_kind(cfg)
    if kind == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = _longrope_original(cfg, scaling)
        factor = float(scaling.get("factor") or cfg.max_position_embeddings / original)
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = float(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = float(scaling.get("factor") or cfg.max_position_embeddings / old_len)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)


def cos_sin_cache(cfg: ModelConfig, max_positions: int, device: torch.device | str,
                  kind: str = "global") -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of each angle in the first half, sin in the second.
    `kind` (ModelConfig.layer_rope): "local" is the sliding-attention layers' table (their own
    base, no scaling; Gemma 3); "none" turns nothing (cos 1, sin 0), so a NoPE layer runs every
    kernel's RoPE unchanged. With partial rotary embeddings (rotary_dim < head_dim) the table
    turns the first rotary_dim / 2 pairs and leaves the others (cos 1, sin 0); the q and k
    weights are laid out to match (partial_rotary_order)."""
    half = cfg.head_dim // 2
    if kind == "none":
        return torch.cat((torch.ones(max_positions, half), torch.zeros(max_positions, half)), dim=-1).to(device)
    if kind == "local":
        cfg = dataclasses.replace(cfg, rope_theta=cfg.rope_theta_local, rope_scaling=None)
    turned = dataclasses.replace(cfg, head_dim=cfg.rotary_dim, partial_rotary_factor=1.0)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_frequencies(turned, max_positions)[None, :]
    scale = rope_attention_factor(cfg)
    still = half - freqs.shape[1]
    cos = torch.cat((freqs.cos() * scale, torch.ones(max_positions, still)), dim=-1)
    sin = torch.cat((freqs.sin() * scale, torch.zeros(max_positions, still)), dim=-1)
    return torch.cat((cos, sin), dim=-1).to(device)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims that puts partial RoPE in every kernel's full-head form: the
    kernels pair dim j with j + head_dim / 2, the model pairs i with i + rotary_dim / 2 within its
    first rotary_dim dims. So the turned pairs come first in each half and the dims RoPE leaves
    follow (their table entries turn nothing). q and k rows both take it: q.k is unchanged."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat((torch.arange(0, r), torch.arange(rotary_dim, rotary_dim + rest),
                      torch.arange(r, rotary_dim), torch.arange(rotary_dim + rest, head_dim)))
