"""GGUF blocks on the Triton backend: a GEMM that forms each weight tile from its codes in registers.

The CPU kernels read ggml's blocks as they are (cpu_gguf.c); here each part is unpacked once, at
load, into gguf_blocks.Affine's form: w = scale * (code - offset) + zero per group of 16 or 32
weights. Codes of 4 bits or fewer stay two to a byte (byte i of each 64 columns holds column i in
its low nibble and column 32 + i in its high one, so a 32-column tile is one shift), wider ones
take a byte; scale and zero are fp32 (a K format's scale is a product of two fields that fp16
cannot hold exactly). The kernel walks K 32 columns at a time: it loads the activation tile and
the codes with their scales, forms the weights in fp32, rounds them to the activation's dtype (the
float model's weights are rounded the same way) and accumulates tl.dot in fp32.

Weight memory per value: 4-bit formats 0.75 B, 5- to 8-bit ones 1.125-1.25 B, against 2 B for bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rill.kernels import gguf_blocks
from rill.kernels.triton_setup import INTERPRET, prepare_interpreter

prepare_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PACK = 64  # columns sharing bytes when codes are 4-bit: i and 32 + i
# (BLOCK_M for few rows, BLOCK_M, BLOCK_N, num_warps): not yet tuned on a GPU.
CONFIG = (16, 16, 32, 4) if INTERPRET else (16, 64, 64, 4)


@triton.jit
def _gguf_gemm_kernel(x_ptr, code_ptr, scale_ptr, zero_ptr, y_ptr, M, N, K,
                      stride_xm, stride_cn, stride_sn, stride_ym,
                      OFFSET: tl.constexpr, GROUP: tl.constexpr, PACKED4: tl.constexpr, HAS_ZERO: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rm < M, rn < N
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + j)[None, :], mask=in_m[:, None], other=0.0)
        if PACKED4:
            byte = tl.load(code_ptr + rn[:, None] * stride_cn + ((k0 // 64) * 32 + j)[None, :],  # PACK
                           mask=in_n[:, None], other=0)
            code = (byte >> (((k0 // 32) % 2) * 4)) & 15
        else:
            code = tl.load(code_ptr + rn[:, None] * stride_cn + (k0 + j)[None, :], mask=in_n[:, None], other=0)
        if GROUP == 32:
            sc = tl.load(scale_ptr + rn * stride_sn + k0 // 32, mask=in_n, other=0.0)[:, None]
        else:
            sc = tl.load(scale_ptr + rn[:, None] * stride_sn + ((k0 + j) // GROUP)[None, :], mask=in_n[:, None],
                         other=0.0)
        w = sc * (code.to(tl.int32) - OFFSET).to(tl.float32)
        if HAS_ZERO:
            if GROUP == 32:
                w += tl.load(zero_ptr + rn * stride_sn + k0 // 32, mask=in_n, other=0.0)[:, None]
            else:
                w += tl.load(zero_ptr + rn[:, None] * stride_sn + ((k0 + j) // GROUP)[None, :],
                             mask=in_n[:, None], other=0.0)
        w = w.to(x_ptr.dtype.element_ty)  # the float model's weight, rounded to its dtype
        if UPCAST:  # the interpreter's 16-bit dot is wrong: the same rounded values, in fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=in_m[:, None] & in_n[None, :])


@dataclass
class _Part:
    n: int
    qtype: int
    codes: torch.Tensor  # uint8 [n, k] or, packed4, [n, k / 2]
    scale: torch.Tensor  # fp32 [n, k / group]
    zero: torch.Tensor | None
    offset: int
    group: int
    packed4: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)


def pack(raw: torch.Tensor, qtype: int, k: int, device: torch.device | str) -> _Part:
    """One part's raw blocks uint8 [n, row_bytes] as the kernel reads them, on `device` (unpacked there)."""
    a = gguf_blocks.affine(raw.to(device), qtype, k)
    n, codes = raw.shape[0], a.codes
    packed4 = a.bits <= 4 and k % PACK == 0
    if packed4:
        c = codes.reshape(n, k // PACK, 2, 32)
        codes = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)
    return _Part(n, qtype, codes.contiguous(), a.scale.contiguous(),
                 None if a.zero is None else a.zero.contiguous(), a.offset, a.group, packed4)


def gemm(x: torch.Tensor, part: _Part, y: torch.Tensor) -> None:
    """y [m, part.n] fp32 (a column slice may be given) = x [m, k] @ W.T, W the part's weights."""
    m, k = x.shape
    few, block_m, block_n, warps = CONFIG
    bm = few if m <= few else block_m
    grid = (triton.cdiv(m, bm), triton.cdiv(part.n, block_n))
    _gguf_gemm_kernel[grid](
        x, part.codes, part.scale, part.scale if part.zero is None else part.zero, y, m, part.n, k,
        x.stride(0), part.codes.stride(0), part.scale.stride(0), y.stride(0),
        OFFSET=part.offset, GROUP=part.group, PACKED4=part.packed4, HAS_ZERO=part.zero is not None,
        UPCAST=INTERPRET and x.dtype != torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 or INTERPRET else "tf32",
        BLOCK_M=bm, BLOCK_N=block_n, num_warps=warps)


class QuantLinear:
    """The Triton form of gguf_linear.QuantLinear: y = x @ W.T (+ bias), W the parts (qtype, raw
    uint8 [n_i, row_bytes]) stacked along the output, kept as codes and scales on `device`."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], k: int, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device | str, logits: bool = False) -> None:
        if k % 32:
            raise ValueError(f"GGUF weights of {k} columns: the Triton GEMM takes multiples of 32")
        self.in_features = k
        self.dtype = dtype
        self.logits = logits
        self.parts = [pack(raw, qtype, k, device) for qtype, raw in parts]
        self.out_features = sum(p.n for p in self.parts)
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=torch.float32).contiguous()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _forward(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.to(self.dtype).contiguous()
        y = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32, device=x2.device)
        at = 0
        for part in self.parts:
            gemm(x2, part, y[:, at:at + part.n])
            at += part.n
        if self.bias is not None:
            y += self.bias
        return y

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> fp32 [..., out_features] (for logits)."""
        return self._forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., out_features] in x's dtype."""
        y = self._forward(x.reshape(-1, self.in_features)).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)
