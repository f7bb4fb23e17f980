"""Paged attention in plain torch and the native CPU kernels, the CPU side of `ops.paged_attention`.

A mixed step splits in two: every single-token (decode) row is done together, by the native
kernel that reads the paged KV in place (cpu_native) when it is available, else by gathers +
batched matmuls over rows grouped by length; the multi-token (prefill chunk) rows likewise go to
one call of the native prefill kernel, else each chunk runs through SDPA on its own. Softmax
always runs in fp32. Which kernel runs is the measured choice (chooser.py).

RILL_BATCH_INVARIANT: every row, prompt rows included, is a decode row for the native decode
kernel (each over its own positions), since a row's bits must not depend on the kernel its step's
shape picked: a prompt's last token alone (a prefix-cache hit, a chunk of one) would take the
decode kernel, the same token in a longer chunk the prompt kernel, and they round differently.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from rill.kernels import chooser, cpu_native
from rill.shared import envs

if TYPE_CHECKING:
    from rill.kernels.ops import AttentionMetadata


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    # One plan per window size (Gemma 3 alternates two); full attention's keeps the plain key.
    key = ("torch_plan", window) if window else "torch_plan"
    plan = meta.aux.get(key)
    if plan is None:  # built on the first layer of its window, reused by the others
        plan = meta.aux[key] = _AttentionPlan(meta, q.shape[1], k_cache.shape[2], k_cache.shape[1], q.device,
                                              *attention_kernels(meta, q, k_cache), window=window)
    return attend(plan, q, k_cache, v_cache, scale, k_new, v_new, softcap)


def attention_shape(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[object, ...]:
    """Attention's key in the kernel table (see attention_key)."""
    return attention_key(q.dtype, q.shape[1], k_cache.shape[2], q.shape[2])


def attention_key(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> tuple[object, ...]:
    """dtype, query heads, KV heads, head size."""
    return (str(dtype).removeprefix("torch."), heads, kv_heads, head_dim)


def prefill_candidates(q: torch.Tensor, k_cache: torch.Tensor) -> list[str]:
    """Prompt-chunk attention implementations for these tensors, the flag-based pick first:
    native kernels (AMX tiles, AVX512-BF16 dot products, fp32 FMAs) where they apply, and SDPA."""
    if not cpu_native.prefill_supported(q, k_cache):
        return ["sdpa"]
    names = []
    if q.dtype == torch.bfloat16:
        if q.shape[2] % 32 == 0 and cpu_native.amx_prefill_available():
            names.append("amx")
        if cpu_native.dot_prefill_available():
            names.append("dot")
    return [*names, "vector", "sdpa"]


def decode_candidates(q: torch.Tensor, k_cache: torch.Tensor) -> list[str]:
    """Decode attention implementations: the native kernel (with its register-only fast path where
    the shape allows), its generic loop, and torch's gathers + batched matmuls."""
    return ["native", "generic", "torch"] if cpu_native.decode_supported(q, k_cache) else ["torch"]


def attention_kernels(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[str, str]:
    """(decode, prefill) implementations for this step: the measured choice (chooser.py; prompt
    chunks by the longest context among them) where it is one this step can run, else the
    flag-based pick. RILL_PREFILL_KERNEL=amx|dot|vector forces the native prefill kernel."""
    table, shape = chooser.installed(), attention_shape(q, k_cache)
    decode_names = decode_candidates(q, k_cache)
    decode = table.choice("decode", shape, 0) or decode_names[0]
    prefill_names = prefill_candidates(q, k_cache)
    qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
    longest = max((seq_lens[i] for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] > 1), default=0)
    bucket = chooser.CONTEXT_BUCKETS[min(bisect.bisect_left(chooser.CONTEXT_BUCKETS, longest),
                                         len(chooser.CONTEXT_BUCKETS) - 1)]
    prefill = table.choice("prefill", shape, bucket) or prefill_names[0]
    forced = envs.RILL_PREFILL_KERNEL
    if forced in ("amx", "dot", "vector") and "vector" in prefill_names:
        prefill = forced
    return (decode if decode in decode_names else decode_names[0],
            prefill if prefill in prefill_names else prefill_names[0])


def attend(plan: _AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Attention of every row of a step, by the implementations its plan chose; `softcap`: scores
    s become softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.native is not None:
        n = plan.native
        cpu_native.paged_decode(q, k_cache, v_cache, n.block_tables, n.seq_lens, n.rows, out, n.max_len, scale,
                                generic_only=plan.decode_kernel == "generic", window=plan.window, softcap=softcap)
    if plan.native_prefill is not None:
        p = plan.native_prefill
        cpu_native.paged_prefill(q, k_cache, v_cache, p.block_tables, p.q_starts, p.q_lens, p.ctx_lens, out, scale,
                                 kernel=plan.prefill_kernel, window=plan.window, softcap=softcap)
    for group in plan.decode_groups:
        out.index_copy_(0, group.rows, _decode(q.index_select(0, group.rows), k_cache, v_cache, group, scale,
                                               softcap))
    for start, end, ctx_len, key_start, blocks in plan.prefills:
        if ctx_len == 0 and k_new is not None and v_new is not None:
            k, v = k_new[start:end], v_new[start:end]
        else:
            # The gathered blocks start at key_start (a window's first block); the sequence ends
            # ctx_len + (end - start) - key_start keys in.
            keys = ctx_len + end - start - key_start
            k = _gather(k_cache, blocks)[:keys]
            v = _gather(v_cache, blocks)[:keys]
        out[start:end] = _prefill(q[start:end], k, v, ctx_len, scale, key_start, plan.window, softcap)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' rows, contiguous: [len(blocks) * block_size, kv_heads, head_dim]."""
    return cache.index_select(0, blocks).flatten(0, 1)


# A decode group costs a handful of op launches per layer on top of its KV traffic; in units of
# one (row, block) of padded KV, that overhead is worth about this many:
_GROUP_OVERHEAD_BLOCKS = 48


def split_by_length(nblocks: list[int], overhead: int = _GROUP_OVERHEAD_BLOCKS) -> list[list[int]]:
    """Groups of row indices, each padded to its longest row's block count, chosen to minimise
    padded (row, block) pairs plus `overhead` per group: rows of very different lengths then no
    longer all pay for the longest one. Exact DP over the rows sorted by length (O(n^2), n <= a
    few hundred, once per step)."""
    order = sorted(range(len(nblocks)), key=lambda i: nblocks[i])
    lens = [nblocks[i] for i in order]
    n = len(lens)
    best = [0] + [0] * n  # best[j]: cost of grouping the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        # The group ending at row j-1 (the longest so far) pads every member to lens[j-1].
        best[j], cut[j] = min((best[i] + (j - i) * lens[j - 1] + overhead, i) for i in range(j))
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def first_window_block(first_query: int, window: int | None, block_size: int) -> int:
    """The first block a query at `first_query` (or later) reads: its window's, else block 0."""
    return max(0, first_query - window + 1) // block_size if window else 0


class _DecodeGroup:
    """Single-token rows of similar lengths: their KV gathered and padded together, with the mask
    that drops positions past each row's end (or before its sliding window) and (query head, kv
    head) pairs of other groups. With a window each row's blocks start at its window's first one,
    so table entries before it (blocks already released) are never read."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int], num_heads: int, num_kv_heads: int,
                 block_size: int, device: torch.device, window: int | None = None) -> None:
        qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
        idx = torch.tensor(seqs, dtype=torch.int64)
        lens = torch.tensor([seq_lens[i] for i in seqs], dtype=torch.int64)
        first = torch.tensor([first_window_block(seq_lens[i] - 1, window, block_size) for i in seqs])
        count = -(-lens // block_size) - first
        nblocks = int(count.max())
        self.rows = torch.tensor([qsl[i] for i in seqs], dtype=torch.int64, device=device)
        tables = meta.block_tables.index_select(0, idx.to(meta.block_tables.device)).to(torch.int64)
        # Row i reads blocks first[i] .. first[i] + count[i] - 1, then pads with block 0 (masked).
        cols = first[:, None] + torch.arange(nblocks)[None, :]
        used = (torch.arange(nblocks)[None, :] < count[:, None]).to(tables.device)
        picked = tables.gather(1, cols.clamp(max=tables.shape[1] - 1).to(tables.device))
        self.blocks = torch.where(used, picked, 0).flatten().to(device)
        self.num = len(seqs)
        padded = nblocks * block_size
        # Scores are taken against every (position, kv head) pair of a sequence in one bmm over a
        # contiguous [padded * kv_heads, head_dim] view, so no per-head copy of the gathered KV is
        # needed; the mask then drops positions past the sequence's end and the pairs whose kv head
        # is not the query head's group. That trades kv_heads x more (cheap) FLOPs for one fewer
        # pass over memory, which wins for the few-kv-head models a CPU serves.
        group = num_heads // num_kv_heads
        pos = first[:, None] * block_size + torch.arange(padded)[None, :]  # [n, padded]
        past_end = pos >= lens[:, None]
        if window:
            past_end |= pos < lens[:, None] - window
        other_head = (torch.arange(num_heads)[:, None] // group) != torch.arange(num_kv_heads)[None, :]
        masked = past_end[:, None, :, None] | other_head[None, :, None, :]  # [n, H, padded, Hkv]
        self.mask = torch.zeros(masked.shape, dtype=torch.float32) \
            .masked_fill_(masked, float("-inf")).view(len(seqs), num_heads, padded * num_kv_heads).to(device)


def _native_tables(meta: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
    """The block-table rows of `seqs`, int32 and contiguous, as the native kernels read them."""
    idx = torch.tensor(seqs, dtype=torch.int64)
    return meta.block_tables.index_select(0, idx).to(torch.int32).contiguous()


def row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table and context length as a single-token decode: a sequence's rows see
    its positions up to their own (row r of q rows ending at length L sees L - q + 1 + r)."""
    if meta.max_query_len == 1:
        return meta.block_tables, meta.seq_lens
    qsl = np.asarray(meta.query_start_loc_host)
    qlens = np.diff(qsl)
    seq_of_row = np.repeat(np.arange(len(qlens)), qlens)
    lens = np.asarray(meta.seq_lens_host)[seq_of_row] - (qsl[seq_of_row + 1] - 1 - np.arange(int(qsl[-1])))
    return (meta.block_tables.index_select(0, torch.from_numpy(seq_of_row)).contiguous(),
            torch.from_numpy(lens.astype(np.int32)))


class _NativeDecode:
    """The single-token rows' block tables, lengths and q rows, for the native kernel (`seqs`
    None: every row of the step, each a decode over its own positions, see row_tables)."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int] | None) -> None:
        if seqs is None:
            tables, self.seq_lens = row_tables(meta)
            self.block_tables = tables.to(torch.int32).contiguous()
            self.rows = torch.arange(int(meta.query_start_loc_host[-1]), dtype=torch.int64)
            self.max_len = int(self.seq_lens.max())
            return
        self.block_tables = _native_tables(meta, seqs)
        self.seq_lens = torch.tensor([meta.seq_lens_host[i] for i in seqs], dtype=torch.int32)
        self.rows = torch.tensor([meta.query_start_loc_host[i] for i in seqs], dtype=torch.int64)
        self.max_len = max(meta.seq_lens_host[i] for i in seqs)


class _NativePrefill:
    """The multi-token rows' block tables, query starts, lengths and context lengths, for the
    native prefill kernel."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int]) -> None:
        qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
        self.block_tables = _native_tables(meta, seqs)
        self.q_starts = torch.tensor([qsl[i] for i in seqs], dtype=torch.int32)
        self.q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in seqs], dtype=torch.int32)
        self.ctx_lens = torch.tensor([seq_lens[i] - (qsl[i + 1] - qsl[i]) for i in seqs], dtype=torch.int32)


class _AttentionPlan:
    """Index tensors and masks for one step, shared by every layer. `decode_kernel`: native,
    generic or torch; `prefill_kernel`: amx, dot, vector (native) or sdpa (see attention_kernels)."""

    def __init__(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, block_size: int,
                 device: torch.device, decode_kernel: str = "torch", prefill_kernel: str = "sdpa",
                 window: int | None = None) -> None:
        qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
        self.decode_kernel, self.prefill_kernel = decode_kernel, prefill_kernel
        self.window = window or None  # sliding-window size of the layers this plan serves
        decodes = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        prefills = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] > 1]
        if prefills and decode_kernel != "torch" and envs.RILL_BATCH_INVARIANT:  # see the module docstring
            self.native_prefill, self.prefills, self.decode_groups = None, [], []
            self.native: _NativeDecode | None = _NativeDecode(meta, None)
            return
        # Multi-token rows: one call of the native kernel, which reads the paged KV in place;
        # else SDPA per row over its keys (gathered when it has context).
        native_prefill = prefill_kernel != "sdpa"
        self.native_prefill = _NativePrefill(meta, prefills) if native_prefill and prefills else None
        self.prefills: list[tuple[int, int, int, int, torch.Tensor]] = []
        if self.native_prefill is None:
            for i in prefills:
                start, end = qsl[i], qsl[i + 1]
                ctx_len = seq_lens[i] - (end - start)
                first = first_window_block(ctx_len, self.window, block_size)
                blocks = meta.block_tables[i, first:-(-seq_lens[i] // block_size)].to(torch.int64)
                self.prefills.append((start, end, ctx_len, first * block_size, blocks))
        # Single-token rows: one call of the native kernel, else length groups in plain torch.
        self.native = _NativeDecode(meta, decodes) if decode_kernel != "torch" and decodes else None
        if self.native is not None:
            decodes = []
        groups = split_by_length([-(-seq_lens[i] // block_size)
                                  - first_window_block(seq_lens[i] - 1, self.window, block_size)
                                  for i in decodes]) if decodes else []
        self.decode_groups = [_DecodeGroup(meta, [decodes[j] for j in g], num_heads, num_kv_heads, block_size,
                                           device, self.window) for g in groups]


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap) in place (fp32 scores), or the scores as they are."""
    return scores if not softcap else scores.div_(softcap).tanh_().mul_(softcap)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    head_dim = q.shape[-1]
    k = k_cache.index_select(0, group.blocks).view(group.num, -1, head_dim)  # [n, padded*Hkv, D]
    v = v_cache.index_select(0, group.blocks).view(group.num, -1, head_dim)
    scores = soft_cap(torch.bmm(q, k.transpose(1, 2)).float().mul_(scale), softcap).add_(group.mask)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, v)  # [n, H, D]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float,
             key_start: int = 0, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [n, H, D] at positions ctx_len..ctx_len+n-1 over k, v [ctx_len+n-key_start, Hkv, D]
    (the keys from position key_start on); `window`: a query at p sees keys p - window + 1 .. p."""
    n = q.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if softcap:
        # SDPA has no soft-cap: scores, cap, mask and softmax spelled out (fp32, as in _decode).
        group = q.shape[1] // k.shape[1]
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        scores = soft_cap(torch.matmul(qt, kt.transpose(-1, -2)).float().mul_(scale), softcap)
        keys = key_start + torch.arange(k.shape[0], device=q.device)
        query_pos = (ctx_len + torch.arange(n, device=q.device))[:, None]
        hidden = keys[None, :] > query_pos
        if window:
            hidden |= keys[None, :] <= query_pos - window
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1).to(q.dtype)
        return torch.matmul(probs, vt)[0].transpose(0, 1)
    if ctx_len == 0 and key_start == 0 and not window:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position ctx_len + i and sees keys up to ctx_len + i.
        keys = key_start + torch.arange(k.shape[0], device=q.device)
        query_pos = (ctx_len + torch.arange(n, device=q.device))[:, None]
        mask = keys[None, :] <= query_pos
        if window:
            mask &= keys[None, :] > query_pos - window
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
