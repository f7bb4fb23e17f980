"""A mixture-of-experts MLP block: its weights as read from either checkpoint layout, and its forward.

The router is an ordinary linear layer over the MLP's input; the experts are stacked into
`gate_up` [E, 2F, H] and `down` [E, H, F] and prepared by ops.make_experts, whether the
checkpoint stores one tensor per expert (the hub's layout) or the fused 3-D tensors transformers
keeps in memory (families.Experts names both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rill.kernels import ops
from rill.kernels.moe import route
from rill.services.worker import families


class TensorSource(Protocol):
    def get(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: str) -> bool: ...


@dataclass
class SparseMoe:
    """One layer's sparse MLP: x [T, H] -> sum of its top-k experts' outputs, routing-weighted."""

    router: Callable[[torch.Tensor], torch.Tensor]  # x -> logits [T, E]
    experts: Callable[..., torch.Tensor]  # ops.make_experts: (x, weights, ids) -> [T, H]
    top_k: int
    renormalise: bool
    # Qwen3-MoE rounds the routing weights to the model dtype before scaling; Mixtral keeps fp32.
    round_weights: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, self.renormalise,
                             x.dtype if self.round_weights else None)
        return self.experts(x, weights, ids)


def read_sparse_moe(ckpt: TensorSource, i: int, raw: dict[str, Any], fam: families.Family,
                    put: Callable[[torch.Tensor], torch.Tensor]) -> SparseMoe:
    """Layer i's router and experts from the checkpoint, stacked and moved by `put` (dtype, device)."""
    spec = fam.experts
    assert spec is not None
    fused = families.fused_expert_names(i)
    if fused[1] in ckpt:
        router_name = fused[0]
        gate_up, down = put(ckpt.get(fused[1])), put(ckpt.get(fused[2]))
    else:
        router_name, *names = spec.expert_names(i, families.num_experts(raw))
        per_expert = [names[j:j + 3] for j in range(0, len(names), 3)]  # (gate, up, down) of each expert
        gate_up = put(torch.stack([torch.cat([ckpt.get(g), ckpt.get(u)]) for g, u, _ in per_expert]))
        down = put(torch.stack([ckpt.get(d) for _, _, d in per_expert]))
    return SparseMoe(router=ops.make_linear(put(ckpt.get(router_name))), experts=ops.make_experts(gate_up, down),
                     top_k=int(raw["num_experts_per_tok"]), renormalise=families.renormalises(raw, fam),
                     round_weights=spec.round_weights)
