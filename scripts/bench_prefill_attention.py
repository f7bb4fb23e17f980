#!/usr/bin/env python3
"""Prompt-chunk attention on the CPU: the native paged kernels against the torch path (SDPA over
the chunk's keys, gathered from the cache when it has context), same run, same inputs. "native"
is the fp32-FMA vector kernel; in bf16 the AVX512-BF16 dot-product kernel ("dot") and the AMX
tile kernel ("amx") run too where the CPU has them.

SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks scattered over the
pool). Each case is one step's multi-token rows, as `torch_attention.paged_attention` gets them:
(context, chunk length) per sequence.

    .venv/bin/python scripts/bench_prefill_attention.py [--dtypes float32,bfloat16] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from rill.kernels import cpu_native, ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (context, query length) of each prompt chunk in one step
CASES = {
    "one 512-token prompt": [(0, 512)],
    "3 prompts of 170": [(0, 170)] * 3,
    "chunk 200 after 100": [(100, 200)],
    "chunk 64 after 1500": [(1500, 64)],
    "8 prompts of 20-60": [(0, n) for n in (20, 33, 41, 60, 27, 55, 38, 46)],
}


def per_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ops.AttentionMetadata, native: bool,
             repeats: int, kernel: str = "vector") -> float:
    """Best seconds per call (the per-step plan is rebuilt each time, as every step does)."""
    os.environ["RILL_NATIVE_KERNELS"] = "1" if native else "0"
    os.environ["RILL_PREFILL_KERNEL"] = kernel
    times = []
    for _ in range(repeats + 1):
        meta.aux.clear()
        t0 = time.perf_counter()
        ops.paged_attention(q, k, v, meta, HEAD_DIM ** -0.5)
        times.append(time.perf_counter() - t0)
    os.environ.pop("RILL_PREFILL_KERNEL")
    return min(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("the native kernels did not build on this machine")
    rng = random.Random(0)
    extra = [k for k, ok in (("dot", cpu_native.dot_prefill_available()), ("amx", cpu_native.amx_prefill_available()))
             if ok]
    head = f"{'dtype':<9} | {'case':<22} | {'torch SDPA us':>13} | {'native us':>9} | {'speed-up':>8} | {'GFLOP/s':>7}"
    for k in extra:
        head += f" | {k + ' us':>7} | {'speed-up':>8} | {'GFLOP/s':>7}"
    print(head + "\n" + "-" * len(head))
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, chunks in CASES.items():
            need = [-(-(c + n) // BLOCK) for c, n in chunks]
            pool = sum(need) + 8
            ids = list(range(pool))
            rng.shuffle(ids)
            blocks = [[ids.pop() for _ in range(nb)] for nb in need]
            k = torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
            v = torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
            _, meta = ops.make_attention_metadata(blocks, [c for c, _ in chunks], [n for _, n in chunks], BLOCK)
            q = torch.randn(sum(n for _, n in chunks), HEADS, HEAD_DIM).to(dtype)
            plain = per_call(q, k, v, meta, False, args.repeats)
            native = per_call(q, k, v, meta, True, args.repeats)
            # causal: query i of a chunk sees context + i + 1 keys; QK and PV are 2 FLOP per MAC each
            flop = sum(4 * HEADS * HEAD_DIM * (n * c + n * (n + 1) / 2) for c, n in chunks)
            line = (f"{str(dtype).removeprefix('torch.'):<9} | {name:<22} | {plain * 1e6:>13.0f} | {native * 1e6:>9.0f} "
                    f"| {plain / native:>7.2f}x | {flop / native / 1e9:>7.1f}")
            for kernel in extra if dtype == torch.bfloat16 else []:
                t = per_call(q, k, v, meta, True, args.repeats, kernel)
                line += f" | {t * 1e6:>7.0f} | {plain / t:>7.2f}x | {flop / t / 1e9:>7.1f}"
            print(line)


if __name__ == "__main__":
    main()
