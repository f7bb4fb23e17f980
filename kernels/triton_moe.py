"""The fused mixture-of-experts kernels of the Triton (CUDA) backend.

The token-expert pairs (see moe.py) are sorted by expert and each expert's segment is padded to a
multiple of BLOCK_M, so that every row block of the sorted list belongs to one expert. Two
grouped GEMMs then run over those blocks, each program loading its expert's weight tile and the
rows of the pairs it holds (padding rows are masked off):

1. gate_up: rows of x times expert e's [2F, H] weight, gate and up tiles side by side, and
   silu(gate) * up applied in the epilogue -> [T * k, F] (pair-major, unsorted);
2. down: those rows times expert e's [H, F] weight, scaled by the pair's routing weight in the
   epilogue -> [T * k, H]; the k rows of each token are then summed.

The sort and padding are torch ops with no device-to-host sync, and every buffer is sized for
the worst routing (T * k + E * (BLOCK_M - 1) padded rows), so a step is capturable in a CUDA
graph and a warm-up step measures the most memory any routing can take. Rounding follows the
grouped torch path: each GEMM rounds to the model dtype, silu(gate) rounds before the multiply.
"""

from __future__ import annotations

import torch

from rill.kernels.moe import expert_counts
from rill.kernels.triton_setup import INTERPRET, prepare_interpreter

prepare_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Launch settings: (BLOCK_N, BLOCK_K, num_warps, num_stages), compiled for sm_90 without spills
# (scripts/gpu_check.py --compile-only), not yet tuned on a GPU.
CONFIG = (32, 32, 4, 1) if INTERPRET else (64, 32, 4, 3)


def _precision(dtype: torch.dtype) -> str:
    # fp32 models must not silently drop to tf32; 16-bit dots ignore the setting.
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"


def block_m_for(pairs: int, num_experts: int) -> int:
    """Row-block size: small when few pairs per expert (decode), so padding stays a small share."""
    return 16 if pairs <= 4 * num_experts or INTERPRET else 64


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P], block_expert [P // block_m]) with P = T * k + E * (block_m - 1) rounded up
    to a block: pair ids grouped by expert, each group padded to whole blocks with the sentinel
    T * k; the expert of each block, -1 for the unused blocks at the end."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    counts = expert_counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat.index_select(0, order)
    first_in_group = torch.cumsum(counts, 0) - counts  # where each expert starts among the sorted pairs
    rank = torch.arange(pairs, device=flat.device) - first_in_group.index_select(0, sorted_expert)
    dest = (padded_end - padded).index_select(0, sorted_expert) + rank
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, dest, order)
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                    num_pairs, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + ks) < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] tiles of the gate rows and, F rows further, the up rows.
        wg = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    h = (silu * acc_u.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_ot + cols[None, :], h,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                 num_pairs, inter, hidden,
                 stride_ht, stride_we, stride_wn, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = tl.where(valid, pair, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + ks) < inter
        a = tl.load(h_ptr + row[:, None] * stride_ht + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + row, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + cols[None, :], y.to(dtype), mask=valid[:, None] & col_ok[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """The experts of `ops.make_experts` on the Triton kernels: x [T, H] -> [T, H]."""
    t, k = topk_ids.shape
    num_experts, f2, hidden = gate_up.shape
    inter = f2 // 2
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    block_m = block_m or block_m_for(pairs, num_experts)
    x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    sorted_pairs, block_expert = align_pairs(topk_ids, num_experts, block_m)
    upcast = INTERPRET and x.dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong
    precision = _precision(x.dtype)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = CONFIG
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](x, gate_up, h, sorted_pairs, block_expert, pairs, hidden, inter,
                          x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
                          TOP_K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          UPCAST=upcast, PRECISION=precision, num_warps=warps, num_stages=stages)
    grid = (block_expert.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](h, down, topk_weights.reshape(-1).contiguous(), y, sorted_pairs, block_expert, pairs,
                       inter, hidden, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       UPCAST=upcast, PRECISION=precision, num_warps=warps, num_stages=stages)
    # The k weighted rows of a token, added in order in fp32 and rounded once.
    return y.view(t, k, hidden).float().sum(1).to(x.dtype)


class FusedExperts:
    """`ops.make_experts` on the Triton backend: the stacked weights as they are."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up.contiguous(), down.contiguous()

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up, self.down, topk_weights, topk_ids)


def make_experts(gate_up: torch.Tensor, down: torch.Tensor) -> FusedExperts:
    """`ops.make_experts` on the Triton backend."""
    return FusedExperts(gate_up, down)
