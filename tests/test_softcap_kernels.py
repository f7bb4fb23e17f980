"""Attention logit soft-capping (Gemma 2: a scaled score s becomes cap * tanh(s / cap) before the
mask and the softmax) in every kernel path, with and without a sliding window, decode rows and
prompt chunks, against the float64 reference. The Triton kernels run under the interpreter here
(TRITON_INTERPRET=1, set before import). The model: tests/test_model_families.py ("gemma2")."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_case import PagedCase, close  # noqa: E402
from test_window_kernels import BS, KERNEL_TOL, STEP, WINDOW, step_meta, windowed_case  # noqa: E402

from rill.kernels import cpu_native, ops, torch_attention  # noqa: E402

CAP = 3.0  # small enough that the cap moves the scores of these cases (asserted below)


def capped_case(dtype: torch.dtype, window: int | None, seed: int, head_dim: int = 64, group: int = 4,
                device: str = "cpu") -> tuple[PagedCase, torch.Tensor]:
    if window:
        case = windowed_case(dtype, head_dim, group, seed, device)
    else:
        case = PagedCase([c + n for c, n in STEP], [n for _, n in STEP], BS, 2, group, head_dim, dtype, seed=seed,
                         device=device)
    want = case.reference(window, CAP)
    assert (want - case.reference(window)).abs().max() > 0.05, "the cap does not change this case"
    return case, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_native_kernels_soft_cap(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, window: int | None) -> None:
    """Decode rows (register path where the CPU has AVX-512, and the generic loop) and prompt
    chunks (every prefill kernel this CPU has) in one step, then through ops.paged_attention."""
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "1")
    if cpu_native.library() is None:
        pytest.fail("the native kernels did not build on this machine")
    case, want = capped_case(dtype, window, seed=11)
    prefills = ["vector"] + [k for k, ok in (("dot", cpu_native.dot_prefill_available()),
                                             ("amx", cpu_native.amx_prefill_available())) if ok and dtype == torch.bfloat16]
    for prefill in prefills:
        for decode in ("native", "generic"):
            plan = torch_attention._AttentionPlan(step_meta(case), case.heads, 2, BS, torch.device("cpu"), decode, prefill,
                                            window=window)
            assert plan.native is not None and plan.native_prefill is not None
            close(torch_attention.attend(plan, case.q, case.k_cache, case.v_cache, case.scale, softcap=CAP), want,
                  *KERNEL_TOL[dtype])
    close(ops.paged_attention(case.q, case.k_cache, case.v_cache, step_meta(case), case.scale, window=window,
                              softcap=CAP), want, *KERNEL_TOL[dtype])


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_torch_path_soft_caps(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """The plain-torch path (no native kernels): decode groups and spelled-out prompt attention."""
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "0")
    case, want = capped_case(torch.float32, window, seed=5, group=2)
    # This path reads slots past a row's end in its last block (and masks them): numbers, not NaN.
    case.k_cache, case.v_cache = torch.nan_to_num(case.k_cache, nan=0.5), torch.nan_to_num(case.v_cache, nan=0.5)
    meta = step_meta(case)
    out = torch_attention.paged_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, window=window, softcap=CAP)
    plan = meta.aux[("torch_plan", window) if window else "torch_plan"]
    assert plan.native is None and plan.decode_groups and plan.prefills
    close(out, want, 2e-5, 2e-5)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_triton_kernels_soft_cap(window: int | None) -> None:
    """The split-K decode kernel (one split and three) and the extend kernel over a mixed step."""
    from rill.kernels.triton_attention import decode_attention, extend_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [1, WINDOW - 1, WINDOW + 1, 37]
    case = PagedCase(lens, [1] * len(lens), BS, 2, 2, 32, torch.float32, seed=3, device=device)
    if window:
        case.release_before_window(window)
    want = case.reference(window, CAP)
    for splits in (1, 3):
        out = decode_attention(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, case.scale,
                               max(lens), num_splits=splits, out=case.poisoned_out(), window=window, softcap=CAP)
        close(out, want, *KERNEL_TOL[torch.float32])
    case, want = capped_case(torch.float32, window, seed=4, head_dim=32, group=2, device=device)
    out = extend_attention(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, case.qsl, case.scale,
                           max(n for _, n in STEP), out=case.poisoned_out(), window=window, softcap=CAP)
    close(out, want, *KERNEL_TOL[torch.float32])
