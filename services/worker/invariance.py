"""What RILL_BATCH_INVARIANT=1 cannot pin for a loaded model, said once at start.

The mode pins every GGUF layer whose format the native library serves to its blocks
(kernels/gguf_linear.py) and every attention row to the native decode kernel
(kernels/torch_attention.py). Anything else keeps a kernel chosen by the step's shape, so a greedy
request's text may still depend on what shares its steps: a float layer (its GEMM is the measured
choice per batch size), a GGUF layer in a format the library does not serve (dequantized at load:
a float layer), attention where the native decode kernel cannot run, and the GPU kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rill.kernels import cpu_native, gguf_blocks
from rill.kernels.gguf_linear import QuantLinear

if TYPE_CHECKING:
    from rill.services.worker.llama import LlamaModel


def invariance_gaps(model: LlamaModel, device: str) -> list[str]:
    """What keeps a step-shaped kernel under RILL_BATCH_INVARIANT=1 (empty: nothing)."""
    if device != "cpu":
        return [f"the {device} kernels (the mode pins CPU kernels only)"]
    linears = [lin for lin in model.linears() if lin is not None]
    floats = sum(not isinstance(lin, QuantLinear) for lin in linears)
    formats = sorted({gguf_blocks.name(p.qtype) for lin in linears if isinstance(lin, QuantLinear)
                      for p in lin.parts if set(p.route.choices) != {"blocks"}})
    gaps = [f"{floats} float linear layers (GEMM kernel chosen per batch size)"] if floats else []
    if formats:
        gaps.append(f"GGUF formats {', '.join(formats)} (no native GEMM for them here: served as float)")
    c = model.cfg
    q = torch.empty(1, c.num_attention_heads, c.head_dim, dtype=model.dtype)
    if not cpu_native.decode_supported(q, torch.empty(1, 16, c.num_key_value_heads, c.head_dim, dtype=model.dtype)):
        gaps.append("attention (no native decode kernel for this model's shape or dtype)")
    return gaps
