"""GGUF blocks on the Triton backend (kernels/triton_gguf.py) against the float GEMM of the same
blocks dequantized, every format, under the Triton interpreter where there is no GPU; and a real
GGUF's layer (SmolLM2's Q4_1 QKV) served by it when the Triton backend is forced."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rill.kernels import gguf_blocks, ops, triton_gguf  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
FORMATS = sorted(gguf_blocks.SUPPORTED)


def check(got: torch.Tensor, x: torch.Tensor, parts: list[tuple[int, torch.Tensor]], k: int, dtype: torch.dtype,
          bias: torch.Tensor | None, out_tol: float = 0.0) -> None:
    """Against the float model's layer (the weights dequantized, rounded to `dtype`), in float64: the
    fp32 sums' rounding (2e-6 of the sum of |products|) plus `out_tol` of the output's rounding."""
    w = torch.cat([gguf_blocks.dequantize(raw, q, k) for q, raw in parts]).to(dtype).double()
    xd = x.to(dtype).double()
    want = xd @ w.T + (bias.double() if bias is not None else 0)
    bound = 2e-6 * (xd.abs() @ w.abs().T) + out_tol * want.abs() + 1e-7
    assert ((got.cpu().double() - want).abs() <= bound).all(), (got.cpu().double() - want).abs().max()


@pytest.mark.parametrize("qtype", FORMATS, ids=[gguf_blocks.name(q) for q in FORMATS])
@pytest.mark.parametrize("m", [1, 19])
def test_triton_gemm_matches_the_dequantized_float_gemm(qtype: int, m: int) -> None:
    """Both code layouts (4-bit two to a byte where k is a multiple of 64, else one a byte), groups
    of 16 and 32, rows and columns that fill no last tile."""
    elements = gguf_blocks.FORMATS[qtype].elements
    for k in sorted({elements * 2, 32 * 3} if elements == 32 else {256}):
        raw = gguf_blocks.random_blocks(qtype, 37, k, seed=k)
        lin = triton_gguf.QuantLinear([(qtype, raw)], k, None, torch.float32, DEVICE)
        assert lin.parts[0].packed4 == (gguf_blocks.affine(raw, qtype, k).bits <= 4 and k % 64 == 0)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        check(lin.float_out(x.to(DEVICE)), x, [(qtype, raw)], k, torch.float32, None)


def test_stacked_parts_bias_and_16_bit_activations() -> None:
    """A fused layer of two formats (as Gemma 3's QKV is) with a bias, in fp16: the weights rounded to
    fp16 as the float model's are, the sums in fp32, the output in fp16."""
    k = 128
    parts = [(gguf_blocks.Q5_0, gguf_blocks.random_blocks(gguf_blocks.Q5_0, 40, k, seed=1)),
             (gguf_blocks.Q8_0, gguf_blocks.random_blocks(gguf_blocks.Q8_0, 24, k, seed=2))]
    bias = torch.randn(64)
    lin = triton_gguf.QuantLinear(parts, k, bias, torch.float16, DEVICE)
    x = torch.randn(5, k).to(torch.float16)
    got = lin(x.to(DEVICE))
    assert got.dtype == torch.float16 and got.shape == (5, 64)
    check(got, x, parts, k, torch.float16, bias, out_tol=2 ** -11)
    assert lin.nbytes < 64 * k * 2  # smaller than the fp16 weight


def test_a_real_gguf_layer_is_served_by_the_triton_gemm_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's first QKV (three Q4_1 tensors, q and k rows in llama.cpp's order) through
    GGUFSource on the Triton backend: the Triton layer, the float layer's outputs."""
    from rill.services.worker.gguf_weights import GGUFSource
    from rill.services.worker.llama_weights import Checkpoint
    from rill.shared.config import ModelConfig
    from rill.shared.model_files import resolve_model

    try:
        model_dir = resolve_model(None)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no default model here: {e}")
    cfg = ModelConfig.from_dir(model_dir)
    try:
        source = GGUFSource.of(model_dir, cfg)
    except ValueError:
        pytest.skip("the default model was not converted from a GGUF")
    ckpt = Checkpoint(model_dir)
    p = "model.layers.0.self_attn."
    weight = torch.cat([ckpt.get(p + f"{n}_proj.weight") for n in "qkv"]).float().to(DEVICE)
    ops.set_backend("triton")
    try:
        lin = source.linear(["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"], weight, None)
        assert isinstance(lin, triton_gguf.QuantLinear)
        x = torch.randn(3, weight.shape[1], device=DEVICE)
        torch.testing.assert_close(lin(x), x @ weight.T, rtol=1e-4, atol=1e-4)
    finally:
        ops.set_backend(None)
