"""Native CPU kernels (cpu_paged_attention.c, cpu_prefill_*.c, cpu_quant.c,
cpu_elementwise.c, cpu_small_gemm.c), compiled on first use and called through ctypes.

Why native code on the CPU path: decode attention over paged KV has no efficient stock torch
form. The torch path must gather every sequence's blocks into a padded copy and run small
batched matmuls against it, which made attention a large share of a decode step; reading the
blocks in place is several times faster. Prompt chunks read them in place too, about twice as
fast as torch's SDPA on copies. The quantise / dequantise steps around an int8 GEMM are one pass
each instead of a dozen small torch ops (cpu_quant.c), and so are the residual add + RMSNorm
between a layer's GEMMs and RoPE + the KV-cache write (cpu_elementwise.c). bf16 linear layers of
up to 1024 rows run faster than through oneDNN (cpu_small_gemm.c).

The library is built for this CPU (or RILL_NATIVE_MARCH's level) into Rill's cache folder
(native_build.py). It links OpenMP by soname, so in a process that imported torch it shares
torch's libgomp and thread pool. Without a compiler (or with RILL_NATIVE_KERNELS=0) every caller
gets None and keeps the plain-torch implementation.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from rill.kernels import native_build
from rill.shared import envs
from rill.shared.model_files import cache_root

log = logging.getLogger("rill.kernels")


_lib: ctypes.CDLL | None = None
_tried = False
_amx = False  # the build has the AMX prefill kernel and the OS granted this process the tiles
_silu_vec16 = False  # the build's SiLU * up has its 16-lane path (AVX512-BF16 CPUs)
_geglu_exact = False  # the layer driver's GELU is torch's bit for bit (torch's vector tanh found)
_prefill_dot = False  # the build has the AVX512-BF16 dot-product prefill kernel


def enabled() -> bool:
    return envs.RILL_NATIVE_KERNELS


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it the first time; None when it cannot be had."""
    global _lib, _tried, _amx, _silu_vec16, _geglu_exact, _prefill_dot
    if not enabled():  # read on every call, so a test or an operator can switch it off
        return None
    if _tried:
        return _lib
    _tried = True
    try:
        _lib = _load(_build())
        _amx = _lib.amx_enable() == 0
        _silu_vec16 = bool(_lib.silu_mul_vec16())
        _geglu_exact = bool(_lib.decode_layers_geglu_exact())
        _prefill_dot = bool(_lib.prefill_dot_available())
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("native CPU kernels unavailable (%s); using the torch kernels", exc)
        _lib = None
    return _lib


def _loaded() -> ctypes.CDLL:
    """The library, for an op whose caller has just checked that it may run natively (the
    `*_supported` checks call `library()`, which reads RILL_NATIVE_KERNELS): per-call ops skip
    that second environment read, a few µs each, hundreds of times a decode step."""
    assert _lib is not None
    return _lib


_build_key: str | None = None


def build_key() -> str | None:
    """The hash of the loaded library's sources, flags, compiler and CPU; None without one."""
    return _build_key if library() is not None else None


def _build() -> Path:
    global _build_key
    path, _build_key = native_build.build(cache_root() / "kernels")
    return path


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for fn in (lib.paged_decode_bf16, lib.paged_decode_f32):
        fn.restype = i32
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, i64, f32, i32, i64, f32]
    for fn in (lib.paged_prefill_bf16, lib.paged_prefill_f32, lib.paged_prefill_bf16_amx, lib.paged_prefill_bf16_dot):
        fn.restype = i32
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, f32, i32, f32]
    lib.amx_enable.restype = i32
    lib.amx_enable.argtypes = []
    lib.prefill_dot_available.restype = i32
    lib.prefill_dot_available.argtypes = []
    for fn in (lib.quantize_rows_bf16, lib.quantize_rows_f32):
        fn.restype = None
        fn.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32]
    for fn in (lib.dequantize_bf16, lib.dequantize_f32):
        fn.restype = None
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64]
    for fn in (lib.rms_norm_bf16, lib.rms_norm_f32):
        fn.restype = None
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32]
    for fn in (lib.rope_write_kv_bf16, lib.rope_write_kv_f32):
        fn.restype = None
        fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    for fn in (lib.silu_mul_bf16, lib.silu_mul_f32):
        fn.restype = None
        fn.argtypes = [ptr, ptr, i64, i64]
    for fn in (lib.silu_mul_vec16, lib.decode_layers_geglu_exact):
        fn.restype = i32
        fn.argtypes = []
    lib.small_gemm_available.restype = i32
    lib.small_gemm_available.argtypes = []
    lib.small_gemm_bf16.restype = i32
    lib.small_gemm_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, i32, i64, i64]
    lib.argmax_rows_f32.restype = None
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, ptr]
    lib.apply_token_bitmask_f32.restype = None
    lib.apply_token_bitmask_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64]
    lib.small_gemm_pack.restype = None
    lib.small_gemm_pack.argtypes = [ptr, i64, i64, ptr]
    lib.gelu_mul.restype = None
    lib.gelu_mul.argtypes = [i32, ptr, ptr, i64, i64]
    lib.decode_layers_set_tanh.restype = None
    lib.decode_layers_set_tanh.argtypes = [ptr, ptr]
    lanes = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())  # of torch's GELU's tanh
    lib.decode_layers_set_tanh(*(torch_tanh(f"Sleef_tanhf{n}_u10") if n == lanes else None for n in (16, 8)))
    return lib


def torch_tanh(name: str) -> int | None:
    """Address of torch's vector tanh `name` (Sleef's, exported by libtorch_cpu): the layer driver's
    GELU then equals torch's bit for bit at vector speed. None where this torch build lacks it."""
    try:
        return ctypes.cast(getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")), name),
                           ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


_DECODE = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` can take these tensors (else use the torch path)."""
    return (q.device.type == "cpu" and q.dtype in _DECODE and k_cache.dtype == q.dtype
            and k_cache.is_contiguous() and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and q.shape[2] <= 256 and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[1] // k_cache.shape[2] <= 16 and library() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, max_len: int,
                 scale: float, generic_only: bool = False, window: int | None = None,
                 softcap: float | None = None) -> None:
    """out[rows[i]] = attention of q[rows[i]] (one token at position seq_lens[i] - 1) over
    sequence i's first seq_lens[i] cached tokens (its last `window` with a sliding window; the
    table entries of blocks wholly before it are not read), for each i. block_tables [n, W] int32
    contiguous, seq_lens [n] int32, rows [n] int64; out contiguous like q. The caller checks
    `decode_supported` first. `softcap`: scores s become softcap * tanh(s / softcap). On AVX-512 CPUs, head_dim 64 with GQA groups of up to 4 takes a
    path that keeps every vector in registers; `generic_only` turns it off (to compare)."""
    lib = _loaded()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and rows.dtype == torch.int64
    assert block_tables.is_contiguous() and out.is_contiguous() and v_cache.is_contiguous()
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = getattr(lib, _DECODE[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), rows.data_ptr(), out.data_ptr(), rows.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, max_len, scale, int(generic_only), window or 0, softcap or 0.0)
    if rc != 0:
        raise RuntimeError(f"native paged decode failed with code {rc}")


_PREFILL = {torch.bfloat16: "paged_prefill_bf16", torch.float32: "paged_prefill_f32"}


def amx_prefill_available() -> bool:
    """Whether bf16 prompt chunks can run on AMX tiles here (CPU, compiler and OS all allow it;
    RILL_AMX=0 turns it off)."""
    return (library() is not None and _amx
            and envs.RILL_AMX)


def dot_prefill_available() -> bool:
    """Whether bf16 prompt chunks can run on AVX512-BF16 dot products here (the build has them)."""
    return library() is not None and _prefill_dot


def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill` can take these tensors (else use the torch path): head_dim a
    multiple of 4 up to 256, GQA groups up to 16."""
    return (q.device.type == "cpu" and q.dtype in _PREFILL and k_cache.dtype == q.dtype
            and k_cache.is_contiguous() and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and q.shape[2] <= 256 and q.shape[2] % 4 == 0 and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[1] // k_cache.shape[2] <= 16 and library() is not None)


PREFILL_KERNELS = ("auto", "amx", "dot", "vector")


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor, out: torch.Tensor,
                  scale: float, kernel: str | None = None, window: int | None = None,
                  softcap: float | None = None) -> None:
    """Causal attention for multi-token rows: sequence i's query rows q_starts[i] ..
    q_starts[i] + q_lens[i] sit at positions ctx_lens[i] .. and see every cached key up to their
    own position (the step's K/V must be in the cache already); with a sliding `window`, only the
    last `window` keys up to it (the AMX kernel has no window: such steps take the next one);
    `softcap`: scores s become softcap * tanh(s / softcap) before the mask and the softmax.
    block_tables [n, W], q_starts,
    q_lens, ctx_lens [n]: int32 contiguous; out contiguous like q. The caller checks
    `prefill_supported` first.

    `kernel` (default RILL_PREFILL_KERNEL, else "auto") "auto" takes the fastest this CPU has for
    bf16: AMX tiles (head_dim a multiple of 32, `amx_prefill_available`), else AVX512-BF16 dot
    products (`dot_prefill_available`), else the fp32-FMA vector kernel, which is also fp32's.
    "amx", "dot" and "vector" ask for one (to compare); one that the CPU or the shape cannot take
    falls back to the vector kernel."""
    lib = _loaded()
    for t in (block_tables, q_starts, q_lens, ctx_lens):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert out.is_contiguous() and v_cache.is_contiguous()
    if kernel is None:
        kernel = envs.RILL_PREFILL_KERNEL
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"kernel must be one of {PREFILL_KERNELS}, got {kernel!r}")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), q_starts.data_ptr(), q_lens.data_ptr(), ctx_lens.data_ptr(), out.data_ptr(),
            q_lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale, window or 0, softcap or 0.0)
    rc = -1
    if q.dtype == torch.bfloat16:
        if kernel in ("auto", "amx") and head_dim % 32 == 0 and amx_prefill_available():
            rc = lib.paged_prefill_bf16_amx(*args)
        # A windowed step the AMX kernel turned down still takes the next fastest, the dot kernel.
        if rc in (-1, 1, 3) and (kernel in ("auto", "dot") or (kernel == "amx" and window)) and _prefill_dot:
            rc = lib.paged_prefill_bf16_dot(*args)
    if rc in (-1, 1, 3):  # not taken, or a shape or build it does not handle
        rc = getattr(lib, _PREFILL[q.dtype])(*args)
    if rc != 0:
        raise RuntimeError(f"native paged prefill failed with code {rc}")


_QUANTIZE = {torch.bfloat16: "quantize_rows_bf16", torch.float32: "quantize_rows_f32"}
_DEQUANTIZE = {torch.bfloat16: "dequantize_bf16", torch.float32: "dequantize_f32"}


def quant_supported(x: torch.Tensor) -> bool:
    """Whether `quantize_rows` / `dequantize` can take activations like x (CPU, bf16/fp32)."""
    return x.device.type == "cpu" and x.dtype in _QUANTIZE and library() is not None


def quantize_rows(x: torch.Tensor, min_absmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D x whose rows are contiguous: (q [M, K] int8, scale [M, 1]
    fp32), scale = max(|row|, min_absmax) / 127, q = round-half-even(x / scale)."""
    lib = _loaded()
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    scale = torch.empty((m, 1), dtype=torch.float32)
    getattr(lib, _QUANTIZE[x.dtype])(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), m, k, min_absmax)
    return q, scale


def dequantize(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] int32 * row_scale [M, 1] * col_scale [N] (+ bias [N], fp32) -> [M, N] of dtype."""
    lib = _loaded()
    assert acc.dtype == torch.int32 and acc.is_contiguous()
    assert row_scale.is_contiguous() and col_scale.is_contiguous() and col_scale.dtype == torch.float32
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    m, n = acc.shape
    y = torch.empty((m, n), dtype=dtype)
    getattr(lib, _DEQUANTIZE[dtype])(acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), y.data_ptr(), m, n)
    return y


_RMS_NORM = {torch.bfloat16: "rms_norm_bf16", torch.float32: "rms_norm_f32"}


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `rms_norm` can take these: x (and residual) contiguous 2-D bf16/fp32 CPU tensors
    of one shape, weight contiguous [K], all of x's dtype."""
    return (x.device.type == "cpu" and x.dtype in _RMS_NORM and x.dim() == 2 and x.is_contiguous()
            and weight.dtype == x.dtype and weight.is_contiguous() and weight.shape == x.shape[1:]
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                      and residual.shape == x.shape))
            and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch_ops.rms_norm in one pass per row: weight * RMSNorm(x) or, with `residual`,
    (weight * RMSNorm(x + residual), x + residual). The caller checks `rms_norm_supported` first."""
    lib = _loaded()
    m, k = x.shape
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    getattr(lib, _RMS_NORM[x.dtype])(x.data_ptr(), None if residual is None else residual.data_ptr(),
                                     weight.data_ptr(), out.data_ptr(), None if total is None else total.data_ptr(),
                                     m, k, eps)
    return out if total is None else (out, total)


_ROPE_KV = {torch.bfloat16: "rope_write_kv_bf16", torch.float32: "rope_write_kv_f32"}


def rope_kv_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether `rope_and_write_kv` can take these: q [T, Hq, D], k and v [T, Hkv, D] of one dtype
    with contiguous heads, each with its own row stride (slices of a fused qkv output, or q and k
    normed apart from it), int64 positions
    and slots, an fp32 [max_pos, D] cos|sin table and contiguous caches of the same dtype."""
    def heads_contiguous(x: torch.Tensor) -> bool:
        return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]

    return (q.device.type == "cpu" and q.dtype in _ROPE_KV and k.dtype == q.dtype and v.dtype == q.dtype
            and k_cache.dtype == q.dtype and heads_contiguous(q) and heads_contiguous(k) and heads_contiguous(v)
            and k.shape == v.shape and q.shape[2] == k.shape[2]
            and q.shape[2] % 2 == 0 and k_cache.is_contiguous() and k_cache.shape[-2:] == k.shape[1:]
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
            and cos_sin_cache.shape[1] == q.shape[2]
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and library() is not None)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ops' RoPE + write_kv in one pass: the rotated (q, k) as new contiguous tensors, with
    the rotated k and v stored at their cache slots (slots < 0 skipped). Bit-identical to the
    torch code. The caller checks `rope_kv_supported` first."""
    lib = _loaded()
    assert v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype)
    k_out = torch.empty((t, hkv, d), dtype=q.dtype)
    getattr(lib, _ROPE_KV[q.dtype])(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
                                    positions.data_ptr(), slot_mapping.data_ptr(), cos_sin_cache.data_ptr(),
                                    q_out.data_ptr(), k_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    t, hq, hkv, d)
    return q_out, k_out


_SILU_MUL = {torch.bfloat16: "silu_mul_bf16", torch.float32: "silu_mul_f32"}


def silu_mul_supported(x: torch.Tensor) -> bool:
    """Whether `silu_and_mul` can take x: a contiguous 2-D bf16/fp32 CPU tensor [T, 2F], with the
    library here (whether it should is the kernel chooser's: torch_ops.silu_route)."""
    if not (x.device.type == "cpu" and x.dtype in _SILU_MUL and x.dim() == 2 and x.shape[1] % 2 == 0
            and x.is_contiguous()):
        return False
    return library() is not None


def silu_mul_vec16() -> bool:  # the SiLU * up's 16-lane path is built (AVX512-BF16)
    return library() is not None and _silu_vec16


def geglu_exact() -> bool:  # the layer driver's GELU gives torch's bits (torch's vector tanh found)
    return library() is not None and _geglu_exact


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2F] holding [gate | up] -> SiLU(gate) * up [T, F] in one pass (`silu_mul_supported` first)."""
    m, f = x.shape[0], x.shape[1] // 2
    out = torch.empty((m, f), dtype=x.dtype)
    getattr(_loaded(), _SILU_MUL[x.dtype])(x.data_ptr(), out.data_ptr(), m, f)
    return out


def small_gemm_rows() -> int:
    """The most rows `small_gemm` takes on this machine; 0 without AVX512-BF16 (or a build)."""
    lib = library()
    return 0 if lib is None else int(lib.small_gemm_available())


def small_gemm_weight_ok(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `small_gemm` can serve this linear layer: a bf16 CPU weight [N, K] with K even,
    and a bias (if any) of N bf16 values."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.shape == weight.shape[:1]))
            and small_gemm_rows() > 0)


def small_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the small GEMM's layout ([N/16][K/2][16][2], N padded with zero rows)."""
    lib = _loaded()
    weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(-(-n // 16) * 16 * k, dtype=torch.bfloat16)
    lib.small_gemm_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def small_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for M <= small_gemm_rows(), W [n, K] as `small_gemm_pack` made
    it; bf16 in, fp32 sums, out in bf16 or (out_dtype float32) the sums as they are. The caller
    checks `small_gemm_weight_ok` once per weight."""
    lib = _loaded()
    assert x.dtype == torch.bfloat16 and out_dtype in (torch.bfloat16, torch.float32)
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, n), dtype=out_dtype)
    rc = lib.small_gemm_bf16(x.data_ptr(), m, packed.data_ptr(),
                             None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
                             int(out_dtype == torch.float32), n, k)
    if rc != 0:
        raise RuntimeError(f"native small GEMM failed with code {rc}")
    return out


def argmax_supported(x: torch.Tensor) -> bool:
    """Whether `argmax_rows` can take x: a contiguous 2-D fp32 CPU tensor with columns."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0
            and x.is_contiguous() and library() is not None)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (int64; first index of the maximum, NaN ranked highest) in one vector
    pass per row. The caller checks `argmax_supported` first."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _loaded().argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """In place: row rows[i] of x keeps the tokens whose bit is set in mask[i] (int32 words, 32
    tokens each, llguidance's layout); the others become -inf. The caller checks
    `argmax_supported(x)` (the same layout) first; rows are int64, mask int32, both on the CPU."""
    assert rows.dtype == torch.int64 and mask.dtype == torch.int32 and mask.shape[0] == rows.shape[0]
    rows, mask = rows.contiguous(), mask.contiguous()
    _loaded().apply_token_bitmask_f32(x.data_ptr(), x.shape[1], rows.data_ptr(), rows.shape[0],
                                      mask.data_ptr(), mask.shape[1])
