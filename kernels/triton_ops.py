"""Triton implementations of the kernel interface in `ops.py` (the CUDA backend).

The element-wise kernels keep the rounding order of `torch_ops` (which follows HF Llama), so the
two backends differ only by reduction order: RMSNorm adds the residual in the model dtype,
takes its statistics in fp32 and rounds the normalised row before the weight multiply;
SiLU-and-mul rounds silu(gate) before multiplying by up; RoPE rotates in fp32 and rounds once.

`rope_and_write_kv` is the fused form the model calls: one launch rotates q and k in place and
stores the rotated k and v into the paged cache (slots < 0 are padding and are skipped), which
saves a launch and a round trip of k per layer. The rotary tables (`cos_sin_cache`, with any
Llama-3 / linear frequency scaling already applied by the model) are read per token position.

GEMMs stay on cuBLAS (`Linear` is the torch one), except the experts' grouped GEMMs (triton_moe.py).
"""

from __future__ import annotations

import torch

from rill.kernels.torch_ops import Linear
from rill.kernels.triton_attention import paged_attention
from rill.kernels.triton_moe import make_experts
from rill.kernels.triton_setup import INTERPRET, prepare_interpreter

prepare_interpreter()  # a no-op by now; it must run before this module's own `import triton`

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# ------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n_cols,
                     stride_x, stride_res, stride_out, stride_res_out,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum is rounded, as in torch
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`ops.rms_norm`; `out` / `residual_out` (contiguous, x's shape) receive the results if given."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if out is None:
        out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = residual_out if residual_out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, n)
    else:
        r2 = ro2 = x2  # unused
        res_out = None
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x2, r2, weight, out2, ro2, eps, n, x2.stride(0), r2.stride(0), out2.stride(0),
                                  ro2.stride(0), HAS_RES=residual is not None, BLOCK=block,
                                  num_warps=min(16, max(1, block // 512)))
    return out if res_out is None else (out, res_out)


# ------------------------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols,
             (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


# GeGLU (Gemma) has no Triton kernel yet: torch's ops run on the GPU tensors as they are.
from rill.kernels.torch_ops import gelu_and_mul  # noqa: E402, F401


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out2, d, x2.stride(0), out2.stride(0),
                                                                   BLOCK=block, num_warps=4)
    return out


# ------------------------------------------------------------------------------------- RoPE + cache


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_cb, stride_ct, stride_ch, stride_vcb, stride_vct, stride_vch,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROTATE: tl.constexpr, WRITE_CACHE: tl.constexpr,
):
    # One token per program: NeoX pairs (i, i + HALF) of every head, rotated in fp32.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    kv_heads = tl.arange(0, BLOCK_HKV)
    kv_mask = (kv_heads < num_kv_heads)[:, None] & (offs < HALF)[None, :]
    kbase = row * stride_kt + kv_heads[:, None] * stride_kh + offs[None, :]
    k1 = tl.load(k_ptr + kbase, mask=kv_mask, other=0.0)
    k2 = tl.load(k_ptr + kbase + HALF, mask=kv_mask, other=0.0)
    if ROTATE:
        pos = tl.load(pos_ptr + row).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + offs, mask=offs < HALF, other=0.0)[None, :]
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs, mask=offs < HALF, other=0.0)[None, :]
        q_heads = tl.arange(0, BLOCK_HQ)
        q_mask = (q_heads < num_q_heads)[:, None] & (offs < HALF)[None, :]
        qbase = row * stride_qt + q_heads[:, None] * stride_qh + offs[None, :]
        q1 = tl.load(q_ptr + qbase, mask=q_mask, other=0.0)
        q2 = tl.load(q_ptr + qbase + HALF, mask=q_mask, other=0.0)
        # In place (q_out is q, k_out is k): small tiles are replicated across threads, so no
        # thread may store before every thread has loaded.
        tl.debug_barrier()
        f1 = q1.to(tl.float32)
        f2 = q2.to(tl.float32)
        qobase = row * stride_qot + q_heads[:, None] * stride_qoh + offs[None, :]
        tl.store(q_out_ptr + qobase, (f1 * cos - f2 * sin).to(q1.dtype), mask=q_mask)
        tl.store(q_out_ptr + qobase + HALF, (f2 * cos + f1 * sin).to(q1.dtype), mask=q_mask)
        f1 = k1.to(tl.float32)
        f2 = k2.to(tl.float32)
        k1 = (f1 * cos - f2 * sin).to(k1.dtype)
        k2 = (f2 * cos + f1 * sin).to(k2.dtype)
        kobase = row * stride_kot + kv_heads[:, None] * stride_koh + offs[None, :]
        tl.store(k_out_ptr + kobase, k1, mask=kv_mask)
        tl.store(k_out_ptr + kobase + HALF, k2, mask=kv_mask)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot >= 0:  # negative: a padding token, nothing to store
            block = slot // BLOCK_SIZE
            in_block = slot % BLOCK_SIZE
            cbase = block * stride_cb + in_block * stride_ct + kv_heads[:, None] * stride_ch + offs[None, :]
            tl.store(k_cache_ptr + cbase, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(k_cache_ptr + cbase + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            vbase = row * stride_vt + kv_heads[:, None] * stride_vh + offs[None, :]
            v1 = tl.load(v_ptr + vbase, mask=kv_mask, other=0.0)
            v2 = tl.load(v_ptr + vbase + HALF, mask=kv_mask, other=0.0)
            vcbase = block * stride_vcb + in_block * stride_vct + kv_heads[:, None] * stride_vch + offs[None, :]
            tl.store(v_cache_ptr + vcbase, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_cache_ptr + vcbase + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def _launch_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, q_out: torch.Tensor,
                       k_out: torch.Tensor, positions: torch.Tensor | None, cos_sin_cache: torch.Tensor | None,
                       k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                       slot_mapping: torch.Tensor | None) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if num_tokens == 0:
        return
    for t in (q, k, q_out, k_out) + ((v,) if v is not None else ()):
        if t.stride(2) != 1:
            raise ValueError("the head dimension must be contiguous")
    rotate = positions is not None
    write = k_cache is not None
    half = head_dim // 2
    vv = v if v is not None else k
    kc = k_cache if k_cache is not None else k.unsqueeze(1)  # unused stand-in
    vc = v_cache if v_cache is not None else kc
    cs = cos_sin_cache if cos_sin_cache is not None else k
    if cs is not k and cs.stride(1) != 1:
        cs = cs.contiguous()
    _rope_cache_kernel[(num_tokens,)](
        q, k, vv, q_out, k_out, positions if rotate else k, cs, kc, vc,
        slot_mapping if write else k,
        num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cs.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        HALF=half, BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_SIZE=kc.shape[1], ROTATE=rotate, WRITE_CACHE=write,
        num_warps=4,
    )


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_rope_cache(q, k, None, q_out, k_out, positions, cos_sin_cache, None, None, None)
    return q_out, k_out


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k IN PLACE and store rotated k and v at their slots; returns (q, k)."""
    _launch_rope_cache(q, k, v, q, k, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return q, k


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # The same kernel without the rotation; q is a dummy that is never touched.
    _launch_rope_cache(k, k, v, k, k, None, None, k_cache, v_cache, slot_mapping)


__all__ = ["INTERPRET", "Linear", "apply_rotary", "make_experts", "paged_attention", "rms_norm",
           "rope_and_write_kv", "silu_and_mul", "write_kv"]
