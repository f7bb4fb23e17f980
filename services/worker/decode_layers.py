"""Every layer of a step of few rows in one native call (kernels/cpu_decode_layers.c).

At one decode row the per-op path spends more time dispatching ~12 kernel calls a layer from
Python than the kernels take; the native driver runs the same kernels in the same order, so its
decode logits are bit for bit those of the per-op path (a GeGLU model's GELU is the driver's own,
built on torch's vector tanh to give torch's bits). It serves a step when the model
is a Llama-style stack (per-head q/k norms, Gemma's output norms, sliding windows and local RoPE
included; no experts, attention soft-capping or biases, not tensor-parallel), on the CPU in bf16
or fp32, and every linear layer's measured route for the step's row count is one the driver has:
the GGUF block GEMM or the bf16 small GEMM (a layer on oneDNN is not), and a SwiGLU model's
SiLU * up is measured native at that row count; a GeGLU model needs torch's vector tanh (AVX2
or AVX-512), for torch's GELU bits. RILL_DECODE_LAYERS=0 turns it off.

A step's rows each attend as one decode token over their own context: the rows of a verify step
take the decode kernel row by row (see the C file); a step with a prompt chunk of more rows than
a verify step has runs op by op.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

import torch

from rill.kernels import chooser, cpu_native, gguf_linear, ops, torch_ops
from rill.kernels.gguf_linear import QuantLinear
from rill.kernels.ops import AttentionMetadata
from rill.kernels.torch_attention import attention_key, row_tables
from rill.shared import envs

if TYPE_CHECKING:
    from rill.services.worker.llama import LlamaModel

log = logging.getLogger("rill.worker")

MAX_ROWS = chooser.DECODE_ROWS  # beyond, the per-op path's batched kernels (prompt attention, oneDNN) pay off
# Most rows of one sequence in a step: a speculative verify step's. Longer prompt chunks keep the
# prompt attention kernel, whatever shares their step (a prompt of at most this many tokens may
# take either kernel, by the step's size: its logits then differ in the last bits).
MAX_SEQ_ROWS = 16
_BLOCKS, _SMALL, _X16 = 1, 2, 3
_MAX_PARTS = 4
_i32, _i64, _ptr, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("kind", _i32), ("qtype", _i32), ("n", _i64), ("w", _ptr)]


class _Lin(ctypes.Structure):
    _fields_ = [("num_parts", _i32), ("pad", _i32), ("n", _i64), ("k", _i64), ("parts", _Part * _MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr),
                ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin),
                ("q_norm", _ptr), ("k_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr),
                ("cos_sin", _ptr), ("window", _i64)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("block_size", _i64), ("eps", _f32), ("scale", _f32), ("bf16", _i32),
                ("generic_attention", _i32), ("gelu", _i32), ("pad", _i32), ("layers", _ptr)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.decode_layers.restype = _i32
    lib.decode_layers.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr]
    lib.decode_layers_scratch.restype = _i64
    lib.decode_layers_scratch.argtypes = [_ptr, _i64]
    return lib


def _parts(linear: Any, m: int) -> list[tuple[int, int, int, torch.Tensor]] | None:
    """(kind, qtype, n, weight) of each part of `linear` as its measured route serves m rows;
    None where a part takes a route the driver does not have."""
    if isinstance(linear, QuantLinear):
        if linear.bias is not None:
            return None
        out = []
        for p in linear.parts:
            name = p.route.pick(m) if p.blocks_held else "float"
            if name == "blocks":
                out.append((_BLOCKS, p.qtype, p.n, p.raw) if p.packed is None else (_X16, p.qtype, p.n, p.packed))
            elif name == "float" and p.lin is not None and (small := _small(p.lin, m)) is not None:
                out.append((_SMALL, 0, p.n, small))
            else:
                return None
        return out
    if type(linear) is torch_ops.Linear and linear.bias is None:
        small = _small(linear, m)
        return None if small is None else [(_SMALL, 0, linear.out_features, small)]
    return None


def driver_linears(model: LlamaModel, m: int) -> list[list[list[tuple[int, int, int, torch.Tensor]]]] | None:
    """Each layer's qkv, o, gate_up and down parts (_parts) as the driver serves m rows; None where
    it does not serve m rows: torch's SiLU measured faster there (the per-op path, for its bits),
    or a linear layer takes a route the driver has not."""
    c = model.cfg
    if c.hidden_act == "silu" and torch_ops.silu_route(c.intermediate_size, model.dtype).pick(m) != "native":
        return None
    out = []
    for layer in model.layers:
        row = [_parts(lin, m) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(parts is None or len(parts) > _MAX_PARTS for parts in row):
            return None
        out.append(row)
    return out  # type: ignore[return-value]


def _small(linear: torch_ops.Linear, m: int) -> torch.Tensor | None:
    """The packed weight where the layer serves m rows on the bf16 small GEMM."""
    ok = linear.small is not None and m <= linear.small_rows and linear.route.pick(m) == "small"
    return linear.small if ok else None


def _decode_kernel(model: LlamaModel) -> str | None:
    """The decode attention kernel measured fastest here for this model's shape (None: unmeasured)."""
    c = model.cfg
    return chooser.installed().choice("decode", attention_key(model.dtype, c.num_attention_heads,
                                                               c.num_key_value_heads, c.head_dim), 0)


def why_not(model: LlamaModel) -> str | None:
    """Why the native driver cannot run this model at all (None: it can, for some row counts)."""
    c = model.cfg
    if not envs.RILL_DECODE_LAYERS:
        return "RILL_DECODE_LAYERS=0"
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float32):
        return "not a bf16/fp32 CPU model"
    if ops.uses_triton(model.embed) or cpu_native.library() is None:
        return "no native kernels"
    if c.hidden_act not in ("silu", "gelu_pytorch_tanh") or c.attn_logit_softcapping \
            or model.rope_tables["global"].dtype != torch.float32:
        return "an MLP gate or attention soft-capping the driver has not"
    if c.hidden_act == "gelu_pytorch_tanh" and not cpu_native.geglu_exact():
        return "GeGLU: torch's GELU bits need its vector tanh (AVX2 or AVX-512)"
    if c.head_dim % 2 or c.head_dim > 256 or c.num_attention_heads % c.num_key_value_heads \
            or c.num_attention_heads // c.num_key_value_heads > 16:
        return "attention shape"
    for layer in model.layers:
        if layer.moe is not None or (layer.q_norm is None) != (layer.k_norm is None):
            return "layers with experts, or a q norm without a k norm"
        if layer.input_norm is None or layer.post_norm is None \
                or (layer.q_norm is not None and layer.q_norm.shape[0] != c.head_dim):
            return "norms the driver has not (OLMo 2's: none before attention and MLP, q/k over all heads)"
    if _decode_kernel(model) == "torch":
        return "decode attention measured faster in torch here"
    return None


class DecodeLayers:
    """The native driver bound to one model; `run` serves a step or declines (None)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.lib = _declare(cpu_native.library())  # type: ignore[arg-type]
        self.generic = _decode_kernel(model) == "generic"
        # Per row count: the model's description for the driver, the layer array it points at, and
        # the scratch bytes a call takes (None: some layer's route at that count is not the driver's).
        self._stacks: dict[int, tuple[_Stack, Any, int] | None] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)  # one buffer for every row count, grown as needed
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._routes = gguf_linear.route_changes
        self._rows = torch.arange(MAX_ROWS, dtype=torch.int64)

    @classmethod
    def of(cls, model: LlamaModel) -> DecodeLayers | None:
        reason = why_not(model)
        if reason is not None:
            log.debug("native layer driver off: %s", reason)
            return None
        return cls(model)

    def _stack(self, m: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[_Stack, Any, int] | None:
        """The driver's description of the model for m rows (see _stacks)."""
        if kv_caches is not self._caches or gguf_linear.route_changes != self._routes:
            self._stacks.clear()  # descriptions of the old KV cache or the old routes
            self._caches, self._routes = kv_caches, gguf_linear.route_changes
        if m in self._stacks:
            return self._stacks[m]
        model, c = self.model, self.model.cfg
        linears = driver_linears(model, m)
        if linears is None or not all(k_cache.is_contiguous() for k_cache, _ in kv_caches):
            self._stacks[m] = None
            return None
        layers = (_Layer * len(model.layers))()
        for i, (layer, row, (k_cache, v_cache)) in enumerate(zip(model.layers, linears, kv_caches, strict=True)):
            for name, lin, parts in zip(("qkv", "o", "gate_up", "down"), (layer.qkv, layer.o, layer.gate_up, layer.down),
                                        row, strict=True):
                target = getattr(layers[i], name)
                target.num_parts, target.n, target.k = len(parts), lin.out_features, lin.in_features
                for j, (kind, qtype, n, w) in enumerate(parts):
                    target.parts[j] = _Part(kind, qtype, n, w.data_ptr())
            target = layers[i]
            target.input_norm, target.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
                norm = getattr(layer, name)
                setattr(target, name, None if norm is None else norm.data_ptr())
            target.cos_sin, target.window = model.rope_tables[layer.rope].data_ptr(), layer.window or 0
            target.k_cache, target.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        stack = _Stack(len(model.layers), c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                       c.intermediate_size, kv_caches[0][0].shape[1], c.rms_norm_eps, model.scale,
                       int(model.dtype == torch.bfloat16), int(self.generic),
                       int(c.hidden_act == "gelu_pytorch_tanh"), 0, ctypes.addressof(layers))
        self._stacks[m] = (stack, layers, int(self.lib.decode_layers_scratch(ctypes.byref(stack), m)))
        return self._stacks[m]

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, residual) after every layer for the embedded rows h [m, hidden]; None when this
        step is not one the driver serves (the caller runs the per-op path)."""
        m = h.shape[0]
        if m > MAX_ROWS or m < 1 or meta.max_query_len > MAX_SEQ_ROWS:
            return None
        found = self._stack(m, kv_caches)
        if found is None:
            return None
        stack, _, need = found
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        tables, seq_lens = row_tables(meta)
        if tables.dtype != torch.int32 or not tables.is_contiguous() or positions.dtype != torch.int64 \
                or meta.slot_mapping.dtype != torch.int64:
            return None
        h = h.contiguous()  # a fresh tensor (the embedding's rows): overwritten in place
        residual = torch.empty_like(h)
        rc = self.lib.decode_layers(ctypes.byref(stack), m, h.data_ptr(), residual.data_ptr(), positions.data_ptr(),
                                    meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
                                    seq_lens.data_ptr(), self._rows.data_ptr(), meta.max_seq_len,
                                    self._scratch.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native layer driver failed with code {rc}")
        return h, residual
