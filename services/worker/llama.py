"""Llama-family forward pass over a flattened batch and a paged KV cache.

Our own implementation (transformers is only a test reference): RMSNorm, RoPE (rope.py), GQA
attention through `rill.kernels.ops`, SwiGLU MLP, optional biases, tied embeddings, per-head q/k
norms and mixture-of-experts MLPs (experts.py); which families those serve, and the checks that
refuse the rest at load, are in families.py. Q/K/V and gate/up weights are concatenated at load
time (llama_weights.py) so each layer runs three GEMMs plus the output projection. With int8
quantization, SmoothQuant factors are folded into the weights first (smoothquant.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rill.kernels import ops
from rill.kernels.gguf_linear import QuantLinear
from rill.kernels.ops import AttentionMetadata
from rill.services.worker import families, gguf_weights, tensor_parallel, tp_support
from rill.services.worker.decode_layers import DecodeLayers
from rill.services.worker.llama_weights import Checkpoint, LayerReader, LayerTensors, LayerWeights, Linear
from rill.services.worker.rope import cos_sin_cache
from rill.shared.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def float_quantization(quantization: str) -> str:
    """How a float weight is prepared in a model served with `quantization`: under "gguf" the
    block layers come prepared, and a layer or head that stays float is a plain float layer."""
    return "none" if quantization == "gguf" else quantization


def _prepare_linears(cfg: ModelConfig, tensors: list[LayerTensors], lm_head: torch.Tensor | None, tied: bool,
                     quantization: str, source: gguf_weights.GGUFSource | None,
                     ) -> tuple[list[LayerWeights], QuantLinear | None]:
    """Every layer's linear layers prepared from the tensors read (`tensors` is emptied), and the
    GGUF LM head where the checkpoint has one."""
    # int8 is quantized from the `dtype` weights, as the tied LM head must be (its rounding to
    # bf16 first is far below the int8 step). Layer by layer, each dropping its read tensors as
    # the prepared (pre-packed or int8) copies replace them, so the load peaks near one model.
    def float_linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
        return ops.make_linear(w, b, float_quantization(quantization))

    layers = [tensors.pop(0).prepare(source.layer_linears(i, float_linear) if source
                                     else lambda _, w, b: float_linear(w, b))
              for i in range(cfg.num_hidden_layers)]
    head = source.lm_head(lm_head, tied) if source and lm_head is not None else None
    return layers, head


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
        self.scale = cfg.attention_multiplier or (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.rope_tables = {kind: cos_sin_cache(cfg, max_positions, self.device, kind)
                            for kind in {"global", *(layer.rope for layer in layers)}}
        # Rounded to the model dtype first, as transformers multiplies by it.
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=self.dtype)
        self.act = ops.gelu_and_mul if cfg.hidden_act == "gelu_pytorch_tanh" else ops.silu_and_mul
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        # The native driver for steps of few rows (decode_layers.py), set up on the first step:
        # loading may still swap layers (GGUF heads, tensor-parallel shards) after __init__.
        self._driver: DecodeLayers | None = None
        self._driver_checked = False

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
        ckpt = Checkpoint(model_dir)
        families.check_tensors(ckpt.names(), raw, family)
        windows = families.layer_windows(raw, family)
        shard = None
        if tp is not None:
            tp_support.check_supported(family.name, quantization, tp.size, bool(smoothquant_alpha))
            shard = tensor_parallel.Shard.plan(cfg, tp.rank, tp.size)
            ckpt = tensor_parallel.ShardedCheckpoint(ckpt, cfg, shard)  # type: ignore[assignment]
        reader = LayerReader(ckpt, raw, family, cfg, windows, dtype, device)
        tensors = [reader.layer(i) for i in range(cfg.num_hidden_layers)]
        embed = reader.put(ckpt.get("model.embed_tokens.weight"))
        norm = reader.norm_weight("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        lm_head = embed if tied else reader.put(ckpt.get("lm_head.weight"))
        if quantization == "int8" or smoothquant_alpha:
            from rill.services.worker import smoothquant  # it builds on this module

            # Folded into `tensors` and the norm; a tied head becomes a scaled copy of the embedding.
            norm, lm_head = smoothquant.smooth(model_dir, cfg, tensors, embed, norm, lm_head, smoothquant_alpha)
        source = gguf_weights.GGUFSource.of(model_dir, cfg) if quantization == "gguf" else None
        layers, head = _prepare_linears(cfg, tensors, lm_head, tied, quantization, source)
        model = cls(shard.local_config(cfg) if shard else cfg, embed, layers, norm, head or lm_head,
                    max_positions or cfg.max_position_embeddings, quantization,
                    tied=tied, embed_scale=cfg.hidden_size ** 0.5 if family.gemma else cfg.embedding_multiplier)
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
        return self.gather_logits(self.local_logits(hidden))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits: all of them, or with tensor parallelism its vocabulary slice (padded),
        which gather_logits joins; soft-capping is per value, so it is done before the join."""
        if self.lm_head is None:
            raise RuntimeError("a headless model (built for calibration) has no logits")
        head = self.lm_head
        logits = head.local(hidden) if isinstance(head, tensor_parallel.GatheredHead) else head.float_out(hidden)
        cap, scaling = self.cfg.final_logit_softcapping, self.cfg.logits_scaling
        if scaling is not None:
            logits.div_(scaling)
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """local_logits joined over the ranks (on rank 0; the others get [rows, 0])."""
        head = self.lm_head
        return head.gather(local) if isinstance(head, tensor_parallel.GatheredHead) else local

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
        """Run T flattened tokens; return the final-normed hidden states of `rows` only (the LM head
        is applied by the caller, so that many rows, e.g. prompt logprobs, can go in slices)."""
        h = self.embed_lookup(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if not self._driver_checked:
            self._driver, self._driver_checked = DecodeLayers.of(self), True
        ran = self._driver.run(h, positions, meta, kv_caches) if self._driver is not None else None
        h, residual = ran if ran is not None else self._layers(h, positions, meta, kv_caches)
        # Only the rows that get sampled go through the final norm and the LM head.
        last = h.index_select(0, rows) + residual.index_select(0, rows)
        return ops.rms_norm(last, self.norm, self.cfg.rms_norm_eps)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer, op by op: (the last layer's output, the residual stream)."""
        c = self.cfg
        eps = c.rms_norm_eps
        t = h.shape[0]
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if layer.input_norm is None:  # OLMo 2: the stream as it is
                residual = x = h if residual is None else h + residual
            elif residual is None:
                residual = h
                x = ops.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = ops.rms_norm(h, layer.input_norm, eps, residual)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            v = v.view(t, c.num_key_value_heads, c.head_dim)
            if layer.q_norm is not None and layer.q_norm.shape[0] == c.head_dim:  # Qwen3: head by head
                q = ops.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, eps)
                k = ops.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, eps)
            elif layer.q_norm is not None:  # OLMo 2: over the whole projection
                q, k = ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)
            # RoPE and the cache write in one op (one fused kernel on the Triton backend).
            q, k = ops.rope_and_write_kv(q.view(t, c.num_attention_heads, c.head_dim),
                                         k.view(t, c.num_key_value_heads, c.head_dim), v, positions,
                                         self.rope_tables[layer.rope],
                                         k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, k, v, window=layer.window,
                                       softcap=c.attn_logit_softcapping)
            h = layer.o(attn.reshape(t, self.q_size))
            if layer.attn_out_norm is not None:  # Gemma: the output is normed before its residual add
                h = ops.rms_norm(h, layer.attn_out_norm, eps)
            if layer.post_norm is None:
                residual = x = h + residual
            else:
                x, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            h = layer.moe(x) if layer.moe is not None else layer.down(self.act(layer.gate_up(x)))
            if layer.mlp_out_norm is not None:
                h = ops.rms_norm(h, layer.mlp_out_norm, eps)
        assert residual is not None
        return h, residual
