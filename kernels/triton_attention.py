"""Triton paged attention over the NHD block cache ([num_blocks, block_size, kv_heads, head_dim]).

Two paths, both reading every key and value (the step's own included) through the block table:

- `decode_attention`, for steps where every sequence runs one token: flash-decoding. Grid
  (seqs, kv_heads, splits); a program walks one split of one sequence's context for one KV head
  and computes all G query heads of that head's group at once (GQA packing: each K/V tile is
  loaded once and multiplied against a [G padded to 16, D] query tile), with an online softmax in
  fp32. With more than one split each program writes an fp32 partial output and its log-sum-exp
  and `_reduce_kernel` merges them; with one split the kernel writes the output directly. The
  split count comes from seqs x kv_heads x context (`choose_num_splits`), not from the batch
  alone, so long contexts still fill the GPU at mid-size batches.
- `extend_attention`, for any other step (prefill chunks, decodes, or a mix of both, in one
  launch): a program owns BLOCK_Q query tokens x the G heads of one KV head (rows packed as
  token-major, head-minor), finds its sequence by binary search over query_start_loc, walks the
  cached prefix and then its own tokens with the causal mask, and stops at the last key its
  rows can see.

Sliding-window layers pass `window` (a runtime argument, so one compiled kernel serves both
layer kinds of Gemma 3): a query at position p sees keys p - window + 1 .. p, and the key loops
start at the window of the first row, never touching table entries of released blocks before it.
No window is passed as NO_WINDOW, far past any context. Gemma 2's attention logit soft-capping
(`softcap`: a score s becomes softcap * tanh(s / softcap) before the mask and the softmax) is a
compile-time switch (SOFTCAP), so the other models' kernels stay as they were.

Addresses are formed in int64 (block ids and token rows are widened before any multiply), so
caches past 2^31 elements are safe. The launch grids depend only on tensor shapes and on
`max_seq_len` (for the split count), which keeps a captured CUDA graph valid across replays.

Under TRITON_INTERPRET=1 (CPU tests) bf16 `tl.dot` is wrong, so bf16 tiles are upcast to fp32
before the dot there (`UPCAST`); fp16 runs as on a GPU, where the dots take the cache dtype
(P rounded to it too) and accumulate in fp32. fp32 dots use "ieee" precision, not tf32.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch


def prepare_interpreter() -> None:
    """Make TRITON_INTERPRET=1 work even when triton was imported before it was set.

    The flag is read when a function is decorated, and Triton's own library functions (tl.sum,
    tl.max, tl.cdiv, ...) are decorated when triton is first imported, which torch._dynamo does
    early (transformers pulls it in). Compiled library functions cannot be called from an
    interpreted kernel, so drop triton's Python modules (not its C extension) and import afresh."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(getattr(standard, "sum", None), InterpretedFunction):
        return
    for name in [m for m in sys.modules if (m == "triton" or m.startswith("triton.")) and not m.startswith("triton._C")]:
        del sys.modules[name]


prepare_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if TYPE_CHECKING:
    from rill.kernels.ops import AttentionMetadata

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
NO_WINDOW = 1 << 30  # the window of a full-attention layer: longer than any context
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

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


# ------------------------------------------------------------------------------------- kernels


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), s and cap in the same units (the kernels' log2 ones); tanh from exp2:
    1 - 2 / (e^2x + 1) on |x|, sign put back."""
    x = s / cap
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_splits, window, softcap_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The splits cover the keys the query sees: its window's (from first_key), else all of them.
    # Each covers a whole number of tiles; trailing splits of a short sequence are empty.
    first_key = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), TILE_N) * TILE_N
    start = first_key + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(q_ptr + seq64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq64 * stride_table
    for tile in range(start, end, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        valid = pos < end
        # One table entry per key; neighbouring keys share entries, which stay in L1.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
        if HEAD_DIM == BLOCK_D:  # a mask constant along D keeps the loads vectorised
            kv_mask = valid[:, None]
        else:
            kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_kt + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_H, TILE_N], log2 units
        if SOFTCAP:
            s = _soft_cap(s, softcap_log2)
        s = tl.where(valid[None, :], s, float("-inf"))
        # The first tile of a non-empty split has a valid key, so m_new is finite from here on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / safe_l[:, None]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # partials: [seqs, heads, splits, BLOCK_D] fp32 and lse [seqs, heads, splits] (log2 units)
        row = (seq64 * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)
    else:
        tl.store(out_ptr + seq64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence (padding lane): output 0
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    scale_log2, num_seqs, window, softcap_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    qblock = tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence i owns global q-blocks from qsl[i] // BLOCK_Q + i on (the grid has one spare
    # block per sequence so that bound needs no host-side count): the owner is the last i whose
    # first block is <= this one.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= qblock:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_off = (qblock - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this block, in the sequence
    if q_off >= q_len:
        return
    seq64 = seq.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx_len + tok  # absolute position: sees keys 0..q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq64 * stride_table
    kv_end = tl.minimum(seq_len, ctx_len + q_off + BLOCK_Q)  # one past the last key any row sees
    kv_start = tl.maximum(ctx_len + q_off - window + 1, 0)  # the first key any row sees
    for tile in range(kv_start, kv_end, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        valid = pos < kv_end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
        if HEAD_DIM == BLOCK_D:  # a mask constant along D keeps the loads vectorised
            kv_mask = valid[:, None]
        else:
            kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_kt + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFTCAP:
            s = _soft_cap(s, softcap_log2)
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) \
            & valid[None, :] & row_valid[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Padding rows see nothing: keep their max at 0 so exp2 gives 0 instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


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
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
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
        _reduce_kernel[(num_seqs, num_heads)](
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
    _extend_kernel[grid](
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
