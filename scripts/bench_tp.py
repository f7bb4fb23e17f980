#!/usr/bin/env python3
"""Tensor parallelism on this machine: TP=1 against TP=2 (gloo, CPU), same total threads, one run.

Each configuration runs the worker's own ModelRunner (the sampled tokens broadcast from rank 0
included) through the same step plans: BATCH greedy requests of PROMPT tokens prefilled in one
step, then DECODE decode steps. Reported per configuration: prefill ms, decode tok/s, the
all-reduces per decode step and their mean time (what TP adds on the critical path), the weight
memory each rank holds and its resident growth over the load. The greedy tokens of TP=2 must
equal TP=1's (printed when they do not).

    .venv/bin/python scripts/bench_tp.py [MODEL] [--threads 2] [--batch 8] [--prompt 64] [--decode 32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch


def plans(batch: int, prompt: int, decode: int, block_size: int, vocab: int) -> list:
    from rill.shared.request_params import SamplingParams
    from rill.shared.schema import NewRequestData, StepPlan

    per = -(-(prompt + decode + 1) // block_size)
    ids = [f"r{i}" for i in range(batch)]
    first = StepPlan(step_id=0, new_requests=[
        NewRequestData(request_id=rid, token_ids=[(31 * i + 7 * j + 1) % vocab for j in range(prompt)],
                       params=SamplingParams(temperature=0.0, max_tokens=decode + 1),
                       block_ids=list(range(i * per, (i + 1) * per))) for i, rid in enumerate(ids)],
        cached_request_ids=[], cached_new_block_ids=[], scheduled_request_ids=ids,
        num_scheduled_tokens=[prompt] * batch)
    steps = [StepPlan(step_id=s, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                      scheduled_request_ids=ids, num_scheduled_tokens=[1] * batch) for s in range(1, decode + 1)]
    return [first, *steps]


def run_one(args: argparse.Namespace, rank: int, size: int, address: str) -> dict | None:
    from rill.services.worker.memory import resident_bytes, weight_bytes
    from rill.services.worker.model_runner import ModelRunner
    from rill.services.worker.tensor_parallel import TPGroup
    from rill.shared.config import ModelConfig

    group = TPGroup.join(rank, size, address, "cpu") if size > 1 else None
    cfg = ModelConfig.from_dir(args.model)
    todo = plans(args.batch, args.prompt, args.decode, 16, cfg.vocab_size)
    rss = resident_bytes()
    runner = ModelRunner(args.model, dtype="float32", device="cpu", block_size=16,
                         num_blocks=args.batch * -(-(args.prompt + args.decode + 1) // 16),
                         max_model_len=args.prompt + args.decode + 1, tp=group)
    held, grown = weight_bytes(runner.model), resident_bytes() - rss
    runner.warmup()
    if group is not None:
        group.timing = True
    start = time.perf_counter()
    result = runner.execute(todo[0])
    prefill = time.perf_counter() - start
    tokens = [list(result.token_ids)]
    calls0 = group.allreduce_calls if group else 0
    reduce0 = group.allreduce_s if group else 0.0
    start = time.perf_counter()
    for plan in todo[1:]:
        tokens.append(list(runner.execute(plan).token_ids))
    decode = time.perf_counter() - start
    out = {"rank": rank, "weights_mib": held / 2**20, "resident_mib": grown / 2**20}
    if group is not None:
        calls = group.allreduce_calls - calls0
        out["allreduce_per_step"] = calls / args.decode
        out["allreduce_ms"] = (group.allreduce_s - reduce0) / max(calls, 1) * 1e3
    if rank == 0:
        out |= {"prefill_ms": prefill * 1e3, "decode_tok_s": args.batch * args.decode / decode, "tokens": tokens,
                "threads": torch.get_num_threads()}
    return out


def launch(args: argparse.Namespace, size: int) -> list[dict]:
    """`size` processes of this script, RILL_WORKER_THREADS = threads / size each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, RILL_WORKER_THREADS=str(max(1, args.threads // size)))
    argv = [sys.executable, __file__, args.model, "--batch", str(args.batch), "--prompt", str(args.prompt),
            "--decode", str(args.decode), "--threads", str(args.threads)]
    procs = [subprocess.Popen([*argv, "--rank", str(r), "--size", str(size), "--address", address], env=env,
                              stdout=subprocess.PIPE) for r in range(size)]
    return [json.loads(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from rill.shared.model_files import resolve_model

        args.model = str(resolve_model())
    if args.rank is not None:  # one rank of a launched configuration
        print(json.dumps(run_one(args, args.rank, args.size, args.address)), flush=True)
        return
    from rill.kernels.chooser import cpu_model

    print(f"{cpu_model()}, {args.threads} threads in all; batch {args.batch}, prompt {args.prompt}, "
          f"{args.decode} decode steps, float32")
    runs = {size: launch(args, size) for size in (1, 2)}
    print("| TP | threads/rank | prefill ms | decode tok/s | all-reduces/step | ms/all-reduce | weights MiB per rank "
          "| resident +MiB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for size, ranks in runs.items():
        lead = ranks[0]
        reduce = (f"{lead['allreduce_per_step']:.0f} | {lead['allreduce_ms']:.3f}" if size > 1 else "0 | -")
        weights = " / ".join(f"{r['weights_mib']:.0f}" for r in ranks)
        grown = " / ".join(f"{r['resident_mib']:.0f}" for r in ranks)
        print(f"| {size} | {lead['threads']} | {lead['prefill_ms']:.0f} | {lead['decode_tok_s']:.1f} | {reduce} | "
              f"{weights} | {grown} |")
    if runs[1][0]["tokens"] != runs[2][0]["tokens"]:
        print("greedy tokens differ between TP=1 and TP=2 (check for near-ties)")


if __name__ == "__main__":
    main()
