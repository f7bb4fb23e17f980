"""A CPU step's token budget when --max-num-batched-tokens is not given, measured on this machine.

A step carrying a chunk of a prompt holds every running stream for its whole length, so the budget
bounds their inter-token latency; a chunk too small leaves the GEMMs short of their speed and reads
long prompts slower. Where that balance lies depends on the CPU, the model, its dtype and the
threads (one core kind runs a step many times faster than another: scripts/benchmarks.md), so
the worker times one prompt step at each candidate size, smallest first, and keeps the smallest
size that reads prompts within KNEE of the fastest size whose step fits RILL_CPU_STEP_TARGET_MS
(the smallest candidate where none fits). The bound is a fresh prompt's step: a chunk late in a
long prompt also reads its prefix, and takes longer. The answer is kept in Rill's cache folder
per machine and model, so every later start agrees without measuring.

CUDA keeps 2048: a GPU runs such a step in milliseconds, and the warm-up that sizes its KV cache
needs the budget before any step could be timed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from rill.kernels import chooser
from rill.services.worker.model_runner import ModelRunner
from rill.services.worker.tensor_parallel import TPGroup
from rill.shared import envs
from rill.shared.config import EngineArgs
from rill.shared.model_files import cache_root

log = logging.getLogger("rill.worker")

CANDIDATES = (128, 256, 512, 1024, 2048)
KNEE = 0.95  # a size within 5 % of the best prompt throughput is as good: a larger one only adds latency
SATURATED = 1.03  # doubling the chunk gained less: larger sizes will not read prompts faster


def choose(times: dict[int, float], target_s: float) -> int:
    """The budget for measured prompt-step times {tokens: seconds}: the smallest size within KNEE
    of the best tokens per second among the sizes whose step fits `target_s`; the smallest size
    measured when none fits."""
    fitting = {n: t for n, t in times.items() if t <= target_s}
    if not fitting:
        return min(times)
    best = max(n / t for n, t in fitting.items())
    return min(n for n, t in fitting.items() if n / t >= KNEE * best)


def resolve(runner: ModelRunner, args: EngineArgs, tp: TPGroup | None = None) -> int:
    """The step budget this worker announces: the flag's, 0 on CUDA (the scheduler's default),
    else the measured one (cached; see the module docstring)."""
    if args.max_num_batched_tokens:
        return args.max_num_batched_tokens
    if runner.device != "cpu":
        return 0
    target_s = envs.RILL_CPU_STEP_TARGET_MS / 1e3
    path = cache_root() / "step-budget" / f"{_key(runner, args, tp, target_s)}.json"
    cached = _read(path)
    if tp is not None:  # the ranks step together: all of them measure unless each has the answer
        cached = tp.all_reduce_min(cached or 0) or None
    if cached is not None:
        log.info("step budget: %d tokens (measured at an earlier start: %s)", cached, path)
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    if tp is not None:  # not under the lock: a rank holding it would wait on peers waiting for it
        return _measure_and_keep(runner, path, target_s, tp)
    # Engines starting together on a fresh machine: one measures (without the others' steps
    # competing for the cores), the rest wait for its answer.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read(path)
        return cached if cached is not None else _measure_and_keep(runner, path, target_s, tp)


def _measure_and_keep(runner: ModelRunner, path: Path, target_s: float, tp: TPGroup | None) -> int:
    start = time.perf_counter()
    times = measure(runner, target_s, tp)
    budget = choose(times, target_s)
    if tp is not None:
        budget = tp.all_reduce_min(budget)
    if tp is None or tp.lead:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"budget": budget, "target_ms": target_s * 1e3,
                                   "step_ms": {n: round(t * 1e3, 2) for n, t in times.items()}}))
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    log.info("step budget: %d tokens; a prompt step took %s (target %.0f ms; measured in %.1f s)", budget,
             ", ".join(f"{n} -> {t * 1e3:.0f} ms" for n, t in times.items()), target_s * 1e3,
             time.perf_counter() - start)
    return budget


def measure(runner: ModelRunner, target_s: float, tp: TPGroup | None = None) -> dict[int, float]:
    """Seconds of one prompt step of each candidate size, smallest first, best of two after a
    first run that sets the size up; stops past `target_s`, once doubling stops paying, or at
    what the context and the KV cache hold."""
    limit = min(runner.max_model_len, runner.num_blocks * runner.block_size)
    times: dict[int, float] = {}
    for n in [c for c in CANDIDATES if c <= limit] or [limit]:
        runner.warmup(n)
        times[n] = min(_timed(runner, n) for _ in range(2))
        half = times.get(n // 2)
        go = times[n] <= target_s and (half is None or n / times[n] >= SATURATED * (n // 2) / half)
        if tp is not None:
            go = bool(tp.all_reduce_min(int(go)))
        if not go:
            break
    return times


def _timed(runner: ModelRunner, n: int) -> float:
    start = time.perf_counter()
    runner.warmup(n)
    return time.perf_counter() - start


def _key(runner: ModelRunner, args: EngineArgs, tp: TPGroup | None, target_s: float) -> str:
    """The machine (chooser.machine_key: CPU, flags, torch, threads, kernels) and what sets a
    step's cost: the model's config, dtype, quantization, block size, draft model, ranks."""
    config = Path(args.model_dir, "config.json")
    parts = [chooser.machine_key(), config.read_text() if config.is_file() else args.model_dir, runner.dtype,
             runner.quantization, str(runner.block_size), args.speculative_config, str(tp.size if tp else 1),
             f"{target_s:.4f}"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _read(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["budget"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
