"""Triton paged attention: which kernel a step takes, and its launch (the kernels themselves are
in triton_attention_kernels.py).

Two paths, both reading every key and value (the step's own included) through the block table:
`decode_attention` for steps where every sequence runs one token (flash-decoding; its split count
comes from seqs x kv_heads x context, `choose_num_splits`, not from the batch alone, so long
contexts still fill the GPU at mid-size batches), and `extend_attention` for any other step
(prefill chunks, decodes, or a mix of both, in one launch). `paged_attention` picks one.

No window is passed as NO_WINDOW, far past any context. The launch grids depend only on tensor
shapes and on `max_seq_len` (for the split count), which keeps a captured CUDA graph valid
across replays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rill.kernels.triton_setup import INTERPRET, prepare_interpreter

prepare_interpreter()

import triton  # noqa: E402

from rill.kernels.triton_attention_kernels import decode_kernel, extend_kernel, reduce_kernel  # noqa: E402

if TYPE_CHECKING:
    from rill.kernels.ops import AttentionMetadata

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
NO_WINDOW = 1 << 30  # the window of a full-attention layer: longer than any context

# Launch settings. Chosen from sm_90 compiles of the Llama-3-8B shapes (bf16, head_dim 128, G=4;
# registers without spills, see scripts/gpu_check.py --compile-only), not yet from GPU timings:
# gpu_check.py times alternatives for the decode kernel and prints the fastest.
DECODE_CONFIG = {"tile_n": 64, "num_warps": 4, "num_stages": 3}


def extend_config(block_m: int, head_dim: int) -> tuple[int, int, int]:
    """(tile_n, num_warps, num_stages) of the extend kernel for a row-block size."""
    if INTERPRET:
        return 64, 4, 1
    if head_dim > 128:
        return 32, 8 if block_m >= 64 else 4, 2
    if block_m >= 64:
        return 64, 8, 2
    return 32, 4, 3


# ------------------------------------------------------------------------------------- launchers


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: few programs keep CPU runs short


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      tile_n: int = 64) -> int:
    """Splits per (sequence, KV head) so that the grid has about 4 programs per SM, while every
    split still covers at least two tiles of the longest context (short contexts gain nothing
    from splitting, and each split costs a partial write and a share of the reduce)."""
    programs = num_seqs * num_kv_heads
    target = 4 * num_sms
    if programs >= target or max_seq_len <= 2 * tile_n:
        return 1
    by_fill = -(-target // programs)
    by_length = -(-max_seq_len // (2 * tile_n))
    return max(1, min(by_fill, by_length, MAX_SPLITS))


def _upcast(dtype: torch.dtype) -> bool:
    # Only bf16 dots are wrong in the interpreter; fp16 keeps the GPU's rounding of P to 16 bits.
    return INTERPRET and dtype == torch.bfloat16


def _precision(dtype: torch.dtype) -> str:
    # fp32 models must not silently drop to tf32; 16-bit dots ignore the setting.
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q heads {q.shape[1]} / head_dim {q.shape[2]} do not fit the cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension of q and of the caches must be contiguous")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int, num_splits: int | None = None,
                     out: torch.Tensor | None = None, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] (row i belongs to sequence i) -> [B, Hq, D];
    `window`: a sliding window's size (the query sees its last `window` keys); `softcap`: scores
    s become softcap * tanh(s / softcap).

    A sequence with seq_len 0 (a padding lane) gets zeros."""
    _check(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    tile_n = DECODE_CONFIG["tile_n"] if INTERPRET or head_dim <= 128 else min(32, DECODE_CONFIG["tile_n"])
    if num_splits is None:
        seen = min(max_seq_len, window) if window else max_seq_len
        num_splits = choose_num_splits(num_seqs, num_kv_heads, seen, _num_sms(q.device), tile_n)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_splits, window or NO_WINDOW, (softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE_N=tile_n, SPLIT=split, UPCAST=_upcast(q.dtype),
        PRECISION=_precision(q.dtype), SOFTCAP=bool(softcap), num_warps=DECODE_CONFIG["num_warps"],
        num_stages=DECODE_CONFIG["num_stages"],
    )
    if split:
        reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                     out: torch.Tensor | None = None, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Causal attention for any mix of prefill chunks and decodes: q [T, Hq, D] -> [T, Hq, D];
    `window`: a sliding window's size (a query at p sees keys p - window + 1 .. p); `softcap`:
    scores s become softcap * tanh(s / softcap)."""
    _check(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # Rows = query tokens x the group's heads. Long chunks get 128 rows (a full tensor-core tile
    # per K/V load); decode-heavy mixes get the 16-row minimum so padding rows stay few.
    if INTERPRET:
        block_m = max(16, triton.next_power_of_2(group) * 8)
    else:
        block_m = min(128, max(16, triton.next_power_of_2(max(1, max_query_len) * group)))
        block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n, num_warps, num_stages = extend_config(block_m, head_dim)
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads)
    extend_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, num_seqs, window or NO_WINDOW, (softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, TILE_N=tile_n, UPCAST=_upcast(q.dtype), PRECISION=_precision(q.dtype),
        SOFTCAP=bool(softcap), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """The `ops.paged_attention` entry: pure-decode steps take the split-K decode kernel, all
    others the extend kernel. Only tensor shapes, the two host ints max_query_len and
    max_seq_len and the layer's window and soft-cap are consulted, so the launch is the same on every
    CUDA-graph replay."""
    del k_new, v_new  # the cache already holds this step's K/V
    if meta.max_query_len <= 1 and q.shape[0] == meta.seq_lens.shape[0]:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len,
                                num_splits=meta.aux.get("num_splits"), window=window, softcap=softcap)
    return extend_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                            meta.max_query_len, window=window, softcap=softcap)


def attention_bytes(num_seqs: int, ctx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    elem: int) -> int:
    """Bytes a decode step must move: every context K and V once, plus q in and out."""
    return num_seqs * (2 * ctx * num_kv_heads * head_dim + 2 * num_heads * head_dim) * elem


def extend_flops(query_lens: list[int], seq_lens: list[int], num_heads: int, head_dim: int) -> float:
    """Useful causal attention FLOPs (QK^T and PV, 2 FLOPs per multiply-add)."""
    total = 0.0
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        ctx = s_len - q_len
        keys = q_len * ctx + q_len * (q_len + 1) / 2
        total += 4.0 * keys * num_heads * head_dim
    return total


__all__ = ["decode_attention", "extend_attention", "paged_attention", "choose_num_splits", "attention_bytes",
           "extend_flops", "MAX_SPLITS"]
