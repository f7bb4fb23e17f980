"""Whether a row's bits depend on what shares its step, said once at start.

By default, decode steps of up to some size give each row the same bits whatever else they hold
(verify rows of speculative and predicted drafts included, so they accept what decoding would
give) where the native layer driver serves them all with the same kernels: its GEMMs on the GGUF
blocks (pinned there up to the size where that was measured cheap, cpu_tuning.settle_decode_rows)
and each row attending as one decode token. decode_rows_agree says up to which size, and what
changes beyond.

RILL_BATCH_INVARIANT=1 pins every GGUF layer whose format the native library serves to its blocks
(kernels/gguf_linear.py) and every attention row to the native decode kernel
(kernels/torch_attention.py), prompt rows included. Anything else keeps a kernel chosen by the
step's shape, so a greedy request's text may still depend on what shares its steps: a float layer
(its GEMM is the measured choice per batch size), a GGUF layer in a format the library does not
serve (dequantized at load: a float layer), attention where the native decode kernel cannot run,
and the GPU kernels; invariance_gaps names them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from rill.kernels import chooser, cpu_native, gguf_blocks
from rill.kernels.gguf_linear import QuantLinear
from rill.services.worker.decode_layers import driver_linears, why_not
from rill.shared import envs

if TYPE_CHECKING:
    from rill.services.worker.llama import LlamaModel

log = logging.getLogger("rill.worker")


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


def agreeing_rows(model: LlamaModel, device: str, say: bool) -> int:
    """What the worker announces (WorkerReady.agreeing_rows): decode_rows_agree's size, 0 under
    RILL_BATCH_INVARIANT (every size agrees: no bound); said once at start where `say`."""
    if envs.RILL_BATCH_INVARIANT:
        return 0
    rows, gaps = decode_rows_agree(model, device)
    if say:
        agreed = (f"up to {rows} rows a row's bits do not depend on the step's size (drafts verified there "
                  "accept what decoding gives)" if rows else "a row's bits depend on the step's size")
        changed = f"; {'beyond, ' if rows else ''}{' and '.join(gaps)} change with it" if gaps else ""
        log.info("decode steps: %s%s%s", agreed, changed, " (RILL_BATCH_INVARIANT=1 pins them)" if gaps else "")
    return rows


def decode_rows_agree(model: LlamaModel, device: str) -> tuple[int, list[str]]:
    """(the most rows of a decode step up to which a row's bits do not depend on the step's size,
    0 for none; what changes beyond, empty where nothing does up to chooser.DECODE_ROWS)."""
    if device != "cpu":
        return 0, [f"the {device} kernels"]
    if (reason := why_not(model)) is not None:
        return 0, [f"the native layer driver is off ({reason})"]
    first, head = _driver_kernels(model, 1), _head_kernels(model.lm_head, 1)
    if first is None:
        return 0, ["the kernels of linear layers or SiLU the native layer driver has not at 1 row"]
    agree = 1
    for m in chooser.DECODE_BUCKETS[1:]:
        gemms, gaps = _driver_kernels(model, m), []
        if gemms is None:
            gaps.append(f"the kernels of linear layers or SiLU the native layer driver has not at {m} rows")
        elif shifting := sum(k != k1 for k, k1 in zip(gemms, first, strict=True)):
            gaps.append(f"the GEMM kernel of {shifting} of {len(first)} linear layers")
        if _head_kernels(model.lm_head, m) != head:
            gaps.append("the LM head's GEMM kernel")
        if gaps:
            return agree, gaps
        agree = m
    return agree, []


def _driver_kernels(model: LlamaModel, m: int) -> list[tuple[tuple[int, int], ...]] | None:
    """(kind, weight address) of each part of each linear layer as the native driver serves m rows
    (None: it does not serve m rows)."""
    linears = driver_linears(model, m)
    return None if linears is None else [tuple((kind, w.data_ptr()) for kind, _, _, w in parts)
                                         for row in linears for parts in row]


def _head_kernels(head: Any, m: int) -> tuple[str, ...]:
    """The LM head's route per part at m logit rows (it runs after the driver, op by op)."""
    if isinstance(head, QuantLinear):
        return tuple(p.route.pick(m) if p.blocks_held else "float" for p in head.parts)
    route = getattr(head, "route", None)
    return (route.pick(m),) if route is not None else ()
