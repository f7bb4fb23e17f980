"""Where one engine step's time goes: each kernel-level phase of the model (summed over layers),
the LM head, sampling, and the rest (the runner's Python: plan checks, metadata, bookkeeping).

Used by bench_compare.py (a decode step and a prompt step, printed after the in-process runs).
The phases are timed by wrapping the functions `llama.py` calls, so a wrapped step runs the same
kernels as an unwrapped one plus a clock read around each call (~1 µs each).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from _inproc_engine import Engine

from rill.kernels import ops
from rill.services.worker.model_runner import ModelRunner
from rill.shared.schema import StepPlan

OPS = ("rms_norm", "rope_and_write_kv", "paged_attention", "silu_and_mul")
LINEARS = ("qkv", "o", "gate_up", "down")


class _Timed:
    def __init__(self, fn: Callable[..., Any], name: str, acc: dict[str, float]) -> None:
        self.fn, self.name, self.acc = fn, name, acc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.acc[self.name] += time.perf_counter() - t
        return out

    def __getattr__(self, attr: str) -> Any:  # float_out and friends pass through
        return getattr(self.fn, attr)


@contextmanager
def timed(runner: ModelRunner, acc: dict[str, float]) -> Iterator[None]:
    """Time every phase of `runner`'s steps into `acc` (seconds) while inside."""
    model = runner.model
    saved_ops = {name: getattr(ops, name) for name in OPS}
    saved_layers = [{name: getattr(layer, name) for name in LINEARS} for layer in model.layers]
    saved = (model.logits, runner.sampler.sample_batch)
    try:
        for name in OPS:
            setattr(ops, name, _Timed(saved_ops[name], name.replace("paged_", ""), acc))
        for layer, orig in zip(model.layers, saved_layers, strict=True):
            for name in LINEARS:
                setattr(layer, name, _Timed(orig[name], f"gemm {name}", acc))
        model.logits = _Timed(saved[0], "lm_head", acc)
        runner.sampler.sample_batch = _Timed(saved[1], "sampling", acc)
        yield
    finally:
        for name, fn in saved_ops.items():
            setattr(ops, name, fn)
        for layer, orig in zip(model.layers, saved_layers, strict=True):
            for name, fn in orig.items():
                setattr(layer, name, fn)
        model.logits, runner.sampler.sample_batch = saved


def profile(runner: ModelRunner, prompts: list[list[int]], budget: int, steps: int = 3) -> dict[str, dict[str, float]]:
    """Mean ms per phase over `steps` prompt steps (the first steps, each a full budget of prompt
    tokens) and `steps` decode steps (every request decoding), with 'total' and 'other'."""
    runner.reset()
    engine = Engine(runner, budget=budget, caching=False, max_seqs=len(prompts))
    for i, ids in enumerate(prompts):
        engine.submit(f"p{i}", ids, 64 + steps)
    sums: dict[str, dict[str, float]] = {"prompt": defaultdict(float), "decode": defaultdict(float)}
    shapes: dict[str, str] = {}
    counts = {"prompt": 0, "decode": 0}
    while True:
        plan: StepPlan | None = engine.sched.schedule()
        if plan is None:
            break
        kind = "decode" if max(plan.num_scheduled_tokens, default=0) == 1 else "prompt"
        wanted = counts[kind] < steps and (kind == "decode" or sum(plan.num_scheduled_tokens) == budget)
        acc: dict[str, float] = defaultdict(float)
        if wanted:
            with timed(runner, acc):
                t = time.perf_counter()
                result = runner.execute(plan)
                acc["total"] = time.perf_counter() - t
            acc["other"] = acc["total"] - sum(v for k, v in acc.items() if k != "total")
            counts[kind] += 1
            shapes.setdefault(kind, f"{sum(plan.num_scheduled_tokens)} tokens, {len(plan.num_scheduled_tokens)} seqs")
            for k, v in acc.items():
                sums[kind][k] += v * 1e3 / steps
        else:
            result = runner.execute(plan)
        if result.error:
            raise RuntimeError(result.error)
        engine.sched.update(result)
        if all(c >= steps for c in counts.values()):
            break
    runner.reset()
    return {f"{kind} step (first: {shapes[kind]})": row for kind, row in sums.items() if kind in shapes}


def format_profile(profiles: dict[str, dict[str, float]]) -> str:
    lines = []
    for title, row in profiles.items():
        total = row["total"]
        lines.append(f"  {title}: {total:.1f} ms")
        for name, ms in sorted(((k, v) for k, v in row.items() if k != "total"), key=lambda kv: -kv[1]):
            lines.append(f"    {name:<18} {ms:>8.2f} ms  {ms / total:>6.1%}")
    return "\n".join(lines)
