"""Llama-family forward pass over a flattened batch and a paged KV cache.

Our own implementation (transformers is only a test reference): RMSNorm, RoPE (default, linear,
dynamic NTK, Llama-3, YaRN and LongRoPE frequency scaling), GQA attention through `rill.kernels.ops`,
SwiGLU MLP, optional biases, tied embeddings, per-head q/k norms and mixture-of-experts MLPs
(experts.py); which families those serve, and the checks that refuse the rest at load, are in
families.py. Q/K/V and gate/up weights are concatenated at load time so each layer
runs three GEMMs plus the output projection. With int8 quantization, SmoothQuant factors are folded
into the weights first (smoothquant.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from rill.kernels import ops
from rill.kernels.gguf_linear import QuantLinear
from rill.kernels.ops import AttentionMetadata
from rill.services.worker import families, gguf_weights, tensor_parallel, tp_support
from rill.services.worker.experts import SparseMoe, read_sparse_moe
from rill.shared.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
                  local: bool = False) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of each angle in the first half, sin in the second.
    `local`: the sliding-attention layers' table (their own base, no scaling; Gemma 3)."""
    if local:
        cfg = dataclasses.replace(cfg, rope_theta=cfg.rope_theta_local, rope_scaling=None)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_frequencies(cfg, max_positions)[None, :]
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope_attention_factor(cfg)).to(device)


# x -> x @ W.T + b: an ops.make_linear layer, or a calibration probe (smoothquant.Probe).
Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # fused [(heads + 2 * kv_heads) * head_dim, hidden]
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # fused [2 * intermediate, hidden]; None in a sparse (experts) layer
    down: Linear | None
    q_norm: torch.Tensor | None = None  # [head_dim]: RMSNorm of each q head before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: norms of the attention and MLP outputs
    mlp_out_norm: torch.Tensor | None = None
    local_rope: bool = False  # a sliding-attention layer: its own RoPE table (Gemma 3)
    window: int | None = None  # sliding-window size: a query at p sees keys p - window + 1 .. p
    moe: SparseMoe | None = None  # the layer's MLP is a mixture of experts (experts.py)


@dataclass
class LayerTensors:
    """One layer's weights as read (model dtype, fused like LayerWeights), before the linear layers
    are prepared: the stage where smoothing factors are folded in."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    local_rope: bool = False
    window: int | None = None
    moe: SparseMoe | None = None  # already prepared (no quantized experts)

    def prepare(self, linear: Callable[[str, torch.Tensor, torch.Tensor | None], Linear]) -> LayerWeights:
        """`linear(field, weight, bias)` builds each linear layer (field: qkv, o, gate_up, down)."""
        dense = self.moe is None
        return LayerWeights(input_norm=self.input_norm, qkv=linear("qkv", self.qkv, self.qkv_bias),
                            o=linear("o", self.o, self.o_bias), post_norm=self.post_norm,
                            gate_up=linear("gate_up", self.gate_up, self.gate_up_bias) if dense else None,
                            down=linear("down", self.down, self.down_bias) if dense else None,
                            q_norm=self.q_norm, k_norm=self.k_norm, attn_out_norm=self.attn_out_norm,
                            mlp_out_norm=self.mlp_out_norm, local_rope=self.local_rope, window=self.window,
                            moe=self.moe)


class _Checkpoint:
    """Tensors by HF name across every *.safetensors file of a folder, read on demand."""

    def __init__(self, model_dir: Path) -> None:
        self._where: dict[str, Path] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    self._where[name] = path
        if not self._where:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._where else None

    def part(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        """Only rows (and cols) of a tensor, read without the rest (a tensor-parallel shard)."""
        if name not in self._where:
            raise KeyError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self._where[name]), framework="pt") as f:
            view = f.get_slice(name)
            return view[rows] if cols is None else view[rows, cols]


def _cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("a fused projection has a bias on some parts only")
    return torch.cat(parts)  # type: ignore[arg-type]


def float_quantization(quantization: str) -> str:
    """How a float weight is prepared in a model served with `quantization`: under "gguf" the
    block layers come prepared, and a layer or head that stays float is a plain float layer."""
    return "none" if quantization == "gguf" else quantization


class LlamaModel:
    """Weights plus the forward pass. Not an nn.Module: no hooks or autograd on the hot path."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights], norm: torch.Tensor,
                 lm_head: torch.Tensor | QuantLinear | None, max_positions: int, quantization: str = "none",
                 tied: bool | None = None, embed_scale: float | None = None) -> None:
        """lm_head None: a headless model, final_hidden only (calibration). `tied` defaults to
        whether lm_head is the embedding (a smoothed tied head is a scaled copy of it).
        `embed_scale`: the embedding's multiplier (Gemma: sqrt(hidden))."""
        self.cfg = cfg
        self.embed = embed
        # ids -> rows of the embedding (tensor_parallel.shard_model swaps in a vocab-parallel lookup)
        self.embed_lookup: Callable[[torch.Tensor], torch.Tensor] = partial(F.embedding, weight=embed)
        self.layers = layers
        self.norm = norm
        self.tied = lm_head is embed if tied is None else tied
        # Quantized, a tied head gets its own int8 copy; the embedding lookup keeps the model dtype.
        self.lm_head = lm_head if lm_head is None or not isinstance(lm_head, torch.Tensor) \
            else ops.make_linear(lm_head, quantization=float_quantization(quantization), logits=True)
        self.quantization = quantization
        self.dtype = embed.dtype
        self.device = embed.device
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.cos_sin = cos_sin_cache(cfg, max_positions, self.device)
        self.cos_sin_local = cos_sin_cache(cfg, max_positions, self.device, local=True) \
            if any(layer.local_rope for layer in layers) else None
        # Rounded to the model dtype first, as transformers multiplies by it.
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=self.dtype)
        self.act = ops.gelu_and_mul if cfg.hidden_act == "gelu_pytorch_tanh" else ops.silu_and_mul
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
             max_positions: int | None = None, quantization: str = "none",
             smoothquant_alpha: float | dict[str, float] | None = None,
             tp: tensor_parallel.TPGroup | None = None) -> LlamaModel:
        """quantization "int8": every linear layer and the LM head as W8A8 int8 GEMMs (CPU only);
        norms, the embedding and the KV cache stay in `dtype`. Before quantizing, activation
        outliers are smoothed into the weights (smoothquant.py) with `smoothquant_alpha`, by
        default RILL_SMOOTHQUANT_ALPHA or the measured default; 0 turns that off. An alpha given
        with quantization "none" smooths the float model (the fold is exact up to rounding).
        `tp`: load this rank's shard only (tensor_parallel.py)."""
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        family = families.check_config(raw, max_positions)  # refuses what the forward would get wrong
        families.check_quantization(family, "int8" if smoothquant_alpha else quantization)
        cfg = ModelConfig.from_dict(raw)
        ckpt = _Checkpoint(model_dir)
        families.check_tensors(ckpt.names(), raw, family)
        windows = families.layer_windows(raw, family)
        shard = None
        if tp is not None:
            tp_support.check_supported(family.name, quantization, tp.size, bool(smoothquant_alpha))
            shard = tensor_parallel.Shard.plan(cfg, tp.rank, tp.size)
            ckpt = tensor_parallel.ShardedCheckpoint(ckpt, cfg, shard)  # type: ignore[assignment]
        sparse = families.sparse_layers(raw, family)

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dtype=dtype).to(device).contiguous()

        def norm_weight(name: str) -> torch.Tensor | None:
            # Gemma's norms scale by (1 + w): folded in once, in fp32, so the forward's norm is Llama's.
            t = ckpt.get(name)
            return put(t.float() + 1.0 if family.gemma else t)

        def read_layer(i: int) -> LayerTensors:
            p = f"model.layers.{i}."
            *attn, o_name = family.attn_names(i)  # [q, k, v] or [qkv]: concatenated either way
            *mlp, down_name = family.mlp_names(i)
            gemma = family.gemma
            moe = read_sparse_moe(ckpt, i, raw, family, put) if sparse[i] else None
            if moe is not None:
                mlp, down_name = [], None
            return LayerTensors(
                input_norm=norm_weight(f"{p}input_layernorm.weight"),
                qkv=put(torch.cat([ckpt.get(f"{n}.weight") for n in attn])),
                qkv_bias=put(_cat_optional([ckpt.maybe(f"{n}.bias") for n in attn])),
                o=put(ckpt.get(f"{o_name}.weight")), o_bias=put(ckpt.maybe(f"{o_name}.bias")),
                # The MLP's input norm: Llama calls it post_attention_layernorm; Gemma names it
                # pre_feedforward and uses post_attention for the attention output's own norm.
                post_norm=norm_weight(f"{p}pre_feedforward_layernorm.weight" if gemma
                                      else f"{p}post_attention_layernorm.weight"),
                gate_up=put(torch.cat([ckpt.get(f"{n}.weight") for n in mlp])) if mlp else None,
                gate_up_bias=put(_cat_optional([ckpt.maybe(f"{n}.bias") for n in mlp])) if mlp else None,
                down=put(ckpt.get(f"{down_name}.weight")) if down_name else None,
                down_bias=put(ckpt.maybe(f"{down_name}.bias")) if down_name else None,
                q_norm=norm_weight(f"{p}self_attn.q_norm.weight") if family.qk_norm else None,
                k_norm=norm_weight(f"{p}self_attn.k_norm.weight") if family.qk_norm else None,
                attn_out_norm=norm_weight(f"{p}post_attention_layernorm.weight") if gemma else None,
                mlp_out_norm=norm_weight(f"{p}post_feedforward_layernorm.weight") if gemma else None,
                local_rope=cfg.rope_theta_local is not None and i < len(cfg.layer_types)
                and cfg.layer_types[i] == "sliding_attention", window=windows[i], moe=moe)

        tensors = [read_layer(i) for i in range(cfg.num_hidden_layers)]
        embed = put(ckpt.get("model.embed_tokens.weight"))
        norm = norm_weight("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        lm_head = embed if tied else put(ckpt.get("lm_head.weight"))
        if quantization == "int8" or smoothquant_alpha:
            from rill.services.worker import smoothquant  # it builds on this module

            # Folded into `tensors` and the norm; a tied head becomes a scaled copy of the embedding.
            norm, lm_head = smoothquant.smooth(model_dir, cfg, tensors, embed, norm, lm_head, smoothquant_alpha)
        # int8 is quantized from the `dtype` weights, as the tied LM head must be (its rounding to
        # bf16 first is far below the int8 step). Layer by layer, each dropping its read tensors as
        # the prepared (pre-packed or int8) copies replace them, so the load peaks near one model.
        def float_linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
            return ops.make_linear(w, b, float_quantization(quantization))

        source = gguf_weights.GGUFSource.of(model_dir, cfg) if quantization == "gguf" else None
        layers = [tensors.pop(0).prepare(source.layer_linears(i, float_linear) if source
                                         else lambda _, w, b: float_linear(w, b))
                  for i in range(cfg.num_hidden_layers)]
        head = source.lm_head(lm_head, tied) if source and lm_head is not None else None
        model = cls(shard.local_config(cfg) if shard else cfg, embed, layers, norm, head or lm_head,
                    max_positions or cfg.max_position_embeddings, quantization,
                    tied=tied, embed_scale=cfg.hidden_size ** 0.5 if family.gemma else None)
        if source is not None:
            # A float head tied to the embedding keeps the float table anyway: look rows up there.
            source.finish(model, embed, float_table_kept=tied and head is None)
        if shard is not None and tp is not None:
            tensor_parallel.shard_model(model, shard, cfg, tp)
        return model

    def linears(self) -> list[Any]:
        """The LM head and each layer's four linear layers, in order (None where there is none)."""
        return [self.lm_head, *(f for layer in self.layers for f in (layer.qkv, layer.o, layer.gate_up, layer.down))]

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides (the KV behind the longest one is never read again,
        so its blocks can be released); None when any layer attends to the whole context."""
        windows = [layer.window for layer in self.layers]
        return None if not windows or None in windows else max(windows)  # type: ignore[type-var]

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cfg
        return ops.allocate_kv_cache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                                     c.head_dim, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Run T flattened tokens; return fp32 logits [len(logits_indices), vocab] for those rows only."""
        return self.logits(self.final_hidden(input_ids, positions, meta, kv_caches, logits_indices))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (see final_hidden)."""
        if self.lm_head is None:
            raise RuntimeError("a headless model (built for calibration) has no logits")
        logits = self.lm_head.float_out(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
        """Run T flattened tokens; return the final-normed hidden states of `rows` only (the LM head
        is applied by the caller, so that many rows, e.g. prompt logprobs, can go in slices)."""
        c = self.cfg
        eps = c.rms_norm_eps
        t = input_ids.shape[0]
        h = self.embed_lookup(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = ops.rms_norm(h, layer.input_norm, eps, residual)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            v = v.view(t, c.num_key_value_heads, c.head_dim)
            if layer.q_norm is not None:  # Qwen3: each head normed on its own, before RoPE
                q = ops.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, eps)
                k = ops.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, eps)
            # RoPE and the cache write in one op (one fused kernel on the Triton backend).
            q, k = ops.rope_and_write_kv(q.view(t, c.num_attention_heads, c.head_dim),
                                         k.view(t, c.num_key_value_heads, c.head_dim), v, positions,
                                         self.cos_sin_local if layer.local_rope else self.cos_sin,
                                         k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, k, v, window=layer.window,
                                       softcap=c.attn_logit_softcapping)
            h = layer.o(attn.reshape(t, self.q_size))
            if layer.attn_out_norm is not None:  # Gemma: the output is normed before its residual add
                h = ops.rms_norm(h, layer.attn_out_norm, eps)
            x, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            h = layer.moe(x) if layer.moe is not None else layer.down(self.act(layer.gate_up(x)))
            if layer.mlp_out_norm is not None:
                h = ops.rms_norm(h, layer.mlp_out_norm, eps)
        # Only the rows that get sampled go through the final norm and the LM head.
        last = h.index_select(0, rows) + residual.index_select(0, rows)
        return ops.rms_norm(last, self.norm, eps)
