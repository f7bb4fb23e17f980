#!/usr/bin/env python3
"""The scheduler's own time per step (schedule + update, no model, no broker) at 64/256/1024
running sequences in steady decode, with prefix caching on. Target: <= 1 ms per step at 256.

Each size runs twice, alternating: with Python's default garbage collector settings, and with the
heap settled as a service process settles it (`lifecycle.settle_heap`); the target reads the latter.

    .venv/bin/python scripts/bench_scheduler.py [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.shared.lifecycle import settle_heap
from rill.shared.request_params import SamplingParams
from rill.shared.schema import StepResult, TokenizedRequest

DEFAULT_GC = gc.get_threshold()  # Python's, before anything changes it


def measure(num_seqs: int, steps: int, block_size: int = 16, prompt_len: int = 128) -> tuple[float, float, float]:
    s = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs * 2),
                                  max_model_len=8192),
                  KVCacheManager(num_seqs * (prompt_len + steps + 64) // block_size + 16, block_size))
    for i in range(num_seqs):
        s.add(TokenizedRequest(request_id=f"r{i}", reply_to="g", prompt_token_ids=[i % 50 + 3] * prompt_len,
                               params=SamplingParams(temperature=0.0, max_tokens=steps + 100, ignore_eos=True),
                               eos_token_ids=[2], arrival_time=0.0))

    def step() -> float:
        t0 = time.perf_counter()
        plan = s.schedule()
        ids = plan.scheduled_request_ids
        t1 = time.perf_counter()
        result = StepResult(step_id=plan.step_id, request_ids=ids, token_ids=[5] * len(ids))
        t2 = time.perf_counter()
        s.update(result)
        return (t1 - t0) + (time.perf_counter() - t2)

    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in s.running) or s.waiting:
        step()  # get every sequence through its prompt: measure steady-state decode
    times = sorted(step() for _ in range(steps))
    assert len(s.running) == num_seqs
    return statistics.median(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3, statistics.mean(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for n in (64, 256, 1024):
        for gc_mode in ("default", "served"):
            print(f"measuring {n} running sequences, collector {gc_mode} ...", flush=True)
            if gc_mode == "default":
                gc.unfreeze()
                gc.set_threshold(*DEFAULT_GC)
            else:
                settle_heap()
            rows.append((n, gc_mode, *measure(n, args.steps)))
    print(f"\n{'running seqs':>12} | {'collector':>9} | {'p50 ms/step':>11} | {'p99 ms/step':>11} | {'mean ms/step':>12}")
    print("-" * 68)
    for n, gc_mode, p50, p99, mean in rows:
        print(f"{n:>12} | {gc_mode:>9} | {p50:>11.3f} | {p99:>11.3f} | {mean:>12.3f}")
    at256 = next(r for r in rows if r[:2] == (256, "served"))[2]
    print(f"\ntarget <= 1 ms/step at 256 running: {'met' if at256 <= 1.0 else 'NOT met'} ({at256:.3f} ms p50)")

if __name__ == "__main__":
    main()
