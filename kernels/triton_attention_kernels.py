"""The @triton.jit kernels of paged attention over the NHD block cache
([num_blocks, block_size, kv_heads, head_dim]); triton_attention.py chooses and launches them.

- `decode_kernel` (flash-decoding), for steps where every sequence runs one token. Grid
  (seqs, kv_heads, splits); a program walks one split of one sequence's context for one KV head
  and computes all G query heads of that head's group at once (GQA packing: each K/V tile is
  loaded once and multiplied against a [G padded to 16, D] query tile), with an online softmax in
  fp32. With more than one split each program writes an fp32 partial output and its log-sum-exp
  and `reduce_kernel` merges them; with one split the kernel writes the output directly.
- `extend_kernel`, for any other step (prefill chunks, decodes, or a mix of both, in one
  launch): a program owns BLOCK_Q query tokens x the G heads of one KV head (rows packed as
  token-major, head-minor), finds its sequence by binary search over query_start_loc, walks the
  cached prefix and then its own tokens with the causal mask, and stops at the last key its
  rows can see.

Scores are in log2 units (the launchers pass scale * log2(e)). Sliding-window layers pass
`window` (a runtime argument, so one compiled kernel serves both layer kinds of Gemma 3): a query
at position p sees keys p - window + 1 .. p, and the key loops start at the window of the first
row, never touching table entries of released blocks before it. Gemma 2's attention logit
soft-capping (`softcap`: a score s becomes softcap * tanh(s / softcap) before the mask and the
softmax) is a compile-time switch (SOFTCAP), so the other models' kernels stay as they were.

Addresses are formed in int64 (block ids and token rows are widened before any multiply), so
caches past 2^31 elements are safe.

Under TRITON_INTERPRET=1 (CPU tests) bf16 `tl.dot` is wrong, so bf16 tiles are upcast to fp32
before the dot there (`UPCAST`); fp16 runs as on a GPU, where the dots take the cache dtype
(P rounded to it too) and accumulate in fp32. fp32 dots use "ieee" precision, not tf32.
"""

from __future__ import annotations

from rill.kernels.triton_setup import prepare_interpreter

prepare_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), s and cap in the same units (the kernels' log2 ones); tanh from exp2:
    1 - 2 / (e^2x + 1) on |x|, sign put back."""
    x = s / cap
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


@triton.jit
def paged_kv_tile(table_row, pos, valid, k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                  stride_vh, kvh, offs_d, d_mask, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """K and V rows [TILE_N, BLOCK_D] of positions `pos` (zeros where not `valid`), read from the
    paged cache through one table entry per key (neighbouring keys share entries, which stay in L1)."""
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
    return k, v


@triton.jit
def decode_kernel(
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
        k, v = paged_kv_tile(table_row, pos, valid, k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb,
                             stride_vt, stride_vh, kvh, offs_d, d_mask, BLOCK_SIZE, HEAD_DIM, BLOCK_D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_H, TILE_N], log2 units
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
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
def reduce_kernel(
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
def extend_kernel(
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
        k, v = paged_kv_tile(table_row, pos, valid, k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb,
                             stride_vt, stride_vh, kvh, offs_d, d_mask, BLOCK_SIZE, HEAD_DIM, BLOCK_D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
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
