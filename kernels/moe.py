"""Mixture-of-experts math shared by every backend: top-k routing, the per-expert ordering of
token-expert pairs, and the torch path that runs the experts as grouped GEMMs (CPU).

The experts are SwiGLU MLPs stored stacked: `gate_up` [E, 2F, H] (gate rows first, then up, as
transformers keeps them in memory) and `down` [E, H, F]. A step of T tokens routed to k experts
each has T * k token-expert pairs, pair p = t * k + j being token t's j-th choice.

The grouped path sorts the pairs by expert so that each expert's tokens are one contiguous
segment, runs one GEMM pair per expert that has tokens, scales each row by its routing weight and
scatter-adds the rows back onto their tokens. Rounding follows transformers' eager experts: each
GEMM and silu(gate) * up round to the model dtype, the weighted row rounds once more before the add.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool,
          weight_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] int64) from router logits [T, E]: softmax in fp32 over
    all experts, the k largest, rescaled to sum to 1 when `renormalise`, then cast to
    `weight_dtype` (Qwen3-MoE rounds them to the model dtype; Mixtral keeps fp32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weight_dtype is None else weights.to(weight_dtype)), ids


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert [E] int64, without a device-to-host sync (torch.bincount on CUDA reads
    the largest id back to size its output; scatter_add into a fixed size does not)."""
    flat = expert_ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H] -> [T, H], one GEMM pair per expert
    with tokens. `act` maps [n, 2F] (gate | up) to [n, F] (silu_and_mul)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
    token_of = order // k
    # One host read per layer: the segment bounds steer the Python loop below.
    counts = expert_counts(flat, gate_up.shape[0]).tolist()
    xs = x.index_select(0, token_of)
    ys = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = slice(start, start + n)
            ys[seg] = F.linear(act(F.linear(xs[seg], gate_up[e])), down[e])
            start += n
    weighted = (ys * topk_weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, weighted)


def dense_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token in fp32, weighted by its routing weight (zero where not
    chosen): the plainest statement of what the grouped paths compute (tests only)."""
    e, f2, _ = gate_up.shape
    xf = x.float()
    gu = torch.einsum("th,efh->etf", xf, gate_up.float())
    h = F.silu(gu[..., :f2 // 2]) * gu[..., f2 // 2:]
    y = torch.einsum("etf,ehf->eth", h, down.float())  # [E, T, H]
    dense_w = torch.zeros(x.shape[0], e, dtype=torch.float32, device=x.device)
    dense_w.scatter_(1, topk_ids, topk_weights.float())
    return torch.einsum("te,eth->th", dense_w, y)
