"""The one kernel interface the model calls.

`llama.py` only ever calls the functions below; each one dispatches on the device of its input
to an implementation module (`_impl_for`): CUDA tensors go to the Triton kernels (`triton_ops`,
`triton_attention`), everything else to `torch_ops` (plain torch and native kernels, tuned for CPU;
its attention in `torch_attention`).

RILL_KERNELS=triton|torch|auto (default auto) forces one backend for every device; `set_backend`
does the same from code. Forcing Triton on a machine without CUDA runs the kernels under the
Triton interpreter (TRITON_INTERPRET=1 is set before they are imported), which is how the CPU
test suite runs a whole model step through the Triton path; it is far too slow to serve with.

KV cache layout (per layer): K and V tensors of shape [num_blocks, block_size, num_kv_heads,
head_dim] ("NHD"), allocated once. The KV of a request's position p lives at slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from rill.kernels import torch_ops
from rill.kernels.torch_ops import Int8Linear, Linear
from rill.shared import envs
from rill.shared.config import QUANTIZATIONS

AnyLinear = Linear | Int8Linear


@dataclass
class AttentionMetadata:
    """Where each query token of a flattened step reads and writes its KV.

    Sequences appear in batch order; sequence i owns query rows
    `query_start_loc[i] : query_start_loc[i+1]`, which sit at the last `query_len` positions of
    its `seq_lens[i]` tokens (so a row can be a prefill chunk starting anywhere, or one decode).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each query token's new K/V
    query_start_loc: torch.Tensor  # [B+1] int32: cu_seqlens of the query tokens
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of the two small index arrays: the torch path branches on them per sequence,
    # and having them here saves a device->host sync on every layer.
    query_start_loc_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    # Per-step scratch an implementation computes on the first layer and reuses on the others.
    aux: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def make_attention_metadata(block_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                            query_lens: Sequence[int], block_size: int,
                            device: torch.device | str = "cpu") -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and attention metadata for sequences that each run `query_lens[i]` tokens
    starting at position `num_computed[i]`, with KV in blocks `block_ids[i]` (at least enough
    blocks to hold num_computed + query_len tokens)."""
    num_seqs = len(query_lens)
    qlens = np.asarray(query_lens, dtype=np.int64)
    computed = np.asarray(num_computed, dtype=np.int64)
    seq_lens = computed + qlens
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    total = int(qsl[-1])
    # Only the blocks that hold the context take part; the rest of a table is not read.
    blocks_needed = (seq_lens + block_size - 1) // block_size
    max_blocks = int(blocks_needed.max()) if num_seqs else 0
    table = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        n = int(blocks_needed[i])
        if n > len(ids):
            raise ValueError(f"sequence {i} needs {n} blocks for {int(seq_lens[i])} tokens, has {len(ids)}")
        table[i, :n] = ids[:n]
    seq_of_token = np.repeat(np.arange(num_seqs), qlens)
    positions = np.repeat(computed - qsl[:-1], qlens) + np.arange(total)
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(table.astype(np.int32)).to(device),
        max_query_len=int(qlens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        query_start_loc_host=qsl.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return torch.from_numpy(positions).to(device), meta


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled, not empty: padded decode lanes read slots nobody wrote, and garbage NaNs there
    would leak through `0 * NaN` in the probability-weighted sum.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


log = logging.getLogger("rill.kernels")

BACKENDS = ("auto", "torch", "triton")
_backend: str | None = None  # None: read RILL_KERNELS on first use
_triton_module: ModuleType | None = None
_triton_failed = False


def set_backend(name: str | None) -> None:
    """Force "torch" or "triton" for every device, or "auto" (by device); None re-reads RILL_KERNELS."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def backend() -> str:
    """The configured choice: auto, torch or triton."""
    global _backend
    if _backend is None:
        name = envs.RILL_KERNELS
        if name not in BACKENDS:
            raise ValueError(f"RILL_KERNELS must be one of {BACKENDS}, got {name!r}")
        _backend = name
    return _backend


def _triton_ops() -> ModuleType | None:
    """The Triton implementation module, imported on first use (None when Triton is unusable)."""
    global _triton_module, _triton_failed
    if _triton_module is None and not _triton_failed:
        if not torch.cuda.is_available():
            # Without a GPU the kernels can only run interpreted; the flag is read when the
            # kernels are decorated, i.e. at import.
            envs.export("TRITON_INTERPRET", "1", overwrite=False)
        try:
            from rill.kernels import triton_ops
        except ImportError as exc:  # no triton wheel: serve with torch rather than not at all
            log.warning("Triton kernels unavailable (%s); using the torch kernels", exc)
            _triton_failed = True
            return None
        _triton_module = triton_ops
    return _triton_module


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ops on tensors like `x` run the Triton kernels."""
    return _impl_for(x) is not torch_ops


def _impl_for(x: torch.Tensor) -> ModuleType:
    """The implementation seam: Triton for CUDA tensors (or when forced), torch otherwise."""
    choice = _backend if _backend is not None else backend()
    if choice == "torch" or (choice == "auto" and not x.is_cuda):
        return torch_ops
    impl = _triton_ops()
    if impl is None or (not x.is_cuda and not impl.INTERPRET):
        return torch_ops  # compiled GPU kernels cannot take CPU tensors
    return impl


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at their slots in the paged cache (in place)."""
    _impl_for(k).write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, heads, head_dim] over each sequence's paged KV -> [T, heads, head_dim].

    The step's own K/V must already be in the cache (`write_kv` first). `k_new`/`v_new` (this
    step's K/V rows, aligned with q) are an optional hint: an implementation may read a fresh
    prompt's keys from them instead of gathering them back from the cache. `window` (a
    sliding-window layer): a query at position p sees keys p - window + 1 .. p only (transformers'
    `kv_idx > q_idx - sliding_window`), and no implementation reads the table entries of blocks
    wholly before its window, which the scheduler may have released. `softcap` (Gemma 2's
    attention logit soft-capping): each scaled score s becomes softcap * tanh(s / softcap) before
    the mask and the softmax.
    """
    extra = {k: v for k, v in (("window", window), ("softcap", softcap)) if v}
    return _impl_for(q).paged_attention(q, k_cache, v_cache, meta, scale, k_new, v_new, **extra)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight; with `residual`, first x = x + residual and return (normed, x)."""
    return _impl_for(x).rms_norm(x, weight, eps, residual)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE on q [T, heads, D] and k [T, kv_heads, D]. `cos_sin_cache` is
    [max_positions, D] fp32 holding cos in the first half and sin in the second."""
    return _impl_for(q).apply_rotary(q, k, positions, cos_sin_cache)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` then `write_kv` of the rotated k and v; returns the rotated (q, k).

    The Triton backend does both in one kernel and rotates q and k IN PLACE (callers must not
    reuse the unrotated inputs); it also skips slots < 0 (padding tokens). On CPU the native
    kernel does both in one pass too (into new tensors), else torch runs them one after the other."""
    impl = _impl_for(q)
    fused = getattr(impl, "rope_and_write_kv", None)
    if fused is not None:
        return fused(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    q, k = impl.apply_rotary(q, k, positions, cos_sin_cache)
    impl.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                quantization: str | None = None, logits: bool = False) -> AnyLinear:
    """A callable x -> x @ weight.T + bias, prepared once for the weight's device; with
    quantization "int8", the W8A8 int8 version (CPU weights only). `logits`: the LM head, called
    through `float_out` (on CPU its GEMM choice is measured for that use)."""
    if quantization is None or quantization == "none":
        impl = _impl_for(weight)
        return impl.Linear(weight, bias, logits=True) if logits and impl is torch_ops else impl.Linear(weight, bias)
    if quantization != "int8":
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    return torch_ops.Int8Linear(weight, bias, logits)  # refuses non-CPU weights


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2F] holding [gate | up] -> silu(gate) * up, [T, F]."""
    return _impl_for(x).silu_and_mul(x)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2F] holding [gate | up] -> GELU_tanh(gate) * up, [T, F] (GeGLU)."""
    return _impl_for(x).gelu_and_mul(x)


def make_experts(gate_up: torch.Tensor, down: torch.Tensor) -> Callable[..., torch.Tensor]:
    """SwiGLU experts, gate_up [E, 2F, H] (each expert's gate rows, then its up rows) and down
    [E, H, F], prepared once for their device: experts(x [T, H], topk_weights [T, k], topk_ids
    [T, k]) -> sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), [T, H]. Grouped GEMMs
    over the tokens sorted by expert (moe.py); a fused pair of kernels on Triton (triton_moe.py)."""
    return _impl_for(gate_up).make_experts(gate_up, down)
