"""ctypes bindings of the GGUF block-quantized GEMM (cpu_gguf.c) and dequantizer
(cpu_gguf_dequant.c), part of the native CPU kernel
library that cpu_native.py builds and loads (its `library()`; None when it cannot be had)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from rill.kernels import cpu_native, gguf_blocks

_declared: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL | None:
    """The kernel library with this module's functions declared; None without one."""
    global _declared
    lib = cpu_native.library()
    if lib is not None and lib is not _declared:
        _declared = declare(lib)
    return lib


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares cpu_gguf.c's functions on a library that holds them (also one built alone, in tests)."""
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.gguf_gemm_f32.restype = i32
    lib.gguf_gemm_f32.argtypes = [ptr, i64, ptr, i32, i64, i64, ptr, ptr]
    lib.gguf_gemm_x16.restype = i32
    lib.gguf_gemm_x16.argtypes = [ptr, i64, ptr, i32, i64, i64, ptr, ptr, i32]
    lib.gguf_gemm_x16_supported.restype = i32
    lib.gguf_gemm_x16_supported.argtypes = [i32]
    lib.gguf_gemm_supported.restype = i32
    lib.gguf_gemm_supported.argtypes = [i32]
    lib.gguf_gemm_simd.restype = i32
    lib.gguf_gemm_simd.argtypes = []
    lib.gguf_dequant.restype = i32
    lib.gguf_dequant.argtypes = [ptr, i32, i64, i64, ptr, i32]
    lib.gguf_dequant_supported.restype = i32
    lib.gguf_dequant_supported.argtypes = [i32]
    lib.gguf_dequant_x16_rows.restype = i32
    lib.gguf_dequant_x16_rows.argtypes = [ptr, i32, i64, i64, ptr, i64, ptr, i32]
    return lib


def simd_level() -> str | None:
    """Which integer dot product the build uses: "avx512-vnni", "avx2" or "scalar"; None without a build."""
    lib = _lib()
    return None if lib is None else ("scalar", "avx2", "avx512-vnni")[lib.gguf_gemm_simd()]


def format_supported(qtype: int) -> bool:
    """Whether the native library is here and multiplies this format."""
    lib = _lib()
    return lib is not None and qtype in gguf_blocks.SUPPORTED and bool(lib.gguf_gemm_supported(qtype))


def x16_supported(qtype: int) -> bool:
    """Whether this build multiplies the format repacked 16 rows at a time (gguf_blocks.pack_x16;
    cpu_gguf_x16.c: Q4_0, Q4_1, Q5_0, Q8_0 and the K formats on AVX512-VNNI CPUs)."""
    lib = _lib()
    return lib is not None and qtype in gguf_blocks.X16_FORMATS and bool(lib.gguf_gemm_x16_supported(qtype))


def gemm_x16(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, k: int,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`gemm` on the weight as gguf_blocks.pack_x16 repacked it, written in `out_dtype` (fp32, or
    bf16 rounded as torch rounds). The caller checks `x16_supported`."""
    lib = _declared if _declared is not None else _lib()
    assert lib is not None and x.dim() == 2 and x.shape[1] == k and x.dtype == torch.float32 and x.is_contiguous()
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,))
    assert out_dtype in (torch.float32, torch.bfloat16)
    return _run_gemm(lib.gguf_gemm_x16, x, packed, qtype, n, k, bias, "x16 GGUF GEMM", out_dtype,
                     int(out_dtype == torch.bfloat16))


def _run_gemm(fn: Any, x: torch.Tensor, weight: torch.Tensor, qtype: int, n: int, k: int,
              bias: torch.Tensor | None, what: str, out_dtype: torch.dtype = torch.float32,
              *flags: int) -> torch.Tensor:
    """out [m, n] in out_dtype from one of the library's GEMM entry points (checked arguments;
    `flags` follow the output pointer)."""
    out = torch.empty((x.shape[0], n), dtype=out_dtype)
    rc = fn(x.data_ptr(), x.shape[0], weight.data_ptr(), qtype, n, k, None if bias is None else bias.data_ptr(),
            out.data_ptr(), *flags)
    if rc != 0:
        raise RuntimeError(f"native {what} ({gguf_blocks.name(qtype)}) failed with code {rc}")
    return out


def supported(qtype: int, x: torch.Tensor) -> bool:
    """Whether `gemm` can take x against a weight of this format: the library present, the format
    supported, x fp32, contiguous, on the CPU."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and format_supported(qtype))


def gemm(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] fp32 @ W.T (+ bias) -> [m, n] fp32, W the raw blocks uint8 [n, row_bytes(qtype, k)].
    The activation is quantized to 8 bits per call (see cpu_gguf.c), so the result is within half
    a quantization step of each activation block from the float GEMM. The caller checks `supported`
    (which loads the library: a decode step's calls then skip `cpu_native.library()`)."""
    return gemm_with(_declared if _declared is not None else _lib(), x, raw, qtype, n, k, bias)


def gemm_with(lib: ctypes.CDLL | None, x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int,
              bias: torch.Tensor | None) -> torch.Tensor:
    """`gemm` through a given library (`declare`d)."""
    assert lib is not None and x.dim() == 2 and x.shape[1] == k
    rb = gguf_blocks.row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.shape != (n, rb) or not raw.is_contiguous():
        raise ValueError(f"{gguf_blocks.name(qtype)} weight: want contiguous uint8 [{n}, {rb}], "
                         f"got {raw.dtype} {list(raw.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    assert bias is None or bias.shape == (n,)
    return _run_gemm(lib.gguf_gemm_f32, x, raw, qtype, n, k, bias, "GGUF GEMM")


DEQUANT_DTYPES = (torch.float32, torch.bfloat16)


def dequant_supported(qtype: int) -> bool:
    """Whether the native library is here and dequantizes this format."""
    lib = _lib()
    return lib is not None and qtype in gguf_blocks.SUPPORTED and bool(lib.gguf_dequant_supported(qtype))


def dequantize(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Raw blocks uint8 [n, row_bytes(qtype, k)] -> [n, k] in dtype (fp32: equal bit for bit to
    gguf_blocks.dequantize; bf16: that rounded to nearest-even), written into `out` when given
    (a contiguous [n, k] tensor of dtype: a reused scratch buffer). The caller checks `dequant_supported`."""
    return dequantize_with(_lib(), raw, qtype, k, dtype, out)


def dequantize_x16_rows(packed: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor,
                        dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` of a weight of n rows as gguf_blocks.pack_x16 repacked it, dequantized to [len(ids), k]
    in dtype (equal to `dequantize` of the original rows), into `out` when given (contiguous, of that
    shape and dtype): an embedding lookup on a tied head's blocks, a dequant-route tile."""
    lib = _lib()
    assert lib is not None and dtype in DEQUANT_DTYPES and packed.dtype == torch.uint8 and packed.is_contiguous()
    ids = ids.to(torch.int64).contiguous()
    out = _dequant_out(out, ids.numel(), k, dtype)
    rc = lib.gguf_dequant_x16_rows(packed.data_ptr(), qtype, n, k, ids.data_ptr(), ids.numel(), out.data_ptr(),
                                   int(dtype == torch.bfloat16))
    if rc != 0:
        raise ValueError(f"x16 {gguf_blocks.name(qtype)} rows of {n} x {k}: a format, shape or id out of range")
    return out


def _dequant_out(out: torch.Tensor | None, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The [n, k] dtype tensor a dequantizer writes: `out` checked, or a new one."""
    if out is None:
        return torch.empty((n, k), dtype=dtype)
    if out.dtype != dtype or tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ValueError(f"dequantize into {out.dtype} {list(out.shape)}: want contiguous {dtype} [{n}, {k}]")
    return out


def dequantize_with(lib: ctypes.CDLL | None, raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype,
                    out: torch.Tensor | None) -> torch.Tensor:
    """`dequantize` through a given library (`declare`d)."""
    assert lib is not None and dtype in DEQUANT_DTYPES
    rb = gguf_blocks.row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb or not raw.is_contiguous():
        raise ValueError(f"{gguf_blocks.name(qtype)} weight: want contiguous uint8 [n, {rb}], "
                         f"got {raw.dtype} {list(raw.shape)}")
    n = raw.shape[0]
    out = _dequant_out(out, n, k, dtype)
    rc = lib.gguf_dequant(raw.data_ptr(), qtype, n, k, out.data_ptr(), int(dtype == torch.bfloat16))
    if rc != 0:
        raise RuntimeError(f"native GGUF dequantizer ({gguf_blocks.name(qtype)}) failed with code {rc}")
    return out
