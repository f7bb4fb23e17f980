"""A Llama-family model's weights: read by HF name from its safetensors files (Checkpoint), one
layer as read, fused, in the model dtype (LayerTensors: where SmoothQuant folds its factors in),
and as prepared for the forward (LayerWeights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rill.services.worker import families
from rill.services.worker.experts import SparseMoe, read_sparse_moe
from rill.services.worker.rope import partial_rotary_order
from rill.shared.config import ModelConfig

# x -> x @ W.T + b: an ops.make_linear layer, or a calibration probe (smoothquant.Probe).
Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # None: the attention takes the residual stream as it is (OLMo 2)
    qkv: Linear  # fused [(heads + 2 * kv_heads) * head_dim, hidden]
    o: Linear
    post_norm: torch.Tensor | None  # the MLP's input norm; None as input_norm
    gate_up: Linear | None  # fused [2 * intermediate, hidden]; None in a sparse (experts) layer
    down: Linear | None
    # RMSNorm of q and k before RoPE: [head_dim], each head on its own (Qwen3, Gemma 3), or
    # [heads * head_dim], the whole projection (OLMo 2).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma 2/3, OLMo 2: norms of the attention and MLP outputs
    mlp_out_norm: torch.Tensor | None = None
    rope: str = "global"  # its RoPE table (ModelConfig.layer_rope): global, local or none
    window: int | None = None  # sliding-window size: a query at p sees keys p - window + 1 .. p
    moe: SparseMoe | None = None  # the layer's MLP is a mixture of experts (experts.py)


@dataclass
class LayerTensors:
    """One layer's weights as read (model dtype, fused like LayerWeights), before the linear layers
    are prepared: the stage where smoothing factors are folded in."""

    input_norm: torch.Tensor | None
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor | None
    gate_up: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    rope: str = "global"
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
                            mlp_out_norm=self.mlp_out_norm, rope=self.rope, window=self.window,
                            moe=self.moe)


class Checkpoint:
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


def cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("a fused projection has a bias on some parts only")
    return torch.cat(parts)  # type: ignore[arg-type]


class LayerReader:
    """Each layer's tensors from a checkpoint, fused and placed as LlamaModel.load wants them."""

    def __init__(self, ckpt: Checkpoint, raw: dict[str, Any], family: families.Family, cfg: ModelConfig,
                 windows: list[int | None], dtype: torch.dtype, device: str) -> None:
        self.ckpt = ckpt
        self.raw = raw
        self.family = family
        self.cfg = cfg
        self.windows = windows
        self.sparse = families.sparse_layers(raw, family)
        self.dtype = dtype
        self.device = device

    def put(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype=self.dtype).to(self.device).contiguous()

    def norm_weight(self, name: str) -> torch.Tensor | None:
        # Gemma's norms scale by (1 + w): folded in once, in fp32, so the forward's norm is Llama's.
        t = self.ckpt.get(name)
        return self.put(t.float() + 1.0 if self.family.gemma else t)

    def residual(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """An attention or MLP output projection with Granite's residual_multiplier folded in
        (in fp32, then rounded once to the model dtype)."""
        m = self.cfg.residual_multiplier
        return t if t is None or m is None else t.float() * m

    def rotary_order(self, qkv: torch.Tensor | None) -> torch.Tensor | None:
        """A fused q/k/v weight (or bias) with each q and k head's rows in partial_rotary_order
        (only with partial rotary embeddings). Counted from its rows, so a tensor-parallel shard's
        heads are laid out the same."""
        cfg = self.cfg
        if qkv is None or cfg.rotary_dim == cfg.head_dim:
            return qkv
        heads = qkv.shape[0] // cfg.head_dim
        kv = heads // (cfg.num_attention_heads // cfg.num_key_value_heads + 2)
        out = qkv.reshape(heads, cfg.head_dim, -1).clone()
        out[:heads - kv] = out[:heads - kv, partial_rotary_order(cfg.head_dim, cfg.rotary_dim)]
        return out.reshape(qkv.shape)

    def layer(self, i: int) -> LayerTensors:
        ckpt, family, cfg, put, norm_weight = self.ckpt, self.family, self.cfg, self.put, self.norm_weight
        p = f"model.layers.{i}."
        *attn, o_name = family.attn_names(i)  # [q, k, v] or [qkv]: concatenated either way
        *mlp, down_name = family.mlp_names(i)
        sandwich, pre = family.sandwich, family.pre_norms
        moe = read_sparse_moe(ckpt, i, self.raw, family, put) if self.sparse[i] else None
        if moe is not None:
            mlp, down_name = [], None
        return LayerTensors(
            input_norm=norm_weight(f"{p}input_layernorm.weight") if pre else None,
            qkv=put(self.rotary_order(torch.cat([ckpt.get(f"{n}.weight") for n in attn]))),
            qkv_bias=put(self.rotary_order(cat_optional([ckpt.maybe(f"{n}.bias") for n in attn]))),
            o=put(self.residual(ckpt.get(f"{o_name}.weight"))), o_bias=put(self.residual(ckpt.maybe(f"{o_name}.bias"))),
            # The MLP's input norm: Llama calls it post_attention_layernorm; Gemma names it
            # pre_feedforward and uses post_attention for the attention output's own norm.
            post_norm=norm_weight(f"{p}pre_feedforward_layernorm.weight" if sandwich
                                  else f"{p}post_attention_layernorm.weight") if pre else None,
            gate_up=put(torch.cat([ckpt.get(f"{n}.weight") for n in mlp])) if mlp else None,
            gate_up_bias=put(cat_optional([ckpt.maybe(f"{n}.bias") for n in mlp])) if mlp else None,
            down=put(self.residual(ckpt.get(f"{down_name}.weight"))) if down_name else None,
            down_bias=put(self.residual(ckpt.maybe(f"{down_name}.bias"))) if down_name else None,
            q_norm=norm_weight(f"{p}self_attn.q_norm.weight") if family.qk_norm else None,
            k_norm=norm_weight(f"{p}self_attn.k_norm.weight") if family.qk_norm else None,
            attn_out_norm=norm_weight(f"{p}post_attention_layernorm.weight") if sandwich else None,
            mlp_out_norm=norm_weight(f"{p}post_feedforward_layernorm.weight") if sandwich else None,
            rope=cfg.layer_rope(i), window=self.windows[i], moe=moe)
