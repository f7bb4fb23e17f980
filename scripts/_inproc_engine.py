"""A scheduler driving a model runner in one process, timed: the engine without the broker.

Shared by the feature benchmarks (prefix caching, chunked prefill), which compare scheduling
settings on the same model and the same requests; broker cost is the same for both sides.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.services.scheduler.speculation import Speculator
from rill.services.worker.model_runner import ModelRunner
from rill.shared.config import QUANTIZATIONS, StepCost
from rill.shared.request_params import SamplingParams
from rill.shared.schema import TokenizedRequest


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    """--quantization for the Rill runs of a benchmark (`rill serve`'s flag; other systems keep their dtype)."""
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="Rill runs only: int8 = W8A8 linear layers (CPU)")


@dataclass
class Timeline:
    arrival: dict[str, float] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    step_tokens: list[int] = field(default_factory=list)

    def ttft(self, rid: str) -> float:
        return self.token_times[rid][0] - self.arrival[rid]

    def gaps(self, rid: str) -> list[float]:
        t = self.token_times[rid]
        return [b - a for a, b in zip(t, t[1:], strict=False)]


class Engine:
    def __init__(self, runner: ModelRunner, budget: int, caching: bool = True, max_seqs: int = 64,
                 speculator: Speculator | None = None, step_cost: StepCost | None = None) -> None:
        self.runner = runner
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                               max_model_len=runner.max_model_len, step_cost=step_cost),
                               KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching=caching,
                                              sliding_window=runner.model.sliding_window), speculator)
        self.timeline = Timeline()

    def submit(self, rid: str, ids: list[int], max_tokens: int, ignore_eos: bool = True) -> None:
        msg = TokenizedRequest(request_id=rid, reply_to="bench", prompt_token_ids=ids,
                               params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                               eos_token_ids=[] if ignore_eos else list(self.runner.cfg.eos_token_ids),
                               arrival_time=time.time())
        why = self.sched.check_admissible(msg)
        if why:
            raise ValueError(why.message)
        self.sched.add(msg)
        self.timeline.arrival[rid] = time.perf_counter()

    def step(self) -> bool:
        plan = self.sched.schedule()
        if plan is None:
            return False
        result = self.runner.execute(plan)
        if result.error:
            raise RuntimeError(result.error)
        now = time.perf_counter()
        self.timeline.step_tokens.append(sum(plan.num_scheduled_tokens))
        for rid, k in zip(result.request_ids, result.num_tokens or [1] * len(result.request_ids), strict=True):
            self.timeline.token_times.setdefault(rid, []).extend([now] * k)  # k > 1: accepted drafts
        self.sched.update(result)
        return True

    def drain(self) -> None:
        while self.step():
            pass


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]
