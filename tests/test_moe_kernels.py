"""The mixture-of-experts kernels: the Triton fused grouped GEMMs (under the interpreter without a
GPU) and the torch grouped path, each against every expert run densely on every token."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rill.kernels import moe, ops, triton_moe  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
# (atol, rtol) against the fp32 dense reference: the paths round each GEMM and silu(gate) * up
# to the model dtype, the reference does not.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (4e-2, 3e-2)}


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
          used: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, gate_up, down and routing (weights from a real softmax top-k, renormalised) where only
    the first `used` experts receive tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    logits = torch.randn(tokens, experts, generator=g)
    if used is not None:
        logits[:, used:] = float("-inf")
    weights, ids = moe.route(logits, top_k, renormalise=True)
    return *(t.to(dtype).to(DEVICE) for t in (x, gate_up, down)), weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,used,block_m", [
    (1, 64, 32, 8, 2, None, None),  # one decode row: 2 of 8 experts, 6 blocks empty
    (37, 72, 40, 4, 2, 3, 16),  # several blocks per expert, partial tiles, an expert with no tokens
    (9, 32, 48, 6, 3, None, 16),  # top-3
])
def test_fused_moe_matches_grouped_and_dense(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                                             used: int | None, block_m: int | None, dtype: torch.dtype) -> None:
    x, gate_up, down, weights, ids = _case(tokens, hidden, inter, experts, top_k, dtype, used)
    want = moe.dense_reference(x, gate_up, down, weights, ids)
    atol, rtol = TOL[dtype]
    fused = triton_moe.fused_experts(x, gate_up, down, weights, ids, block_m=block_m)
    try:
        ops.set_backend("torch")
        grouped = ops.make_experts(gate_up.cpu(), down.cpu())(x.cpu(), weights.cpu(), ids.cpu())
    finally:
        ops.set_backend(None)
    for got in (fused, grouped):
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=atol * want.abs().max().item(), rtol=rtol)


def test_align_pairs_pads_each_expert_to_whole_blocks() -> None:
    """Each expert's pairs, in token order, fill ceil(count / block_m) whole blocks of its own;
    padding only ends a group; the blocks past the last group are unused (-1)."""
    block_m, experts = 4, 5
    ids = torch.randint(0, experts - 1, (11, 2), generator=torch.Generator().manual_seed(3))  # expert 4 unused
    sorted_pairs, block_expert = triton_moe.align_pairs(ids, experts, block_m)
    pad, flat = ids.numel(), ids.reshape(-1)
    blocks, owners = sorted_pairs.view(-1, block_m).tolist(), block_expert.tolist()
    used = 0
    for e in range(experts):
        mine = [i for i in range(pad) if flat[i] == e]
        n = -(-len(mine) // block_m)
        assert owners[used:used + n] == [e] * n
        rows = [p for b in blocks[used:used + n] for p in b]
        assert rows == mine + [pad] * (n * block_m - len(mine))
        used += n
    assert set(owners[used:]) <= {-1} and all(p == pad for b in blocks[used:] for p in b)
    assert len(owners) * block_m >= pad + experts * (block_m - 1)  # sized for the worst routing


def test_ops_dispatches_moe_to_triton_when_forced() -> None:
    x, gate_up, down, weights, ids = _case(5, 32, 32, 4, 2, torch.float32)
    try:
        ops.set_backend("triton")
        experts = ops.make_experts(gate_up, down)
        got = experts(x, weights, ids)
    finally:
        ops.set_backend(None)
    assert isinstance(experts, triton_moe.FusedExperts) and ops.uses_triton(x) is CUDA  # back to auto
    torch.testing.assert_close(got, triton_moe.fused_experts(x, gate_up, down, weights, ids))
