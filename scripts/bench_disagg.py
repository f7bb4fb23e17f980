#!/usr/bin/env python3
"""TTFT and inter-token latency, colocated vs disaggregated (1 prefill + 1 decode engine), on the
same model, workload and machine, in one run.

Workload: `--streams` requests with short prompts decode `--stream-tokens` tokens each (EOS
ignored); once they all stream, `--long` requests with `--long-len`-token prompts arrive
`--long-every` seconds apart (each generating `--long-tokens`). Every request streams over HTTP;
TTFT and ITL are measured at the client, as `rill bench serve` does.

  colocated:      `rill serve` (one engine; its worker gets every core)
  disaggregated:  `rill serve --prefill-engines 1 --decode-engines 1` (the cores split between the
                  two workers, RILL_WORKER_THREADS each: by default half)

Colocated, a long prompt's chunks share steps with the decodes, so every stream's ITL jumps while
it is prefilled; disaggregated, the decode engine never runs a prompt, and the streams pay only for
the KV import of each long prompt (one step) and for sharing the CPU with the prefill engine.

    .venv/bin/python scripts/bench_disagg.py [MODEL] [--streams 8] [--stream-tokens 160] [--long 3]
                                             [--long-len 2048] [--budget 512] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _serve import engine_stats, serving  # noqa: E402

from rill.shared.broker import free_port  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402


@dataclass
class Timing:
    kind: str  # "stream" | "long"
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def one(client: httpx.AsyncClient, kind: str, prompt: list[int], max_tokens: int,
              progress: dict[str, int]) -> Timing:
    out = Timing(kind)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    out.error = str(msg["error"])[:200]
                    return out
                if any(c.get("text") for c in msg.get("choices") or []):
                    now = time.perf_counter()
                    if out.tokens == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.tokens += 1
                    progress["chunks"] += 1
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def workload(base_url: str, args: argparse.Namespace) -> tuple[list[Timing], float]:
    rng = random.Random(args.seed)
    streams = [[rng.randint(1000, 20000) for _ in range(32)] for _ in range(args.streams)]
    longs = [[rng.randint(1000, 20000) for _ in range(args.long_len)] for _ in range(args.long)]
    progress = {"chunks": 0}
    limits = httpx.Limits(max_connections=args.streams + args.long + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, "stream", p, args.stream_tokens, progress)) for p in streams]
        while progress["chunks"] < args.streams and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)  # every stream is decoding before the long prompts come
        for i, p in enumerate(longs):
            if i:
                await asyncio.sleep(args.long_every)
            tasks.append(asyncio.create_task(one(client, "long", p, args.long_tokens, progress)))
            print(f"    long prompt {i + 1}/{args.long} sent ({args.long_len} tokens)", flush=True)
        while not all(t.done() for t in tasks):
            await asyncio.sleep(2.0)
            print(f"    {progress['chunks']} chunks received, {sum(t.done() for t in tasks)}/{len(tasks)} "
                  f"requests done", flush=True)
        return [t.result() for t in tasks], time.perf_counter() - start


def run_mode(model_dir: str, args: argparse.Namespace, disaggregated: bool) -> dict[str, Any]:
    cores = args.cores or len(os.sched_getaffinity(0))
    threads = max(1, cores // 2) if disaggregated else cores
    port = free_port()
    argv = [sys.executable, "-m", "rill.services.cli", "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
            "--dtype", args.dtype, "--max-num-batched-tokens", str(args.budget),
            "--max-model-len", str(args.long_len + 512), "--kv-cache-memory", args.kv_cache_memory]
    if disaggregated:
        argv += ["--prefill-engines", "1", "--decode-engines", "1"]
    label = "disaggregated 1P+1D" if disaggregated else "colocated"
    print(f"[{label}] starting rill serve (worker threads: {threads}{' each' if disaggregated else ''}) ...",
          flush=True)
    env = dict(os.environ, RILL_WORKER_THREADS=str(threads))
    with serving(argv, port, env) as base:
        print(f"[{label}] ready; running the workload", flush=True)
        timings, duration = asyncio.run(workload(base, args))
        stats = engine_stats(base)
    failed = [t.error for t in timings if t.error]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed: {failed[:3]}")
    streams = [t for t in timings if t.kind == "stream"]
    longs = [t for t in timings if t.kind == "long"]
    itl = [g * 1e3 for t in streams for g in t.itl]
    row = {"label": label, "threads": threads, "duration": duration,
           "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99), "itl_max": max(itl, default=0.0),
           "stream_ttft_p50": percentile([t.ttft * 1e3 for t in streams], 0.5),
           "long_ttft_p50": percentile([t.ttft * 1e3 for t in longs], 0.5),
           "long_ttft_p99": percentile([t.ttft * 1e3 for t in longs], 0.99),
           "all_ttft_p50": percentile([t.ttft * 1e3 for t in timings], 0.5),
           "all_ttft_p99": percentile([t.ttft * 1e3 for t in timings], 0.99)}
    sent = sum(s.get("kv_transfers_sent", 0) for s in stats)
    if sent:
        row["transfers"] = sent
        row["mb_per_transfer"] = sum(s.get("kv_bytes_sent", 0) for s in stats) / sent / 1e6
        row["transfer_ms"] = sum(s.get("kv_transfer_seconds_sum", 0.0) for s in stats) / sent * 1e3
        received = sum(s.get("kv_transfers_received", 0) for s in stats) or 1
        row["import_ms"] = sum(s.get("kv_import_seconds_sum", 0.0) for s in stats) / received * 1e3
        row["export_ms"] = sum(s.get("kv_export_seconds_sum", 0.0) for s in stats) / sent * 1e3
        row["handoff_ms"] = sum(s.get("kv_handoff_seconds_sum", 0.0) for s in stats) / received * 1e3
    row["engines"] = {s.get("role", "both"): (s.get("prefill_tokens", 0), s.get("decode_tokens", 0)) for s in stats}
    print(f"[{label}] done in {duration:.1f} s", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--streams", type=int, default=8, help="decoding streams (short prompts)")
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=3, help="long prompts arriving while the streams decode")
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts")
    ap.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens (chunk size)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--cores", type=int, default=0, help="cores to split (default: every usable one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["colocated", "disaggregated"], default=None)
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    modes = [m for m in (False, True) if args.only is None or args.only == ("disaggregated" if m else "colocated")]
    rows = [run_mode(model_dir, args, m) for m in modes]
    print(f"\n{args.streams} streams x {args.stream_tokens} tokens; {args.long} prompts of {args.long_len} tokens "
          f"arriving every {args.long_every:g} s; chunk budget {args.budget}; dtype {args.dtype}")
    head = (f"{'mode':>20} | {'threads':>7} | {'ITL p50':>8} | {'ITL p99':>8} | {'ITL max':>8} | "
            f"{'TTFT p50':>8} | {'TTFT p99':>8} | {'long TTFT p50':>13} | {'long TTFT p99':>13} | {'wall s':>6}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['label']:>20} | {r['threads']:>7} | {r['itl_p50']:>8.1f} | {r['itl_p99']:>8.1f} | "
              f"{r['itl_max']:>8.1f} | {r['all_ttft_p50']:>8.1f} | {r['all_ttft_p99']:>8.1f} | "
              f"{r['long_ttft_p50']:>13.1f} | {r['long_ttft_p99']:>13.1f} | {r['duration']:>6.1f}")
    print("(milliseconds; ITL: gaps between the streams' chunks; TTFT: every request; long: the long prompts)")
    for r in rows:
        if "transfers" in r:
            print(f"{r['label']}: {r['transfers']} KV transfers, {r['mb_per_transfer']:.1f} MB each on average; "
                  f"first token -> request in the decode batch {r['handoff_ms']:.0f} ms (export "
                  f"{r['export_ms']:.0f} ms, import {r['import_ms']:.0f} ms); prefill blocks held until the "
                  f"ack {r['transfer_ms']:.0f} ms")
        print(f"{r['label']}: (prefill, decode) tokens per engine role: {r['engines']}")


if __name__ == "__main__":
    main()
