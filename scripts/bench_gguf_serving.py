#!/usr/bin/env python3
"""A .gguf served from its own blocks (--quantization gguf) against the same file dequantized
(--quantization none, in --dtype), in one run: the in-process engine (scheduler + model runner,
no broker), 1, 8 and 32 concurrent streams, greedy, EOS ignored. Prints TTFT p50, TPOT p50 and
output tok/s per setting, the ratio gguf / float, the weights each holds, and the CPU.

    .venv/bin/python scripts/bench_gguf_serving.py [MODEL.gguf] [--dtype bfloat16] [--prompt-len 256]
                                                   [--output-len 64] [--streams 1,8,32] [--turns 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _inproc_engine import Engine, percentile  # noqa: E402

from rill.kernels import chooser  # noqa: E402
from rill.kernels.native_build import cpu_flags  # noqa: E402
from rill.services.worker.model_runner import ModelRunner  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes the linear layers hold as served: blocks, float copies, and each float layer's
    prepared copies (oneDNN-packed, small-GEMM packed) alike."""
    return sum(lin.nbytes for lin in runner.model.linears())


def run(runner: ModelRunner, streams: int, prompt_len: int, output_len: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = runner.cfg.vocab_size
    engine = Engine(runner, budget=2048, caching=False, max_seqs=max(streams, 1))
    start = time.perf_counter()
    rids = [f"r{seed}-{i}" for i in range(streams)]
    for rid in rids:
        engine.submit(rid, [rng.randrange(100, vocab - 100) for _ in range(prompt_len)], output_len)
    engine.drain()
    wall = time.perf_counter() - start
    tl = engine.timeline
    gaps = [g for rid in rids for g in tl.gaps(rid)]
    return {"ttft": percentile([tl.ttft(r) for r in rids], 0.5), "tpot": statistics.median(gaps),
            "tok_s": streams * output_len / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--turns", type=int, default=2, help="runs of each setting, interleaved; medians reported")
    args = p.parse_args()
    model_dir = str(resolve_model(args.model))
    streams = [int(s) for s in args.streams.split(",")]
    blocks = 4 + sum(-(-(args.prompt_len + args.output_len) // 16) for _ in range(max(streams)))
    runners = {q: ModelRunner(model_dir, dtype=args.dtype, quantization=q, num_blocks=blocks)
               for q in ("none", "gguf")}
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
                     if f in cpu_flags().split())
    print(f"# {Path(model_dir).name}, {args.dtype}, prompt {args.prompt_len}, output {args.output_len}; "
          f"CPU {chooser.cpu_model()} [{flags}]")
    for q, r in runners.items():
        print(f"# weights of the linear layers as served, {q}: {weight_bytes(r) / 2 ** 20:.0f} MiB")
    for r in runners.values():  # warm-up: first calls allocate and fault in pages
        run(r, 1, 32, 4, seed=0)
    print("| streams | quantization | TTFT p50 ms | TPOT p50 ms | output tok/s |")
    print("|---|---|---|---|---|")
    for n in streams:
        got: dict[str, list[dict[str, float]]] = {"none": [], "gguf": []}
        for turn in range(args.turns):
            for q in ("none", "gguf") if turn % 2 == 0 else ("gguf", "none"):
                got[q].append(run(runners[q], n, args.prompt_len, args.output_len, seed=turn + 1))
        med = {q: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for q, rows in got.items()}
        for q in ("none", "gguf"):
            m = med[q]
            print(f"| {n} | {q} | {m['ttft'] * 1e3:.0f} | {m['tpot'] * 1e3:.1f} | {m['tok_s']:.1f} |")
        print(f"| {n} | gguf / none | {med['gguf']['ttft'] / med['none']['ttft']:.2f}x | "
              f"{med['gguf']['tpot'] / med['none']['tpot']:.2f}x | "
              f"{med['gguf']['tok_s'] / med['none']['tok_s']:.2f}x |")


if __name__ == "__main__":
    main()
