"""A CPU step's token budget when --max-num-batched-tokens is not given, measured on this machine.

A step carrying a chunk of a prompt holds every running stream for its whole length, so the budget
bounds their inter-token latency; a chunk too small leaves the GEMMs short of their speed and reads
long prompts slower. Where that balance lies depends on the CPU, the model, its dtype and the
threads (one core kind runs a step many times faster than another: scripts/benchmarks.md), so
the worker times one prompt step at each candidate size, smallest first, and keeps the smallest
size that reads prompts within KNEE of the fastest size whose step fits RILL_CPU_STEP_TARGET_MS
(the smallest candidate where none fits). That bounds a fresh prompt's step; a chunk deep in a
long prompt also reads its whole prefix, so the worker also times a budget-sized chunk after a
long context and announces the cost of its prompt steps (shared.config.StepCost): with it the
scheduler shortens such chunks to hold their steps within the target too. The answers are kept
in Rill's cache folder per machine and model, so every later start agrees without measuring.

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
from dataclasses import dataclass
from pathlib import Path

from rill.kernels import chooser
from rill.services.worker.model_runner import ModelRunner
from rill.services.worker.tensor_parallel import TPGroup
from rill.shared import envs
from rill.shared.config import EngineArgs, StepCost
from rill.shared.model_files import cache_root

log = logging.getLogger("rill.worker")

CANDIDATES = (128, 256, 512, 1024, 2048)
KNEE = 0.95  # a size within 5 % of the best prompt throughput is as good: a larger one only adds latency
SATURATED = 1.03  # doubling the chunk gained less: larger sizes will not read prompts faster
CONTEXT_PROBE = 4096  # the most context the chunk that measures its cost follows (8 budgets at most)


@dataclass(frozen=True)
class StepBudget:
    """What a worker announces: its step's token budget (0: the scheduler's default) and, where
    measured, the cost of its prompt steps (None: chunks keep the whole budget)."""

    tokens: int
    cost: StepCost | None = None


def choose(times: dict[int, float], target_s: float) -> int:
    """The budget for measured prompt-step times {tokens: seconds}: the smallest size within KNEE
    of the best tokens per second among the sizes whose step fits `target_s`; the smallest size
    measured when none fits."""
    fitting = {n: t for n, t in times.items() if t <= target_s}
    if not fitting:
        return min(times)
    best = max(n / t for n, t in fitting.items())
    return min(n for n, t in fitting.items() if n / t >= KNEE * best)


def resolve(runner: ModelRunner, args: EngineArgs, tp: TPGroup | None = None) -> StepBudget:
    """The step budget this worker announces: the flag's, the scheduler's default on CUDA, else
    the measured one (cached; see the module docstring)."""
    if args.max_num_batched_tokens:
        return StepBudget(args.max_num_batched_tokens)
    if runner.device != "cpu":
        return StepBudget(0)
    target_s = envs.RILL_CPU_STEP_TARGET_MS / 1e3
    path = cache_root() / "step-budget" / f"{_key(runner, args, tp, target_s)}.json"
    cached = _read(path)
    if tp is not None:  # the ranks step together: all of them measure unless each has the answer
        cached = cached if tp.all_reduce_min(cached.tokens if cached else 0) else None
    if cached is not None:
        log.info("step budget: %d tokens, %s (measured at an earlier start: %s)", cached.tokens, cached.cost, path)
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


def _measure_and_keep(runner: ModelRunner, path: Path, target_s: float, tp: TPGroup | None) -> StepBudget:
    log.info("step budget: measuring prompt steps on this machine (once per model: later starts reuse it) ...")
    start = time.perf_counter()
    times, budget, cost = measure_budget(runner, target_s, tp)
    if tp is None or tp.lead:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"budget": budget, "step_cost": cost.wire(),
                                   "step_ms": {n: round(t * 1e3, 2) for n, t in times.items()}}))
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    if tp is not None:  # every rank announces the lead's answer, and goes on once it is kept
        cost = tp.share(cost)
    log.info("step budget: %d tokens, %s; a prompt step took %s (target %.0f ms; measured in %.1f s)",
             budget, cost, ", ".join(f"{n} -> {t * 1e3:.0f} ms" for n, t in times.items()),
             target_s * 1e3, time.perf_counter() - start)
    return StepBudget(budget, cost)


def measure_budget(runner: ModelRunner, target_s: float,
                   tp: TPGroup | None = None) -> tuple[dict[int, float], int, StepCost]:
    """The prompt-step times measured ({tokens: seconds}), the budget they give and its steps' cost."""
    times = measure(runner, target_s, tp)
    budget = choose(times, target_s)
    if tp is not None:
        budget = tp.all_reduce_min(budget)
    return times, budget, StepCost(times[budget] / budget, context_cost(runner, budget), target_s)


def measure(runner: ModelRunner, target_s: float, tp: TPGroup | None = None) -> dict[int, float]:
    """Seconds of one prompt step of each candidate size, smallest first, best of two after a
    first run that sets the size up; stops past `target_s`, once doubling stops paying, or at
    what the context and the KV cache hold."""
    times: dict[int, float] = {}
    for n in [c for c in CANDIDATES if c <= runner.room] or [runner.room]:
        runner.warmup(n)
        times[n] = min(runner.warmup(n) for _ in range(2))
        half = times.get(n // 2)
        go = times[n] <= target_s and (half is None or n / times[n] >= SATURATED * (n // 2) / half)
        if tp is not None:
            go = bool(tp.all_reduce_min(int(go)))
        if not go:
            break
    return times


def context_cost(runner: ModelRunner, budget: int) -> float:
    """What a token of context adds to a prompt token's cost, relative to a fresh prompt's: a
    budget-sized chunk timed after up to CONTEXT_PROBE tokens of context against one at the
    start; 0 where the context holds too little to tell."""
    context = min(8 * budget, CONTEXT_PROBE, runner.room - budget)
    if context < 2 * budget:
        return 0.0
    fresh = min(runner.warmup(budget) for _ in range(2))
    deep = runner.warmup(budget, context)  # once: the prefill before it is most of the time
    return max(0.0, (deep / fresh - 1) / context)


def _key(runner: ModelRunner, args: EngineArgs, tp: TPGroup | None, target_s: float) -> str:
    """The machine (chooser.machine_key: CPU, flags, torch, threads, kernels) and what sets a
    step's cost: the model's config, dtype, quantization, block size, draft model, ranks."""
    config = Path(args.model_dir, "config.json")
    parts = [chooser.machine_key(), config.read_text() if config.is_file() else args.model_dir, runner.dtype,
             runner.quantization, str(runner.block_size), args.speculative_config, str(tp.size if tp else 1),
             f"{target_s:.4f}"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _read(path: Path) -> StepBudget | None:
    try:
        data = json.loads(path.read_text())
        return StepBudget(int(data["budget"]), StepCost.of([float(x) for x in data["step_cost"]]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
