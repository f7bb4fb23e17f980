"""A linear layer whose weight stays in the GGUF's block-quantized form (gguf_blocks.py), multiplied
by the native kernel (cpu_gguf.c through gguf_native.py) without dequantizing it.

The weight may be several parts stacked along the output dimension, each in its own format: a
fused QKV projection can have q and k in Q5_0 and v in Q8_0. A part whose format the native
library does not take (or every part, without the library) is dequantized once, here, to a float
weight in the layer's dtype and multiplied by torch; one warning per format says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rill.kernels import gguf_blocks, gguf_native

log = logging.getLogger("rill.kernels")
_warned: set[int] = set()  # formats already reported as falling back, once per process


@dataclass(frozen=True)
class _Part:
    qtype: int
    n: int
    raw: torch.Tensor | None  # the blocks, multiplied natively
    weight: torch.Tensor | None  # or the dequantized weight, multiplied by torch


def _part(qtype: int, raw: torch.Tensor, k: int, dtype: torch.dtype) -> _Part:
    rb = gguf_blocks.row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb:
        raise ValueError(f"{gguf_blocks.name(qtype)} part of {k} columns: want uint8 [n, {rb}], "
                         f"got {raw.dtype} {list(raw.shape)}")
    if gguf_native.format_supported(qtype):
        return _Part(qtype, raw.shape[0], raw.contiguous(), None)
    if qtype not in _warned:
        _warned.add(qtype)
        log.warning("GGUF %s weights: no native quantized GEMM here; dequantized to %s at load",
                    gguf_blocks.name(qtype), dtype)
    return _Part(qtype, raw.shape[0], None, gguf_blocks.dequantize(raw, qtype, k).to(dtype))


class QuantLinear:
    """y = x @ W.T (+ bias), W [sum n_i, k] the parts (qtype, raw uint8 [n_i, row_bytes]) stacked."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], k: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        if not parts:
            raise ValueError("a QuantLinear needs at least one weight part")
        self.in_features = k
        self.dtype = dtype
        self._parts = [_part(qtype, raw, k, dtype) for qtype, raw in parts]
        self.out_features = sum(p.n for p in self._parts)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of {list(bias.shape)} for {self.out_features} outputs")
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.nbytes = sum(p.raw.nbytes if p.raw is not None else p.weight.nbytes for p in self._parts)
        self._native = all(p.raw is not None for p in self._parts)

    def _run(self, x: torch.Tensor, part: _Part, bias: torch.Tensor | None) -> torch.Tensor:
        if part.raw is not None:
            return gguf_native.gemm(x, part.raw, part.qtype, part.n, self.in_features, bias)
        y = F.linear(x.to(part.weight.dtype), part.weight).float()
        return y if bias is None else y + bias

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> fp32 [..., out_features] (the sums as they are: for logits)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._native:  # the native kernel reads fp32 rows
            x2 = x2.to(torch.float32).contiguous()
        if len(self._parts) == 1:
            y = self._run(x2, self._parts[0], self.bias)
        else:
            y = torch.cat([self._run(x2, p, None) for p in self._parts], dim=1)
            if self.bias is not None:
                y += self.bias
        return y.reshape(*lead, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., out_features] in x's dtype."""
        return self.float_out(x).to(x.dtype)
