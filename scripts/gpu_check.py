#!/usr/bin/env python
"""Verify and time Rill's Triton kernels: one command, under 5 minutes on a CUDA GPU.

    .venv/bin/python scripts/gpu_check.py                  # everything this machine can do
    .venv/bin/python scripts/gpu_check.py --compile-only   # just the sm_90 compile report
    .venv/bin/python scripts/gpu_check.py --smoke          # every section at tiny shapes (tests the script)

On a CUDA machine it
  (a) measures the device's copy bandwidth and bf16 matmul rate (the "measured peaks"),
  (b) checks every kernel against float64 references on fresh random data with NaN-poisoned
      outputs, in bf16 and fp16 (plus a KV cache past 2^31 elements, for the int64 addressing),
  (c) times each kernel (median of `triton.testing.do_bench`, cold L2) and prints GB/s or
      TFLOP/s and the fraction of the measured peak, sweeps a few decode-kernel launch settings,
      and checks that decode time never drops as the batch grows at 8k context,
  (d) times a full decode step of a Llama-3-8B-shaped model with random bf16 weights at batch
      1 / 32 / 256 and context 1k / 4k, eager and from CUDA graphs, against the roofline
      (weights + KV bytes at the measured bandwidth),
  (e) with two GPUs or more, tensor parallelism: TP=2 over NCCL (tests/tp_case.py) against
      TP=1 on a tiny random Llama (fp32 logits through chunked prefill and decode; the decode
      step also through CUDA graphs captured on both ranks, their all-reduces inside), and the
      time of one NCCL all-reduce of a decode step's activations ([32, 4096] bf16),
and prints a compact table last.

On a CPU machine it runs what a CPU can check: (b) on tiny shapes under the Triton interpreter
(fp32, fp16 and bf16: the kernels upcast bf16 dot operands there), and a compile of every
kernel variant for sm_90 with the ptxas bundled in the Triton wheel, reporting registers, spill
bytes and shared memory; it says which GPU sections it skipped. Where 256 x 4k of KV does not
fit next to the weights (an H200 holds ~0.9M tokens), that row runs at the longest context that
fits and says so. The exit status is 1 when a correctness or compile check fails (missed
performance targets are reported, not fatal).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

START = time.monotonic()
BUDGET_S = 280.0  # stop starting optional work past this, to stay under 5 minutes
CUDA = torch.cuda.is_available()
COMPILE_ONLY = "--compile-only" in sys.argv
if not CUDA and not COMPILE_ONLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")

import triton  # noqa: E402  (after TRITON_INTERPRET is decided)

from rill.kernels import (  # noqa: E402
    gguf_blocks,
    moe,
    ops,
    triton_attention,
    triton_attention_kernels,
    triton_gguf,
    triton_moe,
    triton_ops,
)
from rill.kernels.triton_attention import (  # noqa: E402
    attention_bytes,
    choose_num_splits,
    decode_attention,
    extend_attention,
    extend_flops,
)

DEV = "cuda" if CUDA else "cpu"


@dataclass
class Row:
    section: str
    item: str
    value: str
    reference: str = ""
    status: str = ""


ROWS: list[Row] = []


def add(section: str, item: str, value: str, reference: str = "", status: str = "") -> None:
    ROWS.append(Row(section, item, value, reference, status))
    print(f"  [{section}] {item}: {value} {reference} {status}".rstrip(), flush=True)


def time_left() -> float:
    return BUDGET_S - (time.monotonic() - START)


@dataclass(frozen=True)
class Plan:
    """Shapes of the timing sections: Llama-3-8B on a GPU; tiny ones for --smoke."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block: int = 16
    hidden: int = 4096
    ffn: int = 14336
    layers: int = 32
    vocab: int = 128256
    copy_bytes: int = 1 << 30  # far past L2
    matmul: int = 8192
    decode_grid: tuple = ((1, 1024), (1, 8192), (32, 1024), (32, 4096), (32, 8192), (256, 1024), (256, 3072))
    split_probe: tuple = (32, 4096)  # where forced splits=1 is compared with the chosen split
    mono_ctx: int = 8192
    mono_batches: tuple = (8, 12, 16, 24, 32, 48, 64)
    sweep: tuple = ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 3))  # (tile, warps, stages)
    extend_cases: tuple = ((0, 4096), (6144, 2048))  # (cached prefix, new tokens)
    elem_tokens: tuple = (8192, 32)  # prefill size (bandwidth), decode size (latency)
    step_batches: tuple = (1, 32, 256)
    step_ctxs: tuple = (1024, 4096)
    kv_margin: int = 12 << 30  # memory left free next to the step benchmark's KV cache


FULL = Plan()
SMOKE = Plan(heads=4, kv_heads=2, head_dim=64, hidden=128, ffn=192, layers=2, vocab=512, copy_bytes=1 << 20,
             matmul=128, decode_grid=((1, 100), (4, 300)), split_probe=(4, 300), mono_ctx=200, mono_batches=(1, 2, 4),
             sweep=((32, 4, 3), (64, 4, 3)), extend_cases=((0, 40), (50, 20)), elem_tokens=(16, 4),
             step_batches=(1, 3), step_ctxs=(20, 60), kv_margin=0)
SMOKE_RUN = "--smoke" in sys.argv
P = SMOKE if SMOKE_RUN else FULL


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms of many runs, L2 flushed between runs (triton.testing.do_bench); on CPU
    (--smoke) the wall time of one run, only to exercise the code."""
    if not CUDA:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def timed_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean ms per call of `iters` back-to-back calls after one warm-up (CUDA events)."""
    fn()
    if not CUDA:  # --smoke on CPU: one timed call is enough to exercise the code
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4


def status(good: bool, bad: str = "BELOW") -> str:
    """A target verdict; meaningless (so blank) for --smoke timings."""
    return "" if SMOKE_RUN else ("ok" if good else bad)


# ================================================================================= (a) peaks


def measure_peaks() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 matmul FLOP/s) as this device really delivers them."""
    n = P.copy_bytes
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    bw = 2 * n / (ms * 1e-3)  # read + write
    m = P.matmul
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    ms = bench_ms(lambda: a @ b)
    flops = 2 * m ** 3 / (ms * 1e-3)
    add("peak", f"copy bandwidth ({n >> 20} MiB, read+write)", f"{bw / 1e12:.2f} TB/s")
    add("peak", f"bf16 matmul {m}^3", f"{flops / 1e12:.0f} TFLOP/s")
    return bw, flops


# ================================================================================= (b) correctness

TOL_ATTN = {torch.float32: (5e-5, 5e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
TOL_ELEM = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3.2e-2, 3.2e-2)}


def compare(item: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> bool:
    atol, rtol = tol
    got64 = got.double()
    want = want.double().to(got64.device)
    nan = bool(torch.isnan(got64).any())
    err = (got64 - want).abs()
    ratio = err / (atol + rtol * want.abs())  # <= 1 passes
    ok = not nan and bool((ratio <= 1).all())
    worst = float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0
    used = float(ratio.nan_to_num(float("inf")).max()) if err.numel() else 0.0
    name = str(dtype).replace("torch.", "")
    add("correct", f"{item} [{name}]", f"max err {worst:.1e}, {used:.0%} of tol" + (" NaN!" if nan else ""),
        f"(tol {atol:.0e}+{rtol:.0e}|ref|)", "ok" if ok else "FAIL")
    return ok


def gather_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               seq_lens: list[int], query_lens: list[int], scale: float) -> torch.Tensor:
    """float64 causal attention from explicitly gathered pages (GQA by head repetition)."""
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for i, (n, qn) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(n, device=q.device)
        blocks = tables[i, pos // bs].long()
        k = k_cache[blocks, pos % bs].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % bs].double().repeat_interleave(group, dim=1)
        s = torch.einsum("thd,khd->htk", q[start:start + qn].double(), k) * scale
        q_pos = n - qn + torch.arange(qn, device=q.device)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:start + qn] = torch.einsum("htk,khd->thd", s.softmax(-1), v)
        start += qn
    return out


def paged_case(seq_lens: list[int], query_lens: list[int], bs: int, kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, seed: int, min_block: int = 0, num_blocks: int | None = None):
    """Random KV for each sequence in shuffled blocks (ids >= min_block); every other slot is NaN
    unless the cache is too big to fill; block-table padding points at a NaN block."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    used = sum(need) + 1
    total = num_blocks or used + 2
    shape = (total, bs, kv_heads, head_dim)
    huge = total * bs * kv_heads * head_dim > (1 << 28)
    make = torch.empty if huge else (lambda s, **kw: torch.full(s, float("nan"), **kw))
    k_cache = make(shape, dtype=dtype, device=DEV)
    v_cache = make(shape, dtype=dtype, device=DEV)
    ids = (torch.randperm(total - min_block, generator=g, device=DEV)[:used] + min_block).tolist()
    poison = ids.pop()
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    width = max(need) + 1
    tables = torch.full((len(seq_lens), width), poison, dtype=torch.int32, device=DEV)
    for i, (n, nb) in enumerate(zip(seq_lens, need, strict=True)):
        own = [ids.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(own, dtype=torch.int32, device=DEV)
        pos = torch.arange(n, device=DEV)
        slot_b, slot_o = tables[i, pos // bs].long(), pos % bs
        k = torch.randn((n, kv_heads, head_dim), generator=g, device=DEV)
        k[torch.rand((n, kv_heads), generator=g, device=DEV) < 0.05] *= 4.0  # a few dominant keys
        k_cache[slot_b, slot_o] = k.to(dtype)
        v_cache[slot_b, slot_o] = torch.randn((n, kv_heads, head_dim), generator=g, device=DEV).to(dtype)
    q = (torch.randn((sum(query_lens), kv_heads * group, head_dim), generator=g, device=DEV) * 1.5).to(dtype)
    return q, k_cache, v_cache, tables


def check_attention(dtype: torch.dtype, big: bool) -> None:
    if big:
        configs = [(16, 8, 4, 128), (32, 8, 3, 128), (16, 2, 8, 64)]  # (block, kv heads, group, head_dim)
        dec_lens = [333, 1024, 2049, 3001]
        ext = [(0, 700), (1500, 300), (2000, 1), (0, 1), (37, 129), (15, 17)]
    else:
        configs = [(16, 2, 4, 64), (32, 1, 3, 128)]
        dec_lens = [100]
        ext = [(0, 37), (19, 31), (78, 1), (0, 1), (2, 9)]
    tol = TOL_ATTN[dtype]
    for bs, kvh, group, hd in configs:
        lens = [1, bs - 1, bs, bs + 1] + dec_lens  # ends mid-block, on a block edge, spans many blocks
        q, kc, vc, tables = paged_case(lens, [1] * len(lens), bs, kvh, group, hd, dtype, seed=bs + group + hd)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        want = gather_ref(q, kc, vc, tables, lens, [1] * len(lens), hd ** -0.5)
        for splits in (1, None, 7):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, kc, vc, tables, seq_lens, hd ** -0.5, max(lens), num_splits=splits, out=out)
            label = "auto" if splits is None else str(splits)
            compare(f"decode G={group} D={hd} bs={bs} splits={label}", dtype, out, want, tol)
        seq_l = [c + n for c, n in ext]
        q_l = [n for _, n in ext]
        q, kc, vc, tables = paged_case(seq_l, q_l, bs, kvh, group, hd, dtype, seed=7 + bs + group + hd)
        qsl = torch.tensor([0] + list(torch.tensor(q_l).cumsum(0)), dtype=torch.int32, device=DEV)
        out = torch.full_like(q, float("nan"))
        extend_attention(q, kc, vc, tables, torch.tensor(seq_l, dtype=torch.int32, device=DEV), qsl, hd ** -0.5,
                         max(q_l), out=out)
        compare(f"extend mixed G={group} D={hd} bs={bs}", dtype, out, gather_ref(q, kc, vc, tables, seq_l, q_l,
                                                                                hd ** -0.5), tol)
    if big:
        # > 2^31 elements per cache: block ids above 2^31 / (block elements) overflow int32 math.
        bs, kvh, group, hd = 16, 8, 4, 128
        per_block = bs * kvh * hd
        total = (1 << 31) // per_block + 4096
        lens = [3000, 77, 1]
        q, kc, vc, tables = paged_case(lens, [1] * 3, bs, kvh, group, hd, dtype, seed=99,
                                       min_block=(1 << 31) // per_block - 8, num_blocks=total)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kc, vc, tables, seq_lens, hd ** -0.5, max(lens), out=out)
        want = gather_ref(q, kc, vc, tables, lens, [1] * 3, hd ** -0.5)
        compare("decode, cache > 2^31 elements", dtype, out, want, tol)
        qsl = torch.arange(4, dtype=torch.int32, device=DEV)
        out2 = torch.full_like(q, float("nan"))
        extend_attention(q, kc, vc, tables, seq_lens, qsl, hd ** -0.5, 1, out=out2)
        compare("extend, cache > 2^31 elements", dtype, out2, want, tol)
        del kc, vc


def llama3_cos_sin(head_dim: int, max_pos: int) -> torch.Tensor:
    from rill.services.worker.rope import cos_sin_cache
    from rill.shared.config import ModelConfig

    cfg = ModelConfig(vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=max_pos, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return cos_sin_cache(cfg, max_pos, DEV)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    c = cs.double()[positions][:, None, :]
    x = x.double()
    return torch.cat((x[..., :half] * c[..., :half] - x[..., half:] * c[..., half:],
                      x[..., half:] * c[..., :half] + x[..., :half] * c[..., half:]), dim=-1)


def check_elementwise(dtype: torch.dtype, big: bool) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    tokens, hidden, ffn = (300, 4096, 14336) if big else (7, 72, 1100)
    heads, kv_heads, hd, bs, nblocks = (32, 8, 128, 16, 64) if big else (6, 2, 64, 16, 4)
    tol = TOL_ELEM[dtype]
    # RMSNorm with and without the residual add
    x = (torch.randn((tokens, hidden), generator=g, device=DEV) * 3).to(dtype)
    r = torch.randn((tokens, hidden), generator=g, device=DEV).to(dtype)
    w = (torch.rand(hidden, generator=g, device=DEV) * 2).to(dtype)
    out = torch.full_like(x, float("nan"))
    triton_ops.rms_norm(x, w, 1e-5, out=out)
    xd = x.double()
    compare("rms_norm", dtype, out, w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5), tol)
    out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    triton_ops.rms_norm(x, w, 1e-5, r, out=out, residual_out=res)
    compare("add+rms_norm: sum", dtype, res, xd + r.double(), tol)
    sd = res.double()
    compare("add+rms_norm: norm", dtype, out, w.double() * sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-5),
            tol)
    # SiLU-and-mul
    xg = (torch.randn((tokens, 2 * ffn), generator=g, device=DEV) * 3).to(dtype)
    out = torch.full((tokens, ffn), float("nan"), dtype=dtype, device=DEV)
    triton_ops.silu_and_mul(xg, out=out)
    gd, ud = xg.double()[:, :ffn], xg.double()[:, ffn:]
    compare("silu_and_mul", dtype, out, gd * torch.sigmoid(gd) * ud, tol)
    # fused RoPE (Llama-3 scaled tables) + cache write, in place on views of one qkv row
    qkv = (torch.randn((tokens, (heads + 2 * kv_heads) * hd), generator=g, device=DEV) * 2).to(dtype)
    q = qkv[:, :heads * hd].view(tokens, heads, hd)
    k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(tokens, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd:].view(tokens, kv_heads, hd)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEV)
    cs = llama3_cos_sin(hd, 8192)
    slots = torch.randperm(nblocks * bs, generator=g, device=DEV)[:tokens]
    slots[1] = -1
    q_want, k_want, v_in = rope_ref(q, positions, cs), rope_ref(k, positions, cs), v.clone()
    kc = torch.full((nblocks, bs, kv_heads, hd), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    triton_ops.rope_and_write_kv(q, k, v, positions, cs, kc, vc, slots)
    compare("rope_and_write_kv: q", dtype, q, q_want, tol)
    compare("rope_and_write_kv: k", dtype, k, k_want, tol)
    keep = slots >= 0
    cached = kc.view(-1, kv_heads, hd)[slots[keep]]
    exact = torch.equal(cached, k[keep]) and torch.equal(vc.view(-1, kv_heads, hd)[slots[keep]], v_in[keep])
    untouched = torch.ones(nblocks * bs, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    clean = bool(torch.isnan(kc.view(-1, kv_heads, hd)[untouched]).all())
    add("correct", f"rope_and_write_kv: cache rows [{str(dtype)[6:]}]", "exact" if exact else "differ",
        "(padding slot skipped, other slots untouched)" if clean else "(wrote outside its slots)",
        "ok" if exact and clean else "FAIL")
    # unfused rotary + write_kv
    q2 = torch.randn((tokens, heads, hd), generator=g, device=DEV).to(dtype)
    k2 = torch.randn((tokens, kv_heads, hd), generator=g, device=DEV).to(dtype)
    qo, ko = torch.full_like(q2, float("nan")), torch.full_like(k2, float("nan"))
    triton_ops.apply_rotary(q2, k2, positions, cs, q_out=qo, k_out=ko)
    compare("apply_rotary: q", dtype, qo, rope_ref(q2, positions, cs), tol)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    triton_ops.write_kv(k2, q2[:, :kv_heads], kc, vc, slots)
    exact = torch.equal(kc.view(-1, kv_heads, hd)[slots[keep]], k2[keep]) and \
        torch.equal(vc.view(-1, kv_heads, hd)[slots[keep]], q2[keep, :kv_heads])
    add("correct", f"write_kv [{str(dtype)[6:]}]", "exact" if exact else "differ", "", "ok" if exact else "FAIL")


# ================================================================================= (c) kernel timings


def check_moe(dtype: torch.dtype, big: bool) -> None:
    """The fused-MoE kernels against every expert run densely in fp32 (Qwen3-30B-A3B's experts:
    128 of 768 wide, top-8, when big; row blocks of 16 and 64)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    tokens, hidden, inter, experts, top_k = (300, 2048, 768, 128, 8) if big else (9, 72, 40, 6, 2)
    x = torch.randn((tokens, hidden), generator=g, device=DEV).to(dtype)
    gate_up = (torch.randn((experts, 2 * inter, hidden), generator=g, device=DEV) * hidden ** -0.5).to(dtype)
    down = (torch.randn((experts, hidden, inter), generator=g, device=DEV) * inter ** -0.5).to(dtype)
    weights, ids = moe.route(torch.randn((tokens, experts), generator=g, device=DEV), top_k, True, dtype)
    want = moe.dense_reference(x, gate_up, down, weights, ids)
    atol, rtol = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (4e-2, 3e-2)}[dtype]
    scale = float(want.abs().max())
    for block_m in (16, 64) if big else (16,):
        got = triton_moe.fused_experts(x, gate_up, down, weights, ids, block_m=block_m)
        compare(f"fused moe M={block_m}", dtype, got, want, (atol * scale, rtol))


def decode_inputs(batch: int, ctx: int, dtype: torch.dtype = torch.bfloat16):
    nbps = -(-ctx // P.block)
    k = torch.randn((batch * nbps, P.block, P.kv_heads, P.head_dim), dtype=dtype, device=DEV)
    v = torch.randn_like(k)
    tables = torch.randperm(batch * nbps, device=DEV).view(batch, nbps).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn((batch, P.heads, P.head_dim), dtype=dtype, device=DEV)
    return q, k, v, tables, seq_lens


def time_decode_attention(bw: float) -> None:
    h, kvh, d = P.heads, P.kv_heads, P.head_dim
    scale = d ** -0.5
    for batch, ctx in P.decode_grid:
        q, k, v, tables, seq_lens = decode_inputs(batch, ctx)
        splits = choose_num_splits(batch, kvh, ctx, num_sms(), triton_attention.DECODE_CONFIG["tile_n"])
        ms = bench_ms(lambda: decode_attention(q, k, v, tables, seq_lens, scale, ctx))  # noqa: B023
        nbytes = attention_bytes(batch, ctx, h, kvh, d, 2)
        frac = nbytes / (ms * 1e-3) / bw
        targeted = batch >= 32 and ctx >= 2048
        add("kernel", f"decode attn B={batch} ctx={ctx} splits={splits}",
            f"{ms * 1e3:.1f} us {nbytes / (ms * 1e-3) / 1e9:.0f} GB/s",
            f"{frac:.0%} of copy" + (" (target >=75%)" if targeted else ""), status(frac >= 0.75) if targeted else "")
        if (batch, ctx) == P.split_probe:
            ms1 = bench_ms(lambda: decode_attention(q, k, v, tables, seq_lens, scale, ctx, num_splits=1))  # noqa: B023
            add("kernel", "  same, forced splits=1", f"{ms1 * 1e3:.1f} us", f"({ms1 / ms:.2f}x the chosen split)")
        if batch == 1 and splits > 1:
            part_out = torch.randn((1, h, splits, d), device=DEV)
            part_lse = torch.randn((1, h, splits), device=DEV)
            out = torch.empty((1, h, d), dtype=torch.bfloat16, device=DEV)
            red = bench_ms(lambda: triton_attention_kernels.reduce_kernel[(1, h)](  # noqa: B023
                part_out, part_lse, out, splits, out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=d,  # noqa: B023
                BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4))  # noqa: B023
            add("kernel", f"  reduce stage share B=1 ctx={ctx}", f"{red / ms:.0%}", "(target <=10%)",
                status(red / ms <= 0.10, "ABOVE"))
        if time_left() < 150:
            add("kernel", "decode grid", "cut short", "(time budget)")
            break
    # No cliff where splitting stops: time must not drop as the batch grows.
    times = []
    for batch in P.mono_batches:
        q, k, v, tables, seq_lens = decode_inputs(batch, P.mono_ctx)
        times.append(bench_ms(lambda: decode_attention(q, k, v, tables, seq_lens, scale, P.mono_ctx)))  # noqa: B023
    mono = all(b >= a * 0.97 for a, b in zip(times, times[1:], strict=False))
    add("kernel", f"decode time vs batch {P.mono_batches[0]}..{P.mono_batches[-1]} at ctx {P.mono_ctx}",
        " ".join(f"{t * 1e3:.0f}" for t in times) + " us", "(must not drop as batch grows)", status(mono, "CLIFF"))
    if time_left() > 170:
        batch, ctx = P.split_probe
        q, k, v, tables, seq_lens = decode_inputs(batch, ctx)
        saved = dict(triton_attention.DECODE_CONFIG)
        results = []
        try:
            for tile, warps, stages in P.sweep:
                triton_attention.DECODE_CONFIG.update(tile_n=tile, num_warps=warps, num_stages=stages)
                results.append((bench_ms(lambda: decode_attention(q, k, v, tables, seq_lens, scale, ctx)),  # noqa: B023
                                (tile, warps, stages)))
        finally:
            triton_attention.DECODE_CONFIG.update(saved)
        best = min(results)
        add("kernel", f"decode launch sweep B={batch} ctx={ctx} (tile,warps,stages)",
            " ".join(f"{c}:{t * 1e3:.0f}us" for t, c in results), f"best {best[1]} (default {tuple(saved.values())})")


def time_other_kernels(bw: float, flops: float) -> None:
    h, kvh, d, bs = P.heads, P.kv_heads, P.head_dim, P.block
    scale = d ** -0.5
    for ctx, qlen in P.extend_cases:
        seq = ctx + qlen
        nb = -(-seq // bs)
        kc = torch.randn((nb, bs, kvh, d), dtype=torch.bfloat16, device=DEV)
        vc = torch.randn_like(kc)
        tables = torch.randperm(nb, device=DEV).view(1, nb).to(torch.int32)
        q = torch.randn((qlen, h, d), dtype=torch.bfloat16, device=DEV)
        qsl = torch.tensor([0, qlen], dtype=torch.int32, device=DEV)
        sl = torch.tensor([seq], dtype=torch.int32, device=DEV)
        ms = bench_ms(lambda: extend_attention(q, kc, vc, tables, sl, qsl, scale, qlen))  # noqa: B023
        tf = extend_flops([qlen], [seq], h, d) / (ms * 1e-3)
        add("kernel", f"extend attn q={qlen} after ctx={ctx}", f"{ms * 1e3:.0f} us {tf / 1e12:.0f} TFLOP/s",
            f"{tf / flops:.0%} of matmul (target >=44%)", status(tf / flops >= 0.44))
    for tokens in P.elem_tokens:
        big = tokens > 1000 or SMOKE_RUN and tokens == P.elem_tokens[0]
        hid, ffn = P.hidden, P.ffn
        x = torch.randn((tokens, hid), dtype=torch.bfloat16, device=DEV)
        r = torch.randn_like(x)
        w = torch.rand(hid, dtype=torch.bfloat16, device=DEV)
        ms = bench_ms(lambda: triton_ops.rms_norm(x, w, 1e-5, r))  # noqa: B023
        gbs = 4 * x.numel() * 2 / (ms * 1e-3)
        add("kernel", f"add+rms_norm T={tokens}", f"{ms * 1e3:.1f} us {gbs / 1e9:.0f} GB/s",
            f"{gbs / bw:.0%} of copy" + (" (target >=75%)" if big else ""), status(gbs / bw >= 0.75) if big else "")
        xg = torch.randn((tokens, 2 * ffn), dtype=torch.bfloat16, device=DEV)
        ms = bench_ms(lambda: triton_ops.silu_and_mul(xg))  # noqa: B023
        gbs = 3 * tokens * ffn * 2 / (ms * 1e-3)
        add("kernel", f"silu_and_mul T={tokens}", f"{ms * 1e3:.1f} us {gbs / 1e9:.0f} GB/s",
            f"{gbs / bw:.0%} of copy" + (" (target >=75%)" if big else ""), status(gbs / bw >= 0.75) if big else "")
        qkv = torch.randn((tokens, (h + 2 * kvh) * d), dtype=torch.bfloat16, device=DEV)
        qv = qkv[:, :h * d].view(tokens, h, d)
        kv_ = qkv[:, h * d:(h + kvh) * d].view(tokens, kvh, d)
        vv = qkv[:, (h + kvh) * d:].view(tokens, kvh, d)
        nb = -(-tokens // bs) + 1
        kc = torch.zeros((nb, bs, kvh, d), dtype=torch.bfloat16, device=DEV)
        vc = torch.zeros_like(kc)
        pos = torch.arange(tokens, device=DEV)
        cs = llama3_cos_sin(d, max(tokens, 16))
        slots = torch.randperm(nb * bs, device=DEV)[:tokens]
        ms = bench_ms(lambda: triton_ops.rope_and_write_kv(qv, kv_, vv, pos, cs, kc, vc, slots))  # noqa: B023
        gbs = tokens * d * 2 * (2 * h + 2 * kvh + kvh + 2 * kvh) / (ms * 1e-3)
        small = not big
        add("kernel", f"rope+cache write T={tokens}", f"{ms * 1e3:.1f} us {gbs / 1e9:.0f} GB/s",
            f"{gbs / bw:.0%} of copy" + (" (target <=3us)" if small else ""),
            status(ms * 1e3 <= 3.0, "ABOVE") if small else "")


# ================================================================================= (d) decode steps


def random_llama(max_positions: int):
    """A Llama-3-8B-shaped model (P's shapes) with random bf16 weights, and the weight bytes one
    decode step must read (every projection and the LM head; the embedding is only gathered)."""
    from rill.services.worker.llama import LlamaModel
    from rill.services.worker.llama_weights import LayerWeights
    from rill.shared.config import ModelConfig

    cfg = ModelConfig(vocab_size=P.vocab, hidden_size=P.hidden, intermediate_size=P.ffn, num_hidden_layers=P.layers,
                      num_attention_heads=P.heads, num_key_value_heads=P.kv_heads, head_dim=P.head_dim,
                      rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=max_positions,
                      tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=torch.bfloat16, device=DEV) * 0.02

    def ones() -> torch.Tensor:
        return torch.ones(P.hidden, dtype=torch.bfloat16, device=DEV)

    qkv_rows, q_size = (P.heads + 2 * P.kv_heads) * P.head_dim, P.heads * P.head_dim
    layers = [LayerWeights(input_norm=ones(), qkv=ops.make_linear(w(qkv_rows, P.hidden)),
                           o=ops.make_linear(w(P.hidden, q_size)), post_norm=ones(),
                           gate_up=ops.make_linear(w(2 * P.ffn, P.hidden)), down=ops.make_linear(w(P.hidden, P.ffn)))
              for _ in range(P.layers)]
    weight_bytes = 2 * P.layers * (qkv_rows * P.hidden + P.hidden * q_size + 3 * P.ffn * P.hidden) \
        + 2 * P.vocab * P.hidden
    model = LlamaModel(cfg, w(P.vocab, P.hidden), layers, ones(), w(P.vocab, P.hidden), max_positions)
    return model, weight_bytes


def time_decode_steps(bw: float) -> None:
    from rill.services.worker.cuda_graphs import DecodeGraphs

    max_ctx, bs = max(P.step_ctxs), P.block
    if CUDA:
        torch.cuda.empty_cache()  # earlier sections' buffers: free them for the KV cache sizing below
    model, weight_bytes = random_llama(max_ctx)
    kv_per_token = P.layers * 2 * P.kv_heads * P.head_dim * 2
    block_bytes = kv_per_token * bs
    want_blocks = max(P.step_batches) * -(-max_ctx // bs)
    if CUDA:
        free = torch.cuda.mem_get_info()[0]
        num_blocks = min(want_blocks, int((free - P.kv_margin) // block_bytes))
    else:
        num_blocks = want_blocks
    kv = model.allocate_kv_cache(num_blocks, bs)
    add("step", f"Llama-3-8B shape ({P.layers} layers), random bf16", f"weights {weight_bytes / 1e9:.2f} GB",
        f"KV cache {num_blocks * block_bytes / 1e9:.1f} GB ({num_blocks * bs} tokens)")
    graphs = DecodeGraphs(model, kv, bs, max_model_len=max_ctx, sizes=list(P.step_batches))
    if CUDA:
        t0 = time.monotonic()
        graphs.capture()
        add("step", f"capture {len(P.step_batches)} decode graphs", f"{time.monotonic() - t0:.1f} s")
    perm = torch.randperm(num_blocks).tolist()
    for batch in P.step_batches:
        for ctx in P.step_ctxs:
            if time_left() < 20:
                add("step", f"B={batch} ctx={ctx}", "skipped", "(time budget)")
                continue
            fit = ctx
            while fit > 0 and batch * -(-fit // bs) > num_blocks:
                fit -= 512 if fit > 512 else fit
            if fit <= 0:
                add("step", f"B={batch} ctx={ctx}", "skipped", "(KV cache too small)")
                continue
            note = "" if fit == ctx else f" (ctx {ctx} needs {batch * ctx * kv_per_token / 1e9:.0f} GB KV)"
            nbps = -(-fit // bs)
            blocks = [perm[i * nbps:(i + 1) * nbps] for i in range(batch)]
            computed = [fit - 1] * batch
            tokens = [(17 * i) % P.vocab for i in range(batch)]
            positions, meta = ops.make_attention_metadata(blocks, computed, [1] * batch, bs, DEV)
            ids = torch.tensor(tokens, device=DEV)
            last = torch.arange(batch, device=DEV)
            with torch.inference_mode():
                eager = timed_ms(lambda: model.forward(ids, positions, meta, kv, last), 5)  # noqa: B023
                want = model.forward(ids, positions, meta, kv, last).float()
                got = graphs.run(tokens, computed, blocks).float().clone()
                replay_fn = graphs.graphs[batch][0].replay if graphs.captured else \
                    (lambda: graphs.run(tokens, computed, blocks))  # noqa: B023
                replay = timed_ms(replay_fn, 10)
                full = timed_ms(lambda: graphs.run(tokens, computed, blocks), 5)  # noqa: B023
            diff = float((got - want).abs().max()) / max(1e-6, float(want.abs().max()))
            roof = (weight_bytes + batch * fit * kv_per_token) / bw * 1e3
            targeted = batch == 1
            add("step", f"B={batch} ctx={fit}{note}",
                f"graph {replay:.2f} ms (+host {full:.2f}) eager {eager:.2f} ms",
                f"roofline {roof:.2f} ms -> {replay / roof:.2f}x" + (" (target <=1.25x)" if targeted else "")
                + f"; graph speedup {eager / replay:.2f}x; graph vs eager logits rel diff {diff:.1e}",
                status(replay <= 1.25 * roof, "ABOVE") if targeted else "")
            if diff > 2e-2:
                add("step", f"  graph vs eager B={batch} ctx={fit}", f"rel diff {diff:.1e}", "(> 2e-2)", "FAIL")


# ================================================================================= sm_90 compile report


def compile_report() -> list[tuple[str, int, int, int]]:
    """Compile each kernel variant the Llama-3-8B / SmolLM2 shapes use for sm_90 (no GPU needed:
    Triton's bundled ptxas) and read registers, spill (stack) bytes and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ta, tk, to = triton_attention, triton_attention_kernels, triton_ops
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = os.path.join(bin_dir, "cuobjdump")
    if CUDA:
        major, minor = torch.cuda.get_device_capability()
        target = GPUTarget("cuda", major * 10 + minor, 32)
    else:
        target = GPUTarget("cuda", 90, 32)
    bf = "*bf16"
    attn_ptrs = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, tables_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32",
                     out_ptr=bf, part_out_ptr="*fp32", part_lse_ptr="*fp32")
    dec = dict(BLOCK_H=16, BLOCK_SIZE=16, TILE_N=ta.DECODE_CONFIG["tile_n"], UPCAST=False, PRECISION="tf32",
               SOFTCAP=False)
    sf = {"scale_log2", "softcap_log2"}
    dw, ds = ta.DECODE_CONFIG["num_warps"], ta.DECODE_CONFIG["num_stages"]
    e128, e16, e256 = ta.extend_config(128, 128), ta.extend_config(16, 128), ta.extend_config(128, 256)
    rope_ptrs = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, q_out_ptr=bf, k_out_ptr=bf, pos_ptr="*i64", cs_ptr="*fp32",
                     k_cache_ptr=bf, v_cache_ptr=bf, slot_ptr="*i64")
    variants = [
        ("decode split  G=4 D=128", tk.decode_kernel, attn_ptrs, sf,
         dict(dec, GROUP=4, HEAD_DIM=128, BLOCK_D=128, SPLIT=True), dw, ds),
        ("decode 1-pass G=4 D=128", tk.decode_kernel, attn_ptrs, sf,
         dict(dec, GROUP=4, HEAD_DIM=128, BLOCK_D=128, SPLIT=False), dw, ds),
        ("decode split  G=3 D=64", tk.decode_kernel, attn_ptrs, sf,
         dict(dec, GROUP=3, HEAD_DIM=64, BLOCK_D=64, SPLIT=True), dw, ds),
        ("reduce S<=64 D=128", tk.reduce_kernel, attn_ptrs, set(), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64), 4, 1),
        ("extend M=128 G=4 D=128", tk.extend_kernel, attn_ptrs, sf,
         dict(GROUP=4, BLOCK_M=128, BLOCK_Q=32, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=e128[0],
              UPCAST=False, PRECISION="tf32", SOFTCAP=False), e128[1], e128[2]),
        ("extend M=16 G=4 D=128", tk.extend_kernel, attn_ptrs, sf,
         dict(GROUP=4, BLOCK_M=16, BLOCK_Q=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=e16[0],
              UPCAST=False, PRECISION="tf32", SOFTCAP=False), e16[1], e16[2]),
        # Gemma 2's shape: head_dim 256, GQA 2, attention logit soft-capping.
        ("decode split  G=2 D=256 softcap", tk.decode_kernel, attn_ptrs, sf,
         dict(dec, GROUP=2, HEAD_DIM=256, BLOCK_D=256, SPLIT=True, TILE_N=32, SOFTCAP=True), dw, ds),
        ("extend M=128 G=2 D=256 softcap", tk.extend_kernel, attn_ptrs, sf,
         dict(GROUP=2, BLOCK_M=128, BLOCK_Q=64, HEAD_DIM=256, BLOCK_D=256, BLOCK_SIZE=16, TILE_N=e256[0],
              UPCAST=False, PRECISION="tf32", SOFTCAP=True), e256[1], e256[2]),
        ("add+rms_norm H=4096", to._rms_norm_kernel, dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, res_out_ptr=bf),
         {"eps"}, dict(HAS_RES=True, BLOCK=4096), 8, 1),
        ("silu_and_mul", to._silu_and_mul_kernel, dict(x_ptr=bf, out_ptr=bf), set(), dict(BLOCK=1024), 4, 1),
        ("rope+cache 32/8 D=128", to._rope_cache_kernel, rope_ptrs, set(),
         dict(HALF=64, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64, BLOCK_SIZE=16, ROTATE=True, WRITE_CACHE=True), 4, 1),
        ("write_kv 8 D=128", to._rope_cache_kernel, rope_ptrs, set(),
         dict(HALF=64, BLOCK_HQ=8, BLOCK_HKV=8, BLOCK_HALF=64, BLOCK_SIZE=16, ROTATE=False, WRITE_CACHE=True), 4, 1),
    ]
    # The fused-MoE grouped GEMMs at their decode and prefill row blocks (Qwen3-30B-A3B: top-8).
    moe_ptrs = dict(x_ptr=bf, h_ptr=bf, w_ptr=bf, out_ptr=bf, weights_ptr=bf, sorted_ptr="*i64",
                    block_expert_ptr="*i64")
    block_n, block_k, moe_warps, moe_stages = triton_moe.CONFIG
    for block_m in (16, 64):
        tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=False, PRECISION="tf32")
        variants += [
            (f"moe gate_up M={block_m}", triton_moe._gate_up_kernel, moe_ptrs, set(), dict(tiles, TOP_K=8),
             moe_warps, moe_stages),
            (f"moe down M={block_m}", triton_moe._down_kernel, moe_ptrs, set(), tiles, moe_warps, moe_stages)]
    # The GGUF GEMM (triton_gguf.py): 4-bit codes two to a byte with a min (Q4_1 / Q4_K), 8-bit
    # ones (Q8_0), groups of 16 (Q6_K); its decode and prefill row blocks.
    gguf_ptrs = dict(x_ptr=bf, code_ptr="*u8", scale_ptr="*fp32", zero_ptr="*fp32", y_ptr="*fp32")
    few, block_m, block_n, gguf_warps = triton_gguf.CONFIG
    for bm in (few, block_m):
        for label, packed4, group, zero, offset in (("Q4_1", True, 32, True, 0), ("Q8_0", False, 32, False, 128),
                                                    ("Q6_K", False, 16, False, 32)):
            variants.append((f"gguf {label} M={bm}", triton_gguf._gguf_gemm_kernel, gguf_ptrs, set(),
                             dict(OFFSET=offset, GROUP=group, PACKED4=packed4, HAS_ZERO=zero, UPCAST=False,
                                  PRECISION="tf32", BLOCK_M=bm, BLOCK_N=block_n), gguf_warps, 1))
    report = []
    for name, fn, ptrs, floats, consts, warps, stages in variants:
        sig, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in consts:
                sig[arg] = "constexpr"
            elif arg in ptrs:
                sig[arg] = ptrs[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[arg] = "fp32" if arg in floats else "i32"
                if arg.startswith("stride") and arg != "stride_table":  # as the JIT specialises real shapes
                    attrs[(i,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=target,
                                options={"num_warps": warps, "num_stages": stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        regs, stack = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
        report.append((name, regs, stack, int(kernel.metadata.shared)))
        print(f"COMPILED {name}: sm_{target.arch} regs={regs} spill_bytes={stack} smem={kernel.metadata.shared}"
              f" warps={warps} stages={stages}", flush=True)
    return report


def run_compile_report_subprocess() -> None:
    """The compile report needs compiled (not interpreted) kernels: a fresh process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile-only"], env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPILED ")]
    for ln in lines:
        name, _, rest = ln[len("COMPILED "):].partition(": ")
        spill = re.search(r"spill_bytes=(\d+)", rest)
        add("compile", name, rest, "", "ok" if spill and spill.group(1) == "0" else "SPILLS")
    if proc.returncode != 0 or not lines:
        add("compile", "sm_90 compile", "failed", (proc.stderr or proc.stdout)[-400:], "FAIL")


# ================================================================================= main


def check_tensor_parallel() -> None:
    """(e): two ranks of tests/tp_case.py on GPUs 0 and 1, against TP=1 on GPU 0."""
    import socket
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    from rill.services.worker.llama import LlamaModel

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from tp_case import steps

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1001, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        procs = [subprocess.Popen([sys.executable, str(root / "tests" / "tp_case.py"), str(r), "2", address, tmp,
                                   "cuda", tmp, f"triton:{tmp}"]) for r in range(2)]
        codes = [p.wait(240) for p in procs]
        if any(codes):
            add("tp", "TP=2 over NCCL", f"ranks exited {codes}", "", "FAIL")
            return
        want = steps(LlamaModel.load(tmp, torch.float32, device="cuda")).cpu()
        got = torch.load(Path(tmp) / "logits-0.pt")
        err = float((got - want).abs().max())
        add("tp", "TP=2 logits vs TP=1 (fp32)", f"max abs err {err:.2e}", "(< 1e-3)", "ok" if err < 1e-3 else "FAIL")
        ops.set_backend("triton")
        try:  # the decode step through CUDA graphs captured on both ranks, all-reduces inside
            want = steps(LlamaModel.load(tmp, torch.float32, device="cuda")).cpu()[-2:]
        finally:
            ops.set_backend(None)
        err = float((torch.load(Path(tmp) / "graph-1.pt") - want).abs().max())
        add("tp", "TP=2 decode CUDA graphs vs TP=1 (fp32)", f"max abs err {err:.2e}", "(< 1e-3)",
            "ok" if err < 1e-3 else "FAIL")
        us = (Path(tmp) / "allreduce_us.txt").read_text()
        add("tp", "NCCL all-reduce [32, 4096] bf16", f"{us} us")


def print_table() -> None:
    print("\n" + "=" * 118)
    print(f"RILL GPU CHECK SUMMARY  device={torch.cuda.get_device_name(0) if CUDA else 'cpu (no CUDA)'}"
          f"{' SMOKE SHAPES (timings meaningless)' if SMOKE_RUN else ''}  "
          f"torch={torch.__version__} triton={triton.__version__}  {time.monotonic() - START:.0f}s")
    print("=" * 118)
    w_item = min(48, max(len(r.item) for r in ROWS))
    for r in ROWS:
        print(f"{r.section:8} {r.item[:w_item]:{w_item}} {r.value:34} {r.status:6} {r.reference}")
    bad = [r for r in ROWS if r.status in ("FAIL", "SPILLS", "CLIFF")]
    missed = [r for r in ROWS if r.status in ("BELOW", "ABOVE")]
    print("-" * 118)
    print(f"correctness/compile failures: {len(bad)}   performance targets missed: {len(missed)}")


def check_gguf(dtype: torch.dtype, big: bool) -> None:
    """The GGUF GEMM (triton_gguf.py) against the GEMM of its weights dequantized and rounded to
    `dtype`, each code layout (Q4_1, Q4_K: 4-bit pairs with a min; Q8_0; Q6_K: groups of 16); when
    big, at Llama-3-8B's gate/up shape, and timed against cuBLAS on the bf16 weight at 1 and 256 rows."""
    g = torch.Generator(device="cpu").manual_seed(3)
    n, k = (14336, 4096) if big else (40, 256)
    for qtype in (gguf_blocks.Q4_1, gguf_blocks.Q4_K, gguf_blocks.Q8_0, gguf_blocks.Q6_K):
        raw = gguf_blocks.random_blocks(qtype, n, k, seed=qtype)
        lin = triton_gguf.QuantLinear([(qtype, raw)], k, None, dtype, DEV)
        w = gguf_blocks.dequantize(raw, qtype, k).to(DEV).to(dtype)
        x = torch.randn((9, k), generator=g).to(DEV).to(dtype)
        want = x.float() @ w.float().T
        # bf16: the interpreter's fp32 -> bf16 cast is not round-to-nearest-even as torch's is.
        tol = 4e-2 if dtype == torch.bfloat16 and not CUDA else 1e-3
        compare(f"gguf {gguf_blocks.name(qtype)} {n}x{k}", dtype, lin.float_out(x), want,
                (tol * float(want.abs().max()), tol))
        if big and qtype == gguf_blocks.Q4_1 and dtype == torch.bfloat16:
            for m in (1, 256):
                xm = torch.randn((m, k), generator=g).to(DEV).to(dtype)
                ms, ref = bench_ms(lambda: lin(xm)), bench_ms(lambda: xm @ w.T)  # noqa: B023
                add("gguf", f"Q4_1 GEMM {n}x{k}, {m} rows", f"{ms:.3f} ms", f"(cuBLAS bf16 {ref:.3f} ms, "
                    f"{lin.nbytes / 2 ** 20:.0f} vs {w.numel() * 2 / 2 ** 20:.0f} MiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="only compile every kernel for sm_90")
    parser.add_argument("--smoke", action="store_true",
                        help="run every section with tiny shapes (on CPU too): checks the script, not the GPU")
    args = parser.parse_args()
    if args.compile_only:
        compile_report()
        return 0
    torch.manual_seed(0)
    if args.smoke and not CUDA:
        ops.set_backend("triton")  # the model steps too go through the (interpreted) Triton kernels
    if CUDA or args.smoke:
        print(f"device: {torch.cuda.get_device_name(0) if CUDA else 'cpu'}{' (smoke shapes)' if args.smoke else ''}",
              flush=True)
        bw, flops = measure_peaks()
        for dtype in (torch.bfloat16, torch.float16):
            check_attention(dtype, big=CUDA and not args.smoke)
            check_elementwise(dtype, big=CUDA and not args.smoke)
            check_moe(dtype, big=CUDA and not args.smoke)
            check_gguf(dtype, big=CUDA and not args.smoke)
        time_decode_attention(bw)
        time_other_kernels(bw, flops)
        if time_left() > 40:
            time_decode_steps(bw)
        else:
            add("step", "full decode steps", "skipped", "(time budget)")
        if CUDA:
            torch.cuda.empty_cache()
            run_compile_report_subprocess()
        if CUDA and torch.cuda.device_count() > 1:
            check_tensor_parallel()
        elif CUDA:
            add("skipped", "(e) tensor parallelism", "needs two GPUs")
    else:
        print("no CUDA device: running the CPU-checkable parts (Triton interpreter, sm_90 compile)", flush=True)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            check_attention(dtype, big=False)
            check_elementwise(dtype, big=False)
            check_moe(dtype, big=False)
            check_gguf(dtype, big=False)
        run_compile_report_subprocess()
        for what in ("(a) copy bandwidth and bf16 matmul peaks", "(b) bf16/fp16 checks at full Llama-3-8B shapes "
                     "and the > 2^31-element cache", "(c) per-kernel timings, decode launch sweep, batch "
                     "monotonicity", "(d) Llama-3-8B decode steps, eager vs CUDA graphs, vs roofline"):
            add("skipped", what, "needs a CUDA GPU")
    print_table()
    failures = sum(r.status in ("FAIL", "SPILLS", "CLIFF") for r in ROWS)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

