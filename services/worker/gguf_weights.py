"""GGUF weights served in the file's own quantization (`--quantization gguf`).

A GGUF is still converted once into a float checkpoint (model_files.py): that gives the config,
the tokenizer, the norms and a reference for every weight. Here each linear layer's raw GGUF blocks
(Q4_1, Q5_0, Q4_K, ...) are read from the file itself and replace the float weight, kept quantized
in memory and multiplied by kernels/gguf_linear.QuantLinear (kernels/triton_gguf.QuantLinear on the
Triton backend: CUDA, opt-in). A block set is used only when it
dequantizes to exactly the converted weight, rows permuted as llama.cpp's converter permuted
them; anything else (a float tensor in the file, an unknown layout) keeps the float weight, so a
mismatch costs memory, never correctness.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from rill.kernels import gguf_blocks, gguf_linear, gguf_native, ops
from rill.kernels.gguf_linear import BlockPart, QuantLinear
from rill.services.worker.memory import held_bytes
from rill.shared import envs
from rill.shared.config import ModelConfig
from rill.shared.gguf_header import read_header
from rill.shared.model_files import converted_from

if TYPE_CHECKING:
    from rill.services.worker.llama import LlamaModel

log = logging.getLogger("rill.worker")

GgufShape = tuple[int, int, int]  # a weight part's (n, k, ggml type), as cpu_tuning.tune_gguf takes it
MakeLinear = Callable[[torch.Tensor, torch.Tensor | None], object]

# A fused linear layer -> the GGUF tensors stacked in it, in order; the first spelling present wins
# (Phi-3 files hold one attn_qkv and a fused gate/up under ffn_up).
_PARTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "qkv": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
    "o": (("attn_output",),),
    "gate_up": (("ffn_gate", "ffn_up"), ("ffn_up",)),
    "down": (("ffn_down",),),
}


def format_runs(qtypes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(format, first, end) of each run of adjacent parts in one format: a run is one GEMM call
    (a fused QKV all in Q4_1 is one call, not three)."""
    runs: list[tuple[int, int, int]] = []
    for i, qtype in enumerate(qtypes):
        if runs and runs[-1][0] == qtype:
            runs[-1] = qtype, runs[-1][1], i + 1
        else:
            runs.append((qtype, i, i + 1))
    return runs


def merge_formats(parts: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """Each run of adjacent parts in one format (format_runs) as one part."""
    return [(q, parts[i][1] if j - i == 1 else torch.cat([b for _, b in parts[i:j]]))
            for q, i, j in format_runs([q for q, _ in parts])]


def blocks_serve(n: int, k: int, qtype: int, dtype: torch.dtype, logits: bool) -> bool:
    """Whether the blocks serve some row count of this part (the measured routes of this machine,
    kernels/gguf_linear.py); else a float copy serves them all and the layer is the float one."""
    if not gguf_native.format_supported(qtype):
        return False
    return any(c != "float" for c in gguf_linear.installed_route(n, k, qtype, dtype, logits).choices)


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (its converter interleaves each
    head's rotary halves; transformers' GGUF reader applies the same reverse)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


@dataclass
class Report:
    """What the load kept, for the start-up log line (each tensor counted once by name: a tied head
    and the embedding read the same one)."""

    formats: Counter = field(default_factory=Counter)
    float_params: dict[str, int] = field(default_factory=dict)  # each quantized tensor, counted as floats
    from_blocks: int = 0  # linear layers the blocks serve (at some row counts at least)
    measured_float: int = 0  # layers whose float copy measured faster at every row count
    kept_float: int = 0  # layers whose blocks the kernels cannot serve

    def add(self, name: str, qtype: int, params: int) -> None:
        if name not in self.float_params:
            self.formats[gguf_blocks.name(qtype)] += 1
        self.float_params[name] = params

    def line(self, held_bytes: int, with_copy: int) -> str:
        kinds = ", ".join(f"{n}x{k}" for k, n in sorted(self.formats.items()))
        mib, params = 2 ** 20, sum(self.float_params.values())
        copies = f" ({with_copy} also from a float copy at the batch sizes it measured faster)" if with_copy else ""
        if envs.RILL_BATCH_INVARIANT:
            copies += " (RILL_BATCH_INVARIANT: on the blocks at every batch size where the format allows)"
        return (f"gguf ({kinds}): {self.from_blocks} linear layers served from their blocks{copies}, "
                f"{self.measured_float} from float copies (faster on this CPU at every batch size), "
                f"{self.kept_float} float (blocks not servable); weights held {held_bytes / mib:.0f} MiB "
                f"against {params * 4 / mib:.0f} MiB fp32 / {params * 2 / mib:.0f} MiB bf16 for these tensors")


class BlockEmbedding:
    """ids -> embedding rows dequantized from token_embd's blocks: its own rows, or those a tied
    head keeps (one copy of the blocks for both)."""

    def __init__(self, source: torch.Tensor | BlockPart, qtype: int, k: int, dtype: torch.dtype) -> None:
        self.source, self.qtype, self.k, self.dtype = source, qtype, k, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat, src = ids.reshape(-1), self.source
        native = flat.device.type == "cpu" and self.dtype in gguf_native.DEQUANT_DTYPES \
            and gguf_native.dequant_supported(self.qtype)
        if native and isinstance(src, BlockPart) and src.raw is None and src.packed is not None:
            out = gguf_native.dequantize_x16_rows(src.packed, self.qtype, src.n, self.k, flat, self.dtype)
        else:
            rows = src.index_select(0, flat) if isinstance(src, torch.Tensor) else src.select(flat, self.k)
            out = gguf_native.dequantize(rows.contiguous(), self.qtype, self.k, self.dtype) if native \
                else gguf_blocks.dequantize(rows, self.qtype, self.k).to(self.dtype)
        return out.reshape(*ids.shape, self.k)


class GGUFSource:
    """The raw blocks of one GGUF file, by tensor name (memory-mapped)."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        self.path = path
        self.cfg = cfg
        self.tensors = read_header(path).tensors
        self.report = Report()
        self._parts: dict[str, tuple[int, torch.Tensor]] = {}  # checked blocks, shared by a tied head

    @classmethod
    def of(cls, model_dir: Path, cfg: ModelConfig) -> GGUFSource:
        """The GGUF behind a converted checkpoint folder; refused by name for any other folder."""
        path = converted_from(model_dir)
        if path is None:
            raise ValueError(f"--quantization gguf serves a .gguf model's own blocks; {model_dir} was not "
                             "converted from one (serve the .gguf file, or --quantization none)")
        return cls(path, cfg)

    def blocks(self, name: str) -> tuple[int, np.ndarray] | None:
        """(ggml type, raw rows [n, row bytes]) of a block-quantized 2-D tensor the kernels serve."""
        t = self.tensors.get(name)
        if t is None or t.qtype not in gguf_blocks.SUPPORTED or len(t.dims) != 2:
            return None
        shape = (t.dims[1], gguf_blocks.row_bytes(t.qtype, t.dims[0]))
        return t.qtype, np.memmap(self.path, np.uint8, mode="r", offset=t.offset, shape=shape)

    def _part(self, name: str, want: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """This tensor's blocks, rows in the checkpoint's order, if they dequantize to `want`."""
        if name in self._parts:
            return self._parts[name]
        found = self.blocks(name)
        if found is None:
            return None
        qtype, raw = found
        want = want.cpu()  # compared with the blocks read here
        rows, k = want.shape
        if raw.shape[0] != rows:
            return None
        blocks = torch.from_numpy(np.array(raw))  # read out of the map: the file may change later
        values = gguf_blocks.dequantize(blocks, qtype, k).to(want.dtype)
        heads = {self.cfg.num_attention_heads, self.cfg.num_key_value_heads}
        orders = [None, *(llama_row_order(rows, h) for h in sorted(heads) if rows % (2 * h) == 0)]
        for order in orders:
            if torch.equal(values if order is None else values[order], want):
                self._parts[name] = qtype, blocks if order is None else blocks[order].contiguous()
                self.report.add(name, qtype, want.numel())
                return self._parts[name]
        return None

    def linear(self, names: Sequence[str], weight: torch.Tensor, bias: torch.Tensor | None,
               logits: bool = False) -> object | None:
        """A QuantLinear (Triton's on that backend) over the named tensors stacked in `weight`'s
        rows, or None: the float layer serves (blocks that do not match it, or a layer whose every
        part measured faster from a float copy at every row count: then it is the float layer)."""
        parts: list[tuple[int, torch.Tensor]] = []
        start = 0
        for name in names:
            t = self.tensors.get(name)
            rows = t.dims[1] if t is not None and len(t.dims) == 2 else 0
            part = self._part(name, weight[start:start + rows]) if rows else None
            if part is None:
                self.report.kept_float += 1
                return None
            parts.append(part)
            start += rows
        if start != weight.shape[0]:
            self.report.kept_float += 1
            return None
        parts = merge_formats(parts)
        k = weight.shape[1]
        if ops.uses_triton(weight):  # CUDA, or the interpreter when forced: no CPU kernel or chooser
            from rill.kernels import triton_gguf

            self.report.from_blocks += 1
            return triton_gguf.QuantLinear(parts, k, bias, weight.dtype, weight.device, logits)
        if not any(blocks_serve(b.shape[0], k, q, weight.dtype, logits) for q, b in parts):
            self.report.measured_float += 1
            return None
        self.report.from_blocks += 1
        return QuantLinear(parts, k, bias, weight.dtype, logits)

    def layer_linears(self, layer: int, fallback: MakeLinear) -> Callable[[str, torch.Tensor, torch.Tensor | None],
                                                                       object]:
        """For `LayerTensors.prepare`: each fused field of `layer` from its GGUF blocks where they
        serve it, else `fallback(weight, bias)`."""
        def make(field: str, weight: torch.Tensor, bias: torch.Tensor | None) -> object:
            names = self._names(layer, field)
            quantized = self.linear(names, weight, bias) if names else None
            if names is None:
                self.report.kept_float += 1
            return quantized if quantized is not None else fallback(weight, bias)
        return make

    def _names(self, layer: int, field: str) -> list[str] | None:
        """The GGUF tensors stacked in one fused field of a layer: the first spelling the file has."""
        for spelling in _PARTS[field]:
            names = [f"blk.{layer}.{n}.weight" for n in spelling]
            if all(n in self.tensors for n in names):
                return names
        return None

    def embedding(self, weight: torch.Tensor, tied_head: object | None = None) -> BlockEmbedding | None:
        """ids -> embedding rows dequantized from token_embd's blocks (the same values as
        `weight`, checked here), or None; the float table can then be dropped. A tied head built
        on the CPU blocks lends its own (row by row or repacked)."""
        part = self._part("token_embd.weight", weight)
        if part is None:
            return None
        qtype, blocks = part
        source: torch.Tensor | BlockPart = blocks.to(weight.device)
        if isinstance(tied_head, QuantLinear) and len(tied_head.parts) == 1:
            head_part = tied_head.parts[0]
            if head_part.has_rows and head_part.qtype == qtype:
                source = head_part
        return BlockEmbedding(source, qtype, weight.shape[1], weight.dtype)

    def finish(self, model: LlamaModel, embed: torch.Tensor, float_table_kept: bool) -> None:
        """Swap the embedding lookup to the blocks (dropping the float table) unless the float table
        stays for a tied float head; log what the model holds."""
        lookup = None if float_table_kept else self.embedding(embed, model.lm_head if model.tied else None)
        if lookup is not None:
            model.embed_lookup, model.embed = lookup, embed.new_empty(0, embed.shape[1])
        held = held_bytes(model.embed, model.embed_lookup, *model.linears())
        with_copy = sum(1 for lin in model.linears()
                        if isinstance(lin, QuantLinear) and any(p.lin is not None for p in lin.parts))
        log.info("%s", self.report.line(held, with_copy))

    def _head_name(self, tied: bool) -> str:
        return "token_embd.weight" if tied or "output.weight" not in self.tensors else "output.weight"

    def lm_head(self, weight: torch.Tensor, tied: bool) -> object | None:
        return self.linear([self._head_name(tied)], weight, None, logits=True)

    def part_shapes(self, tied: bool) -> tuple[list[GgufShape], GgufShape | None]:
        """(n, k, ggml type) of every linear part the blocks may serve, adjacent parts of one format
        merged as `linear` merges them (one entry per layer's part), and the LM head's: what the
        kernel chooser measures before the layers are built."""
        def info(name: str) -> tuple[int, int, int] | None:
            t = self.tensors.get(name)
            ok = t is not None and t.qtype in gguf_blocks.SUPPORTED and len(t.dims) == 2
            return (t.dims[1], t.dims[0], t.qtype) if ok else None  # type: ignore[union-attr]

        shapes: list[GgufShape] = []  # one per part of each layer: the float copies' bytes count them
        layers = {int(name.split(".")[1]) for name in self.tensors if name.startswith("blk.")}
        for layer in layers:
            for fused in _PARTS:
                found = [info(name) for name in self._names(layer, fused) or []]
                infos = [i for i in found if i is not None]
                if not infos or len(infos) < len(found):
                    continue  # `linear` serves this field from floats
                k = infos[0][1]
                shapes.extend((sum(n for n, _, _ in infos[i:j]), k, q)
                              for q, i, j in format_runs([q for _, _, q in infos]))
        return sorted(shapes), info(self._head_name(tied))
