#!/usr/bin/env python3
"""Native CPU decode attention: the AVX-512 register path against the generic loop, same run.

SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), sequences of 84–364
tokens in blocks scattered over the pool, one call per layer over 30 layers' caches in turn (so
the KV streams from memory, as in a model step, instead of staying in the last-level cache).

    .venv/bin/python scripts/bench_decode_attention.py [--layers 30] [--batches 16,32,64]
"""

from __future__ import annotations

import argparse
import os
import random
import time

# Huge pages for the caches, as `rill service worker` sets them (scattered blocks, fewer TLB misses).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import torch  # noqa: E402

from rill.kernels import cpu_native  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def per_layer(caches: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, tables: torch.Tensor,
              seq_lens: torch.Tensor, out: torch.Tensor, generic_only: bool, repeats: int) -> float:
    """Best seconds per layer call over `repeats` passes through every layer's cache."""
    rows = torch.arange(q.shape[0], dtype=torch.int64)
    max_len = int(seq_lens.max())

    def one_pass() -> None:
        for k, v in caches:
            cpu_native.paged_decode(q, k, v, tables, seq_lens, rows, out, max_len, HEAD_DIM ** -0.5,
                                    generic_only=generic_only)

    one_pass()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        times.append((time.perf_counter() - t0) / len(caches))
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batches", default="16,32,64")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("the native kernels did not build on this machine")
    rng = random.Random(0)
    print(f"{'dtype':<9} | {'batch':>5} | {'generic us/layer':>16} | {'register us/layer':>17} | {'speed-up':>8} "
          f"| {'KV GB/s (register)':>18}")
    print("-" * 90)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            lens = [rng.randint(20, 300) + 64 for _ in range(batch)]
            need = [-(-n // BLOCK) for n in lens]
            pool = sum(need) * 2
            ids = list(range(pool))
            rng.shuffle(ids)
            tables = torch.zeros(batch, max(need), dtype=torch.int32)
            for i, nb in enumerate(need):
                tables[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)], dtype=torch.int32)
            caches = [(torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
                       torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)) for _ in range(args.layers)]
            q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
            out = torch.empty_like(q)
            seq_lens = torch.tensor(lens, dtype=torch.int32)

            best = {generic_only: per_layer(caches, q, tables, seq_lens, out, generic_only, args.repeats)
                    for generic_only in (True, False)}
            kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * q.element_size()
            print(f"{str(dtype).removeprefix('torch.'):<9} | {batch:>5} | {best[True] * 1e6:>16.0f} | "
                  f"{best[False] * 1e6:>17.0f} | {best[True] / best[False]:>7.2f}x | {kv_bytes / best[False] / 1e9:>18.1f}")


if __name__ == "__main__":
    main()
