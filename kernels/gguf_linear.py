"""A linear layer whose weight stays in the GGUF's block-quantized form (gguf_blocks.py).

Three routes multiply it, chosen per part and per call by the number of rows m (the kernel
chooser's "gguf_gemm" op, measured per part shape, format and row bucket on the serving
machine; see cpu_tuning.tune_gguf):
- "blocks": the native integer-dot GEMM on the blocks (cpu_gguf.c), for decode: few rows are bound
  by how fast the weight streams from memory, and the blocks are 3.5-7x smaller than bf16.
- "dequant": a tile of weight rows (TILE_ELEMS values) at a time is dequantized
  (cpu_gguf_dequant.c) into a reused scratch buffer and multiplied by torch's GEMM in the
  layer's dtype (fp32 or bf16) into a slice of the output, for prompt chunks and batched
  decode: the blocks route unpacks every weight block again for each 4 activation rows.
- "float": the part dequantized once, when the layer is built, into the layer's dtype and served
  by the float model's own layer (torch_ops.Linear: pre-packed oneDNN, the native small GEMM, per
  its "gemm" entries of the table). It costs a float copy of the weight (float_copy_bytes), kept
  only when some row bucket of the part chose "float", and is as fast as the float model, which
  the other two routes are not from a few rows up (scripts/benchmarks.md, GGUF blocks).
Unmeasured, a part takes "blocks" up to BLOCKS_ROWS (4) rows and "float" above.

The weight may be several parts stacked along the output dimension, each in its own format: a
fused QKV projection can have q and k in Q5_0 and v in Q8_0. A part whose format the native
library does not take (or every part, without the library) is served by "float" alone (its blocks
are not kept); one warning per format says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rill.kernels import chooser, gguf_blocks, gguf_native, torch_ops
from rill.shared import envs

log = logging.getLogger("rill.kernels")
_warned: set[int] = set()  # formats already reported as falling back, once per process

OP = "gguf_gemm"
ROUTES = ("blocks", "dequant", "float")
# The unmeasured choice: "blocks" up to this many rows (decode, bound by the weight's bytes),
# "float" above (compute-bound: the float GEMMs win there; scripts/benchmarks.md), except for the
# formats the x16 GEMM serves, which keep "blocks" everywhere: it measured faster than a bf16 copy
# from 1 to 256 rows, and a float copy costs 3-7x the blocks' memory, so it must win by the margin.
BLOCKS_ROWS = 4
# Weight values dequantized per torch GEMM: small tiles pay per-call and fork/join costs, a whole
# large weight would need hundreds of MB of scratch; this is 512 rows at k = 2048.
TILE_ELEMS = 1 << 20
_scratch: dict[torch.dtype, torch.Tensor] = {}  # one tile buffer per dtype, shared by every layer
# Bumped by every `force`: whoever keeps a description of the routes (decode_layers.py) rebuilds it.
route_changes = 0


def mm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the dequant route multiplies in: the layer's where the dequantizer writes it."""
    return dtype if dtype in gguf_native.DEQUANT_DTYPES else torch.float32


def gguf_key(n: int, k: int, qtype: int, dtype: torch.dtype, logits: bool = False) -> tuple[object, ...]:
    """A part's key in the kernel table: out x in features, format, layer dtype, and whether it makes logits."""
    return (n, k, gguf_blocks.name(qtype), str(mm_dtype(dtype)).removeprefix("torch."),
            *(("logits",) if logits else ()))


def incumbent(bucket: int, qtype: int) -> str:
    return "blocks" if bucket <= BLOCKS_ROWS or gguf_native.x16_supported(qtype) else "float"


def installed_route(n: int, k: int, qtype: int, dtype: torch.dtype, logits: bool = False) -> chooser.Route:
    """The installed table's route for a part of this shape, the incumbents where it has none;
    "blocks" at every size under RILL_BATCH_INVARIANT: both blocks GEMMs (x16 and row by row) give
    each row the same bits whatever rows share the call, the routes round differently. Only parts
    of a format the native library serves get here (_part)."""
    buckets = chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS
    if envs.RILL_BATCH_INVARIANT:
        return chooser.Route(tuple(buckets), ("blocks",) * len(buckets))
    return chooser.installed().route(OP, gguf_key(n, k, qtype, dtype, logits), buckets,
                                     [incumbent(b, qtype) for b in buckets])


def _tile(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [rows, k] view of the shared scratch buffer, grown when too small. Safe to
    reuse across layers: a CPU GEMM has finished reading it when torch.mm returns."""
    buf = _scratch.get(dtype)
    if buf is None or buf.numel() < rows * k:
        buf = _scratch[dtype] = torch.empty(rows * k, dtype=dtype)
    return buf[:rows * k].view(rows, k)


@dataclass
class BlockPart:
    qtype: int
    n: int
    raw: torch.Tensor | None  # the blocks row by row; None when packed holds them, or a part served by "float" only
    route: chooser.Route  # which route serves m rows
    lin: torch_ops.Linear | None = None  # the float copy, kept while the route uses "float"
    packed: torch.Tensor | None = None  # the blocks repacked 16 rows at a time, where the build has that GEMM

    @property
    def blocks_held(self) -> bool:
        """Whether the part keeps its blocks (routes "blocks" and "dequant" can serve it)."""
        return self.raw is not None or self.packed is not None

    @property
    def has_rows(self) -> bool:
        """Whether the blocks row by row can be had (kept, or unpacked from the x16 copy)."""
        return self.raw is not None or (self.packed is not None and self.qtype not in gguf_blocks.X16_KEEPS_ROWS)

    def rows(self, k: int) -> torch.Tensor:
        """The blocks row by row (unpacked from the x16 copy where that is what is kept)."""
        if self.raw is not None:
            return self.raw
        if not self.has_rows:
            raise ValueError(f"{gguf_blocks.name(self.qtype)} blocks kept repacked only (this layer was "
                             "built for the blocks route alone): no rows for another route")
        assert self.packed is not None
        return gguf_blocks.unpack_x16(self.packed, self.qtype, self.n, k)

    def dequantized(self, r0: int, r1: int, k: int, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
        """Rows r0:r1 of the weight dequantized into `out` [r1 - r0, k]: straight from the x16 copy
        where that is what is kept (unpacking it to rows first cost more than the dequantizing)."""
        if self.raw is None and self.has_rows:
            assert self.packed is not None
            return gguf_native.dequantize_x16_rows(self.packed, self.qtype, self.n, k, torch.arange(r0, r1), dtype, out)
        return gguf_native.dequantize(self.rows(k)[r0:r1], self.qtype, k, dtype, out)

    def select(self, ids: torch.Tensor, k: int) -> torch.Tensor:
        """Rows `ids` of the blocks (an embedding lookup sharing a tied head's blocks)."""
        if self.raw is not None or not self.has_rows:
            return self.rows(k).index_select(0, ids)
        assert self.packed is not None
        return gguf_blocks.select_x16(self.packed, self.qtype, k, ids)

    def blocks_mm(self, x32: torch.Tensor, k: int, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The "blocks" route: x32 [m, k] fp32 @ W.T -> fp32, on the repacked copy where there is one
        (which writes `out_dtype`, fp32 or bf16, itself)."""
        if self.packed is not None:
            return gguf_native.gemm_x16(x32, self.packed, self.qtype, self.n, k, bias, out_dtype)
        assert self.raw is not None
        return gguf_native.gemm(x32, self.raw, self.qtype, self.n, k, bias)


def _float_linear(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype, logits: bool,
                  route: chooser.Route | None = None) -> torch_ops.Linear:
    """The part dequantized into `dtype`, as the float model's layer (which keeps its own copies:
    given the part's `route`, only those the row buckets routed to "float" use)."""
    if gguf_native.dequant_supported(qtype):
        w = gguf_native.dequantize(raw, qtype, k, mm_dtype(dtype)).to(dtype)
    else:
        w = gguf_blocks.dequantize(raw, qtype, k).to(dtype)
    return torch_ops.Linear(w, None, logits, None if route is None else route.buckets_of("float"))


def _part(qtype: int, raw: torch.Tensor, k: int, dtype: torch.dtype, logits: bool, keep_rows: bool) -> BlockPart:
    rb = gguf_blocks.row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb:
        raise ValueError(f"{gguf_blocks.name(qtype)} part of {k} columns: want uint8 [n, {rb}], "
                         f"got {raw.dtype} {list(raw.shape)}")
    n = raw.shape[0]
    if gguf_native.format_supported(qtype) and gguf_native.dequant_supported(qtype):
        raw = raw.contiguous()
        route = installed_route(n, k, qtype, dtype, logits)
        # The blocks stay even where every bucket chose "float" (a CPU where oneDNN wins from one
        # row): force() and the probes switch routes on a built layer, which needs them.
        # Where the build has the x16 GEMM, the repacked copy replaces the rows (rows() restores them;
        # not Q4_K's: its repacked scales are products the rows cannot be rebuilt from).
        packed = gguf_blocks.pack_x16(raw, qtype, k) if gguf_native.x16_supported(qtype) else None  # None: rows
        lin = _float_linear(raw, qtype, k, dtype, logits, route) if route.uses("float") else None
        # Q4_K's rows stay beside its repacked copy only where a route other than blocks reads them.
        keep_rows = keep_rows or packed is None or (qtype in gguf_blocks.X16_KEEPS_ROWS and set(route.choices) != {"blocks"})
        return BlockPart(qtype, n, raw if keep_rows else None, route, lin, packed)
    if qtype not in _warned:
        _warned.add(qtype)
        log.warning("GGUF %s weights: no native quantized GEMM here; dequantized to %s at load",
                    gguf_blocks.name(qtype), dtype)
    buckets = chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS
    return BlockPart(qtype, n, None, chooser.Route(buckets, ("float",) * len(buckets)),
                 _float_linear(raw, qtype, k, dtype, logits))


class QuantLinear:
    """y = x @ W.T (+ bias), W [sum n_i, k] the parts (qtype, raw uint8 [n_i, row_bytes]) stacked.
    `logits`: the LM head (called through float_out; its routes use the logit row buckets).
    `keep_rows`: every part keeps rows for every route (a layer `force` will switch: the probes)."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], k: int, bias: torch.Tensor | None,
                 dtype: torch.dtype, logits: bool = False, keep_rows: bool = False) -> None:
        if not parts:
            raise ValueError("a QuantLinear needs at least one weight part")
        self.in_features = k
        self.dtype = dtype
        self.logits = logits
        self.mm_dtype = mm_dtype(dtype)
        self._parts = [_part(qtype, raw, k, dtype, logits, keep_rows) for qtype, raw in parts]
        self.out_features = sum(p.n for p in self._parts)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of {list(bias.shape)} for {self.out_features} outputs")
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()

    @property
    def parts(self) -> list[BlockPart]:
        """The stacked parts, in output order (read them; `force` changes their routes)."""
        return self._parts

    @property
    def float_copy_bytes(self) -> int:
        """Bytes of the float copies kept for the "float" route (every copy its Linear holds)."""
        return sum(p.lin.nbytes for p in self._parts if p.lin is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as kept: the blocks plus the float copies."""
        return sum(t.nbytes for p in self._parts for t in (p.raw, p.packed) if t is not None) + self.float_copy_bytes

    @property
    def routes(self) -> list[chooser.Route | None]:
        """Each part's route (None: a part served by "float" alone, its format having no native kernel)."""
        return [p.route if p.blocks_held else None for p in self._parts]

    def force(self, name: str) -> None:
        """Serve every row count by one route: for probes and tests. The float copy is made (built
        as the installed table says) or dropped to match, as if the table had chosen `name`."""
        global route_changes
        assert name in ROUTES
        route_changes += 1
        for p in self._parts:
            if not p.blocks_held:
                continue
            p.route = chooser.Route((1,), (name,))
            if name != "float":
                p.lin = None
            elif p.lin is None or p.lin.rows is not None:  # none, or one built for some buckets only
                p.lin = _float_linear(p.rows(self.in_features), p.qtype, self.in_features, self.dtype, self.logits)

    def _names(self, m: int) -> list[str]:
        return [p.route.pick(m) for p in self._parts]

    def _dequant_mm(self, x: torch.Tensor, part: BlockPart, y: torch.Tensor) -> None:
        """y [m, part.n] (a column slice of the output) = x @ W.T, W dequantized a tile at a time."""
        k = self.in_features
        rows = min(part.n, max(16, TILE_ELEMS // k // 16 * 16))  # whole groups of a repacked weight
        direct = y.dtype == x.dtype
        for r0 in range(0, part.n, rows):
            r1 = min(r0 + rows, part.n)
            w = part.dequantized(r0, r1, k, x.dtype, _tile(r1 - r0, k, x.dtype))
            if direct:
                torch.mm(x, w.t(), out=y[:, r0:r1])  # a strided slice: BLAS writes it in place
            else:
                y[:, r0:r1] = torch.mm(x, w.t())

    @staticmethod
    def _float_mm(part: BlockPart, xf: torch.Tensor, fp32: bool) -> torch.Tensor:
        assert part.lin is not None, "route float without its float copy"
        return part.lin.float_out(xf) if fp32 else part.lin(xf)

    def _forward(self, x2: torch.Tensor, fp32: bool) -> torch.Tensor:
        """x2 [m, k] -> [m, out_features]: in fp32 where `fp32` (logits) or a part takes "blocks",
        else in mm_dtype (the layer's dtype where it is fp32 or bf16)."""
        names = self._names(x2.shape[0])
        x32 = x2.to(torch.float32).contiguous() if "blocks" in names else None  # the native kernel reads fp32
        xf = x2.to(self.dtype).contiguous() if "float" in names else None  # the float copy's dtype
        if names == ["blocks"]:  # a bf16 layer's output rounded by the GEMM (no pass over it after)
            out = torch.bfloat16 if self.dtype == torch.bfloat16 and not fp32 else torch.float32
            return self._parts[0].blocks_mm(x32, self.in_features, self.bias, out)
        if names == ["float"]:
            y = self._float_mm(self._parts[0], xf, fp32)
            if self.bias is not None:
                y += self.bias
            return y
        xd = x2.to(self.mm_dtype).contiguous() if "dequant" in names else None
        out_dtype = torch.float32 if fp32 or "blocks" in names else self.mm_dtype
        y = torch.empty((x2.shape[0], self.out_features), dtype=out_dtype)
        at = 0
        for part, name in zip(self._parts, names, strict=True):
            cols = y[:, at:at + part.n]
            if name == "dequant":
                self._dequant_mm(xd, part, cols)
            elif name == "blocks":
                cols.copy_(part.blocks_mm(x32, self.in_features))
            else:
                cols.copy_(self._float_mm(part, xf, fp32))
            at += part.n
        if self.bias is not None:
            y += self.bias
        return y

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> fp32 [..., out_features] (the sums as they are: for logits)."""
        y = self._forward(x.reshape(-1, self.in_features), True).float()
        return y.reshape(*x.shape[:-1], self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., out_features] in x's dtype."""
        y = self._forward(x.reshape(-1, self.in_features), False).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)
