"""Mixture-of-experts math shared by every backend: top-k routing, the per-expert ordering of
token-expert pairs, and the torch path that runs the experts as grouped GEMMs (CPU).

The experts are SwiGLU MLPs stored stacked: `gate_up` [E, 2F, H] (gate rows first, then up, as
transformers keeps them in memory) and `down` [E, H, F]. A step of T tokens routed to k experts
each has T * k token-expert pairs, pair p = t * k + j being token t's j-th choice.

The grouped path sorts the pairs by expert so that each expert's tokens are one contiguous
segment, runs one GEMM pair per expert that has tokens, scales each row by its routing weight and
adds each token's k rows. Rounding follows transformers' eager experts: each GEMM and
silu(gate) * up round to the model dtype, the weighted row rounds once more; the k rows of a token
are added in fp32 and rounded once (transformers adds them one by one in the model dtype).
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


class GroupedExperts:
    """Stacked SwiGLU experts on the torch path: each expert's two projections prepared once as
    linear layers (`linear`: torch_ops.Linear, which pre-packs CPU weights; GEMMs of a few rows
    against an unpacked weight ran 5-10x slower), called over the expert's gathered tokens."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,
                 linear: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.num_experts = gate_up.shape[0]
        self.gate_up = [linear(w) for w in gate_up.unbind(0)]
        self.down = [linear(w) for w in down.unbind(0)]
        self.act = act  # [n, 2F] (gate | up) -> [n, F]

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H] -> [T, H], one GEMM pair per
        expert with tokens."""
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # segment bounds, on the host
        xs = x.index_select(0, order // k)
        ys = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = slice(start, start + n)
                ys[seg] = self.down[e](self.act(self.gate_up[e](xs[seg])))
                start += n
        ys.mul_(topk_weights.reshape(-1).index_select(0, order)[:, None])  # in fp32 when the weights are
        # Back to pair order (a gather: index_add_ onto repeated token rows is pathologically slow
        # on CPU), then each token's k rows summed.
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return ys.index_select(0, unsort).view(t, k, -1).sum(1)


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
