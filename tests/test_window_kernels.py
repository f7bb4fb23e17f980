"""Sliding-window attention in every kernel path: a query at p sees keys p - window + 1 .. p
(transformers' `kv_idx > q_idx - sliding_window`), and no path reads a table entry wholly before
its window (the scheduler may have released that block). Cases poison (NaN) the block every
such entry points at, so a read of one shows. The Triton kernels run under the interpreter here
(TRITON_INTERPRET=1, set before import). Models with windows: tests/test_sliding_window.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_case import PagedCase, close  # noqa: E402

from rill.kernels import cpu_native, ops, torch_attention  # noqa: E402

WINDOW = 10
BS = 4
KERNEL_TOL = {torch.float32: (5e-5, 5e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
# (cached prefix, new tokens): a fresh prompt longer than the window, a chunk after a prefix,
# decodes before, at and far past the window (mid-block and on a block edge), a short prompt.
STEP = [(0, 23), (13, 14), (3, 1), (9, 1), (WINDOW, 1), (30, 1), (2 * WINDOW + 3, 1), (0, 5)]


def windowed_case(dtype: torch.dtype, head_dim: int, group: int, seed: int, device: str = "cpu") -> PagedCase:
    seq_lens = [c + n for c, n in STEP]
    case = PagedCase(seq_lens, [n for _, n in STEP], BS, 2, group, head_dim, dtype, seed=seed, device=device)
    case.release_before_window(WINDOW)
    return case


def step_meta(case: PagedCase):
    blocks = [[int(b) for b in row[: -(-n // BS)]] for row, n in zip(case.tables.cpu(), case.seq_lens, strict=True)]
    return ops.make_attention_metadata(blocks, [c for c, _ in STEP], [n for _, n in STEP], BS, "cpu")[1]


# ------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 3)])
def test_native_kernels_mask_the_window(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int,
                                        group: int) -> None:
    """Decode rows (register path where the CPU has AVX-512, and the generic loop) and prompt
    chunks (every prefill kernel this CPU has) in one step, against the float64 reference."""
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "1")
    if cpu_native.library() is None:
        pytest.fail("the native kernels did not build on this machine")
    case = windowed_case(dtype, head_dim, group, seed=head_dim + group)
    want = case.reference(WINDOW)
    prefills = ["vector"] + (["dot"] if dtype == torch.bfloat16 and cpu_native.dot_prefill_available() else [])
    for prefill in prefills:
        for decode in ("native", "generic"):
            meta = step_meta(case)
            plan = torch_attention._AttentionPlan(meta, case.heads, 2, BS, torch.device("cpu"), decode, prefill,
                                            window=WINDOW)
            assert plan.native is not None and plan.native_prefill is not None
            close(torch_attention.attend(plan, case.q, case.k_cache, case.v_cache, case.scale), want, *KERNEL_TOL[dtype])
    # Through the interface the model calls: a plan of its own for the window.
    meta = step_meta(case)
    close(ops.paged_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, window=WINDOW), want,
          *KERNEL_TOL[dtype])
    assert ("torch_plan", WINDOW) in meta.aux and "torch_plan" not in meta.aux


def test_torch_path_masks_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain-torch path (no native kernels): decode groups gather from each row's window on,
    prompt chunks run SDPA over their window's keys only."""
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "0")
    case = windowed_case(torch.float32, 64, 2, seed=5)
    # This path reads slots past a row's end in its last block (and masks them): numbers, not NaN.
    case.k_cache, case.v_cache = torch.nan_to_num(case.k_cache, nan=0.5), torch.nan_to_num(case.v_cache, nan=0.5)
    meta = step_meta(case)
    out = torch_attention.paged_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, window=WINDOW)
    plan = meta.aux[("torch_plan", WINDOW)]
    assert plan.native is None and plan.decode_groups and plan.prefills
    close(out, case.reference(WINDOW), 2e-5, 2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_kernels_mask_the_window(dtype: torch.dtype) -> None:
    """The split-K decode kernel (one split, and splits of which some fall wholly before the
    window) and the extend kernel over a mixed step."""
    from rill.kernels.triton_attention import decode_attention, extend_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [1, WINDOW - 1, WINDOW, WINDOW + 1, 37]
    case = PagedCase(lens, [1] * len(lens), BS, 2, 2, 32, dtype, seed=3, device=device)
    case.release_before_window(WINDOW)
    want = case.reference(WINDOW)
    for splits in (1, 3):
        out = decode_attention(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, case.scale,
                               max(lens), num_splits=splits, out=case.poisoned_out(), window=WINDOW)
        close(out, want, *KERNEL_TOL[dtype])
    case = windowed_case(dtype, 32, 2, seed=4, device=device)
    out = extend_attention(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, case.qsl, case.scale,
                           max(n for _, n in STEP), out=case.poisoned_out(), window=WINDOW)
    close(out, case.reference(WINDOW), *KERNEL_TOL[dtype])
