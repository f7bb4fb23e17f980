"""A GGUF's Q4_1 tensors requantized to another format (metadata and every other tensor copied): a
real model in a format no wheel here ships. 32-element formats by gguf-py; the K formats, which
gguf-py only reads, by the plain min/max encoders below (not llama.cpp's search for the best
scales: valid blocks of a coarser fit, enough for tests of the kernels that read them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGUFValueType

from rill.kernels.gguf_blocks import q6_k_blocks
from rill.shared.model_files import cache_root, file_key

_ADD = {GGUFValueType.STRING: "add_string", GGUFValueType.BOOL: "add_bool", GGUFValueType.FLOAT32: "add_float32",
        GGUFValueType.UINT32: "add_uint32", GGUFValueType.INT32: "add_int32", GGUFValueType.UINT64: "add_uint64",
        GGUFValueType.ARRAY: "add_array"}


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().view(torch.uint8).reshape(*x.shape, 2)


def q5_k(w: torch.Tensor) -> torch.Tensor:
    """float [n, k] (k a multiple of 256) -> Q5_K blocks uint8 [n, k / 256 * 176]:
    w ~ d sc q - dmin m per 32 values, q < 32, sc and m 6 bits."""
    x = w.float().reshape(-1, 8, 32)
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1)
    scale, low = (hi - lo) / 31, -lo
    d = (scale.amax(-1) / 63).half().float().clamp(min=1e-8)
    dmin = (low.amax(-1) / 63).half().float().clamp(min=1e-8)
    sc = (scale / d[:, None]).round().clamp(0, 63)
    mn = (low / dmin[:, None]).round().clamp(0, 63)
    step, zero = (d[:, None] * sc).unsqueeze(-1), (dmin[:, None] * mn).unsqueeze(-1)
    q = ((x + zero) / step.clamp(min=1e-12)).round().clamp(0, 31).to(torch.uint8).reshape(-1, 256)
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], dim=1)  # get_scale_min_k4 undone
    qh = ((q >> 4).reshape(-1, 8, 32) << torch.arange(8, dtype=torch.uint8)[:, None]).sum(1, dtype=torch.uint8)
    lo4 = (q & 15).reshape(-1, 4, 2, 32)
    qs = (lo4[:, :, 0] | (lo4[:, :, 1] << 4)).reshape(-1, 128)
    blocks = torch.cat([_fp16(d), _fp16(dmin), scales, qh, qs], dim=1)
    return blocks.reshape(w.shape[0], -1)


def q6_k(w: torch.Tensor) -> torch.Tensor:
    """float [n, k] (k a multiple of 256) -> Q6_K blocks uint8 [n, k / 256 * 210]:
    w ~ d sc (u - 32) per 16 values, u < 64, sc a signed byte."""
    x = w.float().reshape(-1, 16, 16)
    scale = x.abs().amax(-1) / 31.5
    d = (scale.amax(-1) / 127).half().float().clamp(min=1e-8)
    sc = (scale / d[:, None]).round().clamp(1, 127)
    u = (x / (d[:, None] * sc).unsqueeze(-1)).round().clamp(-32, 31).add(32).to(torch.uint8)
    return q6_k_blocks(u, sc.to(torch.int8).view(torch.uint8), _fp16(d)).reshape(w.shape[0], -1)


K_ENCODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q5_K: q5_k, GGMLQuantizationType.Q6_K: q6_k}


def requantize(src: Path, dst: Path, to: GGMLQuantizationType,
               pick: Callable[[str, int], GGMLQuantizationType | None] | None = None) -> Path:
    """`pick(name, k)`: a tensor's format (None: as it is), else `to` for every Q4_1 tensor."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        getattr(writer, _ADD[field.types[0]])(name, field.contents())
    for t in reader.tensors:
        fmt = to if t.tensor_type == GGMLQuantizationType.Q4_1 else None
        if pick is not None and t.tensor_type == GGMLQuantizationType.Q4_1:
            fmt = pick(t.name, int(t.shape[0]))
        if fmt is not None:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if fmt in K_ENCODERS:
                blocks = K_ENCODERS[fmt](torch.from_numpy(values)).numpy()
            else:
                blocks = gguf.quants.quantize(values, fmt)
            writer.add_tensor(t.name, blocks, raw_dtype=fmt)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def requantized(src: Path, recipe: str, to: GGMLQuantizationType,
                pick: Callable[[str, int], GGMLQuantizationType | None] | None = None) -> Path:
    """requantize() once per machine: the file is kept in Rill's cache under a name that says the
    source's content, the recipe and this module's code (its encoders), so `rill serve`'s conversion
    of it is cached too (in a fresh temporary folder each run, both were redone, and each left a
    converted copy behind). A caller that changes what `recipe` means must rename it."""
    code = file_key(Path(__file__))[:8]
    dst = cache_root() / "test-gguf" / f"{src.stem.split('.')[0]}.{recipe}-{file_key(src)}-{code}.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        part = dst.with_name(f".{dst.name}.{os.getpid()}")
        requantize(src, part, to, pick)
        os.replace(part, dst)  # whole or absent, should two runs race
    return dst
